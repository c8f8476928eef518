"""Snapshots and forks of a running sandbox on real QEMU (marked qemu): the source is never
paused, woken or re-channelled, a snapshot taken while the guest writes restores to a
consistent file system, and two forks of a live source do not share random state.

One test, one manager: under TCG every wake costs a fraction of a second.
"""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest

from torpor.config import paths
from torpor.errors import Conflict, EngineError
from torpor.sandbox.checkpoints import Checkpoints
from torpor.sandbox.manager import SandboxManager
from torpor.sandbox.models import SandboxState as S
from torpor.sandbox.vm import machine_dir

pytestmark = pytest.mark.qemu

#: a guest process that appends numbered lines (flushed, fsynced every 20) and rewrites a
#: rotating set of small files, as fast as it can: the disk is busy at every instant
WRITER = r"""
import os
os.makedirs('/root/churn', exist_ok=True)
with open('/root/lines.txt', 'a') as f:
    i = 0
    while True:
        f.write(f'{i}\n')
        f.flush()
        if i % 20 == 0:
            os.fsync(f.fileno())
        with open(f'/root/churn/f{i % 50}', 'w') as g:
            g.write(str(i) * 100)
        i += 1
"""


def _lines_are_whole(text: str) -> int:
    """The writer's file holds 0, 1, 2 ... with no gap (a last line may be cut): its count."""
    lines = text.split("\n")
    whole = lines[:-1]  # after the last newline: a line being written, or nothing
    assert whole, "the writer wrote nothing"
    assert [int(x) for x in whole] == list(range(len(whole)))
    return len(whole)


def _disk_fsck(frozen: Path, scratch: Path) -> str:
    """Flatten a frozen dir's disk, replay its journal and check the file system read-only;
    return e2fsck's report (raises CalledProcessError if the file system is damaged)."""
    raw = scratch / "disk.raw"
    subprocess.run(
        ["qemu-img", "convert", "-U", "-O", "raw", str(frozen / "disk.qcow2"), str(raw)],
        check=True,
    )
    subprocess.run(["e2fsck", "-p", "-E", "journal_only", str(raw)], check=False)
    done = subprocess.run(["e2fsck", "-fn", str(raw)], capture_output=True, text=True, check=True)
    raw.unlink()
    return done.stdout


def test_live_snapshot_and_fork_leave_the_source_running(
    qemu_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main() -> None:
        m = SandboxManager(paths(qemu_home))
        await m.start(supervise=False)
        cp = Checkpoints(m)
        try:
            src = await m.create(name="live-src")
            await m.run_code(src.id, "import random\nv = 'kept-in-ram'")
            await m.write_file(src.id, "/root/writer.py", WRITER)
            await m.run_command(src.id, "nohup python3 /root/writer.py >/dev/null 2>&1 &")
            for _ in range(300):  # an interpreter starts slowly under TCG
                await asyncio.sleep(0.1)
                out = await m.run_command(src.id, "wc -l < /root/lines.txt 2>/dev/null || echo 0")
                if int(out.stdout.strip() or 0) >= 50:
                    break
            live = m.live(src.id)
            machine, channel = live.machine, live.channel
            seen = len(m.registry.transitions(src.id))

            snap = await cp.snapshot(src.id, name="while-writing")
            assert cp.last_downtime is not None and cp.last_downtime > 0
            kids = await cp.fork(src.id, count=2)

            # the source was never paused, woken or re-channelled: same QEMU, same channel,
            # no transition recorded, and it still runs its writer and holds its variable
            assert m.live(src.id).machine is machine and m.live(src.id).channel is channel
            assert m.registry.transitions(src.id)[seen:] == []
            assert (await m.get(src.id)).state is S.RUNNING
            assert (await m.run_code(src.id, "v")).text == "'kept-in-ram'"
            first = _lines_are_whole((await m.read_file(src.id, "/root/lines.txt")).decode())
            await asyncio.sleep(0.5)
            assert _lines_are_whole((await m.read_file(src.id, "/root/lines.txt")).decode()) > (
                first
            )

            # two forks of a live source diverge: interpreter RNG and the kernel's entropy
            drawn = [(await m.run_code(k.id, "random.random()")).text for k in kids]
            drawn.append((await m.run_code(src.id, "random.random()")).text)
            assert len(set(drawn)) == 3, drawn
            urandom = [
                (await m.run_command(k.id, "head -c 16 /dev/urandom | od -An -tx1")).stdout
                for k in kids
            ]
            assert urandom[0] != urandom[1]
            for k in kids:
                assert (await m.run_code(k.id, "v")).text == "'kept-in-ram'"
            # each child of a fork of many started on a RAM file of its own
            child_rams = [m.directory(k.id) / "ram" for k in kids]
            assert not child_rams[0].samefile(child_rams[1])

            # a fork of one child starts the child's QEMU before the source stops (its RAM is
            # filled in place): the source runs on untouched, the child has its RAM and a
            # whole file from the writer, which goes on writing in it; two such forks differ
            ones = [(await cp.fork(src.id, count=1))[0] for _ in range(2)]
            assert m.live(src.id).machine is machine and m.live(src.id).channel is channel
            assert m.registry.transitions(src.id)[seen:] == []
            for k in ones:
                assert (await m.run_code(k.id, "v")).text == "'kept-in-ram'"
                at_fork = _lines_are_whole((await m.read_file(k.id, "/root/lines.txt")).decode())
                await asyncio.sleep(0.5)
                text = (await m.read_file(k.id, "/root/lines.txt")).decode()
                assert _lines_are_whole(text) > at_fork
            drawn = [(await m.run_code(k.id, "random.random()")).text for k in ones]
            assert drawn[0] != drawn[1]

            # a one-child fork that fails before its child starts (a taken name) or after
            # (its state cannot be handed over) leaves nothing: no child, no QEMU, no frozen
            # RAM; the source runs on
            def frozen_rams() -> set[Path]:
                return {f for f in cp.snapshots.frozen_root.rglob("ram*") if f.is_file()}

            before, rams = {i.id for i in await m.list()}, frozen_rams()
            with pytest.raises(Conflict):
                await cp.fork(src.id, count=1, names=[ones[0].name])

            def refuse(src_dir: Path, dst: Path) -> None:
                raise EngineError(f"cannot give {dst} the state (test)")

            monkeypatch.setattr(machine_dir, "link_state", refuse)
            with pytest.raises(EngineError, match="the state"):
                await cp.fork(src.id, count=1)
            monkeypatch.undo()

            # the same for a fork of many whose copy into one child fails after the stop
            def refuse_fill(ram: Path, dst: Path, state: Path | None = None) -> None:
                raise EngineError(f"cannot fill {dst} (test)")

            monkeypatch.setattr(machine_dir, "fill_pending", refuse_fill)
            with pytest.raises(EngineError, match="cannot fill"):
                await cp.fork(src.id, count=3)
            monkeypatch.undo()
            assert {i.id for i in await m.list()} == before
            assert frozen_rams() == rams
            assert (await m.run_code(src.id, "v")).text == "'kept-in-ram'"
            assert m.live(src.id).machine is machine

            # the snapshot restores to the instant it was taken: RAM and disk agree, the
            # writer's file is whole, and the restored guest writes on
            restored = await cp.restore(snap.id)
            text = (await m.read_file(restored.id, "/root/lines.txt")).decode()
            at_snapshot = _lines_are_whole(text)
            await asyncio.sleep(0.5)
            text = (await m.read_file(restored.id, "/root/lines.txt")).decode()
            assert _lines_are_whole(text) > at_snapshot
            # and its disk alone (no RAM) is a consistent file system once its journal plays
            assert snap.status == "capturing"  # restored above from its local frozen copy
            assert (await cp.wait_stored(snap.id)).status == "stored"
            frozen = await asyncio.to_thread(cp.snapshots.materialize, snap.id)
            report = await asyncio.to_thread(_disk_fsck, frozen, tmp_path)
            assert "clean" in report or "files" in report
        finally:
            for info in await m.list():
                await m.kill(info.id)
            await m.close(pause=False)

    asyncio.run(main())


def test_a_create_from_the_clone_pool_is_a_fresh_reseeded_machine(qemu_home: Path) -> None:
    from torpor.sandbox import template as templates
    from torpor.sandbox.engine import QemuEngine

    async def main() -> None:
        engine = QemuEngine(paths(qemu_home), pool_size=1)
        snap = Path(templates.get("python").snapshot_dir)
        m = SandboxManager(paths(qemu_home), engine=engine)
        await m.start(supervise=False)
        try:
            a = await m.create(name="first")  # the pool is empty: cloned, then a refill starts
            for _ in range(1200):
                if engine.pool.ready("python", snap):
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)
            (pooled,) = engine.pool.ready("python", snap)
            b = await m.create(name="second")
            assert not pooled.exists()  # b is that clone, moved into its directory
            assert (await m.get(b.id)).state is S.RUNNING
            draws = [
                (await m.run_code(x.id, "import random; random.random()")).text for x in (a, b)
            ]
            assert draws[0] != draws[1]
            ids = [
                (await m.run_command(x.id, "cat /proc/sys/kernel/random/boot_id")).stdout
                for x in (a, b)
            ]
            assert ids[0] == ids[1]  # the same booted machine underneath ...
            assert (m.directory(b.id) / "machine.json").read_text() != (
                m.directory(a.id) / "machine.json"
            ).read_text()  # ... with its own VM generation id
        finally:
            for info in await m.list():
                await m.kill(info.id)
            await m.close(pause=False)
            engine.pool.drain()

    asyncio.run(main())


def test_the_live_path_runs_under_kvm_where_kvm_works(qemu_home: Path) -> None:
    """Where the accelerator probe finds a working KVM the template runs under it, and a live
    snapshot (stop, switch, save, RAM copy, cont) runs there too; elsewhere this says why not."""
    from torpor.sandbox import template as templates
    from torpor.sandbox.vm.accel import probe

    info = templates.get("python")
    report = probe(kernel=Path(info.kernel))
    if report.accel != "kvm":
        pytest.skip(f"no usable KVM on this host: {report.reason}")
    assert info.accel == "kvm", "KVM works here but the template was built for TCG"

    async def main() -> None:
        m = SandboxManager(paths(qemu_home))
        await m.start(supervise=False)
        cp = Checkpoints(m)
        try:
            src = await m.create(name="kvm-src")
            await m.run_code(src.id, "v = 7")
            snap = await cp.snapshot(src.id, name="under-kvm")
            assert cp.last_downtime is not None
            restored = await cp.restore(snap.id)
            assert (await m.run_code(restored.id, "v")).text == "7"
        finally:
            for s in await m.list():
                await m.kill(s.id)
            await m.close(pause=False)

    asyncio.run(main())
