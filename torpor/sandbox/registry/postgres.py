"""The sandbox registry on PostgreSQL: the same interface as the SQLite
:class:`~torpor.sandbox.registry.Registry`, for many nodes sharing one registry.

Tables live in their own schema, ``torpor_registry`` (the memory store's is ``torpor``, so both
can share one database): ``sandboxes`` (one row per sandbox, the same columns as SQLite's),
``transitions`` (the append-only log) and ``schema_version``. A state change and its log entry
are one transaction, compare-and-set on the old state (``UPDATE ... WHERE state = old``), so
two nodes racing to move one sandbox cannot both win: the loser gets InvalidState. Names are
unique per tenant among sandboxes that are not stopped (a partial unique index).

Migrations are versioned (``schema_version``), each step in one transaction under an advisory
lock, so two nodes starting at once migrate once. A database newer than this torpor is refused.

A dropped connection (PostgreSQL restarted) is reopened on the next call; a call that fails
that way raises StorageError and may be retried. psycopg is imported only when this registry is
opened (the ``postgres`` extra).

**Nodes and leases** (schema v2, PostgreSQL only: one machine needs neither). Each node
heartbeats (:meth:`PostgresRegistry.heartbeat`: its accelerator, CPU model, capacity), which
also renews the leases of the sandboxes it owns. A node takes a sandbox before it runs it
(:meth:`PostgresRegistry.acquire`, compare-and-set: free, its own, or a lapsed lease) and gives
it back once it is paused (:meth:`PostgresRegistry.release`); another node asking gets Conflict
naming the owner (to proxy to). :meth:`PostgresRegistry.lapsed` lists the sandboxes whose
owner stopped heartbeating, for another node to recover.

**Snapshot manifests** (schema v3): :meth:`PostgresRegistry.put_snapshot` keeps the manifest a
:class:`~torpor.sandbox.storage.snapshots.SnapshotStore` writes, so every node sees every
snapshot, and :meth:`PostgresRegistry.referenced_chunks` is the mark set of a sweep of the
shared chunk store (:func:`~torpor.sandbox.storage.retention.sweep_shared_store`).

**Pause manifests** (schema v4, ``pauses``): which node holds a sandbox's latest pause
(:meth:`PostgresRegistry.note_pause`) and the latest pause stored off-node
(:meth:`PostgresRegistry.record_durable`; a failed upload says why:
:meth:`PostgresRegistry.record_upload_error`). A sandbox row read from here carries
``durable_at`` when its current pause is the durable one. :meth:`PostgresRegistry.recover`
takes a sandbox from an owner whose lease lapsed, in one compare-and-set transaction: back to
its last durable pause (what changed since is lost, and the transition says so), else to
``error``. The manager's use of all this: :mod:`torpor.sandbox.manager.cluster`.

**Durable snapshots** (schema v6): a snapshot row also says which node saved it and when all
its chunks were pushed to the shared store (``durable_at``; ``upload_error`` while a push
fails): :meth:`PostgresRegistry.record_snapshot_durable`,
:meth:`PostgresRegistry.undurable_snapshots` (what a node resumes pushing).

**Sweeps of the shared store** (schema v7): :meth:`PostgresRegistry.exclusive` (a session
advisory lock on a connection of its own) and the ``sweeps`` log say which node swept when
(:meth:`~torpor.sandbox.manager.cluster.ClusterNode.sweep_if_due`).

**Usage** (schema v8): the same cumulative meters on each transition row and the same ledger
of stored things as SQLite's schema 2 (:mod:`torpor.sandbox.registry.meters`), so a usage
report reads the same on both. Transitions recorded before v8 carry zero meters.

**Volumes and drives** (schema v9, ``volumes`` and ``drives``): their records (the JSON a
:class:`~torpor.sandbox.storage.records.RecordStore` writes) with the columns a query needs:
tenant, name (unique in the tenant), labels, the sandbox holding a volume, the node its data is
on, and for a volume the manifest of its latest image pushed to the shared store
(:meth:`PostgresRegistry.record_volume_image`). :meth:`PostgresRegistry.record_rows`,
:meth:`PostgresRegistry.save_record`, :meth:`PostgresRegistry.remove_record`,
:meth:`PostgresRegistry.locked` (a blocking advisory lock) are what
:class:`~torpor.sandbox.manager.cluster.RegistryRecords` runs on.
"""

from __future__ import annotations

import builtins
import json
import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from torpor.config import check_name
from torpor.errors import (
    Conflict,
    CorruptData,
    InvalidArgument,
    NotFound,
    SandboxNotFound,
    SnapshotNotFound,
    StorageError,
    VolumeNotFound,
)
from torpor.sandbox.models import SandboxEvent, SandboxState
from torpor.sandbox.registry.lifecycle import Transition, check_transition
from torpor.sandbox.registry.meters import (
    MeterRow,
    Meters,
    accrue,
    meter_row,
    meters_from_columns,
    stored_rows,
)
from torpor.sandbox.registry.sqlite import (
    _UNSET,
    EVENTS_SQL,
    SandboxRecord,
    _check_labels,
    _moved,
    _spec_json,
    _Unset,
    events_from_rows,
)

__all__ = [
    "PG_SCHEMA_VERSION",
    "ClaimFacts",
    "NodeInfo",
    "PauseRecord",
    "PostgresRegistry",
    "SnapshotStatus",
]

log = logging.getLogger(__name__)

PG_SCHEMA_VERSION = 9
_MIGRATION_LOCK = 0x70726567  # "preg": the advisory lock migrations take
#: what the manager's transitions carry for usage meters (schema v8)
_METER_COLUMNS = frozenset({"cpu_reading", "owned_bytes"})
#: the meter columns of a transition row, in :func:`~torpor.sandbox.registry.meters.meter_row`'s
#: order
_METERS = "dst, at, cpu_reading, owned_bytes, m_vcpu, m_cpu, m_ram, m_paused, cpu_ratio"

_BOOTSTRAP = """
CREATE SCHEMA IF NOT EXISTS torpor_registry;
CREATE TABLE IF NOT EXISTS torpor_registry.schema_version (
    version     INTEGER PRIMARY KEY,
    applied_at  TIMESTAMPTZ NOT NULL DEFAULT now()
);
"""

_SCHEMA_V1 = """
CREATE TABLE torpor_registry.sandboxes (
    id                   TEXT PRIMARY KEY,
    tenant               TEXT NOT NULL,
    name                 TEXT NOT NULL,
    template             TEXT NOT NULL,
    state                TEXT NOT NULL,
    labels               TEXT NOT NULL DEFAULT '{}',
    spec                 TEXT NOT NULL DEFAULT '{}',
    idle_pause_seconds   INTEGER,
    pause_retention_days INTEGER NOT NULL DEFAULT 30,
    created_at           DOUBLE PRECISION NOT NULL,
    last_active_at       DOUBLE PRECISION NOT NULL,
    paused_at            DOUBLE PRECISION,
    error                TEXT
);
CREATE UNIQUE INDEX sandboxes_live_name ON torpor_registry.sandboxes (tenant, name)
    WHERE state <> 'stopped';
CREATE INDEX sandboxes_state ON torpor_registry.sandboxes (state);
CREATE TABLE torpor_registry.transitions (
    seq        BIGSERIAL PRIMARY KEY,
    sandbox_id TEXT NOT NULL,
    src        TEXT,
    dst        TEXT NOT NULL,
    at         DOUBLE PRECISION NOT NULL,
    reason     TEXT NOT NULL DEFAULT ''
);
CREATE INDEX transitions_sandbox ON torpor_registry.transitions (sandbox_id, seq);
"""

# v2: nodes (heartbeat, capacity, accelerator, CPU model) and one owner node per sandbox that
# holds a machine, with a lease the owner renews by heartbeating
_SCHEMA_V2 = """
CREATE TABLE torpor_registry.nodes (
    id            TEXT PRIMARY KEY,
    url           TEXT NOT NULL DEFAULT '',
    accelerator   TEXT NOT NULL,
    cpu_model     TEXT NOT NULL,
    capacity_mib  INTEGER NOT NULL,
    started_at    DOUBLE PRECISION NOT NULL,
    heartbeat_at  DOUBLE PRECISION NOT NULL,
    draining      BOOLEAN NOT NULL DEFAULT false
);
ALTER TABLE torpor_registry.sandboxes ADD COLUMN owner_node TEXT;
ALTER TABLE torpor_registry.sandboxes ADD COLUMN lease_until DOUBLE PRECISION;
CREATE INDEX sandboxes_owner ON torpor_registry.sandboxes (owner_node);
"""

# v3: snapshot manifests (the body a SnapshotStore writes), so every node sees every snapshot
# and a sweep of the shared chunk store marks from all of them
_SCHEMA_V3 = """
CREATE TABLE torpor_registry.snapshots (
    id          TEXT PRIMARY KEY,
    tenant      TEXT NOT NULL,
    name        TEXT NOT NULL,
    node        TEXT,
    created_at  DOUBLE PRECISION NOT NULL,
    expires_at  DOUBLE PRECISION NOT NULL,
    manifest    TEXT NOT NULL
);
CREATE UNIQUE INDEX snapshots_name ON torpor_registry.snapshots (tenant, name);
"""

# v4: pause manifests. One row per sandbox: which node holds its latest pause's files
# (``pause_node``, ``pause_at``: the sandbox's ``paused_at`` then), and the latest pause made
# durable off-node (``manifest``, ``manifest_paused_at``, ``durable_at``); an upload that
# keeps failing says why in ``upload_error``.
_SCHEMA_V4 = """
CREATE TABLE torpor_registry.pauses (
    sandbox_id          TEXT PRIMARY KEY,
    pause_node          TEXT,
    pause_at            DOUBLE PRECISION,
    manifest            TEXT,
    manifest_paused_at  DOUBLE PRECISION,
    durable_at          DOUBLE PRECISION,
    upload_error        TEXT,
    attempts            INTEGER NOT NULL DEFAULT 0
);
"""

# v5: a node's vCPUs (its capacity beside its RAM; ``draining`` is in v2 already)
_SCHEMA_V5 = """
ALTER TABLE torpor_registry.nodes ADD COLUMN vcpus INTEGER NOT NULL DEFAULT 0;
"""

# v6: durable snapshots. A snapshot is saved into its node's chunks, then pushed to the
# shared store in the background: ``durable_at`` says when that was done, ``upload_error``
# why the last try failed (it is retried), ``attempts`` how many failed
_SCHEMA_V6 = """
ALTER TABLE torpor_registry.snapshots ADD COLUMN durable_at DOUBLE PRECISION;
ALTER TABLE torpor_registry.snapshots ADD COLUMN upload_error TEXT;
ALTER TABLE torpor_registry.snapshots ADD COLUMN attempts INTEGER NOT NULL DEFAULT 0;
CREATE INDEX snapshots_undurable ON torpor_registry.snapshots (node) WHERE durable_at IS NULL;
"""

# v7: sweeps of the shared chunk store (one node at a time, under an advisory lock): when
# each ran, on which node, and what it did; the next is due a period after the last
_SCHEMA_V7 = """
CREATE TABLE torpor_registry.sweeps (
    seq          BIGSERIAL PRIMARY KEY,
    node         TEXT NOT NULL,
    started_at   DOUBLE PRECISION NOT NULL,
    finished_at  DOUBLE PRECISION NOT NULL,
    removed      INTEGER NOT NULL,
    kept         INTEGER NOT NULL,
    freed_bytes  BIGINT NOT NULL
);
"""

# v8: usage, as SQLite's schema version 2 keeps it (see torpor.sandbox.registry.meters): the
# cumulative meters on each transition row, and the ledger of stored things (snapshots,
# volumes). Transitions recorded before v8 carry zero meters (no backfill: a cluster's usage
# counts from its upgrade)
_SCHEMA_V8 = """
ALTER TABLE torpor_registry.transitions ADD COLUMN cpu_reading DOUBLE PRECISION;
ALTER TABLE torpor_registry.transitions ADD COLUMN owned_bytes BIGINT;
ALTER TABLE torpor_registry.transitions ADD COLUMN m_vcpu DOUBLE PRECISION NOT NULL DEFAULT 0;
ALTER TABLE torpor_registry.transitions ADD COLUMN m_cpu DOUBLE PRECISION NOT NULL DEFAULT 0;
ALTER TABLE torpor_registry.transitions ADD COLUMN m_ram DOUBLE PRECISION NOT NULL DEFAULT 0;
ALTER TABLE torpor_registry.transitions ADD COLUMN m_paused DOUBLE PRECISION NOT NULL DEFAULT 0;
ALTER TABLE torpor_registry.transitions ADD COLUMN cpu_ratio DOUBLE PRECISION;
CREATE INDEX transitions_at ON torpor_registry.transitions (sandbox_id, at);
CREATE TABLE torpor_registry.stored (
    kind        TEXT NOT NULL,
    id          TEXT NOT NULL,
    tenant      TEXT NOT NULL,
    name        TEXT NOT NULL,
    labels      TEXT NOT NULL DEFAULT '{}',
    bytes       BIGINT NOT NULL,
    started_at  DOUBLE PRECISION NOT NULL,
    ended_at    DOUBLE PRECISION,
    expires_at  DOUBLE PRECISION,
    PRIMARY KEY (kind, id)
);
CREATE INDEX stored_tenant ON torpor_registry.stored (tenant);
"""

# v9: volumes and drives, shared by every node (see the module docstring): ``node`` is where
# the data is (a volume's latest image, a drive's directory), ``holder`` the sandbox a volume
# is attached to (read-write, else the first reader); ``image`` the manifest of a volume's
# latest image in the shared store and ``image_at`` when it was pushed
_SCHEMA_V9 = """
CREATE TABLE torpor_registry.volumes (
    id          TEXT PRIMARY KEY,
    tenant      TEXT NOT NULL,
    name        TEXT NOT NULL,
    size_mib    INTEGER NOT NULL,
    labels      TEXT NOT NULL DEFAULT '{}',
    holder      TEXT,
    node        TEXT,
    record      TEXT NOT NULL,
    written_at  DOUBLE PRECISION NOT NULL,
    image       TEXT,
    image_at    DOUBLE PRECISION
);
CREATE UNIQUE INDEX volumes_name ON torpor_registry.volumes (tenant, name);
CREATE TABLE torpor_registry.drives (
    id          TEXT PRIMARY KEY,
    tenant      TEXT NOT NULL,
    name        TEXT NOT NULL,
    labels      TEXT NOT NULL DEFAULT '{}',
    node        TEXT,
    record      TEXT NOT NULL,
    written_at  DOUBLE PRECISION NOT NULL
);
CREATE UNIQUE INDEX drives_name ON torpor_registry.drives (tenant, name);
"""

#: the tables of the shared records (volumes, drives) by kind
_RECORD_TABLES = {"volume": "torpor_registry.volumes", "drive": "torpor_registry.drives"}

#: version -> the script that brings the schema from the previous version to it
_MIGRATIONS = {
    1: _SCHEMA_V1,
    2: _SCHEMA_V2,
    3: _SCHEMA_V3,
    4: _SCHEMA_V4,
    5: _SCHEMA_V5,
    6: _SCHEMA_V6,
    7: _SCHEMA_V7,
    8: _SCHEMA_V8,
    9: _SCHEMA_V9,
}

_COLUMNS = (
    "id, tenant, name, template, state, labels, spec, idle_pause_seconds, "
    "pause_retention_days, created_at, last_active_at, paused_at, error"
)
#: a sandbox row with what its pause manifest says (see :func:`_row_to_record`)
_SELECT = (
    "SELECT "
    + ", ".join(f"s.{c.strip()}" for c in _COLUMNS.split(","))
    + ", p.durable_at, p.manifest_paused_at, p.upload_error FROM torpor_registry.sandboxes s"
    " LEFT JOIN torpor_registry.pauses p ON p.sandbox_id = s.id"
)


@dataclass(frozen=True)
class NodeInfo:
    """One node of a cluster as the registry knows it."""

    id: str
    accelerator: str  # "kvm" or "tcg": a snapshot wakes only where it was taken's kind is
    cpu_model: str
    capacity_mib: int  # guest RAM it may run
    url: str = ""
    started_at: float = 0.0
    heartbeat_at: float = 0.0
    draining: bool = False  # it takes no new sandbox (``torpor node drain``)
    vcpus: int = 0

    def alive(self, now: float, stale_after: float) -> bool:
        """Whether the node heartbeat within ``stale_after`` seconds of ``now``."""
        return now - self.heartbeat_at <= stale_after


def _row_to_record(row: tuple[Any, ...]) -> SandboxRecord:
    (
        id_,
        tenant,
        name,
        template,
        state,
        labels,
        spec_text,
        idle,
        retention,
        created,
        active,
        paused,
        error,
        durable_at,
        manifest_paused_at,
        upload_error,
    ) = row
    spec = json.loads(spec_text or "{}")
    # durable: the current pause is the one stored off-node (a later pause, or a wake, is not)
    durable = state == SandboxState.PAUSED.value and paused == manifest_paused_at
    return SandboxRecord(
        id=id_,
        tenant=tenant,
        name=name,
        template=template,
        state=SandboxState(state),
        labels=json.loads(labels or "{}"),
        vcpus=int(spec.get("vcpus", 1)),
        memory_mib=int(spec.get("memory_mib", 512)),
        envs=dict(spec.get("envs") or {}),
        idle_pause_seconds=idle,
        pause_retention_days=retention,
        created_at=created,
        last_active_at=active,
        paused_at=paused,
        error=error,
        memory_scope=spec.get("memory_scope"),
        durable_at=durable_at if durable and paused is not None else None,
        upload_error=upload_error if state == SandboxState.PAUSED.value else None,
    )


@dataclass(frozen=True)
class SnapshotStatus:
    """Where a recorded snapshot was saved and whether it is in the shared store yet."""

    node: str | None
    durable_at: float | None
    upload_error: str | None
    attempts: int


@dataclass(frozen=True)
class PauseRecord:
    """What the registry knows of a sandbox's pauses (schema v4): where the latest one's
    files are, and the latest one stored off-node."""

    sandbox_id: str
    node: str | None  # the node holding the latest pause's files (None: no node's)
    paused_at: float | None  # that pause (the sandbox's ``paused_at`` then)
    manifest: dict[str, Any] | None  # the latest durable pause
    manifest_paused_at: float | None
    durable_at: float | None
    upload_error: str | None
    attempts: int


@dataclass(frozen=True)
class ClaimFacts:
    """What a node needs to take a sandbox without a detour, read in one round trip
    (:meth:`PostgresRegistry.claim_facts`): its row's state and owner, whether a drive
    attached pins it to another node, its pause record's where and when (the manifest's
    ``origin`` only), and what the asking node holds running."""

    state: SandboxState
    paused_at: float | None
    memory_mib: int
    owner_node: str | None
    lease_until: float | None
    pinned_elsewhere: bool
    pause_node: str | None
    pause_at: float | None
    manifest_paused_at: float | None
    origin: dict[str, Any] | None
    node_sandboxes: int
    node_memory_mib: int


class PostgresRegistry:
    """The registry of sandboxes in PostgreSQL at ``dsn``; see the module docstring.
    Thread-safe (one connection behind a lock, reopened when it drops).

    Every method raises :class:`StorageError` when PostgreSQL fails; lookups raise
    :class:`SandboxNotFound`; a taken name raises :class:`Conflict`.
    """

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
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
            conn.execute(_BOOTSTRAP.encode())
        version = self.schema_version
        if version > PG_SCHEMA_VERSION:
            raise StorageError(
                f"the registry database has schema version {version}, newer than this torpor "
                f"({PG_SCHEMA_VERSION})"
            )
        while version < target:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
                version = self.schema_version  # another node may have migrated meanwhile
                if version >= target:
                    break
                conn.execute(_MIGRATIONS[version + 1].encode())
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

    # -- writes ---------------------------------------------------------------------------

    def insert(self, rec: SandboxRecord, *, reason: str = "create") -> None:
        """Add a sandbox and log its first state. Raises InvalidName, InvalidArgument,
        Conflict (name taken by a live sandbox of the tenant) or StorageError."""
        self.insert_many([rec], reason=reason)

    def insert_many(self, recs: Sequence[SandboxRecord], *, reason: str = "create") -> None:
        """Add sandboxes and log their first states, all in one transaction (a fork's
        children: one commit, so one sync, for all): all or none. Raises as :meth:`insert`
        (Conflict names the first name taken, by a live sandbox or earlier in ``recs``)."""
        rows = []
        for rec in recs:
            check_name(rec.name, "sandbox name")
            labels = _check_labels(rec.labels)
            spec = _spec_json(rec.vcpus, rec.memory_mib, rec.envs, rec.memory_scope)
            rows.append((rec, labels, spec))
        taken = recs[0] if recs else None  # the row being written: a Conflict is its name's
        try:
            with self._tx() as db:
                for rec, labels, spec in rows:
                    taken = rec
                    db.execute(
                        f"INSERT INTO torpor_registry.sandboxes ({_COLUMNS}) VALUES "
                        "(%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s)",
                        (
                            rec.id,
                            rec.tenant,
                            rec.name,
                            rec.template,
                            rec.state.value,
                            json.dumps(labels, sort_keys=True),
                            spec,
                            rec.idle_pause_seconds,
                            rec.pause_retention_days,
                            rec.created_at,
                            rec.last_active_at,
                            rec.paused_at,
                            rec.error,
                        ),
                    )
                    db.execute(
                        "INSERT INTO torpor_registry.transitions (sandbox_id, src, dst, at, reason)"
                        " VALUES (%s,%s,%s,%s,%s)",
                        (rec.id, None, rec.state.value, rec.created_at, reason),
                    )
            self.generation += 1
        except Conflict as exc:
            assert taken is not None
            raise Conflict(
                f"a sandbox named {taken.name!r} already exists",
                exc=exc.exc,
                name=taken.name,
                tenant=taken.tenant,
            ) from exc

    def set_state(
        self,
        sandbox_id: str,
        src: SandboxState,
        dst: SandboxState,
        *,
        reason: str = "",
        at: float | None = None,
        **columns: Any,
    ) -> Transition:
        """Move ``sandbox_id`` from ``src`` to ``dst`` (compare-and-set) and log it; ``columns``
        (``paused_at``, ``error``, ``last_active_at``) are updated in the same transaction.

        Raises InvalidState/SandboxClosed for an illegal move or when the row is no longer in
        ``src`` (another node moved it), SandboxNotFound, or StorageError.
        """
        check_transition(sandbox_id, src, dst)
        readings = {k: columns.pop(k) for k in _METER_COLUMNS if k in columns}
        allowed = {"paused_at", "error", "last_active_at"}
        if not set(columns) <= allowed:
            raise InvalidArgument(f"cannot set {sorted(set(columns) - allowed)}")
        when = time.time() if at is None else at
        sets = ", ".join(["state = %s"] + [f"{c} = %s" for c in columns])  # names from above
        with self._tx() as db:
            cur = db.execute(
                f"UPDATE torpor_registry.sandboxes SET {sets} WHERE id = %s AND state = %s",
                (dst.value, *columns.values(), sandbox_id, src.value),
            )
            if cur.rowcount != 1:
                row = db.execute(
                    "SELECT state FROM torpor_registry.sandboxes WHERE id = %s", (sandbox_id,)
                ).fetchone()
                if row is None:
                    raise SandboxNotFound(
                        f"no sandbox {sandbox_id}", kind="sandbox", name=sandbox_id
                    )
                check_transition(sandbox_id, SandboxState(row[0]), dst)
                raise _moved(sandbox_id, SandboxState(row[0]), src)
            _log_transition(db, sandbox_id, src, dst, when, reason, **readings)
        self.generation += 1
        return Transition(sandbox_id, src, dst, when, reason)

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

    def update_settings(
        self,
        sandbox_id: str,
        *,
        labels: Mapping[str, str] | None = None,
        idle_pause_seconds: int | _Unset | None = _UNSET,
        pause_retention_days: int | None = None,
        envs: Mapping[str, str] | None = None,
    ) -> None:
        """Change what may change of a live sandbox: its labels (replaced), idle pause (None:
        never), pause retention and environment variables (replaced); what is not given
        stays. Raises InvalidArgument or StorageError."""
        columns: dict[str, Any] = {}
        if envs is not None:
            rec = self.get(sandbox_id)
            columns["spec"] = _spec_json(rec.vcpus, rec.memory_mib, envs, rec.memory_scope)
        if labels is not None:
            columns["labels"] = json.dumps(_check_labels(labels), sort_keys=True)
        if not isinstance(idle_pause_seconds, _Unset):
            columns["idle_pause_seconds"] = idle_pause_seconds
        if pause_retention_days is not None:
            columns["pause_retention_days"] = pause_retention_days
        if not columns:
            return
        assignments = ", ".join(f"{column} = %s" for column in columns)  # names from this code
        with self._tx() as db:
            db.execute(
                f"UPDATE torpor_registry.sandboxes SET {assignments} WHERE id = %s",
                (*columns.values(), sandbox_id),
            )

    # -- reads ----------------------------------------------------------------------------

    def get(self, sandbox_id: str) -> SandboxRecord:
        """The row of ``sandbox_id``. Raises SandboxNotFound."""
        rows = self._query(f"{_SELECT} WHERE s.id = %s", (sandbox_id,))
        if not rows:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r}", kind="sandbox", name=sandbox_id)
        return _row_to_record(rows[0])

    def find(self, tenant: str, id_or_name: str) -> SandboxRecord:
        """A tenant's sandbox by id, else by name (the live one, else the latest killed one).
        Raises SandboxNotFound (also for another tenant's id)."""
        rows = self._query(
            f"{_SELECT} WHERE s.tenant = %s AND (s.id = %s OR s.name = %s)"
            " ORDER BY (s.id = %s) DESC, (s.state <> 'stopped') DESC, s.created_at DESC LIMIT 1",
            (tenant, id_or_name, id_or_name, id_or_name),
        )
        if not rows:
            raise SandboxNotFound(f"no sandbox {id_or_name!r}", kind="sandbox", name=id_or_name)
        return _row_to_record(rows[0])

    def live_by_name(self, tenant: str, name: str) -> SandboxRecord | None:
        """The tenant's sandbox called ``name`` that is not stopped, or None."""
        rows = self._query(
            f"{_SELECT} WHERE s.tenant = %s AND s.name = %s AND s.state <> 'stopped'",
            (tenant, name),
        )
        return _row_to_record(rows[0]) if rows else None

    def list(
        self,
        *,
        tenant: str | None = None,
        labels: Mapping[str, str] | None = None,
        states: set[SandboxState] | None = None,
    ) -> builtins.list[SandboxRecord]:
        """Sandboxes, oldest first, filtered by tenant, states and labels (all must match)."""
        sql = f"{_SELECT} WHERE true"
        args: builtins.list[Any] = []
        if tenant is not None:
            sql += " AND s.tenant = %s"
            args.append(tenant)
        if states is not None:
            sql += " AND s.state = ANY(%s)"
            args.append([st.value for st in states])
        rows = [
            _row_to_record(r)
            for r in self._query(sql + " ORDER BY s.created_at, s.id", tuple(args))
        ]
        # labels matched in Python, exactly as the SQLite registry does
        wanted = dict(labels or {})
        return [r for r in rows if all(r.labels.get(k) == v for k, v in wanted.items())]

    def transitions(self, sandbox_id: str) -> builtins.list[Transition]:
        """Every recorded transition of a sandbox, in order."""
        rows = self._query(
            "SELECT sandbox_id, src, dst, at, reason FROM torpor_registry.transitions"
            " WHERE sandbox_id = %s ORDER BY seq",
            (sandbox_id,),
        )
        return [
            Transition(sid, SandboxState(src) if src else None, SandboxState(dst), at, reason)
            for sid, src, dst, at, reason in rows
        ]

    def events(
        self,
        tenant: str,
        *,
        after: int = 0,
        sandbox: str | None = None,
        limit: int = 500,
    ) -> tuple[builtins.list[SandboxEvent], int]:
        """The tenant's lifecycle events after ``after`` and the ``seq`` to continue from (as
        the SQLite registry's :meth:`~torpor.sandbox.registry.Registry.events`)."""
        by_sandbox = "" if sandbox is None else " AND t.sandbox_id = %s"
        sql = EVENTS_SQL.format(prefix="torpor_registry.", p="%s", by_sandbox=by_sandbox)
        args = (tenant, after) + (() if sandbox is None else (sandbox,)) + (limit,)
        return events_from_rows(self._query(sql, args), after)

    # -- nodes and leases (schema v2) -----------------------------------------------------

    def heartbeat(self, node: NodeInfo, *, lease_seconds: float, at: float | None = None) -> None:
        """Record that ``node`` is alive (registering it the first time) and renew the leases
        of every sandbox it owns to ``at + lease_seconds``. Raises InvalidArgument for a bad
        node, StorageError."""
        check_name(node.id, "node name")
        if node.capacity_mib < 0 or lease_seconds <= 0:
            raise InvalidArgument("capacity must be >= 0 and the lease > 0")
        now = time.time() if at is None else at
        with self._tx() as db:
            db.execute(
                "INSERT INTO torpor_registry.nodes (id, url, accelerator, cpu_model,"
                " capacity_mib, started_at, heartbeat_at, draining, vcpus)"
                " VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s) ON CONFLICT (id) DO UPDATE SET"
                " url = excluded.url, accelerator = excluded.accelerator,"
                " cpu_model = excluded.cpu_model, capacity_mib = excluded.capacity_mib,"
                " heartbeat_at = excluded.heartbeat_at, draining = excluded.draining,"
                " vcpus = excluded.vcpus",
                (
                    node.id,
                    node.url,
                    node.accelerator,
                    node.cpu_model,
                    node.capacity_mib,
                    node.started_at or now,
                    now,
                    node.draining,
                    node.vcpus,
                ),
            )
            db.execute(
                "UPDATE torpor_registry.sandboxes SET lease_until = %s WHERE owner_node = %s",
                (now + lease_seconds, node.id),
            )

    def nodes(self) -> builtins.list[NodeInfo]:
        """Every node that ever heartbeat, by name."""
        rows = self._query(
            "SELECT id, accelerator, cpu_model, capacity_mib, url, started_at, heartbeat_at,"
            " draining, vcpus FROM torpor_registry.nodes ORDER BY id"
        )
        return [NodeInfo(*row) for row in rows]

    def loads(self, *, at: float | None = None) -> dict[str, tuple[int, int]]:
        """node -> (sandboxes it runs, their RAM in MiB): the running or starting sandboxes
        each node holds with a lease still running. Raises StorageError."""
        now = time.time() if at is None else at
        rows = self._query(
            "SELECT owner_node, count(*),"
            " coalesce(sum(coalesce((spec::json->>'memory_mib')::int, 512)), 0)"
            " FROM torpor_registry.sandboxes WHERE owner_node IS NOT NULL"
            " AND lease_until >= %s AND state IN ('running', 'creating') GROUP BY owner_node",
            (now,),
        )
        return {str(node): (int(count), int(mib)) for node, count, mib in rows}

    def acquire(
        self, sandbox_id: str, node_id: str, *, lease_seconds: float, at: float | None = None
    ) -> None:
        """Make ``node_id`` the owner of ``sandbox_id`` until ``at + lease_seconds``: when it
        has no owner, is this node's already, or its owner's lease lapsed (compare-and-set, so
        of two nodes racing exactly one gets it). Raises Conflict naming the owner
        (``owner_node``) otherwise, SandboxNotFound, StorageError."""
        now = time.time() if at is None else at
        with self._tx() as db:
            cur = db.execute(
                "UPDATE torpor_registry.sandboxes SET owner_node = %s, lease_until = %s"
                " WHERE id = %s AND (owner_node IS NULL OR owner_node = %s OR lease_until < %s)",
                (node_id, now + lease_seconds, sandbox_id, node_id, now),
            )
            if cur.rowcount == 1:
                return
            row = db.execute(
                "SELECT owner_node, lease_until FROM torpor_registry.sandboxes WHERE id = %s",
                (sandbox_id,),
            ).fetchone()
        if row is None:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r}", kind="sandbox", name=sandbox_id)
        raise Conflict(
            f"sandbox {sandbox_id} is held by node {row[0]} (lease until {row[1]:.0f})",
            sandbox_id=sandbox_id,
            owner_node=row[0],
            lease_until=row[1],
        )

    def claim_facts(self, sandbox_id: str, node_id: str, *, at: float | None = None) -> ClaimFacts:
        """Everything :meth:`~torpor.sandbox.manager.cluster.ClusterNode.acquire` reads to
        take ``sandbox_id`` for ``node_id`` in the common case, in one query (see
        :class:`ClaimFacts`). Raises SandboxNotFound, StorageError."""
        now = time.time() if at is None else at
        rows = self._query(
            "SELECT s.state, s.paused_at, coalesce((s.spec::json->>'memory_mib')::int, 512),"
            " s.owner_node, s.lease_until,"
            " EXISTS (SELECT 1 FROM torpor_registry.drives d WHERE d.node IS NOT NULL"
            " AND d.node <> %s AND d.record::jsonb -> 'attachments' @> jsonb_build_array("
            "jsonb_build_object('sandbox_id', s.id))),"
            " p.pause_node, p.pause_at, p.manifest_paused_at,"
            " CASE WHEN p.manifest IS NULL THEN NULL ELSE (p.manifest::json->'origin')::text END,"
            " l.n, l.mib"
            " FROM torpor_registry.sandboxes s"
            " LEFT JOIN torpor_registry.pauses p ON p.sandbox_id = s.id"
            " CROSS JOIN (SELECT count(*) AS n,"
            " coalesce(sum(coalesce((spec::json->>'memory_mib')::int, 512)), 0) AS mib"
            " FROM torpor_registry.sandboxes WHERE owner_node = %s AND lease_until >= %s"
            " AND state IN ('running', 'creating')) l"
            " WHERE s.id = %s",
            (node_id, node_id, now, sandbox_id),
        )
        if not rows:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r}", kind="sandbox", name=sandbox_id)
        r = rows[0]
        try:
            origin = None if r[9] is None else json.loads(r[9])
        except ValueError:
            origin = None
        return ClaimFacts(
            state=SandboxState(r[0]),
            paused_at=r[1],
            memory_mib=int(r[2]),
            owner_node=r[3],
            lease_until=r[4],
            pinned_elsewhere=bool(r[5]),
            pause_node=r[6],
            pause_at=r[7],
            manifest_paused_at=r[8],
            origin=origin if isinstance(origin, dict) else None,
            node_sandboxes=int(r[10]),
            node_memory_mib=int(r[11]),
        )

    def claim(
        self, sandbox_id: str, node_id: str, *, lease_seconds: float, at: float | None = None
    ) -> bool:
        """Make ``node_id`` the owner of ``sandbox_id`` until ``at + lease_seconds`` when no
        node holds it or ``node_id`` does (one statement); False otherwise (another node
        holds it, or held it and lapsed: :meth:`recover` and :meth:`acquire` are for
        that). Raises StorageError."""
        now = time.time() if at is None else at
        with self._lock:
            import psycopg

            try:
                cur = self._connection().execute(
                    b"UPDATE torpor_registry.sandboxes SET owner_node = %s, lease_until = %s"
                    b" WHERE id = %s AND (owner_node IS NULL OR owner_node = %s)",
                    (node_id, now + lease_seconds, sandbox_id, node_id),
                )
            except psycopg.Error as exc:
                raise StorageError(f"registry error: {exc}", exc=exc) from exc
            return bool(cur.rowcount == 1)

    def pause_location(self, sandbox_id: str) -> tuple[str | None, float | None] | None:
        """The node holding the files of the sandbox's latest pause and that pause's time
        (None: it was never paused in cluster mode): :meth:`pause_record` without the
        manifest. Raises StorageError."""
        rows = self._query(
            "SELECT pause_node, pause_at FROM torpor_registry.pauses WHERE sandbox_id = %s",
            (sandbox_id,),
        )
        return None if not rows else (rows[0][0], rows[0][1])

    def release(self, sandbox_id: str, node_id: str) -> bool:
        """Give ``sandbox_id`` up (after its pause is durable). True when ``node_id`` held it;
        False when it did not (another node took it over: nothing to give). Raises
        StorageError."""
        with self._tx() as db:
            cur = db.execute(
                "UPDATE torpor_registry.sandboxes SET owner_node = NULL, lease_until = NULL"
                " WHERE id = %s AND owner_node = %s",
                (sandbox_id, node_id),
            )
            return bool(cur.rowcount == 1)

    def owner(self, sandbox_id: str, *, at: float | None = None) -> str | None:
        """The node holding ``sandbox_id`` with a lease still running, or None. Raises
        SandboxNotFound, StorageError."""
        now = time.time() if at is None else at
        rows = self._query(
            "SELECT owner_node, lease_until FROM torpor_registry.sandboxes WHERE id = %s",
            (sandbox_id,),
        )
        if not rows:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r}", kind="sandbox", name=sandbox_id)
        owner, until = rows[0]
        return str(owner) if owner is not None and until is not None and until >= now else None

    def lapsed(self, *, at: float | None = None) -> builtins.list[SandboxRecord]:
        """Sandboxes whose owner's lease ran out (the owner stopped heartbeating): another
        node must recover them. Raises StorageError."""
        now = time.time() if at is None else at
        rows = self._query(
            f"{_SELECT} WHERE s.owner_node IS NOT NULL AND s.lease_until < %s"
            " ORDER BY s.created_at, s.id",
            (now,),
        )
        return [_row_to_record(r) for r in rows]

    def node(self, node_id: str) -> NodeInfo:
        """One node. Raises NotFound, StorageError."""
        for n in self.nodes():
            if n.id == node_id:
                return n
        raise NotFound(f"no node {node_id!r}", kind="node", name=node_id)

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
        from torpor.sandbox.storage.chunks import FileManifest

        refs: set[str] = set()
        for sid, text in self._query("SELECT id, manifest FROM torpor_registry.snapshots"):
            try:
                for fm in json.loads(text)["files"].values():
                    refs |= FileManifest.from_json(fm).hashes()
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise CorruptData(
                    f"snapshot {sid}: its manifest in the registry is unreadable ({exc})",
                    snapshot_id=sid,
                ) from exc
        for sid, text in self._query(
            "SELECT sandbox_id, manifest FROM torpor_registry.pauses WHERE manifest IS NOT NULL"
        ):
            try:
                body = json.loads(text)
                for fm in [*body["files"].values(), *(body.get("volumes") or {}).values()]:
                    refs |= FileManifest.from_json(fm).hashes()
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise CorruptData(
                    f"sandbox {sid}: its pause manifest in the registry is unreadable ({exc})",
                    sandbox_id=sid,
                ) from exc
        for vid, text in self._query(
            "SELECT id, image FROM torpor_registry.volumes WHERE image IS NOT NULL"
        ):
            try:
                refs |= FileManifest.from_json(json.loads(text)).hashes()
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise CorruptData(
                    f"volume {vid}: its image manifest in the registry is unreadable ({exc})",
                    volume_id=vid,
                ) from exc
        return refs

    # -- sweeps of the shared store (schema v7) ---------------------------------------------

    @contextmanager
    def exclusive(self, key: int) -> Iterator[bool]:
        """Try to take the session advisory lock ``key`` on a connection of its own, held for
        the block: yields whether this caller got it (another holder: False, at once). The
        lock goes with the connection, so a node that dies mid-block lets go of it. Raises
        StorageError."""
        import psycopg

        try:
            conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=10)
        except psycopg.Error as exc:
            raise StorageError(f"cannot connect to the registry database: {exc}", exc=exc) from exc
        try:
            row = conn.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()
            yield bool(row and row[0])
        except psycopg.Error as exc:
            raise StorageError(f"registry error: {exc}", exc=exc) from exc
        finally:
            conn.close()  # the lock, if held, goes with the session

    @contextmanager
    def locked(self, key: int) -> Iterator[None]:
        """Hold the session advisory lock ``key`` for the block, waiting for it, on a
        connection of its own (a node that dies mid-block lets go of it). Raises
        StorageError."""
        import psycopg

        try:
            conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=10)
        except psycopg.Error as exc:
            raise StorageError(f"cannot connect to the registry database: {exc}", exc=exc) from exc
        try:
            try:
                conn.execute("SELECT pg_advisory_lock(%s)", (key,))
            except psycopg.Error as exc:
                raise StorageError(f"registry error: {exc}", exc=exc) from exc
            yield
        finally:
            conn.close()  # the lock goes with the session

    # -- volumes and drives (schema v9) -----------------------------------------------------

    def record_rows(self, kind: str) -> builtins.list[dict[str, Any]]:
        """Every record of ``kind`` ("volume", "drive"). Raises StorageError."""
        rows = self._query(f"SELECT id, record FROM {_RECORD_TABLES[kind]} ORDER BY id")
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
            cur = db.execute(f"DELETE FROM {_RECORD_TABLES[kind]} WHERE id = %s", (rid,))
            return bool(cur.rowcount)

    def record_written_at(self, kind: str, rid: str) -> float | None:
        """When a volume's or drive's record was last written. Raises StorageError."""
        rows = self._query(f"SELECT written_at FROM {_RECORD_TABLES[kind]} WHERE id = %s", (rid,))
        return float(rows[0][0]) if rows else None

    def record_volume_image(self, volume_id: str, node: str, manifest: dict[str, Any]) -> None:
        """Record that ``volume_id``'s latest image is on ``node`` and, as ``manifest``, in
        the shared store. Raises VolumeNotFound, StorageError."""
        with self._tx() as db:
            rows = db.execute(
                "SELECT record FROM torpor_registry.volumes WHERE id = %s FOR UPDATE",
                (volume_id,),
            ).fetchall()
            if not rows:
                raise VolumeNotFound(
                    f"volume {volume_id!r} not found", kind="volume", name=volume_id
                )
            data = json.loads(rows[0][0])
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
            rows = db.execute(
                "SELECT record FROM torpor_registry.volumes WHERE id = %s FOR UPDATE",
                (volume_id,),
            ).fetchall()
            if not rows:
                return
            data = json.loads(rows[0][0])
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

    # -- pause manifests (schema v4) ------------------------------------------------------

    def note_pause(self, sandbox_id: str, node: str, paused_at: float) -> None:
        """Record that ``node`` holds the files of the pause taken at ``paused_at`` (not yet
        durable: :meth:`record_durable` follows once the upload is done). Raises
        StorageError."""
        with self._tx() as db:
            db.execute(
                "INSERT INTO torpor_registry.pauses (sandbox_id, pause_node, pause_at)"
                " VALUES (%s,%s,%s) ON CONFLICT (sandbox_id) DO UPDATE SET"
                " pause_node = excluded.pause_node, pause_at = excluded.pause_at,"
                " upload_error = NULL, attempts = 0",
                (sandbox_id, node, paused_at),
            )

    def record_durable(
        self, sandbox_id: str, node: str, paused_at: float, manifest: Mapping[str, Any]
    ) -> float:
        """Record that the pause ``node`` took at ``paused_at`` is stored off-node, as
        ``manifest`` says, and in the same transaction give the sandbox up if ``node`` holds
        it and it is still in that pause (any node may wake it from now on: no moment in
        which it is durable yet held); return when (now). Raises StorageError."""
        now = time.time()
        with self._tx() as db:
            db.execute(
                "INSERT INTO torpor_registry.pauses (sandbox_id, pause_node, pause_at, manifest,"
                " manifest_paused_at, durable_at) VALUES (%s,%s,%s,%s,%s,%s)"
                " ON CONFLICT (sandbox_id) DO UPDATE SET pause_node = excluded.pause_node,"
                " pause_at = excluded.pause_at, manifest = excluded.manifest,"
                " manifest_paused_at = excluded.manifest_paused_at,"
                " durable_at = excluded.durable_at, upload_error = NULL",
                (
                    sandbox_id,
                    node,
                    paused_at,
                    json.dumps(dict(manifest), sort_keys=True),
                    paused_at,
                    now,
                ),
            )
            db.execute(
                "UPDATE torpor_registry.sandboxes SET owner_node = NULL, lease_until = NULL"
                " WHERE id = %s AND owner_node = %s AND state = 'paused' AND paused_at = %s",
                (sandbox_id, node, paused_at),
            )
        return now

    def record_upload_error(self, sandbox_id: str, error: str) -> None:
        """Say why the current pause's upload failed (it is retried). Raises StorageError."""
        with self._tx() as db:
            db.execute(
                "INSERT INTO torpor_registry.pauses (sandbox_id, upload_error, attempts)"
                " VALUES (%s,%s,1) ON CONFLICT (sandbox_id) DO UPDATE SET"
                " upload_error = excluded.upload_error, attempts = pauses.attempts + 1",
                (sandbox_id, error[:2000]),
            )

    def pause_record(self, sandbox_id: str) -> PauseRecord | None:
        """The sandbox's pause record, or None when it was never paused in cluster mode.
        Raises CorruptData for a manifest that does not parse, StorageError."""
        rows = self._query(
            "SELECT pause_node, pause_at, manifest, manifest_paused_at, durable_at,"
            " upload_error, attempts FROM torpor_registry.pauses WHERE sandbox_id = %s",
            (sandbox_id,),
        )
        if not rows:
            return None
        node, at, text, mat, durable, error, attempts = rows[0]
        try:
            manifest = None if text is None else dict(json.loads(text))
        except (TypeError, ValueError) as exc:
            raise CorruptData(
                f"sandbox {sandbox_id}: its pause manifest in the registry is unreadable ({exc})",
                sandbox_id=sandbox_id,
            ) from exc
        return PauseRecord(sandbox_id, node, at, manifest, mat, durable, error, attempts)

    def recover(self, sandbox_id: str, node: str, *, at: float | None = None) -> Transition | None:
        """Take over ``sandbox_id`` from an owner whose lease lapsed (it stopped
        heartbeating: its machine and local files count as gone), on behalf of ``node``.

        One transaction, compare-and-set on the lapsed lease, so of many nodes recovering at
        once exactly one does it (the others get None). A sandbox with a drive attached is
        never taken (a drive is a directory of its node: the sandbox waits for that node,
        nothing of it is lost; None). A sandbox with a durable pause goes
        to ``paused`` at that pause (what changed since is lost, and the transition's reason
        says so); one without goes to ``error`` (its error says what was lost). The owner is
        cleared: the sandbox wakes on whichever node asks next. Returns the transition
        recorded (None: nothing to do, or another node did it). Raises StorageError."""
        now = time.time() if at is None else at
        with self._tx() as db:
            row = db.execute(
                "SELECT state, owner_node, paused_at FROM torpor_registry.sandboxes"
                " WHERE id = %s AND owner_node IS NOT NULL AND owner_node <> %s"
                # FOR UPDATE (not SKIP LOCKED): a node that races another's recovery waits
                # for it and then finds the sandbox recovered, so its acquire that follows
                # never takes over a lapsed lease of a sandbox still marked as running
                " AND lease_until < %s"
                # a drive pins its sandbox to the drive's node: it waits for that node
                " AND NOT EXISTS (SELECT 1 FROM torpor_registry.drives d WHERE"
                " d.record::jsonb -> 'attachments' @> jsonb_build_array("
                "jsonb_build_object('sandbox_id', %s::text))) FOR UPDATE",
                (sandbox_id, node, now, sandbox_id),
            ).fetchone()
            if row is None:
                return None
            state, owner, paused_at = SandboxState(row[0]), row[1], row[2]
            pause = db.execute(
                "SELECT manifest_paused_at, durable_at FROM torpor_registry.pauses"
                " WHERE sandbox_id = %s AND manifest IS NOT NULL",
                (sandbox_id,),
            ).fetchone()
            release = "UPDATE torpor_registry.sandboxes SET owner_node = NULL, lease_until = NULL"
            if state in (SandboxState.STOPPED, SandboxState.ERROR) or (
                state is SandboxState.PAUSED and pause is not None and pause[0] == paused_at
            ):  # nothing was lost: only the lease goes
                db.execute(release + " WHERE id = %s", (sandbox_id,))
                return None
            if pause is not None:
                dst = SandboxState.PAUSED
                reason = (
                    f"node {owner} lost (its lease lapsed); recovered by {node} to its last "
                    f"durable pause of {_iso(pause[0])}: RAM, processes and disk changes since "
                    "then are lost"
                )
                db.execute(
                    release + ", state = %s, paused_at = %s, error = NULL WHERE id = %s",
                    (dst.value, pause[0], sandbox_id),
                )
                db.execute(
                    "UPDATE torpor_registry.pauses SET pause_node = NULL, pause_at = %s,"
                    " upload_error = NULL WHERE sandbox_id = %s",
                    (pause[0], sandbox_id),
                )
            else:
                dst = SandboxState.ERROR
                reason = (
                    f"node {owner} lost (its lease lapsed) while the sandbox was "
                    f"{state.value}, and it had no durable pause: recovered by {node} as lost"
                )
                db.execute(
                    release + ", state = %s, error = %s WHERE id = %s",
                    (
                        dst.value,
                        f"RAM, processes and disk: node {owner} was lost before any pause of "
                        "this sandbox was stored off-node",
                        sandbox_id,
                    ),
                )
            _log_transition(db, sandbox_id, state, dst, now, reason)
        self.generation += 1
        log.warning("sandbox %s: %s", sandbox_id, reason)
        return Transition(sandbox_id, state, dst, now, reason)

    def owned_by(self, node_id: str) -> builtins.list[SandboxRecord]:
        """Sandboxes ``node_id`` holds (whatever its lease), oldest first. Raises
        StorageError."""
        rows = self._query(
            f"{_SELECT} WHERE s.owner_node = %s ORDER BY s.created_at, s.id", (node_id,)
        )
        return [_row_to_record(r) for r in rows]

    # -- usage (schema v8; the same as SQLite's) -------------------------------------------

    def meters_at(
        self, instants: tuple[float, ...], *, tenant: str | None = None
    ) -> builtins.list[tuple[SandboxRecord, builtins.list[Meters], MeterRow | None]]:
        """Every sandbox (of ``tenant``, or all) with its cumulative usage meters at each of
        ``instants``, and its last transition row at or before the last instant (None if it
        did not exist yet): as :meth:`Registry.meters_at
        <torpor.sandbox.registry.sqlite.Registry.meters_at>`, two index seeks per sandbox and
        instant (``LATERAL`` joins). Raises StorageError."""
        extra, joins = [], ""
        args: builtins.list[Any] = []
        for i, t in enumerate(instants):
            extra += [f"{side}{i}.{c.strip()}" for side in "ba" for c in _METERS.split(",")]
            # a sandbox created at or after t has used nothing by then: no seek for it
            joins += (
                f" LEFT JOIN LATERAL (SELECT {_METERS} FROM torpor_registry.transitions"
                f" WHERE sandbox_id = s.id AND at <= %s ORDER BY at DESC, seq DESC LIMIT 1)"
                f" b{i} ON s.created_at < %s"
                f" LEFT JOIN LATERAL (SELECT {_METERS} FROM torpor_registry.transitions"
                f" WHERE sandbox_id = s.id AND at > %s ORDER BY at, seq LIMIT 1)"
                f" a{i} ON s.created_at < %s"
            )
            args += [t, t, t, t]
        head, tail = _SELECT.split(" FROM ", 1)
        sql = f"{head}, {', '.join(extra)} FROM {tail}{joins}"
        if tenant is not None:
            sql += " WHERE s.tenant = %s"
            args.append(tenant)
        out: builtins.list[tuple[SandboxRecord, builtins.list[Meters], MeterRow | None]] = []
        for r in self._query(sql + " ORDER BY s.created_at, s.id", tuple(args)):
            rec = _row_to_record(r[: len(r) - len(extra)])
            rest = r[len(r) - len(extra) :]
            values, last = meters_from_columns(
                rest, instants, vcpus=rec.vcpus, memory_mib=rec.memory_mib
            )
            out.append((rec, values, last))
        return out

    def record_stored(self, kind: str, items: Sequence[Mapping[str, Any]]) -> None:
        """Enter stored things of ``kind`` in the usage ledger, or update those there (see
        :meth:`Registry.record_stored <torpor.sandbox.registry.sqlite.Registry.record_stored>`).
        Raises StorageError."""
        rows = stored_rows(kind, items)
        if not rows:
            return
        with self._tx() as db, db.cursor() as cur:
            cur.executemany(
                "INSERT INTO torpor_registry.stored (kind, id, tenant, name, labels, bytes,"
                " started_at, expires_at) VALUES (%s,%s,%s,%s,%s,%s,%s,%s)"
                " ON CONFLICT (kind, id) DO UPDATE SET labels = excluded.labels,"
                " bytes = excluded.bytes, expires_at = excluded.expires_at",
                rows,
            )

    def end_stored(self, kind: str, item_ids: set[str], at: float | None = None) -> int:
        """Mark stored things gone at ``at`` (default now), those not already ended; returns
        how many. Raises StorageError."""
        when = time.time() if at is None else at
        count = 0
        with self._tx() as db:
            for item_id in sorted(item_ids):
                cur = db.execute(
                    "UPDATE torpor_registry.stored SET ended_at = %s"
                    " WHERE kind = %s AND id = %s AND ended_at IS NULL",
                    (when, kind, item_id),
                )
                count += cur.rowcount
        return count

    def stored(
        self, *, tenant: str | None = None, kind: str | None = None, live: bool = False
    ) -> builtins.list[dict[str, Any]]:
        """Rows of the usage ledger (``live``: only those not ended), oldest first. Raises
        StorageError."""
        names = ("kind", "id", "tenant", "name", "labels", "bytes", "started_at", "ended_at")
        sql = f"SELECT {', '.join(names)}, expires_at FROM torpor_registry.stored WHERE true"
        args: builtins.list[Any] = []
        if tenant is not None:
            sql += " AND tenant = %s"
            args.append(tenant)
        if kind is not None:
            sql += " AND kind = %s"
            args.append(kind)
        if live:
            sql += " AND ended_at IS NULL"
        out = []
        for r in self._query(sql + " ORDER BY started_at, id", tuple(args)):
            row = dict(zip((*names, "expires_at"), r, strict=True))
            row["labels"] = json.loads(row["labels"] or "{}")
            out.append(row)
        return out


def _log_transition(
    db: Any,
    sandbox_id: str,
    src: SandboxState,
    dst: SandboxState,
    at: float,
    reason: str,
    *,
    cpu_reading: float | None = None,
    owned_bytes: int | None = None,
) -> None:
    """Append a transition with its usage meters: the last row's plus what accrued since
    (in the caller's transaction)."""
    last = db.execute(
        f"SELECT {_METERS} FROM torpor_registry.transitions WHERE sandbox_id = %s"
        " ORDER BY seq DESC LIMIT 1",
        (sandbox_id,),
    ).fetchone()
    spec_row = db.execute(
        "SELECT spec FROM torpor_registry.sandboxes WHERE id = %s", (sandbox_id,)
    ).fetchone()
    spec = json.loads((spec_row[0] if spec_row else None) or "{}")
    row = accrue(
        None if last is None else meter_row(last),
        at,
        dst,
        vcpus=int(spec.get("vcpus", 1)),
        memory_mib=int(spec.get("memory_mib", 512)),
        cpu_reading=cpu_reading,
        owned_bytes=owned_bytes,
    )
    m = row.meters
    db.execute(
        "INSERT INTO torpor_registry.transitions (sandbox_id, src, dst, at, reason, cpu_reading,"
        " owned_bytes, m_vcpu, m_cpu, m_ram, m_paused, cpu_ratio)"
        " VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s)",
        (
            sandbox_id,
            src.value,
            dst.value,
            at,
            reason,
            cpu_reading,
            row.owned_bytes,
            m.vcpu_seconds,
            m.cpu_seconds,
            m.ram_gib_seconds,
            m.paused_byte_seconds,
            row.cpu_ratio,
        ),
    )


def _iso(ts: float) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(ts, tz=UTC).isoformat(timespec="seconds")


def _epoch(value: Any) -> float:
    """A manifest's time (ISO 8601 text or seconds) in seconds since the epoch."""
    if isinstance(value, int | float):
        return float(value)
    from datetime import datetime

    return datetime.fromisoformat(str(value)).timestamp()
