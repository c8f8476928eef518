"""Sandbox lifecycle routes: create, get-or-create by name, get, list, pause, resume, kill.

::

    POST   /v1/sandboxes                      create            -> SandboxInfo (201)
    PUT    /v1/sandboxes/by-name/{name}       get_or_create     -> SandboxInfo (reused says which)
    GET    /v1/sandboxes?label=k=v            list              -> [SandboxInfo]
    GET    /v1/sandboxes/{id_or_name}         get               -> SandboxInfo
    PATCH  /v1/sandboxes/{id_or_name}         update            -> SandboxInfo (labels, idle pause)
    GET    /v1/sandboxes/{id_or_name}/logs    logs              -> text (the guest console)
    POST   /v1/sandboxes/{id_or_name}/pause   pause             -> SandboxInfo
    POST   /v1/sandboxes/{id_or_name}/resume  resume            -> SandboxInfo
    DELETE /v1/sandboxes/{id_or_name}         kill              -> 204

A caller whose token reaches only sandboxes with some labels (``sandboxes={"user": "u-42"}``)
lists only those, and a sandbox it creates gets those labels; any other sandbox is NotFound for
it (audited; :func:`torpor.server.deps.get_tenant`).

The bodies are :mod:`torpor.sandbox.requests` models: a create takes the whole
:class:`~torpor.sandbox.requests.SandboxSpec` (a template fork, or a restore of ``snapshot``, with
``volumes`` and ``drives``); a get-or-create its :class:`~torpor.sandbox.requests.SandboxOptions`.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import PlainTextResponse

from torpor.errors import AccessDenied, SandboxNotFound
from torpor.sandbox.models import SandboxInfo
from torpor.sandbox.models import parse_labels as _parse_labels
from torpor.sandbox.requests import SandboxOptions, SandboxSettings, SandboxSpec
from torpor.server.auth import labels_match
from torpor.server.deps import (
    CallerDep,
    IdentityDep,
    Manager,
    Tenant,
    visible_shared,
    visible_snapshot,
    within_selector,
)
from torpor.server.routes_checkpoints import checkpoints_of

__all__ = ["own", "parse_labels", "router"]

router = APIRouter(prefix="/v1/sandboxes", tags=["sandboxes"])


def parse_labels(labels: list[str] | None) -> dict[str, str] | None:
    """``["user=u-42", "tier=pro"]`` -> ``{"user": "u-42", "tier": "pro"}``.

    Raises :class:`InvalidArgument` for an item without ``=``.
    """
    return _parse_labels(labels, what="label filter")


def own(info: SandboxInfo, tenant: str, id_or_name: str) -> SandboxInfo:
    """Return ``info`` if it belongs to ``tenant``; else the sandbox does not exist for them.

    A second fence behind the manager's own tenant scoping: a route never hands out another
    tenant's sandbox, even if a lower layer got it wrong. Raises :class:`SandboxNotFound`.
    """
    if info.tenant != tenant:
        raise SandboxNotFound(f"no sandbox {id_or_name!r}", kind="sandbox", name=id_or_name)
    return info


async def _fresh(manager: Any, result: Any, id_or_name: str, tenant: str) -> SandboxInfo:
    # pause/resume may return the new info or nothing; either way answer with the current one.
    if isinstance(result, SandboxInfo):
        return own(result, tenant, id_or_name)
    info = await manager.get(id_or_name, tenant=tenant)
    return own(info, tenant, id_or_name)


@router.post("", status_code=201)
async def create_sandbox(
    body: SandboxSpec,
    request: Request,
    manager: Manager,
    tenant: Tenant,
    caller: CallerDep,
    identity: IdentityDep,
) -> SandboxInfo:
    """Create a sandbox: a fork of its template's booted snapshot or, with ``snapshot``, a
    restore of that snapshot; with ``volumes`` and ``drives`` mounted."""
    body = within_selector(body, caller, identity, "POST /v1/sandboxes", body.name)
    if caller.restricted:  # it mounts only volumes and drives carrying the caller's labels
        for volume in body.volumes or ():
            visible_shared(request, caller, "volume", volume.volume)
        for drive in body.drives or ():
            visible_shared(request, caller, "drive", drive.drive)
    if caller.restricted and body.snapshot is not None:
        await visible_snapshot(request, caller, body.snapshot)  # its own sandboxes' only
    if body.plain:  # the manager alone makes it (and a test double of the manager can)
        info: SandboxInfo = await manager.create(body.narrow(SandboxOptions), tenant=tenant)
    else:
        info = await checkpoints_of(request, manager).create(body, tenant=tenant)
    return info


@router.put("/by-name/{name}")
async def get_or_create_sandbox(
    name: str,
    body: SandboxOptions,
    manager: Manager,
    tenant: Tenant,
    caller: CallerDep,
    identity: IdentityDep,
) -> SandboxInfo:
    """Return the sandbox called ``name`` (woken if paused), creating it if there is none."""
    action = "PUT /v1/sandboxes/by-name/{name}"
    body = within_selector(body, caller, identity, action, name)
    # A restricted caller's selector is checked by the manager under the name's lock, so a
    # sandbox of another's that appears between a look and the get-or-create is never
    # relabelled, woken or handed out (AccessDenied, audited here).
    try:
        info: SandboxInfo = await manager.get_or_create(
            name, body, tenant=tenant, selector=caller.sandboxes or None
        )
    except AccessDenied:
        raise identity.deny(
            caller, action, f"sandbox:{name}", "the name belongs to another"
        ) from None
    if not caller.sees(info.labels):  # a second fence: never hand out another's sandbox
        raise identity.deny(caller, action, f"sandbox:{name}", "the name belongs to another")
    return own(info, tenant, name)


@router.get("")
async def list_sandboxes(
    manager: Manager,
    tenant: Tenant,
    caller: CallerDep,
    label: Annotated[list[str] | None, Query()] = None,
    include_stopped: Annotated[bool, Query(alias="all")] = False,
) -> list[SandboxInfo]:
    """The tenant's sandboxes (those the caller may see), optionally only those carrying every
    ``label=KEY=VALUE``; killed ones too with ``all=true``."""
    extra = {"include_stopped": True} if include_stopped else {}
    wanted = parse_labels(label) or {}
    selector = caller.sandboxes or {}
    if any(wanted.get(k, v) != v for k, v in selector.items()):
        return []  # a filter that contradicts the caller's own labels matches nothing
    labels = {**wanted, **selector} or None
    infos: list[SandboxInfo] = await manager.list(labels=labels, tenant=tenant, **extra)
    return [i for i in infos if i.tenant == tenant and labels_match(i.labels, selector)]


@router.get("/{id_or_name}")
async def get_sandbox(id_or_name: str, manager: Manager, tenant: Tenant) -> SandboxInfo:
    """One sandbox by id or name."""
    return own(await manager.get(id_or_name, tenant=tenant), tenant, id_or_name)


@router.patch("/{id_or_name}")
async def update_sandbox(
    id_or_name: str,
    body: SandboxSettings,
    manager: Manager,
    tenant: Tenant,
    caller: CallerDep,
    identity: IdentityDep,
) -> SandboxInfo:
    """Change a sandbox's labels (replaced as a whole) or idle pause (0: never); fields left
    out stay as they are. A restricted caller's new labels keep its selector's."""
    own(await manager.get(id_or_name, tenant=tenant), tenant, id_or_name)
    if body.labels is not None:
        body = within_selector(body, caller, identity, "PATCH /v1/sandboxes/{id}", id_or_name)
    return own(await manager.update(id_or_name, body, tenant=tenant), tenant, id_or_name)


@router.get("/{id_or_name}/logs", response_class=PlainTextResponse)
async def sandbox_logs(
    id_or_name: str,
    manager: Manager,
    tenant: Tenant,
    lines: Annotated[int, Query(ge=1, le=10000)] = 100,
) -> PlainTextResponse:
    """The last ``lines`` lines of the sandbox's guest console (a paused one is not woken)."""
    own(await manager.get(id_or_name, tenant=tenant), tenant, id_or_name)
    text: str = await manager.logs(id_or_name, tenant=tenant, lines=lines)
    return PlainTextResponse(text)


@router.post("/{id_or_name}/pause")
async def pause_sandbox(id_or_name: str, manager: Manager, tenant: Tenant) -> SandboxInfo:
    """Hibernate the sandbox to disk (RAM, processes and all)."""
    return await _fresh(manager, await manager.pause(id_or_name, tenant=tenant), id_or_name, tenant)


@router.post("/{id_or_name}/resume")
async def resume_sandbox(id_or_name: str, manager: Manager, tenant: Tenant) -> SandboxInfo:
    """Wake a paused sandbox."""
    return await _fresh(
        manager, await manager.resume(id_or_name, tenant=tenant), id_or_name, tenant
    )


@router.delete("/{id_or_name}", status_code=204)
async def kill_sandbox(id_or_name: str, manager: Manager, tenant: Tenant) -> Response:
    """Stop the sandbox for good and delete its machine files."""
    await manager.kill(id_or_name, tenant=tenant)
    return Response(status_code=204)
