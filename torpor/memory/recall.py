"""Hybrid recall: lexical and vector candidates, fused, then ranked by scope, relevance, recency.

Candidates come from the backend's lexical search (FTS5 / PostgreSQL full text) and, with an
embedder, its vector search (30+ of each). Each is scored (every factor is in ``Hit.scores``)::

    coverage  = weighted share of the query's terms found in the text (light suffix stemming;
                a stop word weighs 0.2, any other term 1)
    bm25      = engine score * length norm / best such score among the candidates, where
                length norm = (k1 + 1) / (1 + k1 * (1 - b + b * words / mean words)),
                k1 = 1.2, b = 0.75 (BM25's, over the candidates' word counts)
    lexical   = 0.8 * coverage + 0.2 * bm25                  (0 when not matched)
    vector    = cosine similarity to the query                (only with an embedder)
    relevance = 0.2 * lexical + 0.8 * max(vector, 0)          with an embedder
              = lexical                                       without one
    kind      = 1.0 for facts, 0.5 for episodes  (distilled knowledge over raw history:
                "user facts > session > raw history")
    recency   = 1 + 0.05 * 0.5 ** (age_days / 30)
    score     = relevance * kind * recency

Stop words, without an embedder, are searched, not dropped. A question is mostly function
words ("what is my ...", "who am I ..."), and when its content words are paraphrased away
they are all that links it to the statement that answers it ("My role is nurse now."):
dropping them left lexical-only recall with nothing to rank, far below plain BM25, which
keeps them and lets IDF weigh them. Here the engine's IDF weighs them in the bm25 factor and
a fixed 0.2 in coverage, so they decide only where content words tie or fail. To keep common
words off the hot path, the backend is first asked for the content words alone; stop words
are added only when that finds fewer candidates than wanted (measured at 1M records: a
query of matching content words 7 ms either way; one whose content words match nothing
30 ms, bounded by the backend's per-term cap, instead of an empty answer). With an embedder
the vectors bridge paraphrases, and stop-word matches only add noise to the lexical side, so
there the query is its content words (all words if it has no other).

This is a normalized score blend rather than reciprocal rank fusion: RRF discards how much
better one candidate is than the next, which the kind prior and callers' abstention
thresholds need. Coverage stands next to bm25 because bm25's IDF collapses in small stores.
The weights were tuned on ``bench/memory.py``'s quality set (paraphrased questions, MiniLM):
see the note at the end of this docstring.

Order, as the design asks: **the most specific scope first, then relevance, then recency**:
hits sort by scope distance (0 = the query's own scope, 1 = its parent ...), then score, then
``valid_from``. ``RankWeights(tiered=False)`` instead folds scope into the score
(``* 0.7 ** distance``), letting a much better ancestor hit outrank a weak local one.

Abstention: a candidate found only by vector search is dropped below ``min_similarity``
(0.15 by default, for MiniLM-like models), so an unrelated query returns nothing instead of
the nearest noise; ``Hit.score`` is comparable across queries for a caller's own threshold.

Tuning note (bench quality set, seed 7, 12 users, Recall@5 torpor-hybrid vs Chroma with the
same MiniLM vectors): single 1.000/0.923, multi 0.951/0.922, update 0.966/0.897, temporal
1.000/0.941, preference 0.909/0.818, abstention (balanced accuracy) 0.829/0.841. A 0.3
similarity floor and strict fact-before-episode tiers had cost half the multi-session hits.

Lexical-only (no embedder), same set, 40 users, Recall@5 single/multi/update/temporal/
preference, torpor-lexical vs plain BM25 (rank-bm25): seed 7 (tuned) 0.162/0.206/0.212/0.266/
0.475 vs 0.162/0.186/0.150/0.241/0.350; seed 11 (held out) 0.143/0.133/0.301/0.195/0.359 vs
0.143/0.128/0.214/0.195/0.205. Dropping stop words had given 0.027/0/0.071/0.089/0.250 on
seed 7. The coverage weight of a stop word (0.1-0.5) barely matters; searching them does.
Paraphrased questions share almost no content words with their answers, so both are near
their floor here: single and temporal are ties within noise, not wins.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass

from torpor.memory.backends.base import AnyRecord, RecordFilter, TenantStore
from torpor.memory.embeddings import Embedder
from torpor.memory.models import Fact, Hit, path_depth, to_us

log = logging.getLogger(__name__)

__all__ = ["STOPWORDS", "RankWeights", "query_terms", "recall"]

STOPWORDS = frozenset(
    [
        "a",
        "about",
        "above",
        "after",
        "again",
        "all",
        "am",
        "an",
        "and",
        "any",
        "are",
        "as",
        "at",
        "be",
        "been",
        "before",
        "being",
        "below",
        "between",
        "both",
        "but",
        "by",
        "can",
        "could",
        "did",
        "do",
        "does",
        "doing",
        "down",
        "during",
        "each",
        "few",
        "for",
        "from",
        "further",
        "had",
        "has",
        "have",
        "having",
        "he",
        "her",
        "here",
        "hers",
        "herself",
        "him",
        "himself",
        "his",
        "how",
        "i",
        "if",
        "in",
        "into",
        "is",
        "it",
        "its",
        "itself",
        "just",
        "me",
        "more",
        "most",
        "my",
        "myself",
        "no",
        "nor",
        "not",
        "now",
        "of",
        "off",
        "on",
        "once",
        "only",
        "or",
        "other",
        "our",
        "ours",
        "ourselves",
        "out",
        "over",
        "own",
        "same",
        "she",
        "should",
        "so",
        "some",
        "such",
        "than",
        "that",
        "the",
        "their",
        "theirs",
        "them",
        "themselves",
        "then",
        "there",
        "these",
        "they",
        "this",
        "those",
        "through",
        "to",
        "too",
        "under",
        "until",
        "up",
        "very",
        "was",
        "we",
        "were",
        "what",
        "when",
        "where",
        "which",
        "while",
        "who",
        "whom",
        "why",
        "will",
        "with",
        "would",
        "you",
        "your",
        "yours",
        "yourself",
        "yourselves",
    ]
)

_WORD = re.compile(r"\w+", re.UNICODE)


def query_terms(text: str) -> list[str]:
    """Lower-cased word tokens of ``text``, stop words included, deduplicated in order: what
    the backends' lexical search receives (see the module docstring for why stop words stay)."""
    return list(dict.fromkeys(w.lower() for w in _WORD.findall(text)))


@dataclass(frozen=True)
class RankWeights:
    """The constants of the ranking (see the module docstring)."""

    coverage: float = 0.8
    stopword: float = 0.2
    bm25_k1: float = 1.2
    bm25_b: float = 0.75
    lexical: float = 0.2
    scope_decay: float = 0.7
    episode: float = 0.5
    recency: float = 0.05
    half_life_days: float = 30.0
    min_similarity: float = 0.15
    relative_floor: float = 0.0
    tiered: bool = True


_SUFFIXES = (
    ("ies", "y"),
    ("sses", "ss"),
    ("es", ""),
    ("s", ""),
    ("ing", ""),
    ("ed", ""),
    ("ly", ""),
)


@functools.lru_cache(maxsize=65_536)
def stem(word: str) -> str:
    """A light suffix stemmer (enough to match plurals and tenses for coverage)."""
    w = word.lower()
    w = w.removesuffix("'s")
    for suffix, repl in _SUFFIXES:
        if w.endswith(suffix) and len(w) - len(suffix) >= 3:
            return w[: -len(suffix)] + repl
    return w


def coverage(terms: Sequence[str], text: str, stopword: float = 1.0) -> float:
    """The share of ``terms`` (stemmed) that occur in ``text`` (stemmed words), a stop word
    counting ``stopword`` and any other term 1."""
    weights = [stopword if t in STOPWORDS else 1.0 for t in terms]
    total = sum(weights)
    if total <= 0:
        return 0.0
    words = {stem(w) for w in _WORD.findall(text)}
    return sum(w for t, w in zip(terms, weights, strict=True) if stem(t) in words) / total


def _lexical_candidates(
    store: TenantStore, terms: list[str], flt: RecordFilter, pool: int
) -> list[tuple[AnyRecord, float]]:
    """The backend's lexical matches for ``terms``: the content words' first, and all the
    terms' only if those are fewer than ``pool`` (stop words match a large share of a big
    store, so they are searched only where the content words leave room)."""
    content = [t for t in terms if t not in STOPWORDS]
    found = store.lexical_search(content, flt, pool) if content else []
    if len(found) < pool and len(content) < len(terms):
        found = store.lexical_search(terms, flt, pool)
    return found


def _length_normed(found: list[tuple[AnyRecord, float]], weights: RankWeights) -> dict[str, float]:
    """Engine scores times BM25's length normalization (see the module docstring): with a
    term frequency of 1 it is one factor per record, so it applies on top of the engine's
    IDF sum; the mean length is the candidates' own (a record's length relative to its peers)."""
    lengths = {rec.id: max(len(_WORD.findall(rec.text)), 1) for rec, _ in found}
    mean = sum(lengths.values()) / len(lengths) if lengths else 1.0
    k1, b = weights.bm25_k1, weights.bm25_b
    return {
        rec.id: s * (k1 + 1) / (1 + k1 * (1 - b + b * lengths[rec.id] / mean)) for rec, s in found
    }


def recall(
    store: TenantStore,
    query: str,
    flt: RecordFilter,
    k: int,
    *,
    query_scope: str,
    embedder: Embedder | None,
    weights: RankWeights = RankWeights(),
    min_similarity: float | None = None,
) -> list[Hit]:
    """The ``k`` best hits for ``query`` among the records ``flt`` lets through.

    Raises what the store raises (:class:`StorageError`).
    """
    if k <= 0:
        return []
    pool = max(k * 3, 30)  # candidates per source: enough to fuse, cheap to materialize
    terms = query_terms(query)
    if embedder is not None:  # see the module docstring: stop words only without vectors
        terms = [t for t in terms if t not in STOPWORDS] or terms
    lexical = _lexical_candidates(store, terms, flt, pool)
    vector: list[tuple[AnyRecord, float]] = []
    if embedder is not None:
        qvec = embedder.embed([query])[0]
        vector = store.vector_search(qvec.tolist(), flt, pool)
    floor = weights.min_similarity if min_similarity is None else min_similarity

    records: dict[str, AnyRecord] = {}
    bm25: dict[str, float] = {}
    vec: dict[str, float] = {}
    normed = _length_normed(lexical, weights)
    best = max(normed.values(), default=0.0)
    for rec, _ in lexical:
        records[rec.id] = rec
        bm25[rec.id] = normed[rec.id] / best if best > 0 else 1.0
    for rec, s in vector:
        vec[rec.id] = s
        if rec.id not in bm25 and s < floor:
            continue
        records[rec.id] = rec

    qdepth = path_depth(query_scope)
    now = flt.as_of if flt.as_of is not None else flt.now
    scored: list[tuple[float, Hit]] = []
    for rid, rec in records.items():
        scores: dict[str, float] = {}
        if rid in bm25:
            scores["coverage"] = coverage(terms, rec.text, weights.stopword)
            scores["bm25"] = bm25[rid]
            scores["lexical"] = (
                weights.coverage * scores["coverage"] + (1 - weights.coverage) * scores["bm25"]
            )
        else:
            scores["lexical"] = 0.0
        if embedder is not None:
            scores["vector"] = vec.get(rid, 0.0)
            relevance = weights.lexical * scores["lexical"] + (1 - weights.lexical) * max(
                scores["vector"], 0.0
            )
        else:
            relevance = scores["lexical"]
        distance = max(qdepth - path_depth(rec.scope), 0)
        age_days = max(now - to_us(rec.valid_from), 0) / 86_400e6
        scores["relevance"] = relevance
        scores["scope_distance"] = float(distance)
        scores["scope"] = weights.scope_decay**distance
        scores["kind"] = 1.0 if isinstance(rec, Fact) else weights.episode
        scores["recency"] = 1 + weights.recency * 0.5 ** (age_days / weights.half_life_days)
        score = relevance * scores["kind"] * scores["recency"]
        if not weights.tiered:
            score *= scores["scope"]
        scored.append((relevance, Hit.model_construct(record=rec, score=score, scores=scores)))

    top = max((r for r, _ in scored), default=0.0)
    hits = [h for r, h in scored if r >= weights.relative_floor * top and r > 0]
    if weights.tiered:
        hits.sort(key=lambda h: (h.scores["scope_distance"], -h.score, -to_us(h.valid_from)))
    else:
        hits.sort(key=lambda h: (-h.score, h.scores["scope_distance"], -to_us(h.valid_from)))
    return hits[:k]
