"""The SQLite registry: rows, the transitions log, names, schema version, errors."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torpor.errors import (
    Conflict,
    InvalidArgument,
    InvalidName,
    InvalidState,
    SandboxClosed,
    SandboxNotFound,
    StorageError,
)
from torpor.sandbox.models import SandboxState as S
from torpor.sandbox.registry import SCHEMA_VERSION, Registry, SandboxRecord


@pytest.fixture
def reg(tmp_path: Path) -> Registry:
    return Registry(tmp_path / "registry.db")


def rec(id: str = "sbx-1", name: str = "agent", **kw: object) -> SandboxRecord:
    fields: dict[str, object] = {"tenant": "default", "template": "python", "state": S.CREATING}
    fields.update(kw)
    return SandboxRecord(id=id, name=name, **fields)  # type: ignore[arg-type]


def test_insert_get_roundtrip(reg: Registry) -> None:
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


def test_unopenable_path_is_storage_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(StorageError):
        Registry(tmp_path / "file" / "registry.db")


def test_corrupt_file_is_storage_error(tmp_path: Path) -> None:
    (tmp_path / "r.db").write_bytes(b"not a database at all" * 100)
    with pytest.raises(StorageError):
        Registry(tmp_path / "r.db")


def test_transitions_log_and_compare_and_set(reg: Registry) -> None:
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


def test_illegal_move_and_unknown_id(reg: Registry) -> None:
    reg.insert(rec())
    with pytest.raises(InvalidState):
        reg.set_state("sbx-1", S.CREATING, S.PAUSED)
    with pytest.raises(SandboxNotFound):
        reg.set_state("nope", S.CREATING, S.RUNNING)
    with pytest.raises(SandboxNotFound):
        reg.get("nope")
    with pytest.raises(InvalidArgument):
        reg.set_state("sbx-1", S.CREATING, S.RUNNING, name="sneaky")


def test_stopped_row_answers_sandbox_closed(reg: Registry) -> None:
    reg.insert(rec())
    reg.set_state("sbx-1", S.CREATING, S.STOPPED)
    with pytest.raises(SandboxClosed):
        reg.set_state("sbx-1", S.STOPPED, S.RUNNING)


def test_names_unique_per_tenant_among_live(reg: Registry) -> None:
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


@pytest.mark.parametrize("name", ["", "Agent", "-x", "a b", "x" * 64, "a/b"])
def test_invalid_names(reg: Registry, name: str) -> None:
    with pytest.raises(InvalidName):
        reg.insert(rec(name=name))
    assert reg.list() == []


def test_bad_labels(reg: Registry) -> None:
    with pytest.raises(InvalidArgument):
        reg.insert(rec(labels={"n": 3}))
    assert reg.list() == []


def test_list_filters(reg: Registry) -> None:
    reg.insert(rec("sbx-1", "a", labels={"user": "u1", "team": "x"}, created_at=1.0))
    reg.insert(rec("sbx-2", "b", labels={"user": "u2", "team": "x"}, created_at=2.0))
    reg.insert(rec("sbx-3", "c", tenant="t2", labels={"user": "u1"}, created_at=3.0))
    reg.set_state("sbx-2", S.CREATING, S.RUNNING)
    assert [r.id for r in reg.list(labels={"team": "x"})] == ["sbx-1", "sbx-2"]
    assert [r.id for r in reg.list(labels={"user": "u1"})] == ["sbx-1", "sbx-3"]
    assert [r.id for r in reg.list(tenant="default", labels={"user": "u1"})] == ["sbx-1"]
    assert [r.id for r in reg.list(states={S.RUNNING})] == ["sbx-2"]
    assert reg.list(labels={"user": "nobody"}) == []


def test_touch_moves_the_idle_clock(reg: Registry) -> None:
    reg.insert(rec(last_active_at=10.0))
    reg.touch("sbx-1", 99.0)
    assert reg.get("sbx-1").last_active_at == 99.0
    # the cheap (no fsync) idle-clock write leaves state changes fully synchronous
    assert reg._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL


@settings(max_examples=40, deadline=None)
@given(labels=st.dictionaries(st.text(min_size=1, max_size=20), st.text(max_size=40), max_size=5))
def test_labels_roundtrip_and_filter(
    tmp_path_factory: pytest.TempPathFactory, labels: dict[str, str]
) -> None:
    reg = Registry(tmp_path_factory.mktemp("reg") / "r.db")
    reg.insert(rec(labels=labels))
    assert reg.get("sbx-1").labels == labels
    for key, value in labels.items():
        assert [r.id for r in reg.list(labels={key: value})] == ["sbx-1"]
    reg.close()
