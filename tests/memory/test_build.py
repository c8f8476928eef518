"""Batch writes (:mod:`torpor.memory._build`): a batch stores what the same items written one
call at a time store, field by field; the trusted model constructor; the SQLite schema step
that moved the insert triggers' work into the batch statements."""

from __future__ import annotations

import sqlite3
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from torpor.memory import Memory
from torpor.memory.backends._sqlite_conn import connect
from torpor.memory.backends._sqlite_schema import MIGRATIONS
from torpor.memory.backends.base import AnyRecord, RecordFilter
from torpor.memory.backends.sqlite import SQLiteTenantStore
from torpor.memory.models import (
    Episode,
    Fact,
    SourceRef,
    from_us,
    new_ids,
    now_us,
    now_us_run,
    trusted,
)

#: compared apart: the two scopes, times (expiry as a lifetime), ids (by form)
_APART = {"id", "scope", "created_at", "valid_from", "valid_to", "expires_at", "superseded_by"}


def _facts(cited: Path) -> list[Any]:
    return [
        "plain text",
        {"text": "with metadata", "metadata": {"topic": "billing", "n": 3, "ok": True}},
        {"text": "nested metadata", "metadata": {"a": {"b": [1, "two", None]}}},
        {"text": "plan is Free", "key": "plan"},
        {"text": "plan is Pro", "key": "plan"},  # supersedes the one above, same batch
        {"text": "cached", "durability": "cache"},  # the policy's cache TTL
        {"text": "short lived", "ttl": 30},
        {"text": "short lived, timedelta", "ttl": timedelta(minutes=2), "durability": "cache"},
        {"text": "cited", "source": {"path": str(cited), "line": 1}},
        {"text": "cited, missing", "source": SourceRef(path=str(cited) + ".gone")},
        {"text": "empty durability is persistent", "durability": None, "key": None},
    ]


def _turns() -> list[dict[str, Any]]:
    return [
        {"role": "user", "text": "hello there"},
        {"role": "assistant", "text": "hi", "session": "s-2", "metadata": {"m": 1}},
        {"role": "x" * 80, "text": "a long role is cut to 64"},
        {"role": "user", "text": "back-filled", "at": "2024-03-15T09:30:00+02:00"},
        {"role": "user", "text": "back-filled, naive", "at": datetime(2024, 3, 16, 8, 0)},
        {"role": "user", "text": "expires", "ttl": 60, "durability": "cache"},
    ]


def _one_by_one(scope: Any, facts: list[Any], turns: list[dict[str, Any]]) -> list[AnyRecord]:
    out: list[AnyRecord] = []
    for item in facts:
        spec = {"text": item} if isinstance(item, str) else item
        out.append(scope.remember(**spec))
    return out + [scope.log(**turn) for turn in turns]


def _compare(batch: AnyRecord, single: AnyRecord) -> None:
    a, b = batch.model_dump(), single.model_dump()
    assert {k: v for k, v in a.items() if k not in _APART} == {
        k: v for k, v in b.items() if k not in _APART
    }
    for rec in (batch, single):
        assert len(rec.id) == 24 and int(rec.id, 16) >= 0
        assert int(rec.id[:14], 16) > 0
    # lifetimes, not instants: each was measured from its own write
    life_a = None if batch.expires_at is None else batch.expires_at - batch.created_at
    life_b = None if single.expires_at is None else single.expires_at - single.created_at
    assert life_a == life_b
    # a back-filled time is the caller's; otherwise a record is valid from its write
    assert (batch.valid_from == batch.created_at) == (single.valid_from == single.created_at)
    if batch.valid_from != batch.created_at:
        assert batch.valid_from == single.valid_from


def test_a_batch_stores_what_single_calls_store(hmem: Memory, tmp_path: Path) -> None:
    cited = tmp_path / "ledger.csv"
    cited.write_text("plan,Pro\n")
    batch_scope = hmem.scope(app="a", user="batch")
    single_scope = hmem.scope(app="a", user="single")
    for s in (batch_scope, single_scope):
        s.set_policy(cache_ttl_seconds=600, retention_seconds=86_400)
    facts, turns = _facts(cited), _turns()
    made = batch_scope.remember_many(facts) + batch_scope.log_many(turns)
    one = _one_by_one(single_scope, facts, turns)
    assert len(made) == len(one) == len(facts) + len(turns)
    store = hmem.store
    # what the calls returned, then what the store reads back
    for a, b in zip(made, one, strict=True):
        _compare(a, b)
        assert (a.scope, b.scope) == (batch_scope.path, single_scope.path)
    back_a = store.get([r.id for r in made], now_us())
    back_b = store.get([r.id for r in one], now_us())
    for a, b in zip(back_a, back_b, strict=True):
        assert a is not None and b is not None
        _compare(a, b)
    # one write time per record, increasing in the batch's order; ids unique, in that order
    times = [r.created_at for r in made]
    assert times == sorted(times) and len(set(times)) == len(times)
    assert [r.id for r in made] == sorted(r.id for r in made)
    assert len({r.id for r in made}) == len(made)
    # the batch's first "plan" ended where its second began, as in single calls
    for recs in (back_a, back_b):
        first, second = (r for r in recs if isinstance(r, Fact) and r.key == "plan")
        assert isinstance(first, Fact) and isinstance(second, Fact)
        assert first.valid_to == second.valid_from and first.superseded_by == second.id
    # and what each item asked for (single calls are batches of one: the same code)
    day, lives = timedelta(days=1), [r.expires_at - r.created_at for r in made if r.expires_at]
    assert lives == [day] * 5 + [timedelta(seconds=600), timedelta(seconds=30)] + [
        timedelta(minutes=2)
    ] + [day] * 3 + [day] * 5 + [timedelta(seconds=60)]
    episodes = [r for r in made if isinstance(r, Episode)]
    assert [e.role for e in episodes][:3] == ["user", "assistant", "x" * 64]
    assert [e.session for e in episodes][:2] == [None, "s-2"]
    assert episodes[3].valid_from == datetime(2024, 3, 15, 7, 30, tzinfo=UTC)
    assert episodes[4].valid_from == datetime(2024, 3, 16, 8, 0, tzinfo=UTC)
    assert made[1].metadata == {"topic": "billing", "n": 3, "ok": True}
    assert [getattr(r, "key", "-") for r in made[:5]] == [None, None, None, "plan", "plan"]
    assert [r.durability for r in made[5:8]] == ["cache", "persistent", "cache"]
    verified = [r for r in made if isinstance(r, Fact) and r.source is not None]
    assert [r.verified for r in verified] == [True, False] and verified[1].reason
    # each record is found by its own text, lexically and by vector, in both scopes
    for s, recs in ((batch_scope, made), (single_scope, one)):
        for rec in recs:
            if isinstance(rec, Fact) and rec.valid_to is not None:
                continue
            hits = s.recall(rec.text, k=20, include_history=True)
            assert rec.id in {h.record.id for h in hits}, rec.text


def test_clock_run_and_ids() -> None:
    before = now_us()
    first = now_us_run(1000)
    assert first > before
    assert now_us() > first + 999  # nothing after the run reuses its times
    ids = new_ids([first, first + 1, first + 2])
    assert [int(i[:14], 16) for i in ids] == [first, first + 1, first + 2]
    assert len({i[14:] for i in ids}) == 3 and all(len(i) == 24 for i in ids)


@pytest.mark.parametrize(
    "model, values",
    [
        pytest.param(
            Fact,
            {
                "id": "0" * 24,
                "kind": "fact",
                "scope": "app/a",
                "text": "t",
                "metadata": {"k": [1]},
                "created_at": from_us(5),
                "valid_from": from_us(5),
                "valid_to": from_us(9),
                "durability": "cache",
                "expires_at": None,
                "key": "k",
                "source": SourceRef(url="https://example.com/x"),
                "source_hash": "ab",
                "verified": True,
                "reason": None,
                "stale": False,
                "superseded_by": "1" * 24,
            },
            id="fact",
        ),
        pytest.param(
            Episode,
            {
                "id": "0" * 24,
                "kind": "episode",
                "scope": "",
                "text": "t",
                "metadata": {},
                "created_at": datetime(2024, 1, 1, tzinfo=UTC),
                "valid_from": datetime(2023, 1, 1, tzinfo=UTC),
                "valid_to": None,
                "durability": "persistent",
                "expires_at": datetime(2025, 1, 1, tzinfo=UTC),
                "role": "assistant",
                "session": "s",
            },
            id="episode",
        ),
    ],
)
def test_trusted_equals_the_validated_model(model: Any, values: dict[str, Any]) -> None:
    made, checked = trusted(model, values), model(**values)
    assert made == checked
    assert made.model_dump() == checked.model_dump()
    assert made.model_dump_json() == checked.model_dump_json()
    assert repr(made) == repr(checked)
    made.text = "changed"  # an ordinary, mutable model
    assert made.text == "changed"
    with pytest.raises(KeyError):
        trusted(model, {k: v for k, v in values.items() if k != "text"})


def test_a_v2_database_moves_to_batch_statements(tmp_path: Path) -> None:
    """A database written by the schema with insert triggers (v2) is migrated: its records
    stay counted and searchable, and new ones are indexed and counted without triggers."""
    path = tmp_path / "t1.db"
    old = connect(path, MIGRATIONS[:2])
    old.execute(
        "INSERT INTO records (id, kind, scope, text, created_at, valid_from) "
        "VALUES ('0000000000000100000000000', 'fact', 'app/a', 'older walrus', 1, 1)"
    )
    old.close()
    store = SQLiteTenantStore("t1", path)
    assert store.schema_version() == len(MIGRATIONS)
    t = from_us(now_us())
    new = Fact(
        id=new_ids([now_us()])[0], scope="app/a", text="newer walrus", created_at=t, valid_from=t
    )
    store.add([new])
    assert store.record_count() == 2
    hits = store.lexical_search(["walrus"], RecordFilter(scopes=["app/a"], now=now_us()), 5)
    assert sorted(r.text for r, _ in hits) == ["newer walrus", "older walrus"]
    assert store.forget([r.id for r, _ in hits]) == 2
    assert store.record_count() == 0
    assert store.lexical_search(["walrus"], RecordFilter(scopes=["app/a"], now=now_us()), 5) == []
    store.close()
    conn = sqlite3.connect(path)
    conn.execute("INSERT INTO records_fts (records_fts) VALUES ('integrity-check')")
    names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='trigger'")}
    assert "records_ai" not in names and "records_count_ai" not in names
    conn.close()
