"""Usage in cluster mode: the PostgreSQL registry keeps the same meters and ledger as SQLite,
so one replay of transitions gives the same report on both (real PostgreSQL)."""

from __future__ import annotations

import random
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from torpor.sandbox.models import SandboxState as S
from torpor.sandbox.registry import Registry
from torpor.sandbox.registry.postgres import PostgresRegistry
from torpor.sandbox.registry.usage import build

try:  # plain pytest puts this directory on sys.path; a package layout needs the relative form
    from tests.sandbox.test_usage import HOUR, MONTH, T0, simulate_user
except ImportError:  # pragma: no cover
    from .test_usage import HOUR, MONTH, T0, simulate_user

pytestmark = [pytest.mark.postgres]


def _replay(reg: Any) -> None:
    rng = random.Random(5)
    for user in range(12):
        simulate_user(reg, user, rng, cpu_avg=0.05 * (user % 4), owned=(user + 1) * 10**8)
    # one killed mid-month, one still running at the end: both read differently from rows
    reg.set_state("sbx-00003", S.PAUSED, S.STOPPED, at=T0 + 300 * HOUR)
    reg.set_state("sbx-00004", S.PAUSED, S.WAKING, at=T0 + 715 * HOUR)
    reg.set_state("sbx-00004", S.WAKING, S.RUNNING, at=T0 + 715 * HOUR + 0.3, cpu_reading=0.1)
    snapshot = {
        "id": "snap-1",
        "tenant": "acme",
        "name": "s",
        "bytes": 2 * 10**9,
        "started_at": T0,
        "labels": {"user": "u-1"},
        "expires_at": T0 + 15 * 24 * HOUR,
    }
    reg.record_stored("snapshot", [snapshot])
    reg.record_stored(
        "volume",
        [{"id": "vol-1", "tenant": "acme", "name": "v", "bytes": 10 * 1024**3, "started_at": T0}],
    )
    assert reg.end_stored("volume", {"vol-1"}, T0 + 100 * HOUR) == 1
    assert reg.end_stored("volume", {"vol-1"}, T0 + 200 * HOUR) == 0  # ended once


def test_the_same_replay_gives_the_same_report_on_both_registries(tmp_path: Path, dsn: str) -> None:
    sqlite, pg = Registry(tmp_path / "registry.db"), PostgresRegistry(dsn)
    for reg in (sqlite, pg):
        _replay(reg)
    end = datetime.fromtimestamp(T0 + MONTH, UTC)
    for by, since in (("tenant", T0), ("label:user", T0), ("tenant", T0 + 200 * HOUR)):
        a, b = (
            build(r, tenant="acme", by=by, since=since, until=end, now=end) for r in (sqlite, pg)
        )
        assert a.total.vcpu_hours > 0 and a.total.paused_gb_months > 0
        assert a.total.snapshot_gb_months > 0
        assert (a.total.volume_gib_hours > 0) is (since == T0)  # the volume ended at 100 h
        assert _close(b.model_dump(mode="json"), a.model_dump(mode="json"))
    assert pg.stored(kind="volume", live=True) == []
    assert [r["id"] for r in pg.stored(tenant="acme")] == [
        r["id"] for r in sqlite.stored(tenant="acme")
    ]
    pg.close()
    sqlite.close()


def _close(a: Any, b: Any) -> bool:
    """Equal JSON trees, floats within 1e-9 relative (PostgreSQL and SQLite sum the same
    doubles)."""
    if isinstance(a, dict):
        assert set(a) == set(b)
        return all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list):
        assert len(a) == len(b)
        return all(_close(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float):
        assert a == pytest.approx(b, rel=1e-9)
        return True
    assert a == b
    return True
