"""Waking a clone's children (``Cloner.wake_children``) on the fake engine: they move to
``running`` in one commit, and a failure or a cancellation leaves none of them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest

from tests.sandbox.fakes import FakeEngine
from torpor.config import paths
from torpor.errors import GuestError
from torpor.sandbox.checkpoints.clones import Cloner
from torpor.sandbox.manager import SandboxManager
from torpor.sandbox.models import SandboxState as S
from torpor.sandbox.registry import SandboxRecord
from torpor.sandbox.storage.drives import DriveStore


async def _children(m: SandboxManager, engine: FakeEngine, count: int) -> list[SandboxRecord]:
    now = time.time()
    recs = [
        SandboxRecord(
            id=f"sbx-kid{i}",
            tenant="default",
            name=f"kid{i}",
            template="python",
            state=S.CREATING,
            created_at=now,
            last_active_at=now,
        )
        for i in range(count)
    ]
    m.registry.insert_many(recs, reason="forked")
    for rec in recs:
        await engine.clone("python", m.directory(rec.id), m._config(rec))
    return recs


def _run(tmp_path: Path, body: object) -> None:
    async def main() -> None:
        engine = FakeEngine()
        m = SandboxManager(paths(tmp_path / "home"), engine=engine)
        try:
            await body(m, engine, Cloner(m, DriveStore(m.paths)))  # type: ignore[operator]
        finally:
            await m.close(pause=False)

    asyncio.run(main())


def test_children_move_to_running_in_one_commit(tmp_path: Path) -> None:
    async def body(m: SandboxManager, engine: FakeEngine, cloner: Cloner) -> None:
        recs = await _children(m, engine, 3)
        made = await cloner.wake_children(recs, [], reason="forked")
        assert [i.state for i in made] == [S.RUNNING] * 3
        last = [m.registry.transitions(r.id)[-1] for r in recs]
        assert {(t.src, t.dst, t.reason) for t in last} == {(S.CREATING, S.RUNNING, "forked")}
        assert len({t.at for t in last}) == 1  # one transaction

    _run(tmp_path, body)


def test_one_child_failing_removes_them_all(tmp_path: Path) -> None:
    async def body(m: SandboxManager, engine: FakeEngine, cloner: Cloner) -> None:
        recs = await _children(m, engine, 3)
        engine.faults["connect"] = 1  # one guest does not answer
        with pytest.raises(GuestError):
            await cloner.wake_children(recs, [], reason="forked")
        for rec in recs:
            assert m.registry.get(rec.id).state is S.STOPPED
            assert S.RUNNING not in [t.dst for t in m.registry.transitions(rec.id)]
            assert not m.directory(rec.id).exists()
        assert engine.world.processes == {}

    _run(tmp_path, body)


def test_a_cancelled_wake_leaves_no_child(tmp_path: Path) -> None:
    async def body(m: SandboxManager, engine: FakeEngine, cloner: Cloner) -> None:
        recs = await _children(m, engine, 3)
        loop = asyncio.get_running_loop()
        never: asyncio.Future[None] = loop.create_future()  # the last child's RAM never comes
        waking = asyncio.ensure_future(
            cloner.wake_children(recs, [], reason="forked", ram_ready=[None, None, never])
        )
        while len(engine.world.processes) < 2:  # two children run, the last one waits
            await asyncio.sleep(0.01)
        waking.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waking
        assert {m.registry.get(r.id).state for r in recs} == {S.STOPPED}
        assert engine.world.processes == {}

    _run(tmp_path, body)


@pytest.mark.parametrize("operation", ["fork", "snapshot"])
def test_a_source_that_fails_to_wake_leaves_no_child_and_keeps_its_snapshot(
    tmp_path: Path, operation: str
) -> None:
    """A paused-path fork whose source failed to wake again raised, but kept the children
    running (nobody held their ids: they ran on, billed); they are killed. A snapshot taken
    whole is kept: the source that failed to wake may be lost, the snapshot its last copy."""
    from tests.sandbox.fakes import DiskEngine, FakeMachine
    from torpor.errors import EngineError
    from torpor.sandbox.checkpoints import Checkpoints

    source: set[Path] = set()

    class SourceFails(FakeMachine):
        async def wake(self, *, ram_ready: object = None) -> None:
            if self.directory in source:
                raise EngineError("QEMU died while loading the state (injected)")
            await super().wake(ram_ready=ram_ready)  # type: ignore[arg-type]

    class Engine(DiskEngine):
        def machine(self, directory: Path, config: object) -> FakeMachine:
            return SourceFails(self, directory)

    async def main() -> None:
        m = SandboxManager(paths(tmp_path / "home"), engine=Engine())
        cp = Checkpoints(m)
        try:
            src = await m.create(name="src")
            source.add(m.directory(src.id))
            with pytest.raises(EngineError):
                if operation == "fork":
                    await cp.fork(src.id, count=2)
                else:
                    await cp.snapshot(src.id, name="before")
            assert [r.id for r in m.registry.list() if r.state is not S.STOPPED] == [src.id]
            kept = ["before"] if operation == "snapshot" else []
            assert [s.name for s in cp.list_snapshots()] == kept
        finally:
            await cp.settle()
            await m.close(pause=False)

    asyncio.run(main())


def test_a_restore_keeps_the_memory_scope_and_a_fork_of_a_snapshot_takes_the_one_given(
    tmp_path: Path,
) -> None:
    """A restored sandbox lost the memory its guest reached at localhost:7777 (its agent's
    code, restored in RAM, then met no memory), though a create refuses a ``memory_scope``
    with a snapshot because "a restore takes it from the snapshot"; a fork of a snapshot
    ignored the ``memory_scope`` it was given."""
    from tests.sandbox.fakes import DiskEngine
    from torpor.sandbox.checkpoints import Checkpoints

    async def main() -> None:
        m = SandboxManager(paths(tmp_path / "home"), engine=DiskEngine())
        cp = Checkpoints(m)
        try:
            scope = {"app": "support", "user": "u-42"}
            src = await m.create(name="src", memory_scope=scope)
            snap = await cp.snapshot(src.id, name="before")
            assert snap.carried.memory_scope == scope
            assert (await cp.restore(snap.id)).memory_scope == scope
            assert (await cp.create(snapshot=snap.id)).memory_scope == scope
            forked = await cp.fork_snapshot(snap.id, count=2)
            assert [c.memory_scope for c in forked] == [scope, scope]
            other = {"app": "support", "user": "u-42", "session": "s-1", "read_only": True}
            forked = await cp.fork_snapshot(snap.id, count=1, memory_scope=other)
            assert forked[0].memory_scope == other
        finally:
            await cp.settle()
            await m.close(pause=False)

    asyncio.run(main())


@pytest.mark.parametrize("operation", ["snapshot", "fork", "restore"])
def test_a_checkpoint_waiting_for_the_store_lock_leaves_the_event_loop_free(
    tmp_path: Path, operation: str
) -> None:
    """GC holds the snapshot store's lock for its whole pass (every manifest, every frozen
    dir, the chunk sweep). A snapshot, fork or restore waited for that lock on the server's
    event loop: every other request stood still until GC was done. Here another thread
    holds the lock until the loop has run something else."""
    import threading

    from tests.sandbox.fakes import DiskEngine
    from torpor.sandbox.checkpoints import Checkpoints
    from torpor.sandbox.storage.snapshots import store_lock

    async def main() -> None:
        m = SandboxManager(paths(tmp_path / "home"), engine=DiskEngine())
        cp = Checkpoints(m)
        try:
            src = await m.create(name="src")
            snap = await cp.snapshot(src.id, name="before", wait=True)
            held, loop_ran = threading.Event(), threading.Event()
            seen: list[bool] = []

            def hold() -> None:
                with store_lock(m.paths, exclusive=True):
                    held.set()
                    seen.append(loop_ran.wait(5))  # let go once the loop ran, or after 5 s

            holder = threading.Thread(target=hold)
            holder.start()
            held.wait(10)
            work: Coroutine[Any, Any, Any]
            if operation == "snapshot":
                work = cp.snapshot(src.id, name="after")
            elif operation == "fork":
                work = cp.fork(src.id, count=1)
            else:
                work = cp.restore(snap.id)
            job = asyncio.ensure_future(work)
            await asyncio.sleep(0.2)  # it waits for the lock
            loop_ran.set()
            await job
            holder.join(10)
            assert seen == [True]  # the loop ran while the lock was held
            assert len([r for r in m.registry.list() if r.state is S.RUNNING]) == (
                1 if operation == "snapshot" else 2
            )
        finally:
            await cp.settle()
            await m.close(pause=False)

    asyncio.run(main())


def test_children_waiting_for_the_drives_lock_leave_the_event_loop_free(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The children of a fork or restore of a sandbox with a drive record their attachment
    under the drives' lock, which a drive's delete holds while it removes the drive's files
    (any number of them). They waited for it on the server's event loop: every other
    request stood still. Here another thread holds the lock until the loop has run."""
    import threading

    import torpor.sandbox.checkpoints.clones as clones_mod

    async def mounted(channel: Any, drive: Any, path: str, read_only: bool) -> None:
        pass

    monkeypatch.setattr(clones_mod, "mount_in_guest", mounted)

    async def body(m: SandboxManager, engine: FakeEngine, cloner: Cloner) -> None:
        drive = cloner.drives.create("handoff")
        recs = await _children(m, engine, 2)
        held, loop_ran = threading.Event(), threading.Event()
        seen: list[bool] = []

        def hold() -> None:
            with cloner.drives.records.lock():
                held.set()
                seen.append(loop_ran.wait(5))  # let go once the loop ran, or after 5 s

        holder = threading.Thread(target=hold)
        holder.start()
        held.wait(10)
        waking = asyncio.ensure_future(
            cloner.wake_children(recs, [(drive, "/shared", False)], reason="forked")
        )
        await asyncio.sleep(0.2)  # the children wait for the lock
        loop_ran.set()
        made = await waking
        holder.join(10)
        assert seen == [True]  # the loop ran while the lock was held
        assert [i.state for i in made] == [S.RUNNING] * 2
        attached = cloner.drives.get(drive.id).attachments
        assert sorted(a.sandbox_id for a in attached) == sorted(r.id for r in recs)

    _run(tmp_path, body)
