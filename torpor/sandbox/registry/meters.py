"""Usage meters carried by the transitions log: pure functions, no I/O.

Every transition row carries the sandbox's **cumulative** meters up to that instant, so a
sandbox's usage over ``[since, until)`` is ``at(until) - at(since)``: two index seeks per
sandbox, whatever the length of its history (a usage report over 10,000 sandboxes reads 40,000
rows, not the millions of transitions a month makes).

The meters (all since the sandbox was created):

* ``vcpu_seconds``: allocated vCPUs x seconds the machine was up (creating, waking, running,
  pausing: the states in which a QEMU process holds the machine);
* ``cpu_seconds``: vCPU-seconds the machine actually used, from the QEMU process's CPU time
  (``utime + stime``) read at each transition that leaves a state in which it runs (a new
  process starts at create and at each wake, so a reading there counts from zero); capped at
  the allocation. A stretch with no reading at its end (the last milliseconds of a pause,
  after which QEMU is gone; a machine still running) is estimated at the share of its
  allocation the machine used in the last stretch that was read (``cpu_ratio``), and at the
  whole allocation when none ever was (never less than the truth is billed);
* ``ram_gib_seconds``: GiB of guest RAM x seconds up;
* ``paused_byte_seconds``: bytes the sandbox alone owns on disk (its RAM file, state file and
  disk overlay, not the shared template or frozen layers) x seconds paused, with the bytes
  measured when the pause was written.

Between two rows every meter grows linearly (that is how :func:`interpolate` reads a meter at
any instant); after the last row it grows at the rate of the state the sandbox is in (the used
CPU of a stretch still open estimated as above until its reading).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torpor.sandbox.models import SandboxState

__all__ = [
    "UP_STATES",
    "MeterRow",
    "Meters",
    "accrue",
    "extrapolate",
    "interpolate",
    "meter_row",
    "meters_from_columns",
    "stored_rows",
]

S = SandboxState

#: states in which a QEMU process holds the machine (vCPUs and RAM are allocated)
UP_STATES = frozenset({S.CREATING, S.WAKING, S.RUNNING, S.PAUSING})
#: states in which a new QEMU process starts, so a CPU reading there starts from zero
_FRESH_PROCESS = frozenset({S.CREATING, S.WAKING})


@dataclass(slots=True)
class Meters:
    """Cumulative usage of one sandbox (see the module docstring for the units). Treated as
    a value: never changed in place (not frozen only because a frozen dataclass is several
    times slower to make, and a usage report makes tens of thousands)."""

    vcpu_seconds: float = 0.0
    cpu_seconds: float = 0.0
    ram_gib_seconds: float = 0.0
    paused_byte_seconds: float = 0.0

    def __add__(self, other: Meters) -> Meters:
        return Meters(
            self.vcpu_seconds + other.vcpu_seconds,
            self.cpu_seconds + other.cpu_seconds,
            self.ram_gib_seconds + other.ram_gib_seconds,
            self.paused_byte_seconds + other.paused_byte_seconds,
        )

    def __sub__(self, other: Meters) -> Meters:
        return Meters(
            self.vcpu_seconds - other.vcpu_seconds,
            self.cpu_seconds - other.cpu_seconds,
            self.ram_gib_seconds - other.ram_gib_seconds,
            self.paused_byte_seconds - other.paused_byte_seconds,
        )

    def scaled(self, factor: float) -> Meters:
        return Meters(
            self.vcpu_seconds * factor,
            self.cpu_seconds * factor,
            self.ram_gib_seconds * factor,
            self.paused_byte_seconds * factor,
        )


@dataclass(slots=True)
class MeterRow:
    """What metering needs of one transition row: when, into which state, the QEMU process's
    CPU seconds read then (None: no process, or unreadable), the bytes owned from then on (set
    on entering ``paused``), the cumulative meters at that instant, and the share of its
    allocation the machine used in the last stretch that was read (None: never read). A value,
    like :class:`Meters`."""

    at: float
    state: SandboxState
    cpu_reading: float | None = None
    owned_bytes: int | None = None
    meters: Meters = field(default_factory=Meters)
    cpu_ratio: float | None = None


def _segment(
    prev: MeterRow, at: float, cpu_reading: float | None, vcpus: int, memory_mib: int
) -> tuple[Meters, float | None]:
    """The usage accrued from ``prev`` to ``at`` (the sandbox stayed in ``prev.state``), and
    the used share of the allocation to carry on (``prev.cpu_ratio`` unless this stretch was
    read)."""
    dt = max(0.0, at - prev.at)
    ratio = prev.cpu_ratio
    if prev.state in UP_STATES:
        allocated = vcpus * dt
        base = 0.0 if prev.state in _FRESH_PROCESS else prev.cpu_reading
        if cpu_reading is not None and base is not None and cpu_reading >= base:
            used = min(allocated, cpu_reading - base)
            if allocated > 0:
                ratio = used / allocated
        else:
            used = allocated * (1.0 if ratio is None else ratio)
        return Meters(allocated, used, memory_mib / 1024 * dt, 0.0), ratio
    if prev.state is S.PAUSED:
        return Meters(paused_byte_seconds=(prev.owned_bytes or 0) * dt), ratio
    return Meters(), ratio


def accrue(
    prev: MeterRow | None,
    at: float,
    state: SandboxState,
    *,
    vcpus: int,
    memory_mib: int,
    cpu_reading: float | None = None,
    owned_bytes: int | None = None,
) -> MeterRow:
    """The row for a transition into ``state`` at ``at``, following ``prev`` (None: the
    sandbox's first row, all meters zero). ``owned_bytes`` not given on entering ``paused``
    keeps the bytes of the previous pause."""
    if prev is None:
        return MeterRow(at, state, cpu_reading, owned_bytes, Meters())
    if owned_bytes is None and state is S.PAUSED:
        owned_bytes = prev.owned_bytes
    accrued, ratio = _segment(prev, at, cpu_reading, vcpus, memory_mib)
    return MeterRow(at, state, cpu_reading, owned_bytes, prev.meters + accrued, ratio)


def extrapolate(last: MeterRow, at: float, *, vcpus: int, memory_mib: int) -> Meters:
    """The meters at ``at``, after the sandbox's last row ``last`` (it is still in that state;
    the used CPU of an up-stretch still open is estimated, see the module docstring)."""
    if at <= last.at:
        return last.meters
    return last.meters + _segment(last, at, None, vcpus, memory_mib)[0]


def interpolate(before: MeterRow, after: MeterRow, at: float) -> Meters:
    """The meters at ``at`` between two consecutive rows (each meter grows linearly between
    them)."""
    span = after.at - before.at
    if at <= before.at or span <= 0:
        return before.meters
    if at >= after.at:
        return after.meters
    return before.meters + (after.meters - before.meters).scaled((at - before.at) / span)


def meter_row(values: Sequence[Any]) -> MeterRow:
    """A transition's meter columns (``dst, at, cpu, owned, vcpu, used, ram, paused, ratio``,
    as both registries select them) as a :class:`MeterRow`."""
    dst, at, cpu, owned, vcpu, used, ram, paused, ratio = tuple(values)
    return MeterRow(at, SandboxState(dst), cpu, owned, Meters(vcpu, used, ram, paused), ratio)


def meters_from_columns(
    columns: Sequence[Any], instants: Sequence[float], *, vcpus: int, memory_mib: int
) -> tuple[list[Meters], MeterRow | None]:
    """A sandbox's meters at each of ``instants``, from the meter columns both registries
    select per instant (the last row at or before it, then the first row after it; a missing
    row's columns are NULL), and the last row before the last instant (None: none)."""
    width = len(columns) // (2 * len(instants)) if instants else 0
    values: list[Meters] = []
    last: MeterRow | None = None
    for i, t in enumerate(instants):
        b = columns[2 * i * width : (2 * i + 1) * width]
        a = columns[(2 * i + 1) * width : (2 * i + 2) * width]
        before = None if b[0] is None else meter_row(b)
        last = before
        if before is None:
            values.append(Meters())
        elif a[0] is None:
            values.append(extrapolate(before, t, vcpus=vcpus, memory_mib=memory_mib))
        else:
            values.append(interpolate(before, meter_row(a), t))
    return values, last


def stored_rows(kind: str, items: Iterable[Mapping[str, Any]]) -> list[tuple[Any, ...]]:
    """The usage ledger's rows for stored things of ``kind`` (see ``record_stored``)."""
    return [
        (
            kind,
            item["id"],
            item["tenant"],
            item["name"],
            json.dumps(dict(item.get("labels") or {}), sort_keys=True),
            int(item["bytes"]),
            float(item["started_at"]),
            item.get("expires_at"),
        )
        for item in items
    ]
