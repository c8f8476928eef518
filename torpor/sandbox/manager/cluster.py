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
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import platform
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from torpor.config import Paths, check_name
from torpor.errors import (
    Conflict,
    CorruptData,
    InvalidArgument,
    NoNodeAvailable,
    SnapshotNotFound,
    StateLost,
    StorageError,
    TorporError,
)
from torpor.sandbox.models import NodeStatus
from torpor.sandbox.models import SandboxState as S
from torpor.sandbox.registry.postgres import NodeInfo, PostgresRegistry
from torpor.sandbox.requests import VolumeSpec
from torpor.sandbox.storage.catalog import CatalogEntry
from torpor.sandbox.storage.chunk_backends import LocalChunkBackend
from torpor.sandbox.storage.chunks import (
    ChunkStore,
    FileManifest,
    PutStats,
    SweepReport,
    open_chunk_store,
)
from torpor.sandbox.storage.drives import DriveInfo, DriveStore
from torpor.sandbox.storage.pauses import (
    RamFill,
    begin_rebuild,
    manifest_chunks,
    push_pause,
    rebuild_pause,
    warm_template,
)
from torpor.sandbox.storage.retention import sweep_shared_store
from torpor.sandbox.storage.snapshots import SnapshotInfo, SnapshotStore
from torpor.sandbox.storage.tiered import TieredChunkBackend
from torpor.sandbox.storage.volumes import VolumeInfo, VolumeStore

__all__ = [
    "CLUSTER_ENV",
    "NODE_ENV",
    "PROXIED",
    "ClusterConfig",
    "ClusterNode",
    "RegistryCatalog",
    "RegistryRecords",
    "compatible",
    "default_url",
    "local_status",
    "upload_failed",
]

log = logging.getLogger(__name__)

#: the registry's DSN, the node's name (the store is ``$TORPOR_STORE``)
CLUSTER_ENV = "TORPOR_CLUSTER"
NODE_ENV = "TORPOR_NODE"
LEASE_ENV = "TORPOR_LEASE_SECONDS"

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

#: the advisory locks creates, attaches and deletes of volumes ("tvol") and drives ("tdrv")
#: are made under, across nodes
RECORD_LOCKS = {"volume": 0x74766F6C, "drive": 0x74647276}

#: the node a request came from when another node proxied it here (set by the server's proxy):
#: placement then wakes the sandbox here instead of sending it on again
PROXIED: ContextVar[str | None] = ContextVar("torpor_proxied_by", default=None)


@dataclass(frozen=True)
class ClusterConfig:
    """How a node joins a cluster: the registry (a PostgreSQL DSN), the shared chunk store
    (``s3://bucket/prefix``), its name and the URL other nodes and clients reach it at.
    A lease lasts ``lease_seconds`` and is renewed every ``heartbeat_seconds``."""

    dsn: str
    store: str
    node: str
    url: str = ""
    lease_seconds: float = 15.0
    heartbeat_seconds: float = 3.0

    def __post_init__(self) -> None:
        check_name(self.node, "node name")
        if not self.dsn.startswith(("postgres://", "postgresql://")):
            raise InvalidArgument(f"--cluster must be a PostgreSQL DSN, not {self.dsn!r}")
        if not self.store.startswith("s3://"):
            raise InvalidArgument(
                f"--store must be s3://bucket/prefix in cluster mode, not {self.store!r} "
                "(a local directory cannot be shared between nodes)"
            )
        if not 0 < self.heartbeat_seconds < self.lease_seconds:
            raise InvalidArgument("the heartbeat must be shorter than the lease, both > 0")

    @classmethod
    def lease_from_env(cls) -> float:
        """``$TORPOR_LEASE_SECONDS`` (default 15). Raises InvalidArgument."""
        raw = os.environ.get(LEASE_ENV, "").strip()
        try:
            value = float(raw) if raw else 15.0
        except ValueError as exc:
            raise InvalidArgument(f"{LEASE_ENV} must be seconds, not {raw!r}") from exc
        if value < 2:
            raise InvalidArgument(f"{LEASE_ENV} must be at least 2 seconds, not {raw!r}")
        return value


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _memory_mib() -> int:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    return 0


def _accelerator() -> str:
    from torpor.sandbox.vm.accel import probe

    try:
        return probe().accel
    except TorporError as exc:
        log.warning("cannot tell the accelerator: %s", exc)
        return "unknown"


def compatible(node: NodeInfo, origin: dict[str, Any] | None) -> bool:
    """Whether a pause made where ``origin`` says (``{"accelerator", "cpu_model"}``; None: a
    pause that does not say) can wake on ``node``: the same accelerator and, for kvm, the same
    CPU model (a KVM guest's CPU state carries the host CPU's features; under TCG QEMU
    emulates its own CPU)."""
    if not origin:
        return True
    accel = str(origin.get("accelerator") or "")
    if accel and node.accelerator != accel:
        return False
    return accel != "kvm" or node.cpu_model == str(origin.get("cpu_model") or "")


def local_status(sandboxes: int, memory_mib: int) -> NodeStatus:
    """This machine as the one node of the embedded default (no cluster)."""
    return NodeStatus(
        name="local",
        alive=True,
        accelerator=_accelerator(),
        cpu_model=_cpu_model(),
        capacity_mib=_memory_mib(),
        vcpus=os.cpu_count() or 0,
        sandboxes=sandboxes,
        memory_mib=memory_mib,
        this=True,
    )


def default_url(host: str | None, port: int) -> str:
    """The URL a node advertises when none is given: its host (its name when it listens on
    every address) and port."""
    if host is None:
        return ""
    name = socket.gethostname() if host in ("0.0.0.0", "::", "") else host
    return f"http://[{name}]:{port}" if ":" in name else f"http://{name}:{port}"


class ClusterNode:
    """This node's side of the cluster: the shared registry and store, its heartbeat, the
    leases it holds and its pause uploads. Made by the manager (see the module docstring).

    Raises StorageError when PostgreSQL or the store cannot be opened."""

    def __init__(self, config: ClusterConfig, paths: Paths) -> None:
        self.config = config
        self.node = config.node
        self.paths = paths
        self.registry = PostgresRegistry(config.dsn)
        self.chunks: ChunkStore = open_chunk_store(config.store, paths.home)
        self.started_at = time.time()
        self._accel: str | None = None
        self._pushes: dict[str, asyncio.Task[None]] = {}
        #: the push of a newer pause asked for while an older one's was in flight, and the
        #: event that cuts the older one's backoff short
        self._queued: dict[str, Callable[[], Any]] = {}
        self._kicks: dict[str, asyncio.Event] = {}
        self._heartbeat: asyncio.Task[None] | None = None
        self._beat_pool = ThreadPoolExecutor(1, thread_name_prefix=f"torpor-beat-{self.node}")
        self._warming: asyncio.Task[None] | None = None
        #: this node takes no new sandbox (``torpor node drain``; a restart clears it)
        self.draining = False
        self._snapshots: SnapshotStore | None = None
        self._sweeping: asyncio.Task[None] | None = None
        #: sandbox -> where the time of its last pause upload went (seconds per step, and
        #: the chunk store's :class:`PutStats`); for the bench and the logs
        self.last_push: dict[str, dict[str, Any]] = {}
        #: volume -> the image manifest (its key) this node's copy was pulled from, and a
        #: lock per volume so that two pulls of one volume here never write at once
        self.pulled_volumes: dict[str, str] = {}
        self._pull_locks: dict[str, threading.Lock] = {}
        self._pull_guard = threading.Lock()

    # -- nodes and leases -----------------------------------------------------------------

    def info(self) -> NodeInfo:
        """What this node tells the registry about itself."""
        if self._accel is None:
            self._accel = _accelerator()
        return NodeInfo(
            id=self.node,
            accelerator=self._accel,
            cpu_model=_cpu_model(),
            capacity_mib=_memory_mib(),
            url=self.config.url,
            started_at=self.started_at,
            draining=self.draining,
            vcpus=os.cpu_count() or 0,
        )

    def beat(self) -> None:
        """Heartbeat once (renews this node's leases). Raises StorageError."""
        self.registry.heartbeat(self.info(), lease_seconds=self.config.lease_seconds)

    def acquire(self, sandbox_id: str, *, place: bool = True) -> None:
        """Hold ``sandbox_id`` (renewed by the heartbeat). With ``place``, a paused sandbox no
        node holds is first placed (:meth:`place`): when another node should wake it, a
        Conflict names that node (``owner_node``, ``owner_url``, ``placed``). Raises Conflict
        naming the node that holds it (``owner_node``) and its URL (``owner_url``),
        NoNodeAvailable, SandboxNotFound, StorageError."""
        if self._claimed(sandbox_id, place=place):
            return
        self.check_pins(sandbox_id)
        # an owner that stopped heartbeating lost it: fall back to its last durable pause first
        self.registry.recover(sandbox_id, self.node)
        if (
            place
            and self.draining
            and self.registry.owner(sandbox_id) == self.node
            and self.registry.get(sandbox_id).state is S.PAUSED  # drained, not durable yet
        ):
            raise Conflict(
                f"node {self.node} is draining: sandbox {sandbox_id} wakes on another node "
                "once its pause is durable (in a few seconds): retry then",
                sandbox_id=sandbox_id,
                node=self.node,
            )
        if place:
            target, why = self.place(sandbox_id)
            if target is not None:
                raise Conflict(
                    f"sandbox {sandbox_id} wakes on node {target.id} ({why}): "
                    f"send the request to {target.url}",
                    sandbox_id=sandbox_id,
                    owner_node=target.id,
                    owner_url=target.url,
                    placed=why,
                )
        try:
            self.registry.acquire(sandbox_id, self.node, lease_seconds=self.config.lease_seconds)
        except Conflict as exc:
            owner = str(exc.data.get("owner_node") or "")
            url = ""
            with contextlib.suppress(TorporError):
                url = self.registry.node(owner).url
            raise Conflict(
                f"sandbox {sandbox_id} runs on node {owner}"
                + (f" ({url})" if url else "")
                + ": send the request there",
                sandbox_id=sandbox_id,
                owner_node=owner,
                owner_url=url,
            ) from exc

    def _claimed(self, sandbox_id: str, *, place: bool) -> bool:
        """:meth:`acquire`'s common cases in one query and at most one write: the sandbox is
        this node's already (its lease good for half a lease more: nothing to write), or no
        node holds it and it needs no placement or its placement is this node (its pause
        was made here, this node is not full). False for everything else (another node holds
        it or lapsed, a drive pins it elsewhere, this node drains, placement may name
        another node), which :meth:`acquire` then walks through step by step. Raises
        SandboxNotFound, StorageError."""
        if self.draining or PROXIED.get() is not None:
            return False
        now = time.time()
        facts = self.registry.claim_facts(sandbox_id, self.node, at=now)
        if facts.pinned_elsewhere:
            return False
        mine = facts.owner_node == self.node
        if facts.owner_node is not None and not mine:
            return False
        if mine and (facts.lease_until or 0.0) >= now + self.config.lease_seconds / 2:
            return True  # the heartbeat renews it
        if (
            place
            and facts.owner_node is None
            and facts.state is S.PAUSED
            and facts.manifest_paused_at is not None
            and facts.manifest_paused_at == facts.paused_at
        ):  # placed (:meth:`place`): only its origin node being this one is decided here
            if facts.origin is None:
                return False
            here = self.info()
            full = (
                here.capacity_mib > 0
                and facts.node_memory_mib + facts.memory_mib > here.capacity_mib
            )
            if facts.origin.get("node") != self.node or full or not compatible(here, facts.origin):
                return False
        return self.registry.claim(
            sandbox_id, self.node, lease_seconds=self.config.lease_seconds, at=now
        )

    # -- placement ------------------------------------------------------------------------

    def _live_nodes(self) -> tuple[list[NodeInfo], dict[str, tuple[int, int]]]:
        now = time.time()
        nodes = [
            n if n.id != self.node else replace(n, draining=self.draining)
            for n in self.registry.nodes()
            if n.id == self.node or n.alive(now, self.config.lease_seconds)
        ]
        if not any(n.id == self.node for n in nodes):
            nodes.append(replace(self.info(), heartbeat_at=now))
        return nodes, self.registry.loads(at=now)

    def place(self, sandbox_id: str) -> tuple[NodeInfo | None, str]:
        """Where the paused ``sandbox_id`` should wake (the rule is in the module docstring):
        ``(None, why)`` for this node, else ``(node, why)``. A sandbox that is not paused, is
        held by a node, or whose latest pause is not durable is not placed (None). Raises
        NoNodeAvailable when no live node can wake its pause, SandboxNotFound, StorageError."""
        rec = self.registry.get(sandbox_id)
        if rec.state is not S.PAUSED or self.registry.owner(sandbox_id) is not None:
            return None, "not placed"
        pause = self.registry.pause_record(sandbox_id)
        if pause is None or pause.manifest is None or pause.manifest_paused_at != rec.paused_at:
            return None, "not durable"
        raw = pause.manifest.get("origin")
        origin: dict[str, Any] = dict(raw) if isinstance(raw, dict) else {}
        nodes, loads = self._live_nodes()
        ok = [n for n in nodes if not n.draining and compatible(n, origin)]

        def full(n: NodeInfo) -> bool:
            held = loads.get(n.id, (0, 0))[1]
            return n.capacity_mib > 0 and held + rec.memory_mib > n.capacity_mib

        def share(n: NodeInfo) -> tuple[float, int, str]:
            count, held = loads.get(n.id, (0, 0))
            return (held / n.capacity_mib if n.capacity_mib else float(count), count, n.id)

        here = next((n for n in ok if n.id == self.node), None)
        if PROXIED.get() is not None and here is not None:
            return None, f"sent here by node {PROXIED.get()}"
        if not ok:
            need = str(origin.get("accelerator") or "?")
            if need == "kvm":
                need += f" on a {origin.get('cpu_model')!r} CPU"
            raise NoNodeAvailable(
                f"sandbox {sandbox_id}: no live node that is not draining can wake its pause "
                f"(made on node {origin.get('node') or pause.node or '?'}: it needs {need})",
                sandbox_id=sandbox_id,
                accelerator=origin.get("accelerator"),
                cpu_model=origin.get("cpu_model"),
            )
        reachable = [n for n in ok if n.id == self.node or n.url]
        origin_node = next((n for n in reachable if n.id == origin.get("node")), None)
        if origin_node is not None and not full(origin_node):
            return (None if origin_node.id == self.node else origin_node), "its origin node"
        if here is not None and not full(here):
            return None, "the node that received the request"
        best = min([n for n in reachable if not full(n)] or reachable or ok, key=share)
        return (None if best.id == self.node else best), "the least loaded node"

    def accepting(self) -> None:
        """Raise unless this node takes new sandboxes: a draining node raises a Conflict
        naming the least loaded other live node (``owner_url``: the server proxies the create
        there), or NoNodeAvailable when there is none. Raises StorageError."""
        if not self.draining:
            return
        nodes, loads = self._live_nodes()
        others = [n for n in nodes if n.id != self.node and not n.draining and n.url]
        if not others:
            raise NoNodeAvailable(
                f"node {self.node} is draining and no other live node takes sandboxes",
                node=self.node,
            )
        best = min(
            others,
            key=lambda n: (loads.get(n.id, (0, 0))[1] / max(n.capacity_mib, 1), n.id),
        )
        raise Conflict(
            f"node {self.node} is draining: create the sandbox on node {best.id} ({best.url})",
            owner_node=best.id,
            owner_url=best.url,
            placed="this node is draining",
        )

    def statuses(self) -> list[NodeStatus]:
        """Every node the registry knows, with its health and load. Raises StorageError."""
        now = time.time()
        loads = self.registry.loads(at=now)
        out = []
        for n in self.registry.nodes():
            count, held = loads.get(n.id, (0, 0))
            out.append(
                NodeStatus(
                    name=n.id,
                    url=n.url,
                    alive=n.alive(now, self.config.lease_seconds),
                    draining=self.draining if n.id == self.node else n.draining,
                    heartbeat_age_seconds=round(max(0.0, now - n.heartbeat_at), 3),
                    accelerator=n.accelerator,
                    cpu_model=n.cpu_model,
                    capacity_mib=n.capacity_mib,
                    vcpus=n.vcpus,
                    sandboxes=count,
                    memory_mib=held,
                    this=n.id == self.node,
                )
            )
        return out

    def settle(self, sandbox_id: str) -> None:
        """Give ``sandbox_id`` back unless this node must keep it: it runs here, or its pause
        is not durable yet. Best effort (logged)."""
        if sandbox_id in self._pushes:
            return
        try:
            rec = self.registry.get(sandbox_id)
            if rec.state in (S.STOPPED, S.ERROR) or (
                rec.state is S.PAUSED and rec.durable_at is not None
            ):
                self.registry.release(sandbox_id, self.node)
        except TorporError as exc:
            log.warning("cannot release %s: %s", sandbox_id, exc)

    def recover_lapsed(self) -> list[str]:
        """Recover every sandbox whose owner's lease lapsed (see
        :meth:`PostgresRegistry.recover`); return the ids this node recovered."""
        lapsed = self.registry.lapsed()
        return [r.id for r in lapsed if self.registry.recover(r.id, self.node) is not None]

    def stale(self, sandbox_id: str) -> bool:
        """Whether this node's directory of ``sandbox_id`` is of no use any more: the sandbox
        was killed; or this node does not hold it and its latest pause is not this node's
        (it woke elsewhere since, or was recovered from the store after this node was lost).
        A sandbox in ``error`` keeps its directory (the disk it kept can still be read).
        Raises StorageError."""
        try:
            rec = self.registry.get(sandbox_id)
        except TorporError:
            return False  # not a sandbox of this cluster: not ours to judge
        if rec.state is S.STOPPED:
            return True
        if rec.state is S.ERROR or self.registry.owner(sandbox_id) == self.node:
            return False
        pause = self.registry.pause_record(sandbox_id)
        return pause is None or pause.node != self.node

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

    # -- pauses ---------------------------------------------------------------------------

    def warm(self) -> None:
        """Hash every template's booted RAM once (pushes and rebuilds compare against it);
        best effort."""
        if not self.paths.templates.is_dir():
            return
        for template_dir in sorted(self.paths.templates.iterdir()):
            try:
                warm_template(template_dir, self.chunks.chunk_size)
            except OSError as exc:
                log.warning("cannot read template %s: %s", template_dir.name, exc)

    def template_dir(self, template: str) -> Path:
        return self.paths.templates / template

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

    def push(self, directory: Path, template: str, sandbox_id: str) -> dict[str, Any]:
        """Store the paused directory; return its manifest (see :func:`push_pause`), with
        where it was made (``origin``: node, accelerator, CPU model; placement reads it).
        Chunks the sandbox's recorded pause names are not sent again (they stay in the store
        until this manifest replaces that one). Where the time went is kept in
        :attr:`last_push` (the bench prints it). Raises as :func:`push_pause`,
        StorageError."""
        started = time.perf_counter()
        stats = PutStats()
        prior = self.registry.pause_record(sandbox_id)
        known = manifest_chunks(None if prior is None else prior.manifest)
        looked_up = time.perf_counter()
        manifest = push_pause(
            directory,
            self.chunks,
            self.template_dir(template),
            sandbox_id=sandbox_id,
            known=known,
            stats=stats,
        )
        pushed = time.perf_counter()
        info = self.info()
        manifest["origin"] = {
            "node": self.node,
            "accelerator": info.accelerator,
            "cpu_model": info.cpu_model,
        }
        for vid, fm in (manifest.get("volumes") or {}).items():  # their latest images
            self.registry.record_volume_image(vid, self.node, fm)
        while len(self.last_push) >= 256:  # a report per sandbox, of the latest ones
            self.last_push.pop(next(iter(self.last_push)))
        self.last_push[sandbox_id] = {
            "prior manifest": looked_up - started,
            "chunks": pushed - looked_up,
            "volume records": time.perf_counter() - pushed,
            "stats": stats.to_json(),
        }
        return manifest

    def record_durable(self, sandbox_id: str, paused_at: float, manifest: dict[str, Any]) -> None:
        """Record the pause taken at ``paused_at`` as durable, as ``manifest`` says (see
        :meth:`PostgresRegistry.record_durable`). Raises StorageError."""
        started = time.perf_counter()
        self.registry.record_durable(sandbox_id, self.node, paused_at, manifest)
        self.last_push.setdefault(sandbox_id, {})["record"] = time.perf_counter() - started

    def rebuild(
        self, manifest: dict[str, Any], directory: Path, template: str, sandbox_id: str
    ) -> float:
        """Rebuild a paused directory from its manifest (see :func:`rebuild_pause`)."""
        seconds = rebuild_pause(
            manifest,
            directory,
            self.chunks,
            self.template_dir(template),
            sandbox_id=sandbox_id,
            volumes_dir=self.paths.volumes,
        )
        self._volumes_here(manifest)
        return seconds

    def _volumes_here(self, manifest: dict[str, Any]) -> None:
        """Record that the volume images a rebuilt pause carries are on this node now."""
        for vid, fm in (manifest.get("volumes") or {}).items():
            self.registry.record_volume_image(vid, self.node, fm)

    def begin_rebuild(
        self,
        manifest: dict[str, Any],
        directory: Path,
        template: str,
        sandbox_id: str,
        durable: bool = True,
    ) -> RamFill:
        """Rebuild a paused directory but its RAM's content, which the returned job fills
        (see :func:`begin_rebuild`; ``durable=False`` for a wake): QEMU may start
        meanwhile."""
        fill = begin_rebuild(
            manifest,
            directory,
            self.chunks,
            self.template_dir(template),
            sandbox_id=sandbox_id,
            volumes_dir=self.paths.volumes,
            durable=durable,
        )
        self._volumes_here(manifest)
        return fill

    # -- snapshots ------------------------------------------------------------------------

    def snapshot_store(self) -> SnapshotStore:
        """This node's view of the cluster's snapshots: manifests in the registry
        (:class:`RegistryCatalog`), chunks saved into this node's ``chunks/`` and pushed to the
        shared store (:class:`~torpor.sandbox.storage.tiered.TieredChunkBackend`); made once."""
        if self._snapshots is None:
            tiered = TieredChunkBackend(LocalChunkBackend(self.paths.chunks), self.chunks.backend)
            self._snapshots = SnapshotStore(
                self.paths,
                chunks=ChunkStore(backend=tiered, chunk_size=self.chunks.chunk_size, workers=4),
                catalog=RegistryCatalog(self.registry, self.node),
            )
        return self._snapshots

    def volume_store(self) -> ClusterVolumeStore:
        """This node's view of the cluster's volumes (:class:`ClusterVolumeStore`)."""
        return ClusterVolumeStore(self)

    def push_volume(self, volume_id: str) -> FileManifest:
        """Store this node's image of ``volume_id`` in the shared store (only the chunks the
        store lacks go up: ``new_bytes`` of the result) and record it as the volume's latest
        image, on this node. Returns its file manifest. Raises VolumeNotFound,
        StorageError."""
        started = time.perf_counter()
        image = self.paths.volumes / f"{volume_id}.img"
        fm = self.chunks.put_file(image)
        self.chunks.sync_dirs()
        self.registry.record_volume_image(volume_id, self.node, fm.to_json())
        log.info(
            "volume %s pushed to %s (%d new bytes, %.2f s)",
            volume_id,
            self.chunks.location,
            fm.new_bytes,
            time.perf_counter() - started,
        )
        return fm

    def pull_volume(self, volume_id: str, manifest: dict[str, Any] | None = None) -> None:
        """Write ``volume_id``'s image into this node's ``volumes/`` from the shared store:
        ``manifest`` (a pause's copy) or else its latest pushed image (verified; replaced
        atomically). Raises StateLost when it was never pushed, CorruptData, StorageError."""
        started = time.perf_counter()
        if manifest is None:
            manifest = self.registry.volume_image(volume_id)
        if manifest is None:
            raise StateLost(
                f"volume {volume_id} has no image in the shared store",
                volume_id=volume_id,
                lost="the volume's image (on its node only)",
            )
        image = self.paths.volumes / f"{volume_id}.img"
        tmp = image.with_name(f".{image.name}.pull")
        try:
            self.chunks.restore_file(FileManifest.from_json(manifest), tmp)
            os.replace(tmp, image)
        except (KeyError, TypeError, ValueError) as exc:
            tmp.unlink(missing_ok=True)
            raise CorruptData(
                f"volume {volume_id}: its image manifest is unreadable ({exc})",
                volume_id=volume_id,
            ) from exc
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise StorageError(f"cannot write volume {volume_id}: {exc}", exc=exc) from exc
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        log.info(
            "volume %s pulled from %s (%.2f s)",
            volume_id,
            self.chunks.location,
            time.perf_counter() - started,
        )

    def volume_pull_lock(self, volume_id: str) -> threading.Lock:
        """This node's lock for pulling ``volume_id`` (not the cluster-wide volumes' lock)."""
        with self._pull_guard:
            return self._pull_locks.setdefault(volume_id, threading.Lock())

    def pinned_to(self, sandbox_id: str) -> tuple[str, list[str]] | None:
        """The node a drive attached to ``sandbox_id`` is on, with the names of those
        drives (None: no drive pins it). Raises StorageError."""
        pins = [(name, node) for _, name, node in self.registry.drives_of(sandbox_id) if node]
        if not pins:
            return None
        node = pins[0][1]
        return node, [name for name, n in pins if n == node]

    def check_pins(self, sandbox_id: str) -> None:
        """Raise unless this node may run ``sandbox_id``: one with a drive attached runs only
        on the drive's node (a Conflict naming it, ``owner_url``: the server proxies there;
        NoNodeAvailable naming it when it is down: the sandbox waits for it, nothing of it
        is lost). Raises StorageError."""
        pinned = self.pinned_to(sandbox_id)
        if pinned is None or pinned[0] == self.node:
            return
        node, drives = pinned
        nodes, _ = self._live_nodes()
        there = next((n for n in nodes if n.id == node), None)
        if there is None or not there.url:
            raise NoNodeAvailable(
                f"sandbox {sandbox_id} has drive {', '.join(drives)} attached, a directory of "
                f"node {node}, which is down: the sandbox runs only there and waits for it "
                f"(nothing of it is lost); start node {node} again, or detach the drive "
                "there first",
                sandbox_id=sandbox_id,
                node=node,
                drives=drives,
            )
        raise Conflict(
            f"sandbox {sandbox_id} has drive {', '.join(drives)} attached, a directory of "
            f"node {node}: it runs only there; send the request to {there.url}",
            sandbox_id=sandbox_id,
            owner_node=node,
            owner_url=there.url,
            placed=f"drive {', '.join(drives)}",
        )

    def holder_node(self, sandbox_id: str) -> str | None:
        """The node running ``sandbox_id`` (its lease), else the one holding its latest
        pause's files. Raises StorageError."""
        owner = self.registry.owner(sandbox_id)
        if owner is not None:
            return owner
        pause = self.registry.pause_record(sandbox_id)
        return None if pause is None else pause.node

    def drive_store(self) -> ClusterDriveStore:
        """This node's view of the cluster's drives (:class:`ClusterDriveStore`)."""
        return ClusterDriveStore(self)

    def origin(self) -> dict[str, Any]:
        """What a snapshot or pause taken here records of where it was made."""
        info = self.info()
        return {"node": self.node, "accelerator": info.accelerator, "cpu_model": info.cpu_model}

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

    def evict_snapshot_chunks(self, snapshot_id: str) -> int:
        """Move the local copies of a durable snapshot's chunks into the node's bounded cache
        (:meth:`TieredChunkBackend.evict`); return the local bytes freed. Best effort: a
        failure is logged (the copies stay, as before)."""
        store = self.snapshot_store()
        backend = store.chunks.backend
        freed = 0
        try:
            assert isinstance(backend, TieredChunkBackend)
            for _info, body in store.manifests(snapshot_id):
                for fm in body["files"].values():
                    for digest in FileManifest.from_json(fm).hashes():
                        freed += backend.evict(digest)
        except (TorporError, OSError) as exc:
            log.warning("snapshot %s: cannot evict its local chunks: %s", snapshot_id, exc)
        if freed:
            log.info("snapshot %s: %d local chunk bytes moved to the cache", snapshot_id, freed)
        return freed

    async def resume_snapshot_pushes(self) -> None:
        """Push again every snapshot this node saved that is not durable yet and no upload
        is working on (after a restart, or one left over). Raises StorageError."""
        for sid in await asyncio.to_thread(self.registry.undurable_snapshots, self.node):
            if f"snapshot:{sid}" not in self._pushes:
                self.push_snapshot_later(sid)

    def check_restore(self, info: SnapshotInfo, origin: dict[str, Any]) -> None:
        """Raise unless this node can restore (or fork from) snapshot ``info`` taken where
        ``origin`` says: one not durable yet is only on the node that saved it (a Conflict
        naming it, proxied there; StateLost when that node is gone); one taken on another
        accelerator or, for kvm, another CPU model restores only on a node like it (a
        Conflict naming the least loaded such node, proxied there; NoNodeAvailable when there
        is none). Raises StorageError."""
        nodes, loads = self._live_nodes()
        if info.durable is None and info.node not in (None, self.node):
            holder = next((n for n in nodes if n.id == info.node), None)
            if holder is None or not holder.url:
                raise StateLost(
                    f"snapshot {info.id} ({info.name}) was saved on node {info.node}, which is "
                    "gone, before it was stored off-node: it cannot be restored",
                    snapshot_id=info.id,
                    lost="the snapshot's chunks (on its node only)",
                    node=info.node,
                )
            raise Conflict(
                f"snapshot {info.id} is on node {info.node} only until it is durable (seconds): "
                f"send the request to {holder.url}",
                snapshot_id=info.id,
                owner_node=holder.id,
                owner_url=holder.url,
            )
        here = next(n for n in nodes if n.id == self.node)
        if compatible(here, origin):
            return
        need = str(origin.get("accelerator") or "?")
        if need == "kvm":
            need += f" on a {origin.get('cpu_model')!r} CPU"
        fits = [n for n in nodes if not n.draining and n.url and compatible(n, origin)]
        if not fits or PROXIED.get() is not None:
            raise NoNodeAvailable(
                f"snapshot {info.id} ({info.name}) was taken on node {origin.get('node')} and "
                f"needs {need}; node {self.node} is {here.accelerator} ({here.cpu_model})"
                + ("" if fits else " and no live node is like its origin"),
                snapshot_id=info.id,
                accelerator=origin.get("accelerator"),
                cpu_model=origin.get("cpu_model"),
            )
        best = min(fits, key=lambda n: (loads.get(n.id, (0, 0))[1] / max(n.capacity_mib, 1), n.id))
        raise Conflict(
            f"snapshot {info.id} needs {need}: it is restored on node {best.id} ({best.url})",
            snapshot_id=info.id,
            owner_node=best.id,
            owner_url=best.url,
            placed=f"a node with {need}",
        )

    # -- the shared store's GC ------------------------------------------------------------

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


class ClusterVolumeStore(VolumeStore):
    """A cluster node's volumes: records in the registry (:class:`RegistryRecords`), images
    in this node's ``volumes/`` and in the shared store.

    A new volume's image is pushed at once, and again whenever its last read-write sandbox
    lets go of it (a detach, a kill) and with every pause of a sandbox that has it attached
    (:meth:`ClusterNode.push`): so a volume no sandbox holds can be attached on any node,
    which pulls its latest image when the one here is not it. A push that fails leaves the
    volume on its node: an attach elsewhere is then a Conflict naming that node. A volume
    attached read-write to a sandbox is a Conflict naming the node that runs (or holds the
    pause of) that sandbox. An attach pulls the image it needs before it takes the volumes'
    lock every node shares (:meth:`_pull_ahead`; a lock per volume on this node instead), so
    no other node's volume operation waits for a transfer."""

    def __init__(self, cluster: ClusterNode) -> None:
        super().__init__(cluster.paths, RegistryRecords(cluster.registry, "volume", cluster.node))
        self.cluster = cluster

    def create(
        self, spec: VolumeSpec | str | None = None, /, *, tenant: str = "default", **fields: Any
    ) -> VolumeInfo:
        info = super().create(spec, tenant=tenant, **fields)
        self._push(info.id)
        return info

    def _push(self, volume_id: str) -> None:
        try:
            self.cluster.push_volume(volume_id)
        except TorporError as exc:  # it stays on this node until a later push
            log.warning(
                "volume %s: push failed, it stays on node %s: %s", volume_id, self.cluster.node, exc
            )
            with contextlib.suppress(TorporError):
                self.cluster.registry.forget_volume_image(volume_id, self.cluster.node)

    def _pulled(self, volume_id: str, manifest: dict[str, Any]) -> bool:
        """Whether this node's image of ``volume_id`` is the one ``manifest`` describes
        (pulled from it, and no sandbox of this node has written it since: one that did
        holds the volume here, so it is not pulled at all)."""
        return self.image(volume_id).exists() and self.cluster.pulled_volumes.get(
            volume_id
        ) == _manifest_key(manifest)

    def _pull(self, volume_id: str, manifest: dict[str, Any] | None) -> None:
        """Pull ``volume_id``'s image (``manifest``: its latest, None: never pushed) unless
        this node's copy is it already. Raises as :meth:`ClusterNode.pull_volume`."""
        with self.cluster.volume_pull_lock(volume_id):
            if manifest is not None and self._pulled(volume_id, manifest):
                return
            self.cluster.pull_volume(volume_id, manifest)
            if manifest is not None:
                self.cluster.pulled_volumes[volume_id] = _manifest_key(manifest)

    def _pull_ahead(self, id_or_name: str, tenant: str, read_only: bool) -> None:
        """Before the cluster-wide volumes' lock: pull the volume's latest image when the
        attach will need it, so no node's volume create, attach or delete waits for the
        transfer. Under the lock, :meth:`_before_attach` pulls again only if the latest
        image changed meanwhile. Not for an attach the sharing rule refuses as things stand
        (a writer holds it, or this one would write to a volume others read). Best effort:
        what fails here is tried again there."""
        try:
            info = self.get(id_or_name, tenant=tenant)
            if info.node in (None, self.cluster.node) and self.image(info.id).exists():
                return
            if any(not a.read_only for a in info.attachments) or (
                info.attachments and not read_only
            ):
                return
            manifest = self.cluster.registry.volume_image(info.id)
            if manifest is not None:
                self._pull(info.id, manifest)
        except TorporError as exc:
            log.info("volume %s: no pull ahead of the attach: %s", id_or_name, exc)

    def _before_attach(self, info: VolumeInfo, first: bool) -> None:
        here = self.cluster.node
        if info.node not in (None, here) or not self.image(info.id).exists():
            try:
                self._pull(info.id, self.cluster.registry.volume_image(info.id))
            except StateLost as exc:
                raise Conflict(
                    f"volume {info.name!r} ({info.id}) is on node {info.node} only (its latest "
                    "image was never stored off-node): attach it there",
                    kind="volume",
                    id=info.id,
                    node=info.node,
                ) from exc
            if first:
                info.node = here
        elif first:
            info.node = here
        super()._before_attach(info, first)

    def attach(
        self,
        id_or_name: str,
        sandbox_id: str,
        path: str,
        *,
        read_only: bool = False,
        tenant: str = "default",
    ) -> VolumeInfo:
        self._pull_ahead(id_or_name, tenant, read_only)
        try:
            return super().attach(id_or_name, sandbox_id, path, read_only=read_only, tenant=tenant)
        except Conflict as exc:
            holder = exc.data.get("holder")
            if not isinstance(holder, str):
                raise
            node = self.cluster.holder_node(holder)
            if node is None or node == self.cluster.node:
                raise
            url = ""
            with contextlib.suppress(TorporError):
                url = self.cluster.registry.node(node).url
            raise Conflict(
                f"{exc.message} (sandbox {holder} is on node {node}"
                + (f", {url}" if url else "")
                + ")",
                **{**exc.data, "node": node, "node_url": url},
            ) from exc

    def tidy(self) -> list[str]:
        """Delete this node's copies of volume images that are of no use here any more: the
        volume was deleted (from another node), or its latest image is on another node and
        no sandbox of this node (running here, or whose pause is here) has it attached.
        Under the volumes' lock (no create, attach or pull is half done meanwhile). Returns
        the ids dropped. Raises StorageError."""
        dropped = []
        here = self.cluster.node
        with self.records.lock():
            records = {i.id: i for i in self._infos()}
            for image in sorted(self.root.glob("vol-*.img")):
                info = records.get(image.stem)
                if info is not None and (
                    info.node in (None, here)
                    or any(self.cluster.holder_node(a.sandbox_id) == here for a in info.attachments)
                ):
                    continue
                image.unlink(missing_ok=True)
                dropped.append(image.stem)
        for vid in dropped:
            log.info("node %s: dropped its stale copy of volume %s", here, vid)
        return dropped

    def _let_go(self, before: list[VolumeInfo]) -> None:
        """Push the image of every volume here that a read-write sandbox let go of."""
        for info in before:
            if any(not a.read_only for a in info.attachments) and self.image(info.id).exists():
                now = next((v for v in self._infos() if v.id == info.id), None)
                if now is not None and not any(not a.read_only for a in now.attachments):
                    self._push(info.id)

    def detach(self, id_or_name: str, sandbox_id: str, *, tenant: str = "default") -> VolumeInfo:
        before = self.get(id_or_name, tenant=tenant)
        info = super().detach(id_or_name, sandbox_id, tenant=tenant)
        self._let_go([before])
        return info

    def release(self, sandbox_ids: set[str] | None = None, *, keep: set[str] | None = None) -> int:
        before = [i for i in self._infos() if i.node == self.cluster.node]
        dropped = super().release(sandbox_ids, keep=keep)
        if dropped:
            self._let_go(before)
        return dropped


class ClusterDriveStore(DriveStore):
    """A cluster node's drives: records in the registry (:class:`RegistryRecords`), each
    drive's directory on the node that made it (``node``). A drive is attached only to a
    sandbox on its node (else a Conflict naming the node), and pins that sandbox there
    (:meth:`ClusterNode.check_pins`). A drive is deleted only on its node (its directory is
    there)."""

    def __init__(self, cluster: ClusterNode) -> None:
        super().__init__(cluster.paths, RegistryRecords(cluster.registry, "drive", cluster.node))
        self.cluster = cluster

    def _elsewhere(self, info: DriveInfo, what: str) -> Conflict:
        url = ""
        with contextlib.suppress(TorporError):
            url = self.cluster.registry.node(str(info.node)).url
        return Conflict(
            f"drive {info.name!r} ({info.id}) is a directory of node {info.node}: {what} "
            + (f"there ({url})" if url else "there"),
            kind="drive",
            id=info.id,
            node=info.node,
            node_url=url,
        )

    def _before_attach(self, info: DriveInfo, first: bool) -> None:
        if info.node not in (None, self.cluster.node):
            raise self._elsewhere(info, "attach it to a sandbox running")
        super()._before_attach(info, first)

    def delete(self, id_or_name: str, *, tenant: str = "default") -> DriveInfo:
        info = self.get(id_or_name, tenant=tenant)
        if info.node not in (None, self.cluster.node) and not info.attachments:
            raise self._elsewhere(info, "delete it")
        return super().delete(id_or_name, tenant=tenant)


class RegistryRecords:
    """Volume or drive records in the cluster's PostgreSQL registry (the
    :class:`~torpor.sandbox.storage.records.RecordMedium` of a cluster node): every node lists,
    gets, attaches and deletes every volume and drive; creates, attaches and deletes are
    serialized across nodes by a PostgreSQL advisory lock per kind. Raises StorageError."""

    shared = True

    def __init__(self, registry: PostgresRegistry, kind: str, node: str) -> None:
        self.registry = registry
        self.kind = kind
        self.node: str | None = node

    def rows(self) -> Iterator[dict[str, Any]]:
        yield from self.registry.record_rows(self.kind)

    def save(self, data: dict[str, Any]) -> None:
        try:
            self.registry.save_record(self.kind, data)
        except Conflict as exc:  # two nodes creating one name at once: the unique index decides
            name = data.get("name")
            raise Conflict(
                f"a {self.kind} named {name!r} already exists", kind=self.kind, name=name
            ) from exc

    def remove(self, rid: str) -> None:
        self.registry.remove_record(self.kind, rid)

    def lock(self) -> contextlib.AbstractContextManager[None]:
        return self.registry.locked(RECORD_LOCKS[self.kind])

    def written_at(self, rid: str) -> float | None:
        return self.registry.record_written_at(self.kind, rid)


class RegistryCatalog:
    """Snapshot manifests in the cluster's PostgreSQL registry (the
    :class:`~torpor.sandbox.storage.catalog.SnapshotCatalog` of a cluster node): every node
    sees, restores, deletes and expires every snapshot; a new one is recorded as saved on
    ``node`` (not durable until its push is done). Raises StorageError."""

    shared = True

    def __init__(self, registry: PostgresRegistry, node: str) -> None:
        self.registry = registry
        self.node = node

    def entries(self, snapshot_id: str | None = None) -> Iterator[CatalogEntry]:
        for sid, text, status in self.registry.snapshot_rows(snapshot_id):
            body: dict[str, Any] | None = None
            error = None
            try:
                parsed = json.loads(text)
            except ValueError as exc:
                error = str(exc)
            else:
                if isinstance(parsed, dict):
                    body = parsed
                else:
                    error = "not a JSON object"
            yield CatalogEntry(
                sid,
                body,
                error=error,
                node=status.node,
                durable_at=status.durable_at,
                upload_error=status.upload_error,
            )

    def add(self, snapshot_id: str, body: dict[str, Any]) -> None:
        try:
            self.registry.put_snapshot(body, node=self.node)
        except Conflict as exc:  # two nodes saving one name at once: the unique index decides
            name = body.get("info", {}).get("name")
            raise Conflict(
                f"a snapshot named {name!r} already exists", kind="snapshot", name=name
            ) from exc

    def replace(self, snapshot_id: str, body: dict[str, Any]) -> None:
        self.registry.replace_snapshot(snapshot_id, body)

    def remove(self, snapshot_id: str) -> bool:
        return self.registry.delete_snapshot(snapshot_id)


def _manifest_key(manifest: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()


def upload_failed(exc: BaseException) -> str:
    """The text ``info.upload_error`` shows for a failed upload."""
    return f"{type(exc).__name__}: {exc}" if not isinstance(exc, TorporError) else str(exc)
