"""Usage and retention routes (over :mod:`torpor.sandbox.registry.usage`).

::

    GET  /v1/usage?by=label:user&since=2026-11-01&until=...   usage report   -> UsageReport
    POST /v1/sandboxes/{id_or_name}/retention  {"days": 90}   keep a pause   -> SandboxInfo
    POST /v1/snapshots/{id_or_name}/retention  {"days": 90}   keep a snapshot -> SnapshotInfo

A report covers the caller's tenant only. ``by`` is ``tenant`` (default), ``sandbox`` or
``label:KEY``; ``since`` defaults to the start of the month and ``until`` to now (ISO 8601
dates or times, UTC unless they say otherwise). A bad grouping or window is InvalidArgument.
Retention counts from when the sandbox was paused (or the snapshot taken), 1-365 days; GC
honours it, and the report's ``retention`` list says what each one still to run will cost.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request

from torpor.errors import NotFound
from torpor.sandbox.models import SandboxInfo
from torpor.sandbox.registry.usage import RetentionSpec, UsageReport, build
from torpor.sandbox.storage.snapshots import SnapshotInfo
from torpor.server.deps import Manager, Tenant
from torpor.server.routes_checkpoints import checkpoints_of
from torpor.server.routes_sandboxes import own

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["usage"])


def _needs(manager: Any, attribute: str) -> Any:
    """``manager.<attribute>``; a manager without it (a test double serving the HTTP layer)
    answers NotFound, never a 500."""
    found = getattr(manager, attribute, None)
    if found is None:
        raise NotFound(f"this server keeps no {attribute}", kind="feature", name=attribute)
    return found


@router.get("/usage")
async def usage(
    manager: Manager,
    tenant: Tenant,
    by: Annotated[str, Query(max_length=300)] = "tenant",
    since: Annotated[str | None, Query(max_length=64)] = None,
    until: Annotated[str | None, Query(max_length=64)] = None,
) -> UsageReport:
    """What the tenant's sandboxes, snapshots and volumes used over ``[since, until)``, and
    what it costs by the home's rate card (``<home>/rates.json`` over the defaults)."""
    registry, home = _needs(manager, "registry"), _needs(manager, "paths")
    cluster = getattr(manager, "cluster", None)  # a node's snapshots are the cluster's
    snapshots = None if cluster is None else cluster.snapshot_store()
    return await asyncio.to_thread(
        build,
        registry,
        home,
        tenant=tenant,
        by=by,
        since=since,
        until=until,
        snapshots=snapshots,
    )


@router.post("/sandboxes/{id_or_name}/retention")
async def set_sandbox_retention(
    id_or_name: str, body: RetentionSpec, manager: Manager, tenant: Tenant
) -> SandboxInfo:
    """Keep the sandbox's pause ``days`` days from when it was paused (a running sandbox:
    from its next pause); ``expires_at`` says until when."""
    info: SandboxInfo = await _needs(manager, "set_retention")(id_or_name, body.days, tenant=tenant)
    return own(info, tenant, id_or_name)


@router.post("/snapshots/{id_or_name}/retention")
async def set_snapshot_retention(
    id_or_name: str, body: RetentionSpec, request: Request, manager: Manager, tenant: Tenant
) -> SnapshotInfo:
    """Keep the snapshot ``days`` days from when it was taken."""
    cp = checkpoints_of(request, manager)
    return await asyncio.to_thread(cp.set_snapshot_retention, id_or_name, body.days, tenant=tenant)
