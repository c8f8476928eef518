"""API tokens, grants and the access check: who may read or write which scopes.

A token maps to one tenant and a list of grants (``read``/``write`` on a scope prefix; write
implies read). Only the token's SHA-256 is stored. With no token, a :class:`Memory` is the
trusted local owner of its tenant (embedded use) and every check passes.

Every refusal is an :class:`~torpor.errors.AccessDenied` *and* an audit-log entry, written
before the error is raised, so an ungranted access can never pass as an empty result.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from torpor.config import check_name
from torpor.errors import AccessDenied, InvalidArgument
from torpor.memory import _validate as check
from torpor.memory.backends.base import MemoryBackend
from torpor.memory.models import (
    AuditEntry,
    Grant,
    TokenInfo,
    canonical_path,
    from_us,
    now_us,
    path_within,
)

log = logging.getLogger(__name__)

__all__ = ["Access", "TokenManager", "hash_token"]

_PREFIX = "tpr_"


def hash_token(token: str) -> str:
    """The stored form of a token (one holding a lone surrogate hashes too: it is unknown)."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def _grants(grants: Iterable[Grant | tuple[str, str]]) -> list[Grant]:
    out = []
    for g in grants:
        if isinstance(g, Grant):  # a model (the server's request) is checked the same way
            g = (g.mode, g.prefix)
        if isinstance(g, tuple) and len(g) == 2:
            mode, prefix = g
            # validate the prefix as a scope path, in its one spelling, so a typo cannot grant
            # too much (or nothing: "app//u-42" would match no scope)
            if not isinstance(prefix, str):
                raise InvalidArgument(f"a grant's prefix is a scope path, not {prefix!r}")
            out.append(Grant(mode=mode, prefix=canonical_path(prefix.strip("/"))))  # type: ignore[arg-type]
        else:
            raise InvalidArgument(f"a grant is ('read'|'write', 'scope/prefix'), not {g!r}")
    return out


def _selector(labels: Mapping[str, str] | None) -> dict[str, str] | None:
    """A sandbox label selector, checked (``None``: no sandbox rights)."""
    if labels is None:
        return None
    if not isinstance(labels, Mapping):
        raise InvalidArgument(f"sandbox rights are a label mapping, not {labels!r}")
    out = {}
    for k, v in labels.items():
        if not isinstance(k, str) or not isinstance(v, str) or not k or len(k) > 63 or len(v) > 255:
            raise InvalidArgument(f"a sandbox label selector needs short strings, not {k!r}={v!r}")
        if not (check.storable(k) and check.storable(v)):  # no store keeps it, no label carries it
            raise InvalidArgument(
                f"a sandbox label selector needs text without NUL or lone surrogates, "
                f"not {k!r}={v!r}"
            )
        out[k] = v
    return out


class TokenManager:
    """Issue, look up, list and revoke API tokens (``mem.tokens``; the server's one identity).

    A token is shown once, at :meth:`issue`; afterwards only its hash is stored and its public
    id (:attr:`TokenInfo.id`, the start of the hash) names it.
    """

    def __init__(self, backend: MemoryBackend) -> None:
        self._backend = backend

    def issue(
        self,
        tenant: str,
        grants: Iterable[Grant | tuple[str, str]],
        *,
        name: str = "",
        sandboxes: Mapping[str, str] | None = None,
        admin: bool = False,
        expires_at: datetime | None = None,
        actor: str = "admin",
    ) -> str:
        """A new token for ``tenant``; returns the secret (shown once).

        ``grants``: memory rights; ``sandboxes``: sandbox rights as a label selector (None:
        none, ``{}``: every sandbox of the tenant); ``admin``: may manage the tenant's tokens;
        ``expires_at``: refused from then on. Raises :class:`InvalidArgument` /
        :class:`InvalidName`.
        """
        check_name(tenant, "tenant name")
        if not isinstance(name, str) or len(name) > 200 or not check.storable(name):
            raise InvalidArgument(
                "a token name is a string of at most 200 characters, without NUL or lone surrogates"
            )
        if expires_at is not None and expires_at.tzinfo is None:
            raise InvalidArgument("expires_at must be timezone-aware")
        token = _PREFIX + secrets.token_urlsafe(24)
        info = TokenInfo(
            token_hash=hash_token(token),
            tenant=tenant,
            grants=_grants(grants),
            name=name,
            created_at=from_us(now_us()),
            sandboxes=_selector(sandboxes),
            admin=bool(admin),
            expires_at=expires_at,
        )
        self._backend.put_token(info)
        self._backend.append_audit(
            AuditEntry(
                at=info.created_at,
                tenant=tenant,
                actor=actor,
                action="token.issue",
                detail={"name": name, "id": info.id},
            )
        )
        return token

    def lookup(self, token: str) -> TokenInfo | None:
        """The live (not revoked, not expired) token record, or None."""
        info = self._backend.get_token(hash_token(token))
        return None if info is None or not info.live(from_us(now_us())) else info

    def list(self, tenant: str) -> list[TokenInfo]:
        """Every token of ``tenant`` (revoked and expired ones too), oldest first."""
        return self._backend.list_tokens(check_name(tenant, "tenant name"))

    def find(self, tenant: str, token_id: str) -> TokenInfo | None:
        """The token of ``tenant`` whose id is ``token_id`` (or a unique longer prefix of its
        hash), or None."""
        if not isinstance(token_id, str) or len(token_id) < 8:
            return None
        found = [t for t in self.list(tenant) if t.token_hash.startswith(token_id)]
        return found[0] if len(found) == 1 else None

    def revoke(self, token: str) -> bool:
        """Revoke ``token`` (the secret); False if unknown."""
        return self._backend.revoke_token(hash_token(token))

    def revoke_id(self, tenant: str, token_id: str, *, actor: str = "admin") -> bool:
        """Revoke the token of ``tenant`` named by its id; False if there is none."""
        info = self.find(tenant, token_id)
        if info is None:
            return False
        self._backend.revoke_token(info.token_hash)
        self._backend.append_audit(
            AuditEntry(
                at=from_us(now_us()),
                tenant=tenant,
                actor=actor,
                action="token.revoke",
                detail={"id": info.id, "name": info.name},
            )
        )
        return True

    def adopt(self, token: str, tenant: str, *, name: str) -> bool:
        """Store a token that already exists elsewhere (a legacy token file) as a full-rights
        admin token of ``tenant``: every memory scope, every sandbox. Returns False, leaving
        it as it is, when the store knows it already (a revoked token stays revoked)."""
        check_name(tenant, "tenant name")
        token_hash = hash_token(token)
        if self._backend.get_token(token_hash) is not None:
            return False
        self._backend.put_token(
            TokenInfo(
                token_hash=token_hash,
                tenant=tenant,
                grants=[Grant(mode="write", prefix="")],
                name=name,
                created_at=from_us(now_us()),
                sandboxes={},
                admin=True,
            )
        )
        return True


@dataclass
class Access:
    """The caller's rights inside one tenant: ``grants`` None means full (local owner)."""

    backend: MemoryBackend
    tenant: str
    actor: str
    grants: Sequence[Grant] | None = None

    def allows(self, mode: str, path: str) -> bool:
        """True when some grant covers ``path`` for ``mode`` (write implies read)."""
        if self.grants is None:
            return True
        return any(
            path_within(path, g.prefix) and (mode == "read" or g.mode == "write")
            for g in self.grants
        )

    def deny(
        self, action: str, scope: str, message: str, *, tenant: str | None = None
    ) -> AccessDenied:
        """Write the audit entry for a refusal and return the error to raise."""
        self.backend.append_audit(
            AuditEntry(
                at=from_us(now_us()),
                tenant=tenant or self.tenant,
                actor=self.actor,
                action=action,
                scope=scope,
                allowed=False,
                detail={"token_tenant": self.tenant},
            )
        )
        log.warning(
            "access denied: %s %s on %s:%s", self.actor, action, tenant or self.tenant, scope
        )
        return AccessDenied(message, tenant=tenant or self.tenant, scope=scope)

    def require(self, mode: str, path: str, action: str) -> None:
        """Raise :class:`AccessDenied` (audited) unless ``mode`` on ``path`` is granted."""
        if not self.allows(mode, path):
            raise self.deny(
                action,
                path,
                f"{action}: no {mode} grant on {path or '/'!r} in tenant {self.tenant!r}",
            )

    def require_tenant(self, tenant: str, action: str) -> None:
        """Raise :class:`AccessDenied` (audited) when ``tenant`` is not the caller's."""
        if tenant != self.tenant:
            raise self.deny(
                action,
                "",
                f"{action}: tenant {tenant!r} is outside this token's tenant",
                tenant=tenant,
            )

    def readable(self, paths: Sequence[str]) -> list[str]:
        """The subset of ``paths`` the caller may read (ancestors without a grant are left
        out of what a scope sees, silently: they were never the caller's)."""
        return [p for p in paths if self.allows("read", p)]

    def audit(self, action: str, scope: str, **detail: object) -> None:
        """Record an allowed administrative action (forget, import, fork)."""
        self.backend.append_audit(
            AuditEntry(
                at=from_us(now_us()),
                tenant=self.tenant,
                actor=self.actor,
                action=action,
                scope=scope,
                detail=dict(detail),
            )
        )
