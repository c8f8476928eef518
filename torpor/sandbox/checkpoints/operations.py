"""Snapshot, restore, fork, volumes and drives: the operations on top of the SandboxManager.

How each one works (the storage is in :mod:`~torpor.sandbox.storage.snapshots`):

* **snapshot(sandbox)**: under the sandbox's lock, a *running* sandbox is not paused: the
  guest flushes its file systems, then
  :func:`~torpor.sandbox.storage.snapshots.freeze_live` stops its vCPUs only while QEMU
  switches the disk to a new overlay (the old top layer becomes the frozen one), saves the
  device state and the RAM file is copied, and resumes it; the same QEMU, channel and
  processes run on (:attr:`Checkpoints.last_downtime` says how long it stood still). A
  paused one (or one with a drive mounted: QEMU cannot save a mounted 9p share) is frozen by
  :func:`~torpor.sandbox.storage.snapshots.freeze` (RAM copied sparsely, the disk overlay
  moved aside and replaced by a new overlay on top of it), paused and woken around it as
  needed. The call returns once the frozen copy is listed, ``capturing``
  (:meth:`~torpor.sandbox.storage.snapshots.SnapshotStore.begin`: a cache link and a pending
  record, see :mod:`~torpor.sandbox.storage.captures`); a background task makes a spare
  clone of it, then captures it into the content-addressed chunk store and writes the
  checked manifest (``stored``; :meth:`Checkpoints.wait_stored` waits for it, ``wait=True``
  returns only then). A crash in between is finished by :meth:`Checkpoints.recover`.
* **restore(snapshot)**: a snapshot whose frozen dir is still cached locally (capturing, or
  among the newest ``$TORPOR_SNAPSHOT_CACHE`` stored) is cloned from that dir, its spare
  clone moved in when there is one (else the child's QEMU starts while its RAM is copied);
  any other is rebuilt from verified chunks into a frozen dir first. The new sandbox is woken
  and given fresh entropy and the host's clock.
* **fork(sandbox, count)**: freeze as for a snapshot (live for a running source, with no
  guest flush: RAM and disk are taken at one instant; for a paused one the frozen RAM is a
  hard link to the source's, cloned into every child before the source could run again),
  then the children wake. Nothing goes through the chunk store, so a child costs one sparse
  RAM copy and a wake (the last child takes the frozen copy itself). The children of a
  running source start before the source stops (:meth:`Cloner.start_pending`): the last
  one's QEMU maps a link of the frozen RAM the stop then fills, the others' map RAM files of
  their own, filled from it once the source runs again; so QEMU's start overlaps the stop and
  the copies, and each child loads the state as soon as its RAM is whole (the last one once
  the copies are done). All children or none: a failure removes the ones already made. A fork
  of a snapshot id is a restore of ``count`` children.

**Volumes and snapshots.** A volume is shared, long-lived data and is never part of a snapshot.
The guest has it mounted with cached file-system state, so a snapshot or fork of a sandbox with a
volume attached would later run a kernel that trusts a disk that has moved on (or a second
writer). Such a snapshot or fork is refused with a Conflict that says what to do: copy the data
you want captured onto the sandbox's own disk (``cp -a /memory /workspace/memory-copy``) and
snapshot a sandbox without volumes, or keep the volume as the durable copy. Nothing is lost.

**Drives** (virtio-9p) block migration while mounted, so every hibernate here unmounts the
sandbox's drives first and mounts them again after the wake; a busy mount is a Conflict.
Children of a fork or restore mount the same drives (drives are multi-writer by design).

Where each part lives: this module has the class, freezing, snapshot, restore, fork and create;
cloning children from a frozen dir is :mod:`torpor.sandbox.checkpoints.clones`; attaching
volumes and drives (and the drive hooks around a hibernate) is
:mod:`torpor.sandbox.checkpoints.attach`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar, cast

from torpor.config import check_name
from torpor.errors import (
    Conflict,
    InvalidArgument,
    InvalidState,
    TorporError,
)
from torpor.sandbox.checkpoints.attach import Attachments
from torpor.sandbox.checkpoints.clones import Children, Cloner, Pending, drop_ram
from torpor.sandbox.manager import SYNC_TIMEOUT, Held, SandboxManager
from torpor.sandbox.models import SandboxInfo
from torpor.sandbox.models import SandboxState as S
from torpor.sandbox.registry import SandboxRecord
from torpor.sandbox.registry.lifecycle import EXPIRED
from torpor.sandbox.registry.usage.report import sync_stored
from torpor.sandbox.requests import (
    ForkSpec,
    GcSpec,
    RestoreSpec,
    SandboxOptions,
    SandboxSpec,
    SnapshotSpec,
)
from torpor.sandbox.storage.compaction import expand, is_compacted
from torpor.sandbox.storage.drives import DriveStore
from torpor.sandbox.storage.retention import (
    GcReport,
    collect_garbage,
    restore_unrecorded_drives,
)
from torpor.sandbox.storage.snapshots import (
    CarriedSettings,
    SnapshotInfo,
    SnapshotStore,
    freeze,
    freeze_live,
    waited,
)
from torpor.sandbox.storage.volumes import VolumeStore
from torpor.sandbox.vm.disk import virtual_size

__all__ = ["VOLUME_SNAPSHOT_REFUSAL", "Checkpoints"]

log = logging.getLogger(__name__)
T = TypeVar("T")

#: how long before its pause expires a paused sandbox is warned about (at each GC)
EXPIRY_WARNING = 24 * 3600.0

#: what a snapshot or fork of a sandbox with a volume does (also the Conflict's message)
VOLUME_SNAPSHOT_REFUSAL = (
    "sandbox {sandbox} has volume(s) {volumes} attached; volumes are never part of a snapshot "
    "or fork (they are shared data that outlives sandboxes, and the guest's cached view of them "
    "would not match the disk after a restore). Nothing was changed. To capture that data, copy "
    "it onto the sandbox's own disk (e.g. `cp -a {path} /workspace/`) in a sandbox without "
    "volumes and snapshot that one; the volume itself keeps its data as it is."
)


class Checkpoints:
    """Snapshots, restores, forks, volumes and drives of one :class:`SandboxManager`.

    Coroutines raise SandboxNotFound / SnapshotNotFound / VolumeNotFound / DriveNotFound,
    InvalidArgument (bad count, path, retention), Conflict (names, sharing rules, volumes on a
    snapshot), InvalidState / StateLost (the sandbox's state), CorruptData (a bad chunk),
    StorageError / EngineError / GuestError from below.

    Two components do part of the work: :attr:`attachments`
    (:class:`~torpor.sandbox.checkpoints.attach.Attachments`: attaching volumes and drives, and
    the manager's guest hook for drives) and :attr:`cloner`
    (:class:`~torpor.sandbox.checkpoints.clones.Cloner`: children out of a frozen dir). Both,
    and this class, reach the manager's internals only through
    :class:`~torpor.sandbox.manager.Held`.
    """

    def __init__(self, manager: SandboxManager) -> None:
        self.manager = manager
        self.paths = manager.paths
        cluster = manager.cluster
        #: in cluster mode the manifests are the registry's and the chunks are pushed to the
        #: shared store (see :meth:`~torpor.sandbox.manager.cluster.ClusterNode.snapshot_store`)
        self.snapshots = SnapshotStore(self.paths) if cluster is None else cluster.snapshot_store()
        #: in cluster mode their records are the registry's (every node sees every one)
        self.volumes = VolumeStore(self.paths) if cluster is None else cluster.volume_store()
        self.drives = DriveStore(self.paths) if cluster is None else cluster.drive_store()
        self.held: Held = manager
        self.attachments = Attachments(manager, self.volumes, self.drives)
        self.cloner = Cloner(manager, self.drives)
        #: how long the guest stood still in the last live snapshot or fork (seconds)
        self.last_downtime: float | None = None
        #: snapshots being stored in the chunk store in the background, by id
        self._captures: dict[str, asyncio.Task[SnapshotInfo | None]] = {}
        #: spare RAM copies of cached snapshots being made (see storage.captures)
        self._spares: set[asyncio.Task[bool]] = set()
        hooks = manager.guest_hooks
        if not any(isinstance(h, Attachments) for h in hooks):
            hooks.append(self.attachments)  # drives are unmounted/remounted around a hibernate

    # -- freezing a live sandbox ---------------------------------------------------------

    async def _freeze(
        self,
        tenant: str,
        id_or_name: str,
        then: Callable[[SandboxRecord, Path, Any], Awaitable[T]],
        *,
        before_wake: Callable[[SandboxRecord, Path], Awaitable[Any]] | None = None,
        link_ram: bool = False,
        before_stop: Callable[[SandboxRecord, Path], Awaitable[Callable[[Path], None]]]
        | None = None,
        undo: Callable[[T], Awaitable[None]] | None = None,
    ) -> T:
        """Freeze the sandbox: a running one live (:meth:`_freeze_live`, never paused), a
        paused one as it is, one with a drive mounted by pause + freeze + wake.

        ``before_wake(record, frozen_dir)`` runs under the sandbox's lock, before the source
        could change the frozen files (with ``link_ram`` on the pause path the frozen RAM is
        the source's own file, so it must be done with it and drop it before returning; on
        the live path the frozen RAM is a copy it may let the last child take);
        ``then(record, frozen_dir, before_wake's result)`` runs after (alongside the source's
        wake on the pause path, after the lock is released on the live path, so the source's
        calls go on meanwhile). ``before_stop(record, frozen_dir)`` runs on the live path only,
        once the frozen dir is published and before the source stops, and returns what is
        called inside the stop with the saved state's file (see
        :func:`~torpor.sandbox.storage.snapshots.freeze_live`'s ``published`` and
        ``saved``). ``undo(result)`` removes what ``then`` made when the source's wake
        alongside it failed (the call raises that failure: nothing is left made). Returns
        what ``then`` returns."""
        m = self.held
        rec = m.registry.find(tenant, id_or_name)
        self._refuse_volumes(rec)  # before the lease; again under the lock (see there)
        await m.take(rec.id)  # cluster mode: Conflict (proxied) when another node runs it
        try:
            return await self._frozen_held(rec, link_ram, before_wake, then, before_stop, undo)
        finally:
            await m.give_back(rec.id)

    def _refuse_volumes(self, rec: SandboxRecord) -> None:
        """Raise Conflict (:data:`VOLUME_SNAPSHOT_REFUSAL`) if the sandbox has a volume."""
        vols = self.volumes.attached_to(rec.id)
        if vols:
            raise Conflict(
                VOLUME_SNAPSHOT_REFUSAL.format(
                    sandbox=rec.name,
                    volumes=", ".join(v.name for v, _ in vols),
                    path=vols[0][1].path,
                ),
                sandbox_id=rec.id,
                volumes=[v.id for v, _ in vols],
            )

    async def _frozen_held(
        self,
        rec: SandboxRecord,
        link_ram: bool,
        before_wake: Callable[[SandboxRecord, Path], Awaitable[Any]] | None,
        then: Callable[[SandboxRecord, Path, Any], Awaitable[T]],
        before_stop: Callable[[SandboxRecord, Path], Awaitable[Callable[[Path], None]]]
        | None = None,
        undo: Callable[[T], Awaitable[None]] | None = None,
    ) -> T:
        """:meth:`_freeze`'s work once the sandbox is this node's (see there)."""
        m = self.held
        live = m.live(rec.id)
        async with live.lock:
            rec = m.registry.get(rec.id)
            # a volume attached since the first look (it records, then plugs under this
            # lock) would be frozen into the machine: a second writer in every restore
            self._refuse_volumes(rec)
            if rec.state is S.PAUSED:
                await m.fetch_pause(rec)  # cluster mode: its files may be on another node
            if rec.state is S.ERROR:
                raise m.lost(rec)
            if rec.state not in (S.RUNNING, S.PAUSED):
                raise InvalidState(
                    f"sandbox {rec.id} is {rec.state.value}; snapshot and fork need it running "
                    "or paused",
                    sandbox_id=rec.id,
                    state=rec.state.value,
                    required=["running", "paused"],
                )
            was_running = rec.state is S.RUNNING
            if was_running and self._can_capture_live(rec, live):
                await m.drain(live)
                frozen = await self._freeze_live(
                    rec, live, for_clones=link_ram, before_stop=before_stop
                )
                was_running = False  # nothing to wake: the source never stopped running
                try:
                    prepared = None if before_wake is None else await before_wake(rec, frozen)
                except BaseException:
                    drop_ram(frozen)
                    raise
                jobs: list[Awaitable[Any]] = []
            else:
                if was_running:
                    await m.drain(live)
                    rec = await m.pause_held(rec, live, "snapshot")  # drives: via guest_hooks
                try:
                    directory = m.directory(rec.id)
                    if is_compacted(directory):  # a long-paused one: its RAM is in the chunk store
                        await asyncio.to_thread(
                            expand, directory, self.snapshots.chunks, sandbox_id=rec.id
                        )
                    async with waited(self.snapshots.lock()):
                        frozen = await asyncio.to_thread(
                            freeze, directory, self.snapshots.frozen_root, link_ram=link_ram
                        )
                    prepared = None if before_wake is None else await before_wake(rec, frozen)
                except BaseException:
                    if was_running:
                        await m.wake_held(rec, live, "snapshot failed")
                    raise
                # The frozen dir is immutable from here: the source wakes while ``then``
                # (capture or clone children) works on the copy, so the two costs overlap.
                jobs = [then(rec, frozen, prepared)]
                if was_running:
                    jobs.append(m.wake_held(rec, live, "snapshot taken"))
                results = await asyncio.gather(*jobs, return_exceptions=True)
        if not jobs:  # live: the source's calls go on while ``then`` works on the frozen dir
            return await then(rec, frozen, prepared)
        for r in results:
            if isinstance(r, BaseException):
                if undo is not None and not isinstance(results[0], BaseException):
                    await undo(cast(T, results[0]))  # made, but the source did not wake
                raise r
        return cast(T, results[0])

    def _can_capture_live(self, rec: SandboxRecord, live: Any) -> bool:
        """True if the running sandbox can be copied without pausing it: its machine can
        (the QEMU engine's can) and no 9p drive is mounted (QEMU refuses to save the state of
        a mounted 9p share; such a sandbox is paused and woken as before)."""
        if live.machine is None or live.channel is None:
            return False
        if not callable(getattr(live.machine, "capture", None)):
            return False
        return not self.drives.attached_to(rec.id)

    async def _freeze_live(
        self,
        rec: SandboxRecord,
        live: Any,
        *,
        for_clones: bool,
        before_stop: Callable[[SandboxRecord, Path], Awaitable[Callable[[Path], None]]]
        | None = None,
    ) -> Path:
        """For a snapshot, flush the guest's file systems (so the disk layer alone is whole
        too: a snapshot's disk may be read without its RAM); then
        :func:`~torpor.sandbox.storage.snapshots.freeze_live` the running machine. A fork
        (``for_clones``) skips the flush: its children run on RAM and disk taken at one
        instant, whose page cache is the guest's own, so nothing is waited for."""
        if not for_clones:
            try:
                await asyncio.wait_for(live.channel.sync(), SYNC_TIMEOUT)
            except Exception as exc:  # RAM and disk are captured at one instant either way
                log.warning("sync before the snapshot of %s failed: %r", rec.id, exc)
        published = saved = None
        if before_stop is not None:
            inside: list[Callable[[Path], None]] = []

            async def published(frozen: Path) -> None:
                inside.append(await before_stop(rec, frozen))

            def saved(state: Path) -> None:
                for hook in inside:
                    hook(state)

        async with waited(self.snapshots.lock()):
            frozen, downtime = await freeze_live(
                self.held.directory(rec.id),
                self.snapshots.frozen_root,
                live.machine,
                for_clones=for_clones,
                published=published,
                saved=saved,
            )
        self.last_downtime = downtime
        return frozen

    # -- snapshots -----------------------------------------------------------------------

    async def snapshot(
        self,
        id_or_name: str,
        spec: SnapshotSpec | None = None,
        /,
        *,
        tenant: str = "default",
        **fields: Any,
    ) -> SnapshotInfo:
        """Snapshot a running or paused sandbox (RAM + disk); it keeps its state afterwards.
        ``spec`` (or ``fields``: ``name``, ``retention_days``, ``labels``, ``wait``) is a
        :class:`~torpor.sandbox.requests.SnapshotSpec`.

        Returns once the frozen copy is made and listed, ``capturing``: restore and fork
        work from then on (from the local copy), while the copy is stored in the chunk store
        in the background (:meth:`wait_stored` waits for it; a capture that fails is retried
        at the next GC pass, wait or restart). With ``wait`` it returns the ``stored``
        snapshot, and if storing fails nothing is listed. In a cluster it always returns the
        stored snapshot (listed in the registry, so every node sees it), then pushes it to
        the shared store in the background (``info.durable``).

        ``name`` defaults to ``<sandbox name>-<time>``. Raises InvalidName / InvalidArgument,
        Conflict (name taken; a volume attached), InvalidState, StorageError (e.g. disk full:
        nothing is listed and the sandbox is unharmed).
        """
        snap = SnapshotSpec.of(spec, **fields)
        rec = self.manager.registry.find(tenant, id_or_name)
        if snap.name:
            name = snap.name
        else:  # the sandbox's name cut, never the time; the random part tells one second's apart
            suffix = f"-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
            name = rec.name[: 63 - len(suffix)].rstrip("-.") + suffix
        check_name(name, "snapshot name")

        def check_free() -> None:  # (every manifest is read: in a thread, as every such read)
            self.snapshots.check_name_free(name, tenant)  # fail before pausing anything
            self.snapshots.check_room(tenant)

        await asyncio.to_thread(check_free)

        cluster = self.manager.cluster

        async def capture(rec: SandboxRecord, frozen: Path, _: Any) -> SnapshotInfo:
            what: dict[str, Any] = {
                "name": str(name),
                "tenant": tenant,
                "retention_days": snap.retention_days,
                "sandbox_id": rec.id,
                "template": rec.template,
                "labels": dict(snap.labels or {}),
                "drives": self.cloner.drive_records(rec.id),
                "carried": CarriedSettings(
                    labels=rec.labels,
                    idle_pause_seconds=rec.idle_pause_seconds,
                    pause_retention_days=rec.pause_retention_days,
                    memory_scope=rec.memory_scope,
                ),
                "envs": rec.envs,
            }
            if cluster is not None:
                # a cluster lists a snapshot in its registry once stored (every node sees it
                # then), and pushes it to the shared store in the background
                try:
                    info = await asyncio.to_thread(
                        self.snapshots.save, frozen, **what, origin=cluster.origin()
                    )
                finally:
                    drop_ram(frozen)  # the source's disk chain still needs the layer, not the RAM
                cluster.push_snapshot_later(info.id)  # durable off this node in the background
                return info.model_copy(update={"node": cluster.node})
            try:
                info = await asyncio.to_thread(self.snapshots.begin, frozen, **what)
            except BaseException:
                drop_ram(frozen)
                raise
            self._complete_later(info.id)
            return info

        # no undo: a snapshot taken whole is kept when the source then fails to wake (it may
        # be the only copy of that state left)
        info = await self._freeze(tenant, id_or_name, capture)
        if not snap.wait:
            return info
        try:
            return await self.wait_stored(info.id, tenant=tenant)
        except TorporError:  # as before captures ran behind: nothing is listed
            with contextlib.suppress(TorporError):
                self.delete_snapshot(info.id, tenant=tenant)
            raise

    def _complete_later(self, snapshot_id: str) -> asyncio.Task[SnapshotInfo | None]:
        """Store the capturing snapshot ``snapshot_id`` in the background (once per id)."""
        task = self._captures.get(snapshot_id)
        if task is None:

            def work() -> SnapshotInfo | None:
                # the spare first: a restore right after the snapshot then copies no RAM
                with contextlib.suppress(TorporError):
                    self.snapshots.captures.make_spare(snapshot_id)
                return self.snapshots.complete(snapshot_id)

            task = asyncio.get_running_loop().create_task(asyncio.to_thread(work))
            self._captures[snapshot_id] = task

            def done(t: asyncio.Task[SnapshotInfo | None]) -> None:
                self._captures.pop(snapshot_id, None)
                if not t.cancelled() and t.exception() is not None:
                    log.error(
                        "capturing snapshot %s failed (retried at the next restart or wait): %r",
                        snapshot_id,
                        t.exception(),
                    )

            task.add_done_callback(done)
        return task

    async def wait_stored(self, id_or_name: str, *, tenant: str = "default") -> SnapshotInfo:
        """Wait until the snapshot is in the chunk store (its manifest written and checked)
        and return it; a capture that a crash interrupted is finished here. Raises
        SnapshotNotFound (also when it was deleted meanwhile), StorageError / EngineError
        (the capture failed; it is tried again at the next call)."""
        info = await asyncio.to_thread(self.snapshots.get, id_or_name, tenant=tenant)
        if info.status == "capturing":
            await asyncio.shield(self._complete_later(info.id))
        return await asyncio.to_thread(self.snapshots.get, info.id, tenant=tenant)

    async def settle(self) -> None:
        """Wait for every capture and spare copy in flight (a server's shutdown; benches)."""
        while self._captures or self._spares:
            jobs = [*self._captures.values(), *self._spares]
            await asyncio.gather(*jobs, return_exceptions=True)

    def _refill(self, snapshot_id: str) -> None:
        """Make the spare RAM copy of a cached snapshot again, in the background."""
        task = asyncio.get_running_loop().create_task(
            asyncio.to_thread(self.snapshots.captures.make_spare, snapshot_id)
        )
        self._spares.add(task)

        def done(t: asyncio.Task[bool]) -> None:
            self._spares.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.warning("no spare RAM for snapshot %s: %r", snapshot_id, t.exception())

        task.add_done_callback(done)

    def list_snapshots(self, *, tenant: str = "default") -> list[SnapshotInfo]:
        """The tenant's listed (checked, unexpired) snapshots."""
        return self.snapshots.list(tenant=tenant)

    def get_snapshot(self, id_or_name: str, *, tenant: str = "default") -> SnapshotInfo:
        """One snapshot. Raises SnapshotNotFound (also when expired)."""
        return self.snapshots.get(id_or_name, tenant=tenant)

    def delete_snapshot(self, id_or_name: str, *, tenant: str = "default") -> SnapshotInfo:
        """Delete a snapshot (its chunks go at the next GC). Raises SnapshotNotFound."""
        info = self.snapshots.delete(id_or_name, tenant=tenant)
        self.manager.registry.end_stored("snapshot", {info.id})  # usage bills it until now
        return info

    def set_snapshot_retention(
        self, id_or_name: str, days: int, *, tenant: str = "default"
    ) -> SnapshotInfo:
        """Keep a snapshot ``days`` days (1-365) from when it was taken (see
        :meth:`SnapshotStore.set_retention`). Raises InvalidArgument, SnapshotNotFound."""
        return self.snapshots.set_retention(id_or_name, days, tenant=tenant)

    async def restore(
        self,
        snapshot: str,
        spec: RestoreSpec | None = None,
        /,
        *,
        tenant: str = "default",
        **fields: Any,
    ) -> SandboxInfo:
        """A new running sandbox from a stored snapshot (RAM, processes and files as they were),
        with the source sandbox's labels (updated with ``labels``), idle pause and pause
        retention unless the caller gives them (a restored user's VM stays traceable to its
        user, and still pauses when idle), and its memory scope.
        ``spec`` (or ``fields``: ``name``, ``labels``, ``idle_pause_seconds``,
        ``pause_retention_days``) is a :class:`~torpor.sandbox.requests.RestoreSpec`.

        Raises SnapshotNotFound (deleted or expired), CorruptData (a chunk fails its hash),
        Conflict (name taken; in a cluster, another node's to do, as for a draining node: it
        names that node), NoNodeAvailable, and leaves no half-made sandbox behind.
        """
        options = RestoreSpec.of(spec, **fields)
        names = None if options.name is None else [options.name]
        children = await self._from_snapshot(snapshot, 1, names, options, None, tenant)
        return children[0]

    async def fork_snapshot(
        self,
        snapshot: str,
        spec: ForkSpec | None = None,
        /,
        *,
        tenant: str = "default",
        **fields: Any,
    ) -> list[SandboxInfo]:
        """``count`` new sandboxes from one stored snapshot (see :meth:`restore`); ``spec`` (or
        ``fields``: ``count``, ``labels``, ``names``, ``memory_scope``, ``envs``) is a
        :class:`~torpor.sandbox.requests.ForkSpec`."""
        fork = ForkSpec.of(spec, **fields)
        options = RestoreSpec.of(labels=fork.labels, envs=fork.envs)
        scope = None if fork.memory_scope is None else fork.memory_scope.record()
        return await self._from_snapshot(snapshot, fork.count, fork.names, options, scope, tenant)

    async def _from_snapshot(
        self,
        snapshot: str,
        count: int,
        names: list[str] | None,
        options: RestoreSpec,
        memory_scope: dict[str, Any] | None,
        tenant: str,
    ) -> list[SandboxInfo]:
        """``count`` children of the snapshot: its carried settings unless ``options`` (or
        ``memory_scope``, None: the source's) give others."""
        # the manifests are read in a thread (a look-up by name reads and hashes every one)
        info = await asyncio.to_thread(self.snapshots.get, snapshot, tenant=tenant)
        cluster = self.manager.cluster
        if cluster is not None:  # not durable yet, or another accelerator: another node's
            origin = await asyncio.to_thread(self.snapshots.origin, info.id, tenant=tenant)
            await asyncio.to_thread(cluster.check_restore, info, origin)
            await asyncio.to_thread(cluster.accepting)  # a draining node: another node's too
        # the source's settings unless the caller gives its own (labels and envs: merged, as
        # for a fork)
        kept = await asyncio.to_thread(self.snapshots.envs, info.id, tenant=tenant)
        envs = {**kept, **(options.envs or {})}
        carried, given = info.carried, options.model_fields_set
        idle = options.idle_pause_seconds
        if "idle_pause_seconds" not in given:
            idle = carried.idle_pause_seconds
        retention = options.pause_retention_days
        if "pause_retention_days" not in given and carried.pause_retention_days is not None:
            retention = carried.pause_retention_days
        # held until the children exist: until then no overlay names the frozen dir, and GC
        # (which takes this lock exclusively) must not take it for garbage
        async with waited(self.snapshots.lock()), waited(self.snapshots.captures.in_use()):
            frozen = self.snapshots.cached(info.id)  # local, never run, read-only: clone it
            own = frozen is None
            used: list[Path] = []

            def spare(into: Path) -> bool:
                taken = self.snapshots.captures.take_spare(info.id, into)
                if taken:
                    used.append(into)
                return taken

            if frozen is None:
                frozen = await asyncio.to_thread(self.snapshots.materialize, info.id, tenant=tenant)
            try:
                children = Children(
                    count=count,
                    labels={**carried.labels, **(options.labels or {})},
                    names=names,
                    idle_pause_seconds=idle,
                    pause_retention_days=retention,
                    tenant=tenant,
                    reason=f"restored from {info.id}",
                    memory_scope=carried.memory_scope if memory_scope is None else memory_scope,
                    envs=envs,
                )
                return await self.cloner.spawn(
                    frozen,
                    children,
                    drives_of=info.sandbox_id,
                    recorded_drives=info.drives,
                    take_ram=own,  # the materialized RAM is this restore's own
                    spare=None if own else spare,
                )
            finally:
                if own:
                    drop_ram(frozen)
                elif used:
                    self._refill(info.id)

    async def fork(
        self,
        id_or_name: str,
        spec: ForkSpec | None = None,
        /,
        *,
        tenant: str = "default",
        **fields: Any,
    ) -> list[SandboxInfo]:
        """``count`` live copies of a running or paused sandbox, diverging from now on; ``spec``
        (or ``fields``: ``count``, ``labels``, ``names``) is a
        :class:`~torpor.sandbox.requests.ForkSpec`.

        Children inherit the source's labels and envs (updated with ``labels``, ``envs``).
        Raises InvalidArgument
        (count 0 or over the limit), Conflict (a volume attached, names), InvalidState.
        """
        fork = ForkSpec.of(spec, **fields)
        src = self.manager.registry.find(tenant, id_or_name)  # SandboxNotFound before any work
        # the quota for where this ends (the source as it is, and the children), checked before
        # the source pauses: it must never be left paused because its children took its room
        self.held.check_room(tenant, sandboxes=fork.count, memory_mib=fork.count * src.memory_mib)

        def children_of(rec: SandboxRecord) -> Children:
            return Children(
                count=fork.count,
                labels={**rec.labels, **(fork.labels or {})},
                names=fork.names,
                idle_pause_seconds=rec.idle_pause_seconds,
                pause_retention_days=rec.pause_retention_days,
                tenant=tenant,
                reason=f"forked from {rec.id}",
                memory_scope=(
                    rec.memory_scope if fork.memory_scope is None else fork.memory_scope.record()
                ),
                envs={**rec.envs, **(fork.envs or {})},
            )

        # The children of a running source start before the source stops: their QEMUs start
        # while the stop copies the RAM (into the last child's RAM file), the others' copies
        # follow while the source runs on, and each loads its state once its RAM is whole.
        pending: list[Pending] = []

        async def start_early(rec: SandboxRecord, frozen: Path) -> Callable[[Path], None]:
            size = await asyncio.to_thread(virtual_size, frozen / "disk.qcow2")
            pending.append(
                await self.cloner.start_pending(frozen, children_of(rec), size, linked=True)
            )
            if fork.count > 1:  # their QEMUs' start-up would slow the source's stop down
                await pending[-1].started()
            return pending[-1].release  # inside the stop: the state, linked into each child

        async def clone(rec: SandboxRecord, frozen: Path) -> Any:
            # the frozen RAM is a hard link to the source's (paused) or to the last child's
            # (live): clone it before the source wakes, and drop it
            try:
                if pending:
                    return None
                drives = self.cloner.drives_for(frozen, rec.id)
                recs = await self.cloner.prepare(frozen, children_of(rec), take_ram=True)
            finally:
                drop_ram(frozen)
            return recs, drives

        async def wake(rec: SandboxRecord, frozen: Path, prepared: Any) -> list[SandboxInfo]:
            if pending:  # the other children's copies of the last one's RAM, then all run
                last = pending[0].directories[-1]
                await pending[0].fill(last / "ram")
                return await pending[0].woken
            recs, drives = prepared
            return await self.cloner.wake_children(recs, drives, reason=f"forked from {rec.id}")

        async def remove(children: list[SandboxInfo]) -> None:
            for child in children:
                with contextlib.suppress(TorporError):
                    await self.manager.kill(child.id, tenant=tenant)

        try:
            return await self._freeze(
                tenant,
                id_or_name,
                wake,
                before_wake=clone,
                link_ram=True,
                before_stop=start_early,
                undo=remove,
            )
        except BaseException as exc:
            for child in pending:  # released before the failure: made, so removed
                for made in await child.abandon(repr(exc), wait=isinstance(exc, Exception)):
                    with contextlib.suppress(TorporError):
                        await self.manager.kill(made.id, tenant=tenant)
            raise

    async def create(
        self, spec: SandboxSpec | None = None, /, *, tenant: str = "default", **fields: Any
    ) -> SandboxInfo:
        """``Sandbox.create``: a :class:`~torpor.sandbox.requests.SandboxSpec` (or its
        fields): a template fork, or with ``snapshot`` a restore, with ``volumes`` and
        ``drives`` mounted. Every reference is checked before anything is made; if an attach
        fails the new sandbox is killed (no half-made sandbox). Raises as :meth:`restore`,
        :meth:`SandboxManager.create`, :meth:`attach_volume` and :meth:`attach_drive`;
        InvalidArgument when a restore is given a template or sizes."""
        want = SandboxSpec.of(spec, **fields)
        for v in want.volumes:
            self.volumes.get(v.volume, tenant=tenant)
        for d in want.drives:
            self.drives.get(d.drive, tenant=tenant)
        if want.snapshot is not None:
            fixed = sorted(
                want.model_fields_set & {"template", "vcpus", "memory_mib", "memory_scope"}
            )
            if fixed:
                raise InvalidArgument(
                    "a restore takes its template, sizes and memory scope from the snapshot;"
                    f" drop {fixed}"
                )
            info = await self.restore(want.snapshot, want.narrow(RestoreSpec), tenant=tenant)
        else:
            info = await self.manager.create(want.narrow(SandboxOptions), tenant=tenant)
        try:
            for v in want.volumes:
                await self.attachments.attach_volume(info.id, v, tenant=tenant)
            for d in want.drives:
                await self.attachments.attach_drive(info.id, d, tenant=tenant)
        except BaseException:
            with contextlib.suppress(TorporError):
                await self.manager.kill(info.id, tenant=tenant)
            # in a thread: a volume file read holds the volumes' lock for as long as it takes
            await asyncio.to_thread(self.volumes.release, {info.id})
            await asyncio.to_thread(self.drives.release, {info.id})
            raise
        return await self.manager.get(info.id, tenant=tenant)

    # -- retention -----------------------------------------------------------------------

    async def recover(self) -> int:
        """After a restart, before any attach is in flight: finish storing the snapshots a
        crash left capturing (in the background), give back the attachment record
        of each drive whose share a live sandbox's machine has without one (an attach that
        died between plugging and recording: see
        :func:`~torpor.sandbox.storage.retention.restore_unrecorded_drives`), then mount the
        attached drives that running sandboxes lack (a crash between a plug or a wake and
        the mount). Returns how many records were restored."""
        restored = await asyncio.to_thread(
            restore_unrecorded_drives, self.paths, self.attachments.live_ids()
        )
        await self.attachments.remount_running()
        for sid, _ in list(self.snapshots.captures.records()):  # captures a crash cut short
            self._complete_later(sid)
        return restored

    async def collect_garbage(
        self, spec: GcSpec | None = None, /, *, now: float | None = None, **fields: Any
    ) -> GcReport:
        """Kill sandboxes paused past their ``pause_retention_days``, then run :func:`collect`
        (``spec`` or ``dry_run=True``: report what would go, remove nothing)."""
        dry_run = GcSpec.of(spec, **fields).dry_run
        if not dry_run:  # captures that failed (e.g. a full disk) are tried again
            for sid, _ in list(self.snapshots.captures.records()):
                self._complete_later(sid)
        now = time.time() if now is None else now
        expired: list[str] = []
        for rec in self.manager.registry.list(states={S.PAUSED}):
            ends = rec.expires_at
            if ends is not None and now > ends and not dry_run:
                # as it is now: each kill before awaited, and meanwhile its user may have woken
                # this one or extended its retention; one being woken (its lock held) is left
                # to the next pass. No await from here until the kill holds its lock.
                rec = self.manager.registry.get(rec.id)
                ends = rec.expires_at
                if self.held.live(rec.id).lock.locked():
                    continue
            if ends is not None and now > ends:
                expired.append(rec.id)
                if not dry_run:
                    await self.manager.kill(rec.id, tenant=rec.tenant, reason=EXPIRED)
            elif ends is not None and ends - now < EXPIRY_WARNING:
                log.warning(
                    "paused sandbox %s (%s) will be deleted in %.1f h (pause_retention_days=%d); "
                    "wake it, or extend it with get_or_create(%r, pause_retention_days=...)",
                    rec.id,
                    rec.name,
                    (ends - now) / 3600,
                    rec.pause_retention_days,
                    rec.name,
                )
        from datetime import UTC, datetime

        report = await asyncio.to_thread(
            collect_garbage,
            self.paths,
            now=datetime.fromtimestamp(now, UTC),
            live_sandboxes=self.attachments.live_ids,  # taken when attachments go
            dry_run=dry_run,
            store=self.snapshots,
        )
        report.expired_sandboxes = expired
        if not dry_run:  # usage bills what GC removed (and what was deleted) until now
            await asyncio.to_thread(
                sync_stored,
                self.manager.registry,
                self.paths,
                snapshots=self.snapshots,
                volume_store=self.volumes,
            )
        return report
