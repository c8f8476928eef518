"""The scale-out backend: PostgreSQL + pgvector, many tenants in one database, isolated by
row-level security.

Isolation is enforced by the database, not by ``WHERE`` clauses: every query runs in a
transaction that first switches to the role ``torpor_app`` (no superuser, owns nothing) and
sets ``torpor.tenant`` for that transaction only (``set_config(..., true)``, i.e. ``SET
LOCAL``). The RLS policy on every table admits only rows of that tenant, for reads and writes,
so a query that forgot its tenant sees nothing and a write naming another tenant is refused
(SQLSTATE 42501, raised as :class:`~torpor.errors.AccessDenied` and written to the audit log).

Open with a DSN: ``PostgresBackend("postgresql://app@db/torpor")``. The schema is migrated on
open (see :mod:`._pg_schema`); that needs an owner-level role, so pass ``admin_dsn=`` when the
application's own login cannot run DDL. Connections come from ``psycopg_pool`` when installed,
else from a small built-in pool.

Lexical search is ``tsvector @@ tsquery`` ranked by ``ts_rank_cd``; vector search is pgvector
cosine distance, through a partial HNSW index per embedding dimension. Under RLS the HNSW scan
is filtered after the fact, so when it returns fewer rows than asked the query is re-run as an
exact scan of the tenant's visible rows: approximate search never hides a visible record that an
exact search would have returned within the limit.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from torpor.config import check_name
from torpor.errors import (
    AccessDenied,
    CorruptData,
    InvalidArgument,
    RecordNotFound,
    StorageError,
    TorporError,
)
from torpor.memory.backends import _pg_schema as schema
from torpor.memory.backends._pg_pool import Pool, make_pool
from torpor.memory.backends.base import AnyRecord, MemoryBackend, RecordFilter, TenantStore, Vector
from torpor.memory.models import AuditEntry, Fact, Grant, Policy, Profile, TokenInfo, from_us, to_us

log = logging.getLogger(__name__)

__all__ = ["PostgresBackend", "PostgresTenantStore"]

_RCOLS = ", ".join(f"r.{c}" for c in schema.COLUMNS.split(", "))
_T = schema.TENANT
_MAX_TERMS = 64
_PROFILE_COLS = "scope, data, json_schema, updated_at, version"


def translate(exc: psycopg.Error, what: str, tenant: str | None = None) -> TorporError:
    """The torpor error for a psycopg exception (by SQLSTATE class)."""
    state = getattr(exc, "sqlstate", None) or ""
    text = str(exc).strip()
    if state == "42501":
        return AccessDenied(f"{what}: refused by PostgreSQL (row-level security or "
                            f"privileges): {text}", exc=exc,
                            tenant=tenant, scope="")
    if state.startswith(("23", "22")) or isinstance(exc, psycopg.DataError):
        return InvalidArgument(f"{what}: {text}", exc=exc)
    if state in ("XX001", "XX002"):
        return CorruptData(f"{what}: PostgreSQL reports corrupt data: {text}", exc=exc)
    return StorageError(f"{what}: PostgreSQL failed: {text}", exc=exc, sqlstate=state or None)


def _vec_text(vector: Vector) -> str:
    return "[" + ",".join(repr(float(x)) for x in vector) + "]"


def _within_sql(prefix: str, column: str = "scope") -> tuple[str, list[Any]]:
    if not prefix:
        return "true", []
    return f"({column} = %s OR starts_with({column}, %s))", [prefix, prefix + "/"]


class PostgresTenantStore(TenantStore):
    """The records of one tenant: every transaction is pinned to it by RLS."""

    def __init__(self, backend: PostgresBackend, tenant: str) -> None:
        self.tenant = tenant
        self._backend = backend
        self._closed = False

    @contextmanager
    def _tx(self, what: str) -> Iterator[psycopg.Cursor[Any]]:
        if self._closed:
            raise StorageError(f"memory store of tenant {self.tenant!r} is closed",
                               tenant=self.tenant)
        with self._backend.transaction(what, self.tenant) as cur:
            yield cur

    def schema_version(self) -> int:
        with self._tx("schema version") as cur:
            row = cur.execute("SELECT coalesce(max(version), 0) FROM torpor.schema_version"
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
        return (*schema.record_to_row(rec), _vec_text(vec), len(vec))

    @staticmethod
    def _lock_keys(cur: psycopg.Cursor[Any], tenant: str, records: Sequence[AnyRecord]) -> None:
        # Writers of the same (scope, key) serialize here, in a fixed order so that two
        # batches locking several keys cannot deadlock.
        keys = sorted({f"{tenant}\x1f{r.scope}\x1f{r.key}" for r in records
                       if isinstance(r, Fact) and r.key is not None})
        for k in keys:
            cur.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (k,))

    def add(
        self, records: Sequence[AnyRecord], vectors: Sequence[Vector | None] | None = None
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
        self._backend.note_dims(vectors)
        return stored

    def _supersede(self, cur: psycopg.Cursor[Any], rec: Fact) -> Fact:
        row = cur.execute(
            f"SELECT id, valid_from FROM torpor.records WHERE tenant_id = {_T} AND scope = %s "
            "AND key = %s AND valid_to IS NULL", (rec.scope, rec.key)).fetchone()
        if row is None:
            return rec
        vf = max(to_us(rec.valid_from), int(row[1]) + 1)
        cur.execute(f"UPDATE torpor.records SET valid_to = %s, superseded_by = %s "
                    f"WHERE tenant_id = {_T} AND id = %s", (vf, rec.id, row[0]))
        if vf != to_us(rec.valid_from):
            rec = rec.model_copy(update={"valid_from": from_us(vf)})
        return rec

    def import_records(
        self, records: Sequence[AnyRecord], vectors: Sequence[Vector | None] | None = None
    ) -> int:
        if vectors is not None and len(vectors) != len(records):
            raise InvalidArgument("records and vectors differ in length")
        inserted = 0
        with self._tx("import") as cur:
            self._lock_keys(cur, self.tenant, records)
            for i, rec in enumerate(records):
                if cur.execute(f"SELECT 1 FROM torpor.records WHERE tenant_id = {_T} "
                               "AND id = %s", (rec.id,)).fetchone():
                    continue
                if isinstance(rec, Fact) and rec.key is not None and rec.valid_to is None:
                    row = cur.execute(
                        f"SELECT id, valid_from FROM torpor.records WHERE tenant_id = {_T} "
                        "AND scope = %s AND key = %s AND valid_to IS NULL",
                        (rec.scope, rec.key)).fetchone()
                    if row is not None and int(row[1]) < to_us(rec.valid_from):
                        cur.execute(f"UPDATE torpor.records SET valid_to = %s, superseded_by "
                                    f"= %s WHERE tenant_id = {_T} AND id = %s",
                                    (to_us(rec.valid_from), rec.id, row[0]))
                    elif row is not None:  # the existing fact is newer: import this one ended
                        rec = rec.model_copy(update={"valid_to": from_us(int(row[1])),
                                                     "superseded_by": row[0]})
                self._insert(cur, [self._row(rec, None if vectors is None else vectors[i])])
                inserted += 1
        self._backend.note_dims(vectors)
        return inserted

    def set_verification(
        self, record_id: str, *, verified: bool, stale: bool, source_hash: str | None
    ) -> None:
        with self._tx("verify") as cur:
            n = cur.execute(f"UPDATE torpor.records SET verified = %s, stale = %s, source_hash "
                            f"= %s WHERE tenant_id = {_T} AND id = %s",
                            (verified, stale, source_hash, record_id)).rowcount
        if not n:
            raise RecordNotFound(f"no record {record_id!r}", kind="record", name=record_id)

    def forget(self, ids: Sequence[str]) -> int:
        if not ids:
            return 0
        with self._tx("forget") as cur:
            return int(cur.execute(f"DELETE FROM torpor.records WHERE tenant_id = {_T} "
                                   "AND id = ANY(%s)", (list(ids),)).rowcount)

    def forget_scope(self, prefix: str) -> int:
        where, params = _within_sql(prefix)
        with self._tx("forget scope") as cur:
            n = cur.execute(f"DELETE FROM torpor.records WHERE tenant_id = {_T} AND {where}",
                            params).rowcount
            for table in ("profiles", "policies"):
                cur.execute(f"DELETE FROM torpor.{table} WHERE tenant_id = {_T} AND {where}",
                            params)
        return int(n)

    def cap_expiry(self, scope: str, retention_us: int) -> int:
        with self._tx("retention") as cur:
            return int(cur.execute(
                f"UPDATE torpor.records SET expires_at = created_at + %s WHERE tenant_id = {_T} "
                "AND scope = %s AND (expires_at IS NULL OR expires_at > created_at + %s)",
                (retention_us, scope, retention_us)).rowcount)

    def purge_expired(self, now: int) -> int:
        with self._tx("purge") as cur:
            return int(cur.execute(f"DELETE FROM torpor.records WHERE tenant_id = {_T} "
                                   "AND expires_at <= %s", (now,)).rowcount)

    # -- reads ----------------------------------------------------------------------------
    def get(self, ids: Sequence[str], now: int) -> list[AnyRecord]:
        if not ids:
            return []
        with self._tx("get") as cur:
            rows = cur.execute(
                f"SELECT {_RCOLS} FROM torpor.records r WHERE r.tenant_id = {_T} AND "
                "r.id = ANY(%s) AND (r.expires_at IS NULL OR r.expires_at > %s)",
                (list(ids), now)).fetchall()
        found = {rec.id: rec for rec in map(schema.row_to_record, rows)}
        return [found[i] for i in ids if i in found]

    def history(self, scope: str, key: str, now: int) -> list[Fact]:
        with self._tx("history") as cur:
            rows = cur.execute(
                f"SELECT {_RCOLS} FROM torpor.records r WHERE r.tenant_id = {_T} AND "
                "r.scope = %s AND r.key = %s AND r.kind = 'fact' AND "
                "(r.expires_at IS NULL OR r.expires_at > %s) ORDER BY r.valid_from, r.seq",
                (scope, key, now)).fetchall()
        return [r for r in map(schema.row_to_record, rows) if isinstance(r, Fact)]

    def scan(self, flt: RecordFilter, limit: int, *, newest_first: bool = True) -> list[AnyRecord]:
        order = "DESC" if newest_first else "ASC"
        # one index-ordered subquery per scope, merged: "scope = ANY(...) ORDER BY valid_from"
        # would read and sort every visible row of a large scope to return the newest few
        parts, params = [], []
        for scope in dict.fromkeys(flt.scopes):
            where, p = schema.filter_sql(replace(flt, scopes=[scope]))
            parts.append(f"(SELECT {_RCOLS}, r.seq FROM torpor.records r WHERE {where} "
                         f"ORDER BY r.valid_from {order}, r.seq {order} LIMIT %s)")
            params += [*p, max(limit, 0)]
        if not parts:
            return []
        with self._tx("scan") as cur:
            rows = cur.execute(f"SELECT * FROM ({' UNION ALL '.join(parts)}) AS u "
                               f"ORDER BY u.valid_from {order}, u.seq {order} LIMIT %s",
                               [*params, max(limit, 0)]).fetchall()
        return [schema.row_to_record(r) for r in rows]

    def count(self, flt: RecordFilter) -> int:
        where, params = schema.filter_sql(flt)
        with self._tx("count") as cur:
            row = cur.execute(f"SELECT count(*) FROM torpor.records r WHERE {where}",
                              params).fetchone()
        return int(row[0]) if row else 0

    def lexical_search(
        self, terms: Sequence[str], flt: RecordFilter, limit: int
    ) -> list[tuple[AnyRecord, float]]:
        terms = list(dict.fromkeys(t for t in terms if t))[:_MAX_TERMS]
        if not terms or limit <= 0 or not flt.scopes or not flt.kinds:
            return []
        # any of the terms: an OR of one plain query per term (no operator parsing at all)
        tsq = " || ".join(["plainto_tsquery('torpor.english', %s)"] * len(terms))
        where, params = schema.filter_sql(flt)
        scopes = list(flt.scopes)
        want = limit * 4 + 16
        with self._tx("lexical search") as cur:
            # candidates come ranked from the GIN index (see _pg_schema v4); the filter may
            # drop some (superseded, expired, other kinds): widen until enough or exhausted
            while True:
                rows = cur.execute(
                    f"SELECT {_RCOLS}, greatest(c.rank, 1e-9) AS s FROM "
                    f"torpor.lexical_candidates({tsq}, %s, %s) AS c "
                    f"JOIN torpor.records r ON r.tenant_id = {_T} AND r.id = c.id "
                    f"WHERE {where} ORDER BY s DESC, r.seq DESC LIMIT %s",
                    [*terms, scopes, want, *params, limit]).fetchall()
                if len(rows) >= limit:
                    break
                found = cur.execute(f"SELECT count(*) FROM torpor.lexical_candidates({tsq}, "
                                    "%s, %s)", [*terms, scopes, want]).fetchone()
                if found is None or int(found[0]) < want:
                    break
                want *= 4
        return [(schema.row_to_record(r), float(r[-1])) for r in rows]

    def vector_search(
        self, vector: Vector, flt: RecordFilter, limit: int
    ) -> list[tuple[AnyRecord, float]]:
        if limit <= 0 or len(vector) == 0:
            return []
        dim = len(vector)
        where, params = schema.filter_sql(flt)
        dist = f"(r.embedding::vector({dim}) <=> %s::vector({dim}))"
        query = (f"SELECT {_RCOLS}, 1 - {dist} AS sim FROM torpor.records r "
                 f"WHERE r.embedding_dim = {dim} AND {where} ORDER BY {dist} LIMIT %s")
        args = [_vec_text(vector), *params, _vec_text(vector), limit]
        with self._tx("vector search") as cur:
            # HNSW returns the nearest ef_search rows of the whole table, and RLS and the
            # filter apply afterwards: widen the beam, and if that still comes back short,
            # fall back to an exact scan, so the filter never costs a visible record.
            cur.execute("SELECT set_config('hnsw.ef_search', %s, true)",
                        (str(min(max(limit * 4, 40), 1000)),))
            rows = cur.execute(query, args).fetchall()
            if len(rows) < limit:
                cur.execute("SELECT set_config('enable_indexscan', 'off', true)")
                rows = cur.execute(query, args).fetchall()
        return [(schema.row_to_record(r), float(r[-1])) for r in rows]

    def iter_records(self, prefix: str) -> Iterator[tuple[AnyRecord, list[float] | None]]:
        where, params = _within_sql(prefix, "r.scope")
        with self._tx("export") as cur:
            rows = cur.execute(f"SELECT {_RCOLS}, r.embedding::text FROM torpor.records r "
                               f"WHERE r.tenant_id = {_T} AND {where} ORDER BY r.seq",
                               params).fetchall()
        for row in rows:
            vec = None if row[-1] is None else [float(x) for x in json.loads(row[-1])]
            yield schema.row_to_record(row), vec

    # -- profiles, policies, metadata -----------------------------------------------------
    @staticmethod
    def _profile(row: Any) -> Profile:
        return Profile(scope=row[0], data=row[1], json_schema=row[2],
                       updated_at=from_us(row[3]), version=row[4])

    def get_profile(self, scope: str) -> Profile | None:
        with self._tx("get profile") as cur:
            row = cur.execute(f"SELECT {_PROFILE_COLS} FROM torpor.profiles WHERE tenant_id = "
                              f"{_T} AND scope = %s", (scope,)).fetchone()
        return None if row is None else self._profile(row)

    def put_profile(self, profile: Profile) -> Profile:
        schema_doc = None if profile.json_schema is None else Jsonb(profile.json_schema)
        with self._tx("set profile") as cur:
            row = cur.execute(
                f"INSERT INTO torpor.profiles (tenant_id, {_PROFILE_COLS}) "
                f"VALUES ({_T}, %s, %s, %s, %s, 1) ON CONFLICT (tenant_id, scope) DO UPDATE SET "
                "data = EXCLUDED.data, json_schema = EXCLUDED.json_schema, "
                "updated_at = EXCLUDED.updated_at, version = torpor.profiles.version + 1 "
                "RETURNING version",
                (profile.scope, Jsonb(profile.data), schema_doc, to_us(profile.updated_at)),
            ).fetchone()
        return profile.model_copy(update={"version": int(row[0]) if row else 1})

    def iter_profiles(self, prefix: str) -> Iterator[Profile]:
        where, params = _within_sql(prefix)
        with self._tx("export profiles") as cur:
            rows = cur.execute(f"SELECT {_PROFILE_COLS} FROM torpor.profiles WHERE tenant_id = "
                               f"{_T} AND {where} ORDER BY scope", params).fetchall()
        yield from map(self._profile, rows)

    def get_policy(self, scope: str) -> Policy | None:
        with self._tx("get policy") as cur:
            row = cur.execute("SELECT retention_seconds, cache_ttl_seconds FROM torpor.policies "
                              f"WHERE tenant_id = {_T} AND scope = %s", (scope,)).fetchone()
        return None if row is None else Policy(retention_seconds=row[0], cache_ttl_seconds=row[1])

    def set_policy(self, scope: str, policy: Policy) -> None:
        with self._tx("set policy") as cur:
            cur.execute(f"INSERT INTO torpor.policies VALUES ({_T}, %s, %s, %s) "
                        "ON CONFLICT (tenant_id, scope) DO UPDATE SET retention_seconds = "
                        "EXCLUDED.retention_seconds, cache_ttl_seconds = EXCLUDED.cache_ttl_seconds",
                        (scope, policy.retention_seconds, policy.cache_ttl_seconds))

    def get_meta(self, key: str) -> str | None:
        with self._tx("get meta") as cur:
            row = cur.execute(f"SELECT value FROM torpor.meta WHERE tenant_id = {_T} AND key = %s",
                              (key,)).fetchone()
        return None if row is None else str(row[0])

    def set_meta(self, key: str, value: str) -> None:
        with self._tx("set meta") as cur:
            cur.execute(f"INSERT INTO torpor.meta VALUES ({_T}, %s, %s) ON CONFLICT "
                        "(tenant_id, key) DO UPDATE SET value = EXCLUDED.value", (key, value))

    def close(self) -> None:
        self._closed = True


class PostgresBackend(MemoryBackend):
    """All tenants in one PostgreSQL database (see the module docstring).

    ``dsn``: the application's connection string. ``admin_dsn``: a role that may run the
    migrations and create indexes (default: ``dsn``). ``pool_size``: connections kept open.
    ``hnsw_min_rows``: how many embeddings of one dimension (all tenants) before their HNSW
    index is built; until then vector search is an exact scan.
    Raises :class:`StorageError` when the server cannot be reached or migrated.
    """

    name = "postgres"

    def __init__(self, dsn: str, *, admin_dsn: str | None = None, pool_size: int = 4,
                 hnsw_min_rows: int = 20_000) -> None:
        self.dsn = dsn
        self.admin_dsn = admin_dsn or dsn
        self._lock = threading.Lock()
        self._stores: dict[str, PostgresTenantStore] = {}
        self.hnsw_min_rows = hnsw_min_rows
        self._indexed_dims: set[int] = set()
        self._vector_rows: dict[int, int] = {}
        self._index_failed = False
        self._migrate()
        self._pool: Pool | None = make_pool(dsn, pool_size)

    # -- connections ----------------------------------------------------------------------
    def _admin(self) -> psycopg.Connection[Any]:
        try:
            return psycopg.connect(self.admin_dsn, autocommit=True, connect_timeout=10)
        except psycopg.Error as exc:
            raise translate(exc, "connect to PostgreSQL") from exc

    def _migrate(self) -> None:
        with self._admin() as conn:
            try:
                version = schema.current_version(conn)
                if version > schema.LATEST:
                    raise StorageError(f"memory schema version {version} is newer than this "
                                       f"torpor ({schema.LATEST})", version=version)
                if version < schema.LATEST:
                    schema.migrate(conn)
                rows = conn.execute("SELECT indexname FROM pg_indexes WHERE schemaname = "
                                    "'torpor' AND indexname LIKE 'records\\_hnsw\\_%%'"
                                    ).fetchall()
            except psycopg.Error as exc:
                raise StorageError(f"cannot migrate the memory schema to version "
                                   f"{schema.LATEST}: {str(exc).strip()} (migrations need a role "
                                   "that may create schemas, roles and extensions: pass "
                                   "admin_dsn=)", exc=exc) from exc
        self._indexed_dims = {int(r[0].rsplit("_", 1)[1]) for r in rows}

    def note_dims(self, vectors: Sequence[Vector | None] | None) -> None:
        """Count new embeddings per dimension; build that dimension's HNSW index once it holds
        ``hnsw_min_rows`` of them.

        Below that size an exact scan of the visible rows is fast and inserts stay cheap (an
        HNSW insert costs milliseconds). The index is built ``CONCURRENTLY``, so other writers
        go on meanwhile. Index DDL needs the owner: with a login that cannot run it, search
        stays exact (correct, slower) and a warning is logged once.
        """
        if not vectors or self._index_failed:
            return
        added: dict[int, int] = {}
        for v in vectors:
            if v is not None and len(v) not in self._indexed_dims:
                added[len(v)] = added.get(len(v), 0) + 1
        for dim, n in sorted(added.items()):
            with self._lock:
                if dim not in self._vector_rows:
                    self._vector_rows[dim] = self._count_vectors(dim)
                else:
                    self._vector_rows[dim] += n
                if self._vector_rows[dim] < self.hnsw_min_rows:
                    continue
            self._build_hnsw(dim)

    def _count_vectors(self, dim: int) -> int:
        try:
            with self._admin() as conn:
                row = conn.execute("SELECT count(*) FROM torpor.records WHERE embedding_dim = %s",
                                   (dim,)).fetchone()
        except (psycopg.Error, StorageError):
            log.warning("cannot count %d-dimension embeddings", dim, exc_info=True)
            return 0
        return int(row[0]) if row else 0

    def _build_hnsw(self, dim: int) -> None:
        log.info("building the HNSW index for %d-dimension embeddings", dim)
        try:
            with self._admin() as conn:
                conn.execute("SET maintenance_work_mem = '256MB'")
                conn.execute(schema.hnsw_index_sql(dim))
        except (psycopg.Error, StorageError) as exc:
            self._index_failed = True
            log.warning("cannot create the HNSW index for %d dimensions (vector search "
                        "stays exact): %s", dim, exc)
            return
        self._indexed_dims.add(dim)

    @contextmanager
    def transaction(self, what: str, tenant: str | None) -> Iterator[psycopg.Cursor[Any]]:
        """A cursor in a transaction running as ``torpor_app`` with ``torpor.tenant`` set to
        ``tenant`` (None: unset, so tenant rows are invisible). Commits when the block ends,
        rolls back on an exception. Raises torpor errors only (psycopg's are translated)."""
        pool = self._pool
        if pool is None:
            raise StorageError("the PostgreSQL memory backend is closed")
        try:
            with pool.connection() as conn, conn.transaction(), conn.cursor() as cur:
                cur.execute("SELECT set_config('role', %s, true), "
                            "set_config('torpor.tenant', %s, true)",
                            (schema.APP_ROLE, tenant or ""))
                yield cur
        except psycopg.Error as exc:
            err = translate(exc, what, tenant)
            if isinstance(err, AccessDenied) and tenant:
                self._audit_violation(tenant, what, str(exc))
            raise err from exc

    def _audit_violation(self, tenant: str, what: str, message: str) -> None:
        try:
            self.append_audit(AuditEntry(at=from_us(time.time_ns() // 1000), tenant=tenant,
                                         actor="postgres-rls", action=what, allowed=False,
                                         detail={"error": message}))
        except StorageError:
            log.exception("could not audit an RLS violation for tenant %r", tenant)

    # -- tenants ----------------------------------------------------------------------------
    def tenant(self, tenant: str) -> TenantStore:
        check_name(tenant, "tenant name")
        with self._lock:
            store = self._stores.get(tenant)
            if store is not None:
                return store
        with self.transaction("create tenant", tenant) as cur:
            cur.execute(f"INSERT INTO torpor.tenants VALUES ({_T}, %s) ON CONFLICT DO NOTHING",
                        (time.time_ns() // 1000,))
        with self._lock:
            return self._stores.setdefault(tenant, PostgresTenantStore(self, tenant))

    def tenants(self) -> list[str]:
        with self.transaction("list tenants", None) as cur:
            return [str(r[0]) for r in cur.execute("SELECT * FROM torpor.tenant_names()")]

    # -- tokens and audit -----------------------------------------------------------------
    def put_token(self, token: TokenInfo) -> None:
        with self.transaction("put token", token.tenant) as cur:
            cur.execute(
                f"INSERT INTO torpor.tokens VALUES (%s, {_T}, %s, %s, %s, %s) "
                "ON CONFLICT (token_hash) DO UPDATE SET grants = EXCLUDED.grants, "
                "name = EXCLUDED.name, created_at = EXCLUDED.created_at, "
                "revoked = EXCLUDED.revoked",
                (token.token_hash, Jsonb([g.model_dump() for g in token.grants]), token.name,
                 to_us(token.created_at), token.revoked))

    def get_token(self, token_hash: str) -> TokenInfo | None:
        with self.transaction("get token", None) as cur:
            row = cur.execute("SELECT token_hash, tenant_id, grants, name, created_at, revoked "
                              "FROM torpor.token_by_hash(%s)", (token_hash,)).fetchone()
        if row is None:
            return None
        return TokenInfo(token_hash=row[0], tenant=row[1], grants=[Grant(**g) for g in row[2]],
                         name=row[3], created_at=from_us(row[4]), revoked=bool(row[5]))

    def revoke_token(self, token_hash: str) -> bool:
        token = self.get_token(token_hash)
        if token is None:
            return False
        with self.transaction("revoke token", token.tenant) as cur:
            return bool(cur.execute(f"UPDATE torpor.tokens SET revoked = true WHERE tenant_id = "
                                    f"{_T} AND token_hash = %s", (token_hash,)).rowcount)

    def append_audit(self, entry: AuditEntry) -> None:
        detail = json.loads(json.dumps(entry.detail, default=str))
        with self.transaction("audit", entry.tenant or None) as cur:
            cur.execute("SELECT torpor.audit_append(%s, %s, %s, %s, %s, %s, %s)",
                        (entry.tenant, to_us(entry.at), entry.actor, entry.action, entry.scope,
                         entry.allowed, Jsonb(detail)))

    def audit_log(self, tenant: str | None = None, limit: int = 100) -> list[AuditEntry]:
        cols = "at, tenant_id, actor, action, scope, allowed, detail"
        with self.transaction("audit log", tenant) as cur:
            if tenant is None:
                rows = cur.execute(f"SELECT {cols} FROM torpor.audit_recent(%s)",
                                   (limit,)).fetchall()
            else:
                rows = cur.execute(f"SELECT {cols} FROM torpor.audit WHERE tenant_id = {_T} "
                                   "ORDER BY seq DESC LIMIT %s", (limit,)).fetchall()
        return [AuditEntry(at=from_us(r[0]), tenant=r[1], actor=r[2], action=r[3], scope=r[4],
                           allowed=bool(r[5]), detail=r[6]) for r in rows]

    def close(self) -> None:
        with self._lock:
            for store in self._stores.values():
                store.close()
            self._stores.clear()
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()
