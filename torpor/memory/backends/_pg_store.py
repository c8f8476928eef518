"""The records of one tenant in the PostgreSQL backend (see :mod:`.postgres`).

Every method is one transaction from its backend's ``transaction`` (:class:`Transactions`,
:meth:`~torpor.memory.backends.postgres.PostgresBackend.transaction`), which runs as
``torpor_app`` with ``torpor.tenant`` set: row-level security confines each statement to this
store's tenant whatever its ``WHERE`` says. The explicit ``tenant_id = <setting>`` in queries
is for the planner (it matches the leading column of every index), not for isolation.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import replace
from typing import Any, Protocol

import psycopg
from psycopg.types.json import Jsonb

from torpor.errors import InvalidArgument, RecordNotFound, StorageError
from torpor.memory.backends import _pg_schema as schema
from torpor.memory.backends.base import (
    MAX_LEXICAL_TERMS,
    AnyRecord,
    RecordFilter,
    SearchMemo,
    TenantStore,
    Vector,
    check_record_quota,
    profile_moved,
    successor,
)
from torpor.memory.models import LAST_US, Episode, Fact, Policy, Profile, from_us, to_us

__all__ = ["PostgresTenantStore", "Transactions", "vec_text"]

_RCOLS = ", ".join(f"r.{c}" for c in schema.COLUMNS.split(", "))
_T = schema.TENANT
_PROFILE_COLS = "scope, data, json_schema, updated_at, version"
#: the most candidates ``lexical_candidates()`` takes (its limit is an ``integer``)
_MAX_CANDIDATES = 2**31 - 1


def vec_text(vector: Vector) -> str:
    """pgvector's text form of ``vector`` (``[0.1,0.2]``); NaN is refused by the server."""
    return "[" + ",".join(repr(float(x)) for x in vector) + "]"


def _within_sql(prefix: str, column: str = "scope") -> tuple[str, list[Any]]:
    # component-wise: "app/a" covers "app/a/user/u", not "app/ab" (and LIKE would treat the
    # "_" allowed in names as a wildcard)
    if not prefix:
        return "true", []
    return f"({column} = %s OR starts_with({column}, %s))", [prefix, prefix + "/"]


class Transactions(Protocol):
    """What a :class:`PostgresTenantStore` uses of the
    :class:`~torpor.memory.backends.postgres.PostgresBackend` that made it (a protocol, so the
    backend imports this module and never the reverse)."""

    def transaction(
        self, what: str, tenant: str | None
    ) -> AbstractContextManager[psycopg.Cursor[Any]]:
        """A cursor in a transaction pinned to ``tenant`` by row-level security."""
        ...

    def note_dims(self, vectors: Sequence[Vector | None] | None) -> None:
        """Count new embeddings per dimension (the backend builds HNSW indexes from them)."""
        ...


class PostgresTenantStore(TenantStore):
    """The records of one tenant: every transaction is pinned to it by RLS."""

    def __init__(self, backend: Transactions, tenant: str) -> None:
        self.tenant = tenant
        self._backend = backend
        self._closed = False

    @contextmanager
    def _tx(self, what: str) -> Iterator[psycopg.Cursor[Any]]:
        if self._closed:
            raise StorageError(
                f"memory store of tenant {self.tenant!r} is closed", tenant=self.tenant
            )
        with self._backend.transaction(what, self.tenant) as cur:
            yield cur

    def schema_version(self) -> int:
        with self._tx("schema version") as cur:
            row = cur.execute(
                "SELECT coalesce(max(version), 0) FROM torpor.schema_version"
            ).fetchone()
        return int(row[0]) if row else 0

    # -- writes ---------------------------------------------------------------------------
    def _insert(self, cur: psycopg.Cursor[Any], rows: list[tuple[Any, ...]]) -> None:
        if rows:
            cur.executemany(schema.INSERT_SQL, rows)
            rows.clear()

    @staticmethod
    def _row(rec: AnyRecord, vec: Vector | None) -> tuple[Any, ...]:
        if vec is None:
            return (*schema.record_to_row(rec), None, None)
        return (*schema.record_to_row(rec), vec_text(vec), len(vec))

    @staticmethod
    def _lock_keys(cur: psycopg.Cursor[Any], tenant: str, records: Sequence[AnyRecord]) -> None:
        # Writers of the same (scope, key) serialize here, in a fixed order so that two
        # batches locking several keys cannot deadlock.
        keys = sorted(
            {
                f"{tenant}\x1f{r.scope}\x1f{r.key}"
                for r in records
                if isinstance(r, Fact) and r.key is not None
            }
        )
        for k in keys:
            cur.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (k,))

    def _check_quota(self, cur: psycopg.Cursor[Any], quota: int | None, added: int) -> None:
        """After this transaction inserted ``added`` records: refuse (and so roll back) if the
        tenant now holds more than ``quota``. The insert's trigger updated the tenant's row,
        so a concurrent writer of the same tenant waits for this one: the count is exact."""
        if quota is None or not added:
            return
        check_record_quota(self.tenant, quota, self._count(cur) - added, added)

    @staticmethod
    def _count(cur: psycopg.Cursor[Any]) -> int:
        row = cur.execute(f"SELECT records FROM torpor.tenants WHERE tenant_id = {_T}").fetchone()
        return int(row[0]) if row else 0

    def record_count(self) -> int:
        with self._tx("record count") as cur:
            return self._count(cur)

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
        with self._tx("add") as cur:
            self._lock_keys(cur, self.tenant, records)
            pending: list[tuple[Any, ...]] = []
            for i, rec in enumerate(records):
                if isinstance(rec, Fact) and rec.key is not None:
                    self._insert(cur, pending)  # keep insertion order
                    rec = self._supersede(cur, rec)
                pending.append(self._row(rec, None if vectors is None else vectors[i]))
                stored.append(rec)
            self._insert(cur, pending)
            self._check_quota(cur, quota, len(stored))
        self._backend.note_dims(vectors)
        return stored

    def _supersede(self, cur: psycopg.Cursor[Any], rec: Fact) -> Fact:
        row = cur.execute(
            f"SELECT id, valid_from FROM torpor.records WHERE tenant_id = {_T} AND scope = %s "
            "AND key = %s AND valid_to IS NULL",
            (rec.scope, rec.key),
        ).fetchone()
        if row is None:
            return rec
        rec = successor(rec, int(row[1]))
        cur.execute(
            f"UPDATE torpor.records SET valid_to = %s, superseded_by = %s "
            f"WHERE tenant_id = {_T} AND id = %s",
            (to_us(rec.valid_from), rec.id, row[0]),
        )
        return rec

    def import_records(
        self,
        records: Sequence[AnyRecord],
        vectors: Sequence[Vector | None] | None = None,
        *,
        quota: int | None = None,
    ) -> int:
        if vectors is not None and len(vectors) != len(records):
            raise InvalidArgument("records and vectors differ in length")
        inserted = 0
        with self._tx("import") as cur:
            self._lock_keys(cur, self.tenant, records)
            for i, rec in enumerate(records):
                if cur.execute(
                    f"SELECT 1 FROM torpor.records WHERE tenant_id = {_T} AND id = %s", (rec.id,)
                ).fetchone():
                    continue
                if isinstance(rec, Fact) and rec.key is not None and rec.valid_to is None:
                    row = cur.execute(
                        f"SELECT id, valid_from FROM torpor.records WHERE tenant_id = {_T} "
                        "AND scope = %s AND key = %s AND valid_to IS NULL",
                        (rec.scope, rec.key),
                    ).fetchone()
                    if row is not None and int(row[1]) < to_us(rec.valid_from):
                        cur.execute(
                            f"UPDATE torpor.records SET valid_to = %s, superseded_by "
                            f"= %s WHERE tenant_id = {_T} AND id = %s",
                            (to_us(rec.valid_from), rec.id, row[0]),
                        )
                    elif row is not None:  # the existing fact is newer: import this one ended
                        rec = rec.model_copy(
                            update={"valid_to": from_us(int(row[1])), "superseded_by": row[0]}
                        )
                # a concurrent import of the same record wins: this one skips it, as above
                cur.execute(
                    schema.INSERT_SQL + " ON CONFLICT (tenant_id, id) DO NOTHING",
                    self._row(rec, None if vectors is None else vectors[i]),
                )
                inserted += max(cur.rowcount, 0)
            self._check_quota(cur, quota, inserted)
        self._backend.note_dims(vectors)
        return inserted

    def set_verification(
        self, record_id: str, *, verified: bool, stale: bool, source_hash: str | None
    ) -> None:
        with self._tx("verify") as cur:
            n = cur.execute(
                f"UPDATE torpor.records SET verified = %s, stale = %s, source_hash "
                f"= %s WHERE tenant_id = {_T} AND id = %s",
                (verified, stale, source_hash, record_id),
            ).rowcount
        if not n:
            raise RecordNotFound(f"no record {record_id!r}", kind="record", name=record_id)

    def forget(self, ids: Sequence[str]) -> int:
        if not ids:
            return 0
        with self._tx("forget") as cur:
            return int(
                cur.execute(
                    f"DELETE FROM torpor.records WHERE tenant_id = {_T} AND id = ANY(%s)",
                    (list(ids),),
                ).rowcount
            )

    def forget_scope(self, prefix: str) -> int:
        where, params = _within_sql(prefix)
        with self._tx("forget scope") as cur:
            n = cur.execute(
                f"DELETE FROM torpor.records WHERE tenant_id = {_T} AND {where}", params
            ).rowcount
            for table in ("profiles", "policies"):
                cur.execute(
                    f"DELETE FROM torpor.{table} WHERE tenant_id = {_T} AND {where}", params
                )
        return int(n)

    def cap_expiry(self, scope: str, retention_us: int) -> int:
        with self._tx("retention") as cur:
            return int(
                cur.execute(
                    "UPDATE torpor.records SET expires_at = least(created_at + %s, %s) "
                    f"WHERE tenant_id = {_T} AND scope = %s "
                    "AND (expires_at IS NULL OR expires_at > least(created_at + %s, %s))",
                    (retention_us, LAST_US, scope, retention_us, LAST_US),
                ).rowcount
            )

    def purge_expired(self, now: int) -> int:
        with self._tx("purge") as cur:
            return int(
                cur.execute(
                    f"DELETE FROM torpor.records WHERE tenant_id = {_T} AND expires_at <= %s",
                    (now,),
                ).rowcount
            )

    # -- reads ----------------------------------------------------------------------------
    def get(self, ids: Sequence[str], now: int) -> list[AnyRecord]:
        if not ids:
            return []
        with self._tx("get") as cur:
            rows = cur.execute(
                f"SELECT {_RCOLS} FROM torpor.records r WHERE r.tenant_id = {_T} AND "
                "r.id = ANY(%s) AND (r.expires_at IS NULL OR r.expires_at > %s)",
                (list(ids), now),
            ).fetchall()
        found = {rec.id: rec for rec in map(schema.row_to_record, rows)}
        return [found[i] for i in ids if i in found]

    def history(self, scope: str, key: str, now: int) -> list[Fact]:
        with self._tx("history") as cur:
            rows = cur.execute(
                f"SELECT {_RCOLS} FROM torpor.records r WHERE r.tenant_id = {_T} AND "
                "r.scope = %s AND r.key = %s AND r.kind = 'fact' AND "
                "(r.expires_at IS NULL OR r.expires_at > %s) ORDER BY r.valid_from, r.seq",
                (scope, key, now),
            ).fetchall()
        return [r for r in map(schema.row_to_record, rows) if isinstance(r, Fact)]

    def scan(
        self, flt: RecordFilter, limit: int, *, newest_first: bool = True, offset: int = 0
    ) -> list[AnyRecord]:
        order = "DESC" if newest_first else "ASC"
        offset = max(offset, 0)
        # one index-ordered subquery per scope, merged: "scope = ANY(...) ORDER BY valid_from"
        # would read and sort every visible row of a large scope to return the newest few
        parts, params = [], []
        for scope in dict.fromkeys(flt.scopes):
            where, p = schema.filter_sql(replace(flt, scopes=[scope]))
            parts.append(
                f"(SELECT {_RCOLS}, r.seq FROM torpor.records r WHERE {where} "
                f"ORDER BY r.valid_from {order}, r.seq {order} LIMIT %s)"
            )
            params += [*p, max(limit, 0) + offset]  # a page may come from any one scope
        if not parts:
            return []
        with self._tx("scan") as cur:
            rows = cur.execute(
                f"SELECT * FROM ({' UNION ALL '.join(parts)}) AS u "
                f"ORDER BY u.valid_from {order}, u.seq {order} LIMIT %s OFFSET %s",
                [*params, max(limit, 0), offset],
            ).fetchall()
        return [schema.row_to_record(r) for r in rows]

    def previous_episodes(self, episodes: Sequence[Episode], flt: RecordFilter) -> dict[str, str]:
        """See :meth:`TenantStore.previous_episodes`: one statement, a lateral lookup per
        episode on the (tenant, scope, valid_from, seq) index."""
        ids = [ep.id for ep in episodes]
        if not ids:
            return {}
        where, params = schema.filter_sql(replace(flt, kinds=("episode",)))
        with self._tx("previous episodes") as cur:
            rows = cur.execute(
                "SELECT c.id, p.id FROM torpor.records c CROSS JOIN LATERAL "
                f"(SELECT r.id FROM torpor.records r WHERE {where} AND r.scope = c.scope "
                "AND r.session IS NOT DISTINCT FROM c.session "
                "AND (r.valid_from, r.seq) < (c.valid_from, c.seq) "
                "ORDER BY r.valid_from DESC, r.seq DESC LIMIT 1) p "
                f"WHERE c.tenant_id = {_T} AND c.id = ANY(%s) AND c.kind = 'episode'",
                [*params, ids],
            ).fetchall()
        return {str(c): str(p) for c, p in rows}

    def count(self, flt: RecordFilter) -> int:
        where, params = schema.filter_sql(flt)
        with self._tx("count") as cur:
            row = cur.execute(
                f"SELECT count(*) FROM torpor.records r WHERE {where}", params
            ).fetchone()
        return int(row[0]) if row else 0

    def lexical_search(
        self,
        terms: Sequence[str],
        flt: RecordFilter,
        limit: int,
        *,
        memo: SearchMemo | None = None,  # rows hold JSON as dicts (unhashable): not used
    ) -> list[tuple[AnyRecord, float]]:
        terms = list(dict.fromkeys(t for t in terms if t))[:MAX_LEXICAL_TERMS]
        if not terms or limit <= 0 or not flt.scopes or not flt.kinds:
            return []
        # any of the terms: an OR of one plain query per term (no operator parsing at all)
        tsq = " || ".join(["plainto_tsquery('torpor.english', %s)"] * len(terms))
        where, params = schema.filter_sql(flt)
        scopes = list(flt.scopes)
        want = min(limit * 4 + 16, _MAX_CANDIDATES)
        with self._tx("lexical search") as cur:
            # candidates come ranked from the GIN index (see _pg_schema v4); the filter may
            # drop some (superseded, expired, other kinds): widen until enough or exhausted
            while True:
                rows = cur.execute(
                    f"SELECT {_RCOLS}, greatest(c.rank, 1e-9) AS s FROM "
                    f"torpor.lexical_candidates({tsq}, %s, %s) AS c "
                    f"JOIN torpor.records r ON r.tenant_id = {_T} AND r.id = c.id "
                    f"WHERE {where} ORDER BY s DESC, r.seq DESC LIMIT %s",
                    [*terms, scopes, want, *params, limit],
                ).fetchall()
                if len(rows) >= limit:
                    break
                found = cur.execute(
                    f"SELECT count(*) FROM torpor.lexical_candidates({tsq}, %s, %s)",
                    [*terms, scopes, want],
                ).fetchone()
                if found is None or int(found[0]) < want or want == _MAX_CANDIDATES:
                    break
                want = min(want * 4, _MAX_CANDIDATES)
        return [(schema.row_to_record(r), float(r[-1])) for r in rows]

    def vector_search(
        self,
        vector: Vector,
        flt: RecordFilter,
        limit: int,
        *,
        memo: SearchMemo | None = None,  # as in lexical_search: not used
    ) -> list[tuple[AnyRecord, float]]:
        if limit <= 0 or len(vector) == 0:
            return []
        dim = len(vector)
        where, params = schema.filter_sql(flt)
        dist = f"(r.embedding::vector({dim}) <=> %s::vector({dim}))"
        query = (
            f"SELECT {_RCOLS}, 1 - {dist} AS sim FROM torpor.records r "
            f"WHERE r.embedding_dim = {dim} AND {where} ORDER BY {dist} LIMIT %s"
        )
        args = [vec_text(vector), *params, vec_text(vector), limit]
        with self._tx("vector search") as cur:
            # HNSW returns the nearest ef_search rows of the whole table, and RLS and the
            # filter apply afterwards: widen the beam, and if that still comes back short,
            # fall back to an exact scan, so the filter never costs a visible record.
            cur.execute(
                "SELECT set_config('hnsw.ef_search', %s, true)",
                (str(min(max(limit * 4, 40), 1000)),),
            )
            rows = cur.execute(query, args).fetchall()
            if len(rows) < limit:
                cur.execute("SELECT set_config('enable_indexscan', 'off', true)")
                rows = cur.execute(query, args).fetchall()
        return [(schema.row_to_record(r), float(r[-1])) for r in rows]

    def iter_records(self, prefix: str) -> Iterator[tuple[AnyRecord, list[float] | None]]:
        where, params = _within_sql(prefix, "r.scope")
        with self._tx("export") as cur:
            rows = cur.execute(
                f"SELECT {_RCOLS}, r.embedding::text FROM torpor.records r "
                f"WHERE r.tenant_id = {_T} AND {where} ORDER BY r.seq",
                params,
            ).fetchall()
        for row in rows:
            vec = None if row[-1] is None else [float(x) for x in json.loads(row[-1])]
            yield schema.row_to_record(row), vec

    def without_vectors(self, limit: int) -> list[tuple[str, str]]:
        with self._tx("records without vectors") as cur:
            rows = cur.execute(
                f"SELECT id, text FROM torpor.records WHERE tenant_id = {_T} "
                "AND embedding IS NULL ORDER BY seq LIMIT %s",
                (limit,),
            ).fetchall()
        return [(str(i), str(t)) for i, t in rows]

    def set_vectors(self, pairs: Sequence[tuple[str, Vector]]) -> int:
        n = 0
        with self._tx("set vectors") as cur:
            for rid, vec in pairs:
                cur.execute(
                    "UPDATE torpor.records SET embedding = %s, embedding_dim = %s "
                    f"WHERE tenant_id = {_T} AND id = %s",
                    (vec_text(vec), len(vec), rid),
                )
                n += max(cur.rowcount, 0)
        self._backend.note_dims([v for _, v in pairs])
        return n

    # -- profiles, policies, metadata -----------------------------------------------------
    @staticmethod
    def _profile(row: Any) -> Profile:
        return Profile(
            scope=row[0],
            data=row[1],
            json_schema=row[2],
            updated_at=from_us(row[3]),
            version=row[4],
        )

    def get_profile(self, scope: str) -> Profile | None:
        with self._tx("get profile") as cur:
            row = cur.execute(
                f"SELECT {_PROFILE_COLS} FROM torpor.profiles WHERE tenant_id = "
                f"{_T} AND scope = %s",
                (scope,),
            ).fetchone()
        return None if row is None else self._profile(row)

    def put_profile(self, profile: Profile, *, expect_version: int | None = None) -> Profile:
        schema_doc = None if profile.json_schema is None else Jsonb(profile.json_schema)
        values = (profile.scope, Jsonb(profile.data), schema_doc, to_us(profile.updated_at))
        insert = (
            f"INSERT INTO torpor.profiles (tenant_id, {_PROFILE_COLS}) "
            f"VALUES ({_T}, %s, %s, %s, %s, 1) ON CONFLICT (tenant_id, scope) "
        )
        with self._tx("set profile") as cur:
            if expect_version is None:
                row = cur.execute(
                    insert + "DO UPDATE SET data = EXCLUDED.data, "
                    "json_schema = EXCLUDED.json_schema, updated_at = EXCLUDED.updated_at, "
                    "version = torpor.profiles.version + 1 RETURNING version",
                    values,
                ).fetchone()
            elif expect_version == 0:  # none stored: a concurrent insert wins, this one not
                row = cur.execute(insert + "DO NOTHING RETURNING version", values).fetchone()
            else:  # a concurrent update takes the row first: this WHERE then fails
                row = cur.execute(
                    "UPDATE torpor.profiles SET data = %s, json_schema = %s, updated_at = %s, "
                    f"version = version + 1 WHERE tenant_id = {_T} AND scope = %s "
                    "AND version = %s RETURNING version",
                    (*values[1:], profile.scope, expect_version),
                ).fetchone()
            if row is None and expect_version is not None:
                raise profile_moved(profile.scope, expect_version)
        return profile.model_copy(update={"version": int(row[0]) if row else 1})

    def iter_profiles(self, prefix: str) -> Iterator[Profile]:
        where, params = _within_sql(prefix)
        with self._tx("export profiles") as cur:
            rows = cur.execute(
                f"SELECT {_PROFILE_COLS} FROM torpor.profiles WHERE tenant_id = "
                f"{_T} AND {where} ORDER BY scope",
                params,
            ).fetchall()
        yield from map(self._profile, rows)

    def get_policy(self, scope: str) -> Policy | None:
        with self._tx("get policy") as cur:
            row = cur.execute(
                "SELECT retention_seconds, cache_ttl_seconds FROM torpor.policies "
                f"WHERE tenant_id = {_T} AND scope = %s",
                (scope,),
            ).fetchone()
        return None if row is None else Policy(retention_seconds=row[0], cache_ttl_seconds=row[1])

    def set_policy(self, scope: str, policy: Policy) -> None:
        with self._tx("set policy") as cur:
            cur.execute(
                f"INSERT INTO torpor.policies VALUES ({_T}, %s, %s, %s) "
                "ON CONFLICT (tenant_id, scope) DO UPDATE SET retention_seconds = "
                "EXCLUDED.retention_seconds, cache_ttl_seconds = EXCLUDED.cache_ttl_seconds",
                (scope, policy.retention_seconds, policy.cache_ttl_seconds),
            )

    def iter_policies(self, prefix: str) -> Iterator[tuple[str, Policy]]:
        where, params = _within_sql(prefix)
        with self._tx("export policies") as cur:
            rows = cur.execute(
                "SELECT scope, retention_seconds, cache_ttl_seconds FROM torpor.policies "
                f"WHERE tenant_id = {_T} AND {where} ORDER BY scope",
                params,
            ).fetchall()
        for scope, retention, cache_ttl in rows:
            yield scope, Policy(retention_seconds=retention, cache_ttl_seconds=cache_ttl)

    def get_meta(self, key: str) -> str | None:
        with self._tx("get meta") as cur:
            row = cur.execute(
                f"SELECT value FROM torpor.meta WHERE tenant_id = {_T} AND key = %s", (key,)
            ).fetchone()
        return None if row is None else str(row[0])

    def set_meta(self, key: str, value: str) -> None:
        with self._tx("set meta") as cur:
            cur.execute(
                f"INSERT INTO torpor.meta VALUES ({_T}, %s, %s) ON CONFLICT "
                "(tenant_id, key) DO UPDATE SET value = EXCLUDED.value",
                (key, value),
            )

    def claim_meta(self, key: str, value: str) -> str:
        with self._tx("set meta") as cur:
            cur.execute(
                f"INSERT INTO torpor.meta VALUES ({_T}, %s, %s) ON CONFLICT DO NOTHING",
                (key, value),
            )
            row = cur.execute(
                f"SELECT value FROM torpor.meta WHERE tenant_id = {_T} AND key = %s", (key,)
            ).fetchone()
        return value if row is None else str(row[0])

    def close(self) -> None:
        self._closed = True
