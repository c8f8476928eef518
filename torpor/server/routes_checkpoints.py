"""Snapshot, restore, fork, volume, drive and GC routes (over :mod:`torpor.sandbox.checkpoints`).

::

    POST   /v1/sandboxes/{id}/snapshots     snapshot a sandbox          -> SnapshotInfo (201)
    POST   /v1/sandboxes/{id}/fork          fork a sandbox              -> [SandboxInfo] (201)
    POST   /v1/sandboxes/{id}/volumes       attach + mount a volume     -> VolumeInfo
    POST   /v1/sandboxes/{id}/drives        attach + mount a drive      -> DriveInfo
    GET    /v1/snapshots                    list                        -> [SnapshotInfo]
    GET    /v1/snapshots/{id}               get                         -> SnapshotInfo
    DELETE /v1/snapshots/{id}               delete                      -> 204
    POST   /v1/snapshots/{id}/restore       restore into a new sandbox  -> SandboxInfo (201)
    POST   /v1/snapshots/{id}/fork          N sandboxes from a snapshot -> [SandboxInfo] (201)
    POST   /v1/volumes   GET /v1/volumes[?label=K=V]   GET|DELETE /v1/volumes/{id}
    POST   /v1/drives    GET /v1/drives[?label=K=V]    GET|DELETE /v1/drives/{id}
    POST   /v1/gc                           retention + garbage collection -> GcReport

The bodies are :mod:`torpor.sandbox.requests` models. A create from a snapshot or with volumes
and drives is ``POST /v1/sandboxes`` (:mod:`torpor.server.routes_sandboxes`), like every create.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, Response

from torpor.errors import AccessDenied
from torpor.sandbox.checkpoints import Checkpoints
from torpor.sandbox.models import SandboxInfo, parse_labels
from torpor.sandbox.requests import (
    DriveMount,
    DriveSpec,
    ForkSpec,
    GcSpec,
    RestoreSpec,
    SnapshotSpec,
    VolumeMount,
    VolumeSpec,
)
from torpor.sandbox.storage.drives import DriveInfo
from torpor.sandbox.storage.records import RecordStore
from torpor.sandbox.storage.snapshots import SnapshotInfo
from torpor.sandbox.storage.volumes import VolumeInfo
from torpor.server.auth import Caller
from torpor.server.deps import (
    CallerDep,
    IdentityDep,
    Manager,
    Tenant,
    checkpoints_of,
    visible_shared,
    within_selector,
)

__all__ = ["checkpoints_of", "router", "start_background"]

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["checkpoints"])


async def _checkpoints(request: Request, manager: Manager) -> Checkpoints:
    return checkpoints_of(request, manager)  # async: no trip to the thread pool (deps.py)


#: the app's Checkpoints, for a route's signature (after ``tenant``: the caller is checked first)
Cp = Annotated[Checkpoints, Depends(_checkpoints)]


# -- sandboxes -------------------------------------------------------------------------------


@router.post("/sandboxes/{id_or_name}/snapshots", status_code=201)
async def snapshot(id_or_name: str, body: SnapshotSpec, tenant: Tenant, cp: Cp) -> SnapshotInfo:
    return await cp.snapshot(id_or_name, body, tenant=tenant)


@router.post("/sandboxes/{id_or_name}/fork", status_code=201)
async def fork(
    id_or_name: str,
    body: ForkSpec,
    tenant: Tenant,
    caller: CallerDep,
    identity: IdentityDep,
    cp: Cp,
) -> list[SandboxInfo]:
    body = within_selector(body, caller, identity, "POST /v1/sandboxes/{id}/fork", id_or_name)
    return await cp.fork(id_or_name, body, tenant=tenant)


@router.post("/sandboxes/{id_or_name}/volumes")
async def attach_volume(
    id_or_name: str,
    body: VolumeMount,
    request: Request,
    tenant: Tenant,
    caller: CallerDep,
    cp: Cp,
) -> VolumeInfo:
    if caller.restricted:  # the sandbox is the caller's (Tenant): the volume must be too
        visible_shared(request, caller, "volume", body.volume)
    return await cp.attachments.attach_volume(id_or_name, body, tenant=tenant)


@router.post("/sandboxes/{id_or_name}/drives")
async def attach_drive(
    id_or_name: str,
    body: DriveMount,
    request: Request,
    tenant: Tenant,
    caller: CallerDep,
    cp: Cp,
) -> DriveInfo:
    if caller.restricted:
        visible_shared(request, caller, "drive", body.drive)
    return await cp.attachments.attach_drive(id_or_name, body, tenant=tenant)


# -- snapshots -------------------------------------------------------------------------------


@router.get("/snapshots")
async def list_snapshots(tenant: Tenant, caller: CallerDep, cp: Cp) -> list[SnapshotInfo]:
    """The tenant's snapshots (a restricted token: those of its sandboxes)."""
    # in a thread, as every read of the manifests: each is read and hashed (a snapshot of
    # gigabytes has a manifest of a megabyte), every tenant's
    snapshots = await asyncio.to_thread(cp.list_snapshots, tenant=tenant)
    if caller.restricted:
        snapshots = [s for s in snapshots if caller.sees(s.carried.labels)]
    return snapshots


@router.get("/snapshots/{id_or_name}")
async def get_snapshot(id_or_name: str, tenant: Tenant, cp: Cp) -> SnapshotInfo:
    return await asyncio.to_thread(cp.get_snapshot, id_or_name, tenant=tenant)


@router.delete("/snapshots/{id_or_name}", status_code=204)
async def delete_snapshot(id_or_name: str, tenant: Tenant, cp: Cp) -> Response:
    # in a thread: it waits for the store's names lock, which a capture holds while it checks
    # every chunk and writes its manifest, and it writes the usage ledger
    await asyncio.to_thread(functools.partial(cp.delete_snapshot, id_or_name, tenant=tenant))
    return Response(status_code=204)


@router.post("/snapshots/{id_or_name}/restore", status_code=201)
async def restore(
    id_or_name: str,
    body: RestoreSpec,
    tenant: Tenant,
    caller: CallerDep,
    identity: IdentityDep,
    cp: Cp,
) -> SandboxInfo:
    body = within_selector(body, caller, identity, "POST /v1/snapshots/{id}/restore", body.name)
    return await cp.restore(id_or_name, body, tenant=tenant)


@router.post("/snapshots/{id_or_name}/fork", status_code=201)
async def fork_snapshot(
    id_or_name: str,
    body: ForkSpec,
    tenant: Tenant,
    caller: CallerDep,
    identity: IdentityDep,
    cp: Cp,
) -> list[SandboxInfo]:
    body = within_selector(body, caller, identity, "POST /v1/snapshots/{id}/fork", id_or_name)
    return await cp.fork_snapshot(id_or_name, body, tenant=tenant)


# -- volumes and drives ----------------------------------------------------------------------


async def _delete_shared(
    cp: Checkpoints, store: RecordStore[Any], id_or_name: str, tenant: str
) -> Response:
    """Delete a volume or drive once attachments of killed sandboxes are dropped (they no
    longer hold it). Raises NotFound, Conflict while a live sandbox has it attached.

    A store's calls run in a thread (here and in the creates): they wait for its lock, which
    a volume file read holds for as long as it takes, and a create runs mkfs."""

    def delete() -> None:
        store.release(keep=cp.attachments.live_ids)  # (ids: under the store's lock)
        store.delete(id_or_name, tenant=tenant)

    await asyncio.to_thread(delete)
    return Response(status_code=204)


def _listed(
    store: RecordStore[Any], tenant: str, caller: Caller, label: list[str] | None
) -> list[Any]:
    """The tenant's volumes or drives the caller may see, carrying every ``label=K=V``."""
    wanted = parse_labels(label, what="label filter") or {}
    selector = caller.sandboxes or {}
    if any(wanted.get(k, v) != v for k, v in selector.items()):
        return []  # a filter that contradicts the caller's own labels matches nothing
    return store.list(tenant=tenant, labels={**wanted, **selector})


#: ``?label=KEY=VALUE`` (repeatable): only those carrying every one
LabelQuery = Annotated[list[str] | None, Query(description="KEY=VALUE, repeatable")]


@router.post("/volumes", status_code=201)
async def create_volume(
    body: VolumeSpec, tenant: Tenant, caller: CallerDep, identity: IdentityDep, cp: Cp
) -> VolumeInfo:
    body = within_selector(body, caller, identity, "POST /v1/volumes", body.name, "volume")
    return await asyncio.to_thread(functools.partial(cp.volumes.create, body, tenant=tenant))


@router.get("/volumes")
async def list_volumes(
    tenant: Tenant, caller: CallerDep, cp: Cp, label: LabelQuery = None
) -> list[VolumeInfo]:
    """The tenant's volumes (those the caller may see), optionally only those carrying every
    ``label=KEY=VALUE``."""
    return _listed(cp.volumes, tenant, caller, label)


@router.get("/volumes/{id_or_name}")
async def get_volume(id_or_name: str, tenant: Tenant, cp: Cp) -> VolumeInfo:
    return cp.volumes.get(id_or_name, tenant=tenant)


@router.delete("/volumes/{id_or_name}", status_code=204)
async def delete_volume(id_or_name: str, tenant: Tenant, cp: Cp) -> Response:
    return await _delete_shared(cp, cp.volumes, id_or_name, tenant)


@router.post("/drives", status_code=201)
async def create_drive(
    body: DriveSpec, tenant: Tenant, caller: CallerDep, identity: IdentityDep, cp: Cp
) -> DriveInfo:
    body = within_selector(body, caller, identity, "POST /v1/drives", body.name, "drive")
    return await asyncio.to_thread(functools.partial(cp.drives.create, body, tenant=tenant))


@router.get("/drives")
async def list_drives(
    tenant: Tenant, caller: CallerDep, cp: Cp, label: LabelQuery = None
) -> list[DriveInfo]:
    """The tenant's drives (those the caller may see), optionally only those carrying every
    ``label=KEY=VALUE``."""
    return _listed(cp.drives, tenant, caller, label)


@router.get("/drives/{id_or_name}")
async def get_drive(id_or_name: str, tenant: Tenant, cp: Cp) -> DriveInfo:
    return cp.drives.get(id_or_name, tenant=tenant)


@router.delete("/drives/{id_or_name}", status_code=204)
async def delete_drive(id_or_name: str, tenant: Tenant, cp: Cp) -> Response:
    return await _delete_shared(cp, cp.drives, id_or_name, tenant)


# -- retention -------------------------------------------------------------------------------


@router.post("/gc")
async def gc(body: GcSpec, tenant: Tenant, caller: CallerDep, cp: Cp) -> dict[str, Any]:
    """Run retention and GC now. They act on the whole home (every tenant's expired pauses,
    unreferenced chunks): only the home's owner may ask, on the local socket (a token holder
    gets AccessDenied; the server collects on its own timer)."""
    if not caller.is_owner:
        raise AccessDenied(
            "GC acts on every tenant of this home: only its owner may run it, on the local "
            "socket (the server also collects on its own every hour)",
            tenant=tenant,
            scope="gc",
        )
    report = await cp.collect_garbage(body)
    return report.to_json()


# -- background ------------------------------------------------------------------------------

#: seconds between two GC passes of a running server ($TORPOR_GC_INTERVAL overrides)
GC_INTERVAL = 3600.0


async def _gc_loop(cp: Checkpoints, interval: float) -> None:
    try:  # first, what a crash mid-attach left: drives plugged unrecorded, or unmounted
        await cp.recover()
    except Exception:
        log.exception("recovering drive attachments failed")
    while True:
        await asyncio.sleep(interval)
        try:
            report = await cp.collect_garbage()
            log.info("gc: %s", report.to_json())
        except asyncio.CancelledError:
            raise
        except Exception:  # one failed pass must not end retention
            log.exception("garbage collection failed")


def start_background(app: Any, manager: Any) -> asyncio.Task[None] | None:
    """Called from the app's lifespan: make the app's :class:`Checkpoints` now (so drives are
    remounted after every wake from the first request on) and start the periodic GC.
    Returns the task (cancel it on shutdown), or None for a manager that is not a real one."""
    if not hasattr(manager, "registry") or not hasattr(manager, "paths"):
        return None
    cp = Checkpoints(manager)
    app.state.checkpoints = cp
    interval = float(os.environ.get("TORPOR_GC_INTERVAL", GC_INTERVAL))
    return asyncio.get_running_loop().create_task(_gc_loop(cp, interval), name="torpor-gc")
