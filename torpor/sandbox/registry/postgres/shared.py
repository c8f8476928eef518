"""What every node of a cluster shares through the PostgreSQL registry besides sandboxes:
snapshot manifests (schema v3, v6), volume and drive records (v9), and the sweeps of the
shared chunk store with the advisory locks they and the records are made under (v7).
"""

from __future__ import annotations

import builtins
import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from torpor.errors import (
    CorruptData,
    InvalidArgument,
    SnapshotNotFound,
    StorageError,
    VolumeNotFound,
)
from torpor.sandbox.registry.postgres.core import PostgresCore
from torpor.sandbox.registry.postgres.schema import RECORD_TABLES

__all__ = ["SharedTables", "SnapshotStatus"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SnapshotStatus:
    """Where a recorded snapshot was saved and whether it is in the shared store yet."""

    node: str | None
    durable_at: float | None
    upload_error: str | None
    attempts: int


class SharedTables(PostgresCore):
    """The registry's snapshot manifests, volume and drive records, and sweeps (see the
    module docstring)."""

    # -- snapshot manifests (schema v3) ---------------------------------------------------

    def put_snapshot(self, body: dict[str, Any], *, node: str | None = None) -> None:
        """Record a snapshot's manifest (``{"info": {...}, "files": {...}, ...}`` as the
        snapshot store writes it). Raises Conflict (the tenant has a snapshot of that name, or
        the id exists), InvalidArgument for a body without its info, StorageError."""
        try:
            info = body["info"]
            row = (
                str(info["id"]),
                str(info["tenant"]),
                str(info["name"]),
                node,
                _epoch(info["created_at"]),
                _epoch(info["expires_at"]),
                json.dumps(body, sort_keys=True),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgument(f"not a snapshot manifest: {exc}") from exc
        with self._tx() as db:
            db.execute(
                "INSERT INTO torpor_registry.snapshots"
                " (id, tenant, name, node, created_at, expires_at, manifest)"
                " VALUES (%s,%s,%s,%s,%s,%s,%s)",
                row,
            )

    def snapshot_manifest(self, snapshot_id: str) -> dict[str, Any]:
        """A snapshot's manifest. Raises SnapshotNotFound, StorageError."""
        rows = self._query(
            "SELECT manifest FROM torpor_registry.snapshots WHERE id = %s", (snapshot_id,)
        )
        if not rows:
            raise SnapshotNotFound(
                f"no snapshot {snapshot_id!r}", kind="snapshot", name=snapshot_id
            )
        body: dict[str, Any] = json.loads(rows[0][0])
        return body

    def replace_snapshot(self, snapshot_id: str, body: dict[str, Any]) -> None:
        """Rewrite a recorded snapshot's manifest (its retention changed; a moved home),
        keeping its node and durability. Raises SnapshotNotFound, InvalidArgument for a body
        without its info, StorageError."""
        try:
            expires = _epoch(body["info"]["expires_at"])
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgument(f"not a snapshot manifest: {exc}") from exc
        with self._tx() as db:
            cur = db.execute(
                "UPDATE torpor_registry.snapshots SET manifest = %s, expires_at = %s WHERE id = %s",
                (json.dumps(body, sort_keys=True), expires, snapshot_id),
            )
            if cur.rowcount != 1:
                raise SnapshotNotFound(
                    f"no snapshot {snapshot_id!r}", kind="snapshot", name=snapshot_id
                )

    def snapshot_rows(
        self, snapshot_id: str | None = None
    ) -> builtins.list[tuple[str, str, SnapshotStatus]]:
        """``(id, manifest text, status)`` of every recorded snapshot (or of one), oldest
        first. Raises StorageError."""
        sql = (
            "SELECT id, manifest, node, durable_at, upload_error, attempts"
            " FROM torpor_registry.snapshots"
        )
        args: tuple[Any, ...] = ()
        if snapshot_id is not None:
            sql, args = sql + " WHERE id = %s", (snapshot_id,)
        rows = self._query(sql + " ORDER BY created_at, id", args)
        return [(r[0], r[1], SnapshotStatus(r[2], r[3], r[4], r[5])) for r in rows]

    def record_snapshot_durable(self, snapshot_id: str) -> float | None:
        """Record that every chunk of the snapshot is in the shared store; return when (now),
        or None when the snapshot is gone (deleted meanwhile). Raises StorageError."""
        now = time.time()
        with self._tx() as db:
            cur = db.execute(
                "UPDATE torpor_registry.snapshots SET durable_at = %s, upload_error = NULL"
                " WHERE id = %s",
                (now, snapshot_id),
            )
            return now if cur.rowcount == 1 else None

    def record_snapshot_upload_error(self, snapshot_id: str, error: str) -> None:
        """Say why the snapshot's push failed (it is retried). Raises StorageError."""
        with self._tx() as db:
            db.execute(
                "UPDATE torpor_registry.snapshots SET upload_error = %s,"
                " attempts = attempts + 1 WHERE id = %s",
                (error[:2000], snapshot_id),
            )

    def undurable_snapshots(self, node: str) -> builtins.list[str]:
        """Ids of the snapshots ``node`` saved that are not in the shared store yet, oldest
        first. Raises StorageError."""
        rows = self._query(
            "SELECT id FROM torpor_registry.snapshots WHERE node = %s AND durable_at IS NULL"
            " ORDER BY created_at, id",
            (node,),
        )
        return [r[0] for r in rows]

    def delete_snapshot(self, snapshot_id: str) -> bool:
        """Forget a snapshot (its chunks go at the next sweep); True when it was there."""
        with self._tx() as db:
            cur = db.execute("DELETE FROM torpor_registry.snapshots WHERE id = %s", (snapshot_id,))
            return bool(cur.rowcount == 1)

    def referenced_chunks(self) -> set[str]:
        """Every chunk some recorded manifest names (expired ones included: they go first,
        by :meth:`delete_snapshot`). Raises CorruptData when a manifest does not parse (a
        sweep must then not run), StorageError."""
        refs: set[str] = set()
        for hashes in [
            *self._manifest_hashes(
                "SELECT id, manifest FROM torpor_registry.snapshots",
                "snapshot",
                "manifest",
                lambda body: body["files"].values(),
            ),
            *self._manifest_hashes(
                "SELECT sandbox_id, manifest FROM torpor_registry.pauses"
                " WHERE manifest IS NOT NULL",
                "sandbox",
                "pause manifest",
                lambda body: [*body["files"].values(), *(body.get("volumes") or {}).values()],
            ),
            *self._manifest_hashes(
                "SELECT id, image FROM torpor_registry.volumes WHERE image IS NOT NULL",
                "volume",
                "image manifest",
                lambda body: [body],
            ),
        ]:
            refs |= hashes
        return refs

    def _manifest_hashes(
        self, sql: str, kind: str, what: str, files: Callable[[Any], Iterable[Any]]
    ) -> Iterator[set[str]]:
        """The chunk hashes of each file manifest ``files`` finds in the JSON of each row
        ``(id, text)`` of ``sql``. Raises CorruptData naming the ``kind`` (``snapshot_id``,
        ``sandbox_id``, ``volume_id``) whose ``what`` does not parse."""
        from torpor.sandbox.storage.chunks import FileManifest

        for rid, text in self._query(sql):
            try:
                found = [FileManifest.from_json(fm).hashes() for fm in files(json.loads(text))]
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise CorruptData(
                    f"{kind} {rid}: its {what} in the registry is unreadable ({exc})",
                    **{f"{kind}_id": rid},
                ) from exc
            yield from found

    # -- sweeps of the shared store (schema v7) ---------------------------------------------

    @contextmanager
    def _session(self) -> Iterator[Any]:
        """A connection of its own for the block, closed after it (and with it any session
        advisory lock taken on it). Raises StorageError."""
        import psycopg

        try:
            conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=10)
        except psycopg.Error as exc:
            raise StorageError(f"cannot connect to the registry database: {exc}", exc=exc) from exc
        try:
            yield conn
        finally:
            conn.close()

    @contextmanager
    def exclusive(self, key: int) -> Iterator[bool]:
        """Try to take the session advisory lock ``key`` on a connection of its own, held for
        the block: yields whether this caller got it (another holder: False, at once). The
        lock goes with the connection, so a node that dies mid-block lets go of it. Raises
        StorageError."""
        import psycopg

        with self._session() as conn:
            try:
                row = conn.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()
                yield bool(row and row[0])
            except psycopg.Error as exc:
                raise StorageError(f"registry error: {exc}", exc=exc) from exc

    @contextmanager
    def locked(self, key: int) -> Iterator[None]:
        """Hold the session advisory lock ``key`` for the block, waiting for it, on a
        connection of its own (a node that dies mid-block lets go of it). Raises
        StorageError."""
        import psycopg

        with self._session() as conn:
            try:
                conn.execute("SELECT pg_advisory_lock(%s)", (key,))
            except psycopg.Error as exc:
                raise StorageError(f"registry error: {exc}", exc=exc) from exc
            yield

    # -- volumes and drives (schema v9) -----------------------------------------------------

    def record_rows(self, kind: str) -> builtins.list[dict[str, Any]]:
        """Every record of ``kind`` ("volume", "drive"). Raises StorageError."""
        rows = self._query(f"SELECT id, record FROM {RECORD_TABLES[kind]} ORDER BY id")
        out = []
        for rid, text in rows:
            try:
                data = json.loads(text)
            except ValueError as exc:
                log.warning("skipping unreadable %s record %s: %s", kind, rid, exc)
                continue
            if isinstance(data, dict):
                out.append(data)
        return out

    def save_record(self, kind: str, data: dict[str, Any]) -> None:
        """Insert or rewrite a volume's or drive's record (its id, tenant, name, labels,
        attachments, node as :class:`~torpor.sandbox.storage.records.RecordStore` writes
        them); a volume's pushed image stays. Raises Conflict (the name is another's in the
        tenant), InvalidArgument (not a record), StorageError."""
        try:
            rid, tenant, name = str(data["id"]), str(data["tenant"]), str(data["name"])
            labels = json.dumps(data.get("labels") or {}, sort_keys=True)
            node = data.get("node")
            attachments = list(data.get("attachments") or [])
        except (KeyError, TypeError) as exc:
            raise InvalidArgument(f"not a {kind} record: {exc}") from exc
        writer = next((a for a in attachments if not a.get("read_only")), None)
        holder = (writer or (attachments[0] if attachments else {})).get("sandbox_id")
        record = json.dumps(data, sort_keys=True)
        with self._tx() as db:
            if kind == "volume":
                db.execute(
                    "INSERT INTO torpor_registry.volumes (id, tenant, name, size_mib, labels,"
                    " holder, node, record, written_at) VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s)"
                    " ON CONFLICT (id) DO UPDATE SET tenant = EXCLUDED.tenant,"
                    " name = EXCLUDED.name, size_mib = EXCLUDED.size_mib,"
                    " labels = EXCLUDED.labels, holder = EXCLUDED.holder, node = EXCLUDED.node,"
                    " record = EXCLUDED.record, written_at = EXCLUDED.written_at",
                    (
                        rid,
                        tenant,
                        name,
                        int(data.get("size_mib") or 0),
                        labels,
                        holder,
                        node,
                        record,
                        time.time(),
                    ),
                )
            else:
                db.execute(
                    "INSERT INTO torpor_registry.drives (id, tenant, name, labels, node, record,"
                    " written_at) VALUES (%s,%s,%s,%s,%s,%s,%s) ON CONFLICT (id) DO UPDATE SET"
                    " tenant = EXCLUDED.tenant, name = EXCLUDED.name, labels = EXCLUDED.labels,"
                    " node = EXCLUDED.node, record = EXCLUDED.record,"
                    " written_at = EXCLUDED.written_at",
                    (rid, tenant, name, labels, node, record, time.time()),
                )

    def remove_record(self, kind: str, rid: str) -> bool:
        """Forget a volume's or drive's record; True when it was there. Raises
        StorageError."""
        with self._tx() as db:
            cur = db.execute(f"DELETE FROM {RECORD_TABLES[kind]} WHERE id = %s", (rid,))
            return bool(cur.rowcount)

    def record_written_at(self, kind: str, rid: str) -> float | None:
        """When a volume's or drive's record was last written. Raises StorageError."""
        rows = self._query(f"SELECT written_at FROM {RECORD_TABLES[kind]} WHERE id = %s", (rid,))
        return float(rows[0][0]) if rows else None

    def record_volume_image(self, volume_id: str, node: str, manifest: dict[str, Any]) -> None:
        """Record that ``volume_id``'s latest image is on ``node`` and, as ``manifest``, in
        the shared store. Raises VolumeNotFound, StorageError."""
        with self._tx() as db:
            data = _locked_volume(db, volume_id)
            if data is None:
                raise VolumeNotFound(
                    f"volume {volume_id!r} not found", kind="volume", name=volume_id
                )
            data["node"] = node
            db.execute(
                "UPDATE torpor_registry.volumes SET node = %s, record = %s, image = %s,"
                " image_at = %s, written_at = %s WHERE id = %s",
                (
                    node,
                    json.dumps(data, sort_keys=True),
                    json.dumps(manifest, sort_keys=True),
                    time.time(),
                    time.time(),
                    volume_id,
                ),
            )

    def drives_of(self, sandbox_id: str) -> builtins.list[tuple[str, str, str | None]]:
        """The drives attached to ``sandbox_id``: (id, name, node). Raises StorageError."""
        rows = self._query(
            "SELECT id, name, node FROM torpor_registry.drives WHERE record::jsonb ->"
            " 'attachments' @> jsonb_build_array(jsonb_build_object('sandbox_id', %s::text))"
            " ORDER BY id",
            (sandbox_id,),
        )
        return [(str(r[0]), str(r[1]), r[2]) for r in rows]

    def forget_volume_image(self, volume_id: str, node: str) -> None:
        """Record that ``volume_id``'s latest image is on ``node`` only (a push failed: the
        stored one is older). Raises StorageError."""
        with self._tx() as db:
            data = _locked_volume(db, volume_id)
            if data is None:
                return
            data["node"] = node
            db.execute(
                "UPDATE torpor_registry.volumes SET node = %s, record = %s, image = NULL,"
                " image_at = NULL WHERE id = %s",
                (node, json.dumps(data, sort_keys=True), volume_id),
            )

    def volume_image(self, volume_id: str) -> dict[str, Any] | None:
        """The manifest of ``volume_id``'s latest image in the shared store (None: never
        pushed). Raises StorageError."""
        rows = self._query("SELECT image FROM torpor_registry.volumes WHERE id = %s", (volume_id,))
        if not rows or rows[0][0] is None:
            return None
        body: dict[str, Any] = json.loads(rows[0][0])
        return body

    def last_sweep(self) -> float | None:
        """When the last sweep of the shared store finished (None: never). Raises
        StorageError."""
        rows = self._query("SELECT max(finished_at) FROM torpor_registry.sweeps")
        return None if not rows or rows[0][0] is None else float(rows[0][0])

    def record_sweep(
        self, node: str, started_at: float, removed: int, kept: int, freed_bytes: int
    ) -> None:
        """Record a finished sweep of the shared store. Raises StorageError."""
        with self._tx() as db:
            db.execute(
                "INSERT INTO torpor_registry.sweeps"
                " (node, started_at, finished_at, removed, kept, freed_bytes)"
                " VALUES (%s,%s,%s,%s,%s,%s)",
                (node, started_at, time.time(), removed, kept, freed_bytes),
            )


def _locked_volume(db: Any, volume_id: str) -> dict[str, Any] | None:
    """The record of ``volume_id``, its row locked until the caller's transaction ends (None:
    no such volume)."""
    rows = db.execute(
        "SELECT record FROM torpor_registry.volumes WHERE id = %s FOR UPDATE", (volume_id,)
    ).fetchall()
    return None if not rows else dict(json.loads(rows[0][0]))


def _epoch(value: Any) -> float:
    """A manifest's time (ISO 8601 text or seconds) in seconds since the epoch."""
    if isinstance(value, int | float):
        return float(value)
    return datetime.fromisoformat(str(value)).timestamp()
