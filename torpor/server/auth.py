"""Who is calling: one identity for both layers.

A request is made by a :class:`Caller`: a tenant, an actor (who, for the audit log), memory
grants (read/write on scope prefixes) and sandbox rights (a label selector). Two kinds of
caller exist:

* **The local owner.** The unix socket is protected by its file permissions (0600, the home's
  owner only), so a request that arrives there without a token is the trusted owner of the
  tenant ``"default"``: every scope, every sandbox, may manage tokens. A server that only
  listens on its socket (the default) treats every tokenless request so.
* **A token.** Every other request carries ``Authorization: Bearer <token>``. Tokens live in
  the memory store's token table (:class:`~torpor.memory.access.TokenManager`: only the
  SHA-256 is stored; SQLite or PostgreSQL, whichever backs the server's memory), each scoped to
  one tenant with grants, created, listed and revoked through ``/v1/tokens`` or
  ``torpor token ...``. Every request looks its token up, so a revoke is effective on the next
  request, without a restart.

Every refusal is an :class:`~torpor.errors.AccessDenied` (or a ``NotFound`` where saying more
would leak) *and* an entry in the audit log (:meth:`Identity.deny`), written before the error
is raised.

The token file of earlier versions (JSON, ``{"tokens": {TOKEN: TENANT}}``, read at start) is
deprecated: :meth:`Identity.adopt_file` imports it at start, hashed, each token becoming a
full-rights admin token of its tenant; a token revoked since stays revoked. New tokens go to
the store only (``torpor token create``).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from torpor.config import check_name
from torpor.errors import AccessDenied, InvalidArgument, StorageError, Unauthenticated
from torpor.memory.access import Access, TokenManager, hash_token
from torpor.memory.backends.base import MemoryBackend
from torpor.memory.models import AuditEntry, Grant, from_us, now_us

__all__ = [
    "LOCAL_TENANT",
    "Caller",
    "Identity",
    "TokenStore",
    "add_token",
    "labels_match",
    "new_token",
]

log = logging.getLogger(__name__)

#: The tenant of every tokenless request made over the local unix socket.
LOCAL_TENANT = "default"


def labels_match(labels: Mapping[str, str], selector: Mapping[str, str]) -> bool:
    """True when ``labels`` carry every ``key=value`` of ``selector``."""
    return all(labels.get(k) == v for k, v in selector.items())


@dataclass(frozen=True)
class Caller:
    """Who a request acts for, and what it may touch.

    ``grants``: memory rights (None: every scope of the tenant). ``sandboxes``: sandbox rights
    as a label selector (None: no sandbox at all; ``{}``: every sandbox of the tenant;
    ``{"user": "u-42"}``: only sandboxes carrying those labels). ``admin``: may manage the
    tenant's tokens. ``token_id``: the public id of the token used (None for the local owner);
    ``expires_at``: when that token stops being honoured (None: never).
    """

    tenant: str
    actor: str
    grants: tuple[Grant, ...] | None = None
    sandboxes: dict[str, str] | None = field(default_factory=dict)
    admin: bool = True
    token_id: str | None = None
    expires_at: datetime | None = None

    @property
    def is_owner(self) -> bool:
        """The trusted local owner (no token)."""
        return self.token_id is None

    @property
    def restricted(self) -> bool:
        """True when the caller sees only some of the tenant's sandboxes (or none)."""
        return self.sandboxes is None or bool(self.sandboxes)

    def sees(self, labels: Mapping[str, str]) -> bool:
        """True when a sandbox with ``labels`` is within this caller's sandbox rights."""
        return self.sandboxes is not None and labels_match(labels, self.sandboxes)

    def access(self, backend: MemoryBackend) -> Access:
        """The memory-layer access check for this caller."""
        return Access(
            backend, self.tenant, self.actor, None if self.grants is None else list(self.grants)
        )


def owner(tenant: str = LOCAL_TENANT) -> Caller:
    """The trusted local owner of ``tenant``."""
    return Caller(tenant=tenant, actor="local")


class Identity:
    """Resolves requests to :class:`Caller` s and audits refusals, over a memory backend's
    token table and audit log.

    ``require_token``: tokenless requests that did not come over the unix socket are refused
    (a TCP server); otherwise every tokenless request is the local owner.
    """

    def __init__(self, backend: MemoryBackend, *, require_token: bool = False) -> None:
        self.backend = backend
        self.tokens = TokenManager(backend)
        self.require_token = require_token

    def caller(self, authorization: str | None, *, trusted: bool) -> Caller:
        """The caller an ``Authorization`` header value (or its absence) stands for.

        ``trusted``: the request came over the unix socket. A token, when given, is always
        honoured (even on the socket: it narrows what the request may do). Raises
        :class:`AccessDenied` (audited) for a missing, malformed, unknown, revoked or expired
        token.
        """
        if not authorization:
            if trusted or not self.require_token:
                return owner()
            raise self.deny(
                None, "connect", "", "this server requires a bearer token", error=Unauthenticated
            )
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise self.deny(
                None, "connect", "", "use 'Authorization: Bearer <token>'", error=Unauthenticated
            )
        info = self.tokens.lookup(token)
        if info is None:
            raise self.deny(
                None,
                "connect",
                "",
                "unknown, revoked or expired token",
                actor=f"token:{hash_token(token)[:16]}",
                error=Unauthenticated,
            )
        return Caller(
            tenant=info.tenant,
            actor=f"token:{info.id}",
            grants=tuple(info.grants),
            sandboxes=None if info.sandboxes is None else dict(info.sandboxes),
            admin=info.admin,
            token_id=info.id,
            expires_at=info.expires_at,
        )

    def deny(
        self,
        caller: Caller | None,
        action: str,
        target: str,
        message: str,
        *,
        actor: str | None = None,
        error: type[AccessDenied] | None = None,
    ) -> AccessDenied:
        """Write the audit entry of a refusal and return the :class:`AccessDenied` to raise."""
        tenant = caller.tenant if caller is not None else ""
        who = actor or (caller.actor if caller is not None else "anonymous")
        self.backend.append_audit(
            AuditEntry(
                at=from_us(now_us()),
                tenant=tenant,
                actor=who,
                action=action,
                scope=target,
                allowed=False,
                detail={"reason": message},
            )
        )
        log.warning("access denied: %s %s %s: %s", who, action, target, message)
        return (error or AccessDenied)(message, tenant=tenant, scope=target)

    def audit(self, caller: Caller, action: str, target: str, **detail: object) -> None:
        """Record a refusal that is answered as NotFound (so nothing leaks) or an allowed
        administrative action."""
        self.backend.append_audit(
            AuditEntry(
                at=from_us(now_us()),
                tenant=caller.tenant,
                actor=caller.actor,
                action=action,
                scope=target,
                allowed=bool(detail.pop("allowed", True)),
                detail=dict(detail),
            )
        )

    def adopt(self, legacy: TokenStore) -> int:
        """Import the tokens of a legacy :class:`TokenStore` (hashed, full rights, admin).
        Returns how many were new."""
        n = sum(
            self.tokens.adopt(token, tenant, name="imported from a token file")
            for token, tenant in legacy.tenants().items()
        )
        if n:
            log.warning(
                "imported %d token(s) from a token file into the token store; token files are "
                "deprecated: manage tokens with 'torpor token create/ls/revoke'",
                n,
            )
        return n

    def adopt_file(self, path: str | os.PathLike[str]) -> int:
        """:meth:`adopt` the token file at ``path``. Raises like :meth:`TokenStore.load`."""
        return self.adopt(TokenStore.load(path))


# -- the deprecated token file ---------------------------------------------------------------


def new_token() -> str:
    """A fresh random token (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


def add_token(path: str | os.PathLike[str], tenant: str) -> str:
    """Deprecated (use ``torpor token create``): add a fresh token for ``tenant`` to the token
    file at ``path`` (created 0600 if missing) and return it. A server imports the file at
    start: restart it.

    Raises :class:`InvalidName` for a bad tenant, :class:`InvalidArgument` for a file that is
    not a token file, :class:`StorageError` when it cannot be written.
    """
    check_name(tenant, "tenant")
    file = Path(path)
    tokens: dict[str, str] = {}
    if file.exists():
        tokens = TokenStore.load(file).tenants()
    token = new_token()
    tokens[token] = tenant
    tmp = file.with_name(file.name + ".tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump({"tokens": tokens}, out, indent=2)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, file)
    except OSError as exc:
        raise StorageError(
            f"cannot write token file {file}: {exc}", exc=exc, path=str(file)
        ) from exc
    return token


class TokenStore:
    """Deprecated: the token -> tenant map of a token file (see the module docstring), kept
    to import it into the token store (:meth:`Identity.adopt`).

    ``TokenStore(None)`` is the local mode: no token is asked for.
    """

    def __init__(self, tokens: Mapping[str, str] | None = None) -> None:
        self._tokens: dict[str, str] | None = None
        if tokens is not None:
            self._tokens = {}
            for token, tenant in tokens.items():
                if not isinstance(token, str) or len(token) < 16:
                    raise InvalidArgument("a token must be a string of at least 16 characters")
                self._tokens[token] = check_name(tenant, "tenant")

    def tenants(self) -> dict[str, str]:
        """A copy of the token -> tenant map (empty when no token is required)."""
        return dict(self._tokens or {})

    @property
    def required(self) -> bool:
        """True when requests must carry a bearer token."""
        return self._tokens is not None

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> TokenStore:
        """Read a token file (see the module docstring).

        Raises :class:`StorageError` when it cannot be read and :class:`InvalidArgument` when
        its content has the wrong shape.
        """
        file = Path(path)
        try:
            raw = json.loads(file.read_text())
        except OSError as exc:
            raise StorageError(
                f"cannot read token file {file}: {exc}", exc=exc, path=str(file)
            ) from exc
        except ValueError as exc:
            raise InvalidArgument(f"token file {file} is not JSON: {exc}", path=str(file)) from exc
        tokens = raw.get("tokens") if isinstance(raw, dict) else None
        if not isinstance(tokens, dict) or not tokens:
            raise InvalidArgument(
                f'token file {file} needs {{"tokens": {{TOKEN: TENANT}}}}', path=str(file)
            )
        if file.stat().st_mode & 0o077:
            log.warning("token file %s is readable by other users", file)
        return cls({str(k): str(v) for k, v in tokens.items()})
