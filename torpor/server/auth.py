"""Who is calling: bearer tokens that map to tenants.

The unix socket is protected by its file permissions (0600, the owner only), so a request that
arrives there belongs to the local tenant ``"default"`` and needs no token. A server that listens
on TCP must be given a token file; every request then carries ``Authorization: Bearer <token>``
and acts for the tenant that token maps to — it can neither see nor touch another tenant's
sandboxes (the manager scopes every call by tenant).

The token file is JSON, a mapping of token to tenant::

    {"tokens": {"3f9c...e1": "acme", "77ab...02": "globex"}}

A token is compared in constant time; a tenant name follows :data:`torpor.config.NAME_RE`.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
from collections.abc import Mapping
from pathlib import Path

from torpor.config import check_name
from torpor.errors import AccessDenied, InvalidArgument, StorageError

__all__ = ["LOCAL_TENANT", "TokenStore", "add_token", "new_token"]

log = logging.getLogger(__name__)

#: The tenant of every request made over the local unix socket.
LOCAL_TENANT = "default"


def new_token() -> str:
    """A fresh random token (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


def add_token(path: str | os.PathLike[str], tenant: str) -> str:
    """Add a fresh token for ``tenant`` to the token file at ``path`` (created 0600 if
    missing) and return it. A running server reads the file at start: restart it.

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
    """Maps bearer tokens to tenants.

    ``TokenStore(None)`` is the local mode: no token is asked for and every caller is
    :data:`LOCAL_TENANT`.
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

    def tenant_for(self, authorization: str | None) -> str:
        """The tenant an ``Authorization`` header value acts for.

        Raises :class:`AccessDenied` for a missing, malformed or unknown token.
        """
        if self._tokens is None:
            return LOCAL_TENANT
        if not authorization:
            raise AccessDenied("this server requires a bearer token")
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise AccessDenied("use 'Authorization: Bearer <token>'")
        # Compare against every token so the time taken says nothing about which one matched.
        found: str | None = None
        for known, tenant in self._tokens.items():
            if hmac.compare_digest(known.encode(), token.encode()):
                found = tenant
        if found is None:
            raise AccessDenied("unknown token")
        return found
