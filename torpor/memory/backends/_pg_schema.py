"""PostgreSQL schema, versioned migrations, and the SQL form of :class:`RecordFilter`.

Everything lives in the ``torpor`` schema of one database. Every tenant table carries a
``tenant_id`` column and a row-level-security policy that admits a row only when its
``tenant_id`` equals ``torpor.bound_tenant()``: the ``torpor.tenant`` setting, if the
``torpor.tenant_proof`` setting proves it (v9), both set by the backend per transaction
(``set_config(..., true)`` = ``SET LOCAL``). RLS is ``FORCE``d, so it holds for the
tables' owner too; only a superuser or a ``BYPASSRLS`` role escapes it, and the backend never
queries as one (it switches to the non-owner role ``torpor_app`` in every transaction).

Migrations are numbered steps (:data:`MIGRATIONS`, version = index + 1) recorded in
``torpor.schema_version``. :func:`migrate` applies the missing ones, each in its own
transaction, under an advisory lock so that concurrent openers serialize.

* v1: tenants, records (facts + episodes), profiles, policies, meta, tokens, audit; RLS.
* v2: full text: a stemming configuration without stop words (like SQLite's ``porter
  unicode61``), a generated ``tsvector`` column and its GIN index.
* v3: dense vectors: pgvector, an ``embedding`` column of any dimension plus ``embedding_dim``
  (HNSW indexes are partial per dimension, created when a dimension first appears), and the
  ``SECURITY DEFINER`` functions for the few cross-tenant reads (token lookup, tenant list,
  the whole audit log).
* v4: ``lexical_candidates()``: under RLS the planner may not use the GIN index, because
  ``@@`` is not leakproof and so must run after the policy's filter. This SECURITY DEFINER
  function runs the match as the owner, where the index serves it, restricted to the
  transaction's tenant by the same setting the policy reads; callers join its ids back to
  ``records`` under RLS, so a row it should not have proposed is still never returned.
  (With a non-superuser owner FORCE RLS applies inside too: still correct, only slower.)
* v5: the scope index also orders by ``seq``, so "newest N of a scope" is an index range scan.
* v6: ``lexical_candidates()`` plans each call with its actual arguments (plpgsql EXECUTE).
* v7: one identity for both layers: a token's sandbox rights (a label selector), ``admin``
  (manages its tenant's tokens) and ``expires_at``.
* v8: ``tenants.records``, each tenant's record count for the memory-records quota, kept by
  statement-level triggers running as the owner (``torpor_app`` may no longer update
  ``tenants``, so it cannot move its own count). A write that inserts records takes the
  tenant's row lock until it commits, so the quota check after the insert is exact.
* v9: the tenant is bound by a proof, not by a setting anyone may set. Every policy (and every
  SECURITY DEFINER function that reads tenant rows) admits the tenant
  ``torpor.bound_tenant()`` returns: ``torpor.tenant`` only when
  ``torpor.tenant_proof`` carries a keyed hash of it with an unexpired time, made with the
  keys in ``torpor.tenant_keys``, which ``torpor_app`` cannot read. The cross-tenant functions
  (tenant list, whole audit log) move from ``torpor_app`` to the new role ``torpor_admin``;
  ``audit_append`` accepts only the proven tenant (or none). See :mod:`.postgres`.
* v10: ``lexical_candidates()`` cuts its matches of equal rank at the newest (``seq``), as
  the search that joins them back orders them and as SQLite does: it had kept an arbitrary
  few, so the newest of many equally relevant records could be missing from a search.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import psycopg
from psycopg import sql

from torpor.memory.backends._rows import RECORD_COLUMNS, record_from_row, record_to_row
from torpor.memory.backends.base import AnyRecord, RecordFilter, time_clauses

log = logging.getLogger(__name__)

__all__ = [
    "APP_ROLE",
    "COLUMNS",
    "INSERT_SQL",
    "LATEST",
    "MIGRATIONS",
    "TENANT",
    "current_version",
    "filter_sql",
    "hnsw_index_sql",
    "migrate",
    "record_to_row",
    "row_to_record",
]

#: The role every query runs as: no superuser, owns nothing, subject to RLS.
APP_ROLE = "torpor_app"
#: pg_advisory_xact_lock key serializing migrations ("torpor" in ASCII).
_MIGRATION_LOCK = 0x746F72706F72

#: The current transaction's tenant; NULL (matching nothing) when unset.
TENANT = "nullif(current_setting('torpor.tenant', true), '')"

_TENANT_TABLES = ("tenants", "records", "profiles", "policies", "meta", "tokens", "audit")
_DEFINER_TABLES = ("tenants", "tokens", "audit")

_V1 = """
CREATE SCHEMA IF NOT EXISTS torpor;
CREATE TABLE torpor.tenants (
    tenant_id text PRIMARY KEY,
    created_at bigint NOT NULL
);
CREATE TABLE torpor.records (
    seq bigint GENERATED ALWAYS AS IDENTITY,
    tenant_id text NOT NULL,
    id text NOT NULL,
    kind text NOT NULL CHECK (kind IN ('fact', 'episode')),
    scope text NOT NULL,
    key text,
    text text NOT NULL,
    metadata jsonb NOT NULL DEFAULT '{}',
    created_at bigint NOT NULL,
    valid_from bigint NOT NULL,
    valid_to bigint,
    durability text NOT NULL DEFAULT 'persistent',
    expires_at bigint,
    role text,
    session text,
    source jsonb,
    source_hash text,
    verified boolean NOT NULL DEFAULT false,
    stale boolean NOT NULL DEFAULT false,
    superseded_by text,
    PRIMARY KEY (tenant_id, id)
);
CREATE INDEX records_scope_time ON torpor.records (tenant_id, scope, valid_from);
CREATE INDEX records_key ON torpor.records (tenant_id, scope, key, valid_from)
    WHERE key IS NOT NULL;
-- at most one current fact per (tenant, scope, key): storage enforces supersession
CREATE UNIQUE INDEX records_current_key ON torpor.records (tenant_id, scope, key)
    WHERE key IS NOT NULL AND valid_to IS NULL;
CREATE INDEX records_expiry ON torpor.records (tenant_id, expires_at)
    WHERE expires_at IS NOT NULL;
CREATE INDEX records_seq ON torpor.records (tenant_id, seq);
CREATE TABLE torpor.profiles (
    tenant_id text NOT NULL,
    scope text NOT NULL,
    data jsonb NOT NULL,
    json_schema jsonb,
    updated_at bigint NOT NULL,
    version integer NOT NULL,
    PRIMARY KEY (tenant_id, scope)
);
CREATE TABLE torpor.policies (
    tenant_id text NOT NULL,
    scope text NOT NULL,
    retention_seconds double precision,
    cache_ttl_seconds double precision,
    PRIMARY KEY (tenant_id, scope)
);
CREATE TABLE torpor.meta (
    tenant_id text NOT NULL,
    key text NOT NULL,
    value text NOT NULL,
    PRIMARY KEY (tenant_id, key)
);
CREATE TABLE torpor.tokens (
    token_hash text PRIMARY KEY,
    tenant_id text NOT NULL,
    grants jsonb NOT NULL,
    name text NOT NULL DEFAULT '',
    created_at bigint NOT NULL,
    revoked boolean NOT NULL DEFAULT false
);
CREATE TABLE torpor.audit (
    seq bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_id text NOT NULL,
    at bigint NOT NULL,
    actor text NOT NULL,
    action text NOT NULL,
    scope text NOT NULL DEFAULT '',
    allowed boolean NOT NULL,
    detail jsonb NOT NULL DEFAULT '{}'
);
CREATE INDEX audit_tenant ON torpor.audit (tenant_id, seq);
"""

_RLS = """
ALTER TABLE torpor.{t} ENABLE ROW LEVEL SECURITY;
{force}CREATE POLICY tenant_isolation ON torpor.{t}
    USING (tenant_id = nullif(current_setting('torpor.tenant', true), ''))
    WITH CHECK (tenant_id = nullif(current_setting('torpor.tenant', true), ''));
GRANT SELECT{writes} ON torpor.{t} TO torpor_app;
"""


def _rls(table: str) -> str:
    # FORCE makes the policy bind the owner too. Not on the tables that the SECURITY DEFINER
    # functions below read across tenants (they run as the owner); torpor_app, which every
    # query runs as, is never the owner, so RLS binds it on every table either way.
    force = (
        ""
        if table in _DEFINER_TABLES
        else f"ALTER TABLE torpor.{table} FORCE ROW LEVEL SECURITY;\n"
    )
    # the audit log is append-only for the app: it writes through audit_append()
    writes = "" if table == "audit" else ", INSERT, UPDATE, DELETE"
    return _RLS.format(t=table, force=force, writes=writes)


_GRANTS = """
GRANT USAGE ON SCHEMA torpor TO torpor_app;
GRANT SELECT ON torpor.schema_version TO torpor_app;
"""

_V2 = """
CREATE TEXT SEARCH DICTIONARY torpor.english_stem_all (TEMPLATE = snowball, Language = english);
CREATE TEXT SEARCH CONFIGURATION torpor.english (COPY = pg_catalog.english);
ALTER TEXT SEARCH CONFIGURATION torpor.english
    ALTER MAPPING FOR asciiword, asciihword, hword_asciipart, word, hword, hword_part
    WITH torpor.english_stem_all;
ALTER TABLE torpor.records ADD COLUMN tsv tsvector
    GENERATED ALWAYS AS (to_tsvector('torpor.english'::regconfig, text)) STORED;
CREATE INDEX records_tsv ON torpor.records USING gin (tsv);
"""

_V3 = """
CREATE EXTENSION IF NOT EXISTS vector;
ALTER TABLE torpor.records ADD COLUMN embedding vector;
ALTER TABLE torpor.records ADD COLUMN embedding_dim integer;
ALTER TABLE torpor.records ADD CONSTRAINT records_embedding_dim
    CHECK ((embedding IS NULL AND embedding_dim IS NULL)
           OR vector_dims(embedding) = embedding_dim);
CREATE FUNCTION torpor.token_by_hash(h text)
    RETURNS SETOF torpor.tokens LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, torpor
    AS $$ SELECT * FROM torpor.tokens WHERE token_hash = h $$;
CREATE FUNCTION torpor.tenant_names()
    RETURNS SETOF text LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, torpor
    AS $$ SELECT tenant_id FROM torpor.tenants ORDER BY tenant_id $$;
CREATE FUNCTION torpor.audit_append(p_tenant text, p_at bigint, p_actor text, p_action text,
                                    p_scope text, p_allowed boolean, p_detail jsonb)
    RETURNS void LANGUAGE sql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, torpor
    AS $$ INSERT INTO torpor.audit (tenant_id, at, actor, action, scope, allowed, detail)
          VALUES (p_tenant, p_at, p_actor, p_action, p_scope, p_allowed, p_detail) $$;
CREATE FUNCTION torpor.audit_recent(lim integer)
    RETURNS SETOF torpor.audit LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, torpor
    AS $$ SELECT * FROM torpor.audit ORDER BY seq DESC LIMIT lim $$;
REVOKE ALL ON FUNCTION torpor.token_by_hash(text), torpor.tenant_names(),
    torpor.audit_recent(integer),
    torpor.audit_append(text, bigint, text, text, text, boolean, jsonb) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION torpor.token_by_hash(text), torpor.tenant_names(),
    torpor.audit_recent(integer),
    torpor.audit_append(text, bigint, text, text, text, boolean, jsonb) TO torpor_app;
"""

_V4 = """
CREATE FUNCTION torpor.lexical_candidates(q tsquery, scopes text[], lim integer)
    RETURNS TABLE (id text, rank real) LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, torpor
    AS $$ SELECT r.id, ts_rank_cd(r.tsv, q, 1) FROM torpor.records r
          WHERE r.tenant_id = nullif(current_setting('torpor.tenant', true), '')
            AND r.scope = ANY(scopes) AND r.tsv @@ q
          ORDER BY 2 DESC LIMIT lim $$;
REVOKE ALL ON FUNCTION torpor.lexical_candidates(tsquery, text[], integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION torpor.lexical_candidates(tsquery, text[], integer) TO torpor_app;
"""

_V5 = """
CREATE INDEX records_scope_order ON torpor.records (tenant_id, scope, valid_from, seq);
DROP INDEX torpor.records_scope_time;
"""

_V6 = """
CREATE OR REPLACE FUNCTION torpor.lexical_candidates(q tsquery, scopes text[], lim integer)
    RETURNS TABLE (id text, rank real) LANGUAGE plpgsql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, torpor
    AS $fn$
BEGIN
    -- EXECUTE plans each call with the actual query and scopes: the scope index for a small
    -- scope, the GIN index for rare terms in a large one (a SQL function gets a generic plan)
    RETURN QUERY EXECUTE
        'SELECT r.id, ts_rank_cd(r.tsv, $1, 1) FROM torpor.records r '
        'WHERE r.tenant_id = nullif(current_setting($4, true), $5) '
        'AND r.scope = ANY($2) AND r.tsv @@ $1 ORDER BY 2 DESC LIMIT $3'
        USING q, scopes, lim, 'torpor.tenant', '';
END
$fn$;
"""

_V7 = """
ALTER TABLE torpor.tokens ADD COLUMN sandboxes jsonb;
ALTER TABLE torpor.tokens ADD COLUMN admin boolean NOT NULL DEFAULT false;
ALTER TABLE torpor.tokens ADD COLUMN expires_at bigint;
CREATE INDEX tokens_tenant ON torpor.tokens (tenant_id);
"""

_V8 = """
ALTER TABLE torpor.tenants ADD COLUMN records bigint NOT NULL DEFAULT 0;
UPDATE torpor.tenants t SET records = (SELECT count(*) FROM torpor.records r
                                       WHERE r.tenant_id = t.tenant_id);
-- the app may not move its own count: the triggers run as the owner
REVOKE UPDATE ON torpor.tenants FROM torpor_app;
CREATE FUNCTION torpor.count_records() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
    SET search_path = pg_catalog, torpor
    AS $fn$
BEGIN
    IF TG_OP = 'INSERT' THEN
        UPDATE torpor.tenants t SET records = t.records + d.n
          FROM (SELECT tenant_id, count(*) AS n FROM added GROUP BY tenant_id) d
         WHERE t.tenant_id = d.tenant_id;
    ELSE
        UPDATE torpor.tenants t SET records = t.records - d.n
          FROM (SELECT tenant_id, count(*) AS n FROM removed GROUP BY tenant_id) d
         WHERE t.tenant_id = d.tenant_id;
    END IF;
    RETURN NULL;
END
$fn$;
REVOKE ALL ON FUNCTION torpor.count_records() FROM PUBLIC;
CREATE TRIGGER records_count_ins AFTER INSERT ON torpor.records
    REFERENCING NEW TABLE AS added FOR EACH STATEMENT EXECUTE FUNCTION torpor.count_records();
CREATE TRIGGER records_count_del AFTER DELETE ON torpor.records
    REFERENCING OLD TABLE AS removed FOR EACH STATEMENT EXECUTE FUNCTION torpor.count_records();
"""

_TABLE_POLICY = """
ALTER POLICY tenant_isolation ON torpor.{t}
    USING (tenant_id = (SELECT torpor.bound_tenant()))
    WITH CHECK (tenant_id = (SELECT torpor.bound_tenant()));
"""

_V9 = (
    """
DO $$ BEGIN
    CREATE ROLE torpor_admin NOLOGIN NOSUPERUSER NOBYPASSRLS;
EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL;
END $$;
-- the key that proves a tenant: two independent 64-byte keys (one SHA-256 block each), from
-- the server's strong random source; readable by the owner and torpor_admin only
CREATE TABLE torpor.tenant_keys (
    id integer PRIMARY KEY CHECK (id = 1),
    inner_key bytea NOT NULL CHECK (length(inner_key) = 64),
    outer_key bytea NOT NULL CHECK (length(outer_key) = 64)
);
INSERT INTO torpor.tenant_keys
SELECT 1, decode(a, 'hex'), decode(b, 'hex') FROM (
    SELECT string_agg(replace(gen_random_uuid()::text, '-', ''), '') FILTER (WHERE i <= 4) a,
           string_agg(replace(gen_random_uuid()::text, '-', ''), '') FILTER (WHERE i > 4) b
    FROM generate_series(1, 8) i) k;
REVOKE ALL ON torpor.tenant_keys FROM PUBLIC;
GRANT SELECT ON torpor.tenant_keys TO torpor_admin;
GRANT USAGE ON SCHEMA torpor TO torpor_admin;

-- the tenant of this transaction, if its proof checks: torpor.tenant_proof must be
-- '<expiry µs>:<mac>' with mac = hex(sha256(outer || sha256(inner || '<tenant>:<expiry>')))
-- (HMAC's construction with independent keys) and the expiry not past. NULL otherwise.
CREATE FUNCTION torpor.bound_tenant() RETURNS text LANGUAGE plpgsql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, torpor
    AS $fn$
DECLARE
    claim text := nullif(current_setting('torpor.tenant', true), '');
    proof text[] := string_to_array(current_setting('torpor.tenant_proof', true), ':');
    k record;
BEGIN
    IF claim IS NULL OR coalesce(array_length(proof, 1), 0) <> 2
       OR proof[1] !~ '^[0-9]{1,18}$' OR proof[2] !~ '^[0-9a-f]{64}$' THEN
        RETURN NULL;
    END IF;
    IF proof[1]::bigint < (extract(epoch FROM now()) * 1000000)::bigint THEN
        RETURN NULL;
    END IF;
    SELECT inner_key, outer_key INTO k FROM torpor.tenant_keys WHERE id = 1;
    -- compared through one more hash, so the time "=" takes tells nothing about the mac
    IF sha256(sha256(k.outer_key || sha256(k.inner_key
              || convert_to(claim || ':' || proof[1], 'UTF8'))))
       = sha256(decode(proof[2], 'hex')) THEN
        RETURN claim;
    END IF;
    RETURN NULL;
END
$fn$;
REVOKE ALL ON FUNCTION torpor.bound_tenant() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION torpor.bound_tenant() TO torpor_app, torpor_admin;
"""
    + "".join(_TABLE_POLICY.format(t=t) for t in _TENANT_TABLES)
    + """
CREATE OR REPLACE FUNCTION torpor.lexical_candidates(q tsquery, scopes text[], lim integer)
    RETURNS TABLE (id text, rank real) LANGUAGE plpgsql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, torpor
    AS $fn$
DECLARE
    t text := torpor.bound_tenant();
BEGIN
    IF t IS NULL THEN
        RETURN;
    END IF;
    RETURN QUERY EXECUTE
        'SELECT r.id, ts_rank_cd(r.tsv, $1, 1) FROM torpor.records r '
        'WHERE r.tenant_id = $4 AND r.scope = ANY($2) AND r.tsv @@ $1 ORDER BY 2 DESC LIMIT $3'
        USING q, scopes, lim, t;
END
$fn$;
CREATE OR REPLACE FUNCTION torpor.audit_append(p_tenant text, p_at bigint, p_actor text,
        p_action text, p_scope text, p_allowed boolean, p_detail jsonb)
    RETURNS void LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, torpor
    AS $fn$
BEGIN
    -- an entry names the proven tenant, or none ('': a refusal before any tenant was known)
    IF p_tenant <> '' AND p_tenant IS DISTINCT FROM torpor.bound_tenant() THEN
        RAISE EXCEPTION 'audit entries of tenant % need that tenant''s proof', p_tenant
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    INSERT INTO torpor.audit (tenant_id, at, actor, action, scope, allowed, detail)
    VALUES (p_tenant, p_at, p_actor, p_action, p_scope, p_allowed, p_detail);
END
$fn$;
-- reading across tenants is for administrators (a login granted torpor_admin, or the owner)
REVOKE EXECUTE ON FUNCTION torpor.tenant_names(), torpor.audit_recent(integer)
    FROM torpor_app;
GRANT EXECUTE ON FUNCTION torpor.tenant_names(), torpor.audit_recent(integer) TO torpor_admin;
"""
)

_V10 = """
CREATE OR REPLACE FUNCTION torpor.lexical_candidates(q tsquery, scopes text[], lim integer)
    RETURNS TABLE (id text, rank real) LANGUAGE plpgsql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, torpor
    AS $fn$
DECLARE
    t text := torpor.bound_tenant();
BEGIN
    IF t IS NULL THEN
        RETURN;
    END IF;
    RETURN QUERY EXECUTE
        'SELECT r.id, ts_rank_cd(r.tsv, $1, 1) FROM torpor.records r '
        'WHERE r.tenant_id = $4 AND r.scope = ANY($2) AND r.tsv @@ $1 '
        'ORDER BY 2 DESC, r.seq DESC LIMIT $3'
        USING q, scopes, lim, t;
END
$fn$;
"""

#: Migration steps; version N is MIGRATIONS[N - 1]. Append only, never edit a shipped step.
MIGRATIONS: list[tuple[str, str]] = [
    ("tables and row-level security", _V1 + "".join(_rls(t) for t in _TENANT_TABLES) + _GRANTS),
    ("full text search", _V2),
    ("vectors and cross-tenant functions", _V3),
    ("lexical candidates through the GIN index", _V4),
    ("scope index ordered like scans (valid_from, seq)", _V5),
    ("lexical candidates planned per call", _V6),
    ("one identity: tokens with sandbox rights, admin, expiry", _V7),
    ("a record count per tenant for the memory-records quota", _V8),
    ("the tenant bound by a proof (a keyed hash) that torpor_app cannot make", _V9),
    ("lexical candidates of equal rank: the newest", _V10),
]
LATEST = len(MIGRATIONS)

_BOOTSTRAP = """
CREATE SCHEMA IF NOT EXISTS torpor;
CREATE TABLE IF NOT EXISTS torpor.schema_version (
    version integer PRIMARY KEY,
    description text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);
"""

_CREATE_ROLE = """
DO $$ BEGIN
    CREATE ROLE torpor_app NOLOGIN NOSUPERUSER NOBYPASSRLS;
EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL;
END $$;
"""


def current_version(conn: psycopg.Connection[Any]) -> int:
    """The schema version of the database behind ``conn`` (0 when torpor was never installed)."""
    row = conn.execute("SELECT to_regclass('torpor.schema_version') IS NOT NULL").fetchone()
    if not row or not row[0]:
        return 0
    row = conn.execute("SELECT coalesce(max(version), 0) FROM torpor.schema_version").fetchone()
    return int(row[0]) if row else 0


def migrate(conn: psycopg.Connection[Any], target: int = LATEST) -> int:
    """Bring the database to version ``target``; returns the version reached.

    ``conn`` must be in autocommit mode and connected as a role that may create schemas,
    roles (or find ``torpor_app`` existing) and, for v3, the ``vector`` extension. Each step
    runs in one transaction. Raises ``psycopg.Error`` (the caller translates it).
    """
    if current_version(conn) >= target:
        return current_version(conn)
    # Roles are cluster-wide: creating one can race with another database's migration.
    if not conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (APP_ROLE,)).fetchone():
        conn.execute(_CREATE_ROLE)
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
        conn.execute(_BOOTSTRAP)
    version = current_version(conn)
    while version < target:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
            # another process may have migrated while we waited for the lock
            version = current_version(conn)
            if version >= target:
                break
            description, script = MIGRATIONS[version]
            conn.execute(script.encode())  # trusted constant DDL, several statements
            conn.execute(
                "INSERT INTO torpor.schema_version (version, description) VALUES (%s, %s)",
                (version + 1, description),
            )
            version += 1
            log.info("memory schema (postgres) migrated to version %d: %s", version, description)
    return version


def hnsw_index_sql(dim: int) -> sql.Composed:
    """The DDL of the partial HNSW (cosine) index for embeddings of ``dim`` dimensions."""
    return sql.SQL(
        "CREATE INDEX CONCURRENTLY IF NOT EXISTS {name} ON torpor.records USING hnsw "
        "((embedding::vector({dim})) vector_cosine_ops) WHERE embedding_dim = {dim}"
    ).format(name=sql.Identifier(f"records_hnsw_{int(dim)}"), dim=sql.Literal(int(dim)))


COLUMNS = RECORD_COLUMNS
_NCOLS = len(COLUMNS.split(", "))
INSERT_SQL = (
    f"INSERT INTO torpor.records (tenant_id, {COLUMNS}, embedding, embedding_dim) "
    f"VALUES ({TENANT}, {', '.join(['%s'] * _NCOLS)}, "
    "%s::vector, %s)"
)


def row_to_record(row: tuple[Any, ...] | Any) -> AnyRecord:
    """A model from a row selected with :data:`COLUMNS` first (jsonb arrives decoded)."""
    return record_from_row(row, json_text=False)


def filter_sql(flt: RecordFilter, alias: str = "r") -> tuple[str, list[Any]]:
    """The WHERE clause (without ``WHERE``) and parameters equivalent to
    :func:`~torpor.memory.backends.base.visible`. The tenant is not named: RLS supplies it,
    and an explicit ``tenant_id = current_setting(...)`` lets the planner use the indexes."""
    a = alias
    scopes, kinds = list(flt.scopes), list(flt.kinds)
    if not scopes or not kinds:
        return "false", []
    parts = [
        f"{a}.tenant_id = {TENANT}",
        # "= %s" for one scope: "= ANY" would keep the planner from ordered index scans
        f"{a}.scope = %s" if len(scopes) == 1 else f"{a}.scope = ANY(%s)",
        f"{a}.kind = ANY(%s)",
        f"({a}.expires_at IS NULL OR {a}.expires_at > %s)",
    ]
    params: list[Any] = [scopes[0] if len(scopes) == 1 else scopes, kinds, flt.now]
    more, more_params = time_clauses(flt, a, "%s")
    parts += more
    params += more_params
    for k, v in flt.metadata.items():
        # jsonb equality: 1 = 1.0, true <> 1, a missing key never matches (NULL)
        parts.append(f"{a}.metadata -> %s = %s::jsonb")
        params += [str(k), json.dumps(v, separators=(",", ":"))]
    return " AND ".join(parts), params
