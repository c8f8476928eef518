"""Retention and GC without a VM: what expired or is unreferenced goes, nothing referenced does."""

from __future__ import annotations

import json
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from torpor.errors import StorageError
from torpor.sandbox.storage.drives import DriveStore
from torpor.sandbox.storage.retention import collect_garbage
from torpor.sandbox.storage.snapshots import SnapshotStore, freeze
from torpor.sandbox.storage.volumes import VolumeStore

try:  # plain pytest puts this directory on sys.path; a package layout needs the relative form
    from tests.sandbox.storage_helpers import make_home, make_machine, qemu_io
except ImportError:  # pragma: no cover
    from .storage_helpers import make_home, make_machine, qemu_io

LATER = datetime.now(UTC) + timedelta(days=3)


def test_expired_snapshot_goes_and_shared_chunks_stay(tmp_path: Path) -> None:
    p = make_home(tmp_path)
    store = SnapshotStore(p)
    m = make_machine(p, "sb1")
    short = store.save(freeze(m, store.frozen_root), name="short", retention_days=1)
    short_chunks = store.referenced_chunks()
    qemu_io(m / "disk.qcow2", "write -P 0x55 6M 64k")
    with open(m / "ram", "r+b") as f:  # the sandbox moved on: some RAM changed
        f.seek(5 << 20)
        f.write(b"\x77" * 4096)
    long = store.save(freeze(m, store.frozen_root), name="long", retention_days=30)
    shared = short_chunks & _chunks_of(store, long.id)
    assert shared  # the two snapshots share most chunks
    report = collect_garbage(p, now=LATER)
    assert report.expired_snapshots == [short.id]
    assert report.removed_chunks > 0
    assert set(store.chunks) == _chunks_of(store, long.id)
    assert shared <= set(store.chunks)
    assert [s.id for s in store.list()] == [long.id]
    store.materialize(long.id)  # still whole: every chunk it needs survived


def _chunks_of(store: SnapshotStore, sid: str) -> set[str]:
    for info, body in store.manifests():
        if info.id == sid:
            from torpor.sandbox.storage.chunks import FileManifest

            out: set[str] = set()
            for fm in body["files"].values():
                out |= FileManifest.from_json(fm).hashes()
            return out
    return set()


def test_nothing_referenced_is_removed(tmp_path: Path) -> None:
    p = make_home(tmp_path)
    store = SnapshotStore(p)
    m = make_machine(p, "sb1")
    info = store.save(freeze(m, store.frozen_root), name="keep", retention_days=30)
    before = set(store.chunks)
    report = collect_garbage(p)
    assert report.expired_snapshots == [] and report.removed_chunks == 0
    assert set(store.chunks) == before
    assert report.removed_frozen == []  # sb1's overlay is backed by the frozen layer
    store.materialize(info.id)


def test_orphan_chunks_and_unused_frozen_dirs_go(tmp_path: Path) -> None:
    p = make_home(tmp_path)
    store = SnapshotStore(p)
    orphan, _ = store.chunks.put(b"left by a snapshot that failed half-way")
    keep = make_machine(p, "keep")
    used = freeze(keep, store.frozen_root)
    qemu_io(keep / "disk.qcow2", "write -P 0x66 8M 64k")
    used2 = freeze(keep, store.frozen_root)  # chain: keep -> used2 -> used
    gone = make_machine(p, "gone", fill=0x43)
    unused = freeze(gone, store.frozen_root)
    shutil.rmtree(gone)  # the sandbox was deleted
    report = collect_garbage(p)
    assert not store.chunks.has(orphan)
    assert report.removed_frozen == [unused.name]
    assert used.exists() and used2.exists()
    assert "read 65536" in qemu_io(keep / "disk.qcow2", "read -P 0x42 2M 64k")


def test_corrupt_manifest_still_protects_its_chunks(tmp_path: Path) -> None:
    p = make_home(tmp_path)
    store = SnapshotStore(p)
    info = store.save(freeze(make_machine(p, "sb1"), store.frozen_root), name="s")
    mpath = p.snapshots / f"{info.id}.json"
    body = json.loads(mpath.read_text())
    body["info"]["name"] = "tampered"
    mpath.write_text(json.dumps(body))
    before = set(store.chunks)
    collect_garbage(p)
    assert set(store.chunks) == before


@pytest.mark.parametrize("damage", ["read-error", "one-byte"])
def test_a_manifest_that_does_not_read_stops_the_sweep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    """A manifest GC cannot read (one EIO, one damaged byte) names chunks GC cannot know:
    sweeping then deleted every chunk of a snapshot that a retried read or a repaired byte
    would have restored. Nothing is swept, and its cached frozen dir stays."""
    p = make_home(tmp_path)
    store = SnapshotStore(p)
    info = store.save(freeze(make_machine(p, "sb1"), store.frozen_root), name="keep")
    before, links = set(store.chunks), store.captures.links()
    manifest = p.snapshots / f"{info.id}.json"
    good = manifest.read_bytes()
    if damage == "one-byte":
        manifest.write_bytes(b"X" + good[1:])
    else:
        real_read_text = Path.read_text

        def flaky(self: Path, *a: Any, **k: Any) -> str:
            if self == manifest:
                raise OSError(5, "Input/output error")
            return real_read_text(self, *a, **k)

        monkeypatch.setattr(Path, "read_text", flaky)
    collect_garbage(p)
    monkeypatch.undo()
    assert set(store.chunks) == before and store.captures.links() == links
    manifest.write_bytes(good)
    store.materialize(info.id)  # whole again once the manifest reads


def test_dry_run_removes_nothing(tmp_path: Path) -> None:
    p = make_home(tmp_path)
    store = SnapshotStore(p)
    store.save(freeze(make_machine(p, "sb1"), store.frozen_root), name="s", retention_days=1)
    before = set(store.chunks)
    report = collect_garbage(p, now=LATER, dry_run=True)
    assert report.expired_snapshots and report.removed_chunks == len(before)
    assert set(store.chunks) == before and len(store.list()) == 1


def test_attachments_of_dead_sandboxes_are_released(tmp_path: Path) -> None:
    p = make_home(tmp_path)
    make_machine(p, "alive")
    vols, drives = VolumeStore(p), DriveStore(p)
    v = vols.create("v", size_mib=16)
    vols.attach(v.id, "dead", "/memory")
    d = drives.create("d")
    drives.attach(d.id, "alive", "/shared")
    drives.attach(d.id, "dead", "/shared")
    report = collect_garbage(p)
    assert report.released_attachments == 2
    assert vols.get("v").attachments == []
    assert [a.sandbox_id for a in drives.get("d").attachments] == ["alive"]


def test_cli_gc_local(tmp_path: Path, monkeypatch: Any) -> None:
    from typer.testing import CliRunner

    from torpor.cli import _load, app

    p = make_home(tmp_path)
    store = SnapshotStore(p)
    orphan, _ = store.chunks.put(b"orphan")
    monkeypatch.setenv("TORPOR_HOME", str(p.home))
    _load()
    dry = CliRunner().invoke(app, ["gc", "--local", "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert store.chunks.has(orphan)
    result = CliRunner().invoke(app, ["gc", "--local"])
    assert result.exit_code == 0, result.output
    assert "removed_chunks" in result.output
    assert not store.chunks.has(orphan)


def test_expired_pauses_are_killed_and_fresh_ones_kept(tmp_path: Path) -> None:
    """Retention of pauses (default 30 days, 1-365 per sandbox), on the manager's fake engine."""
    import asyncio
    import time

    from tests.sandbox.fakes import FakeEngine
    from torpor.config import paths
    from torpor.sandbox.checkpoints import Checkpoints
    from torpor.sandbox.manager import SandboxManager
    from torpor.sandbox.models import SandboxState

    async def main() -> None:
        m = SandboxManager(paths(tmp_path / "home"), engine=FakeEngine())
        cp = Checkpoints(m)
        short = await m.create(name="short", pause_retention_days=1)
        default = await m.create(name="default")
        running = await m.create(name="running", pause_retention_days=1)
        await m.pause(short.id)
        await m.pause(default.id)
        in_2_days = time.time() + 2 * 86400
        dry = await cp.collect_garbage(now=in_2_days, dry_run=True)
        assert dry.expired_sandboxes == [short.id]
        assert (await m.get(short.id)).state is SandboxState.PAUSED
        report = await cp.collect_garbage(now=in_2_days)
        assert report.expired_sandboxes == [short.id]
        assert (await m.get(short.id)).state is SandboxState.STOPPED
        assert not m.directory(short.id).exists()
        assert (await m.get(default.id)).state is SandboxState.PAUSED  # 30 days by default
        assert (await m.get(running.id)).state is SandboxState.RUNNING  # only pauses expire
        report = await cp.collect_garbage(now=time.time() + 31 * 86400)
        assert report.expired_sandboxes == [default.id]
        await m.close()

    asyncio.run(main())


def test_a_pause_woken_or_extended_while_gc_kills_others_is_kept(tmp_path: Path) -> None:
    """GC listed the expired pauses, then killed them one at a time (each kill awaits its
    files' removal): a sandbox its user woke, or whose retention its user extended, while an
    earlier one was being killed was killed anyway, from the list's stale record (a running
    sandbox in use deleted as "expired", an extension answered and then ignored)."""
    import asyncio
    import time

    from tests.sandbox.fakes import FakeEngine
    from torpor.config import paths
    from torpor.sandbox.checkpoints import Checkpoints
    from torpor.sandbox.manager import SandboxManager
    from torpor.sandbox.models import SandboxState

    async def main() -> None:
        m = SandboxManager(paths(tmp_path / "home"), engine=FakeEngine())
        cp = Checkpoints(m)
        first = await m.create(name="first", pause_retention_days=1)
        woken = await m.create(name="woken", pause_retention_days=1)
        extended = await m.create(name="extended", pause_retention_days=1)
        for sbx in (first, woken, extended):
            await m.pause(sbx.id)
        kill = m.kill

        async def kill_while_users_act(id_or_name: str, **kw: Any) -> Any:
            if id_or_name == first.id:  # meanwhile, two users rescue theirs
                await m.resume(woken.id)
                await m.set_retention(extended.id, 30)
            return await kill(id_or_name, **kw)

        m.kill = kill_while_users_act  # type: ignore[method-assign]
        report = await cp.collect_garbage(now=time.time() + 2 * 86400)
        assert report.expired_sandboxes == [first.id]
        assert (await m.get(first.id)).state is SandboxState.STOPPED
        assert (await m.get(woken.id)).state is SandboxState.RUNNING
        assert (await m.get(extended.id)).state is SandboxState.PAUSED
        await m.close()

    asyncio.run(main())


def test_a_pause_shows_when_it_expires_and_warns_a_day_before(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``expires_at`` is visible while paused, and the GC warns in the day before it."""
    import asyncio
    import logging
    from datetime import timedelta

    from tests.sandbox.fakes import FakeEngine
    from torpor.config import paths
    from torpor.sandbox.checkpoints import Checkpoints
    from torpor.sandbox.manager import SandboxManager

    async def main() -> None:
        m = SandboxManager(paths(tmp_path / "home"), engine=FakeEngine())
        cp = Checkpoints(m)
        sbx = await m.create(name="agent-u-9", pause_retention_days=3)
        assert sbx.expires_at is None and sbx.paused_at is None  # running: nothing expires
        await m.pause(sbx.id)
        info = await m.get(sbx.id)
        assert info.paused_at is not None and info.expires_at is not None
        assert info.expires_at - info.paused_at == timedelta(days=3)
        soon = info.expires_at.timestamp() - 3600
        with caplog.at_level(logging.WARNING, logger="torpor.sandbox.checkpoints"):
            report = await cp.collect_garbage(now=soon)
        assert report.expired_sandboxes == []
        assert any("will be deleted in 1.0 h" in r.getMessage() for r in caplog.records)
        extended = await m.get_or_create("agent-u-9", pause_retention_days=30)
        assert extended.pause_retention_days == 30
        await m.pause(sbx.id)
        later = (await m.get(sbx.id)).expires_at
        assert later is not None and later - info.expires_at > timedelta(days=26)
        assert (await cp.collect_garbage(now=soon + 7200)).expired_sandboxes == []
        await m.close()

    asyncio.run(main())


@pytest.mark.parametrize("damage", ["read-error", "one-byte"])
def test_a_pending_record_that_does_not_read_keeps_its_capture(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    """A capturing snapshot's frozen dir is its only copy, kept by its pending record. A
    record GC could not read (one EIO, one damaged byte) used to count as none: the link and
    the frozen dir went, and the snapshot with them."""
    p = make_home(tmp_path)
    store = SnapshotStore(p)
    info = store.begin(freeze(make_machine(p, "sb1"), store.frozen_root), name="capturing")
    links = store.captures.links()
    assert info.id in links and links[info.id].is_dir()
    record = store.captures.pending_root / f"{info.id}.json"
    good = record.read_bytes()
    if damage == "one-byte":
        record.write_bytes(good[:-2] + b"X}")
    else:
        real_read_text = Path.read_text

        def flaky(self: Path, *a: Any, **k: Any) -> str:
            if self == record:
                raise OSError(5, "Input/output error")
            return real_read_text(self, *a, **k)

        monkeypatch.setattr(Path, "read_text", flaky)
    collect_garbage(p)
    monkeypatch.undo()
    assert store.captures.links() == links and links[info.id].is_dir()
    record.write_bytes(good)
    assert store.captures.read(info.id) is not None  # whole again once the record reads


def test_a_forks_linked_ram_is_not_taken_for_a_leftover(tmp_path: Path) -> None:
    """A fork of a paused sandbox freezes with its RAM hard-linked (no copy) and clones the
    children from that link outside the store's lock. The link has the source's mtime (the
    pause, hours ago), so a GC pass in between dropped the frozen RAM and state as a crash's
    leftovers and the fork failed. A link just made is recent (its ctime)."""
    import os
    import time

    p = make_home(tmp_path)
    m = make_machine(p, "sb1")
    long_ago = time.time() - 3 * 3600  # paused three hours ago
    for name in ("ram", "state"):
        os.utime(m / name, (long_ago, long_ago))
    frozen = freeze(m, SnapshotStore(p).frozen_root, link_ram=True)
    collect_garbage(p)
    assert (frozen / "ram").is_file() and (frozen / "state").is_file()


def test_recover_and_gc_finish_a_capture_left_pending(tmp_path: Path) -> None:
    """A snapshot listed as capturing when the server died is stored by the next server's
    recover (and a failed capture by the next GC pass)."""
    import asyncio

    from tests.sandbox.fakes import FakeEngine
    from torpor.config import paths
    from torpor.sandbox.checkpoints import Checkpoints
    from torpor.sandbox.manager import SandboxManager

    p = make_home(tmp_path)
    store = SnapshotStore(p)
    left = store.begin(freeze(make_machine(p, "sbx-a"), store.frozen_root), name="left")
    failed = store.begin(freeze(make_machine(p, "sbx-b"), store.frozen_root), name="failed")
    assert {s.status for s in store.list()} == {"capturing"}

    async def main() -> None:
        m = SandboxManager(paths(p.home), engine=FakeEngine())
        cp = Checkpoints(m)
        real = cp.snapshots.save
        broken = {"id": failed.id}

        def save(*a: Any, **k: Any) -> Any:
            if k.get("snapshot_id") == broken["id"]:
                raise StorageError("No space left on device")
            return real(*a, **k)

        cp.snapshots.save = save  # type: ignore[method-assign]
        await cp.recover()
        await cp.settle()
        assert cp.get_snapshot(left.id).status == "stored"
        assert cp.get_snapshot(failed.id).status == "capturing"  # kept, usable, retried
        broken["id"] = ""
        await cp.collect_garbage()
        await cp.settle()
        assert {s.status for s in cp.list_snapshots()} == {"stored"}
        await m.close()

    asyncio.run(main())


def test_a_sandbox_made_while_gc_runs_keeps_its_volume(tmp_path: Path) -> None:
    """GC took the set of live sandboxes before it began and released attachments at its end:
    a sandbox created while GC ran (swept chunks) lost its volume's attachment, so the volume
    could be attached read-write again elsewhere, or deleted, under its guest."""
    import asyncio

    from tests.sandbox.fakes import FakeEngine
    from torpor.config import paths
    from torpor.sandbox.checkpoints import Checkpoints
    from torpor.sandbox.manager import SandboxManager
    from torpor.sandbox.storage import snapshots as snapmod

    async def main() -> None:
        m = SandboxManager(paths(tmp_path / "home"), engine=FakeEngine())
        cp = Checkpoints(m)
        vol = cp.volumes.create("v", size_mib=16)
        loop = asyncio.get_running_loop()
        made: list[str] = []

        def failpoint(name: str) -> None:  # on GC's thread, while it runs
            if name == "gc:attachments" and not made:
                sbx = asyncio.run_coroutine_threadsafe(m.create(name="new"), loop).result()
                cp.volumes.attach(vol.id, sbx.id, "/data")
                made.append(sbx.id)

        snapmod.failpoint = failpoint
        try:
            report = await cp.collect_garbage()
        finally:
            snapmod.failpoint = None
        assert made and report.released_attachments == 0
        assert [a.sandbox_id for a in cp.volumes.get("v").attachments] == made
        await m.close()

    asyncio.run(main())
