"""The stored resources' requests and answers (snapshots, volumes, drives, GC), written once
for the sync handles (:mod:`torpor.client.storage`, ``Snapshot`` in
:mod:`torpor.client.sandbox`) and the async ones (:mod:`torpor.client.aio_storage`,
``AsyncSnapshot`` in :mod:`torpor.client.aio_sandbox`).

As :mod:`torpor.client.sandbox_calls`: each function takes already-checked request models and
returns a :class:`~torpor.client.calls.Call`, sent with ``runtime.do(call)`` or
``await runtime.do(call)``. A resource's route is ``/v1/snapshots``, ``/v1/volumes`` or
``/v1/drives``; its answers are read as ``model``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, TypeAdapter

from torpor.client.calls import Call
from torpor.client.sandbox_calls import LONG_TIMEOUT, at
from torpor.sandbox.models import SandboxInfo
from torpor.sandbox.registry.usage import RetentionSpec
from torpor.sandbox.requests import ForkSpec, GcSpec, RestoreSpec, Spec
from torpor.sandbox.storage.snapshots import SnapshotInfo

__all__ = [
    "create",
    "delete",
    "fork_snapshot",
    "gc",
    "get",
    "list_resources",
    "read_volume_file",
    "restore",
    "set_retention",
]

M = TypeVar("M", bound=BaseModel)

_SANDBOXES = TypeAdapter(list[SandboxInfo])


def _at(route: str, id_or_name: str, suffix: str = "") -> str:
    return at(route, id_or_name, suffix)


def list_resources(
    route: str, model: type[M], labels: Mapping[str, str] | None = None
) -> Call[list[M]]:
    """``GET <route>``: the tenant's, oldest first; only those carrying every one of
    ``labels`` when given."""
    params = [("label", f"{k}={v}") for k, v in (labels or {}).items()]
    return Call("GET", route, params=params, parse=lambda d: [model.model_validate(i) for i in d])


def get(route: str, model: type[M], id_or_name: str) -> Call[M]:
    return Call("GET", _at(route, id_or_name), parse=model.model_validate)


def create(route: str, model: type[M], spec: Spec) -> Call[M]:
    """``POST <route>`` with the fields of ``spec`` the caller gave (these calls may copy
    RAM or make disks: :data:`LONG_TIMEOUT`)."""
    return Call("POST", route, body=spec.given(), parse=model.model_validate, timeout=LONG_TIMEOUT)


def delete(route: str, id_or_name: str) -> Call[None]:
    return Call("DELETE", _at(route, id_or_name), answer="none")


def set_retention(snapshot_id: str, spec: RetentionSpec) -> Call[SnapshotInfo]:
    return Call(
        "POST",
        _at("/v1/snapshots", snapshot_id, "/retention"),
        body=spec.given(),
        parse=SnapshotInfo.model_validate,
    )


def restore(snapshot_id: str, spec: RestoreSpec) -> Call[SandboxInfo]:
    return Call(
        "POST",
        _at("/v1/snapshots", snapshot_id, "/restore"),
        body=spec.given(),
        parse=SandboxInfo.model_validate,
        timeout=LONG_TIMEOUT,
    )


def fork_snapshot(snapshot_id: str, spec: ForkSpec) -> Call[list[SandboxInfo]]:
    return Call(
        "POST",
        _at("/v1/snapshots", snapshot_id, "/fork"),
        body=spec.given(),
        parse=_SANDBOXES.validate_python,
        timeout=LONG_TIMEOUT,
    )


def read_volume_file(volume_id: str, path: str) -> Call[bytes]:
    return Call(
        "GET", _at("/v1/volumes", volume_id, "/files"), params={"path": path}, answer="bytes"
    )


def gc(spec: GcSpec) -> Call[dict[str, Any]]:
    return Call("POST", "/v1/gc", body=spec.given(), parse=dict, timeout=LONG_TIMEOUT)
