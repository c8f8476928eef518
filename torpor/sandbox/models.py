"""The data that crosses layers: what a command, a file listing and an execution return.

These are plain pydantic models so the same classes serve the library, the HTTP API and the
client. Execution results follow Jupyter's MIME-bundle shape: ``result.data["text/plain"]``.
"""

from __future__ import annotations

import enum
from datetime import datetime
from typing import Any

from pydantic import BaseModel, Field

from torpor.errors import InvalidArgument

__all__ = [
    "CommandResult",
    "DrainReport",
    "DrainedSandbox",
    "EntryInfo",
    "EventPage",
    "Execution",
    "ExecutionError",
    "NodeStatus",
    "ProcessInfo",
    "Result",
    "SandboxEvent",
    "SandboxInfo",
    "SandboxState",
    "parse_labels",
]


class SandboxState(enum.StrEnum):
    """The lifecycle of a sandbox (the transitions: ``torpor.sandbox.registry.lifecycle``)."""

    CREATING = "creating"
    RUNNING = "running"
    PAUSING = "pausing"
    PAUSED = "paused"
    WAKING = "waking"
    STOPPED = "stopped"
    ERROR = "error"


class CommandResult(BaseModel):
    """A finished shell command."""

    exit_code: int
    stdout: str = ""
    stderr: str = ""
    pid: int | None = None


class ProcessInfo(BaseModel):
    """A background process started with ``commands.run(..., background=True)``."""

    pid: int
    cmd: str


class EntryInfo(BaseModel):
    """One entry of a directory listing."""

    name: str
    path: str
    type: str  # "file" | "dir" | "symlink" | "other"
    size: int


class Result(BaseModel):
    """One displayed value: a MIME bundle such as ``{"text/plain": "42"}``."""

    data: dict[str, Any] = Field(default_factory=dict)
    is_main_result: bool = True

    @property
    def text(self) -> str | None:
        value = self.data.get("text/plain")
        return None if value is None else str(value)


class ExecutionError(BaseModel):
    """An exception raised by interpreted code."""

    name: str
    value: str
    traceback: str


class Execution(BaseModel):
    """What ``interpreter.run(code)`` returns."""

    results: list[Result] = Field(default_factory=list)
    stdout: str = ""
    stderr: str = ""
    error: ExecutionError | None = None

    @property
    def text(self) -> str | None:
        """The ``text/plain`` of the main result, if any."""
        for r in self.results:
            if r.is_main_result:
                return r.text
        return None


class SandboxInfo(BaseModel):
    """What the registry knows about a sandbox."""

    id: str
    name: str
    tenant: str = "default"
    template: str
    state: SandboxState
    reused: bool = False
    labels: dict[str, str] = Field(default_factory=dict)
    vcpus: int = 1
    memory_mib: int = 512
    idle_pause_seconds: int | None = None
    pause_retention_days: int = 30
    created_at: datetime
    last_active_at: datetime
    error: str | None = None
    #: while paused: since when, and when the pause is deleted (``paused_at`` +
    #: ``pause_retention_days``) unless the sandbox is woken first or its retention extended
    #: (``get_or_create(name, pause_retention_days=...)``)
    paused_at: datetime | None = None
    expires_at: datetime | None = None
    #: the memory its agent reaches at ``localhost:7777`` (levels, ``read_only``), or None
    memory_scope: dict[str, Any] | None = None
    #: bytes of disk the sandbox alone holds: its RAM file, saved state and disk overlay (not
    #: the template's base image it shares); None when not measured (a killed sandbox: 0)
    owned_bytes: int | None = None
    #: whether it has a network card to the internet (``internet=`` at create); None when
    #: not known (a killed sandbox)
    internet: bool | None = None
    #: cluster mode (``torpor serve --cluster``): when the current pause was copied off this
    #: node into the shared store, so it wakes on any node even if this one dies; None while
    #: running, while the upload runs, or on one machine (the embedded default: nothing
    #: leaves the disk)
    durable: datetime | None = None
    #: cluster mode: why the current pause is not durable yet (an upload failed and is being
    #: retried); None otherwise
    upload_error: str | None = None


class SandboxEvent(BaseModel):
    """One lifecycle event of a sandbox, from the registry's transitions log.

    ``kind`` is what happened: ``create``, ``pause``, ``wake``, ``kill``, ``expire`` (a pause
    kept past ``pause_retention_days``), ``error`` (state lost), ``pause-failed`` /
    ``wake-failed`` (rolled back, nothing lost). ``seq`` grows with every event of the home:
    ``events(after=seq)`` continues where a reader left off.
    """

    seq: int
    at: datetime
    sandbox_id: str
    name: str
    kind: str
    state: SandboxState
    reason: str = ""


def parse_labels(items: list[str] | None, *, what: str = "label") -> dict[str, str] | None:
    """``["user=u-42", "tier=pro"]`` -> ``{"user": "u-42", "tier": "pro"}``; None for none.

    Raises :class:`~torpor.errors.InvalidArgument` (naming the item as ``what``) for an item
    without ``=`` or with an empty key.
    """
    if not items:
        return None
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InvalidArgument(f"{what} {item!r} is not KEY=VALUE", label=item)
        out[key] = value
    return out


class EventPage(BaseModel):
    """A page of lifecycle events and where the next page starts (``after=next``)."""

    events: list[SandboxEvent] = Field(default_factory=list)
    next: int = 0


class NodeStatus(BaseModel):
    """One node as ``GET /v1/nodes`` and ``torpor nodes`` show it. On one machine (no cluster)
    the single row is this machine, named ``local``, always alive."""

    name: str
    url: str = ""
    alive: bool
    draining: bool = False
    heartbeat_age_seconds: float | None = None  # None: this machine, no cluster
    accelerator: str
    cpu_model: str
    capacity_mib: int  # host RAM
    vcpus: int
    sandboxes: int  # running sandboxes it holds
    memory_mib: int  # their guest RAM
    this: bool = False  # the node that answered


class DrainedSandbox(BaseModel):
    """A sandbox a drain moved off its node: paused, durable and released (or why not)."""

    id: str
    name: str
    tenant: str
    state: SandboxState
    durable: datetime | None = None
    error: str | None = None
    #: the drives that keep it on the node (a drive is a directory of its node)
    drives: list[str] = Field(default_factory=list)


class DrainReport(BaseModel):
    """What ``torpor node drain`` did: the node no longer takes sandboxes; ``moved`` are
    paused, durable and released (any node wakes them); ``failed`` are not (``error`` says
    why, and ``drives`` when drives keep them there; they stay on the node)."""

    node: str
    moved: list[DrainedSandbox] = Field(default_factory=list)
    failed: list[DrainedSandbox] = Field(default_factory=list)
