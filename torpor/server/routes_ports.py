"""Reaching a port in a sandbox from the server's host (``sbx.get_host``). ::

    POST /v1/sandboxes/{id}/ports/{port}   -> {"port": 8000, "host": "127.0.0.1:NNNNN"}

The answer is an address on the server's own loopback (see
:mod:`torpor.sandbox.manager.forwards`): asking opens its listener once, asking again returns
the same address. A POST, since the first call opens a listener.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path

from torpor.server.deps import Manager, Tenant

__all__ = ["router"]

router = APIRouter(prefix="/v1/sandboxes/{id_or_name}/ports", tags=["ports"])


@router.post("/{port}")
async def get_host(
    id_or_name: str,
    port: Annotated[int, Path(ge=1, le=65535)],
    manager: Manager,
    tenant: Tenant,
) -> dict[str, Any]:
    """Where on the server's host a connection reaches ``port`` in the sandbox."""
    host: str = await manager.get_host(id_or_name, port, tenant=tenant)
    return {"port": port, "host": host}
