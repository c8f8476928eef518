"""The public API end to end (lexical-only and with the hashing embedder), on every backend."""

from __future__ import annotations

import http.server
import io
import itertools
import json
import threading
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ConfigDict

import torpor
from torpor.errors import (
    AccessDenied,
    Conflict,
    InvalidArgument,
    PayloadTooLarge,
    RecordNotFound,
    SchemaViolation,
)
from torpor.memory import HashEmbedder, Memory, ScopedMemory
from torpor.memory.models import Episode, Policy, from_us, now_us, to_us

_RT = itertools.count()


def test_issue_example(mem: Memory) -> None:
    u = mem.scope(app="support", user="u-42")
    u.set_profile({"plan": "pro", "name": "Jordan"})
    u.log("user", "Can you send me summaries every week?", session="s1")
    f = u.remember("prefers weekly summaries", key="summary_cadence")
    u.remember("prefers daily summaries", key="summary_cadence")
    texts = [h.text for h in u.recall("how often should I send summaries?", k=3)]
    # lexical only, the episode shares more words with the question; the current fact is
    # found and the superseded one never is (with the default embedder the fact comes first,
    # see test_embeddings.py::test_issue_example_with_vectors)
    assert "prefers daily summaries" in texts
    assert "prefers weekly summaries" not in texts
    facts = [h.text for h in u.recall("how often should I send summaries?", k=3, kind="fact")]
    assert facts == ["prefers daily summaries"]
    hist = u.history("summary_cadence")
    assert [h.text for h in hist] == ["prefers weekly summaries", "prefers daily summaries"]
    assert hist[0].valid_to == hist[1].valid_from and hist[1].valid_to is None
    then = [h.text for h in u.recall("summaries", as_of=f.valid_from)]
    assert "prefers weekly summaries" in then and "prefers daily summaries" not in then
    ctx = u.context("write Jordan a short update", budget_tokens=300)
    assert "Jordan" in str(ctx) and "prefers daily summaries" in ctx.text
    assert ctx.tokens <= 300


def test_public_exports() -> None:
    assert torpor.Memory is Memory
    assert torpor.SourceRef is torpor.memory.SourceRef


def test_hits_explain_themselves(hmem: Memory) -> None:
    u = hmem.scope(app="a", user="u")
    f = u.remember("the invoice is due on friday", metadata={"topic": "billing"})
    [hit] = u.recall("when is the invoice due", k=1)
    assert hit.id == f.id and hit.kind == "fact" and hit.scope == "app/a/user/u"
    assert hit.metadata == {"topic": "billing"} and hit.created_at == f.created_at
    assert {"lexical", "vector", "relevance", "recency", "scope"} <= set(hit.scores)
    assert hit.scores["vector"] > 0.3


def test_a_session_dated_alike_still_lends_replies(hmem: Memory) -> None:
    """A log that dates each session once (every turn of it at the same time), or that has
    no sessions, keeps its turns' order: a turn still takes its share of its reply's score
    (``scores["reply"]``)."""
    u = hmem.scope(app="a", user="u")
    day = "2023-05-08T13:56:00"
    told = u.log("mia", "mia: we adopted a kitten last weekend", session="s1", at=day)
    u.log("ben", "ben: a kitten! what did you name the kitten?", session="s1", at=day)
    u.log("mia", "mia: unrelated: the bus was late", session="s2", at=day)
    hits = {h.id: h for h in u.recall("what is the name of the kitten", k=5)}
    assert "reply" in hits[told.id].scores
    # and a log without sessions is one log of its scope
    w = hmem.scope(app="a", user="w")
    told = w.log("mia", "mia: we adopted a kitten last weekend", at=day)
    w.log("ben", "ben: a kitten! what did you name the kitten?", at=day)
    hits = {h.id: h for h in w.recall("what is the name of the kitten", k=5)}
    assert "reply" in hits[told.id].scores


def test_a_question_about_yesterday_finds_yesterdays_turn(mem: Memory) -> None:
    """Turns alike but for their day: "yesterday", "3 days ago" and "last week" are counted
    from the day recall is asked on (``as_of`` here; else now)."""
    _days_counted_from_the_asking(mem)


def test_a_question_about_yesterday_finds_yesterdays_turn_with_vectors(hmem: Memory) -> None:
    _days_counted_from_the_asking(hmem)


def _days_counted_from_the_asking(memory: Memory) -> None:
    u = memory.scope(app="a", user="u")
    asked = "2026-12-03T15:00:00"  # a Thursday
    logged = {
        back: u.log("user", "user: I cooked dinner for the family", session=f"s{back}", at=at)
        for back, at in (
            (0, "2026-12-03T09:00:00"),
            (1, "2026-12-02T19:30:00"),
            (3, "2026-11-30T20:00:00"),
            (8, "2026-11-25T18:00:00"),
        )
    }

    def first(question: str) -> str:
        return u.recall(question, k=4, as_of=asked)[0].id

    assert first("what did I cook for the family") == logged[0].id  # the newest
    assert first("what did I cook for the family yesterday") == logged[1].id
    assert first("what did I cook for the family 3 days ago") == logged[3].id
    assert first("what did I cook for the family last week") == logged[8].id
    hit = u.recall("what did I cook yesterday", k=4, as_of=asked)[0]
    assert hit.scores["date"] == 1.3
    # a day counted back past the calendar's start names nothing; the recall still answers
    assert u.recall("what did I cook 999 months ago", k=4, as_of="0001-01-03T00:00:00") == []
    # nor does a named date against a turn on the calendar's first day (no day before it)
    day_one = u.log("user", "user: I cooked dinner on the first day", at="0001-01-01T00:00:00")
    assert day_one.id in {h.id for h in u.recall("what did I cook on 5 March", k=10)}


def test_keyed_facts_always_current(mem: Memory) -> None:
    u = mem.scope(app="a", user="u")
    for i in range(30):
        u.remember(f"favourite number is {i}", key="fav")
        hits = u.recall("favourite number", k=10)
        assert [h.text for h in hits] == [f"favourite number is {i}"]
    assert len(u.recall("favourite number", k=50, include_history=True)) == 30


def test_scope_sees_ancestors_not_siblings_and_ranks_specific_first(mem: Memory) -> None:
    app = mem.scope(app="a")
    u = mem.scope(app="a", user="u")
    v = mem.scope(app="a", user="v")
    app.remember("office hours are nine to five")
    u.remember("u likes office hours in the morning")
    v.remember("v office hours secret")
    texts = [h.text for h in u.recall("office hours", k=10)]
    assert texts == ["u likes office hours in the morning", "office hours are nine to five"]
    assert [h.text for h in app.recall("office hours", k=10)] == ["office hours are nine to five"]
    sess = mem.scope(app="a", user="u", session="s9")
    sess.remember("in this session office hours moved")
    assert sess.recall("office hours", k=1)[0].text == "in this session office hours moved"


def test_filters_kind_metadata_time(mem: Memory) -> None:
    u = mem.scope(app="a", user="u")
    old = u.log("user", "talked about the garden", at=from_us(now_us() - 86_400_000_000 * 3))
    new = u.log("assistant", "garden advice given", session="s2", metadata={"lang": "en"})
    f = u.remember("has a garden")
    assert [h.id for h in u.recall("garden", kind="fact")] == [f.id]
    assert {h.id for h in u.recall("garden", kind="episode")} == {old.id, new.id}
    assert [h.id for h in u.recall("garden", metadata={"lang": "en"})] == [new.id]
    assert [h.id for h in u.recall("garden", session="s2")] == [new.id]
    day_ago = from_us(now_us() - 86_400_000_000)
    assert [h.id for h in u.recall("garden", until=day_ago)] == [old.id]
    assert old.id not in [h.id for h in u.recall("garden", since=day_ago)]
    assert old.at < new.at


def test_batched_writes(hmem: Memory) -> None:
    u = hmem.scope(app="a", user="u")
    facts = u.remember_many(
        [f"note number {i}" for i in range(200)]
        + [{"text": "keyed", "key": "k", "metadata": {"x": 1}}]
    )
    assert len(facts) == 201 and facts[-1].key == "k"
    eps = u.log_many([{"role": "user", "text": f"turn {i}", "session": "s"} for i in range(50)])
    assert len(eps) == 50 and eps[0].session == "s"
    assert len(u.recall("note number 17", k=3)) == 3


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(lambda u: u.remember(""), id="empty"),
        pytest.param(lambda u: u.remember("   "), id="blank"),
        pytest.param(lambda u: u.remember("a\x00b"), id="nul"),
        pytest.param(lambda u: u.remember("x", metadata={"a": "\x00"}), id="nul-metadata"),
        pytest.param(lambda u: u.remember("x", key="bad key!"), id="key"),
        pytest.param(lambda u: u.remember("x", metadata={"a": object()}), id="metadata"),
        pytest.param(lambda u: u.remember("x", ttl=-1), id="ttl"),
        pytest.param(lambda u: u.remember("x", durability="forever"), id="durability"),
        pytest.param(lambda u: u.remember("x", source={"path": "relative"}), id="source"),
        pytest.param(lambda u: u.remember_many(["ok", ""]), id="batch"),
        pytest.param(lambda u: u.remember_many([{"text": "a", "colour": 1}]), id="unknown-field"),
        pytest.param(lambda u: u.log("", "hi"), id="role"),
        pytest.param(lambda u: u.recall(""), id="query"),
        pytest.param(lambda u: u.recall("x", kind="note"), id="kind"),
        pytest.param(lambda u: u.context("x", budget_tokens=0), id="budget"),
        pytest.param(lambda u: u.remember("bad \ud800 text"), id="lone-surrogate"),
        pytest.param(lambda u: u.log("user", "x \udfff"), id="lone-surrogate-log"),
        pytest.param(lambda u: u.remember("x", metadata={"k": ["\ud800"]}), id="surrogate-meta"),
        pytest.param(lambda u: u.remember("x", metadata=_nested(600)), id="deep-metadata"),
        pytest.param(lambda u: u.set_profile(_nested(600)), id="deep-profile"),
        pytest.param(lambda u: u.recall("where \ud800"), id="surrogate-query"),
    ],
)
def test_bad_input_is_typed_and_writes_nothing(mem: Memory, bad: object) -> None:
    u = mem.scope(app="a", user="u")
    with pytest.raises(InvalidArgument):
        bad(u)  # type: ignore[operator]
    assert list(mem.store.iter_records("")) == []
    assert u.get_profile() == {}


def _nested(depth: int) -> dict[str, object]:
    doc: dict[str, object] = {"leaf": 1}
    for _ in range(depth):
        doc = {"a": doc}
    return doc


def test_nesting_up_to_the_limit_is_kept(mem: Memory) -> None:
    u = mem.scope(app="a", user="u")
    u.set_profile(_nested(20))
    assert u.get_profile() != {}


def test_hybrid_recall_refuses_a_lone_surrogate(hmem: Memory) -> None:
    u = hmem.scope(app="a", user="u")
    u.remember("lives in Lisbon")
    with pytest.raises(InvalidArgument, match="surrogate"):
        u.recall("where do I live \ud800")


def test_oversized_text(mem: Memory) -> None:
    u = mem.scope(app="a", user="u")
    with pytest.raises(PayloadTooLarge) as err:
        u.remember("x" * 40_000)
    assert err.value.data["limit"] == 32_000
    assert list(mem.store.iter_records("")) == []


def test_unknown_key_history(mem: Memory) -> None:
    with pytest.raises(RecordNotFound):
        mem.scope(app="a").history("never_used")


def test_profile_schema(mem: Memory) -> None:
    class P(BaseModel):
        model_config = ConfigDict(extra="forbid")
        plan: str
        name: str | None = None

    u = mem.scope(app="a", user="u")
    u.set_profile({"plan": "pro", "name": "Jordan"}, schema=P)
    with pytest.raises(SchemaViolation):
        u.set_profile({"plan": 3})
    with pytest.raises(SchemaViolation):
        u.set_profile({"plan": "pro", "unknown": 1}, merge=True)
    assert u.get_profile() == {"plan": "pro", "name": "Jordan"}
    v = mem.scope(app="a", user="v")
    v.set_profile({"age": 3}, schema={"type": "object", "properties": {"age": {"type": "integer"}}})
    with pytest.raises(SchemaViolation):
        v.set_profile({"age": "three"})
    assert v.set_profile({"tz": "UTC"}, merge=True).data == {"age": 3, "tz": "UTC"}


@pytest.mark.parametrize(
    "bad",
    [
        {"type": "object", "description": "a\x00b"},
        {"type": "object", "description": "a\udc00b"},
        {"type": "object", "default": float("nan")},
        {"type": "object", "default": object()},
    ],
    ids=["nul", "lone-surrogate", "nan", "not-json"],
)
def test_a_profile_schema_no_store_keeps_is_refused_alike(mem: Memory, bad: object) -> None:
    """A JSON schema holding a NUL, a lone surrogate or NaN was stored by SQLite (then every
    fork or import of the scope failed on it) and refused by PostgreSQL; one holding what is
    not JSON at all raised a raw TypeError. Each is InvalidArgument now, nothing stored."""
    u = mem.scope(app="a", user="u")
    with pytest.raises(InvalidArgument):
        u.set_profile({"plan": "pro"}, schema=bad)  # type: ignore[arg-type]
    assert mem.store.get_profile(u.path) is None
    u.set_profile({"plan": "pro"}, schema={"type": "object"})
    u.fork(app="a", user="v")  # what is stored forks


@pytest.mark.parametrize(
    "bad",
    [
        {"$ref": "#/definitions/nowhere"},
        {"properties": {"plan": {"$ref": "#/properties/plan"}}},
    ],
    ids=["missing", "itself"],
)
def test_a_profile_schema_whose_ref_leads_nowhere_is_invalid(mem: Memory, bad: object) -> None:
    """A JSON schema whose ``$ref`` names nothing it holds, or only itself, raised jsonschema's
    raw reference error or a RecursionError (a 500 over HTTP): it is InvalidArgument."""
    u = mem.scope(app="a", user="u")
    with pytest.raises(InvalidArgument, match="schema"):
        u.set_profile({"plan": "pro"}, schema=bad)  # type: ignore[arg-type]
    assert mem.store.get_profile(u.path) is None


def test_a_profile_schema_fetches_no_url(mem: Memory) -> None:
    """jsonschema fetched a ``$ref`` naming a URL (any address: loopback, 169.254.169.254)
    and checked the profile against what it read, so a token that may write a profile made
    the server GET an internal URL and learned its content from the SchemaViolation's
    message. A schema is checked with what it holds and the standard meta-schemas only."""
    asked: list[str] = []

    class Internal(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append(self.path)
            body = json.dumps({"properties": {"plan": {"const": "internal-secret"}}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Internal)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        u = mem.scope(app="a", user="u")
        url = f"http://127.0.0.1:{server.server_port}/internal.json"
        with pytest.raises(InvalidArgument, match="schema") as err:
            u.set_profile({"plan": "x"}, schema={"$ref": url})
        assert "internal-secret" not in str(err.value)
        std = {"$ref": "https://json-schema.org/draft/2020-12/schema"}  # known offline
        assert u.set_profile({"type": "object"}, schema=std).data == {"type": "object"}
    finally:
        server.shutdown()
        server.server_close()
    assert asked == []


def test_remember_many_returns_what_its_own_later_items_superseded(mem: Memory) -> None:
    """Facts of one batch with the same key supersede one another in order; the batch's answer
    gave every one of them as current (``valid_to`` None), unlike ``get`` and ``history``."""
    u = mem.scope(app="a", user="u")
    got = u.remember_many(
        [
            {"text": "plan is free", "key": "plan"},
            "unkeyed",
            {"text": "plan is pro", "key": "plan"},
            {"text": "plan is team", "key": "plan"},
        ]
    )
    assert got == [u.get(f.id) for f in got]
    assert [f.superseded_by for f in got] == [got[2].id, None, got[3].id, None]


def test_concurrent_profile_merges_keep_every_key(
    mem: Memory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two merges that read the profile before either writes it: each merged onto the same
    old document and the second write dropped the first one's key (four threads merging 25
    keys each kept about 75 of 100)."""
    import threading

    u = mem.scope(app="a", user="u")
    u.set_profile({"base": 1})
    read = mem.store.get_profile
    both_read = threading.Barrier(2, timeout=5)
    waited: set[int] = set()

    def read_then_wait(scope: str) -> object:
        found = read(scope)
        if threading.get_ident() not in waited:  # each thread's first read only
            waited.add(threading.get_ident())
            both_read.wait()
        return found

    monkeypatch.setattr(mem.store, "get_profile", read_then_wait)
    threads = [
        threading.Thread(target=u.set_profile, args=({key: 1},), kwargs={"merge": True})
        for key in ("x", "y")
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    monkeypatch.undo()
    assert u.get_profile() == {"base": 1, "x": 1, "y": 1}


def test_ttl_cache_retention_gc(mem: Memory) -> None:
    u = mem.scope(app="a", user="u")
    short = u.remember("temporary value", durability="cache", ttl=timedelta(microseconds=1))
    keep = u.remember("permanent value")
    assert [h.id for h in u.recall("value")] == [keep.id]
    u.set_policy(cache_ttl_seconds=3600)
    c = u.remember("cached value", durability="cache")
    assert c.expires_at is not None and c.durability == "cache"
    u.set_policy(retention_seconds=1e-6)
    assert u.recall("value") == []
    assert mem.gc() >= 3
    assert mem.store.get([short.id, keep.id, c.id], 0) == []


@pytest.mark.parametrize("write", ["remember", "log"])
def test_a_retention_set_while_a_write_embeds_caps_that_write(
    mem: Memory, monkeypatch: pytest.MonkeyPatch, write: str
) -> None:
    """A write reads its scope's policy, embeds, then stores. A retention set in between
    (another caller's ``set_policy``: it caps the records stored so far) missed the record
    that write then stored, which so lived for ever in a scope that keeps records a minute."""
    u = mem.scope(app="a", user="u")
    admin = Memory.attach(mem.backend, mem.tenant)
    embed = mem.embed

    def embed_while_the_policy_changes(texts: list[str]) -> object:
        admin.scope(app="a", user="u").set_policy(retention_seconds=60)
        return embed(texts)

    monkeypatch.setattr(mem, "embed", embed_while_the_policy_changes)
    rec = u.remember("kept a minute") if write == "remember" else u.log("user", "a minute")
    monkeypatch.undo()
    got = u.get(rec.id)
    assert got.expires_at is not None
    assert to_us(got.expires_at) == to_us(got.created_at) + 60_000_000
    assert rec.expires_at == got.expires_at  # the write answers what it stored


def test_forget_record_and_scope(mem: Memory) -> None:
    u = mem.scope(app="a", user="u")
    v = mem.scope(app="a", user="v")
    f = u.remember("forget me")
    g = u.remember("keep me")
    other = v.remember("forget me too")
    with pytest.raises(RecordNotFound):
        u.forget(other.id)
    assert mem.forget(f.id) == 1
    assert [h.id for h in u.recall("me")] == [g.id]
    assert mem.forget(u) == 1
    assert u.recall("me") == [] and [h.id for h in v.recall("forget")] == [other.id]
    assert any(e.action == "forget.scope" for e in mem.audit_log())


def test_audit_log_limits_out_of_range_are_invalid(mem: Memory) -> None:
    mem.forget(mem.scope(app="a"))
    mem.forget(mem.scope(app="b"))
    assert len(mem.audit_log(2**70)) == 2 and len(mem.audit_log(1)) == 1
    for bad in (0, -1, 1.5, "3", True, None):
        with pytest.raises(InvalidArgument):
            mem.audit_log(bad)  # type: ignore[arg-type]


def test_a_memory_that_fails_to_open_closes_its_backend(backend_spec: str, home: Path) -> None:
    """A refused token or a bad embedder leaves no connection, pool thread or file open."""
    import os

    Memory(str(home), embedder=None, backend=backend_spec).close()
    threads = sorted(t.name for t in threading.enumerate())
    fds = len(os.listdir("/proc/self/fd"))
    kept = []
    for _ in range(2):
        with pytest.raises(AccessDenied) as denied:
            Memory(str(home), token="nope", embedder=None, backend=backend_spec)
        with pytest.raises(InvalidArgument) as invalid:
            Memory(str(home), embedder="no-such-embedder", backend=backend_spec)
        kept += [denied, invalid]  # their tracebacks hold the half-made Memory
    assert sorted(t.name for t in threading.enumerate()) == threads
    assert len(os.listdir("/proc/self/fd")) == fds


def test_two_writers_of_other_models_never_both_claim_a_new_store(
    backend_spec: str, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other process writes its first record between this one's look at the store's
    model and its own first write: this one's vectors would be mixed with the other's."""
    first = Memory(str(home), embedder=HashEmbedder(32), backend=backend_spec)
    second = Memory(str(home), embedder=HashEmbedder(64), backend=backend_spec)
    read = second.store.get_meta

    def meanwhile(key: str) -> str | None:
        found = read(key)
        if key == "embedding_model" and found is None:
            first.scope(app="a").remember("written by the other process first")
        return found

    monkeypatch.setattr(second.store, "get_meta", meanwhile)
    with pytest.raises(Conflict):
        second.scope(app="a").remember("written second")
    assert read("embedding_model") == "hash:32" and read("embedding_dim") == "32"
    first.close()
    second.close()


def test_export_import_fork_roundtrip(hmem: Memory, tmp_path: Path) -> None:
    u = hmem.scope(app="a", user="u")
    u.set_profile({"plan": "pro"})
    u.remember("weekly", key="cadence")
    u.remember("daily", key="cadence")
    u.log("user", "hello there", session="s1")
    path = tmp_path / "u.jsonl"
    assert u.export(path) >= 5
    w = hmem.scope(app="a", user="w")
    assert w.import_(path) == 3
    assert [f.text for f in w.history("cadence")] == ["weekly", "daily"]
    assert w.get_profile() == {"plan": "pro"}
    assert w.import_(path) == 3  # a different scope: fresh ids each time
    u2 = u.fork(app="a", user="x")
    assert [h.text for h in u2.recall("daily", k=5)] == ["daily"]
    assert [f.text for f in u2.history("cadence")] == ["weekly", "daily"]
    buf = io.StringIO()
    u.export(buf)
    assert u.import_(io.StringIO(buf.getvalue())) == 0  # same scope, same ids: idempotent
    with pytest.raises(InvalidArgument):
        w.import_(io.StringIO('{"type": "fact"}\n'))


def test_export_and_fork_keep_the_policy_of_a_scope_without_records(
    mem: Memory, tmp_path: Path
) -> None:
    """A retention set on an app whose records all sit on its users is part of the subtree:
    an export carries it and a fork copies it (they used to read policies only of scopes
    holding records, so a backup silently dropped it)."""
    a = mem.scope(app="a")
    a.set_policy(retention_seconds=3600)
    mem.scope(app="a", user="u").set_policy(cache_ttl_seconds=60)
    mem.scope(app="a", user="u").remember("hello")
    mem.scope(app="other").set_policy(retention_seconds=7)  # outside the subtree
    a.fork(app="b")
    assert mem.store.get_policy("app/b") == Policy(retention_seconds=3600)
    assert mem.store.get_policy("app/b/user/u") == Policy(cache_ttl_seconds=60)
    lines = [json.loads(line) for line in a.export_lines()]
    assert sorted(x["scope"] for x in lines if x["type"] == "policy") == ["app/a", "app/a/user/u"]
    w = mem.scope(app="w")
    w.import_(io.StringIO("\n".join(json.dumps(x) for x in lines)))
    assert mem.store.get_policy("app/w") == Policy(retention_seconds=3600)


def test_a_session_of_one_time_keeps_its_order_through_export_and_fork(
    hmem: Memory, tmp_path: Path
) -> None:
    """Turns of one time are ordered as logged (the turn before each, for the reply share),
    and an export imported elsewhere, or a fork, keeps that order."""
    u = hmem.scope(app="a", user="u")
    for i in range(6):
        u.log("mia", f"turn {i}", session="s1", at="2023-05-08T13:56:00")
    path = tmp_path / "u.jsonl"
    u.export(path)
    w = hmem.scope(app="a", user="w")
    w.import_(path)
    for s in (u, w, u.fork(app="a", user="x")):
        turns = [t for t in s.get_all(kind="episode").items if isinstance(t, Episode)]
        before = hmem.store.previous_episodes(turns, s._filter(now_us(), kinds=("episode",)))
        text = {t.id: t.text for t in turns}
        assert {text[a]: text[b] for a, b in before.items()} == {
            f"turn {i}": f"turn {i - 1}" for i in range(1, 6)
        }


def test_metadata_may_hold_escaped_nul_text(mem: Memory) -> None:
    """A literal backslash-u-0000 is text, not a NUL: it is stored and read back as written."""
    f = mem.scope(app="a").remember("escaped", metadata={"raw": "\\u0000", "n": ["\\x00"]})
    assert mem.scope(app="a").get(f.id).metadata == {"raw": "\\u0000", "n": ["\\x00"]}
    with pytest.raises(InvalidArgument):
        mem.scope(app="a").remember("x", metadata={"n": ["ok", {"deep": "\x00"}]})


def test_time_roundtrip_exact(mem: Memory) -> None:
    f = mem.scope(app="a").remember("t")
    assert from_us(to_us(f.valid_from)) == f.valid_from


_TEXT = st.text(
    alphabet=st.characters(exclude_categories=["Cs"], exclude_characters="\x00"),
    min_size=1,
    max_size=60,
).filter(str.strip)
_META = st.dictionaries(
    st.text(alphabet="abcxyz_", min_size=1, max_size=5),
    st.one_of(st.none(), st.booleans(), st.integers(-10, 10), _TEXT),
    max_size=3,
)


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    items=st.lists(
        st.tuples(st.booleans(), _TEXT, st.sampled_from([None, "k1", "k2"]), _META),
        min_size=1,
        max_size=10,
    )
)
def test_export_import_round_trip_property(
    tmp_path_factory: pytest.TempPathFactory,
    backend_spec: str,
    items: list[tuple[bool, str, str | None, dict[str, object]]],
) -> None:
    home = tmp_path_factory.mktemp("rt")
    tenant = f"rt{next(_RT)}"  # fresh per example: a server backend keeps data
    with Memory(str(home), tenant=tenant, embedder=None, backend=backend_spec) as m:
        u = m.scope(app="a", user="u")
        for is_fact, text, key, meta in items:
            if is_fact:
                u.remember(text, key=key, metadata=meta)
            else:
                u.log("user", text, metadata=meta, session="s")
        buf = io.StringIO()
        u.export(buf)
        before = sorted((r.model_dump_json() for r, _ in m.store.iter_records("")))
    with Memory(str(home), tenant=tenant + "b", embedder=None, backend=backend_spec) as m2:
        u2 = m2.scope(app="a", user="u")
        assert u2.import_(io.StringIO(buf.getvalue())) == len(items)
        after = sorted((r.model_dump_json() for r, _ in m2.store.iter_records("")))
    assert after == before


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda u: u.remember("x", ttl="abc"), id="ttl-str"),
        pytest.param(lambda u: u.remember("x", ttl=[1]), id="ttl-list"),
        pytest.param(lambda u: u.remember("x", ttl=True), id="ttl-bool"),
        pytest.param(lambda u: u.remember("x", ttl=float("nan")), id="ttl-nan"),
        pytest.param(lambda u: u.remember("x", ttl=float("inf")), id="ttl-inf"),
        pytest.param(lambda u: u.remember("x", ttl=1e12), id="ttl-past-1000-years"),
        pytest.param(lambda u: u.log("user", "x", at="0001-01-01T00:00:00+01:00"), id="at-min"),
        pytest.param(lambda u: u.log("user", "x", at="9999-12-31T23:59:59-01:00"), id="at-max"),
        pytest.param(lambda u: u.recall("x", as_of="0001-01-01T00:00:00+01:00"), id="as_of"),
        pytest.param(lambda u: u.recall("x", kind=5), id="kind-int"),
        pytest.param(lambda u: u.recall("x", kind=[{}]), id="kind-dict"),
        pytest.param(lambda u: u.remember("x", metadata={"n": float("nan")}), id="meta-nan"),
        pytest.param(lambda u: u.remember("x", metadata={"n": [float("inf")]}), id="meta-inf"),
        pytest.param(lambda u: u.set_policy(retention_seconds=float("inf")), id="retention-inf"),
        pytest.param(lambda u: u.set_policy(retention_seconds=1e300), id="retention-huge"),
        pytest.param(lambda u: u.set_policy(cache_ttl_seconds=1e300), id="cache-ttl-huge"),
    ],
)
def test_values_out_of_range_are_invalid_and_write_nothing(mem: Memory, call) -> None:  # type: ignore[no-untyped-def]
    """Each of these was a raw OverflowError / ValueError / TypeError, and some were stored
    first: a policy of 1e300 seconds made every later write of its scope fail, a NaN in
    metadata every filtered listing (SQLite). The limits: durations up to a thousand years,
    times within years 1-9999 in UTC, metadata that is JSON."""
    u = mem.scope(app="a", user="u")
    u.remember("kept", metadata={"topic": "t"})
    with pytest.raises(InvalidArgument):
        call(u)
    assert mem.store.get_policy(u.path) is None
    assert [f.text for f in u.get_all(filters={"topic": "t"}).items] == ["kept"]
    u.remember("still writable", durability="cache", ttl=timedelta(days=365 * 999))
    assert u.get_all().total == 2


def _export_line(u: ScopedMemory, **change: object) -> list[str]:
    header, line = list(u.export_lines())
    obj = json.loads(line)
    obj["record"].update({"id": "ffffffffffffff0000000001", **change.pop("record", {})})  # type: ignore[dict-item]
    obj.update(change)
    return [header, json.dumps(obj)]


@pytest.mark.parametrize(
    "change",
    [
        pytest.param({"embedding": [0.1, "x"]}, id="vector-not-numbers"),
        pytest.param({"embedding": [float("nan")] * 64}, id="vector-nan"),
        pytest.param({"record": {"text": "a\x00b"}}, id="text-nul"),
        pytest.param({"record": {"text": "y" * 40_000}}, id="text-too-long"),
        pytest.param({"record": {"key": "bad key !"}}, id="bad-key"),
        pytest.param({"record": {"scope": "garbage"}}, id="scope-not-a-path"),
        pytest.param({"record": {"scope": "app/b"}}, id="scope-outside-the-export"),
        pytest.param({"record": {"metadata": {"n": float("nan")}}}, id="metadata-nan"),
    ],
)
def test_an_import_checks_what_remember_checks(hmem: Memory, change: dict[str, object]) -> None:
    u = hmem.scope(app="a", user="u")
    u.remember("hello world", key="greeting")
    with pytest.raises(InvalidArgument):
        u.import_(_export_line(u, **change))
    assert [f.text for f in u.get_all().items] == ["hello world"]


def test_an_imported_vector_of_another_length_is_embedded_again(hmem: Memory) -> None:
    """Same model name, wrong length (a hand-edited or truncated export): the vector is made
    again rather than stored (on SQLite it had made every recall of the tenant fail)."""
    u = hmem.scope(app="a", user="u")
    u.remember("hello world")
    assert u.import_(_export_line(u, embedding=[0.1, 0.2, 0.3])) == 1
    assert [h.text for h in u.recall("hello", k=5)] == ["hello world", "hello world"]
    assert [h.text for h in hmem.scope(app="b").recall("hello")] == []


def test_an_import_into_a_scope_with_retention_is_capped(mem: Memory) -> None:
    """A scope's retention caps every record in it: the imported ones too (and a fork's)."""
    src = mem.scope(app="src")
    src.remember("kept forever at the source")
    buf = io.StringIO()
    src.export(buf)
    dst = mem.scope(app="dst")
    dst.set_policy(retention_seconds=60)
    assert dst.import_(io.StringIO(buf.getvalue())) == 1
    mem.scope(app="dst2").set_policy(retention_seconds=60)
    src.fork(app="dst2")
    for scope in (dst, mem.scope(app="dst2")):
        (rec,) = scope.get_all().items
        assert rec.expires_at is not None
        assert (rec.expires_at - rec.created_at).total_seconds() <= 60


def test_an_imported_retention_caps_the_records_its_scope_already_holds(mem: Memory) -> None:
    """An import sets the policies it carries; a retention it set on a scope where it brought
    no records (an app whose records sit on its users) left that scope's own records
    uncapped, living for ever under a policy that keeps them a minute (``set_policy`` caps
    them at once)."""
    src = mem.scope(app="src")
    src.set_policy(retention_seconds=60)
    mem.scope(app="src", user="u").remember("a user's fact")
    lines = list(src.export_lines())
    dst = mem.scope(app="dst")
    own = dst.remember("the app's own fact")
    dst.import_(lines)
    assert mem.store.get_policy("app/dst") == Policy(retention_seconds=60)
    got = dst.get(own.id)
    assert got.expires_at is not None
    assert to_us(got.expires_at) == to_us(got.created_at) + 60_000_000


def test_a_profile_merged_past_one_calls_limit_forks_and_imports(mem: Memory) -> None:
    """Each merge is checked on its own, so a stored profile may be larger than one call
    may send; the import's checks must not refuse what the store holds."""
    u = mem.scope(app="a", user="u")
    u.set_profile({"bio": "x" * 20_000})
    u.set_profile({"notes": "y" * 20_000}, merge=True)
    u.remember("hello")
    assert u.fork(app="a", user="v").get_profile() == u.get_profile()
    w = mem.scope(app="a", user="w")
    w.import_(list(u.export_lines()))
    assert w.get_profile() == u.get_profile()


@pytest.mark.parametrize(
    ("source", "target"),
    [
        pytest.param({"app": "a"}, {"app": "b", "agent": "g"}, id="level-out-of-order"),
        pytest.param({"app": "a"}, {"app": "b", "user": "w"}, id="level-twice"),
        pytest.param({}, {"app": "x"}, id="the-root-under-an-app"),
    ],
)
def test_an_import_that_would_put_a_record_at_no_scope_writes_nothing(
    mem: Memory, source: dict[str, str], target: dict[str, str]
) -> None:
    """Re-rooting ``app/a/user/v`` onto ``app/b/agent/g`` made ``app/b/agent/g/user/v``, a
    path no scope has: the record was stored there, unreachable, and every later export of
    the tenant failed to import (and every fork of its root failed)."""
    mem.scope(app="a", user="v").remember("hello from v")
    src, dst = mem.scope(**source), mem.scope(**target)
    with pytest.raises(InvalidArgument):
        dst.import_(list(src.export_lines()))
    with pytest.raises(InvalidArgument):
        src.fork(**target)
    assert [r.scope for r, _ in mem.store.iter_records("")] == ["app/a/user/v"]
    assert mem.scope().import_(list(mem.scope().export_lines())) == 0  # still a good backup


@pytest.mark.parametrize("when", ["0001-01-01T00:00:00+01:00", "9999-12-31T23:59:59-01:00"])
@pytest.mark.parametrize(
    ("line", "field"),
    [
        (1, "created_at"),
        (1, "valid_from"),
        (1, "valid_to"),
        (1, "expires_at"),
        (2, "updated_at"),
    ],
)
def test_an_import_of_a_time_past_the_calendar_writes_nothing(
    mem: Memory, line: int, field: str, when: str
) -> None:
    """A time that is in years 1-9999 as written but not in UTC was stored, and every later
    read of the record (or profile) failed with a raw OverflowError: ``get_all``, recall,
    export. It is refused as ``log(at=...)`` refuses it."""
    u = mem.scope(app="a", user="u")
    u.remember("hello world")
    u.set_profile({"plan": "pro"})
    lines = list(u.export_lines())
    obj = json.loads(lines[line])
    obj["record" if line == 1 else "profile"][field] = when
    if line == 1:
        obj["record"]["id"] = "ffffffffffffff0000000001"
    with pytest.raises(InvalidArgument):
        u.import_([lines[0], json.dumps(obj)])
    assert [f.text for f in u.get_all().items] == ["hello world"]
    assert u.get_profile() == {"plan": "pro"}
    assert len(list(u.export_lines())) == 3


@pytest.mark.parametrize(
    ("line", "change"),
    [
        pytest.param(1, {"id": "\ud800abc"}, id="id-lone-surrogate"),
        pytest.param(1, {"id": "abc\x00"}, id="id-nul"),
        pytest.param(1, {"id": ""}, id="id-empty"),
        pytest.param(1, {"id": ".."}, id="id-dot-dot"),
        pytest.param(1, {"id": "a/b"}, id="id-slash"),
        pytest.param(1, {"source_hash": "\ud800"}, id="source-hash-lone-surrogate"),
        pytest.param(1, {"source": {"url": "https://example.com/\x00"}}, id="source-url-nul"),
        pytest.param(2, {"session": "\ud800"}, id="session-lone-surrogate"),
        pytest.param(2, {"session": "s\x00"}, id="session-nul"),
    ],
)
def test_an_import_of_a_string_no_store_keeps_is_invalid(
    mem: Memory, line: int, change: dict[str, object]
) -> None:
    """An id, session or source that no store can keep (a lone surrogate: SQLite raised a raw
    UnicodeEncodeError, a 500 over HTTP; a NUL: stored on SQLite, a raw error on PostgreSQL),
    or an id no URL can name (the SDK refuses to get or forget it) is InvalidArgument, as the
    same value is to ``log`` and ``get``; nothing is written."""
    u = mem.scope(app="a", user="u")
    u.remember("hello world")
    u.log("user", "a turn", session="s1")
    lines = list(u.export_lines())
    obj = json.loads(lines[line])
    obj["record"].update({"id": "ffffffffffffff0000000001", **change})
    with pytest.raises(InvalidArgument):
        u.import_([lines[0], json.dumps(obj)])
    assert sorted(r.text for r in u.get_all().items) == ["a turn", "hello world"]


def test_an_import_line_nested_too_deep_is_invalid(mem: Memory) -> None:
    """A line of 100,000 nested brackets raised json's raw RecursionError (a 500 over HTTP)
    instead of naming the bad line."""
    u = mem.scope(app="a", user="u")
    header = next(iter(u.export_lines()))
    with pytest.raises(InvalidArgument, match="line 2"):
        u.import_([header, "[" * 100_000 + "]" * 100_000])


@pytest.mark.parametrize(
    "bad", ["a\x00b", "\ud800", float("nan")], ids=["nul", "lone-surrogate", "nan"]
)
def test_an_import_whose_profile_schema_no_store_keeps_writes_nothing(
    mem: Memory, bad: object
) -> None:
    """A profile's JSON schema holding a NUL (or NaN) was refused by PostgreSQL only after the
    records of the import had been written: the import failed and half of it stayed. It is
    refused before any write now, on every backend alike (as a NUL in the data is)."""
    u = mem.scope(app="a", user="u")
    u.remember("hello world")
    u.set_profile({"plan": "pro"})
    header, fact, profile = (json.loads(line) for line in u.export_lines())
    fact["record"]["id"] = "ffffffffffffff0000000001"
    profile["profile"]["json_schema"] = {"type": "object", "description": bad}
    with pytest.raises(InvalidArgument):
        u.import_([json.dumps(x) for x in (header, fact, profile)])
    assert u.get_all().total == 1  # the fact of the import is not there
    assert mem.store.get_profile(u.path).json_schema is None  # type: ignore[union-attr]
