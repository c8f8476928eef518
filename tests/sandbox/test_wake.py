"""Wake and create from the warm clone pool on real QEMU (marked qemu): a create that takes a
warm clone is a fresh, reseeded machine that no listing shows until it is a sandbox, and a
wake's first answer says, in the guest's own clock, where the wait went. The same runs under
KVM where the accelerator probe finds one that works (skipped with the probe's reason here).

One test per accelerator, one manager each: under TCG every wake costs a fraction of a second.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from torpor.config import paths
from torpor.sandbox import template as templates
from torpor.sandbox.engine import QemuEngine
from torpor.sandbox.manager import SandboxManager
from torpor.sandbox.models import SandboxState as S
from torpor.sandbox.vm.channel import wake_split
from torpor.sandbox.vm.machine import PRESTARTED
from torpor.sandbox.vm.pool import TENANT_FILE

pytestmark = pytest.mark.qemu


async def _warm_clones(engine: QemuEngine, snap: Path, n: int) -> list[Path]:
    """The pool's ready clones once ``n`` are there and warm (the filler is a thread)."""
    for _ in range(2400):
        ready = engine.pool.ready("python", snap)
        if len(ready) >= n and all((c / PRESTARTED).exists() for c in ready):
            await asyncio.sleep(0.2)  # the filler's last rename settles
            return engine.pool.ready("python", snap)
        await asyncio.sleep(0.05)
    raise AssertionError("the pool was not refilled with warm clones")


async def _pooled_creates_and_a_wake(home: Path) -> None:
    engine = QemuEngine(paths(home), pool_size=2)
    snap = Path(templates.get("python").snapshot_dir)
    m = SandboxManager(paths(home), engine=engine)
    await m.start(supervise=False)
    try:
        engine.pool.refill_soon("python", snap)
        pooled = await _warm_clones(engine, snap, 2)
        assert await m.list() == []  # pooled clones are nobody's sandbox
        a = await m.create(name="a")
        b = await m.create(name="b")
        assert not any(c.exists() for c in pooled)  # both came from the pool ...
        for made in (a, b):  # ... whole: their QEMU resumed, the state consumed
            d = m.directory(made.id)
            assert not (d / PRESTARTED).exists() and not (d / "state").exists()
            assert not (d / TENANT_FILE).exists()
            assert (await m.get(made.id)).state is S.RUNNING
        assert sorted(s.name for s in await m.list()) == ["a", "b"]
        draws = [(await m.run_code(x.id, "import random; random.random()")).text for x in (a, b)]
        assert draws[0] != draws[1]  # reseeded on take, like any fork
        assert (m.directory(a.id) / "machine.json").read_text() != (
            m.directory(b.id) / "machine.json"
        ).read_text()  # each its own VM generation id

        await m.run_code(a.id, "kept = 41")
        # the draw after next of a seeded generator, then the generator at its first draw
        await m.run_code(
            a.id,
            "random.seed(5)\nnext_one = [random.random() for _ in range(2)][1]\n"
            "random.seed(5)\nrandom.random()",
        )
        await m.pause(a.id)
        await asyncio.sleep(3)  # the guest's clock stands still meanwhile ...
        await m.resume(a.id)
        # ... and a plain wake sets it, but does not reseed: no other guest shares this state
        guest_now = float((await m.run_code(a.id, "import time; time.time()")).text or "0")
        assert abs(guest_now - time.time()) < 2.0
        assert (await m.run_code(a.id, "random.random() == next_one")).text == "True"
        live = m.live(a.id)
        marks = live.channel.guest_marks  # type: ignore[union-attr]
        resumed_at = live.machine.resumed_at  # type: ignore[union-attr]
        split = wake_split(marks, resumed_at)
        assert 0 <= split["data"] <= split["served"] <= split["answered"] == split["received"]
        assert (await m.run_code(a.id, "kept + 1")).text == "42"
    finally:
        for info in await m.list():
            await m.kill(info.id)
        await m.close(pause=False)
        engine.pool.drain()


def test_pooled_creates_are_fresh_machines_and_a_wake_splits_its_wait(qemu_home: Path) -> None:
    asyncio.run(_pooled_creates_and_a_wake(qemu_home))


def test_the_same_under_kvm_where_kvm_works(qemu_home: Path) -> None:
    """Where the accelerator probe finds a working KVM the template runs under it, and pooled
    creates and a wake run there too; elsewhere this says why not."""
    from torpor.sandbox.vm.accel import probe

    info = templates.get("python")
    report = probe(kernel=Path(info.kernel))
    if report.accel != "kvm":
        pytest.skip(f"no usable KVM on this host: {report.reason}")
    assert info.accel == "kvm", "KVM works here but the template was built for TCG"
    asyncio.run(_pooled_creates_and_a_wake(qemu_home))
