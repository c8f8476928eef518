"""Build a usage report from what the registry recorded, priced by the rate card.

Sandboxes: their cumulative meters at ``since`` and ``until`` (see
:mod:`torpor.sandbox.registry.meters`; the difference is the window's usage). Snapshots and
volumes: the registry's ledger of stored things (:meth:`sync_stored` enters what the stores
hold and ends what they no longer do), each billed for its bytes over the part of the window
it existed, a snapshot no later than its expiry.

:func:`price` and :func:`stored_in_window` are pure; :func:`build` does the reading.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from torpor.config import Paths
from torpor.sandbox.models import SandboxState
from torpor.sandbox.registry import AnyRegistry, SandboxRecord
from torpor.sandbox.registry.meters import Meters
from torpor.sandbox.registry.usage.models import (
    Costs,
    RetentionCost,
    UsageLine,
    UsageQuery,
    UsageReport,
    parse_query,
)
from torpor.sandbox.registry.usage.rates import GB, GIB, MONTH_HOURS, RateCard
from torpor.sandbox.storage.snapshots import SnapshotStore
from torpor.sandbox.storage.volumes import VolumeStore

__all__ = ["build", "price", "stored_in_window", "sync_stored"]

_MIB = 1024**2


def stored_in_window(item: Mapping[str, Any], since: float, until: float) -> float:
    """Seconds of ``[since, until)`` during which a ledger row (``started_at``, ``ended_at``,
    ``expires_at``) was stored."""
    end = until
    for bound in (item.get("ended_at"), item.get("expires_at")):
        if bound is not None:
            end = min(end, float(bound))
    return max(0.0, end - max(since, float(item["started_at"])))


def price(quantities: Mapping[str, Any], rates: RateCard) -> dict[str, float]:
    """The costs (:class:`Costs` fields) of a line's ``quantities`` at ``rates``."""
    cpu_hours = quantities["cpu_hours" if rates.cpu_basis == "used" else "vcpu_hours"]
    cost = {
        "cpu": cpu_hours * rates.cpu_vcpu_hour,
        "memory": quantities["ram_gib_hours"] * rates.memory_gib_hour,
        "paused": quantities["paused_gb_months"] * rates.paused_gb_month,
        "snapshots": quantities["snapshot_gb_months"] * rates.snapshot_gb_month,
        "volumes": quantities["volume_gib_hours"] * rates.volume_gib_hour,
    }
    cost["total"] = sum(cost.values())
    return cost


def _line(quantities: dict[str, Any], rates: RateCard) -> UsageLine:
    # made without re-validation: every value here was computed by this module
    return UsageLine.model_construct(
        **quantities, cost=Costs.model_construct(None, **price(quantities, rates))
    )


def sync_stored(
    registry: AnyRegistry,
    paths: Paths,
    *,
    now: float | None = None,
    snapshots: SnapshotStore | None = None,
    volume_store: VolumeStore | None = None,
) -> None:
    """Bring the registry's ledger of stored things in line with the snapshot and volume
    stores: enter (or update: size, labels, expiry) every snapshot and volume there is, and
    end the ones that are gone. ``snapshots``: the snapshot store (default the home's own; a
    cluster node's sees every node's snapshots, while its volumes are its own: volumes other
    nodes hold are then not ended here). ``volume_store``: the volume store (default the home's own;
    a cluster node's sees every node's volumes). Raises StorageError.

    Only rows the ledger held before the stores were listed are ended: a row another sync
    (the GC's, another report's, another node's) entered meanwhile is for a thing made after
    this listing, not a gone one."""
    now = time.time() if now is None else now
    store = snapshots or SnapshotStore(paths)
    entered: dict[str, set[str]] = {"snapshot": set(), "volume": set()}
    for row in registry.stored(live=True):
        entered.setdefault(row["kind"], set()).add(row["id"])
    infos = [
        {
            "id": info.id,
            "tenant": info.tenant,
            "name": info.name,
            "bytes": info.stored_bytes,
            "started_at": info.created_at.timestamp(),
            "labels": {**info.carried.labels, **info.labels},
            "expires_at": info.expires_at.timestamp(),
        }
        for info, _ in store.manifests()
    ]
    volumes = [
        {
            "id": vol.id,
            "tenant": vol.tenant,
            "name": vol.name,
            "bytes": vol.size_mib * _MIB,
            "started_at": vol.created_at.timestamp(),
            "labels": dict(vol.labels),
        }
        for vol in (volume_store or VolumeStore(paths)).list_all()
    ]
    for kind, items in (("snapshot", infos), ("volume", volumes)):
        registry.record_stored(kind, items)
        if kind == "volume" and store.catalog.shared and volume_store is None:
            continue  # this node's volumes only: a deleted one was ended by its delete
        gone = entered[kind] - {i["id"] for i in items}
        if gone:
            registry.end_stored(kind, gone, now)


def _group(
    rec_labels: Mapping[str, str], rec_id: str, tenant: str, query: UsageQuery
) -> str | None:
    if query.label is not None:
        return rec_labels.get(query.label)
    return rec_id if query.by == "sandbox" else tenant


#: the quantities a line sums, in the order :func:`_lines_for` accumulates them
_QUANTITIES = (
    "sandboxes",
    "snapshots",
    "volumes",
    "vcpu_hours",
    "cpu_hours",
    "ram_gib_hours",
    "paused_gb_months",
    "snapshot_gb_months",
    "volume_gib_hours",
)
_PAUSED = 1 / GB / 3600 / MONTH_HOURS  # byte-seconds -> GB-months


def _lines_for(
    records: Iterable[tuple[SandboxRecord, list[Meters], Any]],
    stored: Iterable[Mapping[str, Any]],
    query: UsageQuery,
) -> list[dict[str, Any]]:
    """One dict of quantities per group (``key``, ``name`` and :data:`_QUANTITIES`)."""
    since, until = query.since.timestamp(), query.until.timestamp()
    sums: dict[str | None, list[float]] = {}
    names: dict[str | None, str] = {}
    zero = Meters()
    for rec, (start, end, *_), _ in records:
        used = end - start
        if rec.created_at >= until or (used == zero and rec.state is SandboxState.STOPPED):
            continue
        key = _group(rec.labels, rec.id, rec.tenant, query)
        acc = sums.setdefault(key, [0.0] * len(_QUANTITIES))
        names.setdefault(key, rec.name)
        acc[0] += 1
        acc[3] += used.vcpu_seconds / 3600
        acc[4] += used.cpu_seconds / 3600
        acc[5] += used.ram_gib_seconds / 3600
        acc[6] += used.paused_byte_seconds * _PAUSED
    for item in stored:
        seconds = stored_in_window(item, since, until)
        if seconds <= 0:
            continue
        key = _group(item["labels"], item["id"], item["tenant"], query)
        acc = sums.setdefault(key, [0.0] * len(_QUANTITIES))
        names.setdefault(key, item["name"])
        if item["kind"] == "snapshot":
            acc[1] += 1
            acc[7] += item["bytes"] / GB * seconds / 3600 / MONTH_HOURS
        else:
            acc[2] += 1
            acc[8] += item["bytes"] / GIB * seconds / 3600
    by_sandbox = query.by == "sandbox"
    return [
        {
            "key": key,
            "name": names.get(key) if by_sandbox else None,
            **{
                field: int(value) if i < 3 else value
                for i, (field, value) in enumerate(zip(_QUANTITIES, acc, strict=True))
            },
        }
        for key, acc in sums.items()
    ]


def _retention(
    records: Iterable[tuple[SandboxRecord, list[Meters], Any]],
    stored: Iterable[Mapping[str, Any]],
    query: UsageQuery,
    rates: RateCard,
    now: float,
) -> list[RetentionCost]:
    out: list[RetentionCost] = []
    for rec, _, last in records:  # last: the sandbox's last row at ``now``
        ends = rec.expires_at
        if ends is None or ends <= now:
            continue
        owned = int((last.owned_bytes if last is not None else 0) or 0)
        per_day = owned / GB * rates.paused_gb_month * 24 / MONTH_HOURS
        out.append(
            RetentionCost.model_construct(
                kind="sandbox",
                id=rec.id,
                name=rec.name,
                key=_group(rec.labels, rec.id, rec.tenant, query),
                bytes=owned,
                retention_days=rec.pause_retention_days,
                expires_at=datetime.fromtimestamp(ends, UTC),
                cost_per_day=per_day,
                projected_cost=per_day * (ends - now) / 86400,
            )
        )
    for item in stored:
        ends = item.get("expires_at")
        if item["kind"] != "snapshot" or item.get("ended_at") is not None or ends is None:
            continue
        if ends <= now:
            continue
        per_day = item["bytes"] / GB * rates.snapshot_gb_month * 24 / MONTH_HOURS
        out.append(
            RetentionCost.model_construct(
                kind="snapshot",
                id=item["id"],
                name=item["name"],
                key=_group(item["labels"], item["id"], item["tenant"], query),
                bytes=item["bytes"],
                retention_days=max(1, round((ends - item["started_at"]) / 86400)),
                expires_at=datetime.fromtimestamp(ends, UTC),
                cost_per_day=per_day,
                projected_cost=per_day * (ends - now) / 86400,
            )
        )
    return out


def build(
    registry: AnyRegistry,
    paths: Paths | None = None,
    *,
    tenant: str | None = None,
    by: str = "tenant",
    since: Any = None,
    until: Any = None,
    rates: RateCard | None = None,
    now: datetime | None = None,
    snapshots: SnapshotStore | None = None,
) -> UsageReport:
    """The usage report of ``tenant`` (None: every tenant) grouped ``by`` over ``[since,
    until)``. ``paths``: the home whose snapshot and volume stores are synced into the ledger
    first (None: use the ledger as it is) and whose ``rates.json`` prices it (unless
    ``rates``); ``snapshots``: its snapshot store (a cluster node's: see
    :func:`sync_stored`). Raises InvalidArgument (a bad query or rates.json) or StorageError."""
    now = now or datetime.now(UTC)
    query = parse_query(by, since, until, now=now)
    if rates is None:
        rates = RateCard.of(paths) if paths is not None else RateCard()
    if paths is not None:
        sync_stored(registry, paths, now=now.timestamp(), snapshots=snapshots)
    instants: tuple[float, ...] = (query.since.timestamp(), query.until.timestamp())
    if instants[1] < now.timestamp():  # a past window: what a retention costs is from now on
        instants += (now.timestamp(),)
    records = registry.meters_at(instants, tenant=tenant)
    stored = registry.stored(tenant=tenant)
    groups = _lines_for(records, stored, query)
    lines = [_line(group, rates) for group in groups]
    lines.sort(key=lambda item: (-item.cost.total, item.key or ""))
    total = {"key": None, "name": None}
    total.update({f: sum(group[f] for group in groups) for f in _QUANTITIES})
    return UsageReport(
        by=query.by,
        tenant=tenant,
        since=query.since,
        until=query.until,
        rates=rates,
        lines=lines,
        total=_line(total, rates),
        retention=_retention(records, stored, query, rates, now.timestamp()),
    )
