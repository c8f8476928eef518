"""Snapshots: immutable, verified copies of a hibernated machine, kept in the chunk store.

Two kinds of frozen machine directory exist:

* a **frozen dir** (``snapshots/frozen/<id>/``) is a raw, local, never-run copy of a hibernated
  machine: RAM file, device state, ``machine.json`` and the disk layer. :func:`freeze` makes one
  from a paused sandbox in well under a second: the RAM file is copied (reflink where the file
  system allows, sparse otherwise) and the sandbox's qcow2 overlay is *moved* into the frozen dir
  and replaced by a fresh overlay on top of it, so the sandbox can run on while the frozen layer
  stays immutable. :func:`freeze_live` makes one from a *running* sandbox without pausing it
  (QEMU switches to the new overlay and the RAM is copied while the guest is stopped for
  those milliseconds). Forks and restores clone a frozen dir (``qemu.clone_machine_dir``).
* a **stored snapshot** is a frozen dir captured into the chunk store by :meth:`SnapshotStore.save`:
  every file as hashed, compressed, deduplicated chunks plus a manifest ``snapshots/<id>.json``.
  The disk layer is stored relative to the template's disk (``qemu-img rebase`` folds any
  intermediate frozen layers in), so a stored snapshot depends on nothing but its template.

The manifest is written last, atomically, after every chunk is durable, and carries a digest of
its own body; :meth:`SnapshotStore.list` shows only manifests whose digest and chunks check, and
:meth:`SnapshotStore.materialize` verifies every chunk's hash (a flipped byte -> CorruptData
naming the snapshot).

The manifest's format and the store's reading half (list, get, push, scrub) are in
:mod:`~torpor.sandbox.storage.manifests`; the qcow2 backing chains a freeze deepens and folds,
in :mod:`~torpor.sandbox.storage.backing`. Both are re-exported here.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import shutil
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

from torpor.config import Paths, check_name
from torpor.errors import (
    CorruptData,
    EngineError,
    InvalidState,
    SnapshotNotFound,
    StorageError,
)
from torpor.sandbox.storage.backing import (
    backing_chain,
    backing_file,
    folded_copy,
    is_under,
    template_anchor,
)
from torpor.sandbox.storage.captures import PendingCaptures, cache_size, drop_ram
from torpor.sandbox.storage.catalog import LocalCatalog, SnapshotCatalog, not_found
from torpor.sandbox.storage.chunks import ChunkStore, FileManifest, home_chunk_store
from torpor.sandbox.storage.compaction import MARKER as COMPACTED_MARKER
from torpor.sandbox.storage.manifests import (
    FORMAT_VERSION,
    CarriedSettings,
    ManifestReader,
    SnapshotInfo,
    check_retention,
    dump_info,
    file_identity,
    manifest_digest,
    template_build,
)
from torpor.sandbox.storage.records import rewrite_prefix
from torpor.sandbox.vm.disk import (
    copy_sparse,
    fsync_dir,
    is_qcow2,
    new_overlay,
    set_backing,
    virtual_size,
)

__all__ = [
    "FORMAT_VERSION",
    "MAX_LOCAL_LAYERS",
    "CarriedSettings",
    "SnapshotInfo",
    "SnapshotStore",
    "backing_chain",
    "backing_file",
    "check_retention",
    "freeze",
    "freeze_live",
    "store_lock",
    "waited",
]

log = logging.getLogger(__name__)

#: frozen layers a machine's disk may sit on before :func:`freeze` folds them into one
MAX_LOCAL_LAYERS = 4
#: files of a machine dir that are never captured: sockets, logs, pid and lock files
_VOLATILE_SUFFIXES = (".sock", ".log", ".pid", ".lock", ".tmp")

# -- frozen dirs --------------------------------------------------------------------------------


#: Called with the name of each step of :func:`freeze`, :meth:`SnapshotStore.materialize` (a
#: restore) and GC as it completes; tests raise or exit from it to stop the process at an exact
#: point (a crash), as the manager's ``on_step`` does for pause (``tests/faults``).
failpoint: Callable[[str], None] | None = None


def step(name: str) -> None:
    """Report the step ``name`` to :data:`failpoint` (a crash point in the fault tests)."""
    if failpoint is not None:
        failpoint(name)


@contextlib.contextmanager
def store_lock(paths: Paths, *, exclusive: bool = False, name: str = "store") -> Iterator[None]:
    """Hold the home's ``snapshots/.<name>.lock`` for the block. ``store``: whoever puts
    chunks that no manifest names yet (a save, a compaction) holds it shared until one does;
    GC's sweep holds it exclusive. ``names``: snapshot names commit one at a time."""
    paths.snapshots.mkdir(parents=True, exist_ok=True)
    fd = os.open(paths.snapshots / f".{name}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


@contextlib.asynccontextmanager
async def waited(lock: contextlib.AbstractContextManager[Any]) -> AsyncIterator[None]:
    """Hold the file lock ``lock`` (:func:`store_lock`, a cache's ``in_use``) for the block,
    waiting for it in a thread: GC holds the store's lock for its whole pass, and a wait on
    the event loop stood every other call still meanwhile. A caller cancelled while it waits
    holds nothing: the lock is let go as soon as the thread has it."""
    entering = asyncio.ensure_future(asyncio.to_thread(lock.__enter__))
    try:
        await asyncio.shield(entering)
    except BaseException:

        def let_go(done: asyncio.Future[Any]) -> None:
            if not done.cancelled() and done.exception() is None:
                lock.__exit__(None, None, None)

        entering.add_done_callback(let_go)
        raise
    try:
        yield
    finally:
        lock.__exit__(None, None, None)


def freeze(machine_dir: Path, frozen_root: Path, *, link_ram: bool = False) -> Path:
    """Make an immutable local copy of the hibernated machine in ``machine_dir``.

    The machine must not be running. Returns the new frozen dir. Regular files are copied
    sparsely; each qcow2 overlay is hard-linked into the frozen dir, and only once that dir is
    whole and durable is the overlay in ``machine_dir`` swapped (rename) for a new overlay
    backed by it (same guest-visible content). So at every instant ``machine_dir`` holds a
    whole disk: the old overlay, or the new one over the frozen layer; a crash at any point
    loses nothing (a frozen dir left unreferenced is only extra links, for GC). ``link_ram``:
    hard-link the RAM file instead of copying it — only for a caller that clones it and removes
    the link before the machine runs again (a fork). On failure the machine dir is left as it
    was and no frozen dir remains. Raises StorageError / EngineError.
    """
    if (machine_dir / COMPACTED_MARKER).is_file():
        # its RAM file is an empty shell until expanded (storage.compaction.expand)
        raise StorageError(
            f"{machine_dir} is compacted: expand its RAM from the chunk store before freezing",
            path=str(machine_dir),
        )
    frozen_root.mkdir(parents=True, exist_ok=True)
    fid = f"frz-{uuid.uuid4().hex[:12]}"
    tmp = frozen_root / f".{fid}.tmp"
    final = frozen_root / fid
    layers: list[Path] = []  # the machine's qcow2 files, to swap for overlays on the frozen dir
    swapped: list[Path] = []
    try:
        tmp.mkdir()
        for entry in sorted(machine_dir.iterdir()):
            if not entry.is_file() or entry.is_symlink() or entry.name.endswith(_VOLATILE_SUFFIXES):
                continue
            if entry.name.startswith("."):  # a live capture's overlay alias, a spare overlay
                continue
            if link_ram and entry.name == "ram":
                os.link(entry, tmp / entry.name)
            elif not is_qcow2(entry):
                copy_sparse(entry, tmp / entry.name)
            elif len([b for b in backing_chain(entry) if is_under(b, frozen_root)]) >= (
                MAX_LOCAL_LAYERS
            ):
                # Every freeze adds a layer under the machine; past a few, fold them into one
                # layer on the template's disk so the chain (and each disk read) stays short.
                # The old layers stay as they are for whoever else is backed by them.
                folded_copy(entry, tmp / entry.name, template_anchor(entry, (frozen_root,)))
                layers.append(entry)
            else:
                os.link(entry, tmp / entry.name)  # the machine keeps its disk meanwhile
                layers.append(entry)
        step("freeze:copied")
        os.rename(tmp, final)
        fsync_dir(frozen_root)  # the frozen dir is durable before anything depends on it
        step("freeze:published")
        for original in layers:
            fresh = original.with_name(f".{original.name}.tmp")
            new_overlay(final / original.name, fresh)
            os.replace(fresh, original)  # atomic: the old overlay or the new one, never none
            swapped.append(original)
            step("freeze:swapped")
        fsync_dir(machine_dir)
        for f in final.iterdir():
            if not (link_ram and f.name == "ram"):  # a link shares the source's mode
                f.chmod(0o400)  # a frozen layer is never written again
    except (OSError, StorageError, EngineError) as exc:
        base = final if final.exists() else tmp
        for original in layers:  # a spare overlay never swapped in
            original.with_name(f".{original.name}.tmp").unlink(missing_ok=True)
        for original in swapped:  # put the machine's own layer back as it was
            with contextlib.suppress(OSError):
                os.replace(base / original.name, original)
        shutil.rmtree(base, ignore_errors=True)
        if isinstance(exc, OSError):
            raise StorageError(f"cannot freeze {machine_dir.name}: {exc}", exc=exc) from exc
        raise
    log.info("froze %s into %s", machine_dir.name, fid)
    return final


class LiveMachine(Protocol):
    """A running machine that can be copied without hibernating it
    (:meth:`torpor.sandbox.vm.machine.QemuMachine.capture` is one)."""

    async def capture(
        self,
        *,
        overlay: Path,
        state: Path,
        ram: Path,
        stopped: Callable[[str], None] | None = None,
        fill_ram: bool = False,
        precopy: bool = False,
    ) -> float: ...


async def freeze_live(
    machine_dir: Path,
    frozen_root: Path,
    machine: LiveMachine,
    *,
    for_clones: bool = False,
    published: Callable[[Path], Awaitable[None]] | None = None,
    saved: Callable[[Path], None] | None = None,
) -> tuple[Path, float]:
    """Make an immutable local copy of the *running* machine in ``machine_dir``; the machine
    runs on. Returns the frozen dir and how long the guest stood still (seconds).

    Before the guest stops, the frozen dir is published holding a hard link of the machine's
    disk layer and a copy of ``machine.json``, and a new overlay backed by that link is made
    beside the disk. During the stop (:meth:`LiveMachine.capture`) QEMU switches to the
    overlay, which is renamed to ``disk.qcow2``, and the device state and a copy of the RAM
    are written into the frozen dir; they get their final names (after an fsync) once the
    guest runs again. So at every instant ``disk.qcow2`` names the layer QEMU writes and every
    layer under it exists: a crash at any point loses nothing (a frozen dir left without RAM
    is only a disk layer, kept while an overlay names it, else removed by GC). Past
    :data:`MAX_LOCAL_LAYERS` the frozen layer is replaced by a folded copy (same content)
    after the guest runs again. ``for_clones``: the RAM copy stays writable (a fork's children
    take it); else (a snapshot) the RAM is copied once before the stop too, so the copy in
    the stop is shorter (``precopy``: see :meth:`LiveMachine.capture`).
    ``published(frozen_dir)`` is awaited once the frozen dir is published, before the guest
    stops, with ``ram.tmp`` made there already (empty, at the RAM's size), which the stop
    then fills in place: a fork starts its child's QEMU on a hard link of it, so the child's
    start overlaps the source's stop (:meth:`Checkpoints.fork`); if it raises, the freeze is
    undone and that is raised. ``saved(state_file)`` is called inside the stop once the RAM
    copy and the device state are whole, before ``cont`` (the fork's child loads them while
    the source resumes); if it raises, the capture fails and is undone. On failure no RAM or
    state remains in a frozen dir. Raises StorageError / EngineError / InvalidState.
    """
    fid = f"frz-{uuid.uuid4().hex[:12]}"
    tmp, final = frozen_root / f".{fid}.tmp", frozen_root / fid
    disk = machine_dir / "disk.qcow2"
    overlay = machine_dir / f".disk-{fid}.qcow2"

    def publish() -> None:
        frozen_root.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        for entry in sorted(machine_dir.iterdir()):
            if not entry.is_file() or entry.is_symlink() or entry.name.endswith(_VOLATILE_SUFFIXES):
                continue
            if entry.name in ("ram", "state") or entry.name.startswith("."):
                continue
            if entry.name == "disk.qcow2":
                os.link(entry, tmp / entry.name)  # QEMU writes it until the switch
            elif is_qcow2(entry):
                raise StorageError(f"{machine_dir.name} has a second disk {entry.name}")
            else:
                copy_sparse(entry, tmp / entry.name)
        step("freeze:copied")
        os.rename(tmp, final)
        fsync_dir(frozen_root)
        step("freeze:published")
        new_overlay(final / "disk.qcow2", overlay, size=virtual_size(disk))
        if published is not None:
            with open(final / "ram.tmp", "xb") as f:
                f.truncate((machine_dir / "ram").stat().st_size)

    def settle() -> None:
        # no fsync: a frozen dir's RAM and state are inputs of the save (whose chunks and
        # manifest are made durable) or of clones (whose own state is); a power loss before
        # that leaves a frozen dir that nothing lists, and GC keeps only its disk layer
        for name in ("state", "ram"):
            os.replace(final / f"{name}.tmp", final / name)
        if not for_clones:  # a fork's children take the RAM and state at once: no sync
            fsync_dir(final)
        layer = final / "disk.qcow2"
        if len([b for b in backing_chain(layer) if is_under(b, frozen_root)]) >= MAX_LOCAL_LAYERS:
            # the machine's chain grows by one per capture: past a few, the frozen layer is
            # replaced by a folded copy (the same disk); the running QEMU keeps its open chain
            folded = final / ".disk.qcow2.fold"
            folded_copy(layer, folded, template_anchor(layer, (frozen_root,)))
            os.replace(folded, layer)
            fsync_dir(final)
        for f in final.iterdir():
            if not (for_clones and f.name == "ram"):
                f.chmod(0o400)  # a frozen layer is never written again

    try:
        await asyncio.to_thread(publish)
        if published is not None:
            await published(final)
        into, state = final / "ram.tmp", final / "state.tmp"

        def stopped(name: str) -> None:
            step(name)
            if name == "capture:saved" and saved is not None:
                saved(state)

        if published is not None:  # a fork: its child waits for the RAM
            downtime = await machine.capture(
                overlay=overlay, state=state, ram=into, stopped=stopped, fill_ram=True
            )
        else:  # a snapshot (the shorter stop) or a fork of many (the sooner return)
            downtime = await machine.capture(
                overlay=overlay, state=state, ram=into, stopped=stopped, precopy=not for_clones
            )
        step("freeze:captured")
        await asyncio.to_thread(settle)
    except BaseException as exc:
        if not isinstance(exc, OSError | StorageError | EngineError | InvalidState) and (
            published is None or not isinstance(exc, Exception | asyncio.CancelledError)
        ):
            raise  # the process is going down (a crash point in tests): leave all as is
        overlay.unlink(missing_ok=True)
        for name in ("state", "ram", "state.tmp", "ram.tmp"):
            with contextlib.suppress(OSError):
                (final / name).unlink()
        try:
            named = backing_file(disk)
        except StorageError:
            named = None
        if named is None or not is_under(named, final):  # the machine is not on it: drop it
            shutil.rmtree(final, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError):
            raise StorageError(f"cannot freeze {machine_dir.name}: {exc}", exc=exc) from exc
        raise
    log.info("froze running %s into %s (stood still %.3fs)", machine_dir.name, fid, downtime)
    return final, downtime


class SnapshotStore(ManifestReader):
    """Stored snapshots of one torpor home: manifests under ``snapshots/``, chunks in
    ``chunks/`` (or in the store ``$TORPOR_STORE`` names, e.g. ``s3://bucket/prefix``: see
    :func:`~torpor.sandbox.storage.chunks.open_chunk_store`). The writes are here; list,
    get, push and scrub come from :class:`~torpor.sandbox.storage.manifests.ManifestReader`."""

    def __init__(
        self,
        paths: Paths,
        *,
        chunks: ChunkStore | None = None,
        catalog: SnapshotCatalog | None = None,
    ) -> None:
        self.paths = paths
        self.root = paths.snapshots
        self.frozen_root = paths.snapshots / "frozen"
        self.chunks = chunks or home_chunk_store(paths)
        #: where the manifests are recorded: ``snapshots/`` here, or the cluster's registry
        self.catalog: SnapshotCatalog = catalog or LocalCatalog(self.root)
        self.root.mkdir(parents=True, exist_ok=True)
        #: snapshots still being captured, and the local frozen dirs restores clone from
        self.captures = PendingCaptures(self.root, self.frozen_root)

    # -- locking: saves share the store, GC takes it alone, names commit one at a time --------

    def lock(
        self, *, exclusive: bool = False, name: str = "store"
    ) -> contextlib.AbstractContextManager[None]:
        """Hold ``snapshots/.<name>.lock`` (shared or exclusive) for the block."""
        return store_lock(self.paths, exclusive=exclusive, name=name)

    # -- writing ------------------------------------------------------------------------------

    def save(
        self,
        frozen: Path,
        *,
        name: str,
        tenant: str = "default",
        retention_days: int = 7,
        sandbox_id: str | None = None,
        template: str | None = None,
        labels: dict[str, str] | None = None,
        volumes: list[dict[str, Any]] | None = None,
        drives: list[dict[str, Any]] | None = None,
        carried: CarriedSettings | None = None,
        envs: dict[str, str] | None = None,
        snapshot_id: str | None = None,
        created: datetime | None = None,
        origin: dict[str, Any] | None = None,
    ) -> SnapshotInfo:
        """Capture the frozen dir ``frozen`` into the chunk store as snapshot ``name``.
        ``envs``: the source's environment variables, kept in the manifest beside (not in)
        its info, so a restore carries them over and no listing shows them (:meth:`envs`).
        ``snapshot_id`` / ``created``: those of a pending capture (:meth:`begin`) this
        completes; its manifest is written only while its pending record still exists (a
        snapshot deleted while capturing is not brought back).
        ``origin``: where it was taken (cluster mode: ``{"node", "accelerator",
        "cpu_model"}``; a restore checks it, see :meth:`origin`). The template's build is
        recorded too, so another node with the same build restores it on its own copy.

        Raises InvalidName / InvalidArgument for bad input, Conflict if ``name`` is taken in
        ``tenant``, SnapshotNotFound (the pending capture was deleted), StorageError /
        EngineError if capture fails (then nothing is listed; chunks written so far are left
        for GC).
        """
        check_name(name, "snapshot name")
        check_retention(retention_days)
        self.check_name_free(name, tenant, exclude=snapshot_id)
        if snapshot_id is None:
            self.check_room(tenant)
        sid = snapshot_id or f"snap-{uuid.uuid4().hex[:12]}"
        created = created or datetime.now(UTC)
        files: dict[str, Any] = {}
        anchors: dict[str, Any] = {}
        size = new = 0
        local_roots = (self.frozen_root, self.paths.sandboxes)
        on: Path | None = None  # the template disk the snapshot's disk rests on
        work = self.root / f".{sid}.work"
        with self.lock():
            try:
                for entry in sorted(frozen.iterdir()):
                    if not entry.is_file() or entry.name.endswith(_VOLATILE_SUFFIXES):
                        continue
                    source = entry
                    if is_qcow2(entry):
                        anchor = template_anchor(entry, local_roots)
                        if backing_file(entry) != anchor:
                            # fold the local frozen layers in: rebase onto the template's disk
                            work.mkdir(exist_ok=True)
                            source = work / entry.name
                            folded_copy(entry, source, anchor)
                        anchors[entry.name] = None if anchor is None else file_identity(anchor)
                        on = on or anchor
                    fm = self.chunks.put_file(source)
                    files[entry.name] = fm.to_json()
                    size += fm.size
                    new += fm.new_bytes
                self.chunks.sync_dirs()
                step("save:chunked")
            finally:
                shutil.rmtree(work, ignore_errors=True)
            info = SnapshotInfo(
                id=sid,
                name=name,
                tenant=tenant,
                sandbox_id=sandbox_id,
                template=template,
                labels=dict(labels or {}),
                carried=carried or CarriedSettings(),
                retention_days=retention_days,
                created_at=created,
                expires_at=created + timedelta(days=retention_days),
                size_bytes=size,
                stored_bytes=new,
                volumes=list(volumes or []),
                drives=list(drives or []),
            )
            body = {
                "version": FORMAT_VERSION,
                "info": dump_info(info),
                "files": files,
                "anchors": anchors,
            }
            if envs:
                body["envs"] = dict(envs)
            if origin:
                body["origin"] = dict(origin)
            build = None if template is None else template_build(self.paths, template, disk=on)
            if build is not None:
                body["template"] = build
            with self.lock(exclusive=True, name="names"):
                self.check_name_free(name, tenant, exclude=snapshot_id)
                if snapshot_id is None:  # again, under the lock (a save at once took it)
                    self.check_room(tenant)
                else:
                    pending = self.captures.read(snapshot_id)
                    if pending is None:
                        raise SnapshotNotFound(
                            f"snapshot {snapshot_id} was deleted while it was captured",
                            kind="snapshot",
                            name=snapshot_id,
                        )
                    # its retention may have changed while it was captured (set_retention)
                    kept = SnapshotInfo.model_validate(pending["info"])
                    info = info.model_copy(
                        update={
                            "retention_days": kept.retention_days,
                            "expires_at": kept.expires_at,
                        }
                    )
                    body["info"] = dump_info(info)
                self._write_manifest(sid, body, new=True)
                step("save:listed")
                if snapshot_id is not None:
                    self.captures.remove(snapshot_id)
        log.info("snapshot %s (%s): %d bytes, %d new in the store", sid, name, size, new)
        return info

    def begin(
        self,
        frozen: Path,
        *,
        name: str,
        tenant: str = "default",
        retention_days: int = 7,
        sandbox_id: str | None = None,
        template: str | None = None,
        labels: dict[str, str] | None = None,
        drives: list[dict[str, Any]] | None = None,
        carried: CarriedSettings | None = None,
        envs: dict[str, str] | None = None,
    ) -> SnapshotInfo:
        """List the frozen dir ``frozen`` as snapshot ``name``, ``capturing``: it is cached
        (restores clone it) and a pending record says what :meth:`complete` will store (see
        :mod:`~torpor.sandbox.storage.captures`). ``frozen`` must hold RAM and state and is
        the snapshot's from now on. Raises as :meth:`save` for bad input, a taken name or a
        full quota, StorageError."""
        check_name(name, "snapshot name")
        check_retention(retention_days)
        sid = f"snap-{uuid.uuid4().hex[:12]}"
        created = datetime.now(UTC)
        size = sum(
            f.stat().st_size
            for f in frozen.iterdir()
            if f.is_file() and not f.name.endswith(_VOLATILE_SUFFIXES)
        )
        info = SnapshotInfo(
            id=sid,
            name=name,
            tenant=tenant,
            sandbox_id=sandbox_id,
            template=template,
            labels=dict(labels or {}),
            carried=carried or CarriedSettings(),
            retention_days=retention_days,
            created_at=created,
            expires_at=created + timedelta(days=retention_days),
            size_bytes=size,
            drives=list(drives or []),
            status="capturing",
        )
        body = {"version": FORMAT_VERSION, "info": info.model_dump(mode="json")}
        if envs:
            body["envs"] = dict(envs)
        with self.lock(), self.lock(exclusive=True, name="names"):  # GC waits for both
            self.check_room(tenant)  # under the lock: two at once cannot both take the last
            self.check_name_free(name, tenant)
            self.captures.link(sid, frozen)  # first: a record always names a linked dir
            step("capture:linked")
            self.captures.write(sid, body)
            step("capture:pending")
        log.info("snapshot %s (%s): frozen in %s, capturing", sid, name, frozen.name)
        return info

    def complete(self, snapshot_id: str) -> SnapshotInfo | None:
        """Store the pending snapshot ``snapshot_id`` (chunks, then its manifest, then its
        pending record goes), then give back the RAM of cached snapshots past
        :func:`~torpor.sandbox.storage.captures.cache_size`. Returns its info, or None if
        nothing is pending under that id (done, or deleted). Idempotent: after a crash it is
        run again from the same frozen dir. Raises StorageError / EngineError (the record
        stays: a later call retries)."""
        body = self.captures.read(snapshot_id)
        if body is None:
            return None
        if any(True for _ in self.catalog.entries(snapshot_id)):  # a crash after the manifest
            self.captures.remove(snapshot_id)
            return self.get(snapshot_id, tenant=body["info"]["tenant"], include_expired=True)
        frozen = self.captures.frozen_of(snapshot_id)
        if frozen is None or not (frozen / "state").is_file():
            log.error("pending snapshot %s lost its frozen dir; dropping it", snapshot_id)
            self.captures.remove(snapshot_id)
            return None
        pending = SnapshotInfo.model_validate(body["info"])
        try:
            info = self.save(
                frozen,
                name=pending.name,
                tenant=pending.tenant,
                retention_days=pending.retention_days,
                sandbox_id=pending.sandbox_id,
                template=pending.template,
                labels=pending.labels,
                drives=pending.drives,
                carried=pending.carried,
                envs=body.get("envs"),
                snapshot_id=snapshot_id,
                created=pending.created_at,
            )
        except SnapshotNotFound:  # deleted meanwhile
            return None
        self.evict()
        return info

    def evict(self, keep: int | None = None) -> list[str]:
        """Give back the RAM of stored snapshots' cached frozen dirs past the newest ``keep``
        (default :func:`~torpor.sandbox.storage.captures.cache_size`); nothing while a clone
        copies from the cache. Returns the snapshot ids evicted."""
        keep = cache_size() if keep is None else keep
        pending = self.captures.ids()  # a record that fails to read included: its dir is
        stored = [  # the snapshot's only copy
            (frozen.stat().st_mtime if frozen.exists() else 0.0, sid, frozen)
            for sid, frozen in self.captures.links().items()
            if sid not in pending
        ]
        stored.sort(reverse=True)
        gone: list[str] = []
        with self.captures.evicting() as free:
            if not free:
                return gone
            for _, sid, frozen in stored[keep:]:
                self.captures.unlink(sid)
                drop_ram(frozen)
                gone.append(sid)
        return gone

    def _write_manifest(self, sid: str, body: dict[str, Any], *, new: bool = False) -> None:
        """Record ``body`` (with its digest) as snapshot ``sid``'s manifest: a ``new`` one
        only once every chunk it names is stored; a rewritten one (retention, a moved home)
        names the chunks it named when it was new."""
        if new:  # every chunk must be present before the manifest may name it
            for fm in body["files"].values():
                for digest in FileManifest.from_json(fm).hashes():
                    if not self.chunks.has(digest):
                        raise StorageError(
                            f"snapshot {sid}: chunk {digest[:12]} vanished before "
                            "the manifest was written",
                            snapshot_id=sid,
                        )
        body = dict(body, digest=manifest_digest(body))
        if new:
            self.catalog.add(sid, body)
        else:
            self.catalog.replace(sid, body)

    def set_retention(self, id_or_name: str, days: int, *, tenant: str = "default") -> SnapshotInfo:
        """Keep a snapshot ``days`` days (1-365) from when it was taken: its manifest is
        rewritten (atomically, digest renewed) with the new ``retention_days`` and
        ``expires_at``. A snapshot past its expiry that GC has not removed yet can be kept
        longer this way. Holds the store exclusively, so GC cannot remove it meanwhile.
        Raises InvalidArgument (days), SnapshotNotFound, StorageError."""
        check_retention(days)
        with self.lock(exclusive=True):
            info, body = self._find(id_or_name, tenant, include_expired=True)
            info = info.model_copy(
                update={
                    "retention_days": days,
                    "expires_at": info.created_at + timedelta(days=days),
                }
            )
            if info.status == "capturing":  # its manifest is not written yet: the pending
                with self.lock(exclusive=True, name="names"):  # record carries it there
                    # (a save holds the store shared: it cannot have listed it meanwhile)
                    if self.captures.read(info.id) is None:
                        raise not_found(id_or_name)  # deleted meanwhile
                    self.captures.write(info.id, dict(body, info=info.model_dump(mode="json")))
            else:
                self._write_manifest(info.id, dict(body, info=dump_info(info)))
        log.info("snapshot %s (%s): retention set to %d days", info.id, info.name, days)
        return info

    def rewrite_paths(self, old: str, new: str) -> int:
        """Move every path a manifest stores under directory ``old`` to ``new`` (the home was
        moved: :mod:`torpor.sandbox.storage.relocate`), with a fresh digest. Returns how many
        manifests changed. Raises StorageError."""
        changed = 0
        with self.lock(exclusive=True):
            for info, body in self.manifests():
                moved = rewrite_prefix(body, old, new)
                if moved != body:
                    self._write_manifest(info.id, moved)
                    changed += 1
        return changed

    def delete(self, id_or_name: str, *, tenant: str = "default") -> SnapshotInfo:
        """Remove a snapshot's manifest (its chunks go at the next GC; in a cluster, from
        every node and the shared store). Raises SnapshotNotFound, StorageError."""
        info = self.get(id_or_name, tenant=tenant, include_expired=True)
        try:
            with self.lock(exclusive=True, name="names"):  # not while a capture completes
                # both: a crash between a capture's manifest and its record's removal left
                # the two (the manifest, kept, listed the deleted snapshot again)
                pending = self.captures.remove(info.id)
                if not self.catalog.remove(info.id) and not pending:
                    raise not_found(id_or_name)
            with self.captures.evicting() as free:
                if free:
                    frozen = self.captures.unlink(info.id)
                    if frozen is not None:
                        drop_ram(frozen)
                else:  # a clone copies from the cache now: GC gives the RAM and spare back
                    self.captures.forget(info.id)
        except FileNotFoundError as exc:
            raise SnapshotNotFound(
                f"snapshot {id_or_name!r} not found", kind="snapshot", name=id_or_name
            ) from exc
        except OSError as exc:
            raise StorageError(f"cannot delete snapshot {info.id}: {exc}", exc=exc) from exc
        log.info("deleted snapshot %s (%s)", info.id, info.name)
        return info

    def forget(self, snapshot_id: str) -> bool:
        """Remove a manifest by id whatever its tenant (GC of expired snapshots); True when it
        was there. Raises StorageError."""
        return self.catalog.remove(snapshot_id)

    def materialize(self, id_or_name: str, *, tenant: str = "default") -> Path:
        """Rebuild the snapshot as a new frozen dir (every chunk verified) and return it.

        Raises SnapshotNotFound (deleted or expired), CorruptData (a bad chunk, or the template
        disk it was taken on changed), StorageError. Nothing is left behind on failure.
        """
        info, body = self._find(id_or_name, tenant, include_expired=False)
        if "files" not in body:  # capturing, and its frozen dir lost its RAM (cannot be: kept)
            raise InvalidState(
                f"snapshot {info.id} is still being captured and has no local copy",
                state="capturing",
                required=["stored"],
            )
        anchors: dict[str, Any] = dict(body.get("anchors") or {})
        moved: tuple[str, str] | None = None  # the template's directory there -> here
        for name, ident in anchors.items():
            if ident is None:
                continue
            anchor = Path(ident["path"])
            if anchor.exists() and file_identity(anchor) == ident:
                continue
            here = self._same_template(info, body)
            if here is None:
                raise CorruptData(
                    f"snapshot {info.id}: the template disk it was taken on ({anchor}) is gone or "
                    "was rebuilt since",
                    snapshot_id=info.id,
                    path=str(anchor),
                )
            # another node's home (cluster mode): the same template build here
            anchors[name] = dict(ident, path=str(here[0] / anchor.name))
            moved = here[1]
        self.frozen_root.mkdir(parents=True, exist_ok=True)
        fid = f"frz-{uuid.uuid4().hex[:12]}"
        tmp = self.frozen_root / f".{fid}.tmp"
        try:
            tmp.mkdir()
            for name, fm in body["files"].items():
                if "/" in name or name.startswith("."):
                    raise CorruptData(
                        f"snapshot {info.id}: bad file name {name!r}", snapshot_id=info.id
                    )
                self.chunks.restore_file(
                    FileManifest.from_json(fm), tmp / name, snapshot_id=info.id
                )
                anchor_id = anchors.get(name)
                if anchor_id is not None and backing_file(tmp / name) != Path(anchor_id["path"]):
                    # the manifest is what says where the template disk is (a moved home)
                    set_backing(tmp / name, Path(anchor_id["path"]))
            if moved is not None and (tmp / "machine.json").exists():
                config = json.loads((tmp / "machine.json").read_text())
                config = rewrite_prefix(config, *moved)
                (tmp / "machine.json").write_text(json.dumps(config, indent=2))
            step("materialize:restored")
            final = self.frozen_root / fid
            os.rename(tmp, final)
            step("materialize:renamed")
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise StorageError(
                f"cannot restore snapshot {info.id}: {exc}", exc=exc, snapshot_id=info.id
            ) from exc
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        for f in final.iterdir():
            f.chmod(0o400)
        log.info("materialized snapshot %s into %s", info.id, fid)
        return final
