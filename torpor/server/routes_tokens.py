"""Token routes: the one identity's tokens, created, listed and revoked live.

::

    POST   /v1/tokens          create  TokenSpec -> NewToken (201; the secret is shown once)
    GET    /v1/tokens          list    -> [TokenSummary] (the caller's tenant)
    DELETE /v1/tokens/{id}     revoke  -> 204 (effective on the next request)

Only an admin may manage tokens: the home's owner (the local socket), who may do so for any
tenant (``?tenant=`` / ``TokenSpec.tenant``: this is how a tenant's first token is made), or a
token created with ``admin``, within its own tenant; a token makes tokens that hold no more
than it does (grants, sandbox rights, expiry), and lists and revokes only such tokens. Every
refusal is audited.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Annotated

from fastapi import APIRouter, Query, Response

from torpor.errors import AccessDenied, InvalidArgument, NotFound
from torpor.memory.models import Grant, NewToken, TokenSpec, TokenSummary, from_us, now_us
from torpor.server.auth import Caller, Identity, labels_match
from torpor.server.deps import CallerDep, IdentityDep

__all__ = ["router"]

router = APIRouter(prefix="/v1/tokens", tags=["tokens"])


def _tenant(caller: Caller, identity: Identity, tenant: str | None, action: str) -> str:
    """The tenant an admin request acts on. Raises :class:`AccessDenied` (audited)."""
    if not caller.admin:
        raise identity.deny(caller, action, "", "managing tokens needs an admin token")
    if tenant is None or tenant == caller.tenant:
        return caller.tenant
    if not caller.is_owner:
        raise identity.deny(caller, action, "", f"tenant {tenant!r} is outside this token's tenant")
    return tenant


def _beyond(
    caller: Caller,
    identity: Identity,
    grants: list[Grant],
    sandboxes: dict[str, str] | None,
) -> str | None:
    """What a token of ``grants`` and ``sandboxes`` holds that ``caller`` does not (None:
    nothing): a grant the caller's do not cover, sandbox rights outside its selector."""
    access = caller.access(identity.backend)
    for g in grants:
        if not access.allows(g.mode, g.prefix):
            return f"{g.mode} on {g.prefix or '/'!r}"
    own = caller.sandboxes
    if sandboxes is not None and (own is None or not labels_match(sandboxes, own)):
        return f"sandboxes {sandboxes} are outside {own}"
    return None


def _within_own(
    caller: Caller, identity: Identity, body: TokenSpec, expires: datetime | None
) -> datetime | None:
    """Check that the token ``body`` asks for holds no more than ``caller``'s own: its
    grants covered by the caller's, its sandbox rights within the caller's selector, its
    expiry no later (a caller's that expires gives its own expiry to a token that names
    none). Returns that expiry. Raises :class:`AccessDenied` (audited)."""

    def deny(why: str) -> AccessDenied:
        return identity.deny(
            caller, "token.create", "", f"a token may not grant more than it holds: {why}"
        )

    beyond = _beyond(caller, identity, body.grants, body.sandboxes)
    if beyond is not None:
        raise deny(beyond)
    if caller.expires_at is not None:
        if expires is not None and expires > caller.expires_at:
            raise deny(f"it expires at {caller.expires_at.isoformat()}")
        expires = expires or caller.expires_at
    return expires


@router.post("", status_code=201)
async def create_token(body: TokenSpec, caller: CallerDep, identity: IdentityDep) -> NewToken:
    """Create a token; its secret is in the answer, and nowhere else ever after."""
    tenant = _tenant(caller, identity, body.tenant, "token.create")
    expires = (
        None
        if body.expires_in_seconds is None
        else from_us(now_us()) + timedelta(seconds=body.expires_in_seconds)
    )
    if not caller.is_owner:
        expires = _within_own(caller, identity, body, expires)
    secret = identity.tokens.issue(
        tenant,
        body.grants,
        name=body.name,
        sandboxes=body.sandboxes,
        admin=body.admin,
        expires_at=expires,
        actor=caller.actor,
    )
    info = identity.tokens.lookup(secret)
    if info is None:  # expired between issue and lookup (a loaded machine, a 1 s expiry)
        raise InvalidArgument(
            "the token expired before it could be shown: give a longer expires_in_seconds"
        )
    return NewToken(token=secret, info=TokenSummary.of(info))


@router.get("")
async def list_tokens(
    caller: CallerDep, identity: IdentityDep, tenant: Annotated[str | None, Query()] = None
) -> list[TokenSummary]:
    """The tenant's tokens (revoked and expired ones too), oldest first: those the caller
    could have made (all, for the home's owner)."""
    tenant = _tenant(caller, identity, tenant, "token.list")
    return [
        TokenSummary.of(t)
        for t in identity.tokens.list(tenant)
        if caller.is_owner or _beyond(caller, identity, t.grants, t.sandboxes) is None
    ]


@router.delete("/{token_id}", status_code=204)
async def revoke_token(
    token_id: str,
    caller: CallerDep,
    identity: IdentityDep,
    tenant: Annotated[str | None, Query()] = None,
) -> Response:
    """Revoke a token by its id; refused from the next request on. A token revokes only
    tokens it could have made (AccessDenied, audited)."""
    tenant = _tenant(caller, identity, tenant, "token.revoke")
    target = None if caller.is_owner else identity.tokens.find(tenant, token_id)
    if target is not None:
        beyond = _beyond(caller, identity, target.grants, target.sandboxes)
        if beyond is not None:
            raise identity.deny(
                caller, "token.revoke", "", f"a token may not revoke one that holds more: {beyond}"
            )
    if not identity.tokens.revoke_id(tenant, token_id, actor=caller.actor):
        raise NotFound(f"no token {token_id!r}", kind="token", name=token_id)
    return Response(status_code=204)
