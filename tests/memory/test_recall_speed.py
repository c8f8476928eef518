"""The speed path of recall returns what the plain path returns (issue 10).

Recall shares one :class:`SearchMemo` between its searches (a record both find is built once,
a term searched twice is looked up once), fetches the lexical rows in stages, and tokenizes
the lexical candidates while the query embeds. None of that may change a hit: each test here
compares the memoized path against the same searches run without a memo, on every backend.
"""

from __future__ import annotations

from typing import Any

import pytest

from torpor.memory import Memory
from torpor.memory.backends.base import AnyRecord, RecordFilter, SearchMemo, TenantStore
from torpor.memory.embeddings import HashEmbedder
from torpor.memory.models import Fact, Hit, now_us
from torpor.memory.ranking import STOPWORDS, Candidates, HybridRanker
from torpor.memory.recall import LEXICAL_POOL, previous_turns, query_terms, recall

WORDS = [
    "kayak",
    "canoe",
    "river",
    "lake",
    "paddle",
    "blue",
    "red",
    "green",
    "trip",
    "summer",
    "winter",
    "plan",
]


def _fill(m: Memory) -> Any:
    """A scope with repeated texts (exact ties on both sides), keyed facts superseded in
    between, episodes in sessions (the reply share), and metadata to filter on."""
    u = m.scope(app="a", user="u")
    m.scope(app="a").remember("the team paddles the river every summer")
    u.remember_many(
        [
            {"text": f"{WORDS[i % 12]} {WORDS[(i * 5) % 12]} is mine", "metadata": {"n": i % 3}}
            for i in range(150)
        ]
    )
    for i in range(40):
        u.remember(f"my favourite boat is the {WORDS[i % 6]} one", key="boat")
    u.log_many(
        [
            {
                "role": "user" if i % 2 else "assistant",
                "text": f"a {WORDS[i % 9]} trip",
                "session": f"s{i % 4}",
            }
            for i in range(120)
        ]
    )
    return u


def _plain_recall(
    store: TenantStore, m: Memory, query: str, flt: RecordFilter, k: int, scope: str
) -> list[Hit]:
    """recall() written out with no memo, no staging, no early tokenizing: the reference."""
    ranker = HybridRanker()
    pool = max(k * 3, 30)
    terms = query_terms(query)
    content = [t for t in terms if t not in STOPWORDS]
    lexical = store.lexical_search(content, flt, pool * LEXICAL_POOL) if content else []
    if len(lexical) < pool * LEXICAL_POOL and len(content) < len(terms):
        lexical = store.lexical_search(terms, flt, pool * LEXICAL_POOL)
    emb = m.usable_embedder()
    vector = None
    if emb is not None:
        vector = store.vector_search(emb.embed([query])[0].tolist(), flt, pool)
    found = Candidates(
        query=query,
        terms=tuple(terms),
        scope=scope,
        now=flt.now,
        lexical=lexical,
        vector=vector,
        mean_words=store.mean_words(),
        limit=max(k, ranker.reply_top) if emb is not None else k,
    )
    hits = ranker.rank(found)
    if emb is not None:
        hits = ranker.with_replies(hits, previous_turns(store, hits[: ranker.reply_top], flt))
    return hits[:k]


def _key(hits: list[Hit]) -> list[tuple[str, float, dict[str, float], Any]]:
    return [(h.id, h.score, h.scores, h.record.model_dump()) for h in hits]


QUERIES = [
    "is the kayak mine",  # content words match more than the pool: one search
    "what is my favourite boat",  # few content matches: a second search with stop words
    "a blue trip",
    "the river in summer",
    "zzz unknown words",
]


@pytest.mark.parametrize("embedder", [None, HashEmbedder(64)], ids=["lexical", "hybrid"])
def test_recall_returns_what_the_plain_searches_return(
    backend_spec: str, home: Any, embedder: Any
) -> None:
    m = Memory(str(home), embedder=embedder, backend=backend_spec)
    try:
        u = _fill(m)
        for query in QUERIES:
            for k in (1, 5, 25):
                flt = u._filter(now_us(), kinds=("fact", "episode"))
                got = recall(m.store, query, flt, k, query_scope=u.path, embedder=embedder)
                want = _plain_recall(m.store, m, query, flt, k, u.path)
                assert _key(got) == _key(want), (query, k)
    finally:
        m.close()


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param({}, id="all"),
        pytest.param({"metadata": {"n": 1}}, id="selective-metadata"),
        pytest.param({"kinds": ("episode",), "session": "s2"}, id="selective-session"),
        pytest.param({"include_history": True}, id="history"),
    ],
)
def test_a_memo_changes_no_search_result(hmem: Memory, extra: dict[str, Any]) -> None:
    """Same records, same scores, same order, with or without a memo; and a record that
    both searches find is one object when they share one."""
    u = _fill(hmem)
    store = hmem.store
    flt = RecordFilter(
        scopes=(u.path, "app/a", ""), now=now_us(), **({"kinds": ("fact", "episode")} | extra)
    )
    emb = hmem.usable_embedder()
    assert emb is not None
    for terms in (["kayak", "mine"], ["is", "the", "kayak"], ["boat"], ["trip", "blue"]):
        for limit in (1, 8, 60, 300):
            memo = SearchMemo()
            plain = store.lexical_search(terms, flt, limit)
            memoized = store.lexical_search(terms, flt, limit, memo=memo)
            again = store.lexical_search(terms, flt, limit, memo=memo)  # from the memo
            assert _pairs(plain) == _pairs(memoized) == _pairs(again)
            vec = emb.embed([" ".join(terms)])[0].tolist()
            plain_v = store.vector_search(vec, flt, limit)
            memo_v = store.vector_search(vec, flt, limit, memo=memo)
            assert _pairs(plain_v) == _pairs(memo_v)
            if store.__class__.__name__.startswith("SQLite"):
                by_id = {r.id: r for r, _ in memoized}
                shared = [r for r, _ in memo_v if r.id in by_id]
                assert all(by_id[r.id] is r for r in shared)


def _pairs(found: list[tuple[AnyRecord, float]]) -> list[tuple[Any, float]]:
    return [(r.model_dump(), s) for r, s in found]


def test_a_row_changed_between_searches_is_built_again(hmem: Memory) -> None:
    u = hmem.scope(app="a", user="u")
    fact = u.remember("the blue kayak is mine")
    store = hmem.store
    flt = RecordFilter(scopes=(u.path,), now=now_us())
    memo = SearchMemo()
    ((before, _),) = store.lexical_search(["kayak"], flt, 5, memo=memo)
    assert isinstance(before, Fact) and before.verified is False
    store.set_verification(fact.id, verified=True, stale=False, source_hash=None)
    emb = hmem.usable_embedder()
    assert emb is not None
    ((after, _),) = store.vector_search(emb.embed(["blue kayak"])[0].tolist(), flt, 5, memo=memo)
    assert isinstance(after, Fact) and after.id == before.id and after.verified is True
    ((lex_after, _),) = store.lexical_search(["kayak"], flt, 5, memo=memo)
    assert isinstance(lex_after, Fact) and lex_after.verified is True
