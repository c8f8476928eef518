"""``rt.tokens``: create, list and revoke the server's tokens (one identity for both layers).

::

    rt = torpor.Runtime()                      # the local socket: the home's owner
    new = rt.tokens.create(tenant="acme", grants=[("write", "app/support/user/u-42")],
                           sandboxes={"user": "u-42"}, name="agent u-42")
    new.token                                  # the secret, shown this once
    rt.tokens.list(tenant="acme")              # [TokenSummary]
    rt.tokens.revoke(new.info.id, tenant="acme")

Only an admin may call these: the local owner (any tenant), or a token created with
``admin=True`` (its own tenant). See :mod:`torpor.server.routes_tokens`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeVar

import httpx
from pydantic import ValidationError

from torpor.client.calls import Call
from torpor.client.sandbox_calls import at
from torpor.errors import InvalidArgument
from torpor.memory.models import Grant, NewToken, TokenSpec, TokenSummary
from torpor.sandbox.requests import invalid_argument

__all__ = ["Connection", "Tokens", "parse_grant"]

T = TypeVar("T")


class Connection(Protocol):
    """What the SDK's area clients use of a :class:`~torpor.client.Runtime` (a protocol, so
    they need not import it: the runtime makes them)."""

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response: ...

    def json(self, method: str, path: str, **kwargs: Any) -> Any: ...

    def do(self, call: Call[T]) -> T: ...

    def stream_lines(
        self, method: str, path: str, **kwargs: Any
    ) -> AbstractContextManager[Iterator[str]]: ...

    def health(self) -> dict[str, Any]: ...


def parse_grant(grant: Grant | tuple[str, str] | str) -> Grant:
    """A :class:`Grant` from a Grant, ``("read", "app/a")`` or ``"read:app/a"``.
    Raises :class:`InvalidArgument`."""
    if isinstance(grant, Grant):
        return grant
    if isinstance(grant, str):
        mode, sep, prefix = grant.partition(":")
        if not sep:
            raise InvalidArgument(f"a grant is 'read:PREFIX' or 'write:PREFIX', not {grant!r}")
        grant = (mode, prefix)
    if not (
        isinstance(grant, tuple) and len(grant) == 2 and all(isinstance(g, str) for g in grant)
    ):
        raise InvalidArgument(f"a grant is ('read'|'write', 'scope/prefix'), not {grant!r}")
    return Grant.model_validate({"mode": grant[0], "prefix": grant[1].strip("/")})


class Tokens:
    """The token routes of one :class:`~torpor.client.runtime.Runtime`."""

    def __init__(self, runtime: Connection) -> None:
        self._rt = runtime

    def create(
        self,
        *,
        tenant: str | None = None,
        grants: Iterable[Grant | tuple[str, str] | str] = (),
        sandboxes: Mapping[str, str] | None = None,
        admin: bool = False,
        name: str = "",
        expires_in_seconds: float | None = None,
    ) -> NewToken:
        """A new token (see :class:`~torpor.memory.models.TokenInfo` for the rights).
        Raises :class:`InvalidArgument`, :class:`AccessDenied` (not an admin)."""
        if sandboxes is not None and not isinstance(sandboxes, Mapping):
            raise InvalidArgument(f"sandboxes is a mapping of labels, not {sandboxes!r}")
        try:
            spec = TokenSpec(
                tenant=tenant,
                name=name,
                grants=[parse_grant(g) for g in grants],
                sandboxes=None if sandboxes is None else dict(sandboxes),
                admin=admin,
                expires_in_seconds=expires_in_seconds,
            )
        except ValidationError as exc:
            raise invalid_argument(exc.errors(), "invalid token") from None
        body = spec.model_dump(mode="json")
        return NewToken.model_validate(self._rt.json("POST", "/v1/tokens", json=body))

    def list(self, *, tenant: str | None = None) -> list[TokenSummary]:
        """The tenant's tokens (default: the caller's), oldest first."""
        params: dict[str, Any] = {} if tenant is None else {"tenant": tenant}
        rows = self._rt.json("GET", "/v1/tokens", params=params)
        return [TokenSummary.model_validate(r) for r in rows]

    def revoke(self, token_id: str, *, tenant: str | None = None) -> None:
        """Revoke a token by id; effective on the server's next request. Raises
        :class:`NotFound` for an unknown id, :class:`InvalidArgument` for one that names no
        path segment (``""``, ``.``, ``..``)."""
        params: dict[str, Any] = {} if tenant is None else {"tenant": tenant}
        self._rt.request("DELETE", at("/v1/tokens", token_id), params=params)
