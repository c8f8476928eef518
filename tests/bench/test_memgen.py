"""The retrieval-quality generator: deterministic, well-formed gold answers, every kind present."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from datetime import datetime

import pytest

from bench.memgen import (
    KINDS,
    Dataset,
    GenConfig,
    generate,
    recall_at_k,
    synthetic_texts,
)
from bench.peers import BM25Peer, Doc, tokenize


@pytest.fixture(scope="module")
def ds() -> Dataset:
    return generate(GenConfig(seed=11, users=12))


def test_same_seed_same_data() -> None:
    a = generate(GenConfig(seed=3, users=6))
    b = generate(GenConfig(seed=3, users=6))
    assert a.fingerprint() == b.fingerprint()
    assert [q.text for q in a.questions] == [q.text for q in b.questions]


def test_other_seed_other_data() -> None:
    assert (
        generate(GenConfig(seed=3, users=6)).fingerprint()
        != generate(GenConfig(seed=4, users=6)).fingerprint()
    )


def test_every_kind_is_asked(ds: Dataset) -> None:
    kinds = Counter(q.kind for q in ds.questions)
    assert set(kinds) == set(KINDS)
    assert all(kinds[k] >= 3 for k in KINDS)
    assert {q.split for q in ds.questions} == {"calib", "test"}


def test_every_answerable_question_has_gold_ids_that_exist(ds: Dataset) -> None:
    ids = {t.id for t in ds.turns} | {f.id for f in ds.facts}
    for q in ds.questions:
        if q.kind == "abstain":
            assert q.gold == () and q.gold_ids == frozenset()
            continue
        assert q.gold, q
        assert all(group for group in q.gold)
        assert q.gold_ids <= ids, q
        # gold belongs to the asker: no other user's record answers them
        assert all(i.startswith(q.user + "-") for i in q.gold_ids)


def test_abstention_questions_are_about_nothing_the_user_said(ds: Dataset) -> None:
    said = {(f.user, f.slot) for f in ds.facts}
    for q in ds.questions:
        if q.kind == "abstain":
            assert (q.user, q.slot) not in said


def test_update_gold_is_the_current_value_only(ds: Dataset) -> None:
    facts = {f.id: f for f in ds.facts}
    updates = [q for q in ds.questions if q.kind == "update"]
    assert updates
    for q in updates:
        assert q.current_fact_id is not None and q.stale_fact_ids
        cur = facts[q.current_fact_id]
        assert q.current_fact_id in q.gold_ids
        for sid in q.stale_fact_ids:
            stale = facts[sid]
            assert stale.key == cur.key and stale.at < cur.at
            assert sid not in q.gold_ids and stale.episode_id not in q.gold_ids


def test_temporal_gold_was_valid_at_the_date(ds: Dataset) -> None:
    facts = {f.id: f for f in ds.facts}
    temporal = [q for q in ds.questions if q.kind == "temporal"]
    assert temporal
    for q in temporal:
        assert q.as_of is not None
        (fid,) = [i for i in q.gold_ids if i in facts]
        gold = facts[fid]
        later = [f for f in ds.facts if f.user == q.user and f.key == gold.key and f.at > gold.at]
        assert gold.at <= q.as_of
        assert later and min(f.at for f in later) > q.as_of


def test_multi_session_gold_spans_sessions(ds: Dataset) -> None:
    facts = {f.id: f for f in ds.facts}
    for q in ds.questions:
        if q.kind == "multi":
            sessions = {facts[i].session for i in q.gold_ids if i in facts}
            assert len(q.gold) >= 2 and len(sessions) >= 2


def test_turns_are_time_ordered_within_a_user(ds: Dataset) -> None:
    by_user: dict[str, list[Doc]] = {}
    for t in ds.turns:
        by_user.setdefault(t.user, []).append(Doc(t.id, t.user, t.text, t.at, "episode"))
    for turns in by_user.values():
        assert [d.at for d in turns] == sorted(d.at for d in turns)


def test_questions_are_not_copies_of_statements(ds: Dataset) -> None:
    # wording differs: a question shares at most half of its words with its best gold record
    texts = {t.id: t.text for t in ds.turns} | {f.id: f.text for f in ds.facts}
    overlaps = []
    for q in ds.questions:
        qt = set(tokenize(q.text))
        if q.gold_ids and qt:
            overlaps.append(max(len(qt & set(tokenize(texts[i]))) / len(qt) for i in q.gold_ids))
    assert sum(overlaps) / len(overlaps) < 0.5


@pytest.mark.parametrize(
    ("ranked", "expected"),
    [
        pytest.param(["a", "x"], 0.5, id="one-of-two-groups"),
        pytest.param(["x", "b", "c"], 1.0, id="both-groups"),
        pytest.param(["x", "y", "z", "w", "v", "a"], 0.0, id="past-k"),
    ],
)
def test_recall_at_k(ranked: list[str], expected: float) -> None:
    gold = (frozenset({"a", "b"}), frozenset({"c"}))
    assert recall_at_k(ranked, gold, k=5) == expected


def test_bm25_peer_ranks_the_exact_statement_first() -> None:
    ds = generate(GenConfig(seed=5, users=2))
    peer = BM25Peer()
    peer.add([Doc(t.id, t.user, t.text, t.at, "episode") for t in ds.turns])
    target = next(t for t in ds.turns if t.role == "user")
    hits = peer.search(target.user, target.text, k=3)
    assert hits[0][0] == target.id
    when = {t.id: t.at for t in ds.turns}
    early = peer.search(target.user, "the a I my", k=50, as_of=target.at)
    assert early and all(when[i] <= target.at and i.startswith(target.user) for i, _ in early)


def test_synthetic_texts_are_deterministic() -> None:
    assert list(synthetic_texts(50, seed=2)) == list(synthetic_texts(50, seed=2))
    assert len(list(synthetic_texts(1000))) == 1000


class _Oracle:
    """A system that answers from the gold (and abstains when there is none)."""

    name = "oracle"

    def __init__(self, ds: Dataset, stale_first: bool = False) -> None:
        self.by_text = {(q.user, q.text, q.as_of): q for q in ds.questions}
        self.stale_first = stale_first

    def add(self, docs: Sequence[Doc]) -> None:
        pass

    def search(
        self, user: str, query: str, k: int, as_of: datetime | None = None
    ) -> list[tuple[str, float]]:
        q = self.by_text[(user, query, as_of)]
        ids = sorted(min(g) for g in q.gold)
        if self.stale_first and q.stale_fact_ids:
            ids = [q.stale_fact_ids[0], *ids]
        return [(i, 1.0) for i in ids[:k]]

    def close(self) -> None:
        pass


def test_scoring_an_oracle_gives_full_marks(ds: Dataset) -> None:
    from bench._quality import evaluate

    res = evaluate(_Oracle(ds), ds)
    assert all(res.recall[k] == 1.0 for k in KINDS), res.recall
    assert res.current == 1.0 and res.current_found == 1.0


def test_scoring_catches_a_stale_value_first(ds: Dataset) -> None:
    from bench._quality import evaluate

    res = evaluate(_Oracle(ds, stale_first=True), ds)
    assert res.current == 0.0
    assert res.current_found == 1.0


@pytest.mark.parametrize(
    ("answerable", "abstain", "expected"),
    [
        pytest.param([0.9, 0.8, 0.7], [0.1, 0.2], 0.7, id="separable"),
        pytest.param([0.5], [], float("-inf"), id="no-abstention-questions"),
    ],
)
def test_calibrate(answerable: list[float], abstain: list[float], expected: float) -> None:
    from bench._quality import calibrate

    assert calibrate(answerable, abstain) == expected
