"""A sandbox's row as both registries keep it, and the pure mapping between rows and records.

:class:`SandboxRecord` is one row of ``sandboxes``; :func:`record_from_row` reads it back from
the columns :data:`SANDBOX_COLUMNS` names, in that order (the SQLite and PostgreSQL registries
select them alike, see :mod:`torpor.sandbox.registry.base`). The machine's size, environment
variables and memory scope travel in one JSON column, ``spec`` (:func:`spec_json`).
:func:`events_from_rows` turns transitions rows into the events a user sees.

Nothing here does I/O.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from functools import lru_cache
from typing import Any

from torpor.errors import InvalidArgument, InvalidState
from torpor.sandbox.models import SandboxEvent, SandboxInfo, SandboxState
from torpor.sandbox.registry.lifecycle import event_kind
from torpor.sandbox.requests import MAX_LABELS

__all__ = [
    "SANDBOX_COLUMNS",
    "UNSET",
    "SandboxRecord",
    "Unset",
    "check_labels",
    "events_from_rows",
    "moved",
    "record_from_row",
    "spec_json",
    "spec_size",
]

#: the columns of ``sandboxes`` a record is read from, in :func:`record_from_row`'s order
SANDBOX_COLUMNS = (
    "id",
    "tenant",
    "name",
    "template",
    "state",
    "labels",
    "spec",
    "idle_pause_seconds",
    "pause_retention_days",
    "created_at",
    "last_active_at",
    "paused_at",
    "error",
)

_STATES = {state.value: state for state in SandboxState}


def _dt(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=UTC)


@dataclass(frozen=True)
class SandboxRecord:
    """One row of the registry."""

    id: str
    tenant: str
    name: str
    template: str
    state: SandboxState
    labels: dict[str, str] = field(default_factory=dict)
    vcpus: int = 1
    memory_mib: int = 512
    idle_pause_seconds: int | None = None
    pause_retention_days: int = 30
    #: environment variables of every command and of the interpreter; never in the info
    envs: dict[str, str] = field(default_factory=dict, repr=False)
    created_at: float = field(default_factory=time.time)
    last_active_at: float = field(default_factory=time.time)
    paused_at: float | None = None
    error: str | None = None
    #: the memory scope its agent reaches from inside (``MemoryScope.record()``), or None
    memory_scope: dict[str, Any] | None = None
    #: cluster mode: when the current pause was stored off-node (None: not, or not paused;
    #: always None on one machine, where nothing leaves the disk)
    durable_at: float | None = None
    #: cluster mode: why the current pause is not durable yet (an upload being retried)
    upload_error: str | None = None

    def to_info(self, *, reused: bool = False) -> SandboxInfo:
        """The public :class:`SandboxInfo` for this row."""
        return SandboxInfo(
            id=self.id,
            name=self.name,
            tenant=self.tenant,
            template=self.template,
            state=self.state,
            reused=reused,
            labels=dict(self.labels),
            vcpus=self.vcpus,
            memory_mib=self.memory_mib,
            idle_pause_seconds=self.idle_pause_seconds,
            pause_retention_days=self.pause_retention_days,
            created_at=_dt(self.created_at),
            last_active_at=_dt(self.last_active_at),
            error=self.error,
            paused_at=None if self.expires_at is None else _dt(self.paused_at or 0.0),
            expires_at=None if self.expires_at is None else _dt(self.expires_at),
            memory_scope=None if self.memory_scope is None else dict(self.memory_scope),
            durable=None if self.durable_at is None else _dt(self.durable_at),
            upload_error=self.upload_error,
        )

    @property
    def expires_at(self) -> float | None:
        """When a paused sandbox's pause is deleted (None unless paused)."""
        if self.state is not SandboxState.PAUSED or self.paused_at is None:
            return None
        return self.paused_at + self.pause_retention_days * 86400

    def with_state(self, state: SandboxState, **changes: Any) -> SandboxRecord:
        return replace(self, state=state, **changes)


@lru_cache(maxsize=256)
def _spec(text: str) -> tuple[int, int, tuple[tuple[str, str], ...], str | None]:
    """(vcpus, memory_mib, envs, memory_scope as JSON) of a spec column (cached: most
    sandboxes share a few specs; nothing mutable is cached, so no caller can change it)."""
    spec = json.loads(text or "{}")
    scope = spec.get("memory_scope")
    return (
        int(spec.get("vcpus", 1)),
        int(spec.get("memory_mib", 512)),
        tuple(sorted((spec.get("envs") or {}).items())),
        None if scope is None else json.dumps(scope),
    )


def record_from_row(
    row: Sequence[Any], *, durable_at: float | None = None, upload_error: str | None = None
) -> SandboxRecord:
    """The record of a row whose first columns are :data:`SANDBOX_COLUMNS` (more may
    follow); ``durable_at`` and ``upload_error`` come from elsewhere (the cluster's pauses)."""
    vcpus, memory_mib, envs, scope = _spec(row[6])
    return SandboxRecord(
        id=row[0],
        tenant=row[1],
        name=row[2],
        template=row[3],
        state=_STATES[row[4]],
        labels=json.loads(row[5] or "{}"),
        vcpus=vcpus,
        memory_mib=memory_mib,
        envs=dict(envs),
        idle_pause_seconds=row[7],
        pause_retention_days=row[8],
        created_at=row[9],
        last_active_at=row[10],
        paused_at=row[11],
        error=row[12],
        memory_scope=None if scope is None else json.loads(scope),
        durable_at=durable_at,
        upload_error=upload_error,
    )


def spec_json(
    vcpus: int,
    memory_mib: int,
    envs: Mapping[str, str],
    memory_scope: Mapping[str, Any] | None = None,
) -> str:
    """The ``spec`` column: the machine's size, the sandbox's environment variables and the
    memory scope its agent reaches from inside."""
    spec: dict[str, Any] = {"vcpus": vcpus, "memory_mib": memory_mib}
    if envs:
        spec["envs"] = dict(envs)
    if memory_scope is not None:
        spec["memory_scope"] = dict(memory_scope)
    return json.dumps(spec, sort_keys=True)


def spec_size(text: str | None) -> tuple[int, int]:
    """(vcpus, memory_mib) of a ``spec`` column (the defaults when it says nothing)."""
    spec = json.loads(text or "{}")
    return int(spec.get("vcpus", 1)), int(spec.get("memory_mib", 512))


def check_labels(labels: Mapping[str, str]) -> dict[str, str]:
    """``labels`` as a plain dict. Raises InvalidArgument unless it maps non-empty strings
    to strings, at most :data:`~torpor.sandbox.requests.MAX_LABELS` of them (a merge of a
    request's labels over a sandbox's can pass a request's own limit)."""
    if len(labels) > MAX_LABELS:
        raise InvalidArgument(f"a sandbox has at most {MAX_LABELS} labels, not {len(labels)}")
    out: dict[str, str] = {}
    for key, value in labels.items():
        if not isinstance(key, str) or not isinstance(value, str) or not key:
            raise InvalidArgument(
                f"labels must map non-empty strings to strings: {key!r}", label=str(key)
            )
        out[key] = value
    return out


class Unset:
    """The type of :data:`UNSET`: a keyword not given (None is a value: "never")."""


UNSET = Unset()


def moved(sandbox_id: str, actual: SandboxState, expected: SandboxState) -> InvalidState:
    """The error of a compare-and-set that found the sandbox in another state."""
    return InvalidState(
        f"sandbox {sandbox_id} is {actual.value}, expected {expected.value}",
        sandbox_id=sandbox_id,
        state=actual.value,
        required=[expected.value],
    )


def events_from_rows(rows: Iterable[Sequence[Any]], after: int) -> tuple[list[SandboxEvent], int]:
    """Transitions rows ``(seq, sandbox_id, src, dst, at, reason, name)`` as the events a
    user sees (see :func:`~torpor.sandbox.registry.lifecycle.event_kind`), and the ``seq`` to
    continue from."""
    out: list[SandboxEvent] = []
    last = after
    for seq, sandbox_id, src_text, dst_text, at, reason, name in rows:
        last = int(seq)
        src = SandboxState(src_text) if src_text else None
        dst = SandboxState(dst_text)
        kind = event_kind(src, dst, reason)
        if kind is not None:
            out.append(
                SandboxEvent(
                    seq=int(seq),
                    at=_dt(at),
                    sandbox_id=sandbox_id,
                    name=name,
                    kind=kind,
                    state=dst,
                    reason=reason,
                )
            )
    return out, last
