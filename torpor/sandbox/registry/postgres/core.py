"""The PostgreSQL registry's connection, transactions and migrations, and what its SQL on
sandboxes says otherwise than SQLite's (the rest is
:class:`~torpor.sandbox.registry.base.SqlRegistry`'s).

A dropped connection (PostgreSQL restarted) is reopened on the next call; a call that fails
that way raises StorageError and may be retried. psycopg is imported only when this registry is
opened (the ``postgres`` extra).
"""

from __future__ import annotations

import builtins
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from torpor.errors import Conflict, StorageError
from torpor.sandbox.models import SandboxState
from torpor.sandbox.registry.base import METER_COLUMNS, SqlRegistry
from torpor.sandbox.registry.postgres.schema import (
    BOOTSTRAP,
    MIGRATION_LOCK,
    MIGRATIONS,
    PG_SCHEMA_VERSION,
)
from torpor.sandbox.registry.records import SandboxRecord, record_from_row

__all__ = ["PostgresCore"]

log = logging.getLogger(__name__)

_METERS = ", ".join(METER_COLUMNS)


class PostgresCore(SqlRegistry):
    """The registry of sandboxes in PostgreSQL at ``dsn``, without the cluster's tables
    (:class:`~torpor.sandbox.registry.postgres.PostgresRegistry` adds them). Thread-safe (one
    connection behind a lock, reopened when it drops).

    Every method raises :class:`StorageError` when PostgreSQL fails; lookups raise
    :class:`~torpor.errors.SandboxNotFound`; a taken name raises :class:`Conflict`.
    """

    PARAM = "%s"
    SCHEMA = "torpor_registry."
    #: a sandbox row with what its pause manifest says (see :meth:`_record`)
    RECORD_EXTRA = ", p.durable_at, p.manifest_paused_at, p.upload_error"
    RECORD_JOIN = " LEFT JOIN torpor_registry.pauses p ON p.sandbox_id = s.id"

    def __init__(self, dsn: str, *, schema_version: int = PG_SCHEMA_VERSION) -> None:
        self.dsn = dsn
        self._lock = threading.RLock()
        #: grows with every transition this process records (see the SQLite registry)
        self.generation = 0
        self._conn: Any = None
        with self._lock:
            try:
                self._migrate(self._connection(), schema_version)
            except StorageError:
                raise
            except Exception as exc:
                raise StorageError(f"cannot open the registry database: {exc}", exc=exc) from exc

    # -- plumbing -------------------------------------------------------------------------

    def _connection(self) -> Any:
        import psycopg

        if self._conn is None or self._conn.closed or self._conn.broken:
            try:
                self._conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=10)
            except psycopg.Error as exc:
                raise StorageError(
                    f"cannot connect to the registry database: {exc}", exc=exc
                ) from exc
        return self._conn

    @contextmanager
    def _tx(self) -> Iterator[Any]:
        """One transaction; psycopg errors become StorageError (Conflict for a taken name)."""
        import psycopg

        with self._lock:
            conn = self._connection()
            try:
                with conn.transaction():
                    yield conn
            except psycopg.errors.UniqueViolation as exc:
                raise Conflict(f"registry constraint failed: {exc}", exc=exc) from exc
            except psycopg.Error as exc:
                raise StorageError(f"registry error: {exc}", exc=exc) from exc

    def _query(self, sql: str, args: tuple[Any, ...] = ()) -> builtins.list[tuple[Any, ...]]:
        import psycopg

        with self._lock:
            try:
                return list(self._connection().execute(sql.encode(), args).fetchall())
            except psycopg.Error as exc:
                raise StorageError(f"registry error: {exc}", exc=exc) from exc

    def _migrate(self, conn: Any, target: int = PG_SCHEMA_VERSION) -> None:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
            conn.execute(BOOTSTRAP.encode())
        version = self.schema_version
        if version > PG_SCHEMA_VERSION:
            raise StorageError(
                f"the registry database has schema version {version}, newer than this torpor "
                f"({PG_SCHEMA_VERSION})"
            )
        while version < target:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
                version = self.schema_version  # another node may have migrated meanwhile
                if version >= target:
                    break
                conn.execute(MIGRATIONS[version + 1].encode())
                conn.execute(
                    "INSERT INTO torpor_registry.schema_version (version) VALUES (%s)",
                    (version + 1,),
                )
                version += 1
                log.info("registry (postgres): migrated to schema version %d", version)

    @property
    def schema_version(self) -> int:
        rows = self._query("SELECT coalesce(max(version), 0) FROM torpor_registry.schema_version")
        return int(rows[0][0])

    def close(self) -> None:
        """Close the connection (idempotent)."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    # -- what differs from SQLite ----------------------------------------------------------

    def touch(self, sandbox_id: str, at: float | None = None) -> None:
        """Set ``last_active_at`` (the idle clock) to ``at`` (default: now), without waiting
        for the WAL flush (``synchronous_commit = off``: a clock a little behind after a crash
        only delays an idle pause)."""
        with self._tx() as db:
            db.execute("SET LOCAL synchronous_commit = off")
            db.execute(
                "UPDATE torpor_registry.sandboxes SET last_active_at = %s WHERE id = %s",
                (time.time() if at is None else at, sandbox_id),
            )

    def _meter_join(self, i: int) -> str:
        # LATERAL: a seek in the (sandbox_id, at) index per side
        return (
            f" LEFT JOIN LATERAL (SELECT {_METERS} FROM torpor_registry.transitions"
            f" WHERE sandbox_id = s.id AND at <= %s ORDER BY at DESC, seq DESC LIMIT 1)"
            f" b{i} ON s.created_at < %s"
            f" LEFT JOIN LATERAL (SELECT {_METERS} FROM torpor_registry.transitions"
            f" WHERE sandbox_id = s.id AND at > %s ORDER BY at, seq LIMIT 1)"
            f" a{i} ON s.created_at < %s"
        )

    def _record(self, row: Sequence[Any]) -> SandboxRecord:
        state, paused = row[4], row[11]
        durable_at, manifest_paused_at, upload_error = row[13], row[14], row[15]
        paused_state = state == SandboxState.PAUSED.value
        # durable: the current pause is the one stored off-node (a later pause, or a wake, is not)
        durable = paused_state and paused == manifest_paused_at and paused is not None
        return record_from_row(
            row,
            durable_at=durable_at if durable else None,
            upload_error=upload_error if paused_state else None,
        )
