"""This machine as a node: what it tells the registry of itself (accelerator, CPU model,
RAM, vCPUs) and :class:`NodeBase`, the state every part of a
:class:`~torpor.sandbox.manager.cluster.ClusterNode` shares (the registry, the shared chunk
store, the uploads in flight).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import platform
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from torpor.config import Paths
from torpor.errors import TorporError
from torpor.sandbox.manager.cluster.config import ClusterConfig
from torpor.sandbox.models import NodeStatus
from torpor.sandbox.registry.postgres import NodeInfo, PostgresRegistry
from torpor.sandbox.storage.chunks import ChunkStore, open_chunk_store
from torpor.sandbox.storage.snapshots import SnapshotStore

__all__ = ["NodeBase", "local_status"]

log = logging.getLogger(__name__)


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


class NodeBase:
    """The state of a cluster node that its parts share (see
    :class:`~torpor.sandbox.manager.cluster.ClusterNode`). Raises StorageError when
    PostgreSQL or the store cannot be opened."""

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
