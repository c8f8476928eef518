"""What the SQLite and the PostgreSQL registries share: their sandbox and transitions SQL.

Both keep the same tables (``sandboxes``, ``transitions``, ``stored``) with the same columns,
so every statement on them is written once, here, in :class:`SqlRegistry`, with two dialect
differences filled in by :meth:`SqlRegistry._sql`:

* parameters are written ``?`` (sqlite3's style); PostgreSQL's backend has them as ``%s``
  (so no statement here may contain a literal ``?`` or ``%``);
* tables are written ``{sandboxes}``, ``{transitions}``, ``{stored}``: bare on SQLite,
  in the schema ``torpor_registry`` on PostgreSQL.

What really differs stays in each backend: the connection and its transactions
(``_tx``, ``_query``), the schema and its migrations, :meth:`touch` (an idle clock written
without waiting for the disk, which each engine says its own way), and the one query each
engine answers best its own way (:meth:`SqlRegistry._meter_join`, the seeks of
:meth:`SqlRegistry.meters_at`). The cluster's tables are PostgreSQL's alone
(:mod:`torpor.sandbox.registry.postgres`).
"""

from __future__ import annotations

import builtins
import json
import time
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, closing
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, ClassVar

from torpor.config import check_name
from torpor.errors import Conflict, InvalidArgument, SandboxNotFound
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
from torpor.sandbox.registry.records import (
    SANDBOX_COLUMNS,
    UNSET,
    SandboxRecord,
    Unset,
    check_labels,
    events_from_rows,
    moved,
    record_from_row,
    spec_json,
    spec_size,
)

__all__ = ["METER_COLUMNS", "Move", "SqlRegistry"]

#: the meter columns of a transition row, in :func:`~torpor.sandbox.registry.meters.meter_row`'s
#: order
METER_COLUMNS = (
    "dst",
    "at",
    "cpu_reading",
    "owned_bytes",
    "m_vcpu",
    "m_cpu",
    "m_ram",
    "m_paused",
    "cpu_ratio",
)


@dataclass(frozen=True)
class Move:
    """One row's state change for :meth:`SqlRegistry.set_states`: ``sandbox_id`` from
    ``src`` to ``dst`` (compare-and-set), the usage readings taken at the move, and the
    ``columns`` (``paused_at``, ``error``, ``last_active_at``) set with it."""

    sandbox_id: str
    src: SandboxState
    dst: SandboxState
    cpu_reading: float | None = None
    owned_bytes: int | None = None
    columns: Mapping[str, Any] = field(default_factory=dict)


#: the columns of the usage ledger, in a row's order
_STORED_COLUMNS = (
    "kind",
    "id",
    "tenant",
    "name",
    "labels",
    "bytes",
    "started_at",
    "ended_at",
    "expires_at",
)


#: a sandbox row's columns as :meth:`SqlRegistry._select` reads them (table ``s``)
_SANDBOX_SELECT = ", ".join(f"s.{c}" for c in SANDBOX_COLUMNS)


@lru_cache(maxsize=1024)
def _render(text: str, param: str, schema: str) -> str:
    sql = text.format(
        sandboxes=f"{schema}sandboxes", transitions=f"{schema}transitions", stored=f"{schema}stored"
    )
    return sql if param == "?" else sql.replace("?", param)


class SqlRegistry:
    """The registry's operations on sandboxes, transitions and the usage ledger, over a
    backend's connection (see the module docstring). Not used by itself.

    Every method raises :class:`~torpor.errors.StorageError` when the database fails;
    lookups raise :class:`~torpor.errors.SandboxNotFound`; a taken name raises
    :class:`~torpor.errors.Conflict`.
    """

    #: how the backend writes a parameter, and the prefix of its tables
    PARAM: ClassVar[str] = "?"
    SCHEMA: ClassVar[str] = ""
    #: what a backend reads with each sandbox row beyond :data:`SANDBOX_COLUMNS` (columns,
    #: then the join they come from; see :meth:`_record`)
    RECORD_EXTRA: ClassVar[str] = ""
    RECORD_JOIN: ClassVar[str] = ""

    #: grows with every transition this process records (a cheap "anything new?" for
    #: event followers, before they query)
    generation: int

    # -- what a backend provides ----------------------------------------------------------

    def _tx(self) -> AbstractContextManager[Any]:
        """One transaction, yielding the connection; database errors become StorageError
        (Conflict for a violated unique index)."""
        raise NotImplementedError

    def _query(self, sql: str, args: tuple[Any, ...] = ()) -> builtins.list[Any]:
        """The rows of one statement outside a transaction. Raises StorageError."""
        raise NotImplementedError

    def _meter_join(self, i: int) -> str:
        """The joins that bring, beside sandbox ``s``, its transition rows ``b{i}`` (the
        last at or before instant ``i``) and ``a{i}`` (the first after it), neither for a
        sandbox created at or after it; four parameters, each the instant."""
        raise NotImplementedError

    def _record(self, row: Sequence[Any]) -> SandboxRecord:
        """The record of a row read with :meth:`_select`."""
        return record_from_row(row)

    # -- shared plumbing ------------------------------------------------------------------

    def _sql(self, text: str) -> str:
        """``text`` in this backend's dialect (see the module docstring)."""
        return _render(text, self.PARAM, self.SCHEMA)

    def _select(self, extra: str = "", joins: str = "") -> str:
        """``SELECT`` of a sandbox row (``s``) with what the backend adds, then ``extra``
        columns and ``joins``; the caller appends ``WHERE``."""
        head = f"SELECT {_SANDBOX_SELECT}{self.RECORD_EXTRA}{extra} FROM {{sandboxes}} s"
        return self._sql(head) + self.RECORD_JOIN + joins

    def _log_transition(
        self,
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
        (in the caller's transaction ``db``). It is logged no earlier than the last row (a
        clock stepped back, another node's clock): usage seeks a sandbox's rows by time, so
        its log must not go back in time."""
        last = db.execute(
            self._sql(
                f"SELECT {', '.join(METER_COLUMNS)} FROM {{transitions}} WHERE sandbox_id = ?"
                " ORDER BY seq DESC LIMIT 1"
            ),
            (sandbox_id,),
        ).fetchone()
        if last is not None:
            at = max(at, last[METER_COLUMNS.index("at")])
        spec = db.execute(self._sql("SELECT spec FROM {sandboxes} WHERE id = ?"), (sandbox_id,))
        spec_row = spec.fetchone()
        vcpus, memory_mib = spec_size(spec_row[0] if spec_row else None)
        row = accrue(
            None if last is None else meter_row(last),
            at,
            dst,
            vcpus=vcpus,
            memory_mib=memory_mib,
            cpu_reading=cpu_reading,
            owned_bytes=owned_bytes,
        )
        m = row.meters
        db.execute(
            self._sql(
                "INSERT INTO {transitions} (sandbox_id, src, dst, at, reason, cpu_reading,"
                " owned_bytes, m_vcpu, m_cpu, m_ram, m_paused, cpu_ratio)"
                " VALUES (?,?,?,?,?,?,?,?,?,?,?,?)"
            ),
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
            labels = check_labels(rec.labels)
            spec = spec_json(rec.vcpus, rec.memory_mib, rec.envs, rec.memory_scope)
            rows.append((rec, labels, spec))
        taken = recs[0] if recs else None  # the row being written: a Conflict is its name's
        try:
            with self._tx() as db:
                for rec, labels, spec in rows:
                    taken = rec
                    db.execute(
                        self._sql(
                            f"INSERT INTO {{sandboxes}} ({', '.join(SANDBOX_COLUMNS)})"
                            " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)"
                        ),
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
                        self._sql(
                            "INSERT INTO {transitions} (sandbox_id, src, dst, at, reason)"
                            " VALUES (?,?,?,?,?)"
                        ),
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
        """Move ``sandbox_id`` from ``src`` to ``dst`` (compare-and-set) and log it, with the
        usage readings taken at the move (``cpu_reading``, ``owned_bytes``); ``columns``
        (``paused_at``, ``error``, ``last_active_at``) are updated in the same transaction.

        Raises InvalidState/SandboxClosed for an illegal move or when the row is no longer in
        ``src`` (someone else moved it: another call, another node), SandboxNotFound, or
        StorageError.
        """
        move = Move(sandbox_id, src, dst, cpu_reading, owned_bytes, dict(columns))
        return self.set_states([move], reason=reason, at=at)[0]

    def set_states(
        self, moves: Sequence[Move], *, reason: str = "", at: float | None = None
    ) -> builtins.list[Transition]:
        """Make every move of ``moves`` (each as :meth:`set_state`: compare-and-set, logged
        with its readings, its columns updated) in one transaction, so one commit for all (a
        fork's children going to ``running``): all or none. Every move is checked against the
        lifecycle table before anything is written.

        Raises as :meth:`set_state`, for the first move that cannot be made (no row is then
        moved)."""
        allowed = {"paused_at", "error", "last_active_at"}
        for move in moves:
            check_transition(move.sandbox_id, move.src, move.dst)
            if not set(move.columns) <= allowed:
                raise InvalidArgument(f"cannot set {sorted(set(move.columns) - allowed)}")
        when = time.time() if at is None else at
        with self._tx() as db:
            for move in moves:
                self._move_row(db, move, when, reason)
        if moves:
            self.generation += 1
        return [Transition(m.sandbox_id, m.src, m.dst, when, reason) for m in moves]

    def _move_row(self, db: Any, move: Move, when: float, reason: str) -> None:
        """One move of :meth:`set_states`, in its transaction ``db``."""
        sets = ", ".join(["state = ?"] + [f"{c} = ?" for c in move.columns])  # checked names
        cur = db.execute(
            self._sql(f"UPDATE {{sandboxes}} SET {sets} WHERE id = ? AND state = ?"),
            (move.dst.value, *move.columns.values(), move.sandbox_id, move.src.value),
        )
        if cur.rowcount != 1:
            row = db.execute(
                self._sql("SELECT state FROM {sandboxes} WHERE id = ?"), (move.sandbox_id,)
            ).fetchone()
            if row is None:
                raise SandboxNotFound(
                    f"no sandbox {move.sandbox_id}", kind="sandbox", name=move.sandbox_id
                )
            check_transition(move.sandbox_id, SandboxState(row[0]), move.dst)
            raise moved(move.sandbox_id, SandboxState(row[0]), move.src)
        self._log_transition(
            db,
            move.sandbox_id,
            move.src,
            move.dst,
            when,
            reason,
            cpu_reading=move.cpu_reading,
            owned_bytes=move.owned_bytes,
        )

    def update_settings(
        self,
        sandbox_id: str,
        *,
        labels: Mapping[str, str] | None = None,
        idle_pause_seconds: int | Unset | None = UNSET,
        pause_retention_days: int | None = None,
        envs: Mapping[str, str] | None = None,
    ) -> None:
        """Change what may change of a live sandbox: its labels (replaced), idle pause (None:
        never), pause retention and environment variables (replaced); what is not given
        stays. Raises InvalidArgument or StorageError."""
        columns: dict[str, Any] = {}
        if envs is not None:
            rec = self.get(sandbox_id)
            columns["spec"] = spec_json(rec.vcpus, rec.memory_mib, envs, rec.memory_scope)
        if labels is not None:
            columns["labels"] = json.dumps(check_labels(labels), sort_keys=True)
        if not isinstance(idle_pause_seconds, Unset):
            columns["idle_pause_seconds"] = idle_pause_seconds
        if pause_retention_days is not None:
            columns["pause_retention_days"] = pause_retention_days
        if not columns:
            return
        assignments = ", ".join(f"{column} = ?" for column in columns)  # names from this code
        with self._tx() as db:
            db.execute(
                self._sql(f"UPDATE {{sandboxes}} SET {assignments} WHERE id = ?"),
                (*columns.values(), sandbox_id),
            )

    # -- reads ----------------------------------------------------------------------------

    def get(self, sandbox_id: str) -> SandboxRecord:
        """The row of ``sandbox_id``. Raises SandboxNotFound."""
        rows = self._query(self._select() + self._sql(" WHERE s.id = ?"), (sandbox_id,))
        if not rows:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r}", kind="sandbox", name=sandbox_id)
        return self._record(rows[0])

    def find(self, tenant: str, id_or_name: str) -> SandboxRecord:
        """A tenant's sandbox by id, else by name (the live one, else the latest killed one).
        Raises SandboxNotFound (also for another tenant's id)."""
        rows = self._query(
            self._select()
            + self._sql(
                " WHERE s.tenant = ? AND (s.id = ? OR s.name = ?)"
                " ORDER BY (s.id = ?) DESC, (s.state <> 'stopped') DESC, s.created_at DESC"
                " LIMIT 1"
            ),
            (tenant, id_or_name, id_or_name, id_or_name),
        )
        if not rows:
            raise SandboxNotFound(f"no sandbox {id_or_name!r}", kind="sandbox", name=id_or_name)
        return self._record(rows[0])

    def live_by_name(self, tenant: str, name: str) -> SandboxRecord | None:
        """The tenant's sandbox called ``name`` that is not stopped, or None."""
        rows = self._query(
            self._select()
            + self._sql(" WHERE s.tenant = ? AND s.name = ? AND s.state <> 'stopped'"),
            (tenant, name),
        )
        return self._record(rows[0]) if rows else None

    def list(
        self,
        *,
        tenant: str | None = None,
        labels: Mapping[str, str] | None = None,
        states: set[SandboxState] | None = None,
    ) -> builtins.list[SandboxRecord]:
        """Sandboxes, oldest first, filtered by tenant, states and labels (all must match)."""
        if states is not None and not states:
            return []
        where, args = " WHERE 1=1", []
        if tenant is not None:
            where += " AND s.tenant = ?"
            args.append(tenant)
        if states is not None:
            where += f" AND s.state IN ({','.join('?' * len(states))})"
            args.extend(s.value for s in states)
        sql = self._select() + self._sql(where + " ORDER BY s.created_at, s.id")
        rows = [self._record(r) for r in self._query(sql, tuple(args))]
        # Labels are matched in Python: exact for any key text (JSON paths need quoting
        # rules, and SQLite's stop at NUL), and a tenant has few enough sandboxes.
        wanted = dict(labels or {})
        return [r for r in rows if all(r.labels.get(k) == v for k, v in wanted.items())]

    def transitions(self, sandbox_id: str) -> builtins.list[Transition]:
        """Every recorded transition of a sandbox, in order."""
        rows = self._query(
            self._sql(
                "SELECT sandbox_id, src, dst, at, reason FROM {transitions}"
                " WHERE sandbox_id = ? ORDER BY seq"
            ),
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
        """The tenant's lifecycle events (see
        :func:`~torpor.sandbox.registry.lifecycle.event_kind`) with ``seq`` above ``after``,
        oldest first; only those of sandbox id ``sandbox`` if given; and the ``seq`` to
        continue from (``after`` of the next call).

        They are read from the transitions log, so they survive a restart. Up to ``limit``
        transitions are read per call, and the steps in between are not events, so a call may
        return fewer events than ``limit`` while more follow."""
        sql = (
            "SELECT t.seq, t.sandbox_id, t.src, t.dst, t.at, t.reason, s.name"
            " FROM {transitions} t JOIN {sandboxes} s ON s.id = t.sandbox_id"
            " WHERE s.tenant = ? AND t.seq > ?"
            + ("" if sandbox is None else " AND t.sandbox_id = ?")
            + " ORDER BY t.seq LIMIT ?"
        )
        args = (tenant, after) + (() if sandbox is None else (sandbox,)) + (limit,)
        return events_from_rows(self._query(self._sql(sql), args), after)

    # -- usage ----------------------------------------------------------------------------

    def meters_at(
        self, instants: tuple[float, ...], *, tenant: str | None = None
    ) -> builtins.list[tuple[SandboxRecord, builtins.list[Meters], MeterRow | None]]:
        """Every sandbox (of ``tenant``, or all) with its cumulative usage meters at each of
        ``instants``, and its last transition row at or before the last instant (None if it
        did not exist yet). Two index seeks per sandbox and instant, whatever its history's
        length (see :mod:`torpor.sandbox.registry.meters`). Raises StorageError."""
        extra = [
            f"{side}{i}.{c}" for i in range(len(instants)) for side in "ba" for c in METER_COLUMNS
        ]
        joins = "".join(self._meter_join(i) for i in range(len(instants)))
        args: builtins.list[Any] = [t for t in instants for _ in range(4)]
        sql = self._select(", " + ", ".join(extra), joins)
        if tenant is not None:
            sql += self._sql(" WHERE s.tenant = ?")
            args.append(tenant)
        out: builtins.list[tuple[SandboxRecord, builtins.list[Meters], MeterRow | None]] = []
        for r in self._query(sql + " ORDER BY s.created_at, s.id", tuple(args)):
            row = tuple(r)
            rec = self._record(row)
            values, last = meters_from_columns(
                row[len(row) - len(extra) :], instants, vcpus=rec.vcpus, memory_mib=rec.memory_mib
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
        with self._tx() as db, closing(db.cursor()) as cur:
            cur.executemany(
                self._sql(
                    "INSERT INTO {stored} (kind, id, tenant, name, labels, bytes, started_at,"
                    " expires_at) VALUES (?,?,?,?,?,?,?,?) ON CONFLICT (kind, id) DO UPDATE SET"
                    " labels = excluded.labels, bytes = excluded.bytes,"
                    " expires_at = excluded.expires_at"
                ),
                rows,
            )

    def end_stored(self, kind: str, item_ids: set[str], at: float | None = None) -> int:
        """Mark stored things gone at ``at`` (default now) in the usage ledger, those not
        already ended; returns how many. Raises StorageError."""
        when = time.time() if at is None else at
        count = 0
        sql = self._sql(
            "UPDATE {stored} SET ended_at = ? WHERE kind = ? AND id = ? AND ended_at IS NULL"
        )
        with self._tx() as db:
            for item_id in sorted(item_ids):
                count += db.execute(sql, (when, kind, item_id)).rowcount
        return count

    def stored(
        self, *, tenant: str | None = None, kind: str | None = None, live: bool = False
    ) -> builtins.list[dict[str, Any]]:
        """Rows of the usage ledger (``live``: only those not ended), oldest first. Raises
        StorageError."""
        sql, args = f"SELECT {', '.join(_STORED_COLUMNS)} FROM {{stored}} WHERE 1=1", []
        if tenant is not None:
            sql += " AND tenant = ?"
            args.append(tenant)
        if kind is not None:
            sql += " AND kind = ?"
            args.append(kind)
        if live:
            sql += " AND ended_at IS NULL"
        out = []
        for r in self._query(self._sql(sql + " ORDER BY started_at, id"), tuple(args)):
            row = dict(zip(_STORED_COLUMNS, r, strict=True))
            row["labels"] = json.loads(row["labels"] or "{}")
            out.append(row)
        return out
