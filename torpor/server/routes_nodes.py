"""Node routes (cluster mode; over :meth:`SandboxManager.nodes` and ``drain_node``).

::

    GET  /v1/nodes                      every node, its health and load -> [NodeStatus]
    POST /v1/nodes/{name}/drain         pause, make durable, release     -> DrainReport

Both need an admin token (or the local owner): nodes are the whole deployment's, not one
tenant's, and a drain pauses every tenant's sandboxes on the node. Any node answers; a drain
sent to another node than the one named is proxied to it (a Conflict naming it, see
:mod:`torpor.server.proxy`). On one machine (no cluster) the list is one row, ``local``, and a
drain is InvalidArgument.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query

from torpor.sandbox.models import DrainReport, NodeStatus
from torpor.server.auth import Caller, Identity
from torpor.server.deps import CallerDep, IdentityDep, Manager

__all__ = ["router"]

router = APIRouter(prefix="/v1/nodes", tags=["nodes"])


def _admin(caller: Caller, identity: Identity, action: str, name: str = "") -> None:
    """Raises :class:`AccessDenied` (audited) unless the caller is an admin."""
    if not caller.admin:
        raise identity.deny(caller, action, name, "nodes are managed with an admin token")


@router.get("")
async def list_nodes(
    manager: Manager, caller: CallerDep, identity: IdentityDep
) -> list[NodeStatus]:
    """Every node the cluster knows (alive or not), with its heartbeat age and load."""
    _admin(caller, identity, "node.list")
    nodes: list[NodeStatus] = await manager.nodes()
    return nodes


@router.post("/{name}/drain")
async def drain_node(
    manager: Manager,
    caller: CallerDep,
    identity: IdentityDep,
    name: Annotated[str, Path(max_length=64)],
    timeout: Annotated[float, Query(gt=0, le=3600)] = 300.0,
) -> DrainReport:
    """Stop the node taking sandboxes, pause what it runs, wait until each pause is durable
    (up to ``timeout`` seconds in all) and give it up; says what moved and what did not."""
    _admin(caller, identity, "node.drain", name)
    report: DrainReport = await manager.drain_node(name, timeout=timeout)
    return report
