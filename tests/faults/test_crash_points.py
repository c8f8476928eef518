"""A crash at every step of a restore and of GC loses nothing and leaves no half state.

Each step is a deterministic crash point (``snapshots.failpoint``); the operation runs in a
child process that *exits on the spot* there (``os._exit``: no ``finally``, no ``except``
cleanup, as under SIGKILL). Then, as after a restart, GC runs once more (with the leftover
grace over: the restart came later), and:

* every listed snapshot still restores to the bytes it was taken with,
* the machine that stands on a frozen dir still reads its whole disk,
* what was garbage is gone: expired snapshots, frozen dirs no disk stands on, half-made
  ``.tmp`` dirs, chunks no manifest names, attachments of sandboxes that are gone.

(Crash points of freeze: ``test_freeze_crash.py``; of pause and wake on real QEMU:
``tests/sandbox/test_crash.py``.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.sandbox.storage_helpers import make_home, make_machine, qemu_io
from torpor.config import Paths
from torpor.errors import SnapshotNotFound
from torpor.sandbox.storage import retention
from torpor.sandbox.storage.chunks import FileManifest
from torpor.sandbox.storage.drives import DriveStore
from torpor.sandbox.storage.retention import collect_garbage, referenced_frozen
from torpor.sandbox.storage.snapshots import SnapshotInfo, SnapshotStore, freeze
from torpor.sandbox.storage.volumes import VolumeStore

WORKER = r"""
import os, sys
from pathlib import Path
from datetime import UTC, datetime, timedelta
from torpor.config import paths
from torpor.sandbox.storage import snapshots as snapmod
from torpor.sandbox.storage.retention import collect_garbage
from torpor.sandbox.storage.snapshots import SnapshotStore

home, op, step, arg = sys.argv[1:5]

def failpoint(name):
    if name == step:
        os._exit(137)  # the process dies here: nothing after it runs, nothing is cleaned up

snapmod.failpoint = failpoint
p = paths(home)
if op == "restore":
    SnapshotStore(p).materialize(arg)
elif op == "capture":
    store = SnapshotStore(p)
    store.complete(store.begin(Path(arg), name="captured").id)
else:
    collect_garbage(p, now=datetime.now(UTC) + timedelta(days=int(arg)))
sys.exit(3)  # the step was never reached
"""

LATER = 2  # days: GC runs this far ahead, past the short snapshot's expiry


def _crash(p: Paths, op: str, step: str, arg: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", WORKER, str(p.home), op, step, arg],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert proc.returncode == 137, f"never crashed at {step}: {proc.returncode} {proc.stderr}"


def _world(tmp_path: Path) -> tuple[Paths, Path, SnapshotInfo, SnapshotInfo]:
    """A home with a machine on a frozen dir, a kept and a short-lived snapshot, a frozen dir
    nothing stands on, and a drive attached to a sandbox that is gone."""
    p = make_home(tmp_path)
    machine = make_machine(p, "sbx-1")
    store = SnapshotStore(p)
    kept = store.save(freeze(machine, store.frozen_root), name="kept", retention_days=30)
    qemu_io(machine / "disk.qcow2", "write -P 0x66 4M 64k")  # data only the short one holds
    (machine / "ram").write_bytes(os.urandom(64 << 10))
    short = store.save(freeze(machine, store.frozen_root), name="short", retention_days=1)
    store.materialize(kept.id)  # a restore's frozen dir whose child is gone: garbage
    drives = DriveStore(p)
    drive = drives.create("shared")
    drives.attach(drive.id, "sbx-gone", "/mnt/shared")
    return p, machine, kept, short


def _nothing_lost_nothing_half(p: Paths, machine: Path, kept: SnapshotInfo) -> None:
    store = SnapshotStore(p)
    # the machine still reads its own write and the template's data through its chain
    assert "read 65536" in qemu_io(machine / "disk.qcow2", "read -P 0x66 4M 64k")
    assert "read 65536" in qemu_io(machine / "disk.qcow2", "read -P 0x42 2M 64k")
    assert "read 1048576" in qemu_io(machine / "disk.qcow2", "read -P 0x11 0 1M")
    # the kept snapshot restores whole
    out = store.materialize(kept.id)
    assert "read 65536" in qemu_io(out / "disk.qcow2", "read -P 0x42 2M 64k")
    assert (out / "state").is_file() and (out / "ram").stat().st_size == 8 << 20
    # no half state: no .tmp, no frozen dir without a disk on it (but the one just made),
    # no chunk without a manifest, no attachment of a gone sandbox
    frozen = {d.name for d in store.frozen_root.iterdir()} - {out.name}
    assert not any(n.startswith(".") for n in frozen), frozen
    assert frozen <= referenced_frozen(p, store.frozen_root), frozen
    named: set[str] = set()
    for _, body in store.manifests():
        for fm in body["files"].values():
            named |= FileManifest.from_json(fm).hashes()
    assert named and set(store.chunks) <= named
    assert all(not d.attachments for d in DriveStore(p).list())


@pytest.fixture(autouse=True)
def no_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    """The restart comes after the leftover grace: a crash's .tmp is garbage by then."""
    monkeypatch.setattr(retention, "LEFTOVER_GRACE_SECONDS", -1)


@pytest.mark.parametrize("step", ["materialize:restored", "materialize:renamed"])
def test_a_crash_at_any_step_of_a_restore_loses_nothing(tmp_path: Path, step: str) -> None:
    p, machine, kept, short = _world(tmp_path)
    _crash(p, "restore", step, short.id)
    collect_garbage(p, now=datetime.now(UTC) + timedelta(days=LATER))
    _nothing_lost_nothing_half(p, machine, kept)
    with pytest.raises(SnapshotNotFound):
        SnapshotStore(p).materialize(short.id)  # expired by the later GC: gone, not half


@pytest.mark.parametrize("step", ["gc:expired", "gc:frozen", "gc:chunk", "gc:attachments"])
def test_a_crash_at_any_step_of_gc_loses_nothing(tmp_path: Path, step: str) -> None:
    p, machine, kept, short = _world(tmp_path)
    _crash(p, "gc", step, str(LATER))
    collect_garbage(p, now=datetime.now(UTC) + timedelta(days=LATER))  # after the restart
    _nothing_lost_nothing_half(p, machine, kept)
    assert short.id not in {i.id for i, _ in SnapshotStore(p).manifests()}


def _machine_json(machine: Path, devices: list[dict[str, Any]]) -> None:
    (machine / "machine.json").write_text(json.dumps({"version": 1, "devices": devices}))


def test_a_crash_between_recording_an_attach_and_plugging_it_is_undone(tmp_path: Path) -> None:
    """An attach records the attachment (it reserves the resource), then plugs the device.
    A process that dies in between leaves a record no machine backs: the volume stayed
    attached for good (a read-write attach elsewhere was a Conflict). GC releases it once the
    record is older than an attach in flight; a plugged attachment stays."""
    p = make_home(tmp_path)
    machine = make_machine(p, "sbx-1")
    volumes, drives = VolumeStore(p), DriveStore(p)
    vol = volumes.create("data", size_mib=16)
    half, whole = drives.create("half"), drives.create("whole")
    volumes.attach(vol.id, "sbx-1", "/data")  # recorded, then the crash: never plugged
    drives.attach(half.id, "sbx-1", "/mnt/half")
    drives.attach(whole.id, "sbx-1", "/mnt/whole")
    _machine_json(machine, [{"id": whole.id, "kind": "share"}])

    report = collect_garbage(p, live_sandboxes={"sbx-1"})  # after the restart
    assert report.released_attachments == 2
    assert not volumes.get(vol.id).attachments and not drives.get(half.id).attachments
    assert [a.sandbox_id for a in drives.get(whole.id).attachments] == ["sbx-1"]
    make_machine(p, "sbx-2")
    volumes.attach(vol.id, "sbx-2", "/data")  # no Conflict: the volume is free again


def test_an_attach_in_flight_is_not_taken_for_a_crashed_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(retention, "LEFTOVER_GRACE_SECONDS", 3600.0)
    p = make_home(tmp_path)
    _machine_json(make_machine(p, "sbx-1"), [])
    drives = DriveStore(p)
    drive = drives.create("shared")
    drives.attach(drive.id, "sbx-1", "/mnt/shared")  # plugging now, in another task
    assert collect_garbage(p, live_sandboxes={"sbx-1"}).released_attachments == 0
    assert drives.get(drive.id).attachments


def test_a_crash_between_plugging_a_drive_and_recording_it_is_reconciled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 12: the reverse of the case above. A drive attach plugs the 9p share (machine.json
    names it, with the mount path), then records the attachment; a crash in between leaves a
    device the guest can mount while the drive's record says nobody has it (so it could be
    deleted under the sandbox, and it is never mounted again after a wake). At the restart
    (and in GC) the record is restored: the device is in the machine's saved state, so it
    cannot simply be dropped from a paused machine."""
    p = make_home(tmp_path)
    drives = DriveStore(p)
    crashed, legacy, gone, kept = (drives.create(n) for n in ("crashed", "legacy", "gone", "kept"))
    share: dict[str, Any] = {"kind": "share", "path": "/x", "tag": "t", "slot": 5}
    _machine_json(
        make_machine(p, "sbx-1"),
        [
            {**share, "id": crashed.id, "read_only": True, "guest_path": "/data/in"},
            {**share, "id": legacy.id, "read_only": False},  # a machine.json from before
            {**share, "id": gone.id, "read_only": False},
            {**share, "id": kept.id, "read_only": False, "guest_path": "/k"},
            {"kind": "disk", "id": "vol-1"},
        ],
    )
    drives.attach(kept.id, "sbx-1", "/k")
    drives.delete(gone.id)
    devices = json.loads((p.sandboxes / "sbx-1" / "machine.json").read_text())["devices"]
    assert [d["id"] for d in retention.unrecorded_shares(devices, {kept.id})] == [
        crashed.id,
        legacy.id,
        gone.id,
    ]
    # GC leaves a machine.json younger than an attach in flight alone
    monkeypatch.setattr(retention, "LEFTOVER_GRACE_SECONDS", 3600.0)
    assert collect_garbage(p, live_sandboxes={"sbx-1"}).restored_attachments == 0
    assert not drives.get(crashed.id).attachments
    # the restart: nothing is in flight
    assert retention.restore_unrecorded_drives(p, {"sbx-1"}) == 2
    att = drives.get(crashed.id).attachments
    assert [(a.sandbox_id, a.path, a.read_only) for a in att] == [("sbx-1", "/data/in", True)]
    assert [a.path for a in drives.get(legacy.id).attachments] == ["/mnt/legacy"]
    assert [a.path for a in drives.get(kept.id).attachments] == ["/k"]
    assert retention.restore_unrecorded_drives(p, {"sbx-1"}) == 0  # idempotent
    monkeypatch.setattr(retention, "LEFTOVER_GRACE_SECONDS", 0.0)
    assert collect_garbage(p, live_sandboxes={"sbx-1"}).restored_attachments == 0


@pytest.mark.parametrize(
    "step", ["capture:linked", "capture:pending", "save:chunked", "save:listed"]
)
def test_a_crash_at_any_step_of_a_background_capture_loses_nothing(
    tmp_path: Path, step: str
) -> None:
    """A snapshot returned to its caller (its pending record written) is stored by the
    restart's recovery, whole; one cut before that is garbage, and its RAM goes."""
    p, machine, kept, _ = _world(tmp_path)
    ram = (machine / "ram").read_bytes()
    frozen = freeze(machine, SnapshotStore(p).frozen_root)
    _crash(p, "capture", step, str(frozen))
    store = SnapshotStore(p)  # the restart: Checkpoints.recover completes what is pending
    for sid, _ in list(store.captures.records()):
        store.complete(sid)
    assert not list(store.captures.records())
    collect_garbage(p, now=datetime.now(UTC) + timedelta(days=LATER))
    _nothing_lost_nothing_half(p, machine, kept)
    names = {i.name: i for i in store.list()}
    if step == "capture:linked":  # never returned to a caller
        assert "captured" not in names
        assert not (frozen / "ram").exists()  # GC gave back the RAM nothing names
    else:
        info = names["captured"]
        assert info.status == "stored"
        out = store.materialize(info.id)
        assert (out / "ram").read_bytes() == ram
        assert "read 65536" in qemu_io(out / "disk.qcow2", "read -P 0x66 4M 64k")
