"""Stored snapshots without a VM: freeze, save, list, materialize, verification, bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from torpor.config import Paths, paths
from torpor.errors import (
    Conflict,
    CorruptData,
    EngineError,
    InvalidArgument,
    InvalidName,
    InvalidState,
    SnapshotNotFound,
    StorageError,
    TemplateNotFound,
)
from torpor.sandbox.storage import snapshots as snapmod
from torpor.sandbox.storage.chunks import ChunkStore
from torpor.sandbox.storage.snapshots import SnapshotStore, backing_chain, backing_file, freeze

try:  # plain pytest puts this directory on sys.path; a package layout needs the relative form
    from tests.sandbox.storage_helpers import make_home, make_machine, qemu_io
except ImportError:  # pragma: no cover
    from .storage_helpers import make_home, make_machine, qemu_io


def _same_files(a: Path, b: Path, names: list[str]) -> None:
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n


def test_freeze_keeps_machine_and_makes_immutable_layer(tmp_path: Path) -> None:
    p = make_home(tmp_path)
    m = make_machine(p, "sb1")
    ram_before = (m / "ram").read_bytes()
    f = freeze(m, p.snapshots / "frozen")
    assert (f / "ram").read_bytes() == ram_before
    assert not (f / "console.log").exists()
    # the machine now writes to a new overlay on top of the frozen layer
    assert backing_file(m / "disk.qcow2") == f / "disk.qcow2"
    qemu_io(m / "disk.qcow2", "write -P 0x99 2M 64k")
    assert "read 65536" in qemu_io(f / "disk.qcow2", "read -P 0x42 2M 64k")
    assert "read 65536" in qemu_io(m / "disk.qcow2", "read -P 0x99 2M 64k")


def test_save_and_materialize_round_trip(tmp_path: Path) -> None:
    p = make_home(tmp_path)
    m = make_machine(p, "sb1")
    store = SnapshotStore(p)
    f = freeze(m, store.frozen_root)
    info = store.save(f, name="before", retention_days=30, sandbox_id="sb1", template="python")
    assert [s.id for s in store.list()] == [info.id]
    assert store.get("before").id == info.id
    assert info.expires_at - info.created_at == timedelta(days=30)
    out = store.materialize(info.id)
    _same_files(f, out, ["ram", "state", "machine.json"])
    # the disk layer is self-contained against the template disk
    tdisk = p.templates / "python" / "snapshot" / "disk.qcow2"
    assert backing_chain(out / "disk.qcow2") == [tdisk]
    assert "read 65536" in qemu_io(out / "disk.qcow2", "read -P 0x42 2M 64k")
    assert "read 1048576" in qemu_io(out / "disk.qcow2", "read -P 0x11 0 1M")


def test_intermediate_layers_are_folded_in(tmp_path: Path) -> None:
    p = make_home(tmp_path)
    m = make_machine(p, "sb1")
    store = SnapshotStore(p)
    freeze(m, store.frozen_root)  # first layer: fill 0x42 at 2M
    qemu_io(m / "disk.qcow2", "write -P 0x77 4M 64k")
    f2 = freeze(m, store.frozen_root)
    assert len(backing_chain(f2 / "disk.qcow2")) == 2
    info = store.save(f2, name="two")
    out = store.materialize(info.id)
    assert len(backing_chain(out / "disk.qcow2")) == 1
    assert "read 65536" in qemu_io(out / "disk.qcow2", "read -P 0x42 2M 64k")
    assert "read 65536" in qemu_io(out / "disk.qcow2", "read -P 0x77 4M 64k")


def test_snapshots_of_one_template_share_chunks(tmp_path: Path) -> None:
    p = make_home(tmp_path)
    store = SnapshotStore(p)
    a = store.save(freeze(make_machine(p, "a", fill=0x42), store.frozen_root), name="a")
    b = store.save(freeze(make_machine(p, "b", fill=0x42), store.frozen_root), name="b")
    assert b.stored_bytes < a.stored_bytes


def test_flipped_byte_fails_restore_naming_the_snapshot(tmp_path: Path) -> None:
    p = make_home(tmp_path)
    store = SnapshotStore(p)
    info = store.save(freeze(make_machine(p, "sb1"), store.frozen_root), name="s")
    chunk = next(iter(store.chunks))
    path = store.chunks.path_of(chunk)
    blob = bytearray(path.read_bytes())
    blob[-3] ^= 0x40
    path.chmod(0o600)
    path.write_bytes(bytes(blob))
    before = set(store.frozen_root.iterdir())
    with pytest.raises(CorruptData) as err:
        store.materialize(info.id)
    assert err.value.data["snapshot_id"] == info.id
    assert set(store.frozen_root.iterdir()) == before  # nothing half-made left


def _flip_a_byte(store: SnapshotStore, chunk: str) -> None:
    path = store.chunks.path_of(chunk)
    blob = bytearray(path.read_bytes())
    blob[-3] ^= 0x40
    path.chmod(0o600)
    path.write_bytes(bytes(blob))


def test_one_bad_chunk_does_not_poison_later_snapshots(tmp_path: Path) -> None:
    """A chunk that fails its check is quarantined, so the next snapshot of the same data
    writes it again, and the earlier snapshot that names it reads again too."""
    p = make_home(tmp_path)
    store = SnapshotStore(p)
    m = make_machine(p, "sb1")
    first = store.save(freeze(m, store.frozen_root), name="first")
    for chunk in list(store.chunks):
        _flip_a_byte(store, chunk)
    with pytest.raises(CorruptData):
        store.materialize(first.id)  # the first bad read quarantines what it reads
    report = store.verify()  # the scrub quarantines the rest and names who is hurt
    assert report["affected"].keys() <= {first.id}
    assert not list(store.chunks)  # every flipped chunk moved aside
    second = store.save(freeze(m, store.frozen_root), name="second")  # same data, rewritten
    store.materialize(second.id)
    store.materialize(first.id)  # healed by content addressing
    assert store.verify()["bad_chunks"] == []


def test_a_scrub_names_the_snapshots_a_bad_chunk_affects(tmp_path: Path) -> None:
    p = make_home(tmp_path)
    store = SnapshotStore(p)
    info = store.save(freeze(make_machine(p, "sb1"), store.frozen_root), name="s")
    assert store.verify() == {"chunks": len(list(store.chunks)), "bad_chunks": [], "affected": {}}
    chunk = sorted(store.chunks)[0]
    _flip_a_byte(store, chunk)
    report = store.verify()
    assert report["bad_chunks"] == [chunk]
    assert report["affected"] == {info.id: [chunk]}
    assert (store.chunks.root / "quarantine" / f"{chunk}.zst").exists()


def test_tampered_manifest_is_not_listed(tmp_path: Path) -> None:
    p = make_home(tmp_path)
    store = SnapshotStore(p)
    info = store.save(freeze(make_machine(p, "sb1"), store.frozen_root), name="s")
    mpath = p.snapshots / f"{info.id}.json"
    body = json.loads(mpath.read_text())
    body["info"]["retention_days"] = 365
    mpath.write_text(json.dumps(body))
    assert store.list() == []
    with pytest.raises(SnapshotNotFound):
        store.materialize(info.id)


def test_rebuilt_template_is_detected(tmp_path: Path) -> None:
    p = make_home(tmp_path)
    store = SnapshotStore(p)
    info = store.save(freeze(make_machine(p, "sb1"), store.frozen_root), name="s")
    tdisk = p.templates / "python" / "snapshot" / "disk.qcow2"
    tdisk.unlink()
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(tdisk), "32M"], check=True)
    with pytest.raises(CorruptData, match="rebuilt"):
        store.materialize(info.id)


def test_names_unique_per_tenant(tmp_path: Path) -> None:
    p = make_home(tmp_path)
    store = SnapshotStore(p)
    f = freeze(make_machine(p, "sb1"), store.frozen_root)
    store.save(f, name="same")
    with pytest.raises(Conflict):
        store.save(f, name="same")
    other = store.save(f, name="same", tenant="acme")
    assert [s.id for s in store.list(tenant="acme")] == [other.id]
    assert len(store.list()) == 1


def test_expired_and_deleted_snapshots_cannot_be_restored(tmp_path: Path) -> None:
    p = make_home(tmp_path)
    store = SnapshotStore(p)
    f = freeze(make_machine(p, "sb1"), store.frozen_root)
    info = store.save(f, name="old", retention_days=1)
    later = datetime.now(UTC) + timedelta(days=2)
    assert store.list(now=later) == []
    gone = store.save(f, name="gone")
    store.delete("gone")
    with pytest.raises(SnapshotNotFound):
        store.materialize(gone.id)
    with pytest.raises(SnapshotNotFound):
        store.delete("gone")
    assert store.get(info.id).id == info.id


@pytest.mark.parametrize(
    "kw, err",
    [
        pytest.param({"name": "Bad Name"}, InvalidName, id="name"),
        pytest.param({"name": "ok", "retention_days": 0}, InvalidArgument, id="retention-0"),
        pytest.param({"name": "ok", "retention_days": 366}, InvalidArgument, id="retention-366"),
    ],
)
def test_bad_input(tmp_path: Path, kw: dict[str, object], err: type[Exception]) -> None:
    p = make_home(tmp_path)
    store = SnapshotStore(p)
    f = freeze(make_machine(p, "sb1"), store.frozen_root)
    with pytest.raises(err):
        store.save(f, **kw)  # type: ignore[arg-type]
    assert store.list() == []


def test_disk_full_during_snapshot_leaves_nothing_listed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = make_home(tmp_path)
    store = SnapshotStore(p)
    f = freeze(make_machine(p, "sb1"), store.frozen_root)
    calls = {"n": 0}
    real = ChunkStore._put_known

    def full(self: ChunkStore, digest: str, data: bytes, **kw: Any) -> int:
        calls["n"] += 1
        if calls["n"] > 2:
            raise StorageError("No space left on device", chunk=digest)
        return real(self, digest, data, **kw)

    monkeypatch.setattr(ChunkStore, "_put_known", full)
    with pytest.raises(StorageError):
        store.save(f, name="full")
    assert store.list() == []
    assert not list(p.snapshots.glob("*.work")) and not list(p.snapshots.glob("snap-*"))
    monkeypatch.setattr(ChunkStore, "_put_known", real)
    assert store.save(f, name="full").name == "full"  # the source is unharmed


def test_freeze_failure_leaves_machine_intact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = make_home(tmp_path)
    m = make_machine(p, "sb1")
    before = sorted(x.name for x in m.iterdir())

    def boom(*args: Path) -> None:
        raise EngineError("qemu-img create failed")

    monkeypatch.setattr(snapmod, "new_overlay", boom)
    with pytest.raises(EngineError):
        freeze(m, p.snapshots / "frozen")
    assert sorted(x.name for x in m.iterdir()) == before
    assert backing_file(m / "disk.qcow2") == p.templates / "python" / "snapshot" / "disk.qcow2"
    assert list((p.snapshots / "frozen").iterdir()) == []


def test_repeated_freezes_keep_the_disk_chain_short(tmp_path: Path) -> None:
    p = make_home(tmp_path)
    m = make_machine(p, "sb1")
    frozen = []
    for i in range(9):
        qemu_io(m / "disk.qcow2", f"write -P {0x20 + i} {4 + i}M 64k")
        frozen.append(freeze(m, p.snapshots / "frozen"))
        assert len(backing_chain(m / "disk.qcow2")) <= snapmod.MAX_LOCAL_LAYERS + 2
    for i in range(9):  # every write is still there, through the folded layers
        assert "read 65536" in qemu_io(m / "disk.qcow2", f"read -P {0x20 + i} {4 + i}M 64k")
    assert "read 65536" in qemu_io(m / "disk.qcow2", "read -P 0x42 2M 64k")
    # older frozen layers are untouched (children may be backed by them)
    assert "read 65536" in qemu_io(frozen[2] / "disk.qcow2", "read -P 0x22 6M 64k")
    store = SnapshotStore(p)
    info = store.save(frozen[-1], name="last")
    out = store.materialize(info.id)
    assert "read 65536" in qemu_io(out / "disk.qcow2", "read -P 0x28 12M 64k")


def test_a_capturing_snapshot_is_listed_cached_and_then_stored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """begin lists the frozen dir at once (capturing, restorable from the cache), complete
    stores it (same id), the cache keeps only the newest ``TORPOR_SNAPSHOT_CACHE``."""
    monkeypatch.setenv("TORPOR_SNAPSHOT_CACHE", "1")
    p = make_home(tmp_path)
    m = make_machine(p, "sb1")
    store = SnapshotStore(p)
    first = store.begin(freeze(m, store.frozen_root), name="first", sandbox_id="sb1")
    assert first.status == "capturing" and first.size_bytes > 0
    assert [(s.id, s.status) for s in store.list()] == [(first.id, "capturing")]
    frozen = store.cached(first.id)
    assert frozen is not None and (frozen / "ram").is_file()
    with pytest.raises(Conflict):
        store.begin(freeze(m, store.frozen_root), name="first")
    with pytest.raises(InvalidState):  # nothing in the chunk store yet
        store.materialize(first.id)
    done = store.complete(first.id)
    assert done is not None and done.id == first.id and done.status == "stored"
    assert done.stored_bytes > 0 and done.created_at == first.created_at
    assert store.complete(first.id) is None  # nothing pending any more
    assert store.cached(first.id) == frozen  # kept: the newest one
    out = store.materialize(first.id)
    _same_files(frozen, out, ["ram", "state", "machine.json"])
    # a spare clone: made once, taken by one restore whole, then made again
    assert store.captures.make_spare(first.id) and not store.captures.make_spare(first.id)
    child = p.sandboxes / "sbx-child"
    assert store.captures.take_spare(first.id, child)
    assert not store.captures.take_spare(first.id, p.sandboxes / "sbx-other")
    _same_files(frozen, child, ["ram", "state"])
    assert backing_file(child / "disk.qcow2") == frozen / "disk.qcow2"
    assert "read 65536" in qemu_io(child / "disk.qcow2", "read -P 0x42 2M 64k")
    assert store.captures.make_spare(first.id)
    second = store.begin(freeze(m, store.frozen_root), name="second")
    store.complete(second.id)
    assert store.cached(first.id) is None and not (frozen / "ram").exists()  # evicted
    assert not store.captures.spare_of(first.id).exists()  # with its spare
    assert store.cached(second.id) is not None
    assert [s.name for s in store.list()] == ["first", "second"]


def test_eviction_keeps_a_capture_whose_pending_record_does_not_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A capturing snapshot's frozen dir is its only copy. Another capture's eviction took a
    record that did not read (one damaged byte) for a stored snapshot's and dropped its RAM:
    once the record read again, complete found no state and dropped the snapshot."""
    monkeypatch.setenv("TORPOR_SNAPSHOT_CACHE", "0")
    p = make_home(tmp_path)
    m = make_machine(p, "sb1")
    store = SnapshotStore(p)
    first = store.begin(freeze(m, store.frozen_root), name="first")
    record = store.captures.pending_root / f"{first.id}.json"
    good = record.read_bytes()
    record.write_bytes(good[:-2] + b"X}")
    second = store.begin(freeze(m, store.frozen_root), name="second")
    store.complete(second.id)  # evicts every stored snapshot's RAM (a cache of 0)
    assert store.cached(second.id) is None
    record.write_bytes(good)
    assert store.cached(first.id) is not None
    done = store.complete(first.id)
    assert done is not None and done.status == "stored"
    assert store.get("first").status == "stored"


def test_a_snapshot_deleted_while_capturing_is_not_stored(tmp_path: Path) -> None:
    p = make_home(tmp_path)
    m = make_machine(p, "sb1")
    store = SnapshotStore(p)
    info = store.begin(freeze(m, store.frozen_root), name="gone")
    frozen = store.cached(info.id)
    assert frozen is not None
    store.delete(info.id)
    assert store.complete(info.id) is None
    assert store.list() == [] and not (p.snapshots / f"{info.id}.json").exists()
    assert not (frozen / "ram").exists()
    with pytest.raises(SnapshotNotFound):
        store.get(info.id)


def test_a_delete_after_a_crash_between_manifest_and_record_removes_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash after a capture wrote its manifest, before its pending record went, leaves
    both. A delete then removed the record only and answered success: the manifest stayed,
    so the deleted snapshot was still listed, restorable and billed."""
    p = make_home(tmp_path)
    m = make_machine(p, "sb1")
    store = SnapshotStore(p)
    info = store.begin(freeze(m, store.frozen_root), name="doomed")

    def crash(name: str) -> None:
        if name == "save:listed":
            raise SystemExit("killed")

    monkeypatch.setattr(snapmod, "failpoint", crash)
    with pytest.raises(SystemExit):
        store.complete(info.id)
    monkeypatch.setattr(snapmod, "failpoint", None)
    assert store.get(info.id).status == "stored"
    store.delete(info.id)
    assert store.list() == []
    with pytest.raises(SnapshotNotFound):
        store.get(info.id)
    assert store.complete(info.id) is None


def test_retention_set_while_capturing_is_kept_and_lists_nothing_half_made(
    tmp_path: Path,
) -> None:
    """A retention change of a capturing snapshot goes into its pending record, not into a
    manifest with no files (which a delete then left behind: the snapshot came back), and the
    stored manifest carries it."""
    p = make_home(tmp_path)
    m = make_machine(p, "sb1")
    store = SnapshotStore(p)
    info = store.begin(freeze(m, store.frozen_root), name="kept", retention_days=3)
    changed = store.set_retention(info.id, 30)
    assert changed.retention_days == 30 and changed.status == "capturing"
    assert not (p.snapshots / f"{info.id}.json").exists()  # no manifest before it is stored
    assert store.get(info.id).retention_days == 30
    done = store.complete(info.id)
    assert done is not None and done.status == "stored" and done.retention_days == 30
    assert done.expires_at == info.created_at + timedelta(days=30)
    assert store.get(info.id).retention_days == 30

    other = store.begin(freeze(m, store.frozen_root), name="dropped")
    store.set_retention(other.id, 20)
    store.delete(other.id)
    with pytest.raises(SnapshotNotFound):
        store.get(other.id)
    assert store.complete(other.id) is None
    assert [s.name for s in store.list()] == ["kept"]


def _build(p: Paths, build_id: str, fill: int) -> Path:
    """Template ``python`` rebuilt as ``build_id`` (its disk holds ``fill`` in its first MiB):
    ``snapshot`` names the new build, older builds stay where they are."""
    tdir = p.templates / "python"
    bdir = tdir / "builds" / build_id / "snapshot"
    bdir.mkdir(parents=True)
    subprocess.run(
        ["qemu-img", "create", "-q", "-f", "qcow2", str(bdir / "disk.qcow2"), "32M"], check=True
    )
    qemu_io(bdir / "disk.qcow2", f"write -P {fill} 0 1M")
    link = tdir / "snapshot"
    if link.is_symlink():
        link.unlink()
    link.symlink_to(Path("builds") / build_id / "snapshot")
    (tdir / "template.json").write_text(
        json.dumps({"name": "python", "build_id": build_id, "directory": str(tdir)})
    )
    return bdir / "disk.qcow2"


def test_a_snapshot_names_the_build_its_disk_rests_on(tmp_path: Path) -> None:
    """A sandbox made from build b1, snapshotted after the template was rebuilt as b2, is a
    b1 snapshot: a node holding only b2 refuses it instead of laying its disk on b2's."""
    a = paths(tmp_path / "a").ensure()
    b1 = _build(a, "b1", 0x11)
    m = a.sandboxes / "sb1"
    m.mkdir(parents=True)
    (m / "ram").write_bytes(b"\x01" * 8192)
    (m / "state").write_bytes(b"state")
    (m / "machine.json").write_text("{}")
    subprocess.run(
        [
            "qemu-img",
            "create",
            "-q",
            "-f",
            "qcow2",
            "-b",
            str(b1),
            "-F",
            "qcow2",
            str(m / "disk.qcow2"),
        ],
        check=True,
    )
    _build(a, "b2", 0x22)  # the template is rebuilt; sb1 still runs on b1
    store = SnapshotStore(a)
    info = store.save(freeze(m, store.frozen_root), name="s", template="python")
    shutil.rmtree(a.templates)  # node a is gone

    b = paths(tmp_path / "b").ensure()  # another node: the template's current build only
    _build(b, "b2", 0x22)
    other = SnapshotStore(b, chunks=store.chunks)
    (b.snapshots / f"{info.id}.json").write_bytes((a.snapshots / f"{info.id}.json").read_bytes())
    with pytest.raises(TemplateNotFound, match="b1"):
        other.materialize(info.id)
    # and where b1 is the current build, it restores on it, reading what it read before
    c = paths(tmp_path / "c").ensure()
    _build(c, "b1", 0x11)
    third = SnapshotStore(c, chunks=store.chunks)
    (c.snapshots / f"{info.id}.json").write_bytes((a.snapshots / f"{info.id}.json").read_bytes())
    out = third.materialize(info.id)
    assert "read 1048576/1048576" in qemu_io(out / "disk.qcow2", "read -P 0x11 0 1M")
