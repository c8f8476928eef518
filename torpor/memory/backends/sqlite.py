"""The embedded backend: one SQLite database file per tenant, plus ``_system.db`` for API
tokens and the audit log.

Isolation is by construction: a :class:`SQLiteTenantStore` holds a connection to exactly one
tenant's file, so no query it runs can reach another tenant. Files live under
``paths().memory`` as ``<tenant>.db`` (tenant names follow ``check_name``, so they can never
collide with ``_system.db``).

Concurrency: WAL journal, a 10 s busy timeout, and ``BEGIN IMMEDIATE`` for every write with a
few retries, so several writer processes serialize instead of failing or losing writes. A
partial unique index allows one current fact per ``(scope, key)``, so two processes racing to
supersede the same key cannot both leave a current fact.
"""

from __future__ import annotations

import json
import logging
import math
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from torpor.config import check_name
from torpor.errors import InvalidArgument, RecordNotFound, StorageError
from torpor.memory.backends import _sqlite_schema as schema
from torpor.memory.backends._rows import (
    TOKEN_COLUMNS,
    audit_from_row,
    token_from_row,
    token_to_row,
)
from torpor.memory.backends._sqlite_conn import Conn, connect
from torpor.memory.backends._vindex import VectorIndex
from torpor.memory.backends.base import (
    MAX_LEXICAL_TERMS,
    AnyRecord,
    MemoryBackend,
    RecordFilter,
    SearchMemo,
    TenantStore,
    Vector,
    check_record_quota,
    profile_moved,
    successor,
)
from torpor.memory.models import (
    LAST_US,
    AuditEntry,
    Episode,
    Fact,
    Policy,
    Profile,
    TokenInfo,
    from_us,
    to_us,
)

log = logging.getLogger(__name__)

__all__ = ["SQLiteBackend", "SQLiteTenantStore", "connect"]

_RCOLS = ", ".join(f"r.{c}" for c in schema.COLUMNS.split(", "))
_MAX_INT = 2**63 - 1
#: most rows one query term contributes to lexical ranking (its newest matches)
_TERM_CAP = 20_000


def _varints(data: bytes) -> list[int]:
    """SQLite's big-endian varints (7 bits a byte, the high bit set on all but the last)."""
    out, value = [], 0
    for byte in data:
        value = (value << 7) | (byte & 0x7F)
        if not byte & 0x80:
            out.append(value)
            value = 0
    return out


def _vec_blob(vector: Vector) -> bytes:
    return np.asarray(vector, dtype=np.float32).tobytes()


def _record(row: tuple[Any, ...], memo: SearchMemo | None) -> AnyRecord:
    """The record of a row selected with ``_RCOLS``, built once per query: keyed by the whole
    row, so a row that changed between two searches is built again."""
    if memo is None:
        return schema.row_to_record(row)
    rec: AnyRecord | None = memo.records.get(row)
    if rec is None:
        rec = memo.records[row] = schema.row_to_record(row)
    return rec


def _within_sql(prefix: str, column: str = "scope") -> tuple[str, list[Any]]:
    if not prefix:
        return "1", []
    return f"({column} = ? OR substr({column}, 1, ?) = ?)", [prefix, len(prefix) + 1, prefix + "/"]


class SQLiteTenantStore(TenantStore):
    """The records of one tenant in one SQLite file (see the module docstring)."""

    def __init__(self, tenant: str, path: Path) -> None:
        self.tenant = tenant
        self.path = path
        self._db = Conn(path, schema.MIGRATIONS)
        self._index = VectorIndex()

    def schema_version(self) -> int:
        with self._db.read("schema version") as conn:
            return int(conn.execute("PRAGMA user_version").fetchone()[0])

    # -- writes ---------------------------------------------------------------------------
    def add(
        self,
        records: Sequence[AnyRecord],
        vectors: Sequence[Vector | None] | None = None,
        *,
        quota: int | None = None,
    ) -> list[AnyRecord]:
        if vectors is not None and len(vectors) != len(records):
            raise InvalidArgument("records and vectors differ in length")
        stored: list[AnyRecord] = []
        rows: list[tuple[Any, ...]] = []
        vecs: list[bytes | None] = []
        with self._db.write("add") as conn:
            # BEGIN IMMEDIATE holds the write lock: the count cannot move under this check
            check_record_quota(self.tenant, quota, self._count(conn), len(records))
            for i, rec in enumerate(records):
                if isinstance(rec, Fact) and rec.key is not None:
                    self._insert_many(conn, rows, vecs)  # supersession sees what came before
                    rec = self._supersede(conn, rec)
                rows.append(schema.record_to_row(rec))
                vec = None if vectors is None else vectors[i]
                vecs.append(None if vec is None else _vec_blob(vec))
                stored.append(rec)
            self._insert_many(conn, rows, vecs)
        return stored

    @staticmethod
    def _insert_many(
        conn: sqlite3.Connection, rows: list[tuple[Any, ...]], vecs: list[bytes | None]
    ) -> None:
        """Insert the pending ``rows`` (:func:`record_to_row`'s) with their FTS5 entries,
        their vectors (None: no vector) and the count, then clear both lists. The rows are
        numbered from the largest rowid ever given, never reusing a forgotten record's (the
        vector index, here and in other processes, knows rows by rowid: a reused one would
        keep the forgotten record's vector)."""
        if not rows:
            return
        top = conn.execute(
            "SELECT max(coalesce((SELECT max(rid) FROM records), 0), "
            "coalesce((SELECT n FROM counts WHERE what = 'max_rid'), 0))"
        ).fetchone()[0]
        rids = range(top + 1, top + 1 + len(rows))
        conn.execute(
            "INSERT INTO counts VALUES ('max_rid', ?) "
            "ON CONFLICT (what) DO UPDATE SET n = excluded.n",
            (rids[-1],),
        )
        conn.executemany(
            schema.INSERT_SQL, [(rid, *row) for rid, row in zip(rids, rows, strict=True)]
        )
        conn.executemany(
            schema.FTS_INSERT_SQL, [(rid, row[4]) for rid, row in zip(rids, rows, strict=True)]
        )
        blobs = [(rid, v) for rid, v in zip(rids, vecs, strict=True) if v is not None]
        if blobs:
            conn.executemany("INSERT INTO vectors (rid, vec) VALUES (?, ?)", blobs)
        conn.execute(schema.COUNT_SQL, (len(rows),))
        rows.clear()
        vecs.clear()

    @staticmethod
    def _current(conn: sqlite3.Connection, rec: Fact) -> Any:
        """``(rid, id, valid_from)`` of the current fact of ``rec``'s scope and key, or None."""
        return conn.execute(
            "SELECT rid, id, valid_from FROM records WHERE scope = ? AND key = ? "
            "AND valid_to IS NULL",
            (rec.scope, rec.key),
        ).fetchone()

    @staticmethod
    def _close(conn: sqlite3.Connection, rid: int, by: Fact) -> None:
        """End the fact at ``rid`` where its successor ``by`` starts."""
        conn.execute(
            "UPDATE records SET valid_to = ?, superseded_by = ? WHERE rid = ?",
            (to_us(by.valid_from), by.id, rid),
        )

    def _supersede(self, conn: sqlite3.Connection, rec: Fact) -> Fact:
        row = self._current(conn, rec)
        if row is None:
            return rec
        rec = successor(rec, row[2])
        self._close(conn, row[0], rec)
        return rec

    @staticmethod
    def _count(conn: sqlite3.Connection) -> int:
        return int(conn.execute("SELECT n FROM counts WHERE what = 'records'").fetchone()[0])

    def record_count(self) -> int:
        with self._db.read("record count") as conn:
            return self._count(conn)

    def import_records(
        self,
        records: Sequence[AnyRecord],
        vectors: Sequence[Vector | None] | None = None,
        *,
        quota: int | None = None,
    ) -> int:
        inserted = 0
        with self._db.write("import") as conn:
            used = self._count(conn)
            for i, rec in enumerate(records):
                if conn.execute("SELECT 1 FROM records WHERE id = ?", (rec.id,)).fetchone():
                    continue
                # checked per record (ids already present are skipped, not counted); an
                # exception rolls the whole import back
                check_record_quota(self.tenant, quota, used + inserted, 1)
                if isinstance(rec, Fact) and rec.key is not None and rec.valid_to is None:
                    row = self._current(conn, rec)
                    if row is not None and row[2] < to_us(rec.valid_from):
                        self._close(conn, row[0], rec)
                    elif row is not None:  # the existing fact is newer: import this one ended
                        rec = rec.model_copy(
                            update={"valid_to": from_us(row[2]), "superseded_by": row[1]}
                        )
                vec = None if vectors is None else vectors[i]
                self._insert_many(
                    conn, [schema.record_to_row(rec)], [None if vec is None else _vec_blob(vec)]
                )
                inserted += 1
        return inserted

    def set_verification(
        self, record_id: str, *, verified: bool, stale: bool, source_hash: str | None
    ) -> None:
        with self._db.write("verify") as conn:
            n = conn.execute(
                "UPDATE records SET verified = ?, stale = ?, source_hash = ? WHERE id = ?",
                (int(verified), int(stale), source_hash, record_id),
            ).rowcount
        if not n:
            raise RecordNotFound(f"no record {record_id!r}", kind="record", name=record_id)

    def forget(self, ids: Sequence[str]) -> int:
        if not ids:
            return 0
        with self._db.write("forget") as conn:
            return sum(conn.execute("DELETE FROM records WHERE id = ?", (i,)).rowcount for i in ids)

    def forget_scope(self, prefix: str) -> int:
        where, params = _within_sql(prefix)
        with self._db.write("forget scope") as conn:
            n = conn.execute(f"DELETE FROM records WHERE {where}", params).rowcount
            conn.execute(f"DELETE FROM profiles WHERE {where}", params)
            conn.execute(f"DELETE FROM policies WHERE {where}", params)
        return int(n)

    def cap_expiry(self, scope: str, retention_us: int) -> int:
        with self._db.write("retention") as conn:
            return int(
                conn.execute(
                    "UPDATE records SET expires_at = min(created_at + ?, ?) WHERE scope = ? AND "
                    "(expires_at IS NULL OR expires_at > min(created_at + ?, ?))",
                    (retention_us, LAST_US, scope, retention_us, LAST_US),
                ).rowcount
            )

    def purge_expired(self, now: int) -> int:
        with self._db.write("purge") as conn:
            return int(conn.execute("DELETE FROM records WHERE expires_at <= ?", (now,)).rowcount)

    # -- reads ----------------------------------------------------------------------------
    def get(self, ids: Sequence[str], now: int) -> list[AnyRecord]:
        found: dict[str, AnyRecord] = {}
        with self._db.read("get") as conn:
            for start in range(0, len(ids), 500):
                part = list(ids[start : start + 500])
                for row in conn.execute(
                    f"SELECT {schema.COLUMNS} FROM records WHERE id IN "
                    f"({','.join('?' * len(part))}) AND (expires_at IS NULL OR expires_at > ?)",
                    [*part, now],
                ):
                    rec = schema.row_to_record(row)
                    found[rec.id] = rec
        return [found[i] for i in ids if i in found]

    def history(self, scope: str, key: str, now: int) -> list[Fact]:
        with self._db.read("history") as conn:
            rows = conn.execute(
                f"SELECT {schema.COLUMNS} FROM records WHERE scope = ? AND key = ? AND "
                "kind = 'fact' AND (expires_at IS NULL OR expires_at > ?) "
                "ORDER BY valid_from, rid",
                (scope, key, now),
            ).fetchall()
        return [r for r in map(schema.row_to_record, rows) if isinstance(r, Fact)]

    def scan(
        self, flt: RecordFilter, limit: int, *, newest_first: bool = True, offset: int = 0
    ) -> list[AnyRecord]:
        where, params = schema.filter_sql(flt)
        order = "DESC" if newest_first else "ASC"
        with self._db.read("scan") as conn:
            rows = conn.execute(
                f"SELECT {_RCOLS} FROM records r WHERE {where} "
                f"ORDER BY r.valid_from {order}, r.rid {order} LIMIT ? OFFSET ?",
                [*params, limit, max(offset, 0)],
            ).fetchall()
        return [schema.row_to_record(r) for r in rows]

    def previous_episodes(self, episodes: Sequence[Episode], flt: RecordFilter) -> dict[str, str]:
        """See :meth:`TenantStore.previous_episodes`: one statement, a correlated lookup per
        episode on the (scope, valid_from) index (whose entries end with the rowid, so the
        row-value bound ``(valid_from, rid)`` is a range of it)."""
        ids = [ep.id for ep in episodes]
        if not ids:
            return {}
        sub = replace(flt, kinds=("episode",))
        where, params = schema.filter_sql(sub)
        out: dict[str, str] = {}
        with self._db.read("previous episodes") as conn:
            for at in range(0, len(ids), 500):
                part = ids[at : at + 500]
                rows = conn.execute(
                    f"SELECT c.id, (SELECT r.id FROM records r WHERE r.scope = c.scope "
                    f"AND r.session IS c.session AND (r.valid_from, r.rid) < (c.valid_from, c.rid) "
                    f"AND {where} "
                    f"ORDER BY r.valid_from DESC, r.rid DESC LIMIT 1) FROM records c "
                    f"WHERE c.id IN ({','.join('?' * len(part))}) AND c.kind = 'episode'",
                    [*params, *part],
                ).fetchall()
                out.update((str(c), str(p)) for c, p in rows if p is not None)
        return out

    def count(self, flt: RecordFilter) -> int:
        where, params = schema.filter_sql(flt)
        with self._db.read("count") as conn:
            return int(
                conn.execute(f"SELECT count(*) FROM records r WHERE {where}", params).fetchone()[0]
            )

    def lexical_search(
        self,
        terms: Sequence[str],
        flt: RecordFilter,
        limit: int,
        *,
        memo: SearchMemo | None = None,
    ) -> list[tuple[AnyRecord, float]]:
        """See :meth:`TenantStore.lexical_search`.

        FTS5 finds the matching rows per term (cheap), and the ranking is done here in numpy:
        a BM25 with tf = 1 and no length normalization, i.e. the sum of the matched terms'
        ``idf = ln(1 + (N - df + 0.5) / (df + 0.5))``. Scoring every match with FTS5's
        ``bm25()`` is far slower for a common query over a large store (figures in
        ``bench/README.md``, "SQLite lexical search"), and memory records are short, so term
        frequency and length add little. A term matching more than :data:`_TERM_CAP` rows
        contributes only its newest matches (its idf is small). Candidates are then checked
        against ``flt`` in SQL, best first, widening as needed: the best ``limit + 8`` first
        (the filter usually passes nearly all), then up to ``2 * limit + 8``, then a join.
        With a ``memo``, a term's matches and a row's record are reused within the query.
        """
        terms = [t for t in dict.fromkeys(terms) if t][:MAX_LEXICAL_TERMS]
        if not terms or limit <= 0:
            return []
        where, params = schema.filter_sql(flt)
        with self._db.read("lexical search") as conn:
            total = max(int(conn.execute("SELECT max(rid) FROM records").fetchone()[0] or 0), 1)
            version = None
            if memo is not None:
                version = (conn.execute("PRAGMA data_version").fetchone()[0], self._db.writes)
            rid_lists, weights, found_terms = [], [], []
            for term in terms:
                rids = self._postings(conn, term, memo, (version, total))
                if rids is None:
                    continue
                df = float(len(rids))
                if len(rids) == _TERM_CAP:  # capped: extrapolate df from the rowid span
                    df = df * total / max(total - int(rids.min()) + 1, 1)
                rid_lists.append(rids)
                weights.append(math.log(1 + (total - df + 0.5) / (df + 0.5)))
                found_terms.append(term)
            if not rid_lists:
                return []
            all_rids = np.concatenate(rid_lists)
            all_w = np.concatenate(
                [np.full(len(r), w) for r, w in zip(rid_lists, weights, strict=True)]
            )
            uniq, inverse = np.unique(all_rids, return_inverse=True)
            scores = np.bincount(inverse, weights=all_w)
            order = np.lexsort((-uniq, -scores))  # best score, then newest
            ranked = uniq[order]
            # usually the filter passes nearly everything: check the best few first, and
            # build only the rows returned (building one costs more than finding it)
            head = [int(r) for r in ranked[: limit + 8]]
            found = self._fetch_rids(conn, head, where, params)
            if len(found) < min(limit, len(head)) and len(ranked) > len(head):
                more = [int(r) for r in ranked[len(head) : limit * 2 + 8]]
                found.update(self._fetch_rids(conn, more, where, params))
                head += more
            head_scores = scores[np.searchsorted(uniq, head)].tolist() if head else []
            if len(found) < min(limit, len(head)) and len(ranked) > len(head):
                # a selective filter: score the eligible matches themselves, a join per term
                # (a common term's postings keep only its newest _TERM_CAP: an older match
                # in this scope would not be among them)
                eligible: dict[int, float] = {}
                for term, weight in zip(found_terms, weights, strict=True):
                    for (rid,) in conn.execute(
                        f"SELECT r.rid FROM records_fts JOIN records r NOT INDEXED "
                        f"ON r.rid = records_fts.rowid WHERE records_fts MATCH ? AND {where}",
                        ['"' + term.replace('"', '""') + '"', *params],
                    ):
                        eligible[rid] = eligible.get(rid, 0.0) + weight
                head = sorted(eligible, key=lambda r: (-eligible[r], -r))[:limit]
                head_scores = [eligible[r] for r in head]
                found = self._fetch_rids(conn, head, where, params)
            best = [(r, sc) for r, sc in zip(head, head_scores, strict=True) if r in found]
        return [(_record(found[r], memo), float(sc)) for r, sc in best[:limit]]

    @staticmethod
    def _postings(
        conn: sqlite3.Connection, term: str, memo: SearchMemo | None, version: Any
    ) -> npt.NDArray[np.int64] | None:
        """The rowids matching ``term`` (its newest :data:`_TERM_CAP` at most, in no set
        order), or None; from the memo when this query already looked the term up in this
        database state. Read as one string that numpy parses: a third less time than a
        Python tuple per match (``bench/README.md``, "Speed of the default configuration")."""
        key = (term, version)
        if memo is not None and key in memo.postings:
            cached: npt.NDArray[np.int64] | None = memo.postings[key]
            return cached
        row = conn.execute(
            "SELECT group_concat(rowid, ' ') FROM (SELECT rowid FROM records_fts "
            "WHERE records_fts MATCH ? ORDER BY rowid DESC LIMIT ?)",
            ('"' + term.replace('"', '""') + '"', _TERM_CAP),
        ).fetchone()
        rids = np.fromstring(row[0], dtype=np.int64, sep=" ") if row and row[0] else None
        if memo is not None:
            memo.postings[key] = rids
        return rids

    def mean_words(self) -> float | None:
        """See :meth:`TenantStore.mean_words`: FTS5's own totals (its "averages" record: the
        row count and the token count, two varints), one small read."""
        with self._db.read("lexical statistics") as conn:
            row = conn.execute("SELECT block FROM records_fts_data WHERE id = 1").fetchone()
        numbers = _varints(bytes(row[0])) if row and row[0] else []
        if len(numbers) < 2 or numbers[0] <= 0:
            return None
        return numbers[1] / numbers[0]

    @staticmethod
    def _fetch_rids(
        conn: sqlite3.Connection, rids: list[int], where: str, params: list[Any]
    ) -> dict[int, tuple[Any, ...]]:
        """Rows with these rowids that pass the filter, by rowid. ``NOT INDEXED`` because with
        bound parameters the planner would rather walk the scope index than look up rowids."""
        found: dict[int, tuple[Any, ...]] = {}
        for at in range(0, len(rids), 500):
            part = rids[at : at + 500]
            for row in conn.execute(
                f"SELECT {_RCOLS} FROM records r NOT INDEXED WHERE r.rid IN "
                f"({','.join('?' * len(part))}) AND {where}",
                [*part, *params],
            ):
                found[row[0]] = row
        return found

    def vector_search(
        self,
        vector: Vector,
        flt: RecordFilter,
        limit: int,
        *,
        memo: SearchMemo | None = None,
    ) -> list[tuple[AnyRecord, float]]:
        if limit <= 0:
            return []
        where, params = schema.filter_sql(flt)
        want = limit * 2 + 8  # widened below when the SQL re-check drops candidates
        # one database state: the index reads the rows, then their vectors, then the rows
        # again; a record another process forgets in between must not be half-seen
        with self._db.snapshot("vector search") as conn:
            token = (conn.execute("PRAGMA data_version").fetchone()[0], self._db.writes)
            while True:
                cands = self._index.candidates(conn, token, vector, flt, want)
                if not cands:
                    return []
                sims = dict(cands)
                rids = list(sims)
                rows = []
                for start in range(0, len(rids), 500):
                    part = rids[start : start + 500]
                    rows += conn.execute(
                        f"SELECT {_RCOLS} FROM records r NOT INDEXED WHERE r.rid IN "
                        f"({','.join('?' * len(part))}) AND {where}",
                        [*part, *params],
                    ).fetchall()
                # metadata/key/session filters may drop candidates: widen until enough
                if len(rows) >= limit or len(cands) < want:
                    break
                want *= 4
        rows.sort(key=lambda r: -sims[r[0]])
        return [(_record(r, memo), sims[r[0]]) for r in rows[:limit]]

    def iter_records(self, prefix: str) -> Iterator[tuple[AnyRecord, list[float] | None]]:
        where, params = _within_sql(prefix, "r.scope")
        with self._db.read("export") as conn:
            rows = conn.execute(
                f"SELECT {_RCOLS}, v.vec FROM records r LEFT JOIN vectors v "
                f"ON v.rid = r.rid WHERE {where} ORDER BY r.rid",
                params,
            ).fetchall()
        for row in rows:
            vec = None if row[-1] is None else np.frombuffer(row[-1], np.float32).tolist()
            yield schema.row_to_record(row), vec

    def without_vectors(self, limit: int) -> list[tuple[str, str]]:
        with self._db.read("records without vectors") as conn:
            rows = conn.execute(
                "SELECT r.id, r.text FROM records r LEFT JOIN vectors v ON v.rid = r.rid "
                "WHERE v.rid IS NULL ORDER BY r.rid LIMIT ?",
                (limit,),
            ).fetchall()
        return [(str(i), str(t)) for i, t in rows]

    def set_vectors(self, pairs: Sequence[tuple[str, Vector]]) -> int:
        n = 0
        with self._db.write("set vectors") as conn:
            for rid, vec in pairs:
                cur = conn.execute(
                    "INSERT OR REPLACE INTO vectors (rid, vec) "
                    "SELECT rid, ? FROM records WHERE id = ?",
                    (_vec_blob(vec), rid),
                )
                n += max(cur.rowcount, 0)
        return n

    # -- profiles, policies, metadata -----------------------------------------------------
    @staticmethod
    def _profile(row: tuple[Any, ...]) -> Profile:
        return Profile(
            scope=row[0],
            data=json.loads(row[1]),
            json_schema=None if row[2] is None else json.loads(row[2]),
            updated_at=from_us(row[3]),
            version=row[4],
        )

    def get_profile(self, scope: str) -> Profile | None:
        with self._db.read("get profile") as conn:
            row = conn.execute(
                "SELECT scope, data, json_schema, updated_at, version FROM "
                "profiles WHERE scope = ?",
                (scope,),
            ).fetchone()
        return None if row is None else self._profile(row)

    def put_profile(self, profile: Profile, *, expect_version: int | None = None) -> Profile:
        with self._db.write("set profile") as conn:
            row = conn.execute(
                "SELECT version FROM profiles WHERE scope = ?", (profile.scope,)
            ).fetchone()
            stored = 0 if row is None else int(row[0])
            if expect_version is not None and stored != expect_version:
                raise profile_moved(profile.scope, expect_version)
            version = stored + 1
            conn.execute(
                "INSERT OR REPLACE INTO profiles (scope, data, json_schema, updated_at, version) "
                "VALUES (?, ?, ?, ?, ?)",
                (
                    profile.scope,
                    json.dumps(profile.data),
                    None if profile.json_schema is None else json.dumps(profile.json_schema),
                    to_us(profile.updated_at),
                    version,
                ),
            )
        return profile.model_copy(update={"version": version})

    def iter_profiles(self, prefix: str) -> Iterator[Profile]:
        where, params = _within_sql(prefix)
        with self._db.read("export profiles") as conn:
            rows = conn.execute(
                "SELECT scope, data, json_schema, updated_at, version FROM "
                f"profiles WHERE {where} ORDER BY scope",
                params,
            ).fetchall()
        yield from map(self._profile, rows)

    def get_policy(self, scope: str) -> Policy | None:
        with self._db.read("get policy") as conn:
            row = conn.execute(
                "SELECT retention_seconds, cache_ttl_seconds FROM policies WHERE scope = ?",
                (scope,),
            ).fetchone()
        return None if row is None else Policy(retention_seconds=row[0], cache_ttl_seconds=row[1])

    def set_policy(self, scope: str, policy: Policy) -> None:
        with self._db.write("set policy") as conn:
            conn.execute(
                "INSERT OR REPLACE INTO policies VALUES (?, ?, ?)",
                (scope, policy.retention_seconds, policy.cache_ttl_seconds),
            )

    def iter_policies(self, prefix: str) -> Iterator[tuple[str, Policy]]:
        where, params = _within_sql(prefix)
        with self._db.read("export policies") as conn:
            rows = conn.execute(
                "SELECT scope, retention_seconds, cache_ttl_seconds FROM policies "
                f"WHERE {where} ORDER BY scope",
                params,
            ).fetchall()
        for scope, retention, cache_ttl in rows:
            yield scope, Policy(retention_seconds=retention, cache_ttl_seconds=cache_ttl)

    def get_meta(self, key: str) -> str | None:
        with self._db.read("get meta") as conn:
            row = conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def set_meta(self, key: str, value: str) -> None:
        with self._db.write("set meta") as conn:
            conn.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))

    def claim_meta(self, key: str, value: str) -> str:
        with self._db.write("set meta") as conn:
            conn.execute("INSERT OR IGNORE INTO meta VALUES (?, ?)", (key, value))
            return str(conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()[0])

    def close(self) -> None:
        self._db.close()


class SQLiteBackend(MemoryBackend):
    """Tenants as files under ``directory``; tokens and audit log in ``_system.db``."""

    name = "sqlite"

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self._lock = threading.Lock()
        self._stores: dict[str, SQLiteTenantStore] = {}
        self._system: Conn | None = None
        self._closed = False

    def _check_open(self) -> None:
        """Raise :class:`StorageError` once closed (nothing is opened again); under ``_lock``."""
        if self._closed:
            raise StorageError(
                f"memory backend {self.directory} is closed", path=str(self.directory)
            )

    def _sys(self) -> Conn:
        with self._lock:
            self._check_open()
            if self._system is None:
                self._system = Conn(self.directory / "_system.db", schema.SYSTEM_MIGRATIONS)
            return self._system

    def tenant(self, tenant: str) -> TenantStore:
        check_name(tenant, "tenant name")
        with self._lock:
            self._check_open()
            store = self._stores.get(tenant)
            if store is None:
                store = SQLiteTenantStore(tenant, self.directory / f"{tenant}.db")
                self._stores[tenant] = store
            return store

    def tenants(self) -> list[str]:
        if not self.directory.is_dir():
            return []
        return sorted(p.stem for p in self.directory.glob("*.db") if not p.stem.startswith("_"))

    def put_token(self, token: TokenInfo) -> None:
        cols = TOKEN_COLUMNS.format(tenant="tenant")
        with self._sys().write("put token") as conn:
            conn.execute(
                f"INSERT OR REPLACE INTO tokens ({cols}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                token_to_row(token, json_text=True),
            )

    def get_token(self, token_hash: str) -> TokenInfo | None:
        cols = TOKEN_COLUMNS.format(tenant="tenant")
        with self._sys().read("get token") as conn:
            row = conn.execute(
                f"SELECT {cols} FROM tokens WHERE token_hash = ?", (token_hash,)
            ).fetchone()
        if row is None:
            return None
        return token_from_row(row, json_text=True)

    def list_tokens(self, tenant: str) -> list[TokenInfo]:
        cols = TOKEN_COLUMNS.format(tenant="tenant")
        with self._sys().read("list tokens") as conn:
            rows = conn.execute(
                f"SELECT {cols} FROM tokens WHERE tenant = ? ORDER BY created_at, token_hash",
                (tenant,),
            ).fetchall()
        return [token_from_row(r, json_text=True) for r in rows]

    def revoke_token(self, token_hash: str) -> bool:
        with self._sys().write("revoke token") as conn:
            return bool(
                conn.execute(
                    "UPDATE tokens SET revoked = 1 WHERE token_hash = ?", (token_hash,)
                ).rowcount
            )

    def append_audit(self, entry: AuditEntry) -> None:
        with self._sys().write("audit") as conn:
            conn.execute(
                "INSERT INTO audit (at, tenant, actor, action, scope, allowed, detail) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    to_us(entry.at),
                    entry.tenant,
                    entry.actor,
                    entry.action,
                    entry.scope,
                    int(entry.allowed),
                    json.dumps(entry.detail, default=str),
                ),
            )

    def audit_log(self, tenant: str | None = None, limit: int = 100) -> list[AuditEntry]:
        where, params = ("WHERE tenant = ?", [tenant]) if tenant is not None else ("", [])
        with self._sys().read("audit log") as conn:
            rows = conn.execute(
                "SELECT at, tenant, actor, action, scope, allowed, detail FROM "
                f"audit {where} ORDER BY seq DESC LIMIT ?",
                [*params, limit],
            ).fetchall()
        return [audit_from_row(r, json_text=True) for r in rows]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for store in self._stores.values():
                store.close()
            self._stores.clear()
            if self._system is not None:
                self._system.close()
                self._system = None
