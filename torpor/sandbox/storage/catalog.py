"""Where snapshot manifests are recorded: the small interface a
:class:`~torpor.sandbox.storage.snapshots.SnapshotStore` writes through, and its local
implementation.

A manifest (``{"version", "info", "files", "anchors", "digest", ...}``) says which chunks make
a snapshot; the chunks themselves are in a chunk store. Two catalogs:

* :class:`LocalCatalog` — one JSON file per snapshot under the home's ``snapshots/`` (the
  embedded default, zero configuration);
* in cluster mode, the PostgreSQL registry's ``snapshots`` table
  (:class:`~torpor.sandbox.manager.cluster.RegistryCatalog` over
  :class:`~torpor.sandbox.registry.postgres.PostgresRegistry`), so every node lists, restores,
  deletes and expires every snapshot, and each entry also says where the snapshot was saved
  and when it became durable in the shared store.

A catalog never judges a manifest: the snapshot store checks each body's digest.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from torpor.errors import SnapshotNotFound, StorageError
from torpor.sandbox.storage.records import write_record
from torpor.sandbox.vm.disk import fsync_dir

__all__ = ["CatalogEntry", "LocalCatalog", "SnapshotCatalog"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CatalogEntry:
    """One recorded manifest: its body (None when it does not parse: ``error`` says why) and,
    in a cluster, where it was saved and whether it is durable off that node."""

    id: str
    body: dict[str, Any] | None
    error: str | None = None
    node: str | None = None
    durable_at: float | None = None
    upload_error: str | None = None


class SnapshotCatalog(Protocol):
    """Snapshot manifests by id. Every method raises StorageError when the medium fails."""

    #: True when other nodes record snapshots here too
    shared: bool

    def entries(self, snapshot_id: str | None = None) -> Iterator[CatalogEntry]:
        """Every recorded manifest (or only ``snapshot_id``'s), in no particular order."""
        ...

    def add(self, snapshot_id: str, body: dict[str, Any]) -> None:
        """Record a new manifest, durably. Raises Conflict when the tenant has a snapshot of
        that name already (a shared catalog checks it itself: two nodes may race)."""
        ...

    def replace(self, snapshot_id: str, body: dict[str, Any]) -> None:
        """Rewrite a recorded manifest. Raises SnapshotNotFound."""
        ...

    def remove(self, snapshot_id: str) -> bool:
        """Forget a manifest; True when it was there."""
        ...


class LocalCatalog:
    """Manifests as files ``<root>/<id>.json``, written atomically (temporary file, fsync,
    rename, fsync of the directory)."""

    shared = False

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def path(self, snapshot_id: str) -> Path:
        return self.root / f"{snapshot_id}.json"

    def entries(self, snapshot_id: str | None = None) -> Iterator[CatalogEntry]:
        paths = (
            sorted(self.root.glob("snap-*.json"))
            if snapshot_id is None
            else [self.path(snapshot_id)]
        )
        for path in paths:
            try:
                body = json.loads(path.read_text())
            except FileNotFoundError:
                continue
            except (OSError, ValueError) as exc:
                yield CatalogEntry(path.stem, None, error=str(exc))
                continue
            if isinstance(body, dict):
                yield CatalogEntry(path.stem, body)
            else:
                yield CatalogEntry(path.stem, None, error="not a JSON object")

    def add(self, snapshot_id: str, body: dict[str, Any]) -> None:
        self.replace(snapshot_id, body)

    def replace(self, snapshot_id: str, body: dict[str, Any]) -> None:
        write_record(
            self.path(snapshot_id),
            body,
            what=f"the manifest of {snapshot_id}",
            sync_dir=True,
            snapshot_id=snapshot_id,
        )

    def remove(self, snapshot_id: str) -> bool:
        try:
            self.path(snapshot_id).unlink()
            fsync_dir(self.root)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise StorageError(f"cannot delete snapshot {snapshot_id}: {exc}", exc=exc) from exc
        return True


def not_found(id_or_name: str) -> SnapshotNotFound:
    """The error for a snapshot that is not recorded."""
    return SnapshotNotFound(f"snapshot {id_or_name!r} not found", kind="snapshot", name=id_or_name)
