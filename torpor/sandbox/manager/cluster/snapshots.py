"""Snapshots in a cluster: manifests in the registry (:class:`RegistryCatalog`), chunks saved
into the node's own ``chunks/`` and pushed to the shared store behind it
(:meth:`Snapshots.snapshot_store`), local copies evicted once durable.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

from torpor.errors import Conflict, TorporError
from torpor.sandbox.manager.cluster.node import NodeBase
from torpor.sandbox.registry.postgres import PostgresRegistry
from torpor.sandbox.storage.catalog import CatalogEntry
from torpor.sandbox.storage.chunk_backends import LocalChunkBackend
from torpor.sandbox.storage.chunks import ChunkStore, FileManifest
from torpor.sandbox.storage.snapshots import SnapshotStore
from torpor.sandbox.storage.tiered import TieredChunkBackend

__all__ = ["RegistryCatalog", "Snapshots"]

log = logging.getLogger(__name__)


class Snapshots(NodeBase):
    """The part of a :class:`~torpor.sandbox.manager.cluster.ClusterNode` that keeps
    snapshots (see the module docstring)."""

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
