"""Sandbox lifecycle routes: create, get-or-create by name, get, list, pause, resume, kill.

::

    POST   /v1/sandboxes                      create            -> SandboxInfo (201)
    PUT    /v1/sandboxes/by-name/{name}       get_or_create     -> SandboxInfo (reused says which)
    GET    /v1/sandboxes?label=k=v            list              -> [SandboxInfo]
    GET    /v1/sandboxes/{id_or_name}         get               -> SandboxInfo
    POST   /v1/sandboxes/{id_or_name}/pause   pause             -> SandboxInfo
    POST   /v1/sandboxes/{id_or_name}/resume  resume            -> SandboxInfo
    DELETE /v1/sandboxes/{id_or_name}         kill              -> 204
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Response
from pydantic import BaseModel, ConfigDict, Field

from torpor.errors import InvalidArgument, SandboxNotFound
from torpor.sandbox.models import SandboxInfo
from torpor.sandbox.models import parse_labels as _parse_labels
from torpor.server.deps import Manager, Tenant

__all__ = ["CreateSandbox", "own", "parse_labels", "router"]

router = APIRouter(prefix="/v1/sandboxes", tags=["sandboxes"])


class CreateSandbox(BaseModel):
    """The body of a create or get-or-create; fields left out take the manager's defaults."""

    model_config = ConfigDict(extra="forbid")

    template: str | None = None
    name: str | None = None
    labels: dict[str, str] | None = None
    idle_pause_seconds: int | None = Field(default=None, ge=1)
    pause_retention_days: int | None = Field(default=None, ge=1, le=365)
    vcpus: int | None = Field(default=None, ge=1, le=64)
    memory_mib: int | None = Field(default=None, ge=64, le=1024 * 1024)

    def options(self) -> dict[str, Any]:
        """The keyword arguments to pass on: only what the caller set."""
        return {k: v for k, v in self.model_dump(exclude_unset=True).items() if v is not None}


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
async def create_sandbox(body: CreateSandbox, manager: Manager, tenant: Tenant) -> SandboxInfo:
    """Create a sandbox (a fork of its template's booted snapshot)."""
    info: SandboxInfo = await manager.create(**body.options(), tenant=tenant)
    return info


@router.put("/by-name/{name}")
async def get_or_create_sandbox(
    name: str, body: CreateSandbox, manager: Manager, tenant: Tenant
) -> SandboxInfo:
    """Return the sandbox called ``name`` (woken if paused), creating it if there is none."""
    options = body.options()
    if options.pop("name", name) != name:
        raise InvalidArgument("the body's name differs from the path's", name=name)
    info: SandboxInfo = await manager.get_or_create(name, **options, tenant=tenant)
    return own(info, tenant, name)


@router.get("")
async def list_sandboxes(
    manager: Manager,
    tenant: Tenant,
    label: Annotated[list[str] | None, Query()] = None,
    include_stopped: Annotated[bool, Query(alias="all")] = False,
) -> list[SandboxInfo]:
    """The tenant's sandboxes, optionally only those carrying every ``label=KEY=VALUE``;
    killed ones too with ``all=true``."""
    extra = {"include_stopped": True} if include_stopped else {}
    infos: list[SandboxInfo] = await manager.list(
        labels=parse_labels(label), tenant=tenant, **extra
    )
    return [i for i in infos if i.tenant == tenant]


@router.get("/{id_or_name}")
async def get_sandbox(id_or_name: str, manager: Manager, tenant: Tenant) -> SandboxInfo:
    """One sandbox by id or name."""
    return own(await manager.get(id_or_name, tenant=tenant), tenant, id_or_name)


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
