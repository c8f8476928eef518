"""The sandbox registry: one SQLite database (WAL) at ``paths().registry``.

It holds one row per sandbox and an append-only log of every state transition. A state change
and its log entry are written in one transaction, compare-and-set on the old state, with
``synchronous=FULL`` so a committed state survives a power cut. The manager writes a state only
after the files that back it are durable, so the registry never claims more than the disk holds.

Names are unique per tenant among sandboxes that are not ``stopped`` (a partial unique index):
a killed sandbox's name can be taken again, while the old row stays so calls on its id still get
:class:`~torpor.errors.SandboxClosed` instead of "not found".
"""

from __future__ import annotations

import builtins
import json
import logging
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from torpor.config import check_name
from torpor.errors import Conflict, InvalidArgument, InvalidState, SandboxNotFound, StorageError
from torpor.sandbox.models import SandboxEvent, SandboxInfo, SandboxState
from torpor.sandbox.registry.lifecycle import Transition, check_transition, event_kind
from torpor.sandbox.registry.meters import (
    MeterRow,
    Meters,
    accrue,
    meter_row,
    meters_from_columns,
    stored_rows,
)

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

_METER_COLUMNS = "dst, at, cpu_reading, owned_bytes, m_vcpu, m_cpu, m_ram, m_paused, cpu_ratio"


_STATES = {state.value: state for state in SandboxState}


def _dt(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=UTC)


@dataclass(frozen=True)
class SandboxRecord:
    """One row of the registry."""

    id: str
    tenant: str
    name: str
    template: str
    state: SandboxState
    labels: dict[str, str] = field(default_factory=dict)
    vcpus: int = 1
    memory_mib: int = 512
    idle_pause_seconds: int | None = None
    pause_retention_days: int = 30
    #: environment variables of every command and of the interpreter; never in the info
    envs: dict[str, str] = field(default_factory=dict, repr=False)
    created_at: float = field(default_factory=time.time)
    last_active_at: float = field(default_factory=time.time)
    paused_at: float | None = None
    error: str | None = None
    #: the memory scope its agent reaches from inside (``MemoryScope.record()``), or None
    memory_scope: dict[str, Any] | None = None
    #: cluster mode: when the current pause was stored off-node (None: not, or not paused;
    #: always None on one machine, where nothing leaves the disk)
    durable_at: float | None = None
    #: cluster mode: why the current pause is not durable yet (an upload being retried)
    upload_error: str | None = None

    def to_info(self, *, reused: bool = False) -> SandboxInfo:
        """The public :class:`SandboxInfo` for this row."""
        return SandboxInfo(
            id=self.id,
            name=self.name,
            tenant=self.tenant,
            template=self.template,
            state=self.state,
            reused=reused,
            labels=dict(self.labels),
            vcpus=self.vcpus,
            memory_mib=self.memory_mib,
            idle_pause_seconds=self.idle_pause_seconds,
            pause_retention_days=self.pause_retention_days,
            created_at=_dt(self.created_at),
            last_active_at=_dt(self.last_active_at),
            error=self.error,
            paused_at=None if self.expires_at is None else _dt(self.paused_at or 0.0),
            expires_at=None if self.expires_at is None else _dt(self.expires_at),
            memory_scope=None if self.memory_scope is None else dict(self.memory_scope),
            durable=None if self.durable_at is None else _dt(self.durable_at),
            upload_error=self.upload_error,
        )

    @property
    def expires_at(self) -> float | None:
        """When a paused sandbox's pause is deleted (None unless paused)."""
        if self.state is not SandboxState.PAUSED or self.paused_at is None:
            return None
        return self.paused_at + self.pause_retention_days * 86400

    def with_state(self, state: SandboxState, **changes: Any) -> SandboxRecord:
        return replace(self, state=state, **changes)


@lru_cache(maxsize=256)
def _spec(text: str) -> tuple[int, int, tuple[tuple[str, str], ...], str | None]:
    """(vcpus, memory_mib, envs, memory_scope as JSON) of a spec column (cached: most
    sandboxes share a few specs; nothing mutable is cached, so no caller can change it)."""
    spec = json.loads(text or "{}")
    scope = spec.get("memory_scope")
    return (
        int(spec.get("vcpus", 1)),
        int(spec.get("memory_mib", 512)),
        tuple(sorted((spec.get("envs") or {}).items())),
        None if scope is None else json.dumps(scope),
    )


def _row_to_record(row: sqlite3.Row) -> SandboxRecord:
    vcpus, memory_mib, envs, scope = _spec(row["spec"])
    return SandboxRecord(
        id=row["id"],
        tenant=row["tenant"],
        name=row["name"],
        template=row["template"],
        state=_STATES[row["state"]],
        labels=json.loads(row["labels"] or "{}"),
        vcpus=vcpus,
        memory_mib=memory_mib,
        envs=dict(envs),
        idle_pause_seconds=row["idle_pause_seconds"],
        pause_retention_days=row["pause_retention_days"],
        created_at=row["created_at"],
        last_active_at=row["last_active_at"],
        paused_at=row["paused_at"],
        error=row["error"],
        memory_scope=None if scope is None else json.loads(scope),
    )


def _spec_json(
    vcpus: int,
    memory_mib: int,
    envs: Mapping[str, str],
    memory_scope: Mapping[str, Any] | None = None,
) -> str:
    """The ``spec`` column: the machine's size, the sandbox's environment variables and the
    memory scope its agent reaches from inside."""
    spec: dict[str, Any] = {"vcpus": vcpus, "memory_mib": memory_mib}
    if envs:
        spec["envs"] = dict(envs)
    if memory_scope is not None:
        spec["memory_scope"] = dict(memory_scope)
    return json.dumps(spec, sort_keys=True)


def _check_labels(labels: Mapping[str, str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in labels.items():
        if not isinstance(key, str) or not isinstance(value, str) or not key:
            raise InvalidArgument(
                f"labels must map non-empty strings to strings: {key!r}", label=str(key)
            )
        out[key] = value
    return out


class _Unset:
    """The type of :data:`_UNSET`: a keyword not given (None is a value: "never")."""


_UNSET = _Unset()


class Registry:
    """The SQLite registry of sandboxes. Thread-safe (one connection behind a lock).

    Every method raises :class:`StorageError` when SQLite fails; lookups raise
    :class:`SandboxNotFound`; a taken name raises :class:`Conflict`.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.RLock()
        #: grows with every transition this process records (a cheap "anything new?" for
        #: event followers, before they query)
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
        version = int(self._db.execute("PRAGMA user_version").fetchone()[0])
        if version > SCHEMA_VERSION:
            raise StorageError(
                f"registry {self.path} has schema version {version}, newer than this torpor "
                f"({SCHEMA_VERSION})",
                path=str(self.path),
            )
        for target in range(version + 1, SCHEMA_VERSION + 1):
            log.info("registry %s: migrating schema to version %d", self.path, target)
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for statement in _MIGRATIONS[target].split(";"):
                    if statement.strip():
                        self._db.execute(statement)
                if target in _BACKFILLS:
                    _BACKFILLS[target](self._db)
                self._db.execute(f"PRAGMA user_version={target}")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

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
                        "INSERT INTO sandboxes (id, tenant, name, template, state, labels, spec,"
                        " idle_pause_seconds, pause_retention_days, created_at, last_active_at,"
                        " paused_at, error) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
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
                        "INSERT INTO transitions (sandbox_id, src, dst, at, reason)"
                        " VALUES (?,?,?,?,?)",
                        (rec.id, None, rec.state.value, rec.created_at, reason),
                    )  # the first row: every meter at zero
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
        cpu_reading: float | None = None,
        owned_bytes: int | None = None,
        **columns: Any,
    ) -> Transition:
        """Move ``sandbox_id`` from ``src`` to ``dst`` (compare-and-set) and log it; ``columns``
        (``paused_at``, ``error``, ``last_active_at``) are updated in the same transaction.

        Raises InvalidState/SandboxClosed for an illegal move or when the row is no longer in
        ``src`` (someone else moved it), SandboxNotFound, or StorageError.
        """
        check_transition(sandbox_id, src, dst)
        allowed = {"paused_at", "error", "last_active_at"}
        if not set(columns) <= allowed:
            raise InvalidArgument(f"cannot set {sorted(set(columns) - allowed)}")
        when = time.time() if at is None else at
        sets = ", ".join(["state = ?"] + [f"{c} = ?" for c in columns])
        with self._tx() as db:
            cur = db.execute(
                f"UPDATE sandboxes SET {sets} WHERE id = ? AND state = ?",
                (dst.value, *columns.values(), sandbox_id, src.value),
            )
            if cur.rowcount != 1:
                row = db.execute(
                    "SELECT state FROM sandboxes WHERE id = ?", (sandbox_id,)
                ).fetchone()
                if row is None:
                    raise SandboxNotFound(
                        f"no sandbox {sandbox_id}", kind="sandbox", name=sandbox_id
                    )
                check_transition(sandbox_id, SandboxState(row["state"]), dst)
                raise _moved(sandbox_id, SandboxState(row["state"]), src)
            row = self._accrue(db, sandbox_id, when, dst, cpu_reading, owned_bytes)
            m = row.meters
            db.execute(
                "INSERT INTO transitions (sandbox_id, src, dst, at, reason, cpu_reading,"
                " owned_bytes, m_vcpu, m_cpu, m_ram, m_paused, cpu_ratio)"
                " VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    sandbox_id,
                    src.value,
                    dst.value,
                    when,
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
        self.generation += 1
        return Transition(sandbox_id, src, dst, when, reason)

    @staticmethod
    def _accrue(
        db: sqlite3.Connection,
        sandbox_id: str,
        at: float,
        dst: SandboxState,
        cpu_reading: float | None,
        owned_bytes: int | None,
    ) -> MeterRow:
        """The meter row of a new transition: the last one's meters plus what accrued since."""
        last = db.execute(
            f"SELECT {_METER_COLUMNS} FROM transitions WHERE sandbox_id = ?"
            " ORDER BY seq DESC LIMIT 1",
            (sandbox_id,),
        ).fetchone()
        spec = json.loads(
            db.execute("SELECT spec FROM sandboxes WHERE id = ?", (sandbox_id,)).fetchone()[0]
            or "{}"
        )
        return accrue(
            None if last is None else meter_row(last),
            at,
            dst,
            vcpus=int(spec.get("vcpus", 1)),
            memory_mib=int(spec.get("memory_mib", 512)),
            cpu_reading=cpu_reading,
            owned_bytes=owned_bytes,
        )

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
        assignments = ", ".join(f"{column} = ?" for column in columns)  # names from this code
        with self._tx() as db:
            db.execute(
                f"UPDATE sandboxes SET {assignments} WHERE id = ?",
                (*columns.values(), sandbox_id),
            )

    # -- reads ----------------------------------------------------------------------------

    def get(self, sandbox_id: str) -> SandboxRecord:
        """The row of ``sandbox_id``. Raises SandboxNotFound."""
        rows = self._query("SELECT * FROM sandboxes WHERE id = ?", (sandbox_id,))
        if not rows:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r}", kind="sandbox", name=sandbox_id)
        return _row_to_record(rows[0])

    def find(self, tenant: str, id_or_name: str) -> SandboxRecord:
        """A tenant's sandbox by id, else by name (the live one, else the latest killed one).
        Raises SandboxNotFound (also for another tenant's id)."""
        rows = self._query(
            "SELECT * FROM sandboxes WHERE tenant = ? AND (id = ? OR name = ?)"
            " ORDER BY (id = ?) DESC, (state != 'stopped') DESC, created_at DESC LIMIT 1",
            (tenant, id_or_name, id_or_name, id_or_name),
        )
        if not rows:
            raise SandboxNotFound(f"no sandbox {id_or_name!r}", kind="sandbox", name=id_or_name)
        return _row_to_record(rows[0])

    def live_by_name(self, tenant: str, name: str) -> SandboxRecord | None:
        """The tenant's sandbox called ``name`` that is not stopped, or None."""
        rows = self._query(
            "SELECT * FROM sandboxes WHERE tenant = ? AND name = ? AND state != 'stopped'",
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
        sql, args = "SELECT * FROM sandboxes WHERE 1=1", []
        if tenant is not None:
            sql += " AND tenant = ?"
            args.append(tenant)
        if states is not None:
            sql += f" AND state IN ({','.join('?' * len(states))})"
            args.extend(s.value for s in states)
        rows = [
            _row_to_record(r) for r in self._query(sql + " ORDER BY created_at, id", tuple(args))
        ]
        # Labels are matched in Python: exact for any key text (SQLite JSON paths need
        # quoting rules and stop at NUL), and a tenant has few enough sandboxes.
        wanted = dict(labels or {})
        return [r for r in rows if all(r.labels.get(k) == v for k, v in wanted.items())]

    def transitions(self, sandbox_id: str) -> builtins.list[Transition]:
        """Every recorded transition of a sandbox, in order."""
        rows = self._query(
            "SELECT * FROM transitions WHERE sandbox_id = ? ORDER BY seq", (sandbox_id,)
        )
        return [
            Transition(
                r["sandbox_id"],
                SandboxState(r["src"]) if r["src"] else None,
                SandboxState(r["dst"]),
                r["at"],
                r["reason"],
            )
            for r in rows
        ]

    # -- usage ----------------------------------------------------------------------------

    def meters_at(
        self, instants: tuple[float, ...], *, tenant: str | None = None
    ) -> builtins.list[tuple[SandboxRecord, builtins.list[Meters], MeterRow | None]]:
        """Every sandbox (of ``tenant``, or all) with its cumulative usage meters at each of
        ``instants``, and its last transition row at or before the last instant (None if it
        did not exist yet). Two index seeks per sandbox and instant, whatever its history's
        length (see :mod:`torpor.sandbox.registry.meters`). Raises StorageError."""
        columns = [
            f"{side}{i}.{c.strip()}"
            for i in range(len(instants))
            for side in "ba"
            for c in _METER_COLUMNS.split(",")
        ]
        sql = "SELECT s.*, " + ", ".join(columns) + " FROM sandboxes s"
        args: builtins.list[Any] = []
        for i, t in enumerate(instants):
            # a sandbox created at or after t has used nothing by then: no seek for it
            sql += (
                f" LEFT JOIN transitions b{i} ON b{i}.seq = CASE WHEN s.created_at >= ? THEN NULL"
                f" ELSE (SELECT seq FROM transitions WHERE sandbox_id = s.id AND at <= ?"
                f" ORDER BY at DESC, seq DESC LIMIT 1) END"
                f" LEFT JOIN transitions a{i} ON a{i}.seq = CASE WHEN s.created_at >= ? THEN NULL"
                f" ELSE (SELECT seq FROM transitions WHERE sandbox_id = s.id AND at > ?"
                f" ORDER BY at, seq LIMIT 1) END"
            )
            args += [t, t, t, t]
        if tenant is not None:
            sql += " WHERE s.tenant = ?"
            args.append(tenant)
        found = self._query(sql + " ORDER BY s.created_at, s.id", tuple(args))
        out: builtins.list[tuple[SandboxRecord, builtins.list[Meters], MeterRow | None]] = []
        for r in found:
            rec = _row_to_record(r)
            tail = tuple(r)[len(r) - len(columns) :]
            values, last = meters_from_columns(
                tail, instants, vcpus=rec.vcpus, memory_mib=rec.memory_mib
            )
            out.append((rec, values, last))
        return out

    def record_stored(self, kind: str, items: Sequence[Mapping[str, Any]]) -> None:
        """Enter stored things of ``kind`` ("snapshot", "volume") in the usage ledger, or
        update the size, labels and expiry of those already there, in one transaction. Each
        item has ``id``, ``tenant``, ``name``, ``bytes``, ``started_at`` and optionally
        ``labels`` and ``expires_at``. Raises StorageError."""
        rows = stored_rows(kind, items)
        if not rows:
            return
        with self._tx() as db:
            db.executemany(
                "INSERT INTO stored (kind, id, tenant, name, labels, bytes, started_at,"
                " expires_at) VALUES (?,?,?,?,?,?,?,?) ON CONFLICT (kind, id) DO UPDATE SET"
                " labels = excluded.labels, bytes = excluded.bytes,"
                " expires_at = excluded.expires_at",
                rows,
            )

    def end_stored(self, kind: str, item_ids: set[str], at: float | None = None) -> int:
        """Mark stored things gone at ``at`` (default now) in the usage ledger, those not
        already ended; returns how many. Raises StorageError."""
        when = time.time() if at is None else at
        count = 0
        with self._tx() as db:
            for item_id in sorted(item_ids):
                cur = db.execute(
                    "UPDATE stored SET ended_at = ? WHERE kind = ? AND id = ? AND ended_at IS NULL",
                    (when, kind, item_id),
                )
                count += cur.rowcount
        return count

    def stored(
        self, *, tenant: str | None = None, kind: str | None = None, live: bool = False
    ) -> builtins.list[dict[str, Any]]:
        """Rows of the usage ledger (``live``: only those not ended), oldest first."""
        sql, args = "SELECT * FROM stored WHERE 1=1", []
        if tenant is not None:
            sql += " AND tenant = ?"
            args.append(tenant)
        if kind is not None:
            sql += " AND kind = ?"
            args.append(kind)
        if live:
            sql += " AND ended_at IS NULL"
        return [
            dict(r, labels=json.loads(r["labels"] or "{}"))
            for r in self._query(sql + " ORDER BY started_at, id", tuple(args))
        ]

    def events(
        self,
        tenant: str,
        *,
        after: int = 0,
        sandbox: str | None = None,
        limit: int = 500,
    ) -> tuple[builtins.list[SandboxEvent], int]:
        """The tenant's lifecycle events (see :func:`event_kind`) with ``seq`` above ``after``,
        oldest first; only those of sandbox id ``sandbox`` if given; and the ``seq`` to continue
        from (``after`` of the next call).

        They are read from the transitions log, so they survive a restart. Up to ``limit``
        transitions are read per call, and the steps in between are not events, so a call may
        return fewer events than ``limit`` while more follow."""
        by_sandbox = "" if sandbox is None else " AND t.sandbox_id = ?"
        sql = EVENTS_SQL.format(prefix="", p="?", by_sandbox=by_sandbox)
        args = (tenant, after) + (() if sandbox is None else (sandbox,)) + (limit,)
        rows = self._query(sql, args)
        return events_from_rows(rows, after)

    def last_seq(self) -> int:
        """The ``seq`` of the newest transition of the home (0 for none)."""
        return int(self._query("SELECT COALESCE(MAX(seq), 0) FROM transitions")[0][0])


def events_from_rows(rows: Iterable[Sequence[Any]], after: int) -> tuple[list[SandboxEvent], int]:
    """Transitions rows ``(seq, sandbox_id, src, dst, at, reason, name)`` as the events a
    user sees (see :func:`event_kind`), and the ``seq`` to continue from (both registries)."""
    out: list[SandboxEvent] = []
    last = after
    for seq, sandbox_id, src_text, dst_text, at, reason, name in rows:
        last = int(seq)
        src = SandboxState(src_text) if src_text else None
        dst = SandboxState(dst_text)
        kind = event_kind(src, dst, reason)
        if kind is not None:
            out.append(
                SandboxEvent(
                    seq=int(seq),
                    at=_dt(at),
                    sandbox_id=sandbox_id,
                    name=name,
                    kind=kind,
                    state=dst,
                    reason=reason,
                )
            )
    return out, last


#: the query of :func:`events_from_rows`'s rows (``?`` or ``%s`` placeholders, then the
#: tenant, after, [sandbox,] limit)
EVENTS_SQL = (
    "SELECT t.seq, t.sandbox_id, t.src, t.dst, t.at, t.reason, s.name"
    " FROM {prefix}transitions t JOIN {prefix}sandboxes s ON s.id = t.sandbox_id"
    " WHERE s.tenant = {p} AND t.seq > {p}{by_sandbox} ORDER BY t.seq LIMIT {p}"
)


def _moved(sandbox_id: str, actual: SandboxState, expected: SandboxState) -> InvalidState:
    return InvalidState(
        f"sandbox {sandbox_id} is {actual.value}, expected {expected.value}",
        sandbox_id=sandbox_id,
        state=actual.value,
        required=[expected.value],
    )
