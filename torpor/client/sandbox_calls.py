"""The sandbox API's requests and answers, written once for :class:`~torpor.client.Sandbox`
and :class:`~torpor.client.aio_sandbox.AsyncSandbox`.

Each function takes already-checked request models (:mod:`torpor.sandbox.requests`: bad
values raise InvalidArgument there, before anything is sent) and returns a
:class:`~torpor.client.calls.Call`; a sync handle sends it with ``runtime.do(call)``, an async
one with ``await runtime.do(call)``. Streamed output (``on_stdout``/``on_stderr``) is read with
:func:`stream_path` and :func:`feed`, shared the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar
from urllib.parse import quote

from pydantic import BaseModel, TypeAdapter

from torpor.client.calls import DEFAULT, Call, url_text
from torpor.errors import InvalidArgument, from_wire
from torpor.sandbox.models import CommandResult, EntryInfo, Execution, SandboxInfo
from torpor.sandbox.registry.usage import RetentionSpec
from torpor.sandbox.requests import (
    CodeSpec,
    CommandSpec,
    ForkSpec,
    SandboxOptions,
    SandboxSettings,
    SandboxSpec,
    SnapshotSpec,
)
from torpor.sandbox.storage.snapshots import SnapshotInfo
from torpor.types import OutputCallback

__all__ = [
    "LONG_TIMEOUT",
    "SLACK",
    "create",
    "feed",
    "get",
    "get_or_create",
    "list_sandboxes",
    "route",
    "stream_path",
]

M = TypeVar("M", bound=BaseModel)

#: seconds to wait for snapshots, restores, forks and mounts: they copy RAM and wake machines
LONG_TIMEOUT = 600.0
#: extra seconds a command's HTTP call may take beyond the command's own timeout (a wake)
SLACK = 120.0

_INFOS = TypeAdapter(list[SandboxInfo])
_ENTRIES = TypeAdapter(list[EntryInfo])


def route(sandbox_id: str, suffix: str = "") -> str:
    """The API path of a sandbox (``/v1/sandboxes/<id>``), plus ``suffix``. Raises
    :class:`InvalidArgument` for an id that names no path segment (``""``, ``.``, ``..``)."""
    return at("/v1/sandboxes", sandbox_id, suffix)


def at(collection: str, id_or_name: str, suffix: str = "") -> str:
    """``<collection>/<id_or_name><suffix>``, the name quoted. An empty name, ``.`` or ``..``
    would name the collection (or its parent) once a client normalizes the path, and a lone
    surrogate goes into no URL: :class:`InvalidArgument`."""
    if not isinstance(id_or_name, str) or id_or_name in ("", ".", "..") or not url_text(id_or_name):
        raise InvalidArgument(f"{id_or_name!r} is not an id or a name")
    return f"{collection}/{quote(id_or_name, safe='')}{suffix}"


def _run_timeout(timeout: float | None) -> float | None:
    return None if timeout is None else timeout + SLACK


# -- finding and making ---------------------------------------------------------------------


def create(spec: SandboxSpec) -> Call[SandboxInfo]:
    """``POST /v1/sandboxes``; a restore or a mount gets :data:`LONG_TIMEOUT`."""
    return Call(
        "POST",
        "/v1/sandboxes",
        body=spec.given(),
        parse=SandboxInfo.model_validate,
        timeout=DEFAULT if spec.plain else LONG_TIMEOUT,
    )


def get_or_create(name: str, spec: SandboxOptions) -> Call[SandboxInfo]:
    path = at("/v1/sandboxes/by-name", name)
    return Call("PUT", path, body=spec.given(), parse=SandboxInfo.model_validate)


def get(id_or_name: str) -> Call[SandboxInfo]:
    return Call("GET", route(id_or_name), parse=SandboxInfo.model_validate)


def list_sandboxes(
    labels: Mapping[str, str] | None, include_stopped: bool
) -> Call[list[SandboxInfo]]:
    params = [("label", f"{k}={v}") for k, v in (labels or {}).items()]
    if include_stopped:
        params.append(("all", "true"))
    return Call("GET", "/v1/sandboxes", params=params, parse=_INFOS.validate_python)


# -- one sandbox ----------------------------------------------------------------------------


def pause(sandbox_id: str) -> Call[SandboxInfo]:
    return Call("POST", route(sandbox_id, "/pause"), parse=SandboxInfo.model_validate)


def resume(sandbox_id: str) -> Call[SandboxInfo]:
    return Call("POST", route(sandbox_id, "/resume"), parse=SandboxInfo.model_validate)


def kill(sandbox_id: str) -> Call[None]:
    return Call("DELETE", route(sandbox_id), answer="none")


def update(sandbox_id: str, spec: SandboxSettings) -> Call[SandboxInfo]:
    return Call("PATCH", route(sandbox_id), body=spec.given(), parse=SandboxInfo.model_validate)


def set_retention(sandbox_id: str, spec: RetentionSpec) -> Call[SandboxInfo]:
    return Call(
        "POST",
        route(sandbox_id, "/retention"),
        body=spec.given(),
        parse=SandboxInfo.model_validate,
    )


def logs(sandbox_id: str, lines: int) -> Call[str]:
    return Call("GET", route(sandbox_id, "/logs"), params={"lines": lines}, answer="text")


def snapshot(sandbox_id: str, spec: SnapshotSpec) -> Call[SnapshotInfo]:
    return Call(
        "POST",
        route(sandbox_id, "/snapshots"),
        body=spec.given(),
        parse=SnapshotInfo.model_validate,
        timeout=LONG_TIMEOUT,
    )


def fork(sandbox_id: str, spec: ForkSpec) -> Call[list[SandboxInfo]]:
    return Call(
        "POST",
        route(sandbox_id, "/fork"),
        body=spec.given(),
        parse=_INFOS.validate_python,
        timeout=LONG_TIMEOUT,
    )


# -- inside it ------------------------------------------------------------------------------


def run_command(sandbox_id: str, spec: CommandSpec) -> Call[CommandResult]:
    return Call(
        "POST",
        route(sandbox_id, "/commands"),
        body=spec.given(),
        parse=CommandResult.model_validate,
        timeout=_run_timeout(spec.timeout),
    )


def run_code(sandbox_id: str, spec: CodeSpec) -> Call[Execution]:
    return Call(
        "POST",
        route(sandbox_id, "/interpreter"),
        body=spec.given(),
        parse=Execution.model_validate,
        timeout=_run_timeout(spec.timeout),
    )


def read_file(sandbox_id: str, path: str) -> Call[bytes]:
    return Call("GET", route(sandbox_id, "/files"), params={"path": path}, answer="bytes")


def write_file(sandbox_id: str, path: str, data: str | bytes) -> Call[None]:
    raw = data.encode() if isinstance(data, str) else bytes(data)
    return Call(
        "PUT", route(sandbox_id, "/files"), params={"path": path}, content=raw, answer="none"
    )


def list_files(sandbox_id: str, path: str) -> Call[list[EntryInfo]]:
    return Call(
        "GET",
        route(sandbox_id, "/files/list"),
        params={"path": path},
        parse=_ENTRIES.validate_python,
    )


def exists(sandbox_id: str, path: str) -> Call[bool]:
    return Call(
        "GET",
        route(sandbox_id, "/files/exists"),
        params={"path": path},
        parse=lambda data: bool(data["exists"]),
    )


def remove(sandbox_id: str, path: str) -> Call[None]:
    return Call("DELETE", route(sandbox_id, "/files"), params={"path": path}, answer="none")


def make_dir(sandbox_id: str, path: str) -> Call[None]:
    return Call("POST", route(sandbox_id, "/files/mkdir"), params={"path": path}, answer="none")


# -- streamed runs --------------------------------------------------------------------------


def stream_path(call: Call[Any]) -> str:
    """The streamed variant of a :func:`run_command` / :func:`run_code` call's route."""
    return call.path + "/stream"


def feed(
    event: Mapping[str, Any],
    model: type[M],
    on_stdout: OutputCallback | None,
    on_stderr: OutputCallback | None,
) -> M | None:
    """Handle one event of a streamed run: output goes to its callback (None is returned);
    the last event is the result (returned as ``model``) or the typed error (raised)."""
    kind = event.get("type")
    if kind == "stdout" and on_stdout is not None:
        on_stdout(event["data"])
    elif kind == "stderr" and on_stderr is not None:
        on_stderr(event["data"])
    elif kind == "result":
        return model.model_validate(event["result"])
    elif kind == "error":
        raise from_wire(event["error"])
    return None
