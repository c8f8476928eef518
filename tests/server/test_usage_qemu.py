"""Usage of a real microVM's pause/wake cycle, metered end to end: the real server (auto-started
by the SDK), QEMU's own CPU time read at each transition, the bytes the pause owns on disk, the
report over HTTP, and retention changed after the fact."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from tests.served import stop_server_and_vms
from torpor.client import Runtime, Sandbox
from torpor.config import paths
from torpor.sandbox.models import SandboxState as S
from torpor.sandbox.registry import Registry

pytestmark = pytest.mark.qemu

BURN = "python3 -c 'x = 0\nfor i in range(2_000_000): x += i\nprint(x)'"


@pytest.fixture
def home(qemu_home: Path) -> Iterator[Path]:
    yield qemu_home
    stop_server_and_vms(qemu_home)


def test_a_pause_wake_cycle_is_metered(home: Path) -> None:
    rt = Runtime(home=home)
    since = datetime.now(UTC) - timedelta(seconds=1)
    start = time.monotonic()
    sbx = Sandbox.get_or_create("agent-u-1", labels={"user": "u-1"}, runtime=rt)
    seen_up = time.monotonic()
    assert sbx.commands.run(BURN, timeout=300).exit_code == 0
    seen_up = time.monotonic() - seen_up  # the machine was up at least this long
    sbx.pause()
    time.sleep(1.0)
    sbx.resume()
    sbx.pause()
    wall = time.monotonic() - start + 1.0  # it cannot have been up longer than this

    report = rt.usage(by="label:user", since=since)
    (line,) = report.lines
    assert line.key == "u-1" and line.sandboxes == 1
    vcpus = sbx.info.vcpus
    assert seen_up * vcpus <= line.vcpu_hours * 3600 <= wall * vcpus
    # QEMU's CPU time was read: used is what the process spent, never above the allocation
    assert 0 < line.cpu_hours <= line.vcpu_hours
    assert line.ram_gib_hours == pytest.approx(line.vcpu_hours / vcpus * sbx.info.memory_mib / 1024)
    assert line.paused_gb_months > 0 and line.cost.total > 0

    reg = Registry(paths(home).registry)  # read beside the server (WAL)
    try:
        steps = reg.meters_at((time.time(),), tenant="default")
        ((rec, _, last),) = steps
        assert rec.state is S.PAUSED and last is not None
        owned = last.owned_bytes
        assert owned is not None and owned > 1 << 20  # the RAM and state files, at least
        assert last.cpu_ratio is not None  # a stretch was read from /proc
    finally:
        reg.close()

    info = sbx.set_retention(90)
    assert info.paused_at is not None and info.expires_at is not None
    assert info.expires_at - info.paused_at == timedelta(days=90)
    (kept,) = rt.usage(since=since).retention
    assert kept.id == sbx.id and kept.retention_days == 90 and kept.bytes == owned
    assert kept.projected_cost == pytest.approx(kept.cost_per_day * 90, rel=0.01)
