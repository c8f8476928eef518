"""One suite, two transports: every memory operation through the embedded :class:`Memory`
and through ``rt.memory`` against a real server, on every backend (fixture ``api``).

The same calls, the same models, the same typed errors: this file never asks which one it
has, except to build tokens (``Api.as_token``).
"""

from __future__ import annotations

import io
import json
import os
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict

from tests.memory.conftest import Api
from torpor.errors import (
    AccessDenied,
    InvalidArgument,
    PayloadTooLarge,
    RecordNotFound,
    SchemaViolation,
    StorageError,
)
from torpor.memory import Context, Episode, Fact, Hit, Policy, Profile
from torpor.memory.models import from_us, now_us


def _lines(m: Any) -> int:
    """How many export lines the tenant's root holds (1: the header alone)."""
    buf = io.StringIO()
    return int(m.scope().export(buf))


def test_issue_example(api: Api) -> None:
    m: Any = api.mem
    u = m.scope(app="support", user="u-42")
    u.set_profile({"plan": "pro", "name": "Jordan"})
    u.log("user", "Can you send me summaries every week?", session="s1")
    f = u.remember("prefers weekly summaries", key="summary_cadence")
    assert isinstance(f, Fact) and f.scope == "app/support/user/u-42"
    u.remember("prefers daily summaries", key="summary_cadence")
    hits = u.recall("how often should I send summaries?", k=3)
    assert all(isinstance(h, Hit) for h in hits)
    texts = [h.text for h in hits]
    assert "prefers daily summaries" in texts and "prefers weekly summaries" not in texts
    facts = u.recall("how often should I send summaries?", k=3, kind="fact")
    assert [h.text for h in facts] == ["prefers daily summaries"]
    hist = u.history("summary_cadence")
    assert [h.text for h in hist] == ["prefers weekly summaries", "prefers daily summaries"]
    assert hist[0].valid_to == hist[1].valid_from and hist[1].valid_to is None
    then = [h.text for h in u.recall("summaries", as_of=f.valid_from)]
    assert "prefers weekly summaries" in then and "prefers daily summaries" not in then
    ctx = u.context("write Jordan a short update", budget_tokens=300)
    assert isinstance(ctx, Context) and "Jordan" in str(ctx) and ctx.tokens <= 300
    assert "prefers daily summaries" in ctx.text
    got = u.get(f.id)  # superseded since: the same fact, its validity now closed
    assert got.model_copy(update={"valid_to": None, "superseded_by": None}) == f
    assert got.valid_to == hist[1].valid_from


def test_scopes_see_ancestors_not_siblings(api: Api) -> None:
    m: Any = api.mem
    app, u, v = m.scope(app="a"), m.scope(app="a", user="u"), m.scope(app="a", user="v")
    app.remember("office hours are nine to five")
    u.remember("u likes office hours in the morning")
    v.remember("v office hours secret")
    texts = [h.text for h in u.recall("office hours", k=10)]
    assert texts == ["u likes office hours in the morning", "office hours are nine to five"]
    assert [h.text for h in app.recall("office hours", k=10)] == ["office hours are nine to five"]


def test_filters_kind_metadata_time(api: Api) -> None:
    u: Any = api.mem.scope(app="a", user="u")  # type: ignore[attr-defined]
    old = u.log("user", "talked about the garden", at=from_us(now_us() - 86_400_000_000 * 3))
    new = u.log("assistant", "garden advice given", session="s2", metadata={"lang": "en"})
    assert isinstance(new, Episode) and old.at < new.at
    f = u.remember("has a garden")
    assert [h.id for h in u.recall("garden", kind="fact")] == [f.id]
    assert {h.id for h in u.recall("garden", kind="episode")} == {old.id, new.id}
    assert [h.id for h in u.recall("garden", metadata={"lang": "en"})] == [new.id]
    assert [h.id for h in u.recall("garden", session="s2")] == [new.id]
    day_ago = from_us(now_us() - 86_400_000_000)
    assert [h.id for h in u.recall("garden", until=day_ago)] == [old.id]
    assert old.id not in [h.id for h in u.recall("garden", since=day_ago)]


def test_times_are_read_alike_embedded_and_over_http(api: Api) -> None:
    """A ``date`` worked embedded and was "not JSON" over HTTP; a number was refused embedded
    and read as a Unix time over HTTP. Both read as the library reads them now."""
    u: Any = api.mem.scope(app="a", user="u")  # type: ignore[attr-defined]
    first = u.log("user", "planted tomatoes", at=date(2026, 3, 1))
    second = u.log_many([{"role": "user", "text": "tomatoes sprouted", "at": "2026-03-08"}])[0]
    assert first.at == datetime(2026, 3, 1, tzinfo=UTC)  # a bare date: its midnight, UTC
    assert second.at == datetime(2026, 3, 8, tzinfo=UTC)
    hits = u.recall("tomatoes", since=date(2026, 3, 5), until="2026-03-09T00:00:00")
    assert [h.id for h in hits] == [second.id]
    assert [h.id for h in u.recall("tomatoes", as_of=date(2026, 3, 2))] == [first.id]
    bad: list[Callable[[], object]] = [
        lambda: u.log("user", "x", at=1_772_323_200),
        lambda: u.recall("tomatoes", as_of=1_772_323_200),
        lambda: u.log_many([{"role": "user", "text": "x", "at": 1_772_323_200}]),
    ]
    for call in bad:
        with pytest.raises(InvalidArgument):
            call()
    assert len(u.recall("tomatoes", k=10)) == 2  # nothing written by the refused calls


def test_batched_writes(hapi: Api) -> None:
    u: Any = hapi.mem.scope(app="a", user="u")  # type: ignore[attr-defined]
    facts = u.remember_many(
        [f"note number {i}" for i in range(200)]
        + [{"text": "keyed", "key": "k", "metadata": {"x": 1}}]
    )
    assert len(facts) == 201 and facts[-1].key == "k"
    eps = u.log_many([{"role": "user", "text": f"turn {i}", "session": "s"} for i in range(50)])
    assert len(eps) == 50 and eps[0].session == "s"
    hits = u.recall("note number 17", k=3)
    assert len(hits) == 3 and hits[0].scores["vector"] > 0


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(lambda u: u.remember(""), id="empty"),
        pytest.param(lambda u: u.remember("a\x00b"), id="nul"),
        pytest.param(lambda u: u.remember("x", key="bad key!"), id="key"),
        pytest.param(lambda u: u.remember("x", metadata={"a": object()}), id="metadata"),
        pytest.param(lambda u: u.remember("x", ttl=-1), id="ttl"),
        pytest.param(lambda u: u.remember("x", durability="forever"), id="durability"),
        pytest.param(lambda u: u.remember("x", source={"path": "relative"}), id="source"),
        pytest.param(lambda u: u.remember_many(["ok", ""]), id="batch"),
        pytest.param(lambda u: u.remember_many([{"text": "a", "colour": 1}]), id="unknown-field"),
        pytest.param(lambda u: u.remember_many(["ok", None]), id="batch-item-none"),
        pytest.param(lambda u: u.remember_many(["ok", [["a", 1]]]), id="batch-item-list"),
        pytest.param(lambda u: u.log_many([{"role": "u", "text": "ok"}, "x"]), id="turn-text"),
        pytest.param(lambda u: u.log("", "hi"), id="role"),
        pytest.param(
            lambda u: u.log_many([{"role": "u", "text": "ok"}, {"text": "x"}]), id="turns"
        ),
        pytest.param(lambda u: u.recall(""), id="query"),
        pytest.param(lambda u: u.recall("x", kind="note"), id="kind"),
        pytest.param(lambda u: u.recall("x", kind=3), id="kind-number"),
        pytest.param(lambda u: u.recall("x", kind={"fact"}), id="kind-set"),
        pytest.param(lambda u: u.recall("x", k=-1), id="k"),
        pytest.param(lambda u: u.recall("x", k=10**30), id="k-huge"),
        pytest.param(lambda u: u.context("x", k_facts=10**10), id="k-facts-huge"),
        pytest.param(lambda u: u.context("x", budget_tokens=0), id="budget"),
        pytest.param(lambda u: u.remember("bad \ud800 text"), id="lone-surrogate"),
        pytest.param(lambda u: u.recall("where \ud800"), id="surrogate-query"),
        pytest.param(lambda u: u.import_(io.StringIO('{"type": "fact"}\n')), id="import"),
    ],
)
def test_bad_input_is_typed_and_writes_nothing(api: Api, bad: Any) -> None:
    m: Any = api.mem
    u = m.scope(app="a", user="u")
    with pytest.raises(InvalidArgument):
        bad(u)
    assert _lines(m) == 1
    assert u.get_profile() == {}


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(lambda u: u.recall("cat", session="\ud800"), id="surrogate-session"),
        pytest.param(lambda u: u.recall("cat", session=["s"]), id="session-list"),
        pytest.param(lambda u: u.recall("cat", min_similarity="high"), id="floor-text"),
        pytest.param(lambda u: u.recall("cat", min_similarity=float("nan")), id="floor-nan"),
    ],
)
def test_recalls_session_and_floor_are_checked(hapi: Api, bad: Any) -> None:
    """A session or a vector floor recall cannot use is InvalidArgument (with vectors: the
    floor is the vector side's), not a raw encoding or type error."""
    mem: Any = hapi.mem
    u = mem.scope(app="a", user="u")
    u.remember("the cat sat on the mat")
    with pytest.raises(InvalidArgument):
        bad(u)


def test_bad_scope_names(api: Api) -> None:
    m: Any = api.mem
    with pytest.raises(InvalidArgument):
        m.scope(app="not a name!")


def test_oversized_text(api: Api) -> None:
    m: Any = api.mem
    u = m.scope(app="a", user="u")
    with pytest.raises(PayloadTooLarge) as err:
        u.remember("x" * 40_000)
    assert err.value.data["limit"] == 32_000
    with pytest.raises(PayloadTooLarge):
        u.remember_many(["fine", "y" * 40_000])
    assert _lines(m) == 1


def test_not_found(api: Api) -> None:
    m: Any = api.mem
    with pytest.raises(RecordNotFound):
        m.scope(app="a").history("never_used")
    with pytest.raises(RecordNotFound):
        m.scope(app="a").get("no-such-record")
    with pytest.raises(RecordNotFound):
        m.forget("no-such-record")


def test_profile_schema(api: Api) -> None:
    class P(BaseModel):
        model_config = ConfigDict(extra="forbid")
        plan: str
        name: str | None = None

    m: Any = api.mem
    u = m.scope(app="a", user="u")
    assert isinstance(u.set_profile({"plan": "pro", "name": "Jordan"}, schema=P), Profile)
    with pytest.raises(SchemaViolation):
        u.set_profile({"plan": 3})
    with pytest.raises(SchemaViolation):
        u.set_profile({"plan": "pro", "unknown": 1}, merge=True)
    assert u.get_profile() == {"plan": "pro", "name": "Jordan"}
    v = m.scope(app="a", user="v")
    v.set_profile({"age": 3}, schema={"type": "object", "properties": {"age": {"type": "integer"}}})
    with pytest.raises(SchemaViolation):
        v.set_profile({"age": "three"})
    assert v.set_profile({"tz": "UTC"}, merge=True).data == {"age": 3, "tz": "UTC"}


def test_ttl_cache_retention_gc(api: Api) -> None:
    m: Any = api.mem
    u = m.scope(app="a", user="u")
    u.remember("temporary value", durability="cache", ttl=timedelta(microseconds=1))
    keep = u.remember("permanent value")
    assert [h.id for h in u.recall("value")] == [keep.id]
    assert isinstance(u.set_policy(cache_ttl_seconds=3600), Policy)
    c = u.remember("cached value", durability="cache")
    assert c.expires_at is not None and c.durability == "cache"
    u.set_policy(retention_seconds=1e-6)
    assert u.recall("value") == []
    assert m.gc() >= 3
    assert _lines(m) == 2  # the header and the policy: the records are purged for good


def test_forget_record_and_scope(api: Api) -> None:
    m: Any = api.mem
    u, v = m.scope(app="a", user="u"), m.scope(app="a", user="v")
    f = u.remember("forget me")
    g = u.remember("keep me")
    other = v.remember("forget me too")
    with pytest.raises(RecordNotFound):
        u.forget(other.id)
    assert m.forget(f.id) == 1
    assert [h.id for h in u.recall("me")] == [g.id]
    assert m.forget(u) == 1
    assert u.recall("me") == [] and [h.id for h in v.recall("forget")] == [other.id]
    assert any(e.action == "forget.scope" for e in m.audit_log())


def test_export_import_fork_roundtrip(hapi: Api, tmp_path: Path) -> None:
    m: Any = hapi.mem
    u = m.scope(app="a", user="u")
    u.set_profile({"plan": "pro"})
    u.remember("weekly", key="cadence")
    u.remember("daily", key="cadence")
    u.log("user", "hello there", session="s1")
    path = tmp_path / "u.jsonl"
    assert u.export(path) >= 5
    w = m.scope(app="a", user="w")
    assert w.import_(path) == 3
    assert [f.text for f in w.history("cadence")] == ["weekly", "daily"]
    assert w.get_profile() == {"plan": "pro"}
    u2 = u.fork(app="a", user="x")
    assert u2.path == "app/a/user/x"
    assert [h.text for h in u2.recall("daily", k=5)] == ["daily"]
    assert [f.text for f in u2.history("cadence")] == ["weekly", "daily"]
    buf = io.StringIO()
    u.export(buf)
    assert u.import_(io.StringIO(buf.getvalue())) == 0  # same scope, same ids: idempotent
    assert u.import_(buf.getvalue().splitlines()) == 0  # any iterable of lines


def test_an_export_with_unicode_line_separators_in_its_text_imports_alike(
    api: Api, tmp_path: Path
) -> None:
    """JSON may carry U+2028, U+2029 and U+0085 unescaped inside a string (an export written
    again with ``ensure_ascii=False``, by jq or another language's encoder): the library read
    such a line whole, the server cut it in two there (``str.splitlines``) and refused it."""
    m: Any = api.mem
    v = m.scope(app="a", user="v")
    v.remember("one\u2028two\u2029three\x85four")
    lines = [json.dumps(json.loads(line), ensure_ascii=False) for line in v.export_lines()]
    assert m.scope(app="a", user="w").import_(lines) == 1
    path = tmp_path / "v.jsonl"
    path.write_text("\r\n".join(lines), encoding="utf-8")
    assert m.scope(app="a", user="x").import_(path) == 1
    for user in ("w", "x"):
        (fact,) = m.scope(app="a", user=user).get_all().items
        assert fact.text == "one\u2028two\u2029three\x85four"


def test_export_is_streamed_in_order(api: Api) -> None:
    m: Any = api.mem
    u = m.scope(app="big")
    u.remember_many([f"line {i} " + "z" * 500 for i in range(2000)])
    buf = io.StringIO()
    assert u.export(buf) == 2001
    first = buf.getvalue().splitlines()[0]
    assert '"torpor-memory"' in first


def test_a_failed_export_leaves_an_existing_file_as_it_was(
    api: Api, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    m: Any = api.mem
    v = m.scope(app="a", user="v")
    v.remember("v's plan")
    backup = tmp_path / "v.jsonl"
    assert v.export(backup) == 2
    before = backup.read_text()

    def cut_short() -> Iterator[str]:  # the server went away (or the store failed) mid-way
        yield before.splitlines()[0]
        raise StorageError("the connection broke")

    monkeypatch.setattr(v, "export_lines", cut_short)
    with pytest.raises(StorageError):
        v.export(backup)
    assert backup.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["v.jsonl"]  # no temporary file left


def test_an_export_writes_into_the_file_it_is_given(api: Api, tmp_path: Path) -> None:
    """The whole-or-nothing export replaced the path it was given: a private backup (0600)
    came back readable by everyone, a link to the latest backup became a file of its own,
    and a pipe (``export >(gzip > u.gz)``, /dev/stdout) could not be written at all."""
    m: Any = api.mem
    v = m.scope(app="a", user="v")
    v.remember("v's plan")
    private = tmp_path / "v.jsonl"
    private.write_text("")
    private.chmod(0o600)
    assert v.export(private) == 2
    assert private.stat().st_mode & 0o777 == 0o600
    dated = tmp_path / "v-2026-03-01.jsonl"
    dated.write_text("")
    latest = tmp_path / "latest.jsonl"
    latest.symlink_to(dated.name)
    assert v.export(latest) == 2
    assert latest.is_symlink() and dated.read_text() == private.read_text()
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    try:
        assert v.export(fifo) == 2
    finally:
        if reader.is_alive():  # the export never opened the pipe: let the reader go
            with open(fifo, "w"):
                pass
        reader.join()
    assert got == [private.read_text()]


def test_grants_apply_alike(api: Api) -> None:
    m: Any = api.mem
    m.scope(app="a", user="v").remember("v's secret plan")
    t: Any = api.as_token([("write", "app/a/user/u")])
    u = t.scope(app="a", user="u")
    u.remember("u's own note")
    assert [h.text for h in u.recall("note")] == ["u's own note"]
    attempts: list[Any] = [
        lambda: t.scope(app="a", user="v"),
        lambda: t.scope(app="a"),
        lambda: t.scope(),
        lambda: t.scope(app="a", user="u", tenant="other"),
    ]
    for attempt in attempts:
        with pytest.raises(AccessDenied):
            attempt()
    r: Any = api.as_token([("read", "app/a/user/u")])
    assert [h.text for h in r.scope(app="a", user="u").recall("note")] == ["u's own note"]
    with pytest.raises(AccessDenied):
        r.scope(app="a", user="u").remember("no write grant")
    denied = [e for e in m.audit_log(limit=50) if not e.allowed]
    assert len(denied) >= 4  # (the refusal naming tenant "other" is in that tenant's log)


def test_an_update_keeps_the_facts_time_to_live(api: Api) -> None:
    """A fact remembered for an hour lived for ever once updated: the new version had no
    expiry. It now lives as long as the old one was given to, counted from the update."""
    u: Any = api.mem.scope(app="a", user="u")  # type: ignore[attr-defined]
    busy = u.remember("in a meeting until 3", key="status", ttl=3600)
    later = u.update(busy.id, "in a meeting until 4")
    assert later.expires_at is not None
    assert abs((later.expires_at - later.valid_from).total_seconds() - 3600) < 1
    forever = u.remember("lives in Lisbon", key="city")
    assert u.update(forever.id, "lives in Porto").expires_at is None


def test_get_all_update_and_delete_all(api: Api) -> None:
    """What mem0 users reach for: every record of a user a page at a time (filtered by
    metadata), update by id as a new version with history, and a delete_all that erases
    everything however many records there are (a peer deleted only the first 100)."""
    m: Any = api.mem
    u = m.scope(app="support", user="u-7")
    other = m.scope(app="support", user="u-8")
    other.remember("not u-7's")
    u.remember_many(
        [{"text": f"note {i}", "metadata": {"topic": "a" if i % 2 else "b"}} for i in range(230)]
    )
    plan = u.remember("plan basic", key="plan")
    u.log("user", "hello")

    first = u.get_all(page_size=100)
    assert first.total == 232 and len(first.items) == 100 and first.has_more
    assert first.items[0].text == "hello"  # newest first
    last = u.get_all(page=3, page_size=100)
    assert len(last.items) == 32 and not last.has_more
    seen = {r.id for p in (1, 2, 3) for r in u.get_all(page=p, page_size=100).items}
    assert len(seen) == 232  # pages neither overlap nor skip
    assert u.get_all(filters={"topic": "a"}).total == 115
    assert [r.text for r in u.get_all(kind="episode").items] == ["hello"]
    with pytest.raises(InvalidArgument):
        u.get_all(page=0)
    with pytest.raises(InvalidArgument):
        u.get_all(page_size=1001)

    newer = u.update(plan.id, "plan pro")
    assert newer.key == "plan" and newer.id != plan.id
    assert [f.text for f in u.history("plan")] == ["plan basic", "plan pro"]
    assert u.get_all(filters={}, kind="fact").total == 231  # the old version is history
    unkeyed = next(r for r in first.items if isinstance(r, Fact) and r.key is None)
    with pytest.raises(InvalidArgument, match="key="):
        u.update(unkeyed.id, "changed")
    with pytest.raises(InvalidArgument, match="old version"):
        u.update(plan.id, "again")
    with pytest.raises(RecordNotFound):
        u.update("rec-nope", "x")

    assert u.delete_all() == 233  # 230 notes, two plan versions, the turn
    assert u.get_all().total == 0
    assert other.get_all().total == 1  # another user's records are untouched


def test_a_record_id_with_a_percent_sign_names_that_record(api: Api) -> None:
    """An import keeps any id a store holds and a URL names, ``%`` included. The SDK put the
    id in the path as it was, so the server read ``%41`` as ``A``: ``get("r%41")`` answered
    record ``rA`` and ``forget("r%41")`` erased it, leaving ``r%41`` in place."""
    m: Any = api.mem
    u = m.scope(app="a", user="u")
    u.remember("a record")
    (line0, line1) = list(u.export_lines())
    u.forget()
    plain = json.loads(line1)

    def named(rid: str, text: str) -> str:
        return json.dumps({**plain, "record": {**plain["record"], "id": rid, "text": text}})

    lines = [line0, named("rA", "the record rA"), named("r%41", "the record r%41")]
    assert u.import_(lines) == 2
    assert u.get("r%41").text == "the record r%41"
    assert m.forget("r%41") == 1
    assert u.get("rA").text == "the record rA"
    with pytest.raises(RecordNotFound):
        u.get("r%41")


def test_an_import_takes_lines_of_bytes_as_the_library_does(api: Api) -> None:
    """A file opened in binary mode (or any iterable of bytes lines) imports embedded (json
    reads bytes); the SDK joined the lines as text and raised a raw TypeError."""
    m: Any = api.mem
    v = m.scope(app="a", user="v")
    v.remember("v's plan", key="plan")
    lines = [line.encode() for line in v.export_lines()]
    assert m.scope(app="a", user="w").import_(io.BytesIO(b"\n".join(lines))) == 1
    assert m.scope(app="a", user="x").import_(lines) == 1
    assert [f.text for f in m.scope(app="a", user="x").history("plan")] == ["v's plan"]
