"""The backend contract (:mod:`torpor.memory.backends.base`), run on every backend."""

from __future__ import annotations

import random
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pytest

from torpor.errors import InvalidArgument, InvalidName, RecordNotFound, StorageError
from torpor.memory.backends import MemoryBackend, TenantStore
from torpor.memory.backends.base import RecordFilter, visible
from torpor.memory.models import (
    AuditEntry,
    Episode,
    Fact,
    Grant,
    Policy,
    Profile,
    TokenInfo,
    from_us,
    new_id,
    now_us,
    to_us,
)

U = "app/a/user/u"
VIEW = [U, "app/a", ""]


def fact(text: str, key: str | None = None, scope: str = U, **kw: Any) -> Fact:
    t = from_us(now_us())
    return Fact(id=new_id(), scope=scope, text=text, key=key, created_at=t, valid_from=t, **kw)


def episode(text: str, scope: str = U, **kw: Any) -> Episode:
    t = from_us(now_us())
    kw.setdefault("valid_from", t)
    return Episode(id=new_id(), scope=scope, text=text, created_at=t, **kw)


def flt(**kw: Any) -> RecordFilter:
    return RecordFilter(scopes=kw.pop("scopes", VIEW), now=kw.pop("now", now_us()), **kw)


def test_schema_is_versioned(store: TenantStore) -> None:
    assert store.schema_version() >= 1


def test_supersede_ends_only_same_scope_and_key(store: TenantStore) -> None:
    a = store.add([fact("weekly", "cadence")])[0]
    other_key = store.add([fact("pro", "plan")])[0]
    other_scope = store.add([fact("weekly too", "cadence", scope="app/a")])[0]
    b = store.add([fact("daily", "cadence")])[0]
    hist = store.history(U, "cadence", now_us())
    assert [f.text for f in hist] == ["weekly", "daily"]
    assert hist[0].valid_to == b.valid_from and hist[0].superseded_by == b.id
    assert hist[1].valid_to is None
    current = {r.id for r in store.scan(flt(), 100)}
    assert current == {b.id, other_key.id, other_scope.id}
    assert a.id not in current


def test_supersede_within_one_batch_keeps_order(store: TenantStore) -> None:
    out = store.add([fact("v1", "k"), fact("v2", "k"), fact("v3", "k")])
    hist = store.history(U, "k", now_us())
    assert [f.text for f in hist] == ["v1", "v2", "v3"]
    assert [f.id for f in hist] == [f.id for f in out]
    times = [to_us(f.valid_from) for f in hist]
    assert times == sorted(set(times))


def test_supersede_moves_valid_from_after_old(store: TenantStore) -> None:
    old = store.add([fact("future", "k")])[0]
    early = fact("backdated", "k")
    early = early.model_copy(update={"valid_from": from_us(to_us(old.valid_from) - 10)})
    new = store.add([early])[0]
    assert to_us(new.valid_from) == to_us(old.valid_from) + 1


def test_as_of_sees_what_was_true(store: TenantStore) -> None:
    a = store.add([fact("weekly summaries", "k")])[0]
    b = store.add([fact("daily summaries", "k")])[0]
    then = [r.id for r in store.scan(flt(as_of=to_us(a.valid_from)), 10)]
    assert then == [a.id]
    assert [r.id for r in store.scan(flt(as_of=to_us(b.valid_from)), 10)] == [b.id]
    assert {r.id for r in store.scan(flt(include_history=True), 10)} == {a.id, b.id}
    hits = store.lexical_search(["summaries"], flt(as_of=to_us(a.valid_from)), 10)
    assert [r.id for r, _ in hits] == [a.id]


def test_duplicate_id_is_typed_and_atomic(store: TenantStore) -> None:
    f = fact("one")
    store.add([f])
    with pytest.raises(InvalidArgument):
        store.add([fact("two"), f])
    assert [r.text for r in store.scan(flt(), 10)] == ["one"]


def test_lexical_search_ranks_and_filters(store: TenantStore) -> None:
    store.add(
        [
            fact("the cat sat on the mat"),
            fact("dogs bark at cats"),
            fact("unrelated text"),
            episode("cat food order", session="s1"),
            fact("cat in another tenant scope", scope="app/b"),
        ]
    )
    hits = store.lexical_search(["cat"], flt(), 10)
    texts = [r.text for r, _ in hits]
    assert "unrelated text" not in texts and "cat in another tenant scope" not in texts
    assert {"the cat sat on the mat", "cat food order"} <= set(texts)
    assert all(s > 0 for _, s in hits)
    assert [s for _, s in hits] == sorted((s for _, s in hits), reverse=True)
    only_ep = store.lexical_search(["cat"], flt(kinds=("episode",), session="s1"), 10)
    assert [r.text for r, _ in only_ep] == ["cat food order"]
    assert store.lexical_search([], flt(), 10) == []
    assert store.lexical_search(['"', "OR", "NEAR("], flt(), 10) == []


def test_lexical_ties_go_to_the_newest_matches(store: TenantStore) -> None:
    # many equally relevant matches ("ok", "thanks" in a chat log): the newest come first,
    # however many older ones the store holds
    t0 = now_us() - 1_000_000
    turns = [episode("ok thanks", valid_from=from_us(t0 + i)) for i in range(120)]
    store.add(turns)
    hits = store.lexical_search(["thanks"], flt(), 5)
    assert len({s for _, s in hits}) == 1  # a tie
    assert [r.id for r, _ in hits] == [t.id for t in turns[::-1][:5]]


def test_lexical_search_takes_a_limit_past_any_count(store: TenantStore) -> None:
    # recall(k=2**28) asks for 6k lexical matches; nothing bounds k but the store's size
    store.add([fact("the cat sat on the mat"), episode("cat food order")])
    for limit in (2**28, 2**29, 2**40):
        hits = store.lexical_search(["cat"], flt(), limit)
        assert sorted(r.text for r, _ in hits) == ["cat food order", "the cat sat on the mat"]


def test_metadata_filters(store: TenantStore) -> None:
    store.add(
        [
            fact("alpha one", metadata={"topic": "billing", "n": 3, "ok": True}),
            fact("alpha two", metadata={"topic": "support", "n": 4, "ok": False}),
            fact("alpha three"),
        ]
    )

    def texts(**meta: Any) -> set[str]:
        return {r.text for r, _ in store.lexical_search(["alpha"], flt(metadata=meta), 10)}

    assert texts(topic="billing") == {"alpha one"}
    assert texts(n=4) == {"alpha two"}
    assert texts(ok=True) == {"alpha one"}
    assert texts(ok=False) == {"alpha two"}
    assert texts(topic="none") == set()


def test_vector_search_cosine_and_filters(store: TenantStore) -> None:
    rng = np.random.default_rng(0)
    vecs = rng.normal(size=(30, 8)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    recs = [fact(f"r{i}", metadata={"even": i % 2 == 0}) for i in range(30)]
    store.add(recs, list(vecs))
    hits = store.vector_search(vecs[7].tolist(), flt(), 5)
    assert hits[0][0].id == recs[7].id and hits[0][1] == pytest.approx(1.0, abs=1e-5)
    expect = np.argsort(-(vecs @ vecs[7]))[:5]
    assert [r.id for r, _ in hits] == [recs[i].id for i in expect]
    even = store.vector_search(vecs[7].tolist(), flt(metadata={"even": True}), 3)
    assert len(even) == 3 and all(r.metadata["even"] for r, _ in even)
    # supersession and deletion are seen by the (cached) index
    store.forget([recs[7].id])
    assert recs[7].id not in [r.id for r, _ in store.vector_search(vecs[7].tolist(), flt(), 5)]
    assert store.vector_search(vecs[0].tolist(), flt(scopes=["app/zzz"]), 5) == []


def test_expiry_is_immediate_and_purge_deletes(store: TenantStore) -> None:
    now = now_us()
    gone = fact("expired note", expires_at=from_us(now - 1))
    live = fact("live note", expires_at=from_us(now + 10**9))
    store.add([gone, live])
    assert [r.id for r in store.scan(flt(now=now), 10)] == [live.id]
    assert store.get([gone.id, live.id], now) == [store.get([live.id], now)[0]]
    assert [r.id for r, _ in store.lexical_search(["note"], flt(now=now), 10)] == [live.id]
    assert store.purge_expired(now) == 1
    assert store.get([gone.id], 0) == []


def test_retention_caps_expiry(store: TenantStore) -> None:
    f = store.add([fact("kept briefly")])[0]
    assert store.cap_expiry(U, 5_000_000) == 1
    got = store.get([f.id], 0)[0]
    assert to_us(got.expires_at) == to_us(f.created_at) + 5_000_000  # type: ignore[arg-type]


def test_a_retention_past_the_calendars_end_leaves_the_records_readable(
    store: TenantStore,
) -> None:
    """A record made late in year 9999 (an import keeps its times) in a scope given a
    retention: created_at + retention passed the last datetime, so every read of the record
    (get, scan, recall) failed with a raw OverflowError. It ends at the calendar's end."""
    late = datetime(9999, 6, 1, tzinfo=UTC)
    made = fact("made late").model_copy(update={"created_at": late, "valid_from": late})
    f = store.add([made])[0]
    assert store.cap_expiry(U, 2 * 365 * 86_400 * 1_000_000) == 1
    got = store.get([f.id], now_us())[0]
    assert got.expires_at == datetime.max.replace(tzinfo=UTC)
    assert [r.id for r in store.scan(flt(), 10)] == [f.id]
    assert store.cap_expiry(U, 2 * 365 * 86_400 * 1_000_000) == 0  # capped once


def test_forget_scope_is_component_wise(store: TenantStore) -> None:
    store.add(
        [fact("x", scope="app/a"), fact("y", scope="app/a/user/u"), fact("z", scope="app/ab")]
    )
    store.put_profile(Profile(scope="app/a/user/u", data={"a": 1}, updated_at=from_us(now_us())))
    assert store.forget_scope("app/a") == 2
    left = store.scan(flt(scopes=["app/a", "app/a/user/u", "app/ab"]), 10)
    assert [r.text for r in left] == ["z"]
    assert store.get_profile("app/a/user/u") is None


def test_profiles_policies_meta(store: TenantStore) -> None:
    assert store.get_profile(U) is None
    p1 = store.put_profile(Profile(scope=U, data={"plan": "pro"}, updated_at=from_us(now_us())))
    p2 = store.put_profile(
        Profile(
            scope=U,
            data={"plan": "free"},
            json_schema={"type": "object"},
            updated_at=from_us(now_us()),
        )
    )
    assert (p1.version, p2.version) == (1, 2)
    got = store.get_profile(U)
    assert (
        got is not None and got.data == {"plan": "free"} and got.json_schema == {"type": "object"}
    )
    assert [p.scope for p in store.iter_profiles("app")] == [U]
    store.set_policy(U, Policy(retention_seconds=60))
    assert store.get_policy(U) == Policy(retention_seconds=60)
    assert store.get_meta("x") is None
    store.set_meta("x", "1")
    assert store.get_meta("x") == "1"


def test_verification_update(store: TenantStore) -> None:
    f = store.add([fact("sourced")])[0]
    store.set_verification(f.id, verified=True, stale=False, source_hash="abc")
    got = store.get([f.id], now_us())[0]
    assert isinstance(got, Fact) and got.verified and got.source_hash == "abc"
    with pytest.raises(RecordNotFound):
        store.set_verification("nope", verified=False, stale=True, source_hash=None)


def test_import_keeps_ids_and_skips_existing(store: TenantStore) -> None:
    a = store.add([fact("v1", "k")])[0]
    b = store.add([fact("v2", "k")])[0]
    rows = list(store.iter_records(""))
    assert [r.id for r, _ in rows] == [a.id, b.id]
    assert store.import_records([r for r, _ in rows]) == 0
    newer = fact("v3", "k")
    assert store.import_records([newer]) == 1
    assert [f.text for f in store.history(U, "k", now_us())] == ["v1", "v2", "v3"]
    assert len(store.scan(flt(key="k"), 10)) == 1


def test_the_same_import_twice_at_once_imports_each_record_once(store: TenantStore) -> None:
    # e.g. a client that timed out retrying an import the server is still running
    import threading

    def twice(records: list[Episode]) -> tuple[list[int], list[Exception]]:
        gate = threading.Barrier(2)
        counts: list[int] = []
        errors: list[Exception] = []

        def run() -> None:
            gate.wait()
            try:
                counts.append(store.import_records(records))
            except Exception as exc:
                errors.append(exc)

        threads = [threading.Thread(target=run) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return counts, errors

    for _ in range(3):
        counts, errors = twice([episode(f"turn {i}") for i in range(200)])
        assert errors == [] and sum(counts) == 200
    assert store.count(flt()) == 600
    assert store.record_count() == 600


def test_scan_matches_reference_filter(store: TenantStore) -> None:
    rnd = random.Random(7)
    scopes = ["", "app/a", U, "app/b", "app/a/user/v"]
    recs: list[Fact | Episode] = []
    for i in range(120):
        scope = rnd.choice(scopes)
        meta = {"c": rnd.choice(["x", "y"])}
        if rnd.random() < 0.5:
            recs.append(
                fact(f"t{i}", key=rnd.choice([None, "k1", "k2"]), scope=scope, metadata=meta)
            )
        else:
            recs.append(
                episode(f"t{i}", scope=scope, session=rnd.choice(["s1", "s2"]), metadata=meta)
            )
    store.add(recs)
    everything = [r for r, _ in store.iter_records("")]
    mid = to_us(everything[60].valid_from)
    for f in [
        flt(),
        flt(include_history=True),
        flt(as_of=mid),
        flt(kinds=("episode",)),
        flt(key="k1", include_history=True),
        flt(session="s2"),
        flt(metadata={"c": "x"}),
        flt(since=mid),
        flt(until=mid),
        flt(scopes=["app/b", ""]),
    ]:
        expect = {r.id for r in everything if visible(r, f)}
        assert {r.id for r in store.scan(f, 1000)} == expect
        assert store.count(f) == len(expect)


def test_closed_store_raises(backend: MemoryBackend) -> None:
    s = backend.tenant("closing")
    s.add([fact("x")])
    s.close()
    with pytest.raises(StorageError):
        s.scan(flt(), 10)


def test_a_closed_backend_raises_and_opens_nothing_again(backend: MemoryBackend) -> None:
    backend.tenant("t1").add([fact("x")])
    backend.audit_log("t1", 1)
    backend.close()
    with pytest.raises(StorageError):
        backend.tenant("t1").scan(flt(), 10)
    with pytest.raises(StorageError):
        backend.tenant("other").add([fact("y")])
    with pytest.raises(StorageError):
        backend.audit_log("t1", 10)
    with pytest.raises(StorageError):
        backend.append_audit(AuditEntry(at=from_us(now_us()), tenant="t1", actor="a", action="x"))
    with pytest.raises(StorageError):
        backend.get_token("h1")


def test_bad_tenant_name(backend: MemoryBackend) -> None:
    with pytest.raises(InvalidName):
        backend.tenant("../etc")
    with pytest.raises(InvalidName):
        backend.tenant("_system")


def test_tenants_are_separate(backend: MemoryBackend) -> None:
    backend.tenant("t1").add([fact("secret of t1")])
    backend.tenant("t2").add([fact("secret of t2")])
    assert [r.text for r in backend.tenant("t2").scan(flt(), 10)] == ["secret of t2"]
    assert {"t1", "t2"} <= set(backend.tenants())


def test_tokens_and_audit(backend: MemoryBackend) -> None:
    info = TokenInfo(
        token_hash="h1",
        tenant="t1",
        grants=[Grant(mode="read", prefix="app/a")],
        created_at=from_us(now_us()),
    )
    backend.put_token(info)
    assert backend.get_token("h1") == info
    assert backend.revoke_token("h1") and backend.get_token("h1").revoked  # type: ignore[union-attr]
    assert not backend.revoke_token("nope")
    for i in range(3):
        backend.append_audit(
            AuditEntry(
                at=from_us(now_us()), tenant="t1", actor="a", action=f"act{i}", allowed=i != 1
            )
        )
    backend.append_audit(AuditEntry(at=from_us(now_us()), tenant="t2", actor="a", action="x"))
    log = backend.audit_log("t1", 10)
    assert [e.action for e in log] == ["act2", "act1", "act0"]
    assert log[1].allowed is False


def test_lexical_search_with_a_selective_filter(store: TenantStore) -> None:
    # many better-ranked matches outside the view force the eligible-set path
    store.add([fact(f"apple apple banana {i}", scope="app/b") for i in range(120)])
    mine = store.add(
        [fact("apple in my scope"), fact("banana in my scope"), episode("apple episode")]
    )
    got = store.lexical_search(["apple", "banana"], flt(), 5)
    assert {r.id for r, _ in got} == {r.id for r in mine}
    only_facts = store.lexical_search(["apple", "banana"], flt(kinds=("fact",)), 5)
    assert {r.id for r, _ in only_facts} == {mine[0].id, mine[1].id}


def test_lexical_scores_favour_rare_terms(store: TenantStore) -> None:
    store.add([fact(f"common word {i}") for i in range(40)] + [fact("common rare")])
    got = store.lexical_search(["common", "rare"], flt(), 3)
    assert got[0][0].text == "common rare"
    assert got[0][1] > got[1][1] > 0


def test_mean_words_is_the_stores_or_unknown(store: TenantStore) -> None:
    """SQLite reads FTS5's totals; a backend without the statistic says None (the ranker
    then falls back on its candidates' mean)."""
    empty = store.mean_words()
    assert empty is None or empty == 0
    short, long = fact("two words"), fact("one two three four five six seven eight nine ten")
    store.add([short, long, episode("a b c d e f")])
    mean = store.mean_words()
    if mean is None:
        return  # e.g. PostgreSQL: nothing cheap to read
    assert mean == pytest.approx(18 / 3)
    store.forget([long.id])
    assert store.mean_words() == pytest.approx(8 / 2)


def test_previous_episodes_follow_the_logged_order(store: TenantStore) -> None:
    """The turn before a turn is the latest earlier one of its scope and session (or of its
    scope's turns without a session); turns of one time (a log that dates every turn of a
    session alike) come in the order stored."""
    t = from_us(now_us())
    earlier = from_us(now_us() - 60_000_000)
    a, b, c = (episode(x, session="s1", valid_from=t) for x in ("a", "b", "c"))
    late = episode("back-filled", session="s1", valid_from=earlier)  # stored last, dated first
    other = episode("other session", session="s2", valid_from=t)
    elsewhere = episode("other scope", scope="app/a", session="s1", valid_from=t)
    # turns logged without a session are their scope's one log
    x, y = (episode(w, valid_from=t) for w in ("x", "y"))
    store.add([a, x, b, c, fact("a fact in between")])
    store.add([late, other, elsewhere, y])
    asked = [a, b, c, late, other, elsewhere, x, y]
    got = store.previous_episodes(asked, flt())
    assert got == {a.id: late.id, b.id: a.id, c.id: b.id, y.id: x.id}
    # the contract's own default (a backend without a query of its own) agrees
    assert TenantStore.previous_episodes(store, asked, flt()) == got
    # what the filter hides is skipped: with ``b`` forgotten, ``c`` follows ``a``
    store.forget([b.id])
    assert store.previous_episodes([c], flt()) == {c.id: a.id}
    assert TenantStore.previous_episodes(store, [c], flt()) == {c.id: a.id}
    # a long session of one time: the default pages through the scan
    many = [episode(f"turn {i}", session="s3", valid_from=t) for i in range(150)]
    store.add(many)
    asked = [many[0], many[1], many[75], many[149]]
    want = {many[i].id: many[i - 1].id for i in (1, 75, 149)}
    assert store.previous_episodes(asked, flt()) == want
    assert TenantStore.previous_episodes(store, asked, flt()) == want


def _unit(seed: int) -> list[float]:
    v = np.random.default_rng(seed).normal(size=16).astype(np.float32)
    return [float(x) for x in v / np.linalg.norm(v)]


def test_a_forgotten_records_rowid_is_never_given_again(store: TenantStore) -> None:
    """SQLite numbered new rows from max(rowid) + 1: after the newest record was forgotten the
    next one took its rowid, and the vector index (which knows rows by rowid) kept scoring
    it with the forgotten record's vector."""
    a, b, c = _unit(1), _unit(2), _unit(3)
    ra = store.add([fact("first")], [a])[0]
    rb = store.add([fact("second")], [b])[0]
    store.vector_search(a, flt(), 5)  # the index now holds rb's vector
    store.forget([rb.id])
    rc = store.add([fact("third")], [c])[0]
    hits = store.vector_search(c, flt(), 5)
    assert [h[0].id for h in hits] == [rc.id, ra.id]
    assert hits[0][1] == pytest.approx(1.0, abs=1e-5)


def test_an_old_match_behind_many_newer_ones_elsewhere_is_found(store: TenantStore) -> None:
    """A term's postings keep its newest matches only (SQLite's _TERM_CAP): with a selective
    filter the older match in the queried scope was dropped, not ranked."""
    from torpor.memory.backends.sqlite import _TERM_CAP

    mine = store.add([fact("alpha in my scope")])[0]
    store.add([fact(f"alpha elsewhere {i}", scope="app/b") for i in range(_TERM_CAP + 1)])
    assert [r.id for r, _ in store.lexical_search(["alpha"], flt(), 5)] == [mine.id]
    assert [r.id for r, _ in store.lexical_search(["mine", "alpha"], flt(), 5)] == [mine.id]


def test_both_backends_search_the_same_first_terms(store: TenantStore) -> None:
    from torpor.memory.backends.base import MAX_LEXICAL_TERMS

    target = store.add([fact("zebra crossing")])[0]
    terms = [f"word{i}" for i in range(MAX_LEXICAL_TERMS - 1)]
    assert [r.id for r, _ in store.lexical_search([*terms, "zebra"], flt(), 5)] == [target.id]
    assert store.lexical_search([*terms, "filler", "zebra"], flt(), 5) == []  # past the cut


def test_a_metadata_filter_on_an_object_compares_values(store: TenantStore) -> None:
    """SQLite compared an object's or a list's JSON text: key order, and 1 against 1.0,
    made equal values differ (PostgreSQL's jsonb and ``visible`` compare values)."""
    store.add([fact("alpha", metadata={"loc": {"city": "Oslo", "zip": "0150"}, "v": [1.0]})])
    store.add([fact("beta", metadata={"loc": "Oslo", "v": 1})])  # scalars: never an object
    for wanted in ({"loc": {"zip": "0150", "city": "Oslo"}}, {"v": [1]}):
        assert [r.text for r in store.scan(flt(metadata=wanted), 10)] == ["alpha"]
        assert store.count(flt(metadata=wanted)) == 1
    assert store.count(flt(metadata={"loc": {"city": "Oslo"}})) == 0


def test_a_metadata_filter_on_an_integer_past_64_bits(store: TenantStore) -> None:
    """JSON has integers of any size (PostgreSQL's jsonb compares them); SQLite could not bind
    one past 64 bits as a parameter and raised a raw OverflowError (a 500 from the server)."""
    store.add(
        [
            fact("big number", metadata={"n": 2**64}),
            fact("small number", metadata={"n": 1}),
            fact("negative number", metadata={"n": -(2**70)}),
        ]
    )
    cases = {2**64: ["big number"], -(2**70): ["negative number"], 2**63: [], 1: ["small number"]}
    for wanted, texts in cases.items():
        only = flt(metadata={"n": wanted})
        assert [r.text for r in store.scan(only, 10)] == texts
        assert store.count(only) == len(texts)
        assert [r.text for r, _ in store.lexical_search(["number"], only, 5)] == texts


def test_a_metadata_filter_on_an_integer_past_a_float(store: TenantStore) -> None:
    """An integer past what a float holds (JSON has them; PostgreSQL's jsonb compares them)
    could not be bound as a real either: SQLite raised a raw OverflowError (a 500). SQLite
    reads such a JSON integer as an infinite real, so the filter compares with that."""
    store.add([fact("huge number", metadata={"n": 10**400}), fact("small", metadata={"n": 1})])
    for wanted, texts in {10**400: ["huge number"], -(10**400): [], 1: ["small"]}.items():
        only = flt(metadata={"n": wanted})
        assert [r.text for r in store.scan(only, 10)] == texts
        assert store.count(only) == len(texts)
