"""The scale-out backend: PostgreSQL + pgvector, many tenants in one database, isolated by
row-level security.

Isolation is enforced by the database, not by ``WHERE`` clauses: every query runs in a
transaction that first switches to the role ``torpor_app`` (no superuser, owns nothing) and
sets ``torpor.tenant`` for that transaction only (``set_config(..., true)``, i.e. ``SET
LOCAL``). The RLS policy on every table admits only rows of that tenant, for reads and writes,
so a query that forgot its tenant sees nothing and a write naming another tenant is refused
(SQLSTATE 42501, raised as :class:`~torpor.errors.AccessDenied` and written to the audit log).

**The tenant is proven, not claimed.** Anyone connected as ``torpor_app`` may set
``torpor.tenant``; so the policies admit a tenant only when the setting
``torpor.tenant_proof`` carries ``<expiry>:<mac>``, a keyed SHA-256 (HMAC's construction) of
``<tenant>:<expiry>`` under the keys in ``torpor.tenant_keys``, a table ``torpor_app`` cannot
read, checked by the SECURITY DEFINER function ``torpor.bound_tenant()`` (schema v9). The
backend reads the keys once at open through ``admin_dsn`` (the owner, or a login granted
``torpor_admin``), or takes them as ``tenant_key=`` / ``$TORPOR_PG_TENANT_KEY`` (the
:attr:`PostgresBackend.tenant_key` of a backend that could read them), and makes a proof valid
:data:`PROOF_SECONDS` per transaction. So a holder of a ``torpor_app`` login (its password, a
SQL injection through it) sees no tenant's rows, cannot list tenants, read the audit log or
write audit entries for a tenant; what the process that holds the keys can do, it can do for
every tenant (it serves them all). Cross-tenant reads (:meth:`~PostgresBackend.tenants`,
the whole :meth:`~PostgresBackend.audit_log`) go through ``admin_dsn``.

Open with a DSN: ``PostgresBackend("postgresql://app@db/torpor")``. The schema is migrated on
open (see :mod:`._pg_schema`); that needs an owner-level role, so pass ``admin_dsn=`` when the
application's own login cannot run DDL. Connections come from ``psycopg_pool`` when installed,
else from a small built-in pool.

Lexical search is ``tsvector @@ tsquery`` ranked by ``ts_rank_cd``. RLS keeps ``@@`` off the
GIN index (the operator is not leakproof, so it must run after the policy's filter), so ranked
candidates come from a ``SECURITY DEFINER`` function confined to the same tenant setting and are
joined back to ``records`` under RLS (schema v4).

Vector search is pgvector cosine distance: an exact scan of the visible rows until a dimension
holds ``hnsw_min_rows`` embeddings, then also a partial HNSW index for that dimension. RLS and
the filter apply after the index scan, so when it returns fewer rows than asked the query is
re-run exactly: a filter can make the result smaller only when fewer records are visible.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from torpor.config import check_name
from torpor.errors import (
    AccessDenied,
    CorruptData,
    InvalidArgument,
    StorageError,
    TorporError,
)
from torpor.memory.backends import _pg_schema as schema
from torpor.memory.backends._pg_pool import Pool, make_pool
from torpor.memory.backends._pg_store import PostgresTenantStore
from torpor.memory.backends._rows import (
    TOKEN_COLUMNS,
    audit_from_row,
    token_from_row,
    token_to_row,
)
from torpor.memory.backends.base import MemoryBackend, TenantStore, Vector
from torpor.memory.models import AuditEntry, TokenInfo, from_us, to_us

log = logging.getLogger(__name__)

__all__ = ["PostgresBackend", "PostgresTenantStore"]

_T = schema.TENANT
#: how long a tenant proof made for one transaction stays valid (it allows this much clock
#: skew between this host and the database; a proof is never shown, so replay needs one seen)
PROOF_SECONDS = 300
#: the keys, hex, for a process whose admin_dsn cannot read them (tenant_key= wins)
KEY_ENV = "TORPOR_PG_TENANT_KEY"


def translate(exc: psycopg.Error, what: str, tenant: str | None = None) -> TorporError:
    """The torpor error for a psycopg exception (by SQLSTATE class)."""
    state = getattr(exc, "sqlstate", None) or ""
    text = str(exc).strip()
    if state == "42501":
        return AccessDenied(
            f"{what}: refused by PostgreSQL (row-level security or privileges): {text}",
            exc=exc,
            tenant=tenant,
            scope="",
        )
    if state.startswith(("23", "22")) or isinstance(exc, psycopg.DataError):
        return InvalidArgument(f"{what}: {text}", exc=exc)
    if state in ("XX001", "XX002"):
        return CorruptData(f"{what}: PostgreSQL reports corrupt data: {text}", exc=exc)
    return StorageError(f"{what}: PostgreSQL failed: {text}", exc=exc, sqlstate=state or None)


class PostgresBackend(MemoryBackend):
    """All tenants in one PostgreSQL database (see the module docstring).

    ``dsn``: the application's connection string. ``admin_dsn``: a role that may run the
    migrations and create indexes (default: ``dsn``). ``pool_size``: connections kept open.
    ``hnsw_min_rows``: how many embeddings of one dimension (all tenants) before their HNSW
    index is built; until then vector search is an exact scan.
    Raises :class:`StorageError` when the server cannot be reached or migrated.
    """

    name = "postgres"

    def __init__(
        self,
        dsn: str,
        *,
        admin_dsn: str | None = None,
        pool_size: int = 4,
        hnsw_min_rows: int = 20_000,
        tenant_key: str | None = None,
    ) -> None:
        self.dsn = dsn
        self.admin_dsn = admin_dsn or dsn
        self._lock = threading.Lock()
        self._stores: dict[str, PostgresTenantStore] = {}
        self.hnsw_min_rows = hnsw_min_rows
        self._indexed_dims: set[int] = set()
        self._vector_rows: dict[int, int] = {}
        self._index_failed = False
        self._migrate()
        self._check_app_role()
        self._keys = self._load_keys(tenant_key or os.environ.get(KEY_ENV) or None)
        self._pool: Pool | None = make_pool(dsn, pool_size)
        try:
            self._check_proof()
        except BaseException:
            self.close()  # nobody else can: the caller never gets this backend
            raise

    # -- the tenant proof -----------------------------------------------------------------
    @property
    def tenant_key(self) -> str:
        """The tenant-proof keys as one hex string: what ``tenant_key=`` (or
        ``$TORPOR_PG_TENANT_KEY``) takes in a process whose login cannot read them. A
        secret: whoever holds it and a ``torpor_app`` login can act as any tenant."""
        return (self._keys[0] + self._keys[1]).hex()

    def _load_keys(self, given: str | None) -> tuple[bytes, bytes]:
        if given is not None:
            try:
                raw = bytes.fromhex(given)
            except ValueError:
                raw = b""
            if len(raw) != 128:
                raise StorageError("tenant_key must be 256 hex digits (PostgresBackend.tenant_key)")
            return raw[:64], raw[64:]
        try:
            with self._admin() as conn:
                row = conn.execute(
                    "SELECT inner_key, outer_key FROM torpor.tenant_keys WHERE id = 1"
                ).fetchone()
        except psycopg.Error as exc:
            raise StorageError(
                "cannot read the tenant-proof keys (torpor.tenant_keys): pass admin_dsn= a "
                f"login that may (the owner, or one granted torpor_admin), or tenant_key= "
                f"(${KEY_ENV}): {str(exc).strip()}",
                exc=exc,
            ) from exc
        if row is None:
            raise CorruptData("torpor.tenant_keys is empty: the tenant-proof keys are gone")
        return bytes(row[0]), bytes(row[1])

    def _proof(self, tenant: str) -> str:
        """``<expiry µs>:<mac>`` proving ``tenant`` to ``torpor.bound_tenant()``."""
        expiry = time.time_ns() // 1000 + PROOF_SECONDS * 1_000_000
        inner = hashlib.sha256(self._keys[0] + f"{tenant}:{expiry}".encode()).digest()
        return f"{expiry}:{hashlib.sha256(self._keys[1] + inner).hexdigest()}"

    def _check_proof(self) -> None:
        # a wrong key or a database clock far ahead of this one would make every tenant's
        # rows invisible, silently: refuse to open instead
        with self.transaction("check the tenant proof", "_probe") as cur:
            row = cur.execute("SELECT torpor.bound_tenant()").fetchone()
        if not row or row[0] != "_probe":
            raise StorageError(
                "PostgreSQL refuses this backend's tenant proof: tenant_key does not match "
                "torpor.tenant_keys, or the database clock is more than "
                f"{PROOF_SECONDS} s ahead of this host's",
            )

    # -- connections ----------------------------------------------------------------------
    def _admin(self) -> psycopg.Connection[Any]:
        try:
            return psycopg.connect(self.admin_dsn, autocommit=True, connect_timeout=10)
        except psycopg.Error as exc:
            raise translate(exc, "connect to PostgreSQL") from exc

    def _check_app_role(self) -> None:
        # Every transaction switches to torpor_app; a login that may not would fail each
        # query with "permission denied": say what to do once, at open.
        try:
            with psycopg.connect(self.dsn, autocommit=True, connect_timeout=10) as conn:
                row = conn.execute(
                    "SELECT current_user, pg_has_role(current_user, %s, 'MEMBER')",
                    (schema.APP_ROLE,),
                ).fetchone()
        except psycopg.Error as exc:
            raise translate(exc, "connect to PostgreSQL") from exc
        if not row or not row[1]:
            user = row[0] if row else "?"
            raise StorageError(
                f"PostgreSQL role {user!r} cannot act as {schema.APP_ROLE}: "
                f"GRANT {schema.APP_ROLE} TO {user}",
                role=user,
            )

    def _migrate(self) -> None:
        with self._admin() as conn:
            try:
                version = schema.current_version(conn)
                if version > schema.LATEST:
                    raise StorageError(
                        f"memory schema version {version} is newer than this "
                        f"torpor ({schema.LATEST})",
                        version=version,
                    )
                if version < schema.LATEST:
                    schema.migrate(conn)
                rows = conn.execute(
                    "SELECT indexname FROM pg_indexes WHERE schemaname = "
                    "'torpor' AND indexname LIKE 'records\\_hnsw\\_%%'"
                ).fetchall()
            except psycopg.Error as exc:
                raise StorageError(
                    f"cannot migrate the memory schema to version "
                    f"{schema.LATEST}: {str(exc).strip()} (migrations need a role "
                    "that may create schemas, roles and extensions: pass "
                    "admin_dsn=)",
                    exc=exc,
                ) from exc
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
                row = conn.execute(
                    "SELECT count(*) FROM torpor.records WHERE embedding_dim = %s", (dim,)
                ).fetchone()
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
            log.warning(
                "cannot create the HNSW index for %d dimensions (vector search stays exact): %s",
                dim,
                exc,
            )
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
                cur.execute(
                    "SELECT set_config('role', %s, true), set_config('torpor.tenant', %s, true), "
                    "set_config('torpor.tenant_proof', %s, true)",
                    (schema.APP_ROLE, tenant or "", self._proof(tenant) if tenant else ""),
                )
                yield cur
        except psycopg.Error as exc:
            err = translate(exc, what, tenant)
            if isinstance(err, AccessDenied) and tenant:
                self._audit_violation(tenant, what, str(exc))
            raise err from exc

    def _audit_violation(self, tenant: str, what: str, message: str) -> None:
        try:
            self.append_audit(
                AuditEntry(
                    at=from_us(time.time_ns() // 1000),
                    tenant=tenant,
                    actor="postgres-rls",
                    action=what,
                    allowed=False,
                    detail={"error": message},
                )
            )
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
            cur.execute(
                f"INSERT INTO torpor.tenants VALUES ({_T}, %s) ON CONFLICT DO NOTHING",
                (time.time_ns() // 1000,),
            )
        with self._lock:
            return self._stores.setdefault(tenant, PostgresTenantStore(self, tenant))

    def tenants(self) -> list[str]:
        """Every tenant's name: a cross-tenant read, so through ``admin_dsn`` (raises
        :class:`AccessDenied` when that login is neither the owner nor in torpor_admin)."""
        try:
            with self._admin() as conn:
                return [str(r[0]) for r in conn.execute("SELECT * FROM torpor.tenant_names()")]
        except psycopg.Error as exc:
            raise translate(exc, "list tenants") from exc

    # -- tokens and audit -----------------------------------------------------------------
    def put_token(self, token: TokenInfo) -> None:
        row = list(token_to_row(token, json_text=False))
        row[2] = Jsonb(row[2])
        row[6] = None if row[6] is None else Jsonb(row[6])
        del row[1]  # the tenant is the transaction's (RLS checks the row against it)
        cols = TOKEN_COLUMNS.format(tenant="tenant_id")
        updates = ", ".join(
            f"{c} = EXCLUDED.{c}" for c in cols.split(", ") if c not in ("token_hash", "tenant_id")
        )
        with self.transaction("put token", token.tenant) as cur:
            cur.execute(
                f"INSERT INTO torpor.tokens ({cols}) VALUES "
                f"(%s, {_T}, %s, %s, %s, %s, %s, %s, %s) "
                f"ON CONFLICT (token_hash) DO UPDATE SET {updates}",
                row,
            )

    def get_token(self, token_hash: str) -> TokenInfo | None:
        cols = TOKEN_COLUMNS.format(tenant="tenant_id")
        with self.transaction("get token", None) as cur:
            row = cur.execute(
                f"SELECT {cols} FROM torpor.token_by_hash(%s)", (token_hash,)
            ).fetchone()
        if row is None:
            return None
        return token_from_row(row, json_text=False)

    def list_tokens(self, tenant: str) -> list[TokenInfo]:
        cols = TOKEN_COLUMNS.format(tenant="tenant_id")
        with self.transaction("list tokens", tenant) as cur:
            rows = cur.execute(
                f"SELECT {cols} FROM torpor.tokens WHERE tenant_id = {_T} "
                "ORDER BY created_at, token_hash"
            ).fetchall()
        return [token_from_row(r, json_text=False) for r in rows]

    def revoke_token(self, token_hash: str) -> bool:
        token = self.get_token(token_hash)
        if token is None:
            return False
        with self.transaction("revoke token", token.tenant) as cur:
            return bool(
                cur.execute(
                    f"UPDATE torpor.tokens SET revoked = true WHERE tenant_id = "
                    f"{_T} AND token_hash = %s",
                    (token_hash,),
                ).rowcount
            )

    def append_audit(self, entry: AuditEntry) -> None:
        detail = json.loads(json.dumps(entry.detail, default=str))
        with self.transaction("audit", entry.tenant or None) as cur:
            cur.execute(
                "SELECT torpor.audit_append(%s, %s, %s, %s, %s, %s, %s)",
                (
                    entry.tenant,
                    to_us(entry.at),
                    entry.actor,
                    entry.action,
                    entry.scope,
                    entry.allowed,
                    Jsonb(detail),
                ),
            )

    def audit_log(self, tenant: str | None = None, limit: int = 100) -> list[AuditEntry]:
        cols = "at, tenant_id, actor, action, scope, allowed, detail"
        if tenant is None:  # every tenant's: through admin_dsn, as tenants()
            try:
                with self._admin() as conn:
                    rows = conn.execute(
                        f"SELECT {cols} FROM torpor.audit_recent(%s)", (limit,)
                    ).fetchall()
            except psycopg.Error as exc:
                raise translate(exc, "audit log") from exc
            return [audit_from_row(r, json_text=False) for r in rows]
        with self.transaction("audit log", tenant) as cur:
            rows = cur.execute(
                f"SELECT {cols} FROM torpor.audit WHERE tenant_id = {_T} "
                "ORDER BY seq DESC LIMIT %s",
                (limit,),
            ).fetchall()
        return [audit_from_row(r, json_text=False) for r in rows]

    def close(self) -> None:
        with self._lock:
            for store in self._stores.values():
                store.close()
            self._stores.clear()
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()
