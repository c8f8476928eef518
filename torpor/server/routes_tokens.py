"""Token routes: the one identity's tokens, created, listed and revoked live.

::

    POST   /v1/tokens          create  TokenSpec -> NewToken (201; the secret is shown once)
    GET    /v1/tokens          list    -> [TokenSummary] (the caller's tenant)
    DELETE /v1/tokens/{id}     revoke  -> 204 (effective on the next request)

Only an admin may manage tokens: the home's owner (the local socket), who may do so for any
tenant (``?tenant=`` / ``TokenSpec.tenant``: this is how a tenant's first token is made), or a
token created with ``admin``, within its own tenant. Every refusal is audited.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated

from fastapi import APIRouter, Query, Response

from torpor.errors import InvalidArgument, NotFound
from torpor.memory.models import NewToken, TokenSpec, TokenSummary, from_us, now_us
from torpor.server.auth import Caller, Identity
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


@router.post("", status_code=201)
async def create_token(body: TokenSpec, caller: CallerDep, identity: IdentityDep) -> NewToken:
    """Create a token; its secret is in the answer, and nowhere else ever after."""
    tenant = _tenant(caller, identity, body.tenant, "token.create")
    expires = (
        None
        if body.expires_in_seconds is None
        else from_us(now_us()) + timedelta(seconds=body.expires_in_seconds)
    )
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
    """The tenant's tokens (revoked and expired ones too), oldest first."""
    tenant = _tenant(caller, identity, tenant, "token.list")
    return [TokenSummary.of(t) for t in identity.tokens.list(tenant)]


@router.delete("/{token_id}", status_code=204)
async def revoke_token(
    token_id: str,
    caller: CallerDep,
    identity: IdentityDep,
    tenant: Annotated[str | None, Query()] = None,
) -> Response:
    """Revoke a token by its id; refused from the next request on."""
    tenant = _tenant(caller, identity, tenant, "token.revoke")
    if not identity.tokens.revoke_id(tenant, token_id, actor=caller.actor):
        raise NotFound(f"no token {token_id!r}", kind="token", name=token_id)
    return Response(status_code=204)
