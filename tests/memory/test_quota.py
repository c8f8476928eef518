"""The memory-records quota (issue 12, item 3): a tenant's store refuses a write that would take
it over ``memory_records`` records with a typed :class:`QuotaExceeded` (limit, used), writes
nothing of a refused batch, and counts every row it keeps (superseded history and episodes
too). Embedded and over HTTP, on SQLite and PostgreSQL; the count stays exact under
concurrent writers."""

from __future__ import annotations

import io
import json
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.memory.conftest import Api
from torpor.errors import QuotaExceeded
from torpor.memory.backends import TenantStore
from torpor.memory.models import Episode, Fact, from_us, new_id, now_us


def _set_quota(home: Path, monkeypatch: pytest.MonkeyPatch, table: dict[str, Any]) -> None:
    # the embedded Memory reads <its home>/quotas.json; the test server (a fake manager, no
    # home of its own) reads $TORPOR_HOME's: point both at the same file
    monkeypatch.setenv("TORPOR_HOME", str(home))
    (home / "quotas.json").write_text(json.dumps(table))


def _rows(m: Any) -> int:
    """Every record the tenant keeps (history too): the export's lines, minus its header."""
    buf = io.StringIO()
    m.scope().export(buf)
    return sum(1 for line in buf.getvalue().splitlines() if '"record"' in line)


def test_record_quota(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    _set_quota(
        api.home, monkeypatch, {"*": {"memory_records": 2}, "default": {"memory_records": 5}}
    )
    m: Any = api.mem
    u = m.scope(app="a", user="u")
    u.remember("plan is basic", key="plan")
    u.remember("plan is pro", key="plan")  # the old version stays in history: 2 rows
    u.log("user", "hello", session="s")
    u.remember("likes tea")
    assert _rows(m) == 4

    with pytest.raises(QuotaExceeded) as info:
        u.remember_many(["one", "two"])
    err = info.value
    assert (err.quota, err.limit, err.used) == ("memory_records", 5, 4)  # type: ignore[attr-defined]
    with pytest.raises(QuotaExceeded):
        u.log_many([{"role": "user", "text": "a"}, {"role": "assistant", "text": "b"}])
    assert _rows(m) == 4  # a refused batch writes nothing, not even its first part

    u.remember("plan is team", key="plan")  # a new version counts: the 5th row
    with pytest.raises(QuotaExceeded):
        u.remember("one too many")
    with pytest.raises(QuotaExceeded):  # a fork (an import) is a write like any other
        u.fork(app="a", user="u2")
    assert _rows(m) == 5

    old = u.history("plan")[0]
    assert u.forget(old.id) == 1  # forgetting frees room
    u.log("user", "again", session="s")
    assert _rows(m) == 5

    # the "*" entry applies to a tenant without its own: another tenant gets 2
    other: Any = api.as_token([("write", "")], tenant="other")
    other.scope(app="x").remember_many(["1", "2"])
    with pytest.raises(QuotaExceeded) as info:
        other.scope(app="x").remember("3")
    assert info.value.tenant == "other" and info.value.limit == 2  # type: ignore[attr-defined]


def _fact(scope: str, text: str, key: str | None = None) -> Fact:
    now = from_us(now_us())
    return Fact(id=new_id(), scope=scope, text=text, key=key, created_at=now, valid_from=now)


def test_count_follows_every_write_and_erase(store: TenantStore) -> None:
    """The counter the quota reads is the number of rows, whatever changed it."""

    def rows() -> int:
        return sum(1 for _ in store.iter_records(""))

    store.add([_fact("app/a", "x", key="k"), _fact("app/a", "y", key="k"), _fact("app/b", "z")])
    now = from_us(now_us())
    ep = Episode(
        id=new_id(),
        scope="app/a",
        role="user",
        text="hi",
        session="s",
        created_at=now,
        valid_from=now,
    )
    store.add([ep])
    assert store.record_count() == rows() == 4
    store.forget([ep.id])
    assert store.record_count() == rows() == 3
    store.forget_scope("app/b")
    assert store.record_count() == rows() == 2
    store.cap_expiry("app/a", 0)
    store.purge_expired(now_us() + 1)
    assert store.record_count() == rows() == 0
    with pytest.raises(QuotaExceeded):
        store.add([_fact("app/a", str(i)) for i in range(3)], quota=2)
    assert store.record_count() == rows() == 0


def test_quota_exact_under_concurrent_writers(store: TenantStore) -> None:
    """Eight writers race to add 10 records each under a quota of 50: exactly 50 land."""
    refused: list[int] = []

    def writer(n: int) -> None:
        for i in range(10):
            try:
                store.add([_fact("app/race", f"w{n} r{i}")], quota=50)
            except QuotaExceeded:
                refused.append(n)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.record_count() == sum(1 for _ in store.iter_records("")) == 50
    assert len(refused) == 30
