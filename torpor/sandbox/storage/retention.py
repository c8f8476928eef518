"""Retention and garbage collection of snapshot storage.

What goes, in this order (each step only removes what nothing references):

1. **expired snapshots**: manifests past ``expires_at`` (retention 1-365 days, default 7);
2. **frozen dirs** (``snapshots/frozen/<id>/``) that no sandbox's disk chain uses any more —
   a fork's or restore's children run on qcow2 overlays backed by a frozen layer, so a frozen
   layer lives exactly as long as some sandbox dir (or another live frozen layer) names it,
   or a snapshot's cache link does (:mod:`.captures`; links of gone snapshots go here too);
3. **chunks** that no manifest names (a manifest that fails its digest still protects every
   chunk it names: GC never turns a corrupt snapshot into a lost one) — mark-and-sweep:
   the manifests give the mark set, :meth:`ChunkStore.sweep` the rest. A store shared by
   many nodes (``s3://``) is not swept from one home, whose manifests are its own only.
   Compacted paused sandboxes (:mod:`.compaction`) mark the chunks of their RAM;
4. **attachments** of volumes and drives held by sandboxes that no longer exist, or recorded
   but never plugged (a crash mid-attach); and the reverse, a drive's 9p device in a
   machine.json with no attachment record (a crash after the plug, before the record), which
   gets its record back (:func:`restore_unrecorded_drives`);
5. leftovers of interrupted work (``.*.tmp``, ``.*.work``) older than an hour, and in the
   clone pool (:meth:`torpor.sandbox.vm.pool.ClonePool.sweep`) the warm clones of a server
   that died and the clones it left half made; and the QEMUs a process that died left
   lingering on paused sandboxes (:func:`torpor.sandbox.vm.linger.sweep`).

Expired *pauses* (a paused sandbox kept past its ``pause_retention_days``, default 30) are the
manager's records; :func:`torpor.sandbox.checkpoints.collect_garbage` kills those first and then
calls :func:`collect` here with the set of sandboxes still alive.

GC holds the snapshot store's lock exclusively, so it never races a snapshot being written
(which holds it shared) into deleting a chunk that snapshot is about to name.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from torpor.config import Paths
from torpor.errors import CorruptData, StorageError, TorporError
from torpor.sandbox.storage.captures import drop_ram
from torpor.sandbox.storage.chunks import ChunkStore, FileManifest, SweepReport
from torpor.sandbox.storage.compaction import referenced_by_compacted
from torpor.sandbox.storage.drives import DriveStore
from torpor.sandbox.storage.records import LiveIds, live_now
from torpor.sandbox.storage.snapshots import SnapshotStore, backing_chain, step
from torpor.sandbox.storage.volumes import VolumeStore
from torpor.sandbox.vm.disk import is_qcow2
from torpor.sandbox.vm.linger import sweep as linger_sweep
from torpor.sandbox.vm.pool import ClonePool

__all__ = [
    "GcReport",
    "collect_garbage",
    "referenced_frozen",
    "restore_unrecorded_drives",
    "sweep_shared_store",
    "unrecorded_shares",
]

log = logging.getLogger(__name__)

#: interrupted work younger than this may still be in progress in another process
LEFTOVER_GRACE_SECONDS = 3600.0


@dataclass
class GcReport:
    """What one GC pass removed."""

    expired_snapshots: list[str] = field(default_factory=list)
    expired_sandboxes: list[str] = field(default_factory=list)
    removed_frozen: list[str] = field(default_factory=list)
    removed_chunks: int = 0
    freed_bytes: int = 0
    released_attachments: int = 0
    restored_attachments: int = 0
    kept_chunks: int = 0
    dry_run: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "expired_snapshots": self.expired_snapshots,
            "expired_sandboxes": self.expired_sandboxes,
            "removed_frozen": self.removed_frozen,
            "removed_chunks": self.removed_chunks,
            "freed_bytes": self.freed_bytes,
            "released_attachments": self.released_attachments,
            "restored_attachments": self.restored_attachments,
            "kept_chunks": self.kept_chunks,
            "dry_run": self.dry_run,
        }


def _du(path: Path) -> int:
    if path.is_file():
        return path.stat().st_blocks * 512
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file())


def referenced_frozen(paths: Paths, frozen_root: Path) -> set[str]:
    """Names of the frozen dirs some sandbox dir's disk chain passes through."""
    refs: set[str] = set()
    root = frozen_root.resolve()
    if not paths.sandboxes.is_dir():
        return refs
    for sandbox in paths.sandboxes.iterdir():
        if not sandbox.is_dir():
            continue
        for f in sandbox.iterdir():
            if not f.is_file() or not is_qcow2(f):
                continue
            for layer in backing_chain(f):
                resolved = layer.resolve()
                if resolved.is_relative_to(root):
                    refs.add(resolved.relative_to(root).parts[0])
    return refs


def _all_named_chunks(store: SnapshotStore) -> tuple[set[str], list[str]]:
    """Chunks named by any manifest that parses as JSON, digest or not; and the ids of the
    manifests that did not read or parse (one read error, one damaged byte): their chunks
    are unknown, so no chunk may be swept while they stay so."""
    refs: set[str] = set()
    unreadable: list[str] = []
    for entry in store.catalog.entries():
        try:
            if entry.body is None:
                raise ValueError(entry.error)
            for fm in entry.body["files"].values():
                refs |= FileManifest.from_json(fm).hashes()
        except Exception as exc:
            log.error("gc: snapshot manifest %s does not read (%s)", entry.id, exc)
            unreadable.append(entry.id)
    return refs, unreadable


def _plugged(paths: Paths, sandbox_id: str, device_id: str) -> bool:
    """Whether the machine of ``sandbox_id`` has the device ``device_id`` (a volume's disk or
    a drive's share); True when its machine.json cannot tell (nothing is released on doubt)."""
    try:
        config = json.loads((paths.sandboxes / sandbox_id / "machine.json").read_text())
        devices = config["devices"]
        return any(d.get("id") == device_id for d in devices)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return True


def unrecorded_shares(devices: list[dict[str, Any]], recorded: set[str]) -> list[dict[str, Any]]:
    """The 9p share records among a machine.json's ``devices`` whose drive (a share's device
    id is its drive's id) is not in ``recorded``, the drives attached to that sandbox."""
    return [d for d in devices if d.get("kind") == "share" and d.get("id") not in recorded]


def restore_unrecorded_drives(
    paths: Paths, live_sandboxes: set[str], *, before: float | None = None
) -> int:
    """Give back the attachment record of every drive whose 9p device a live sandbox's
    machine has but whose record is missing: an attach that died after plugging the share and
    before recording it (or whose undo could not unplug it). Returns how many were restored.

    Restored, not unplugged: the device is part of the machine, and of its saved state once it
    hibernates, so a paused machine cannot drop it without losing that state; and while it is
    there the guest can mount the drive, so the record must say so (the drive cannot then be
    deleted under it, and it is mounted again after every wake). The mount path is the one
    machine.json kept (``guest_path``), else ``/mnt/<drive name>``. ``before``: skip machines
    whose machine.json changed since this Unix time (an attach in flight); None at a restart,
    when nothing is in flight. A drive that no longer exists is logged and left."""
    drives = DriveStore(paths)
    by_id = {d.id: d for d in drives.list_all()}
    restored = 0
    for sandbox_id in sorted(live_sandboxes):
        file = paths.sandboxes / sandbox_id / "machine.json"
        try:
            if before is not None and file.stat().st_mtime >= before:
                continue
            devices = list(json.loads(file.read_text()).get("devices", []))
        except (OSError, ValueError, AttributeError):
            continue
        recorded = {d.id for d, _ in drives.attached_to(sandbox_id)}
        for dev in unrecorded_shares(devices, recorded):
            drive = by_id.get(str(dev.get("id")))
            if drive is None:
                log.warning(
                    "sandbox %s has the 9p device of drive %s, which is gone", sandbox_id, dev
                )
                continue
            path = dev.get("guest_path") or f"/mnt/{drive.name}"
            try:
                drives.attach(
                    drive.id,
                    sandbox_id,
                    path,
                    read_only=bool(dev.get("read_only")),
                    tenant=drive.tenant,
                )
            except TorporError as exc:
                log.warning("cannot restore drive %s in %s: %s", drive.id, sandbox_id, exc)
                continue
            log.warning(
                "drive %s was plugged into %s but its attachment was never recorded (a crash "
                "mid-attach): recorded now, at %s",
                drive.id,
                sandbox_id,
                path,
            )
            restored += 1
    return restored


def _leftovers(root: Path, now: float) -> list[Path]:
    found: list[Path] = []
    for pattern in (".*.tmp", ".*.work", "*/.*.tmp"):
        for p in root.glob(pattern):
            try:
                if now - p.stat().st_mtime > LEFTOVER_GRACE_SECONDS:
                    found.append(p)
            except FileNotFoundError:
                pass
    return found


def collect_garbage(
    paths: Paths,
    *,
    now: datetime | None = None,
    live_sandboxes: LiveIds | None = None,
    dry_run: bool = False,
    store: SnapshotStore | None = None,
) -> GcReport:
    """Remove expired snapshots and unreferenced frozen dirs, chunks and attachments (of
    sandboxes that are gone, and those recorded but never plugged: a crash mid-attach).

    ``live_sandboxes``: ids of sandboxes that still exist, or a function that gives them
    (default: the dirs under ``sandboxes/``), taken when the attachments are released (a
    sandbox made while GC runs keeps its own); attachments of any other sandbox are
    released. ``dry_run`` reports what would go and removes nothing. ``store``: the home's
    snapshot store (default: its own, local one; a cluster node's records its manifests in
    the registry, so an expired snapshot goes for every node). Raises StorageError when the
    file system fails.
    """
    now = now or datetime.now(UTC)
    report = GcReport(dry_run=dry_run)
    store = store or SnapshotStore(paths)
    if live_sandboxes is None:

        def live_sandboxes() -> set[str]:
            return (
                {d.name for d in paths.sandboxes.iterdir() if d.is_dir()}
                if paths.sandboxes.is_dir()
                else set()
            )

    try:
        with store.lock(exclusive=True):
            for info, _ in list(store.manifests()):
                if info.expired(now):
                    report.expired_snapshots.append(info.id)
                    if not dry_run:
                        store.forget(info.id)
                        step("gc:expired")
            named, unreadable = _all_named_chunks(store)
            frozen_root = store.frozen_root
            if frozen_root.is_dir():
                used = referenced_frozen(paths, frozen_root)
                # a snapshot's cached frozen dir (capturing, or kept for fast restores) is
                # used; a link that names no snapshot (deleted, expired, a crash before its
                # pending record) goes, and its dir with it unless a disk chain names it
                snapshots = {i.id for i, _ in store.manifests()} | set(unreadable)
                snapshots |= store.captures.ids()  # a record that fails to read included
                cached = set()
                for sid, frozen in store.captures.links().items():
                    if sid in snapshots:
                        cached.add(frozen.name)
                    elif not dry_run:
                        store.captures.unlink(sid)
                if not dry_run:
                    store.captures.drop_stale_spares(set(store.captures.links()))
                # RAM in a frozen dir is a clone's input for moments (a fork, a restore) or
                # a cached snapshot's; any other, older than the grace, a crash left behind
                # (a capture the crash cut short left it as ram.tmp). Its age is its last
                # change of any kind: a fork's is a hard link made a moment ago to a RAM
                # file last written hours ago (the link shows in the ctime only)
                for d in frozen_root.glob("frz-*"):
                    rams = [r for r in (d / "ram", d / "ram.tmp") if r.is_file()]
                    if d.name in cached or not rams:
                        continue
                    touched = max(max(st.st_mtime, st.st_ctime) for st in map(Path.stat, rams))
                    if time.time() - touched > LEFTOVER_GRACE_SECONDS:
                        report.freed_bytes += sum(_du(r) for r in rams)
                        if not dry_run:
                            drop_ram(d)
                used |= cached
                # a used frozen layer keeps the layers below it
                for name in list(used):
                    disk_files = [f for f in (frozen_root / name).iterdir() if is_qcow2(f)]
                    for f in disk_files:
                        for layer in backing_chain(f):
                            r = layer.resolve()
                            if r.is_relative_to(frozen_root.resolve()):
                                used.add(r.relative_to(frozen_root.resolve()).parts[0])
                for d in sorted(frozen_root.iterdir()):
                    if d.is_dir() and d.name.startswith("frz-") and d.name not in used:
                        report.removed_frozen.append(d.name)
                        report.freed_bytes += _du(d)
                        if not dry_run:
                            shutil.rmtree(d)
                            step("gc:frozen")
                for p in _leftovers(frozen_root, time.time()):
                    report.freed_bytes += _du(p)
                    if not dry_run:
                        shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
            if dry_run:
                expired = set(report.expired_snapshots)
                named = set()
                for info, body in store.manifests():
                    if info.id not in expired:
                        for fm in body["files"].values():
                            named |= FileManifest.from_json(fm).hashes()
            try:  # compacted paused sandboxes keep their RAM's chunks
                named |= set(referenced_by_compacted(paths.sandboxes))
                compacted: CorruptData | None = None
            except CorruptData as exc:
                compacted = exc
            if unreadable:
                log.error(
                    "gc: snapshot manifests %s do not read; no chunk is swept until they do",
                    ", ".join(unreadable),
                )
            elif compacted is not None:
                log.error("gc: %s; no chunk is swept until it is fixed", compacted)
            elif store.chunks.backend.shared:
                # the manifests here are this node's only: a sweep would take other nodes'
                # chunks. A shared store is swept with the cluster's whole mark set.
                log.info(
                    "gc: %s is shared; its chunks are not swept from one home",
                    store.chunks.location,
                )
            else:
                swept = store.chunks.sweep(
                    named, dry_run=dry_run, on_removed=lambda _: step("gc:chunk")
                )
                report.removed_chunks += swept.removed
                report.kept_chunks += swept.kept
                report.freed_bytes += swept.freed_bytes
            for p in _leftovers(store.root, time.time()) + _leftovers(paths.chunks, time.time()):
                report.freed_bytes += _du(p)
                if not dry_run:
                    shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
        if not dry_run:
            step("gc:attachments")
            before = time.time() - LEFTOVER_GRACE_SECONDS
            for records in (VolumeStore(paths), DriveStore(paths)):
                report.released_attachments += records.release(keep=live_sandboxes)
                report.released_attachments += records.release_unplugged(
                    lambda sid, rid: _plugged(paths, sid, rid), before=before
                )
            report.restored_attachments = restore_unrecorded_drives(
                paths, live_now(live_sandboxes), before=before
            )
            # warm clones whose server died, half-made clones (a live server's are kept)
            ClonePool(paths.cache / "pool", 0).sweep()
            linger_sweep(paths.sandboxes)  # QEMUs kept lingering by a process that died
    except OSError as exc:
        raise StorageError(f"garbage collection failed: {exc}", exc=exc) from exc
    log.info("gc: %s", report.to_json())
    return report


def sweep_shared_store(
    chunks: ChunkStore,
    marked: set[str],
    *,
    dry_run: bool = False,
    min_age_seconds: float | None = None,
) -> SweepReport:
    """Sweep a chunk store many nodes share: delete every chunk not in ``marked``, which must
    come from whatever holds every node's manifests (the PostgreSQL registry:
    ``referenced_chunks()``). Chunks younger than ``min_age_seconds`` (default: the store's
    grace, an hour for S3) stay, since a node may be uploading a snapshot whose manifest is not
    recorded yet. Raises StorageError."""
    grace = getattr(chunks.backend, "gc_grace_seconds", 0.0)
    return chunks.sweep(
        marked,
        dry_run=dry_run,
        min_age_seconds=grace if min_age_seconds is None else min_age_seconds,
    )
