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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torpor.config import check_name
from torpor.errors import AccessDenied, InvalidArgument
from torpor.memory.backends.base import MemoryBackend
from torpor.memory.models import AuditEntry, Grant, Scope, TokenInfo, from_us, now_us, path_within

log = logging.getLogger(__name__)

__all__ = ["Access", "TokenManager", "hash_token"]

_PREFIX = "tpr_"


def hash_token(token: str) -> str:
    """The stored form of a token."""
    return hashlib.sha256(token.encode()).hexdigest()


def _grants(grants: Iterable[Grant | tuple[str, str]]) -> list[Grant]:
    out = []
    for g in grants:
        if isinstance(g, Grant):
            out.append(g)
        elif isinstance(g, tuple) and len(g) == 2:
            mode, prefix = g
            # validate the prefix as a scope path so a typo cannot grant too much
            Scope.from_path(prefix)
            out.append(Grant(mode=mode, prefix=prefix.strip("/")))  # type: ignore[arg-type]
        else:
            raise InvalidArgument(f"a grant is ('read'|'write', 'scope/prefix'), not {g!r}")
    return out


class TokenManager:
    """Issue, look up and revoke API tokens (``mem.tokens``)."""

    def __init__(self, backend: MemoryBackend) -> None:
        self._backend = backend

    def issue(
        self, tenant: str, grants: Iterable[Grant | tuple[str, str]], *, name: str = ""
    ) -> str:
        """A new token for ``tenant`` with ``grants``; returns the secret (shown once).
        Raises :class:`InvalidArgument` / :class:`InvalidName`."""
        check_name(tenant, "tenant name")
        token = _PREFIX + secrets.token_urlsafe(24)
        info = TokenInfo(
            token_hash=hash_token(token),
            tenant=tenant,
            grants=_grants(grants),
            name=name,
            created_at=from_us(now_us()),
        )
        self._backend.put_token(info)
        self._backend.append_audit(
            AuditEntry(
                at=info.created_at,
                tenant=tenant,
                actor="admin",
                action="token.issue",
                detail={"name": name},
            )
        )
        return token

    def lookup(self, token: str) -> TokenInfo | None:
        """The live (not revoked) token record, or None."""
        info = self._backend.get_token(hash_token(token))
        return None if info is None or info.revoked else info

    def revoke(self, token: str) -> bool:
        """Revoke ``token``; False if unknown."""
        return self._backend.revoke_token(hash_token(token))


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
