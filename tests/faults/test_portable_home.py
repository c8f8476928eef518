"""A copied or moved home uses its own files, never the original's (hardening item 14).

A home is copied with ``cp -a`` (what a backup restore or a move to a bigger disk does); the
original is then deleted, so any path still pointing at it fails. Its qcow2 overlays, its
``machine.json`` files, its template and its snapshot manifests must all point inside the copy
after :func:`relocate` (which the sandbox manager runs at start), and a snapshot taken before the
move must still restore from the copy.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

from torpor.config import paths
from torpor.sandbox.storage.records import rewrite_prefix
from torpor.sandbox.storage.relocate import relocate
from torpor.sandbox.storage.snapshots import SnapshotStore, backing_chain, backing_file, freeze
from torpor.sandbox.template import templates
from torpor.sandbox.vm.disk import set_backing

try:
    from tests.sandbox.storage_helpers import make_home, make_machine, qemu_io
except ImportError:  # pragma: no cover
    from ..sandbox.storage_helpers import make_home, make_machine, qemu_io


def _old_style_home(tmp_path: Path) -> Path:
    """A home as one made before ``home.json``: absolute paths everywhere."""
    p = make_home(tmp_path)
    tdir = p.templates / "python"
    (tdir / "vmlinuz").write_bytes(b"kernel")
    (tdir / "template.json").write_text(
        json.dumps(
            {
                "name": "python",
                "directory": str(tdir),
                "build_id": "b1",
                "kernel": str(tdir / "vmlinuz"),
                "initrd": str(tdir / "vmlinuz"),
                "base_image": str(tdir / "snapshot" / "disk.qcow2"),
                "snapshot_dir": str(tdir / "snapshot"),
            }
        )
    )
    sbx = make_machine(p, "sbx-1")
    (sbx / "machine.json").write_text(
        json.dumps({"kernel": str(tdir / "vmlinuz"), "devices": [{"path": str(p.drives / "d1")}]})
    )
    store = SnapshotStore(p)
    store.save(freeze(make_machine(p, "sbx-2", fill=0x5A), store.frozen_root), name="before")
    return p.home


def test_a_copied_home_points_at_itself(tmp_path: Path) -> None:
    old = _old_style_home(tmp_path)
    new = tmp_path / "moved"
    subprocess.run(["cp", "-a", str(old), str(new)], check=True)
    shutil.rmtree(old)  # the original is gone: any path left pointing at it breaks

    p = paths(new)
    moved = relocate(p)
    assert moved is not None and moved.old == old.resolve() and moved.new == new.resolve()
    assert moved.disks >= 2 and moved.manifests == 1

    # qcow2 overlays are backed inside the copy, and read what they read before
    backing = backing_file(p.sandboxes / "sbx-1" / "disk.qcow2")
    assert backing == new.resolve() / "templates" / "python" / "snapshot" / "disk.qcow2"
    out = qemu_io(p.sandboxes / "sbx-1" / "disk.qcow2", "read -P 0x11 0 1M")
    assert "read 1048576/1048576" in out
    # machine.json and template.json name the copy's files
    machine = json.loads((p.sandboxes / "sbx-1" / "machine.json").read_text())
    assert machine["kernel"].startswith(str(new.resolve()))
    assert machine["devices"][0]["path"] == str(new.resolve() / "drives" / "d1")
    tj = json.loads((p.templates / "python" / "template.json").read_text())
    assert all(str(old) not in str(v) for v in tj.values())
    # a snapshot taken before the move restores from the copy (its manifest still checks)
    store = SnapshotStore(p)
    (snap,) = store.list()
    frozen = store.materialize(snap.id)
    assert all(str(old) not in str(b) for b in backing_chain(frozen / "disk.qcow2"))

    # home.json now says where the home is: a second start changes nothing
    assert json.loads((new / "home.json").read_text())["path"] == str(new.resolve())
    assert relocate(p) is None


def test_a_home_that_did_not_move_is_left_alone(tmp_path: Path) -> None:
    home = _old_style_home(tmp_path)
    disk = home / "sandboxes" / "sbx-1" / "disk.qcow2"
    before = (disk.stat().st_mtime_ns, (home / "sandboxes" / "sbx-1" / "machine.json").read_text())
    assert relocate(paths(home)) is None
    after = (disk.stat().st_mtime_ns, (home / "sandboxes" / "sbx-1" / "machine.json").read_text())
    assert after == before
    assert json.loads((home / "home.json").read_text())["path"] == str(home.resolve())


def test_a_copied_template_reads_its_own_files_before_any_relocation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = _old_style_home(tmp_path)
    new = tmp_path / "copy"
    subprocess.run(["cp", "-a", str(old), str(new)], check=True)
    monkeypatch.setenv("TORPOR_HOME", str(new))
    info = templates.get("python")
    assert info.directory == new / "templates" / "python"
    assert info.kernel == new / "templates" / "python" / "vmlinuz"
    assert info.snapshot_dir == new / "templates" / "python" / "snapshot"


@pytest.mark.qemu
def test_a_moved_home_wakes_its_sandbox_and_restores_its_snapshot(
    tmp_path: Path, template_home: Path
) -> None:
    """End to end on real QEMU: a home (with its own copy of the template) has a paused
    sandbox and a snapshot; it is copied with ``cp -a`` and the original deleted; a manager
    on the copy wakes the sandbox with its RAM and restores the snapshot."""
    from torpor.sandbox.checkpoints import Checkpoints
    from torpor.sandbox.manager import SandboxManager

    old = tmp_path / "old"
    src = template_home / "templates" / "python"
    build = (src / "snapshot").resolve().parent
    tdir = old / "templates" / "python"
    (tdir / "builds").mkdir(parents=True)
    subprocess.run(["cp", "-a", str(build), str(tdir / "builds")], check=True)
    (tdir / "snapshot").symlink_to(Path("builds") / build.name / "snapshot")
    info = json.loads((src / "template.json").read_text())
    (tdir / "template.json").write_text(json.dumps(rewrite_prefix(info, str(src), str(tdir))))
    for disk in (tdir / "builds" / build.name / "snapshot").glob("*.qcow2"):
        set_backing(disk, tdir / "builds" / build.name / "base.qcow2")

    async def before() -> tuple[str, str]:
        m = SandboxManager(paths(old))
        await m.start(supervise=False)
        try:
            sbx = await m.create(name="agent-u-1")
            await m.run_code(sbx.id, "notes = [1, 2]")
            snap = await Checkpoints(m).snapshot(sbx.id, name="before-move")
            await m.pause(sbx.id)
            return sbx.id, snap.id
        finally:
            await m.close()

    sandbox_id, snap_id = asyncio.run(before())
    new = tmp_path / "new"
    subprocess.run(["cp", "-a", str(old), str(new)], check=True)
    shutil.rmtree(old)

    async def after() -> tuple[str, str]:
        m = SandboxManager(paths(new))
        await m.start(supervise=False)
        try:
            woken = await m.run_code(sandbox_id, "notes")
            restored = await Checkpoints(m).restore(snap_id)
            again = await m.run_code(restored.id, "notes")
            return woken.results[0].data["text/plain"], again.results[0].data["text/plain"]
        finally:
            for info in await m.list():  # no QEMU outlives the test
                await m.kill(info.id)
            await m.close(pause=False)

    assert asyncio.run(after()) == ("[1, 2]", "[1, 2]")


def test_a_home_split_across_file_systems_copies_by_hand(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 12 item 14, the second half: where ``copy_file_range`` cannot work (EXDEV: the
    templates, the sandboxes or the chunks on another file system), a sparse copy and the
    expansion of a compacted sandbox's RAM from its template copy by hand instead of failing."""
    import errno

    from torpor.sandbox.storage.chunks import ChunkStore
    from torpor.sandbox.storage.compaction import compact, expand
    from torpor.sandbox.vm.disk import copy_sparse

    def exdev(*_: object) -> int:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "copy_file_range", exdev)
    src = tmp_path / "src"
    with open(src, "wb") as f:
        f.truncate(8 << 20)
        f.seek(3 << 20)
        f.write(os.urandom(1 << 20))
    copy_sparse(src, tmp_path / "dst")
    assert (tmp_path / "dst").read_bytes() == src.read_bytes()

    p = make_home(tmp_path / "home")
    template_ram = p.templates / "python" / "snapshot" / "ram"
    shutil.copyfile(src, template_ram)
    machine = make_machine(p, "sbx-1")
    shutil.copyfile(src, machine / "ram")
    with open(machine / "ram", "r+b") as ram:
        ram.seek(6 << 20)
        ram.write(os.urandom(64 << 10))
    original = (machine / "ram").read_bytes()
    store = ChunkStore(p.chunks)
    assert compact(machine, store, template_ram).from_template > 0
    expand(machine, store)  # the template's chunks come back through the fallback
    assert (machine / "ram").read_bytes() == original


def test_relocation_opens_no_fifo_and_leaves_what_agents_wrote_alone(tmp_path: Path) -> None:
    """A FIFO or a device in the home is never opened (reading one blocks), and a file an
    agent wrote into a drive keeps its bytes even when it names the old home."""
    old = _old_style_home(tmp_path)
    p = paths(old)
    rootfs_dev = p.cache / "rootfs" / "dev"
    rootfs_dev.mkdir(parents=True)
    os.mkfifo(rootfs_dev / "console")
    os.mkfifo(p.sandboxes / "sbx-1" / "stray.json")
    written = p.drives / "d1" / "notes.json"
    written.parent.mkdir(parents=True)
    payload = json.dumps({"where": str(old.resolve() / "drives" / "d1")})
    written.write_text(payload)
    record = p.drives / "d1.json"
    record.write_text(json.dumps({"id": "d1", "path": str(old.resolve() / "drives" / "d1")}))
    new = tmp_path / "moved"
    subprocess.run(["cp", "-a", str(old), str(new)], check=True)
    shutil.rmtree(old)

    result: list[object] = []
    worker = threading.Thread(target=lambda: result.append(relocate(paths(new))), daemon=True)
    worker.start()
    worker.join(120)  # a FIFO opened for reading blocks for ever: fail instead of hanging
    assert not worker.is_alive(), "relocate() blocked on a FIFO"
    assert result and result[0] is not None
    assert (new / "drives" / "d1" / "notes.json").read_text() == payload
    assert json.loads((new / "drives" / "d1.json").read_text())["path"] == str(
        new.resolve() / "drives" / "d1"
    )


def test_a_relocation_tried_again_after_an_error_rewrites_each_path_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A home moved below its old place (``/srv/torpor`` to ``/srv/torpor/home``): a
    relocation that failed half way (a file it could not rewrite; the next start tries
    again) rewrote the paths it had moved already a second time (``.../home/home/...``), so
    the sandboxes and templates pointed at files that do not exist."""
    from torpor.errors import StorageError

    old = _old_style_home(tmp_path)
    assert relocate(paths(old)) is None  # opened once where it was: home.json says so
    aside = tmp_path / "aside"
    old.rename(aside)
    old.mkdir()
    new = old / "inner"
    aside.rename(new)
    p = paths(new)
    real = SnapshotStore.rewrite_paths

    def fails(self: SnapshotStore, o: str, n: str) -> int:
        raise StorageError("cannot write a manifest")

    monkeypatch.setattr(SnapshotStore, "rewrite_paths", fails)
    with pytest.raises(StorageError):
        relocate(p)
    monkeypatch.setattr(SnapshotStore, "rewrite_paths", real)
    relocate(p)  # the next start
    machine = json.loads((p.sandboxes / "sbx-1" / "machine.json").read_text())
    assert machine["kernel"] == str(new.resolve() / "templates" / "python" / "vmlinuz")
    backing = backing_file(p.sandboxes / "sbx-1" / "disk.qcow2")
    assert backing == new.resolve() / "templates" / "python" / "snapshot" / "disk.qcow2"
