"""Cluster mode: one node of many sharing a PostgreSQL registry and an S3 chunk store.

``torpor serve --cluster DSN --store s3://bucket/prefix --node NAME`` gives the manager a
:class:`ClusterNode`. Then:

* **The registry is PostgreSQL's** (:class:`~torpor.sandbox.registry.postgres.PostgresRegistry`),
  shared by every node; the node's own directory holds its machines' files only.
* **Leases.** The node heartbeats every ``heartbeat_seconds`` (its URL, accelerator, CPU
  model, RAM), which renews the leases of the sandboxes it holds. It takes a sandbox
  (:meth:`ClusterNode.acquire`, compare-and-set) before it creates, wakes, runs, pauses or
  kills it; a sandbox held by another live node is a :class:`~torpor.errors.Conflict` naming
  that node and its URL (``owner_node``, ``owner_url``: the caller may go there). A node
  gives a sandbox back once it is stopped, or paused with that pause durable.
* **Durable pauses.** A pause is local and fast; then a background task
  (:meth:`ClusterNode.push_later`) stores the paused directory in the chunk store
  (:func:`~torpor.sandbox.storage.pauses.push_pause`) and records the manifest: from then on
  ``info.durable`` says when, and the sandbox wakes on any node. A failed upload is retried
  with backoff (1 s doubling to 60 s), logged, and shown as ``info.upload_error``; the node
  keeps the sandbox's lease meanwhile, so no other node wakes an older state. The upload
  holds the sandbox's lock: a wake that comes in during it waits for it.
* **Wake anywhere.** A wake on a node that does not hold the latest pause's files rebuilds
  them from the manifest (:func:`~torpor.sandbox.storage.pauses.begin_rebuild`; the same
  template build must be there, else TemplateNotFound): every file but the RAM first, then
  QEMU starts while the RAM is fetched, and loads the device state once it is whole.
* **Lost nodes.** In every heartbeat the node recovers the sandboxes whose owner's lease
  lapsed (:meth:`~torpor.sandbox.registry.postgres.PostgresRegistry.recover`: to the last
  durable pause, saying what was lost, or to ``error``). At start it reconciles only the
  sandboxes it holds itself, never another node's; at start and every minute it drops the
  directories another node made stale (:meth:`ClusterNode.stale`), with any QEMU still on
  them (a node that was only cut off comes back to find its machines taken over).
* **Routing.** A request for a sandbox another node runs is proxied there by the server
  (:mod:`torpor.server.proxy`), thanks to the ``owner_url`` the Conflict carries.
* **Placement** (:meth:`ClusterNode.place`). A paused sandbox whose latest pause is durable
  and that no node holds wakes, in this order, on: its origin node (the one that made the
  pause: its files and cache are warm) if it is alive, not draining and not full; else the
  node that received the request if it qualifies likewise; else the least loaded node that
  does (share of its RAM its running sandboxes hold). Only nodes of the pause's accelerator
  (and, for kvm, its CPU model) count; with none alive the wake is
  :class:`~torpor.errors.NoNodeAvailable`. A node that is not the one chosen answers a
  Conflict naming it (``owner_url``), which the server proxies; a request that was already
  proxied here (:data:`PROXIED`) wakes here when this node is compatible.
* **Draining** (``torpor node drain``): the node takes no new wake or create (placement
  skips it; a create is sent to the least loaded other node), pauses what it runs, and gives
  each sandbox up once its pause is durable.
* **Snapshots** (:meth:`ClusterNode.snapshot_store`). Manifests are the registry's
  (:class:`RegistryCatalog`): every node lists, restores, deletes and expires every snapshot.
  A snapshot is saved as fast as on one machine, into this node's ``chunks/``, then pushed to
  the shared store in the background (:meth:`ClusterNode.push_snapshot_later`: retried with
  the pauses' backoff, resumed by the heartbeat after a restart); ``info.durable`` says when,
  ``info.upload_error`` why not yet. A restore on another node pulls the chunks it lacks from
  the store (verified: a bad one is CorruptData naming the snapshot) onto its own copy of the
  template build. Before a restore or fork (:meth:`ClusterNode.check_restore`): a snapshot not
  durable yet is restored by the node that saved it (a Conflict the server proxies there;
  StateLost when that node is gone); one taken on another accelerator or (kvm) CPU model by
  the least loaded node like its origin (proxied; NoNodeAvailable when there is none).
* **GC of the shared store** (:meth:`ClusterNode.sweep_if_due`, from the heartbeat): once per
  ``$TORPOR_STORE_SWEEP_SECONDS`` (default an hour) across the cluster, by whichever node takes
  the PostgreSQL advisory lock first, marking from every pause and snapshot manifest in the
  registry, sparing chunks younger than the store's grace (an upload in flight).

The package, by part of :class:`ClusterNode`: :mod:`.config` (joining: :class:`ClusterConfig`),
:mod:`.node` (this machine as a node, the state the parts share), :mod:`.placement` (which
node wakes, creates, restores), :mod:`.leases` (holding, giving back, recovering sandboxes),
:mod:`.pauses` (pauses pushed and rebuilt), :mod:`.snapshots`, :mod:`.volumes` (volumes and
drives); this module keeps the node's background work: heartbeat, uploads with retry, sweeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from torpor.errors import InvalidArgument, SnapshotNotFound, TorporError
from torpor.sandbox.manager.cluster.config import (
    CLUSTER_ENV,
    LEASE_ENV,
    NODE_ENV,
    PROXIED,
    ClusterConfig,
    default_url,
)
from torpor.sandbox.manager.cluster.leases import Leases
from torpor.sandbox.manager.cluster.node import local_status
from torpor.sandbox.manager.cluster.pauses import Pauses
from torpor.sandbox.manager.cluster.placement import compatible
from torpor.sandbox.manager.cluster.snapshots import RegistryCatalog, Snapshots
from torpor.sandbox.manager.cluster.volumes import (
    RECORD_LOCKS,
    ClusterDriveStore,
    ClusterVolumeStore,
    RegistryRecords,
    Volumes,
)
from torpor.sandbox.storage.chunks import SweepReport
from torpor.sandbox.storage.retention import sweep_shared_store

__all__ = [
    "CLUSTER_ENV",
    "LEASE_ENV",
    "NODE_ENV",
    "PROXIED",
    "RECORD_LOCKS",
    "ClusterConfig",
    "ClusterDriveStore",
    "ClusterNode",
    "ClusterVolumeStore",
    "RegistryCatalog",
    "RegistryRecords",
    "compatible",
    "default_url",
    "local_status",
    "upload_failed",
]

log = logging.getLogger(__name__)

#: backoff of a failed pause upload: first retry after this, doubling up to the maximum
RETRY_FIRST = 1.0
RETRY_MAX = 60.0
#: seconds between two looks for local directories another node made stale
TIDY_SECONDS = 60.0
#: seconds between two sweeps of the shared chunk store (by whichever node comes first)
SWEEP_ENV = "TORPOR_STORE_SWEEP_SECONDS"
SWEEP_SECONDS = 3600.0
#: the advisory lock a sweep of the shared store is made under ("tswp")
SWEEP_LOCK = 0x74737770


class ClusterNode(Leases, Pauses, Snapshots, Volumes):
    """This node's side of the cluster: the shared registry and store, its heartbeat, the
    leases it holds and its pause uploads. Made by the manager (see the module docstring).

    Raises StorageError when PostgreSQL or the store cannot be opened."""

    def start_heartbeat(self, tidy: Callable[[], Awaitable[object]] | None = None) -> None:
        """Heartbeat and recover lapsed sandboxes every ``heartbeat_seconds`` until
        :meth:`close`; every :data:`TIDY_SECONDS` also run ``tidy`` (the manager drops its
        stale directories)."""

        async def loop() -> None:
            last_tidy = last_beat = time.monotonic()
            running = asyncio.get_running_loop()
            while True:
                await asyncio.sleep(self.config.heartbeat_seconds)
                try:
                    # a thread of its own: behind the shared pool's uploads and rebuilds (each
                    # seconds long) a beat could come after the lease ran out on a live node
                    await running.run_in_executor(self._beat_pool, self.beat)
                    late = time.monotonic() - last_beat
                    last_beat = time.monotonic()
                    if late > self.config.lease_seconds / 2:
                        log.warning("node %s: heartbeat %.1f s after the last one", self.node, late)
                    await running.run_in_executor(self._beat_pool, self.recover_lapsed)
                    await self.resume_snapshot_pushes()
                    self._sweep_later()
                    if tidy is not None and time.monotonic() - last_tidy >= TIDY_SECONDS:
                        last_tidy = time.monotonic()
                        await tidy()
                        await asyncio.to_thread(ClusterVolumeStore(self).tidy)
                except Exception as exc:  # keep beating: PostgreSQL may be back next time
                    log.warning("heartbeat of node %s failed: %s", self.node, exc)

        if self._heartbeat is None:
            self._heartbeat = asyncio.get_running_loop().create_task(
                loop(), name=f"torpor-heartbeat-{self.node}"
            )
            self._warming = asyncio.get_running_loop().create_task(
                asyncio.to_thread(self.warm), name=f"torpor-warm-{self.node}"
            )

    def pushing(self, sandbox_id: str) -> bool:
        return sandbox_id in self._pushes

    def push_later(
        self,
        sandbox_id: str,
        push: Callable[[], Any],
        after: Callable[[], Awaitable[object]] | None = None,
        *,
        settle: bool = True,
    ) -> None:
        """Run ``push`` (a coroutine function that returns True when done, False to retry,
        None when there is nothing to push any more: the pause was woken or killed) in the
        background with backoff until it is done or says stop. A push asked for while an
        older pause's is still in flight (retrying, e.g. the store is down, and the sandbox
        was woken and paused again meanwhile) replaces it at once: the newest pause is the
        one to make durable, and it is never left waiting behind a pause that is gone.
        ``after`` runs once it is all over (the manager gives the sandbox back, under its
        lock); without it, :meth:`settle` unless ``settle`` is False (a snapshot's upload,
        named ``snapshot:<id>``, has no sandbox to give back)."""
        if sandbox_id in self._pushes:
            self._queued[sandbox_id] = push
            self._kicks[sandbox_id].set()
            return
        kick = self._kicks[sandbox_id] = asyncio.Event()

        async def retrying() -> None:
            delay, current = RETRY_FIRST, push
            try:
                while True:
                    outcome = await current()
                    newer = self._queued.pop(sandbox_id, None)
                    if newer is not None:  # a newer pause: push that one now
                        kick.clear()
                        delay, current = RETRY_FIRST, newer
                        continue
                    if outcome is not False:
                        break
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(kick.wait(), delay)
                    delay = min(delay * 2, RETRY_MAX)
            finally:
                self._pushes.pop(sandbox_id, None)
                self._queued.pop(sandbox_id, None)
                self._kicks.pop(sandbox_id, None)
            if after is not None:
                await after()
            elif settle:
                await asyncio.to_thread(self.settle, sandbox_id)

        self._pushes[sandbox_id] = asyncio.get_running_loop().create_task(
            retrying(), name=f"torpor-push-{sandbox_id}"
        )

    def push_snapshot_later(self, snapshot_id: str) -> None:
        """Push the snapshot's chunks to the shared store in the background, retried with
        backoff until done (then the registry says when: ``info.durable``) or the snapshot is
        deleted; a failed try is logged and shown as ``info.upload_error``."""
        store = self.snapshot_store()

        async def push() -> bool | None:
            started = time.perf_counter()
            try:
                sent = await asyncio.to_thread(store.push, snapshot_id)
                when = await asyncio.to_thread(self.registry.record_snapshot_durable, snapshot_id)
            except SnapshotNotFound:
                return None  # deleted meanwhile: nothing to make durable
            except Exception as exc:
                log.warning("snapshot %s: push failed, retrying: %s", snapshot_id, exc)
                with contextlib.suppress(TorporError):
                    self.registry.record_snapshot_upload_error(snapshot_id, upload_failed(exc))
                return False
            if when is not None:
                log.info(
                    "snapshot %s durable in %s (%d bytes sent, %.2f s)",
                    snapshot_id,
                    self.chunks.location,
                    sent,
                    time.perf_counter() - started,
                )
                await asyncio.to_thread(self.evict_snapshot_chunks, snapshot_id)
            return True

        self.push_later(f"snapshot:{snapshot_id}", push, settle=False)

    async def resume_snapshot_pushes(self) -> None:
        """Push again every snapshot this node saved that is not durable yet and no upload
        is working on (after a restart, or one left over). Raises StorageError."""
        for sid in await asyncio.to_thread(self.registry.undurable_snapshots, self.node):
            if f"snapshot:{sid}" not in self._pushes:
                self.push_snapshot_later(sid)

    def volume_store(self) -> ClusterVolumeStore:
        """This node's view of the cluster's volumes (:class:`ClusterVolumeStore`)."""
        return ClusterVolumeStore(self)

    def drive_store(self) -> ClusterDriveStore:
        """This node's view of the cluster's drives (:class:`ClusterDriveStore`)."""
        return ClusterDriveStore(self)

    def _sweep_later(self) -> None:
        """Start :meth:`sweep_if_due` in the background unless one runs (a sweep of a big
        store takes long: the heartbeat must not wait for it, or the leases would lapse)."""
        if self._sweeping is not None and not self._sweeping.done():
            return

        async def sweep() -> None:
            try:
                await asyncio.to_thread(self.sweep_if_due)
            except Exception as exc:  # tried again at the next heartbeat
                log.warning("node %s: sweep of %s failed: %s", self.node, self.chunks.location, exc)

        self._sweeping = asyncio.get_running_loop().create_task(
            sweep(), name=f"torpor-sweep-{self.node}"
        )

    def sweep_if_due(
        self, *, period: float | None = None, min_age_seconds: float | None = None
    ) -> SweepReport | None:
        """Mark-and-sweep the shared chunk store if no sweep finished in the last ``period``
        seconds (default ``$TORPOR_STORE_SWEEP_SECONDS``, else an hour) and no other node is
        sweeping it now (a PostgreSQL advisory lock): marks from every manifest the registry
        holds (durable pauses and snapshots, durable or not: a snapshot's manifest is recorded
        before its chunks go up); chunks younger than ``min_age_seconds`` (default: the
        store's grace, an hour) stay, as a pause's upload writes its chunks before its
        manifest. Returns the report, or None when it was not this node's to do. Raises
        StorageError, CorruptData (a manifest that does not parse: nothing is swept)."""
        if period is None:
            raw = os.environ.get(SWEEP_ENV, "").strip()
            try:
                period = float(raw) if raw else SWEEP_SECONDS
            except ValueError as exc:
                raise InvalidArgument(f"{SWEEP_ENV} must be seconds, not {raw!r}") from exc
        last = self.registry.last_sweep()
        if last is not None and time.time() - last < period:
            return None
        with self.registry.exclusive(SWEEP_LOCK) as mine:
            last = self.registry.last_sweep()  # another node may have swept meanwhile
            if not mine or (last is not None and time.time() - last < period):
                return None
            started = time.time()
            report = sweep_shared_store(
                self.chunks, self.registry.referenced_chunks(), min_age_seconds=min_age_seconds
            )
            self.registry.record_sweep(
                self.node, started, report.removed, report.kept, report.freed_bytes
            )
        log.info(
            "node %s swept %s: %d removed, %d kept",
            self.node,
            self.chunks.location,
            report.removed,
            report.kept,
        )
        return report

    async def wait_pushes(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the uploads in flight, then cancel the rest."""
        tasks = list(self._pushes.values())
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=timeout)
        for task in pending:
            log.warning("node %s closing: %s not durable yet", self.node, task.get_name())
            task.cancel()

    async def close(self) -> None:
        """Stop the heartbeat and the uploads (callers wait for them first) and close the
        registry."""
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
            self._heartbeat = None
        for task in [
            *self._pushes.values(),
            *([self._warming] if self._warming else []),
            *([self._sweeping] if self._sweeping else []),
        ]:
            task.cancel()
        self._beat_pool.shutdown(wait=False)
        self.registry.close()


def upload_failed(exc: BaseException) -> str:
    """The text ``info.upload_error`` shows for a failed upload."""
    return f"{type(exc).__name__}: {exc}" if not isinstance(exc, TorporError) else str(exc)
