"""Snapshots, restore, fork, volumes and drives on real QEMU microVMs (marked qemu).

Each test shares one manager per test and keeps boots few: under TCG a wake costs ~0.5 s.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from torpor.config import paths
from torpor.errors import (
    Conflict,
    CorruptData,
    EngineError,
    InvalidArgument,
    SnapshotNotFound,
    StorageError,
)
from torpor.sandbox.checkpoints import Checkpoints
from torpor.sandbox.manager import SandboxManager
from torpor.sandbox.models import SandboxState
from torpor.sandbox.vm import machine_dir

pytestmark = pytest.mark.qemu
T = TypeVar("T")
RUNNING = SandboxState.RUNNING


def _run(home: Path, body: Callable[[SandboxManager, Checkpoints], Awaitable[T]]) -> T:
    async def main() -> T:
        manager = SandboxManager(paths(home))
        await manager.start(supervise=False)
        try:
            return await body(manager, Checkpoints(manager))
        finally:
            for info in await manager.list():
                await manager.kill(info.id)
            await manager.close(pause=False)

    return asyncio.run(main())


def _live_ids(manager: SandboxManager) -> set[str]:
    return {r.id for r in manager.registry.list() if r.state is not SandboxState.STOPPED}


def test_snapshot_restore_and_fork(qemu_home: Path) -> None:
    async def body(m: SandboxManager, cp: Checkpoints) -> None:
        src = await m.create(
            name="agent-u-42",
            labels={"user": "u-42"},
            idle_pause_seconds=600,
            pause_retention_days=90,
            envs={"TORPOR_USER": "u-42", "TORPOR_KEY": "k1"},
        )
        await m.run_code(src.id, "notes = ['prefers weekly summaries']")
        await m.write_file(src.id, "/workspace/ledger.csv", "plan,pro\n")
        snap = await cp.snapshot(src.id, name="u-42-before", retention_days=30)
        assert (await m.get(src.id)).state is SandboxState.RUNNING  # kept running
        assert [s.id for s in cp.list_snapshots()] == [snap.id]
        # the agent's step goes badly
        await m.run_command(src.id, "rm -rf /workspace/*")
        await m.run_code(src.id, "notes.clear()")
        await asyncio.sleep(3)  # the snapshot's clock is now behind the host's
        await cp.settle()  # stored, with a spare clone the restore moves in
        assert cp.get_snapshot(snap.id).status == "stored"
        assert cp.snapshots.captures.spare_of(snap.id).is_dir()
        restored = await cp.restore(snap.id, labels={"restored": "yes"}, envs={"TORPOR_KEY": "k2"})
        # the source's settings came along: traceable to its user, still pausing when idle
        assert restored.labels == {"user": "u-42", "restored": "yes"}
        assert restored.idle_pause_seconds == 600
        assert restored.pause_retention_days == 90
        # and its envs, the one given overriding the source's (commands and the interpreter)
        env = await m.run_command(restored.id, 'echo "$TORPOR_USER $TORPOR_KEY"')
        assert env.stdout == "u-42 k2\n"
        env_py = await m.run_code(restored.id, "import os\nos.environ['TORPOR_KEY']")
        assert env_py.text == "'k2'"
        guest_now = float((await m.run_code(restored.id, "import time\ntime.time()")).text or 0)
        assert abs(guest_now - time.time()) < 2  # the clock was set from the host
        out = await m.run_code(restored.id, "notes")
        assert out.text == "['prefers weekly summaries']"
        assert await m.read_file(restored.id, "/workspace/ledger.csv") == b"plan,pro\n"
        assert not await m.exists(src.id, "/workspace/ledger.csv")  # source unaffected
        # three forks of one snapshot (one takes the spare made again after the restore):
        # independent, and with different randomness
        await cp.settle()
        assert cp.snapshots.captures.spare_of(snap.id).is_dir()
        kids = await cp.fork_snapshot(snap.id, count=3, labels={"strategy": "try"})
        draws = set()
        for k in kids:
            r = await m.run_code(k.id, "import random, os\n(random.random(), os.urandom(16).hex())")
            draws.add(r.text)
            assert k.labels == {"user": "u-42", "strategy": "try"}  # carried over, then updated
            assert k.idle_pause_seconds == 600
        assert len(draws) == 3
        # the children moved to running in one commit, each move logged on its own row
        steps = [[(t.src, t.dst) for t in m.registry.transitions(k.id)] for k in kids]
        assert steps == [[(None, SandboxState.CREATING), (SandboxState.CREATING, RUNNING)]] * 3
        assert len({m.registry.transitions(k.id)[-1].at for k in kids}) == 1
        # each child's QEMU started on a RAM file of its own (the spare's or a copy)
        rams = [m.directory(k.id) / "ram" for k in kids]
        assert len({(r.stat().st_dev, r.stat().st_ino) for r in rams}) == 3
        # a copy into a started child that fails leaves no child and no QEMU behind
        before = {i.id for i in await m.list()}
        dirs = set(m.paths.sandboxes.iterdir())

        def refuse(ram: Path, dst: Path, state: Path | None = None) -> None:
            raise EngineError(f"cannot fill {dst} (test)")

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(machine_dir, "fill_pending", refuse)
            with pytest.raises(EngineError, match="cannot fill"):
                await cp.fork_snapshot(snap.id, count=3)
        assert {i.id for i in await m.list()} == before
        assert set(m.paths.sandboxes.iterdir()) == dirs
        # that commit refused (the registry's disk full): no child is left either
        real = m.registry.set_states

        def full(moves: Any, **kw: Any) -> Any:
            if len(moves) > 1:
                raise StorageError("the registry's disk is full (test)")
            return real(moves, **kw)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(m.registry, "set_states", full)
            with pytest.raises(StorageError, match="disk is full"):
                await cp.fork_snapshot(snap.id, count=2)
        assert {i.id for i in await m.list()} == before
        assert set(m.paths.sandboxes.iterdir()) == dirs
        await m.write_file(kids[0].id, "/workspace/mine.txt", "kid 0")
        assert not await m.exists(kids[1].id, "/workspace/mine.txt")
        # a live fork of a paused sandbox: it stays paused
        await m.pause(src.id)
        live_kids = await cp.fork(src.id, count=2)
        assert (await m.get(src.id)).state is SandboxState.PAUSED
        assert {k.state for k in live_kids} == {SandboxState.RUNNING}
        env = await m.run_command(live_kids[0].id, 'echo "$TORPOR_USER $TORPOR_KEY"')
        assert env.stdout == "u-42 k1\n"  # a live fork keeps its source's envs too
        assert (await m.run_code(live_kids[0].id, "notes")).text == "[]"

    _run(qemu_home, body)


def test_bad_input_leaves_nothing_behind(qemu_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torpor.sandbox.storage.chunks import ChunkStore

    real_put = ChunkStore._put_known
    disk = {"full": False, "writes": 0}

    def put(self: ChunkStore, digest: str, data: bytes, **kw: Any) -> int:
        disk["writes"] += 1
        if disk["full"] and disk["writes"] > 3:
            raise StorageError("No space left on device", chunk=digest)
        return real_put(self, digest, data, **kw)

    monkeypatch.setattr(ChunkStore, "_put_known", put)
    monkeypatch.setenv("TORPOR_SNAPSHOT_CACHE", "0")  # a restore reads the (bad) chunks

    async def body(m: SandboxManager, cp: Checkpoints) -> None:
        src = await m.create()
        await m.run_code(src.id, "x = 7")
        disk["full"] = True  # the disk fills up during the snapshot
        with pytest.raises(StorageError):
            await cp.snapshot(src.id, name="full", wait=True)
        disk["full"] = False
        assert cp.list_snapshots() == []
        assert (await m.get(src.id)).state is SandboxState.RUNNING
        assert (await m.run_code(src.id, "x")).text == "7"
        for count in (0, 17, -1):
            with pytest.raises(InvalidArgument):
                await cp.fork(src.id, count=count)
        snap = await cp.snapshot(src.id, name="s", wait=True)
        assert snap.status == "stored" and cp.snapshots.cached(snap.id) is None
        with pytest.raises(Conflict):
            await cp.snapshot(src.id, name="s")
        before = _live_ids(m)
        # flip a byte in one stored chunk: restore fails naming the snapshot
        chunk = next(iter(cp.snapshots.chunks))
        path = cp.snapshots.chunks.path_of(chunk)
        blob = bytearray(path.read_bytes())
        blob[len(blob) // 2] ^= 0xFF
        path.chmod(0o600)
        path.write_bytes(bytes(blob))
        with pytest.raises(CorruptData) as err:
            await cp.restore(snap.id)
        assert err.value.data["snapshot_id"] == snap.id
        cp.delete_snapshot(snap.id)
        with pytest.raises(SnapshotNotFound):
            await cp.restore(snap.id)
        assert _live_ids(m) == before  # no half-made sandbox
        assert (await m.run_code(src.id, "x")).text == "7"  # the source is unharmed

    _run(qemu_home, body)


def test_volumes_and_drives(qemu_home: Path) -> None:
    async def body(m: SandboxManager, cp: Checkpoints) -> Any:
        vol = cp.volumes.create("memory-u-42", size_mib=64)
        a = await cp.create(volumes=[{"volume": vol.id, "path": "/memory"}])
        await m.run_command(a.id, "echo '- prefers weekly summaries' >> /memory/facts.md && sync")
        with pytest.raises(Conflict):  # a second read-write attach
            await cp.create(volumes=[{"volume": vol.id, "path": "/memory"}])
        with pytest.raises(Conflict, match="volumes are never part of a snapshot"):
            await cp.snapshot(a.id, name="with-volume")
        with pytest.raises(InvalidArgument):
            await cp.create(volumes=[{"volume": vol.id, "path": "/etc"}])
        await m.kill(a.id)
        b = await cp.create(volumes=[{"volume": vol.id, "path": "/memory", "read_only": True}])
        facts = await m.read_file(b.id, "/memory/facts.md")
        assert facts == b"- prefers weekly summaries\n"  # survived the sandbox that wrote it
        await m.kill(b.id)

        drive = cp.drives.create("research")
        writer = await cp.create(drives=[{"drive": drive.id, "path": "/shared"}])
        reader = await cp.create(drives=[{"drive": drive.id, "path": "/shared"}])
        await m.write_file(writer.id, "/shared/handoff.md", "step 1 done")
        assert await m.read_file(reader.id, "/shared/handoff.md") == b"step 1 done"
        # pause/wake with a drive: unmounted around the hibernate, mounted again after
        await m.pause(reader.id)
        await m.write_file(writer.id, "/shared/later.md", "step 2")
        assert await m.read_file(reader.id, "/shared/later.md") == b"step 2"
        # a busy drive cannot be unmounted: pausing is a Conflict, not a hang, and it runs on
        await m.run_command(reader.id, "cd /shared && sleep 600", background=True)
        with pytest.raises(Conflict, match="busy"):
            await m.pause(reader.id)
        assert (await m.get(reader.id)).state is SandboxState.RUNNING
        assert await m.read_file(reader.id, "/shared/later.md") == b"step 2"
        # a snapshot of a sandbox with a drive: the drive is not in it, but is mounted again
        snap = await cp.snapshot(writer.id, name="with-drive")
        await m.write_file(writer.id, "/shared/after-snapshot.md", "step 3")
        restored = await cp.restore(snap.id)
        assert await m.read_file(restored.id, "/shared/after-snapshot.md") == b"step 3"

    _run(qemu_home, body)


@pytest.fixture
def served_home(qemu_home: Path) -> Any:
    """``qemu_home`` with the real local server (auto-started by the SDK); stopped after."""
    from tests.served import stop_server_and_vms

    yield qemu_home
    stop_server_and_vms(qemu_home)


def test_issue_scenario_through_the_sdk(served_home: Path) -> None:
    """The issue's example, end to end: SDK -> local server -> checkpoints -> QEMU."""
    import torpor
    from torpor.client.storage import collect_garbage

    rt = torpor.Runtime(home=served_home)
    sbx = torpor.Sandbox.get_or_create("agent-u-42", runtime=rt)
    sbx.interpreter.run("notes = ['prefers weekly summaries']")
    sbx.files.write("/workspace/data.csv", "a,b\n")
    before = sbx.snapshot(name="u-42-before-import", retention_days=30)
    assert before.info.retention_days == 30
    assert [s.id for s in torpor.Snapshot.list(runtime=rt)] == [before.id]
    sbx.commands.run("rm -rf /workspace/*")
    restored = torpor.Sandbox.create(snapshot=before.id, runtime=rt)
    assert restored.interpreter.run("notes").text == "['prefers weekly summaries']"
    assert restored.files.read_text("/workspace/data.csv") == "a,b\n"
    forks = sbx.fork(count=2, labels={"strategy": "try"})
    assert len(forks) == 2 and all(f.info.labels["strategy"] == "try" for f in forks)
    kids = torpor.Sandbox.fork(before.id, count=1, runtime=rt)
    assert kids[0].files.read_text("/workspace/data.csv") == "a,b\n"
    with pytest.raises(InvalidArgument):
        sbx.fork(count=0)
    vol = torpor.Volume.create("memory-u-42", size_mib=64, runtime=rt)
    with torpor.Sandbox.create(volumes=[{"volume": vol.id, "path": "/memory"}], runtime=rt) as a:
        a.commands.run("echo '- prefers weekly summaries' >> /memory/facts.md && sync")
    with torpor.Sandbox.create(volumes=[{"volume": vol.id, "path": "/memory"}], runtime=rt) as b:
        assert b.files.read_text("/memory/facts.md") == "- prefers weekly summaries\n"
    drive = torpor.Drive.create("research", runtime=rt)
    reader = torpor.Sandbox.create(drives=[{"drive": drive.id, "path": "/shared"}], runtime=rt)
    reader.commands.run("echo hello > /shared/x.txt")
    assert (served_home / "drives" / drive.id / "x.txt").read_text() == "hello\n"
    before.delete()
    with pytest.raises(SnapshotNotFound):
        torpor.Sandbox.create(snapshot=before.id, runtime=rt)
    report = collect_garbage(runtime=rt)
    assert report["removed_chunks"] > 0  # the deleted snapshot's chunks, nothing else:
    assert restored.interpreter.run("1 + 1").text == "2"
    # what the server and QEMU wrote (guest RAM, disks, state, the registry) is the owner's only
    for f in [served_home / "registry.db", *(served_home / "sandboxes").rglob("*")]:
        if f.is_file() and not f.is_symlink():
            assert f.stat().st_mode & 0o077 == 0, f"{f} is readable by others"
