"""Compaction in cluster mode (torpor.sandbox.storage.evict, manager/compacting.py), without
VMs: managers on a real PostgreSQL and a real S3 store (SeaweedFS) with the fake engine.

A durable paused sandbox drops its local directory and wakes on its node from the store; a
pause that is not durable (or not durable as it is now) keeps its files; a crash at any point
of a compaction loses nothing. The same wake with real QEMU is measured by
``bench/compaction.py --cluster``.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from tests.sandbox.fakes import FakeEngine
from tests.sandbox.test_cluster import die, node, run, until
from torpor.errors import StorageError
from torpor.sandbox.manager import sandboxes as sandboxes_mod
from torpor.sandbox.models import SandboxState as S
from torpor.sandbox.storage import evict
from torpor.sandbox.storage.pauses import FILLING, is_whole, settle_fill

pytestmark = [pytest.mark.postgres, pytest.mark.s3]


async def _durable_pause(n: Any, name: str, code: str) -> str:
    await n.run_code(name, code)
    await n.pause(name)
    info = await until(lambda: n.get(name), lambda i: i.durable is not None, timeout=30)
    # (the upload's task ends a moment after the durable stamp; a drop waits for it)
    await until(lambda: n.get(name), lambda i: not n.cluster.pushing(i.id), timeout=30)
    return str(info.id)


def test_a_durable_pause_drops_its_files_and_wakes_on_its_node(
    tmp_path: Path, dsn: str, store: str
) -> None:
    async def body() -> None:
        n1 = node(tmp_path, dsn, store, "n1")
        await n1.start(supervise=False)
        await n1.create(name="agent")
        sid = await _durable_pause(n1, "agent", "notes = [1, 2]")
        directory = n1.directory(sid)
        n1.compact_after_seconds = 3600.0
        assert await n1.compact_sweep() == []  # paused a moment ago: kept
        assert directory.is_dir()
        n1.compact_after_seconds = 0.0
        (report,) = await n1.compact_sweep()
        assert report.ram_bytes_before > 0 and report.new_chunk_bytes == 0
        assert not directory.exists()
        info = await n1.get("agent")
        assert (info.state, info.owned_bytes) == (S.PAUSED, 0) and info.durable is not None
        assert await n1.compact_sweep() == []  # nothing left here to drop
        out = await n1.run_code("agent", "notes")  # woken here, from the store
        assert out.results[0].data["text/plain"] == "[1, 2]"
        assert n1.cluster is not None and n1.cluster.registry.owner(sid) == "n1"
        assert directory.is_dir()
        # paused again, durable again, compacted again: the newest pause is the one woken
        await _durable_pause(n1, "agent", "notes.append(3)")
        assert len(await n1.compact_sweep()) == 1
        out = await n1.run_code("agent", "notes")
        assert out.results[0].data["text/plain"] == "[1, 2, 3]"
        await n1.close()

    run(body)


def test_a_pause_not_durable_as_it_is_keeps_its_files(tmp_path: Path, dsn: str, store: str) -> None:
    async def body() -> None:
        n1 = node(tmp_path, dsn, store, "n1")
        await n1.start(supervise=False)
        await n1.create(name="agent")
        sid = await _durable_pause(n1, "agent", "x = 1")
        assert n1.cluster is not None
        real_push = n1.cluster.push

        def failing(*args: Any) -> Any:
            raise StorageError("the store is away (test)")

        n1.cluster.push = failing  # type: ignore[method-assign,assignment]
        await n1.run_code("agent", "x = 2")
        await n1.pause("agent")  # its upload fails: only the older pause is durable
        await until(lambda: n1.get("agent"), lambda i: i.upload_error is not None, timeout=30)
        n1.compact_after_seconds = 0.0
        assert await n1.compact_sweep(limit=5) == []
        assert n1.directory(sid).is_dir()
        n1.cluster.push = real_push  # type: ignore[method-assign]
        await until(lambda: n1.get("agent"), lambda i: i.durable is not None, timeout=30)
        await until(lambda: n1.get("agent"), lambda i: not n1.cluster.pushing(sid), 30)  # type: ignore[union-attr]
        assert len(await n1.compact_sweep()) == 1
        out = await n1.run_code("agent", "x")
        assert out.results[0].data["text/plain"] == "2"  # the latest pause, not the older one
        await n1.close()

    run(body)


@pytest.mark.parametrize("crash", ["before-rename", "after-rename", "mid-delete"])
def test_a_crash_mid_compaction_loses_nothing(
    tmp_path: Path, dsn: str, store: str, crash: str
) -> None:
    """The node dies at a point of a compaction (its process gone, its disk as the crash left
    it); restarted on the same home, it wakes the sandbox with its state intact and clears
    what the compaction left."""

    class Crash(BaseException):
        pass

    async def body() -> None:
        engine = FakeEngine()
        n1 = node(tmp_path, dsn, store, "n1", engine=engine, lease=30)
        await n1.start(supervise=False)
        await n1.create(name="agent")
        sid = await _durable_pause(n1, "agent", "notes = ['kept']")
        directory = n1.directory(sid)
        aside = directory.with_name(f".{sid}{evict.LEFTOVER}")
        with pytest.MonkeyPatch.context() as patch:  # (not the fixture's: it holds the S3 env)
            if crash == "before-rename":

                def replace(src: Any, dst: Any) -> None:
                    raise Crash

                patch.setattr(os, "replace", replace)
            elif crash == "after-rename":

                def remove(path: Path) -> None:
                    raise Crash

                patch.setattr(evict, "_remove", remove)
            else:

                def remove(path: Path) -> None:  # one file gone, then the crash
                    (path / "ram").unlink()
                    raise Crash

                patch.setattr(evict, "_remove", remove)
            n1.compact_after_seconds = 0.0
            with pytest.raises(Crash):
                await n1.compact_sweep()
        assert directory.is_dir() == (crash == "before-rename")
        assert aside.is_dir() == (crash != "before-rename")
        die(n1, None)
        again = node(tmp_path, dsn, store, "n1", engine=FakeEngine(engine.world), lease=30)
        again.compact_after_seconds = None
        await again.start(supervise=False)
        await again.compact_sweep()  # clears the leftovers even with compaction off
        assert not aside.exists()
        out = await again.run_code("agent", "notes")
        assert out.results[0].data["text/plain"] == "['kept']"
        await again.close()

    run(body)


def test_supervisor_compacts_a_cluster_node(
    tmp_path: Path, dsn: str, store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORPOR_COMPACT_AFTER_SECONDS", "0")
    monkeypatch.setattr(sandboxes_mod, "CLUSTER_COMPACT_SECONDS", 0.2)

    async def body() -> None:
        n1 = node(tmp_path, dsn, store, "n1")
        assert n1.compact_after_seconds == 0.0  # on in cluster mode too
        await n1.start(supervise=True, interval=0.05)
        await n1.create(name="agent")
        sid = await _durable_pause(n1, "agent", "y = 5")
        deadline = asyncio.get_running_loop().time() + 30
        while n1.directory(sid).exists():
            assert asyncio.get_running_loop().time() < deadline, "never compacted"
            await asyncio.sleep(0.1)
        out = await n1.run_code("agent", "y")
        assert out.results[0].data["text/plain"] == "5"
        await n1.close()

    run(body)


def test_clear_leftovers_only_takes_what_a_drop_left(tmp_path: Path) -> None:
    root = tmp_path / "sandboxes"
    (root / "sbx-a").mkdir(parents=True)
    (root / ".sbx-a.rebuild").mkdir()
    (root / f".sbx-b{evict.LEFTOVER}" / "sub").mkdir(parents=True)
    (root / f".sbx-b{evict.LEFTOVER}" / "ram").write_bytes(os.urandom(10))
    assert evict.clear_leftovers(root) == ["sbx-b"]
    assert sorted(p.name for p in root.iterdir()) == [".sbx-a.rebuild", "sbx-a"]
    assert evict.clear_leftovers(tmp_path / "absent") == []


def test_a_rebuild_marker_goes_only_once_the_state_is_consumed(tmp_path: Path) -> None:
    """A wake that rebuilt a pause without fsync keeps the marker until its saved state is
    consumed: a crash before that finds the directory not whole (rebuilt again)."""
    d = tmp_path / "sbx-x"
    d.mkdir()
    (d / "state").write_bytes(b"s")
    (d / FILLING).write_bytes(b"")
    settle_fill(d)  # the state is still there: the RAM may be half filled
    assert not is_whole(d) and (d / FILLING).exists()
    (d / "state").unlink()  # consumed by the wake
    settle_fill(d)
    assert not (d / FILLING).exists()
    (d / FILLING).write_bytes(b"")
    (d / "state").write_bytes(b"new")  # a pause saved the running guest's state
    settle_fill(d, saved=True)
    assert is_whole(d)
