"""The ranking seam: :class:`HybridRanker`'s options each change the answer, and a ranking
passed to :class:`Memory` is the one every scope's recall uses."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from torpor.errors import InvalidArgument
from torpor.memory import Candidates, Episode, Fact, HashEmbedder, Hit, HybridRanker, Memory
from torpor.memory.backends.base import AnyRecord
from torpor.memory.models import from_us, now_us, to_us
from torpor.memory.ranking import (
    asks,
    instructs,
    prefers,
    query_days,
    recounts,
    relative_days,
)
from torpor.memory.recall import previous_turns

NOW = now_us()
USER = "app/a/user/u"


def _record(
    kind: type[Fact] | type[Episode], rid: str, text: str, scope: str, days: float
) -> AnyRecord:
    at = from_us(NOW - int(days * 86_400e6))
    return kind(id=rid, scope=scope, text=text, created_at=at, valid_from=at)


LOCAL = _record(Fact, "local", "kayak trip on the lake", USER, 10)
TALK = _record(Episode, "talk", "is the kayak mine or is it a long story about lakes", USER, 40)
# the same words from another speaker, newer: it wins unless the query names Dana
REPLY = Episode(
    id="reply",
    scope=USER,
    text="is the kayak mine or is it a long story about lakes",
    role="sam",
    created_at=from_us(NOW - 86_400_000_000),
    valid_from=from_us(NOW - 86_400_000_000),
)
TALK = TALK.model_copy(update={"role": "Dana"})
PARENT = _record(Fact, "parent", "kayak", "app/a", 1)
WEAK = _record(Fact, "weak", "the lake house", USER, 5)
NEAR = _record(Fact, "near", "a paddle", USER, 2)  # found by vectors only, under the floor


def _found(min_similarity: float | None = None) -> Candidates:
    return Candidates(
        query="is the kayak mine",
        terms=("is", "the", "kayak", "mine"),
        scope=USER,
        now=NOW,
        lexical=[(PARENT, 3.0), (LOCAL, 2.0), (TALK, 1.5), (WEAK, 0.2)],
        vector=[(PARENT, 0.9), (LOCAL, 0.5), (TALK, 0.3), (NEAR, 0.1), (WEAK, 0.05)],
        min_similarity=min_similarity,
    )


def _answer(hits: list[Hit]) -> list[tuple[str, float]]:
    return [(h.id, h.score) for h in hits]


# Each option of HybridRanker, a value that differs from its default, and the ranker it is
# changed on (scope_decay only weighs the score when scope is not a tier of its own; coverage
# is tried without vectors).
OPTIONS = [
    pytest.param("coverage", 0.3, HybridRanker(), id="coverage"),
    pytest.param("stopword", 1.0, HybridRanker(), id="stopword"),
    pytest.param("bm25_k1", 2.0, HybridRanker(), id="bm25_k1"),
    pytest.param("bm25_b", 0.0, HybridRanker(), id="bm25_b"),
    pytest.param("lexical", 0.9, HybridRanker(), id="lexical"),
    pytest.param("stand_out", 0.0, HybridRanker(), id="stand_out"),
    pytest.param("dated", 0.0, HybridRanker(), id="dated"),
    pytest.param("asking", 1.0, HybridRanker(), id="asking"),
    pytest.param("instructing", 1.0, HybridRanker(), id="instructing"),
    pytest.param("preferring", 1.0, HybridRanker(), id="preferring"),
    pytest.param("hybrid_coverage", 0.9, HybridRanker(), id="hybrid_coverage"),
    pytest.param("spread_floor", 0.5, HybridRanker(), id="spread_floor"),
    pytest.param("scope_decay", 0.3, HybridRanker(tiered=False), id="scope_decay"),
    pytest.param("episode", 1.0, HybridRanker(), id="episode"),
    pytest.param("speaker", 0.0, HybridRanker(), id="speaker"),
    pytest.param("recency", 0.5, HybridRanker(), id="recency"),
    pytest.param("half_life_days", 3.0, HybridRanker(), id="half_life_days"),
    pytest.param("min_similarity", 0.05, HybridRanker(), id="min_similarity"),
    pytest.param("relative_floor", 0.5, HybridRanker(), id="relative_floor"),
    pytest.param("tiered", False, HybridRanker(), id="tiered"),
    pytest.param("unseen", 0.0, HybridRanker(), id="unseen"),
]


REPLY_OPTIONS = [
    pytest.param("reply", 0.0, id="reply"),
    pytest.param("reply_top", 1, id="reply_top"),
]


def test_every_option_is_tested() -> None:
    tested = {p.values[0] for p in [*OPTIONS, *REPLY_OPTIONS]}
    assert tested == {f.name for f in dataclasses.fields(HybridRanker)}


def _hit(rid: str, score: float) -> Hit:
    rec = Episode(
        id=rid, scope=USER, text=rid, session="s", created_at=from_us(NOW), valid_from=from_us(NOW)
    )
    return Hit.model_construct(record=rec, score=score, scores={"scope_distance": 0.0})


def _replied() -> list[Hit]:
    # "answer" is the best hit; "fact" (the turn before it) is third, close behind "other"
    return [_hit("answer", 1.0), _hit("other", 0.5), _hit("fact", 0.45)]


def test_a_turn_takes_a_share_of_its_replys_score() -> None:
    hits = HybridRanker().with_replies(_replied(), {"answer": "fact"})
    assert [h.id for h in hits] == ["answer", "fact", "other"]
    assert hits[1].score == pytest.approx(0.45 + 0.1 * 1.0)
    assert hits[1].scores["reply"] == pytest.approx(0.1)
    assert "reply" not in hits[0].scores and "reply" not in hits[2].scores
    # a turn before that is not among the hits is not added
    assert [h.id for h in HybridRanker().with_replies(_replied(), {"answer": "gone"})] == [
        "answer",
        "other",
        "fact",
    ]


@pytest.mark.parametrize(("option", "value"), REPLY_OPTIONS)
def test_every_reply_option_changes_the_answer(option: str, value: object) -> None:
    changed = dataclasses.replace(HybridRanker(reply_top=2), **{option: value})  # type: ignore[arg-type]
    base = HybridRanker(reply_top=2)
    previous = {"answer": "fact", "other": "fact"}
    # reply_top=1: only "answer" passes its share; reply_top=2: "other" too
    assert _answer(changed.with_replies(_replied(), previous)) != _answer(
        base.with_replies(_replied(), previous)
    )


@pytest.mark.parametrize(("option", "value", "base"), OPTIONS)
def test_every_option_changes_the_answer(option: str, value: object, base: HybridRanker) -> None:
    changed = dataclasses.replace(base, **{option: value})  # type: ignore[arg-type]
    # coverage is the lexical-only blend (hybrid_coverage is the one used with vectors)
    found = dataclasses.replace(_found(), vector=None) if option == "coverage" else _found()
    if option == "speaker":
        found = _dialogue("did dana say the kayak is mine")
    if option == "dated":  # the talk (40 days ago) is on the day the query names
        found = dataclasses.replace(found, query=f"is the kayak mine, {_day(TALK)}")
    if option == "unseen":
        found = _unseen_found()
    if option == "asking":
        found = _asked("is the kayak mine")
    if option == "instructing":
        found = _instructed("kayak")
    if option == "preferring":
        found = _instructed("kayak", "dana: I prefer kayak prices.")
    assert _answer(changed.rank(found)) != _answer(base.rank(found))


def test_tiered_puts_the_own_scope_first_and_flat_lets_a_better_ancestor_win() -> None:
    tiered = [h.id for h in HybridRanker().rank(_found())]
    flat = [h.id for h in HybridRanker(tiered=False).rank(_found())]
    assert tiered[0] == "local" and tiered.index("parent") > tiered.index("weak")
    assert flat[0] == "parent"


@pytest.mark.parametrize("tiered", [True, False])
def test_a_limit_returns_the_head_of_the_full_order(tiered: bool) -> None:
    """``Candidates.limit`` (recall's k) only saves building the hits past it."""
    ranker = HybridRanker(tiered=tiered)
    full = ranker.rank(_found())
    assert len(full) > 2
    head = ranker.rank(dataclasses.replace(_found(), limit=2))
    assert [(h.id, h.score, h.scores) for h in head] == [
        (h.id, h.score, h.scores) for h in full[:2]
    ]
    assert [h.id for h in ranker.order(reversed(full))] == [h.id for h in full]


def test_relative_floor_drops_what_is_far_below_the_best() -> None:
    kept = HybridRanker().rank(_found())
    floored = HybridRanker(relative_floor=0.5).rank(_found())
    top = max(h.scores["relevance"] for h in kept)
    assert "weak" in [h.id for h in kept]
    assert [h.id for h in floored] == [h.id for h in kept if h.scores["relevance"] >= 0.5 * top]
    assert "weak" not in [h.id for h in floored]


@pytest.mark.parametrize(
    ("ranker_floor", "query_floor", "admitted"),
    [
        pytest.param(0.15, None, False, id="default-floor"),
        pytest.param(0.05, None, True, id="ranker-floor"),
        pytest.param(0.15, 0.05, True, id="query-floor-overrides"),
        pytest.param(0.05, 0.15, False, id="query-floor-overrides-down"),
    ],
)
def test_a_vector_only_candidate_needs_the_floor(
    ranker_floor: float, query_floor: float | None, admitted: bool
) -> None:
    hits = HybridRanker(min_similarity=ranker_floor).rank(_found(query_floor))
    assert ("near" in [h.id for h in hits]) is admitted
    assert "weak" in [h.id for h in hits]  # under the floor too, but also a lexical match


def test_the_blend_weighs_each_side_by_how_its_best_candidates_stand_out() -> None:
    ranker = HybridRanker()
    hits = {h.id: h for h in ranker.rank(_found(0.05))}
    weight = hits["local"].scores["lexical_weight"]
    assert 0 < weight < 1 and all(h.scores["lexical_weight"] == weight for h in hits.values())
    for h in hits.values():  # a convex blend of the two sides, so comparable across queries
        lexical = (
            h.scores["lexical"]
            if "bm25" in h.scores
            else min(x.scores["lexical"] for x in hits.values() if "bm25" in x.scores)
        )  # a record the lexical side missed that shares no term counts as its weakest
        expected = weight * lexical + (1 - weight) * max(h.scores["vector"], 0.0)
        assert h.scores["relevance"] == pytest.approx(expected)
        assert 0 <= h.scores["relevance"] <= 1
    # flatten the vector side: its spread shrinks, so it counts more per unit of score
    flat = dataclasses.replace(
        _found(0.05), vector=[(r, 0.4 + s / 4) for r, s in _found().vector or ()]
    )
    assert ranker.rank(flat)[0].scores["lexical_weight"] < weight
    # the side whose best candidate stands out further gains weight (``stand_out``)
    assert HybridRanker(stand_out=0.0).rank(_found(0.05))[0].scores["lexical_weight"] != weight
    # no vector candidates: the lexical side decides alone
    alone = dataclasses.replace(_found(0.05), vector=[])
    assert {h.scores["lexical_weight"] for h in ranker.rank(alone)} == {1.0}


# found by vectors only, alike: one shares a word with the query, the other none
PADDLE = _record(Fact, "paddle", "a kayak paddle", USER, 3)
CANOE = _record(Fact, "canoe", "a red canoe", USER, 3)


def _unseen_found() -> Candidates:
    return dataclasses.replace(
        _found(),
        vector=[*(_found().vector or ()), (CANOE, 0.45), (PADDLE, 0.45)],
    )


def test_a_candidate_the_lexical_search_missed_is_scored_on_its_own_words() -> None:
    """A vector candidate that the lexical search did not return gets ``unseen`` times the
    weakest returned engine score when it shares a term with the query (it scored below that
    one), length-normalized like the others; one that shares no term counts as the lexical
    side's weakest candidate."""
    hits = {h.id: h for h in HybridRanker().rank(_unseen_found())}
    paddle, canoe = hits["paddle"], hits["canoe"]
    assert "bm25" not in canoe.scores and "coverage" not in canoe.scores
    assert canoe.scores["lexical"] == min(h.scores["lexical"] for h in hits.values())
    assert paddle.scores["coverage"] > 0 and paddle.scores["bm25"] > 0
    assert paddle.score > canoe.score  # the same cosine: the shared word decides
    # the estimate is proportional to ``unseen``, and below the weakest returned match's
    # engine score before length normalization: WEAK (3 words) and PADDLE (3 words)
    # normalize alike
    half = {h.id: h for h in HybridRanker(unseen=0.325).rank(_unseen_found())}
    assert half["paddle"].scores["bm25"] == pytest.approx(paddle.scores["bm25"] / 2)
    assert paddle.scores["bm25"] < hits["weak"].scores["bm25"]
    # off: both count as the lexical side's weakest candidate, so the cosine alone decides
    off = {h.id: h for h in HybridRanker(unseen=0.0).rank(_unseen_found())}
    assert "bm25" not in off["paddle"].scores and "bm25" not in off["canoe"].scores
    assert off["paddle"].scores["relevance"] == off["canoe"].scores["relevance"]


def _dialogue(query: str) -> Candidates:
    """Two speakers' turns with the same words (Sam's the newer), found alike by both sides."""
    terms = tuple(query.split())
    return Candidates(
        query=query,
        terms=terms,
        scope=USER,
        now=NOW,
        lexical=[(REPLY, 2.0), (TALK, 2.0), (WEAK, 0.5)],
        vector=[(REPLY, 0.6), (TALK, 0.6), (WEAK, 0.2)],
    )


@pytest.mark.parametrize(
    ("query", "first"),
    [
        pytest.param("did dana say the kayak is mine", "talk", id="names-dana"),
        pytest.param("did sam say the kayak is mine", "reply", id="names-sam"),
        pytest.param("did dana tell sam the kayak is mine", "reply", id="names-both"),
        pytest.param("is the kayak mine", "reply", id="names-none"),
    ],
)
def test_a_question_naming_a_speaker_prefers_that_speakers_turns(query: str, first: str) -> None:
    hits = HybridRanker().rank(_dialogue(query))
    assert hits[0].id == first  # ties go to the newer turn (Sam's) unless one speaker is named
    by_id = {h.id: h for h in hits}
    named = {"talk"} if "dana" in query and "sam" not in query else set()
    named |= {"reply"} if "sam" in query and "dana" not in query else set()
    for rid in ("talk", "reply"):
        assert by_id[rid].scores["speaker"] == (1.1 if rid in named else 1.0)
        assert by_id[rid].scores["relevance"] == pytest.approx(by_id["talk"].scores["relevance"])
    assert "speaker" not in by_id["weak"].scores  # a fact has no speaker


DANA_SAM = ("Dana Reyes", "sam")


@pytest.mark.parametrize(
    ("roles", "who", "named"),
    [
        pytest.param(DANA_SAM, "dana", "talk", id="one-word"),
        pytest.param(DANA_SAM, "reyes", "talk", id="surname"),
        pytest.param(DANA_SAM, "dan", "", id="three-letter-variant"),
        pytest.param(DANA_SAM, "dana tell sam", "", id="both"),
        pytest.param(("Muhhamed", "sam"), "Muhammad", "talk", id="spelling"),
        pytest.param(("Muhhamed", "sam"), "Mohammed", "talk", id="spelling2"),
        pytest.param(("Muhhamed", "sam"), "Hammed", "", id="not-first-letter"),
        pytest.param(("Akib", "sam"), "Aqib", "talk", id="four-letters"),
        pytest.param(("Akib", "sam"), "aqib", "", id="lower-case-spelling"),
        pytest.param(("user", "assistant"), "the team that used", "", id="used-not-user"),
        pytest.param(("Dana Reyes", "Sam Reyes"), "reyes", "", id="shared"),
        pytest.param(("Dana Reyes", "Sam Reyes"), "sam reyes", "reply", id="shared-full"),
        pytest.param(("Al Lee", "sam"), "al", "", id="two-letters"),
        pytest.param(("Al Lee", "sam"), "al lee", "talk", id="every-word"),
    ],
)
def test_a_speaker_is_named_by_one_word_of_the_role_or_a_close_spelling(
    roles: tuple[str, str], who: str, named: str
) -> None:
    """A word of a role that no other role has names that speaker, as do close spellings of
    it written capitalized (same first letter, four letters or more); a word shared by two
    roles names neither, and a short word only counts as the whole role."""
    found = _dialogue(f"did {who} say the kayak is mine")
    talk = TALK.model_copy(update={"role": roles[0]})
    reply = REPLY.model_copy(update={"role": roles[1]})
    found = dataclasses.replace(
        found,
        lexical=[(talk, 2.0), (reply, 2.0), (WEAK, 0.5)],
        vector=[(talk, 0.6), (reply, 0.6), (WEAK, 0.2)],
    )
    hits = {h.id: h for h in HybridRanker().rank(found)}
    for rid in ("talk", "reply"):
        assert hits[rid].scores["speaker"] == (1.1 if rid == named else 1.0), rid


def _retold(query: str, sam: str, dana: str) -> Candidates:
    """:func:`_dialogue` with Sam's (newer) turn saying ``sam`` and Dana's saying ``dana``."""
    swap = {
        REPLY.id: REPLY.model_copy(update={"text": sam}),
        TALK.id: TALK.model_copy(update={"text": dana}),
    }
    found = _dialogue(query)
    return dataclasses.replace(
        found,
        lexical=[(swap.get(r.id, r), s) for r, s in found.lexical],
        vector=[(swap.get(r.id, r), s) for r, s in found.vector or ()],
    )


def _asked(query: str) -> Candidates:
    """:func:`_dialogue` with the same words in both turns: Sam's (newer) asks, Dana's tells."""
    return _retold(query, "is the kayak mine?", "the kayak is mine.")


@pytest.mark.parametrize(
    ("text", "asking"),
    [
        pytest.param("What about you, Kate?", True, id="question"),
        pytest.param("sam: Where did you go? Was it fun?  ", True, id="two-questions"),
        pytest.param("I went to Rome. Have you been?", False, id="tells-then-asks"),
        pytest.param("Wow! Really?", False, id="exclaims-then-asks"),
        pytest.param("I sold the kayak.", False, id="tells"),
        pytest.param("is it 3.5 metres?", True, id="a-decimal-point"),
        pytest.param(
            "sam: I'm planning a week in Rome with my two kids in May, can you find us a hotel?",
            False,
            id="a-request-with-its-context",
        ),
    ],
)
def test_asks_reads_turns_that_only_ask(text: str, asking: bool) -> None:
    assert asks(text) is asking


def test_a_turn_that_only_asks_ranks_below_a_turn_that_tells() -> None:
    """Two turns with the same words: Sam's (newer) asks, Dana's tells. A tie goes to the
    newer turn, unless the asking one is lowered; its relevance (abstention) is untouched."""
    assert HybridRanker(asking=1.0).rank(_asked("is the kayak mine"))[0].id == "reply"
    hits = HybridRanker().rank(_asked("is the kayak mine"))
    by_id = {h.id: h for h in hits}
    assert hits[0].id == "talk"
    assert by_id["reply"].scores["asks"] == 0.5 and "asks" not in by_id["talk"].scores
    assert by_id["reply"].scores["relevance"] == pytest.approx(by_id["talk"].scores["relevance"])
    reply, talk = by_id["reply"], by_id["talk"]  # alike but for the factor and their age
    assert reply.score / reply.scores["recency"] == pytest.approx(
        0.5 * talk.score / talk.scores["recency"]
    )


def _day(rec: AnyRecord) -> str:
    return rec.valid_from.strftime("%d %B %Y")


@pytest.mark.parametrize(
    ("query", "days"),
    [
        pytest.param("what did she make on 29 Dec 2023?", ((2023, 12, 29),), id="day-month-year"),
        pytest.param("naps on January 6th, 2024", ((2024, 1, 6),), id="month-day-year"),
        pytest.param("where was he on 31st of december", ((None, 12, 31),), id="no-year"),
        pytest.param("the 2024-02-29 meeting", ((2024, 2, 29),), id="iso"),
        pytest.param("on 30 February", (), id="impossible"),
        pytest.param("may I ask what happened in 2024", (), id="no-day"),
        pytest.param("when did Kate visit Art Basel?", (), id="none"),
    ],
)
def test_query_days_reads_the_days_a_question_names(
    query: str, days: tuple[tuple[int | None, int, int], ...]
) -> None:
    assert query_days(query) == days


def test_a_turn_on_the_day_the_question_names_comes_first() -> None:
    """Two turns alike in every score but their day: the one on the named day (or the day
    after it, when it was told) wins; a year that does not match does not count."""
    at = TALK.valid_from
    early = TALK.model_copy(update={"id": "early", "valid_from": at - timedelta(days=3)})
    late = TALK.model_copy(update={"id": "late", "valid_from": at})

    def first(query: str) -> str:
        found = dataclasses.replace(
            _dialogue("is the kayak mine"),
            query=query,
            lexical=[(late, 2.0), (early, 2.0), (WEAK, 0.5)],
            vector=[(late, 0.6), (early, 0.6), (WEAK, 0.2)],
        )
        hits = HybridRanker().rank(found)
        return hits[0].id

    assert first("is the kayak mine") == "late"  # a tie goes to the newer turn
    assert first(f"is the kayak mine, {_day(early)}") == "early"
    told_next_day = (early.valid_from - timedelta(days=1)).strftime("%d %B")
    assert first(f"is the kayak mine, {told_next_day}") == "early"
    other_year = early.valid_from.replace(year=early.valid_from.year - 1).strftime("%d %B %Y")
    assert first(f"is the kayak mine, {other_year}") == "late"
    hit = next(h for h in HybridRanker().rank(_dialogue(f"kayak {_day(TALK)}")) if h.id == "talk")
    assert hit.scores["date"] == 1.3 and hit.scores["relevance"] <= 1


THURSDAY = date(2026, 12, 3)


def _days(*spans: tuple[int, int]) -> tuple[tuple[int, int, int], ...]:
    """Every day from THURSDAY - a to THURSDAY - b days, for each (a, b)."""
    out: list[tuple[int, int, int]] = []
    for a, b in spans:
        for back in range(a, b - 1, -1):
            d = THURSDAY - timedelta(days=back)
            out.append((d.year, d.month, d.day))
    return tuple(out)


@pytest.mark.parametrize(
    ("query", "days"),
    [
        pytest.param("what did I cook yesterday?", _days((1, 1)), id="yesterday"),
        pytest.param("and last night?", _days((1, 1)), id="last-night"),
        pytest.param("the day before yesterday", _days((2, 2)), id="day-before"),
        pytest.param("what did we plan this morning", _days((0, 0)), id="this-morning"),
        pytest.param("anything new today?", _days((0, 0)), id="today"),
        pytest.param("3 days ago", _days((3, 3)), id="days-ago"),
        pytest.param("a couple of days ago", _days((2, 2)), id="couple"),
        pytest.param("two weeks ago", _days((17, 11)), id="weeks-ago"),
        pytest.param("a month ago", _days((37, 23)), id="month-ago"),
        pytest.param("what did Sam say last Monday", _days((3, 3)), id="last-monday"),
        pytest.param("on Thursday", _days((7, 7)), id="same-weekday"),
        pytest.param("this week", _days((3, 0)), id="this-week"),
        pytest.param("last week", _days((10, 4)), id="last-week"),
        pytest.param("over the past week", _days((7, 1)), id="past-week"),
        pytest.param("what did we do last weekend", _days((5, 4)), id="last-weekend"),
        pytest.param("plans for this weekend", _days((-2, -3)), id="this-weekend"),
        pytest.param("this month", _days((2, 0)), id="this-month"),
        pytest.param("last month", _days((32, 3)), id="last-month"),
        pytest.param("what have I said recently", (), id="recently"),
        pytest.param("Monday meetings are long", (), id="bare-weekday"),
        pytest.param("what happened in 2024", (), id="a-year"),
    ],
)
def test_relative_days_counts_from_the_day_asked(
    query: str, days: tuple[tuple[int, int, int], ...]
) -> None:
    assert relative_days(query, THURSDAY) == days


def test_relative_days_stop_at_the_calendars_ends() -> None:
    """Asked in the first days of year 1 (an early ``as_of``), a day counted back past the
    calendar's start is left out instead of failing the recall."""
    early = date.min + timedelta(days=2)
    assert relative_days("what happened 999 months ago", early) == ()
    assert relative_days("last month", early) == ()
    assert relative_days("last week", early) == ()  # 1 January 1 was a Monday
    assert relative_days("this week", early) == ((1, 1, 1), (1, 1, 2), (1, 1, 3))
    assert relative_days("a week ago", early) == ()
    assert relative_days("the day before yesterday", early) == ((1, 1, 1),)
    # 31 December 9999, the last day, is a Friday: its weekend lies past the calendar
    assert relative_days("this weekend", date.max) == ()
    assert relative_days("today", date.max) == ((9999, 12, 31),)


def test_a_turn_on_a_day_named_from_today_comes_first() -> None:
    """Two turns alike in every score but their day; the question counts its day from
    ``Candidates.now`` (recall's clock, or ``as_of``): "yesterday" lifts yesterday's turn
    only, not today's (the day-after allowance is for dates, told the next morning)."""
    now = datetime(2026, 12, 3, 15, tzinfo=UTC)
    turns = {
        back: TALK.model_copy(
            update={"id": f"back-{back}", "valid_from": now - timedelta(days=back)}
        )
        for back in (0, 1, 3)
    }

    def first(query: str, at: datetime = now) -> str:
        found = dataclasses.replace(
            _dialogue("is the kayak mine"),
            query=query,
            now=to_us(at),
            lexical=[(t, 2.0) for t in turns.values()],
            vector=[(t, 0.6) for t in turns.values()],
        )
        return HybridRanker().rank(found)[0].id

    assert first("is the kayak mine") == "back-0"  # a tie goes to the newer turn
    assert first("was the kayak mine yesterday") == "back-1"
    assert first("was the kayak mine 3 days ago") == "back-3"
    assert first("was the kayak mine last Monday") == "back-3"  # 3 Dec 2026 is a Thursday
    # counted from the instant asked: asked a day later, "yesterday" is today's turn
    assert first("was the kayak mine yesterday", now + timedelta(days=1)) == "back-0"
    assert first("was the kayak mine recently") == "back-0"


def test_bm25_normalizes_length_against_the_stores_mean() -> None:
    """The store's mean length, when the backend gives one, replaces the candidates' mean:
    against a store of short records, a long candidate loses more of its engine score."""
    base = dataclasses.replace(_found(), vector=None)
    own = {h.id: h.scores["bm25"] for h in HybridRanker().rank(base)}
    short_store = {
        h.id: h.scores["bm25"]
        for h in HybridRanker().rank(dataclasses.replace(base, mean_words=1.0))
    }
    long_store = {
        h.id: h.scores["bm25"]
        for h in HybridRanker().rank(dataclasses.replace(base, mean_words=100.0))
    }
    # TALK (11 words) against PARENT (1 word): the shorter the store's records, the further
    # the long one falls behind
    assert short_store["talk"] < own["talk"] < long_store["talk"]
    assert max(short_store.values()) == max(long_store.values()) == 1.0


def test_without_vectors_relevance_is_lexical() -> None:
    found = dataclasses.replace(_found(), vector=None)
    hits = HybridRanker().rank(found)
    assert "near" not in [h.id for h in hits]
    assert all("vector" not in h.scores for h in hits)
    assert all(h.scores["relevance"] == h.scores["lexical"] for h in hits)


# -- through Memory ----------------------------------------------------------------------------
class Recording:
    """A ranker that keeps what it was given and returns the default order reversed."""

    def __init__(self) -> None:
        self.seen: list[Candidates] = []

    def rank(self, found: Candidates) -> list[Hit]:
        self.seen.append(found)
        return HybridRanker().rank(found)[::-1]


OpenMemory = Callable[..., Memory]


@pytest.fixture
def open_mem(backend_spec: str, home: Path) -> Iterator[OpenMemory]:
    """Opens lexical-only Memories on the backend under test (closed at the end)."""
    opened: list[Memory] = []

    def make(**kw: Any) -> Memory:
        opened.append(Memory(str(home), embedder=None, backend=backend_spec, **kw))
        return opened[-1]

    yield make
    for m in opened:
        m.close()


def test_default_ranking_is_the_hybrid_ranker(mem: Memory) -> None:
    assert mem.ranking == HybridRanker()


def test_a_ranking_without_rank_is_refused(home: Path) -> None:
    with pytest.raises(InvalidArgument, match="rank"):
        Memory(str(home), embedder=None, ranking="flat")  # type: ignore[arg-type]


def test_every_scope_of_a_memory_ranks_with_its_ranking(open_mem: OpenMemory) -> None:
    ranker = Recording()
    mem = open_mem(ranking=ranker)
    u = mem.scope(app="a", user="u")
    first = u.remember("kayak trip")
    second = u.remember("kayak trip on the lake with friends")
    assert [h.id for h in u.recall("kayak trip", k=2)] == [second.id, first.id]
    seen = ranker.seen[-1]
    assert (seen.query, seen.scope, seen.vector) == ("kayak trip", u.path, None)
    assert {rec.id for rec, _ in seen.lexical} == {first.id, second.id}
    assert seen.mean_words == mem.store.mean_words()  # the store's mean length, when it has one
    mem.scope_from_path(u.path).recall("kayak")
    u.fork(user="u2").recall("kayak", as_of=first.valid_from)
    assert len(ranker.seen) == 3
    assert ranker.seen[-1].now == to_us(first.valid_from)


def test_memory_ranking_changes_the_order(open_mem: OpenMemory) -> None:
    tiered, flat = open_mem(), open_mem(ranking=HybridRanker(tiered=False))
    app = tiered.scope(app="a")
    app.remember("the kayak is stored in the boathouse by the lake")
    user = tiered.scope(app="a", user="u")
    user.log("user", "my kayak", at=from_us(NOW) - timedelta(days=400))
    query = "where is the kayak stored by the lake"
    assert [h.scope for h in user.recall(query, k=2)] == [user.path, app.path]
    assert [h.scope for h in flat.scope(app="a", user="u").recall(query, k=2)] == [
        app.path,
        user.path,
    ]


@pytest.mark.parametrize("embedded", [False, True], ids=["lexical", "hybrid"])
def test_recall_prefers_the_named_speakers_turns(
    backend_spec: str, home: Path, embedded: bool
) -> None:
    """Through a real store: two speakers say the same thing; the question names one."""
    mem = Memory(str(home), embedder=HashEmbedder(64) if embedded else None, backend=backend_spec)
    try:
        u = mem.scope(app="a", user="u")
        base = from_us(NOW) - timedelta(days=2)
        # two chats (in one log, Dana's turn would take a share of Sam's as its reply)
        dana = u.log("Dana", "I finally fixed the kayak", session="d", at=base)
        sam = u.log("Sam", "I finally fixed the kayak", session="s", at=base + timedelta(hours=1))
        u.log("Sam", "the weather was fine all week", session="s", at=base + timedelta(hours=2))
        assert [h.id for h in u.recall("who fixed the kayak", k=2)] == [sam.id, dana.id]
        hits = u.recall("did Dana fix the kayak", k=2)
        assert [h.id for h in hits] == [dana.id, sam.id]
        assert hits[0].scores["speaker"] > hits[1].scores["speaker"] == 1.0
    finally:
        mem.close()


def test_previous_turns_are_the_same_sessions_visible_turn_before(
    backend_spec: str, home: Path
) -> None:
    """Through a real store: the turn before a hit is the latest earlier episode of its own
    session that the filter lets through (not another session's, not one after ``as_of``)."""
    mem = Memory(str(home), embedder=HashEmbedder(64), backend=backend_spec)
    try:
        u = mem.scope(app="a", user="u")
        base = from_us(NOW) - timedelta(days=2)
        first = u.log("user", "I use Flask 2.3 with SQLite", session="s1", at=base)
        u.log("user", "unrelated other chat", session="s2", at=base + timedelta(minutes=1))
        reply = u.log(
            "assistant", "Flask and SQLite, good", session="s1", at=base + timedelta(minutes=2)
        )
        fact = u.remember("a fact has no turn before it")
        flt = u._filter(now_us(), kinds=("fact", "episode"))
        hits = [Hit.model_construct(record=r, score=1.0, scores={}) for r in (reply, first, fact)]
        assert previous_turns(mem.store, hits, flt) == {reply.id: first.id}
        past = u._filter(now_us(), kinds=("fact", "episode"), as_of=to_us(base) - 1)
        assert previous_turns(mem.store, hits[:1], past) == {}
        # and recall runs the lookup: the turn before the best hit carries its share
        hits = u.recall("Flask and SQLite, good", k=3)
        assert hits[0].id == reply.id
        assert {h.id: h.scores.get("reply", 0.0) for h in hits}[first.id] > 0
    finally:
        mem.close()


def _instructed(query: str, dana: str = "dana: Always quote kayak prices.") -> Candidates:
    """:func:`_dialogue` with the same words in both turns: Sam's (newer) tells, Dana's
    (older) gives a standing instruction (or says ``dana``)."""
    return _retold(query, "sam: Sam quoted kayak prices.", dana)


@pytest.mark.parametrize(
    ("read", "text", "expected"),
    [
        pytest.param(
            instructs,
            "Always include version numbers when I ask about libraries.",
            True,
            id="always",
        ),
        pytest.param(instructs, "user: never use tabs", True, id="speaker-never"),
        pytest.param(instructs, "Fahim Khan: Please always copy me in", True, id="please-always"),
        pytest.param(instructs, "From now on, answer in French.", True, id="from-now-on"),
        pytest.param(instructs, "I always walk to work.", False, id="tells-a-habit"),
        pytest.param(instructs, "Alwaysbright is a shop", False, id="a-longer-word"),
        pytest.param(instructs, "sam: We never went back.", False, id="tells-a-fact"),
        pytest.param(instructs, "Fahim Khan: never heard of him", False, id="never-past-tense"),
        pytest.param(instructs, "Never mind", False, id="never-mind"),
        pytest.param(instructs, "Always a pleasure!", False, id="always-a-phrase"),
        pytest.param(instructs, "Always embed the chart.", True, id="embed-is-no-past-tense"),
        pytest.param(instructs, "Never exceed 200 words", True, id="exceed-is-no-past-tense"),
        pytest.param(instructs, "Never agreed to that", False, id="agreed-is-a-past-tense"),
        pytest.param(prefers, "I prefer e-books for their portability", True, id="prefer"),
        pytest.param(prefers, "user: so I'd rather keep it simple", True, id="rather"),
        pytest.param(prefers, "Akib: I usually prefer tea", True, id="usually"),
        pytest.param(prefers, "Would you prefer tea?", False, id="asks-the-other"),
        pytest.param(prefers, "It was rather good", False, id="rather-an-adverb"),
        pytest.param(recounts, "Have I ever used Bootstrap?", True, id="have-i"),
        pytest.param(recounts, "did I tell you about Rome?", True, id="did-i"),
        pytest.param(recounts, "Whether I ever paid the fee", True, id="i-ever"),
        pytest.param(recounts, "Summarize how my app developed", True, id="summarize"),
        pytest.param(recounts, "Give me a summary of my trips", True, id="summary"),
        pytest.param(recounts, "the order in which I brought up my trips", True, id="brought-up"),
        pytest.param(recounts, "What did we plan in our last chats?", True, id="our-chats"),
        pytest.param(recounts, "Shoe sizes across my messages?", True, id="across-my"),
        pytest.param(recounts, "How should I organize my CV?", False, id="asks-for-help"),
        pytest.param(recounts, "Plan my writing sessions for the week", False, id="sessions"),
        pytest.param(recounts, "What did Caroline paint?", False, id="asks-a-fact"),
        pytest.param(recounts, "Have Ivy and Sam met?", False, id="have-ivy"),
    ],
)
def test_instructions_preferences_and_recounting_queries_are_read(
    read: Callable[[str], bool], text: str, expected: bool
) -> None:
    assert read(text) is expected


def test_a_standing_instruction_ranks_above_a_turn_that_tells() -> None:
    """Two turns the query matches alike: the newer one wins a tie, unless the older one is a
    standing instruction; its relevance (abstention) is untouched."""
    assert HybridRanker(instructing=1.0).rank(_instructed("kayak prices"))[0].id == "reply"
    hits = HybridRanker().rank(_instructed("kayak prices"))
    by_id = {h.id: h for h in hits}
    assert hits[0].id == "talk"
    assert by_id["talk"].scores["instructs"] == 1.5 and "instructs" not in by_id["reply"].scores
    talk, reply = by_id["talk"], by_id["reply"]
    assert talk.scores["relevance"] == pytest.approx(reply.scores["relevance"])


def test_a_stated_preference_ranks_above_a_turn_that_tells() -> None:
    """As a standing instruction, by a smaller factor, and only with vectors; an instruction
    that also states a preference counts once, as an instruction."""
    found = _instructed("kayak prices", "dana: I prefer kayak prices.")
    assert HybridRanker(preferring=1.0).rank(found)[0].id == "reply"
    hits = HybridRanker().rank(found)
    by_id = {h.id: h for h in hits}
    assert hits[0].id == "talk"
    assert by_id["talk"].scores["prefers"] == 1.2 and "instructs" not in by_id["talk"].scores
    lexical_only = HybridRanker().rank(dataclasses.replace(found, vector=None))
    assert all("prefers" not in h.scores for h in lexical_only)  # with an embedder only
    both = _instructed("kayak prices", "dana: Always quote them, I prefer kayak prices.")
    talk = next(h for h in HybridRanker().rank(both) if h.id == "talk")
    assert talk.scores["instructs"] == 1.5 and "prefers" not in talk.scores


@pytest.mark.parametrize(
    "dana", ["dana: Always quote kayak prices.", "dana: I prefer kayak prices."]
)
def test_a_question_about_the_past_wants_what_happened(dana: str) -> None:
    """A query about the conversation's past (:func:`recounts`) gives standing instructions
    and stated preferences no factor: the newer turn wins the tie again."""
    assert HybridRanker().rank(_instructed("kayak prices", dana))[0].id == "talk"
    hits = HybridRanker().rank(_instructed("Have I ever seen kayak prices?", dana))
    assert hits[0].id == "reply"
    assert all("instructs" not in h.scores and "prefers" not in h.scores for h in hits)
