"""Concurrent writers lose nothing; broken databases give typed errors and reopen."""

from __future__ import annotations

import itertools
import multiprocessing as mp
import sqlite3
from pathlib import Path

import pytest

from torpor.errors import CorruptData, StorageError
from torpor.memory import Memory

WRITERS = 4
PER_WRITER = 60


def _writer(home: str, n: int) -> None:
    m = Memory(home, tenant="busy", embedder=None)
    u = m.scope(app="a", user="u")
    for i in range(PER_WRITER):
        if i % 3 == 0:
            u.remember_many([f"w{n} batch {i} item {j}" for j in range(3)])
        else:
            u.remember(f"w{n} fact {i}")
        u.remember(f"w{n} says {i}", key="last_word")
        u.log("user", f"w{n} turn {i}")
    m.close()


def test_concurrent_writer_processes_lose_nothing(tmp_path: Path) -> None:
    home = str(tmp_path)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(home, n)) for n in range(WRITERS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
        assert p.exitcode == 0
    m = Memory(home, tenant="busy", embedder=None)
    recs = [r for r, _ in m.store.iter_records("")]
    per_writer = (PER_WRITER // 3) * 3 + (PER_WRITER - PER_WRITER // 3) + PER_WRITER * 2
    assert len(recs) == WRITERS * per_writer
    hist = m.scope(app="a", user="u").history("last_word")
    assert len(hist) == WRITERS * PER_WRITER
    assert sum(f.valid_to is None for f in hist) == 1
    for older, newer in itertools.pairwise(hist):
        assert older.valid_to == newer.valid_from and older.superseded_by == newer.id
    m.close()


def test_threads_share_one_memory(tmp_path: Path) -> None:
    import threading

    m = Memory(str(tmp_path), embedder=None)
    u = m.scope(app="a")

    def work(n: int) -> None:
        for i in range(50):
            u.remember(f"t{n} {i}", key=f"k{i % 5}")

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(list(m.store.iter_records(""))) == 200
    assert all(sum(f.current for f in u.history(f"k{i}")) == 1 for i in range(5))
    m.close()


def test_corrupt_database_is_typed(tmp_path: Path) -> None:
    mem_dir = tmp_path / "memory"
    mem_dir.mkdir()
    (mem_dir / "broken.db").write_bytes(b"this is not a database at all" * 100)
    with pytest.raises(CorruptData) as err:
        Memory(str(tmp_path), tenant="broken", embedder=None)
    assert "broken.db" in err.value.data["path"]
    # other tenants are unaffected
    ok = Memory(str(tmp_path), tenant="fine", embedder=None)
    ok.scope(app="a").remember("still works")
    ok.close()


def test_closed_memory_is_typed_and_file_reopens(tmp_path: Path) -> None:
    m = Memory(str(tmp_path), embedder=None)
    u = m.scope(app="a")
    u.remember("before close")
    m.close()
    with pytest.raises(StorageError):
        u.remember("after close")
    with pytest.raises(StorageError):
        u.recall("before")
    again = Memory(str(tmp_path), embedder=None)
    assert [h.text for h in again.scope(app="a").recall("before close")] == ["before close"]
    again.close()


def test_locked_database_times_out_typed_then_recovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torpor.memory.backends import _sqlite_conn as sq

    monkeypatch.setattr(sq, "_BEGIN_RETRIES", 2)
    m = Memory(str(tmp_path), embedder=None)
    u = m.scope(app="a")
    u.remember("first")
    blocker = sqlite3.connect(tmp_path / "memory" / "default.db", timeout=0.1)
    blocker.execute("BEGIN EXCLUSIVE")
    m.store._db.conn.execute("PRAGMA busy_timeout = 50")  # type: ignore[attr-defined]
    with pytest.raises(StorageError):
        u.remember("blocked")
    blocker.rollback()
    blocker.close()
    u.remember("later")
    assert {h.text for h in u.recall("first later")} == {"first", "later"}
    m.close()


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    m = Memory(str(tmp_path), tenant="future", embedder=None)
    m.close()
    db = sqlite3.connect(tmp_path / "memory" / "future.db")
    db.execute("PRAGMA user_version = 99")
    db.close()
    with pytest.raises(StorageError, match="newer"):
        Memory(str(tmp_path), tenant="future", embedder=None)
