"""Lexical-only recall (no embedder) on paraphrased questions, on every backend.

Pins what made lexical-only recall at least as good as plain BM25 on the bench's paraphrased
questions (see the module docstring of torpor.memory.recall): stop words are searched and
weighed low instead of dropped, shorter records win ties (BM25 length normalization), and stop
words are only searched when the content words leave room.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torpor.memory import Memory
from torpor.memory.backends.base import AnyRecord, RecordFilter, TenantStore
from torpor.memory.models import now_us
from torpor.memory.recall import query_terms, recall


def test_query_terms_keep_stop_words() -> None:
    assert query_terms("What is my occupation? What IS it") == [
        "what",
        "is",
        "my",
        "occupation",
        "it",
    ]


def test_paraphrased_question_finds_the_statement_through_stop_words(mem: Memory) -> None:
    u = mem.scope(app="a", user="u")
    u.log("user", "Book a table for two tonight.", session="s1")
    u.log("user", "My role is nurse now.", session="s1")
    u.log("user", "Draft an email to the team.", session="s1")
    # "occupation" is in no record: only "is" and "my" link the question to its answer
    hits = u.recall("What is my occupation?", k=2)
    assert [h.text for h in hits] == ["My role is nurse now."]
    assert 0 < hits[0].scores["coverage"] < 0.5  # found on low-weight words only


def test_a_content_word_outranks_several_stop_words(mem: Memory) -> None:
    u = mem.scope(app="a", user="u")
    # stop words are common in any real store: their IDF is low as well as their weight
    u.remember_many([f"note {i}: the plan is on my list" for i in range(8)])
    kayak = u.remember("kayak")
    u.remember("it is on the shelf with my things")
    hits = u.recall("is my kayak on the", k=3)
    # four shared stop words (0.2 each) weigh less than the one shared content word
    assert hits[0].id == kayak.id
    assert hits[0].scores["coverage"] > hits[1].scores["coverage"] > 0


def test_shorter_record_wins_a_lexical_tie(mem: Memory) -> None:
    u = mem.scope(app="a", user="u")
    short = u.remember("kayak trip")
    u.remember("kayak plus a long list of unrelated words about gear weather tides and maps")
    hits = u.recall("kayak", k=2)
    # equal coverage; the older, shorter record comes first (recency alone would flip it)
    assert hits[0].id == short.id
    assert hits[0].scores["bm25"] == 1.0 > hits[1].scores["bm25"]


def test_stop_words_match_with_an_embedder_too(hmem: Memory) -> None:
    u = hmem.scope(app="a", user="u")
    u.log("user", "My role is nurse now.", session="s1")
    hits = u.recall("What is my occupation?", k=5, min_similarity=-1.0)
    # the lexical side is the lexical-only search: "is"/"my" still link question and answer
    assert hits and 0 < hits[0].scores["coverage"] < 0.5 and "vector" in hits[0].scores


class _Spy:
    """A real store that records the terms of each lexical search."""

    def __init__(self, inner: TenantStore) -> None:
        self.inner = inner
        self.searches: list[list[str]] = []

    def lexical_search(
        self, terms: Sequence[str], flt: RecordFilter, limit: int, **kw: Any
    ) -> list[tuple[AnyRecord, float]]:
        self.searches.append(list(terms))
        return self.inner.lexical_search(terms, flt, limit, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_stop_words_are_searched_only_when_content_words_leave_room(mem: Memory) -> None:
    u = mem.scope(app="a", user="u")
    u.remember_many([f"kayak number {i} is mine" for i in range(80)])
    u.remember("is mine")
    spy = _Spy(mem.store)
    flt = RecordFilter(scopes=(u.path,), now=now_us())
    hits = recall(
        spy,  # type: ignore[arg-type]
        "is the kayak mine",
        flt,
        5,
        query_scope=u.path,
        embedder=None,
    )
    # more content matches than the lexical pool (60 for k=5): no stop-word search
    assert spy.searches == [["kayak", "mine"]]
    assert len(hits) == 5
    spy.searches.clear()
    recall(
        spy,  # type: ignore[arg-type]
        "is the canoe blue",
        flt,
        5,
        query_scope=u.path,
        embedder=None,
    )
    assert spy.searches == [["canoe", "blue"], ["is", "the", "canoe", "blue"]]
