"""The sandbox registry: one SQLite database (WAL) at ``paths().registry``.

It holds one row per sandbox and an append-only log of every state transition. A state change
and its log entry are written in one transaction, compare-and-set on the old state, with
``synchronous=FULL`` so a committed state survives a power cut. The manager writes a state only
after the files that back it are durable, so the registry never claims more than the disk holds.

Names are unique per tenant among sandboxes that are not ``stopped`` (a partial unique index):
a killed sandbox's name can be taken again, while the old row stays so calls on its id still get
:class:`~torpor.errors.SandboxClosed` instead of "not found".

The statements on sandboxes, transitions and the usage ledger are the PostgreSQL registry's
too (:class:`~torpor.sandbox.registry.base.SqlRegistry`); this module keeps what is SQLite's
own: the connection, its pragmas, the schema and its migrations.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from torpor.errors import Conflict, StorageError
from torpor.sandbox.models import SandboxState
from torpor.sandbox.registry.base import SqlRegistry
from torpor.sandbox.registry.meters import MeterRow, accrue
from torpor.sandbox.registry.records import SandboxRecord

__all__ = ["SCHEMA_VERSION", "Registry", "SandboxRecord"]

log = logging.getLogger(__name__)

SCHEMA_VERSION = 2

_SCHEMA_V1 = """
CREATE TABLE sandboxes (
    id                   TEXT PRIMARY KEY,
    tenant               TEXT NOT NULL,
    name                 TEXT NOT NULL,
    template             TEXT NOT NULL,
    state                TEXT NOT NULL,
    labels               TEXT NOT NULL DEFAULT '{}',
    spec                 TEXT NOT NULL DEFAULT '{}',
    idle_pause_seconds   INTEGER,
    pause_retention_days INTEGER NOT NULL DEFAULT 30,
    created_at           REAL NOT NULL,
    last_active_at       REAL NOT NULL,
    paused_at            REAL,
    error                TEXT
);
CREATE UNIQUE INDEX sandboxes_live_name ON sandboxes (tenant, name) WHERE state != 'stopped';
CREATE INDEX sandboxes_state ON sandboxes (state);
CREATE TABLE transitions (
    seq        INTEGER PRIMARY KEY AUTOINCREMENT,
    sandbox_id TEXT NOT NULL,
    src        TEXT,
    dst        TEXT NOT NULL,
    at         REAL NOT NULL,
    reason     TEXT NOT NULL DEFAULT ''
);
CREATE INDEX transitions_sandbox ON transitions (sandbox_id, seq);
"""

# Version 2: usage meters on the transitions log (see torpor.sandbox.registry.meters): the QEMU
# process's CPU seconds read at the transition, the bytes a pause owns, and the cumulative
# meters; an index to find a sandbox's row at an instant; and the ledger of stored things
# (snapshots, volumes) that usage prices by size x time, kept after they are deleted.
_SCHEMA_V2 = """
ALTER TABLE transitions ADD COLUMN cpu_reading REAL;
ALTER TABLE transitions ADD COLUMN owned_bytes INTEGER;
ALTER TABLE transitions ADD COLUMN m_vcpu REAL NOT NULL DEFAULT 0;
ALTER TABLE transitions ADD COLUMN m_cpu REAL NOT NULL DEFAULT 0;
ALTER TABLE transitions ADD COLUMN m_ram REAL NOT NULL DEFAULT 0;
ALTER TABLE transitions ADD COLUMN m_paused REAL NOT NULL DEFAULT 0;
ALTER TABLE transitions ADD COLUMN cpu_ratio REAL;
CREATE INDEX transitions_at ON transitions (sandbox_id, at);
CREATE TABLE stored (
    kind        TEXT NOT NULL,
    id          TEXT NOT NULL,
    tenant      TEXT NOT NULL,
    name        TEXT NOT NULL,
    labels      TEXT NOT NULL DEFAULT '{}',
    bytes       INTEGER NOT NULL,
    started_at  REAL NOT NULL,
    ended_at    REAL,
    expires_at  REAL,
    PRIMARY KEY (kind, id)
);
CREATE INDEX stored_tenant ON stored (tenant);
"""

#: user_version -> the script that brings the schema from the previous version to it.
_MIGRATIONS = {1: _SCHEMA_V1, 2: _SCHEMA_V2}


def _backfill_meters(db: sqlite3.Connection) -> None:
    """Version 2: replay every sandbox's transitions into cumulative meters (no CPU readings
    or owned bytes exist for them: used CPU counts as allocated, old pauses as 0 bytes)."""
    specs = {r[0]: json.loads(r[1] or "{}") for r in db.execute("SELECT id, spec FROM sandboxes")}
    prev: dict[str, MeterRow] = {}
    rows = list(db.execute("SELECT seq, sandbox_id, dst, at FROM transitions ORDER BY seq"))
    for seq, sandbox_id, dst, at in rows:
        spec = specs.get(sandbox_id, {})
        row = accrue(
            prev.get(sandbox_id),
            at,
            SandboxState(dst),
            vcpus=int(spec.get("vcpus", 1)),
            memory_mib=int(spec.get("memory_mib", 512)),
        )
        prev[sandbox_id] = row
        m = row.meters
        db.execute(
            "UPDATE transitions SET m_vcpu = ?, m_cpu = ?, m_ram = ?, m_paused = ? WHERE seq = ?",
            (m.vcpu_seconds, m.cpu_seconds, m.ram_gib_seconds, m.paused_byte_seconds, seq),
        )


#: user_version -> what runs after its script, in the same transaction (data, not schema).
_BACKFILLS = {2: _backfill_meters}


class Registry(SqlRegistry):
    """The SQLite registry of sandboxes. Thread-safe (one connection behind a lock).

    Every method raises :class:`StorageError` when SQLite fails; lookups raise
    :class:`SandboxNotFound`; a taken name raises :class:`Conflict`.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.RLock()
        self.generation = 0
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(
                str(self.path), timeout=30.0, isolation_level=None, check_same_thread=False
            )
            self._db.row_factory = sqlite3.Row
            self._db.execute("PRAGMA journal_mode=WAL")
            # FULL: a committed state change is on disk before we act on it (crash safety).
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._migrate()
        except (sqlite3.Error, OSError) as exc:
            raise StorageError(
                f"cannot open the registry {self.path}: {exc}", exc=exc, path=str(self.path)
            ) from exc

    # -- plumbing -------------------------------------------------------------------------

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One IMMEDIATE transaction; sqlite3 errors become StorageError (Conflict for a
        taken name)."""
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    yield self._db
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise
                self._db.execute("COMMIT")
            except sqlite3.IntegrityError as exc:
                raise Conflict(f"registry constraint failed: {exc}", exc=exc) from exc
            except sqlite3.Error as exc:
                raise StorageError(f"registry error: {exc}", exc=exc, path=str(self.path)) from exc

    def _query(self, sql: str, args: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        with self._lock:
            try:
                return list(self._db.execute(sql, args))
            except sqlite3.Error as exc:
                raise StorageError(f"registry error: {exc}", exc=exc, path=str(self.path)) from exc

    def _migrate(self) -> None:
        """Bring the schema to :data:`SCHEMA_VERSION`, a version per transaction. Another
        process opening the registry at the same time may migrate it first: each step reads
        the version again once it holds the write lock, and skips what is done. Raises
        StorageError for a schema newer than this torpor's, sqlite3.Error when one fails."""
        version = int(self._db.execute("PRAGMA user_version").fetchone()[0])
        if version > SCHEMA_VERSION:
            raise StorageError(
                f"registry {self.path} has schema version {version}, newer than this torpor "
                f"({SCHEMA_VERSION})",
                path=str(self.path),
            )
        for target in range(version + 1, SCHEMA_VERSION + 1):
            self._db.execute("BEGIN IMMEDIATE")
            try:
                if int(self._db.execute("PRAGMA user_version").fetchone()[0]) < target:
                    self._migrate_to(target)  # (else another process did meanwhile)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _migrate_to(self, target: int) -> None:
        """Version ``target``'s script and backfill, in the caller's transaction."""
        log.info("registry %s: migrating schema to version %d", self.path, target)
        for statement in _MIGRATIONS[target].split(";"):
            if statement.strip():
                self._db.execute(statement)
        if target in _BACKFILLS:
            _BACKFILLS[target](self._db)
        self._db.execute(f"PRAGMA user_version={target}")

    @property
    def schema_version(self) -> int:
        return int(self._query("PRAGMA user_version")[0][0])

    def close(self) -> None:
        """Close the connection (idempotent)."""
        with self._lock:
            try:
                self._db.close()
            except sqlite3.Error as exc:  # pragma: no cover - close rarely fails
                raise StorageError(f"registry close failed: {exc}", exc=exc) from exc

    # -- what differs from PostgreSQL ------------------------------------------------------

    def touch(self, sandbox_id: str, at: float | None = None) -> None:
        """Set ``last_active_at`` (the idle clock) to ``at`` (default: now).

        Written without an fsync (``synchronous=NORMAL``; WAL keeps it atomic and it survives
        a process crash): it runs twice per in-sandbox call, and after a power cut an idle
        clock a little behind only delays an idle pause.
        """
        with self._lock:
            try:
                self._db.execute("PRAGMA synchronous=NORMAL")
                with self._tx() as db:
                    db.execute(
                        "UPDATE sandboxes SET last_active_at = ? WHERE id = ?",
                        (time.time() if at is None else at, sandbox_id),
                    )
            finally:
                with suppress(sqlite3.Error):
                    self._db.execute("PRAGMA synchronous=FULL")

    def _meter_join(self, i: int) -> str:
        # a seek for the row's seq in the (sandbox_id, at) index, then the row by its key
        return (
            f" LEFT JOIN transitions b{i} ON b{i}.seq = CASE WHEN s.created_at >= ? THEN NULL"
            f" ELSE (SELECT seq FROM transitions WHERE sandbox_id = s.id AND at <= ?"
            f" ORDER BY at DESC, seq DESC LIMIT 1) END"
            f" LEFT JOIN transitions a{i} ON a{i}.seq = CASE WHEN s.created_at >= ? THEN NULL"
            f" ELSE (SELECT seq FROM transitions WHERE sandbox_id = s.id AND at > ?"
            f" ORDER BY at, seq LIMIT 1) END"
        )

    def last_seq(self) -> int:
        """The ``seq`` of the newest transition of the home (0 for none)."""
        return int(self._query("SELECT COALESCE(MAX(seq), 0) FROM transitions")[0][0])
