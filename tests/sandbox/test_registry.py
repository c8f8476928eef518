"""The registry: rows, the transitions log, names, schema version, errors — one suite over
both implementations (SQLite, the embedded default; PostgreSQL, for many nodes), then what is
particular to each."""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.pg import PgCluster
from torpor.errors import (
    Conflict,
    InvalidArgument,
    InvalidName,
    InvalidState,
    NotFound,
    SandboxClosed,
    SandboxNotFound,
    StorageError,
)
from torpor.sandbox.models import SandboxState as S
from torpor.sandbox.registry import SCHEMA_VERSION, Move, Registry, SandboxRecord
from torpor.sandbox.registry.postgres import PG_SCHEMA_VERSION, NodeInfo, PostgresRegistry

AnyRegistry = Registry | PostgresRegistry

IMPLEMENTATIONS = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
]


@pytest.fixture(params=IMPLEMENTATIONS)
def reg(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[AnyRegistry]:
    """A fresh, empty registry of each implementation."""
    r: AnyRegistry
    if request.param == "sqlite":
        r = Registry(tmp_path / "registry.db")
    else:
        cluster: PgCluster = request.getfixturevalue("pg_cluster")
        r = PostgresRegistry(cluster.admin_dsn(request.getfixturevalue("pg_database")))
    yield r
    r.close()


def rec(id: str = "sbx-1", name: str = "agent", **kw: object) -> SandboxRecord:
    fields: dict[str, object] = {"tenant": "default", "template": "python", "state": S.CREATING}
    fields.update(kw)
    return SandboxRecord(id=id, name=name, **fields)  # type: ignore[arg-type]


def test_insert_get_roundtrip(reg: AnyRegistry) -> None:
    reg.insert(rec(labels={"user": "u-42"}, vcpus=2, memory_mib=1024, idle_pause_seconds=60))
    got = reg.get("sbx-1")
    assert (got.name, got.labels, got.vcpus, got.memory_mib, got.idle_pause_seconds) == (
        "agent",
        {"user": "u-42"},
        2,
        1024,
        60,
    )
    info = got.to_info(reused=True)
    assert info.reused and info.state is S.CREATING and info.created_at.tzinfo is not None


def test_wal_and_schema_version(tmp_path: Path) -> None:
    Registry(tmp_path / "r.db").close()
    db = sqlite3.connect(tmp_path / "r.db")
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    # reopening an existing registry keeps the rows
    r = Registry(tmp_path / "r.db")
    r.insert(rec())
    r.close()
    assert Registry(tmp_path / "r.db").get("sbx-1").name == "agent"


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / "r.db")
    db.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(StorageError, match="newer"):
        Registry(tmp_path / "r.db")


def test_two_processes_opening_a_new_registry_at_once_both_open(tmp_path: Path) -> None:
    """Two openers (the server and a CLI command, just after an upgrade or on a new home)
    that both read the old schema version before either migrated: the second one's migration
    finds it done instead of failing ("table sandboxes already exists")."""
    path = tmp_path / "registry.db"
    holder = sqlite3.connect(path, isolation_level=None)  # holds the write lock while both
    holder.execute("PRAGMA journal_mode=WAL")  # openers read version 0
    holder.execute("BEGIN IMMEDIATE")
    opened: list[Registry] = []
    errors: list[BaseException] = []

    def open_it() -> None:
        try:
            opened.append(Registry(path))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=open_it) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    holder.execute("ROLLBACK")
    holder.close()
    for t in threads:
        t.join()
    assert errors == [] and len(opened) == 2
    assert all(reg.schema_version == SCHEMA_VERSION for reg in opened)
    for reg in opened:
        reg.close()


def test_unopenable_path_is_storage_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(StorageError):
        Registry(tmp_path / "file" / "registry.db")


def test_corrupt_file_is_storage_error(tmp_path: Path) -> None:
    (tmp_path / "r.db").write_bytes(b"not a database at all" * 100)
    with pytest.raises(StorageError):
        Registry(tmp_path / "r.db")


def test_transitions_log_and_compare_and_set(reg: AnyRegistry) -> None:
    reg.insert(rec())
    reg.set_state("sbx-1", S.CREATING, S.RUNNING, reason="created")
    reg.set_state("sbx-1", S.RUNNING, S.PAUSING)
    reg.set_state("sbx-1", S.PAUSING, S.PAUSED, paused_at=123.0)
    assert [(t.src, t.dst) for t in reg.transitions("sbx-1")] == [
        (None, S.CREATING),
        (S.CREATING, S.RUNNING),
        (S.RUNNING, S.PAUSING),
        (S.PAUSING, S.PAUSED),
    ]
    assert reg.get("sbx-1").paused_at == 123.0
    # the row is paused, so a move that expects running fails and logs nothing
    with pytest.raises(InvalidState):
        reg.set_state("sbx-1", S.RUNNING, S.PAUSING)
    assert len(reg.transitions("sbx-1")) == 4


def test_illegal_move_and_unknown_id(reg: AnyRegistry) -> None:
    reg.insert(rec())
    with pytest.raises(InvalidState):
        reg.set_state("sbx-1", S.CREATING, S.PAUSED)
    with pytest.raises(SandboxNotFound):
        reg.set_state("nope", S.CREATING, S.RUNNING)
    with pytest.raises(SandboxNotFound):
        reg.get("nope")
    with pytest.raises(InvalidArgument):
        reg.set_state("sbx-1", S.CREATING, S.RUNNING, name="sneaky")


def test_stopped_row_answers_sandbox_closed(reg: AnyRegistry) -> None:
    reg.insert(rec())
    reg.set_state("sbx-1", S.CREATING, S.STOPPED)
    with pytest.raises(SandboxClosed):
        reg.set_state("sbx-1", S.STOPPED, S.RUNNING)


def test_names_unique_per_tenant_among_live(reg: AnyRegistry) -> None:
    reg.insert(rec("sbx-1", "agent"))
    with pytest.raises(Conflict) as info:
        reg.insert(rec("sbx-2", "agent"))
    assert info.value.data["name"] == "agent"
    reg.insert(rec("sbx-3", "agent", tenant="other"))  # other tenant: fine
    reg.set_state("sbx-1", S.CREATING, S.STOPPED)
    reg.insert(rec("sbx-4", "agent"))  # the killed one's name is free again
    live = reg.live_by_name("default", "agent")
    assert live is not None and live.id == "sbx-4"
    # by name: the live one wins; by id: the exact row, even stopped
    assert reg.find("default", "agent").id == "sbx-4"
    assert reg.find("default", "sbx-1").state is S.STOPPED
    with pytest.raises(SandboxNotFound):
        reg.find("other", "sbx-1")  # another tenant's id is not found


def test_insert_many_is_all_or_none(reg: AnyRegistry) -> None:
    reg.insert(rec("sbx-old", "taken"))
    kids = [rec("sbx-a", "a"), rec("sbx-b", "taken"), rec("sbx-c", "c")]
    with pytest.raises(Conflict) as info:
        reg.insert_many(kids, reason="forked")
    assert info.value.data["name"] == "taken"
    assert [r.id for r in reg.list()] == ["sbx-old"]  # the batch left no row
    with pytest.raises(Conflict) as twice:  # a name given twice in one batch
        reg.insert_many([rec("sbx-d", "d"), rec("sbx-e", "d")])
    assert twice.value.data["name"] == "d"
    reg.insert_many([rec("sbx-a", "a"), rec("sbx-c", "c")], reason="forked")
    assert sorted(r.name for r in reg.list()) == ["a", "c", "taken"]
    assert [(t.src, t.dst, t.reason) for t in reg.transitions("sbx-c")] == [
        (None, S.CREATING, "forked")
    ]


def _kids(reg: AnyRegistry) -> list[str]:
    ids = ["sbx-a", "sbx-b", "sbx-c"]
    reg.insert_many([rec(i, i.removeprefix("sbx-")) for i in ids], reason="forked")
    return ids


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(Move("sbx-b", S.CREATING, S.PAUSED), id="illegal-transition"),
        pytest.param(Move("sbx-b", S.RUNNING, S.PAUSING), id="row-not-in-src"),
        pytest.param(Move("sbx-gone", S.CREATING, S.RUNNING), id="unknown-row"),
        pytest.param(Move("sbx-b", S.CREATING, S.RUNNING, columns={"name": "x"}), id="bad-column"),
    ],
)
def test_set_states_refuses_the_whole_batch(reg: AnyRegistry, bad: Move) -> None:
    ids = _kids(reg)
    before = {i: reg.transitions(i) for i in ids}
    moves = [Move("sbx-a", S.CREATING, S.RUNNING), bad, Move("sbx-c", S.CREATING, S.RUNNING)]
    with pytest.raises((InvalidState, SandboxNotFound, InvalidArgument)):
        reg.set_states(moves, reason="forked")
    assert {r.id: r.state for r in reg.list()} == dict.fromkeys(ids, S.CREATING)
    assert {i: reg.transitions(i) for i in ids} == before  # nothing logged either


def test_set_states_moves_and_logs_every_row(reg: AnyRegistry) -> None:
    ids = _kids(reg)
    moves = [
        Move(i, S.CREATING, S.RUNNING, cpu_reading=n, columns={"last_active_at": 50.0 + n})
        for n, i in enumerate(ids)
    ]
    steps = reg.set_states(moves, reason="forked", at=100.0)
    assert [(t.sandbox_id, t.src, t.dst, t.at) for t in steps] == [
        (i, S.CREATING, S.RUNNING, 100.0) for i in ids
    ]
    for n, i in enumerate(ids):
        got = reg.get(i)
        assert (got.state, got.last_active_at) == (S.RUNNING, 50.0 + n)
        assert [(t.src, t.dst, t.reason) for t in reg.transitions(i)] == [
            (None, S.CREATING, "forked"),
            (S.CREATING, S.RUNNING, "forked"),
        ]
    assert reg.set_states([]) == []
    with pytest.raises(InvalidState):  # moved already: a second batch is refused
        reg.set_states(moves[:1])


@pytest.mark.parametrize("name", ["", "Agent", "-x", "a b", "x" * 64, "a/b"])
def test_invalid_names(reg: AnyRegistry, name: str) -> None:
    with pytest.raises(InvalidName):
        reg.insert(rec(name=name))
    assert reg.list() == []


def test_bad_labels(reg: AnyRegistry) -> None:
    with pytest.raises(InvalidArgument):
        reg.insert(rec(labels={"n": 3}))
    assert reg.list() == []


def test_list_filters(reg: AnyRegistry) -> None:
    reg.insert(rec("sbx-1", "a", labels={"user": "u1", "team": "x"}, created_at=1.0))
    reg.insert(rec("sbx-2", "b", labels={"user": "u2", "team": "x"}, created_at=2.0))
    reg.insert(rec("sbx-3", "c", tenant="t2", labels={"user": "u1"}, created_at=3.0))
    reg.set_state("sbx-2", S.CREATING, S.RUNNING)
    assert [r.id for r in reg.list(labels={"team": "x"})] == ["sbx-1", "sbx-2"]
    assert [r.id for r in reg.list(labels={"user": "u1"})] == ["sbx-1", "sbx-3"]
    assert [r.id for r in reg.list(tenant="default", labels={"user": "u1"})] == ["sbx-1"]
    assert [r.id for r in reg.list(states={S.RUNNING})] == ["sbx-2"]
    assert reg.list(labels={"user": "nobody"}) == []


def test_touch_moves_the_idle_clock(reg: AnyRegistry) -> None:
    reg.insert(rec(last_active_at=10.0))
    reg.touch("sbx-1", 99.0)
    assert reg.get("sbx-1").last_active_at == 99.0


def test_sqlite_touch_keeps_state_changes_synchronous(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "registry.db")
    reg.insert(rec(last_active_at=10.0))
    reg.touch("sbx-1", 99.0)
    # the cheap (no fsync) idle-clock write leaves state changes fully synchronous
    assert reg._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL


def test_update_settings(reg: AnyRegistry) -> None:
    reg.insert(rec(labels={"a": "1"}, idle_pause_seconds=60))
    reg.update_settings("sbx-1", labels={"b": "2"}, pause_retention_days=90)
    got = reg.get("sbx-1")
    assert (got.labels, got.idle_pause_seconds, got.pause_retention_days) == ({"b": "2"}, 60, 90)
    reg.update_settings("sbx-1", idle_pause_seconds=None)
    assert reg.get("sbx-1").idle_pause_seconds is None


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(labels=st.dictionaries(st.text(min_size=1, max_size=20), st.text(max_size=40), max_size=5))
def test_labels_roundtrip_and_filter(reg: AnyRegistry, labels: dict[str, str]) -> None:
    tenant = f"t{uuid.uuid4().hex[:8]}"  # one registry serves every example
    sid = f"sbx-{tenant}"
    reg.insert(rec(sid, tenant=tenant, labels=labels))
    assert reg.get(sid).labels == labels
    for key, value in labels.items():
        assert [r.id for r in reg.list(tenant=tenant, labels={key: value})] == [sid]


# -- PostgreSQL only: many nodes on one registry ----------------------------------------------


@pytest.fixture
def pg_dsn(pg_cluster: PgCluster, pg_database: str) -> str:
    return pg_cluster.admin_dsn(pg_database)


@pytest.mark.postgres
def test_postgres_two_nodes_race_and_exactly_one_wins(pg_dsn: str) -> None:
    nodes = [PostgresRegistry(pg_dsn) for _ in range(4)]  # four nodes, one database
    nodes[0].insert(rec())
    nodes[0].set_state("sbx-1", S.CREATING, S.RUNNING)
    nodes[0].set_state("sbx-1", S.RUNNING, S.PAUSING)
    nodes[0].set_state("sbx-1", S.PAUSING, S.PAUSED)
    won: list[int] = []
    lost: list[int] = []
    start = threading.Barrier(len(nodes))

    def wake(i: int) -> None:
        start.wait()
        try:
            nodes[i].set_state("sbx-1", S.PAUSED, S.WAKING, reason=f"node {i}")
            won.append(i)
        except InvalidState:
            lost.append(i)

    threads = [threading.Thread(target=wake, args=(i,)) for i in range(len(nodes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and len(lost) == len(nodes) - 1
    log = nodes[1].transitions("sbx-1")
    assert [t.dst for t in log].count(S.WAKING) == 1 and log[-1].reason == f"node {won[0]}"
    for n in nodes:
        n.close()


@pytest.mark.postgres
def test_postgres_schema_is_versioned_and_newer_is_refused(pg_dsn: str) -> None:
    import psycopg

    first = PostgresRegistry(pg_dsn)
    assert first.schema_version == PG_SCHEMA_VERSION
    first.insert(rec())
    first.close()
    again = PostgresRegistry(pg_dsn)  # opening again migrates nothing and keeps the rows
    assert again.get("sbx-1").name == "agent"
    again.close()
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO torpor_registry.schema_version (version) VALUES (%s)",
            (PG_SCHEMA_VERSION + 1,),
        )
    with pytest.raises(StorageError, match="newer"):
        PostgresRegistry(pg_dsn)


@pytest.mark.postgres
def test_postgres_dropped_connection_is_reopened(pg_dsn: str) -> None:
    import psycopg

    reg = PostgresRegistry(pg_dsn)
    reg.insert(rec())
    with psycopg.connect(pg_dsn, autocommit=True) as conn:  # as a server restart would
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
    with contextlib.suppress(StorageError):  # the call that finds it dead fails typed ...
        reg.get("sbx-1")
    assert reg.get("sbx-1").name == "agent"  # ... and the next one reconnects
    reg.close()


@pytest.mark.postgres
def test_postgres_unreachable_is_storage_error(tmp_path: Path) -> None:
    with pytest.raises(StorageError):
        PostgresRegistry(f"postgresql://nobody@/x?host={tmp_path}&connect_timeout=2")


# -- PostgreSQL only: nodes and leases (schema v2) --------------------------------------------


def _node(name: str, **kw: object) -> NodeInfo:
    fields: dict[str, object] = {"accelerator": "tcg", "cpu_model": "qemu64", "capacity_mib": 4096}
    fields.update(kw)
    return NodeInfo(id=name, **fields)  # type: ignore[arg-type]


@pytest.mark.postgres
def test_postgres_nodes_heartbeat(pg_dsn: str) -> None:
    reg = PostgresRegistry(pg_dsn)
    reg.heartbeat(_node("n1", accelerator="kvm"), lease_seconds=10, at=100.0)
    reg.heartbeat(_node("n2"), lease_seconds=10, at=100.0)
    reg.heartbeat(_node("n1", accelerator="kvm", capacity_mib=8192), lease_seconds=10, at=105.0)
    n1, n2 = reg.nodes()
    assert (n1.id, n1.accelerator, n1.capacity_mib, n1.started_at, n1.heartbeat_at) == (
        "n1",
        "kvm",
        8192,
        100.0,
        105.0,
    )
    assert n1.alive(110.0, stale_after=6) and not n2.alive(110.0, stale_after=6)
    assert reg.node("n2").cpu_model == "qemu64"
    with pytest.raises(NotFound):
        reg.node("n3")
    with pytest.raises(InvalidName):
        reg.heartbeat(_node("Bad Name"), lease_seconds=10)
    reg.close()


@pytest.mark.postgres
def test_postgres_one_owner_per_sandbox_with_a_lease(pg_dsn: str) -> None:
    n1, n2 = PostgresRegistry(pg_dsn), PostgresRegistry(pg_dsn)
    n1.insert(rec())
    n1.acquire("sbx-1", "n1", lease_seconds=10, at=100.0)
    n1.acquire("sbx-1", "n1", lease_seconds=10, at=101.0)  # its own: renewed
    with pytest.raises(Conflict) as taken:
        n2.acquire("sbx-1", "n2", lease_seconds=10, at=105.0)
    assert taken.value.data["owner_node"] == "n1"  # the node to proxy to
    assert n2.owner("sbx-1", at=105.0) == "n1"
    # n1 heartbeats: its lease moves on
    n1.heartbeat(_node("n1"), lease_seconds=10, at=109.0)
    assert n2.lapsed(at=115.0) == []
    # n1 stops heartbeating: past its lease the sandbox is listed lapsed, and n2 may take it
    assert [r.id for r in n2.lapsed(at=120.0)] == ["sbx-1"]
    assert n2.owner("sbx-1", at=120.0) is None
    n2.acquire("sbx-1", "n2", lease_seconds=10, at=120.0)
    assert n2.owner("sbx-1", at=121.0) == "n2"
    assert n1.release("sbx-1", "n1") is False  # n1 came back: it holds nothing to give
    assert n2.release("sbx-1", "n2") is True
    assert n1.owner("sbx-1", at=121.0) is None
    with pytest.raises(SandboxNotFound):
        n1.acquire("nope", "n1", lease_seconds=10)
    n1.close()
    n2.close()


@pytest.mark.postgres
def test_postgres_nodes_racing_to_acquire_one_wins(pg_dsn: str) -> None:
    nodes = [PostgresRegistry(pg_dsn) for _ in range(4)]
    nodes[0].insert(rec())
    won: list[int] = []
    start = threading.Barrier(len(nodes))

    def take(i: int) -> None:
        start.wait()
        with contextlib.suppress(Conflict):
            nodes[i].acquire("sbx-1", f"n{i}", lease_seconds=30)
            won.append(i)

    threads = [threading.Thread(target=take, args=(i,)) for i in range(len(nodes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and nodes[0].owner("sbx-1") == f"n{won[0]}"
    for n in nodes:
        n.close()


@pytest.mark.postgres
def test_postgres_v1_database_migrates_to_the_latest_keeping_rows(pg_dsn: str) -> None:
    old = PostgresRegistry(pg_dsn, schema_version=1)  # as an older torpor left it
    assert old.schema_version == 1
    old.insert(rec())
    old.close()
    new = PostgresRegistry(pg_dsn)
    assert new.schema_version == PG_SCHEMA_VERSION >= 3
    assert new.get("sbx-1").name == "agent"
    new.acquire("sbx-1", "n1", lease_seconds=10)
    assert new.owner("sbx-1") == "n1"
    new.close()


def test_events_envs_and_generation(reg: AnyRegistry) -> None:
    """Both registries: the event log read from transitions (tenant-scoped, resumable), the
    environment kept in the row (replaced by update_settings), the transition count."""
    before = reg.generation
    reg.insert(rec("sbx-a", "a", envs={"API_KEY": "k1"}))
    reg.insert(rec("sbx-o", "o", tenant="other"))
    reg.set_state("sbx-a", S.CREATING, S.RUNNING, reason="created")
    reg.set_state("sbx-a", S.RUNNING, S.PAUSING, reason="idle")
    reg.set_state("sbx-a", S.PAUSING, S.PAUSED, reason="idle", paused_at=time.time())
    reg.set_state("sbx-a", S.PAUSED, S.STOPPED, reason="expired")
    assert reg.generation == before + 6
    events, nxt = reg.events("default")
    assert [(e.kind, e.reason, e.name) for e in events] == [
        ("create", "created", "a"),
        ("pause", "idle", "a"),
        ("expire", "expired", "a"),
    ]
    assert reg.events("default", after=events[1].seq) == ([events[2]], nxt)
    assert reg.events("default", after=nxt) == ([], nxt)
    assert reg.events("other") == ([], reg.events("other")[1])  # its first row is no event
    assert reg.events("default", sandbox="sbx-o")[0] == []
    assert reg.get("sbx-a").envs == {"API_KEY": "k1"}
    assert "k1" not in reg.get("sbx-a").to_info().model_dump_json()
    reg.update_settings("sbx-o", envs={"B": "2"})
    assert reg.get("sbx-o").envs == {"B": "2"} and reg.get("sbx-o").memory_mib == 512
