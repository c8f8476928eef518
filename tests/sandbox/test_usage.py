"""Usage metering and pricing over the registry's transitions, on a fake clock (no VMs).

The simulated month is the issue's: 1,000 users, each with a 2 vCPU / 4 GiB sandbox that is up
10 hours of the month (using 0.1 vCPU on average, as a simulated QEMU process's CPU readings
say) and paused the other 710 with 0.5 GB of its own on disk. Its published price is $364.44:
CPU $25.00 (used vCPU-hours) + memory $300.00 + paused storage $39.44.
"""

from __future__ import annotations

import json
import random
import sqlite3
from datetime import UTC, datetime
from pathlib import Path

import pytest

from torpor.config import Paths, paths
from torpor.errors import InvalidArgument
from torpor.sandbox.models import SandboxState as S
from torpor.sandbox.registry import SCHEMA_VERSION, Registry, SandboxRecord
from torpor.sandbox.registry.meters import MeterRow, Meters, accrue, interpolate
from torpor.sandbox.registry.usage import RateCard, build, parse_query
from torpor.sandbox.registry.usage.report import stored_in_window, sync_stored
from torpor.sandbox.storage.volumes import VolumeStore

HOUR = 3600.0
T0 = 1_790_000_000.0  # a fixed instant: the fake clock's start of the month
MONTH = 720 * HOUR
WAKE, PAUSE = 0.3, 0.05  # seconds a simulated wake and pause take (inside the up hours)


def _fast(reg: Registry) -> Registry:
    # the simulation writes tens of thousands of rows: no fsync per row in a throwaway file
    reg._db.execute("PRAGMA synchronous=OFF")
    return reg


@pytest.fixture
def reg(tmp_path: Path) -> Registry:
    return _fast(Registry(tmp_path / "registry.db"))


def simulate_user(
    reg: Registry,
    user: int,
    rng: random.Random,
    *,
    up_hours: float = 10.0,
    sessions: int = 10,
    paused_hours: float = 710.0,
    cpu_avg: float = 0.1,
    owned: int = 500_000_000,
    tenant: str = "acme",
) -> None:
    """One user's month: ``sessions`` up-stretches of equal length, separated by paused gaps
    of random lengths, the last gap running to the end of the month (no transition ends it).
    A simulated QEMU process reports ``cpu_avg`` vCPU-seconds per second since it started."""
    sid = f"sbx-{user:05d}"
    reg.insert(
        SandboxRecord(
            id=sid,
            tenant=tenant,
            name=f"agent-u-{user}",
            template="python",
            state=S.CREATING,
            labels={"user": f"u-{user}"},
            vcpus=2,
            memory_mib=4096,
            created_at=T0,
            last_active_at=T0,
        )
    )
    cuts = sorted(rng.uniform(0, paused_hours * HOUR) for _ in range(sessions - 1))
    gaps = [b - a for a, b in zip([0.0, *cuts], [*cuts, paused_hours * HOUR], strict=True)]
    up = up_hours * HOUR / sessions
    t, state = T0, S.CREATING
    for i in range(sessions):
        if i:  # wake: a new QEMU process starts
            reg.set_state(sid, S.PAUSED, S.WAKING, at=t)
            state = S.WAKING
        start = t
        reg.set_state(sid, state, S.RUNNING, at=t + WAKE, cpu_reading=cpu_avg * WAKE)
        reg.set_state(
            sid, S.RUNNING, S.PAUSING, at=t + up - PAUSE, cpu_reading=cpu_avg * (up - PAUSE)
        )
        reg.set_state(
            sid, S.PAUSING, S.PAUSED, at=start + up, owned_bytes=owned, paused_at=start + up
        )
        t = start + up + gaps[i]


def test_the_published_month(reg: Registry) -> None:
    rng = random.Random(8)
    for user in range(1000):
        simulate_user(reg, user, rng)
    end = datetime.fromtimestamp(T0 + MONTH, UTC)
    report = build(
        reg,
        tenant="acme",
        since=datetime.fromtimestamp(T0, UTC),
        until=end,
        now=end,
    )
    total = report.total
    assert total.sandboxes == 1000
    assert total.vcpu_hours == pytest.approx(1000 * 10 * 2)
    assert total.cpu_hours == pytest.approx(1000 * 10 * 0.1)
    assert total.ram_gib_hours == pytest.approx(1000 * 10 * 4)
    assert total.paused_gb_months == pytest.approx(1000 * 0.5 * 710 / 720)
    assert round(total.cost.cpu, 2) == 25.00
    assert round(total.cost.memory, 2) == 300.00
    assert round(total.cost.paused, 2) == 39.44
    assert round(total.cost.total, 2) == 364.44
    # by user: a line per user, each a thousandth of it
    by_user = build(reg, tenant="acme", by="label:user", since=T0, until=end, now=end)
    assert len(by_user.lines) == 1000
    assert {line.key for line in by_user.lines} == {f"u-{u}" for u in range(1000)}
    assert all(round(line.cost.total, 5) == 0.36444 for line in by_user.lines)
    # billed on allocation instead, CPU is 20x: 2 vCPUs allocated, 0.1 used
    allocated = build(
        reg,
        tenant="acme",
        since=T0,
        until=end,
        now=end,
        rates=RateCard(cpu_basis="allocated"),
    )
    assert round(allocated.total.cost.cpu, 2) == 500.00


def test_windows_add_up(reg: Registry) -> None:
    """Usage over two halves of the month is the usage over the month (meters are linear in
    time between rows, so a window can start or end anywhere)."""
    rng = random.Random(3)
    for user in range(20):
        simulate_user(reg, user, rng)
    end, mid = T0 + MONTH, T0 + MONTH * 0.37
    now = datetime.fromtimestamp(end, UTC)
    whole = build(reg, tenant="acme", since=T0, until=end, now=now).total
    first = build(reg, tenant="acme", since=T0, until=mid, now=now).total
    second = build(reg, tenant="acme", since=mid, until=end, now=now).total
    for field in ("vcpu_hours", "cpu_hours", "ram_gib_hours", "paused_gb_months"):
        assert getattr(first, field) + getattr(second, field) == pytest.approx(
            getattr(whole, field)
        )
    assert first.cost.total > 0 and second.cost.total > 0


def test_other_tenants_are_not_counted(reg: Registry) -> None:
    rng = random.Random(1)
    simulate_user(reg, 1, rng, tenant="acme")
    simulate_user(reg, 2, rng, tenant="globex")
    end = datetime.fromtimestamp(T0 + MONTH, UTC)
    acme = build(reg, tenant="acme", since=T0, until=end, now=end)
    assert acme.total.sandboxes == 1 and acme.tenant == "acme"
    everyone = build(reg, by="tenant", since=T0, until=end, now=end)
    assert {line.key for line in everyone.lines} == {"acme", "globex"}


def test_cpu_without_readings_counts_as_allocated() -> None:
    """No reading (a fake engine, an unreadable /proc): the whole allocation is billed; one
    reading sets the share used for the unread stretch that follows."""
    row = accrue(None, 0.0, S.CREATING, vcpus=2, memory_mib=1024)
    row = accrue(row, 10.0, S.RUNNING, vcpus=2, memory_mib=1024)
    assert row.meters.cpu_seconds == pytest.approx(20.0)
    read = accrue(row, 110.0, S.PAUSING, vcpus=2, memory_mib=1024, cpu_reading=60.0)
    # base is the reading before (None: creating -> running had none) -> allocated
    assert read.meters.cpu_seconds == pytest.approx(220.0)
    fresh = accrue(None, 0.0, S.CREATING, vcpus=2, memory_mib=1024)
    fresh = accrue(fresh, 10.0, S.RUNNING, vcpus=2, memory_mib=1024, cpu_reading=5.0)
    assert fresh.meters.cpu_seconds == pytest.approx(5.0) and fresh.cpu_ratio == 0.25
    later = accrue(fresh, 50.0, S.PAUSING, vcpus=2, memory_mib=1024)  # no reading
    assert later.meters.cpu_seconds == pytest.approx(5.0 + 0.25 * 80)
    # a reading above the allocation (clock skew, threads outside the vCPUs) is capped
    capped = accrue(fresh, 20.0, S.PAUSING, vcpus=2, memory_mib=1024, cpu_reading=500.0)
    assert capped.meters.cpu_seconds == pytest.approx(5.0 + 20.0)


def test_interpolate_between_rows() -> None:
    a = MeterRow(0.0, S.RUNNING, meters=Meters(0, 0, 0, 0))
    b = MeterRow(100.0, S.PAUSING, meters=Meters(200, 50, 100, 0))
    assert interpolate(a, b, 25.0) == Meters(50, 12.5, 25, 0)
    assert interpolate(a, b, -5.0) == a.meters and interpolate(a, b, 500.0) == b.meters


def test_killed_sandbox_stops_accruing(reg: Registry) -> None:
    reg.insert(
        SandboxRecord(
            id="sbx-k",
            tenant="t",
            name="k",
            template="python",
            state=S.CREATING,
            vcpus=1,
            memory_mib=1024,
            created_at=T0,
            last_active_at=T0,
        )
    )
    reg.set_state("sbx-k", S.CREATING, S.RUNNING, at=T0 + 1)
    reg.set_state("sbx-k", S.RUNNING, S.STOPPED, at=T0 + HOUR + 1)
    end = datetime.fromtimestamp(T0 + 10 * HOUR, UTC)
    total = build(reg, tenant="t", since=T0, until=end, now=end).total
    assert total.vcpu_hours == pytest.approx(1.0 + 1 / HOUR)
    assert total.ram_gib_hours == pytest.approx(1.0 + 1 / HOUR)
    # a window after the kill holds nothing of it
    late = build(reg, tenant="t", since=T0 + 2 * HOUR, until=end, now=end)
    assert late.lines == [] and late.total.cost.total == 0


def test_stored_things_are_billed_while_they_exist(reg: Registry) -> None:
    snapshot = {
        "id": "snap-1",
        "tenant": "t",
        "name": "s",
        "bytes": 2 * 10**9,
        "started_at": T0,
        "labels": {"user": "u-1"},
        "expires_at": T0 + 15 * 24 * HOUR,
    }
    reg.record_stored("snapshot", [snapshot])
    reg.record_stored("snapshot", [snapshot])  # again: one row, updated
    reg.record_stored(
        "volume",
        [{"id": "vol-1", "tenant": "t", "name": "v", "bytes": 10 * 1024**3, "started_at": T0}],
    )
    reg.end_stored("volume", {"vol-1"}, T0 + 100 * HOUR)
    end = datetime.fromtimestamp(T0 + MONTH, UTC)
    report = build(reg, tenant="t", by="label:user", since=T0, until=end, now=end)
    lines = {line.key: line for line in report.lines}
    assert lines["u-1"].snapshot_gb_months == pytest.approx(2 * 0.5)  # half a month to expiry
    assert lines["u-1"].cost.snapshots == pytest.approx(2 * 0.5 * 0.08)
    assert lines[None].volume_gib_hours == pytest.approx(10 * 100)  # this volume carries no labels
    assert lines[None].cost.volumes == pytest.approx(10 * 100 * 0.000153)
    assert stored_in_window({"started_at": 10, "ended_at": 5}, 0, 100) == 0


def test_a_labelled_volume_is_billed_to_its_label(tmp_path: Path) -> None:
    """A volume made with labels (a restricted token's carry its user) is on that label's
    line of a ``by=label:`` report, as a snapshot is; an unlabelled one stays on None."""
    home = paths(tmp_path / "home").ensure()
    store = VolumeStore(home)
    mine = store.create("mine", size_mib=16, labels={"user": "u-42"}, tenant="t")
    store.create("shared", size_mib=32, tenant="t")
    reg = Registry(home.registry)
    later = datetime.fromtimestamp(mine.created_at.timestamp() + HOUR, UTC)
    report = build(reg, home, tenant="t", by="label:user", since=mine.created_at, now=later)
    lines = {line.key: line for line in report.lines}
    assert lines["u-42"].volumes == 1 and lines[None].volumes == 1
    assert lines["u-42"].volume_gib_hours == pytest.approx(16 / 1024, rel=1e-3)


def test_two_ledger_syncs_at_once_keep_a_new_volume_billed(tmp_path: Path) -> None:
    """Two syncs of the ledger at once (the hourly GC, a usage report; two tenants' reports):
    the one that listed the volumes before a volume was made must not end the row the other
    entered for it since, or the volume is never billed again."""
    home = paths(tmp_path / "home").ensure()
    store = VolumeStore(home)
    reg = Registry(home.registry)

    class ListedEarlier:
        """The volume store as a sync saw it before ``vol`` was made, while another sync
        runs and enters it."""

        def list_all(self) -> list[object]:
            vol = store.create("vol", size_mib=16, tenant="t")
            sync_stored(reg, home, volume_store=store)  # the other sync: enters it
            assert [r["id"] for r in reg.stored(kind="volume", live=True)] == [vol.id]
            return []

    sync_stored(reg, home, volume_store=ListedEarlier())  # type: ignore[arg-type]
    (row,) = reg.stored(kind="volume")
    assert row["ended_at"] is None  # it still exists: billed on
    sync_stored(reg, home, volume_store=store)
    assert reg.stored(kind="volume", live=True) != []


def test_retention_cost_is_projected(reg: Registry) -> None:
    simulate_user(reg, 7, random.Random(2), sessions=1, up_hours=1, paused_hours=1)
    now = T0 + 5 * HOUR  # paused since T0 + 1h, retention 30 days
    report = build(reg, tenant="acme", since=T0, until=now, now=datetime.fromtimestamp(now, UTC))
    (item,) = report.retention
    assert item.kind == "sandbox" and item.bytes == 500_000_000 and item.retention_days == 30
    per_day = 0.5 * 0.08 / 30
    assert item.cost_per_day == pytest.approx(per_day)
    remaining = (T0 + HOUR + 30 * 86400 - now) / 86400
    assert item.projected_cost == pytest.approx(per_day * remaining)
    reg.update_settings("sbx-00007", pause_retention_days=365)
    longer = build(reg, tenant="acme", since=T0, until=now, now=datetime.fromtimestamp(now, UTC))
    assert longer.retention[0].projected_cost > 10 * item.projected_cost


def test_retention_cost_of_a_past_window_is_from_now(reg: Registry) -> None:
    """A report over a window that ended before the sandbox paused still projects its pause
    from now, with the bytes the pause owns (not the running row's none at the window's end)."""
    simulate_user(reg, 7, random.Random(2), sessions=1, up_hours=1, paused_hours=1)
    now = datetime.fromtimestamp(T0 + 5 * HOUR, UTC)  # paused since T0 + 1h
    past = build(reg, tenant="acme", since=T0, until=T0 + HOUR / 2, now=now)
    current = build(reg, tenant="acme", since=T0, until=now, now=now)
    assert past.retention == current.retention
    assert past.retention[0].bytes == 500_000_000
    assert past.total.vcpu_hours == pytest.approx(1.0)  # the window's usage is still its own


def test_rates_from_the_home(tmp_path: Path) -> None:
    home = Paths(tmp_path)
    assert RateCard.of(home) == RateCard()
    (tmp_path / "rates.json").write_text(json.dumps({"cpu_vcpu_hour": 0.05}))
    card = RateCard.of(home)
    assert card.cpu_vcpu_hour == 0.05 and card.memory_gib_hour == 0.0075
    for bad in ('{"cpu_vcpu_hour": -1}', '{"cpu_per_hour": 1}', "[1]", "{nope"):
        (tmp_path / "rates.json").write_text(bad)
        with pytest.raises(InvalidArgument):
            RateCard.of(home)


NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("by", "since", "until"),
    [
        pytest.param("user", None, None, id="by-unknown"),
        pytest.param("label:", None, None, id="by-empty-label"),
        pytest.param("tenant", "2026-12-05", None, id="since-future"),
        pytest.param("tenant", "2026-11-20", "2026-11-10", id="reversed"),
        pytest.param("tenant", "2026-11-20", "2026-11-20", id="empty"),
        pytest.param("tenant", "last tuesday", None, id="since-unparsable"),
        pytest.param("tenant", None, "soon", id="until-unparsable"),
        pytest.param("tenant", True, None, id="since-bool"),
        pytest.param("tenant", 1e300, None, id="since-overflow"),
    ],
)
def test_bad_queries_are_typed_errors(by: str, since: object, until: object) -> None:
    with pytest.raises(InvalidArgument):
        parse_query(by, since, until, now=NOW)  # type: ignore[arg-type]


def test_query_defaults_and_cut() -> None:
    q = parse_query(now=NOW)
    assert q.since == datetime(2026, 11, 1, tzinfo=UTC) and q.until == NOW and q.by == "tenant"
    q = parse_query("label:user", "2026-11-01T00:00:00Z", "2027-01-01", now=NOW)
    assert q.label == "user" and q.until == NOW  # a future end is cut to now


def test_migration_from_v1_keeps_rows_and_backfills(tmp_path: Path) -> None:
    """A registry written by the previous schema opens, keeps every row and meters them."""
    path = tmp_path / "r.db"
    db = sqlite3.connect(path)
    from torpor.sandbox.registry.sqlite import _SCHEMA_V1

    db.executescript(_SCHEMA_V1)
    db.execute(
        "INSERT INTO sandboxes VALUES ('sbx-old','default','old','python','paused','{}',"
        '\'{"vcpus": 2, "memory_mib": 2048}\',NULL,30,?,?,?,NULL)',
        (T0, T0, T0 + HOUR),
    )
    for src, dst, at in [(None, "creating", T0), ("creating", "running", T0)]:
        db.execute(
            "INSERT INTO transitions (sandbox_id, src, dst, at) VALUES ('sbx-old',?,?,?)",
            (src, dst, at),
        )
    db.execute(
        "INSERT INTO transitions (sandbox_id, src, dst, at) VALUES ('sbx-old',?,?,?)",
        ("running", "pausing", T0 + HOUR),
    )
    db.execute(
        "INSERT INTO transitions (sandbox_id, src, dst, at) VALUES ('sbx-old',?,?,?)",
        ("pausing", "paused", T0 + HOUR),
    )
    db.execute("PRAGMA user_version=1")
    db.commit()
    db.close()
    reg = Registry(path)
    assert reg.schema_version == SCHEMA_VERSION == 2
    assert [t.dst for t in reg.transitions("sbx-old")] == [
        S.CREATING,
        S.RUNNING,
        S.PAUSING,
        S.PAUSED,
    ]
    end = datetime.fromtimestamp(T0 + 2 * HOUR, UTC)
    total = build(reg, tenant="default", since=T0, until=end, now=end).total
    assert total.vcpu_hours == pytest.approx(2.0) and total.cpu_hours == pytest.approx(2.0)
    assert total.ram_gib_hours == pytest.approx(2.0) and total.paused_gb_months == 0


def test_a_clock_stepped_back_does_not_bill_a_killed_sandbox_for_ever(reg: Registry) -> None:
    """A transition whose clock reads earlier than the one before (an NTP step back, another
    node's clock) is logged at the previous instant: the report's seek by time then still
    finds the last state, and a sandbox killed in the step is not billed as running after."""
    reg.insert(
        SandboxRecord(
            id="sbx-c",
            tenant="t",
            name="c",
            template="python",
            state=S.CREATING,
            vcpus=1,
            memory_mib=1024,
            created_at=T0,
            last_active_at=T0,
        )
    )
    reg.set_state("sbx-c", S.CREATING, S.RUNNING, at=T0 + 10)
    reg.set_state("sbx-c", S.RUNNING, S.STOPPED, at=T0 + 8)  # the clock stepped back 2 s
    for hours in (1, 100):
        end = datetime.fromtimestamp(T0 + hours * HOUR, UTC)
        total = build(reg, tenant="t", since=T0, until=end, now=end).total
        assert total.vcpu_hours == pytest.approx(10 / HOUR)
    assert [t.at for t in reg.transitions("sbx-c")] == [T0, T0 + 10, T0 + 10]
