"""How recall ranks what it found: the :class:`Ranker` seam and its default, :class:`HybridRanker`.

A ranker receives the :class:`Candidates` of one query (the records the backend's lexical and
vector searches found, already confined to what the caller may see) and returns the hits to
give back, best first; :func:`torpor.memory.recall.recall` keeps the first ``k``. Pass one as
``torpor.Memory(ranking=...)``; every scope that memory hands out ranks with it.

:class:`HybridRanker` scores each candidate (every factor lands in ``Hit.scores``)::

    coverage  = weighted share of the query's terms found in the text (light suffix stemming;
                a stop word weighs ``stopword`` = 0.2, any other term 1)
    bm25      = engine score * length norm / best such score among the candidates, where
                length norm = (k1 + 1) / (1 + k1 * (1 - b + b * words / mean words)),
                k1 = 1.2, b = 0.75 (BM25's), mean words = the store's (``Candidates.mean_words``)
                or, when the backend cannot tell, the candidates'
    lexical   = c * coverage + (1 - c) * bm25     (0 when not matched; c = ``coverage`` = 0.2
                without an embedder, ``hybrid_coverage`` = 0.2 with one). A vector candidate
                the lexical search did not return is scored on its own words: its coverage,
                and as engine score ``unseen`` (0.65) times the weakest returned one, when it
                shares a term with the query (its own score is below that one's; its
                ``Hit.scores["bm25"]`` is that estimate)
    vector    = cosine similarity to the query     (only with an embedder)
    relevance = lexical                            without an embedder
              = w * lexical + (1 - w) * max(vector, 0)            with one, where a candidate
                one side did not find (and, for the lexical side, that shares no term with the
                query) counts as that side's weakest candidate, and the
                query's lexical weight (``Hit.scores["lexical_weight"]``) is
                w / (1 - w) = (L / sd_lex) / (1 / sd_vec) * (z_lex / z_vec) ** p,
                L = ``lexical`` = 1.0, sd_* = the standard deviation of that side's
                candidate scores, z_* = how far that side's best candidate stands above
                the side's mean, in its standard deviations, p = ``stand_out`` = 0.5
    kind      = 1.0 for facts, 0.5 for episodes  (distilled knowledge over raw history:
                "user facts > session > raw history")
    speaker   = 1 + ``speaker`` (0.1) for an episode whose role the query names ("what did
                Caroline say ..."; all of the role's words, or a word of it no other role has,
                as is or, capitalized, closely: "Fahim" or "Fahin" for "Fahim Khan"), when the
                candidates' episodes have other roles too; else 1
    date      = 1 + ``dated`` (0.3) for a record whose ``valid_from`` falls on a day the query
                names ("on 7 Jan 2024", "January 6", "2024-01-06"; without a year, any year)
                or on the day after it (a day is often told the next morning); or on a day
                the query names from the day it is asked on (``Candidates.now``: "yesterday",
                "3 days ago", "last Monday", "this week", "last month": :func:`relative_days`;
                that day only); else 1
    asks      = ``asking`` (0.5) for an episode that only asks: at most 10 words, ending with
                "?" with no sentence ending before it ("What about you, Kate?"); else 1
    instructs = ``instructing`` (1.5) for an episode that opens with a standing instruction
                ("Always include version numbers when I ask about libraries", "Never ...",
                "From now on ..."): it governs every later request on its topic; else 1
    prefers   = ``preferring`` (1.2) for any other episode that states a preference ("I prefer
                e-books", "I'd rather ..."), with an embedder; else 1. Neither counts for a
                query about the conversation's past (:func:`recounts`: "Have I ever ...?",
                "summarize ...", "... throughout our conversations"): it wants what happened
    recency   = 1 + 0.05 * 0.5 ** (age_days / 30)
    scope     = 0.7 ** distance  (distance: 0 = the query's own scope, 1 = its parent ...)
    score     = relevance * kind * speaker * date * asks * instructs * prefers * recency
                (tiered, the default), times scope too with ``tiered=False``
    reply     = with an embedder, an episode whose next turn in its session (or, without
                one, in its scope's log) is among the first ``reply_top`` (20) hits gains
                ``reply`` (0.1) times that turn's score (:meth:`HybridRanker.with_replies`;
                recall asks the store for the turns: in time order, and turns of the same
                time in the order they were logged)

then drops what should not be returned, and orders the rest:

* **Abstention.** A candidate found only by vector search is dropped below ``min_similarity``
  (0.15, for MiniLM-like models), so an unrelated query returns nothing instead of the
  nearest noise. A hit whose relevance is 0, or under ``relative_floor`` times the best
  relevance (0 by default: off), is dropped too. ``Hit.score`` is comparable across queries,
  for a caller's own threshold.
* **Order**, as the design asks: the most specific scope first, then score, then the newest
  ``valid_from`` (``tiered``). ``tiered=False`` folds scope into the score instead, so a much
  better ancestor hit may outrank a weak local one.

Why this blend. It orders candidates exactly as the sum of the two sides' standard scores
(``(x - mean) / sd`` over each side's candidates) would, each side weighed by how far its own
best candidate stands out (the square root of the ratio of the two best standard scores), so
the side that singles out a record decides more for this query: names and rare words that
match a short turn make a peaked lexical side, a paraphrase makes a peaked vector side. On
conversations between people (REALTALK) the words decide more than on BEAM's long
user/assistant turns, where MiniLM does better: lexical 1.0 with the stand-out factor is the
weight at which the default is at or above both its parts on both sets' tuning halves.
Written as a convex blend of the raw scores, relevance keeps its absolute scale, so
``Hit.score`` stays comparable across queries (abstention thresholds, the kind prior). A side
whose candidates all score alike (spread under ``spread_floor``, e.g. only stop words matched)
gets no weight. Reciprocal rank fusion and fixed blends lost to MiniLM alone on real
conversations; the fixed 0.2/0.8 blend it replaces had been tuned on generated questions that
share few words with their answers, which rewarded the weaker retriever on real data. The
lexical side is mostly BM25 with a term frequency of 1 and the length normalized against the
whole store: a long turn contains most words of any question, so coverage alone (the old 0.8
share) and a mean taken over the candidates (the records that matched most, hence long ones)
both let long turns crowd out the short turn that answers. Coverage keeps a fifth of the score
because bm25's IDF collapses in small stores. A record only the vectors found used to count as
the lexical side's weakest candidate whatever its own words, so on BEAM a turn that MiniLM
ranked first or second often fell past the tenth place; it is now scored on its own words, with
an engine score it can only have had below the weakest returned one (0.65 of it: the dev halves'
choice, ``bench/README.md``). The reply share: on real conversations a
question often matches the answer better than the turn that holds the evidence (a user states
a fact, the reply repeats and expands it), so a turn takes a little of its reply's score; it
only reorders hits already found (relevance, hence abstention, is untouched). A short turn
that only asks holds no answer, yet a question put to memory matches other questions best
(same words, same form: MiniLM puts them close): on REALTALK such turns were 6% of the turns,
1.4% of the evidence and 11% of the default's first five hits, so their score is lowered (not
their relevance: abstention is untouched). Only short ones: a long question is a request that
carries its context ("I'm trying to ... on Python 3.11, can you help?"), which is where BEAM's
evidence is (lowering every question cost BEAM dev R@5 0.484 -> 0.340). Stop words
weigh little in coverage and only through the engine's IDF in bm25 (why they are searched at all:
:mod:`torpor.memory.recall`). The figures behind these choices (``bench/conversations.py`` on
BEAM, and ``bench/memory.py``'s generated set for abstention and supersession) are in
``bench/README.md`` ("Ranking").
"""

from __future__ import annotations

import difflib
import functools
import math
import re
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Protocol

from torpor.memory.backends.base import AnyRecord
from torpor.memory.models import Episode, Fact, Hit, path_depth, to_us

__all__ = [
    "STOPWORDS",
    "Candidates",
    "HybridRanker",
    "Ranker",
    "asks",
    "coverage",
    "instructs",
    "prefers",
    "query_days",
    "recounts",
    "relative_days",
    "stem",
    "words",
]

STOPWORDS = frozenset(
    """
    a about above after again all am an and any are as at be been before being below between
    both but by can could did do does doing down during each few for from further had has
    have having he her here hers herself him himself his how i if in into is it its itself
    just me more most my myself no nor not now of off on once only or other our ours
    ourselves out over own same she should so some such than that the their theirs them
    themselves then there these they this those through to too under until up very was we
    were what when where which while who whom why will with would you your yours yourself
    yourselves
    """.split()  # noqa: SIM905 (a word list reads better as words than as 124 quoted strings)
)

_WORD = re.compile(r"\w+", re.UNICODE)


def words(text: str) -> list[str]:
    """The word tokens of ``text``, as they are (recall lower-cases and stems them)."""
    return _WORD.findall(text)


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


_SENTENCE_END = re.compile(r"[.!](?:\s|$)")
#: a question longer than this is a request that carries its context (see the module docstring)
ASK_WORDS = 10


def asks(text: str) -> bool:
    """Whether ``text`` only asks: at most :data:`ASK_WORDS` words, ending with a question
    mark with no sentence ending before it ("Where did you go? Was it fun?" asks; "I went to
    Rome. Have you been?" tells)."""
    body = text.rstrip()
    return (
        body.endswith("?")
        and _SENTENCE_END.search(body) is None
        and text_terms(text)[0] <= ASK_WORDS
    )


#: words that, after "always" or "never", make it tell rather than instruct: a past tense
#: ("never heard of him"; "-ed", but not a verb whose own form ends so: "embed", "exceed"),
#: a state or a set phrase ("always a pleasure", "never mind")
_NOT_PAST = (
    r"embed|shred|shed|bed|wed|need|feed|heed|speed|bleed|breed|seed|weed|exceed|proceed|succeed"
)
_TELLS = (
    rf"(?!(?:{_NOT_PAST})\b)\w+ed|"
    r"said|heard|thought|knew|saw|seen|been|had|was|were|went|gone|got|did|done|told|"
    r"felt|made|came|took|found|met|left|won|lost|ate|bought|forgot|meant|mind|a|an|the|so|"
    r"such|there|here|nice|good|great|fun|happy|glad|is|are|am|has|have|do|does|i|you|we|they|"
    r"he|she|it"
)
_INSTRUCTION = re.compile(
    r"^\s*(?:[\w .'-]{1,40}:\s*)?"  # a "speaker: " prefix, as conversations are often logged
    rf"(?:please\s+)?(?:(?:always|never)\s+(?!(?:{_TELLS})\b)\w|from now on\b)",
    re.IGNORECASE,
)


def instructs(text: str) -> bool:
    """Whether ``text`` opens with a standing instruction: "Always include version numbers
    when I ask about libraries", "Never ...", "Please always ...", "From now on ..." (after
    an optional ``speaker:`` prefix). "I always walk to work" tells; it does not instruct."""
    return _INSTRUCTION.search(text) is not None


_PREFERENCE = re.compile(
    r"\bI(?:'d| would)? (?:really |much |kinda |usually |generally |always )?(?:prefer|rather)\b",
    re.IGNORECASE,
)


def prefers(text: str) -> bool:
    """Whether ``text`` states a preference of the speaker's: "I prefer e-books", "I'd
    rather ...", "I usually prefer ..." anywhere in it."""
    return _PREFERENCE.search(text) is not None


_RECOUNT = re.compile(
    r"^\s*(?:have|did|had) I\b|\bI ever\b|\bbrought up\b|\bsummar(?:y|ies|i[sz]e)|"
    r"\bour (?:\w+ )?(?:conversations?|chats?|discussions?)\b|"
    r"\b(?:across|throughout|during) (?:all )?(?:our|my|these|the) (?:\w+ )?"
    r"(?:conversations?|chats?|discussions?|sessions|messages)\b",
    re.IGNORECASE,
)


def recounts(query: str) -> bool:
    """Whether ``query`` asks about the conversation's own history rather than for help now:
    it opens with "Have I", "Did I" or "Had I", or has "I ever", "brought up", "summary" /
    "summarize", "our conversations" (chats, discussions), or "across my sessions" (throughout,
    during; messages). A standing instruction or a stated preference governs a request on its
    topic ("How should I organize my CV?"); a question about what happened ("Have I ever
    used Bootstrap?", "Summarize how my project developed") wants what happened."""
    return _RECOUNT.search(query) is not None


#: the shortest word of a speaker's role that names the speaker on its own
NAME_WORD = 3
#: how alike (:class:`difflib.SequenceMatcher` ratio) two spellings of a name must be
NAME_LIKENESS = 0.75


def name_words(role: str) -> frozenset[str]:
    """The words of a speaker's role that name the speaker on their own: lower-cased, at
    least :data:`NAME_WORD` letters, not stop words ("Fahim Khan" -> fahim, khan)."""
    return frozenset(w for w in words(role.lower()) if len(w) >= NAME_WORD and w not in STOPWORDS)


def spelled_alike(name: str, word: str) -> bool:
    """Whether ``word`` (lower-cased) is ``name`` or, both of at least four letters, a close
    spelling of it: the same first letter and a :data:`NAME_LIKENESS` likeness ("muhammad",
    "mohammed" for "muhhamed"; "aqib" for "akib"). Questions misspell the names of the
    people they ask about; a word that only looks like a name costs little, it raises that
    speaker's turns by the speaker factor."""
    if word == name:
        return True
    if len(word) < 4 or len(name) < 4 or word[0] != name[0]:
        return False
    return difflib.SequenceMatcher(None, word, name).ratio() >= NAME_LIKENESS


@functools.lru_cache(maxsize=8192)
def text_terms(text: str) -> tuple[int, frozenset[str]]:
    """How many words ``text`` has and the set of their stems. Cached: the same records come
    back query after query, and tokenizing a long turn costs more than ranking it."""
    found = words(text)
    return len(found), frozenset(stem(w) for w in found)


def coverage(terms: Sequence[str], text: str, stopword: float = 1.0) -> float:
    """The share of ``terms`` (stemmed) that occur in ``text`` (stemmed words), a stop word
    counting ``stopword`` and any other term 1."""
    weights = [stopword if t in STOPWORDS else 1.0 for t in terms]
    total = sum(weights)
    if total <= 0:
        return 0.0
    found = text_terms(text)[1]
    return sum(w for t, w in zip(terms, weights, strict=True) if stem(t) in found) / total


@dataclass(frozen=True)
class Candidates:
    """What one query found, before ranking: every record here is visible to the caller.

    ``lexical``: (record, engine score: higher is better, any positive scale), best first.
    ``vector``: (record, cosine similarity), best first; None when recall has no embedder.
    ``terms``: the terms the lexical search was given. ``scope``: the path of the scope
    asking. ``now``: the instant recency is measured from (``as_of`` when asked, in
    microseconds). ``min_similarity``: the caller's vector floor for this query, or None
    (the ranker's own). ``mean_words``: the store's mean words per record (BM25's average
    length; :meth:`~torpor.memory.backends.base.TenantStore.mean_words`), or None.
    ``limit``: how many hits the caller keeps (recall's ``k``), or None for all; a ranker may
    stop there.
    """

    query: str
    terms: tuple[str, ...]
    scope: str
    now: int
    lexical: Sequence[tuple[AnyRecord, float]]
    vector: Sequence[tuple[AnyRecord, float]] | None
    min_similarity: float | None = None
    mean_words: float | None = None
    limit: int | None = None


class Ranker(Protocol):
    """Anything that turns :class:`Candidates` into hits: the seam of recall's ranking."""

    def rank(self, found: Candidates) -> list[Hit]:
        """The hits to return, best first (recall keeps the first ``k``). It may drop
        candidates; it should not return records that are not among them."""
        ...


@dataclass(frozen=True)
class HybridRanker:
    """The default ranking (see the module docstring); each field is one of its constants."""

    coverage: float = 0.2
    stopword: float = 0.2
    bm25_k1: float = 1.2
    bm25_b: float = 0.75
    lexical: float = 1.0
    stand_out: float = 0.5
    dated: float = 0.3
    asking: float = 0.5
    instructing: float = 1.5
    preferring: float = 1.2
    hybrid_coverage: float = 0.2
    spread_floor: float = 0.01
    scope_decay: float = 0.7
    episode: float = 0.5
    speaker: float = 0.1
    recency: float = 0.05
    half_life_days: float = 30.0
    min_similarity: float = 0.15
    relative_floor: float = 0.0
    tiered: bool = True
    reply: float = 0.1
    reply_top: int = 20
    unseen: float = 0.65

    def with_replies(self, hits: Sequence[Hit], previous: dict[str, str]) -> list[Hit]:
        """``hits`` (this ranker's order) with each episode's score raised by ``reply`` times
        the score of the hit that follows it in its session, when that one is among the first
        ``reply_top`` (``previous``: a hit's id -> the id of the episode just before it, as
        the store found them), then ordered again. The share lands in ``Hit.scores["reply"]``;
        relevance is untouched (abstention does not change), and no record is added."""
        by_id = {h.id: h for h in hits}
        added: dict[str, float] = {}
        for hit in hits[: self.reply_top]:
            before = previous.get(hit.id)
            if before is not None and before in by_id:
                added[before] = added.get(before, 0.0) + self.reply * hit.score
        if not added:
            return list(hits)
        out = []
        for hit in hits:
            extra = added.get(hit.id)
            if extra is None:
                out.append(hit)
                continue
            scores = {**hit.scores, "reply": extra}
            out.append(
                Hit.model_construct(record=hit.record, score=hit.score + extra, scores=scores)
            )
        return self.order(out)

    def rank(self, found: Candidates) -> list[Hit]:
        """Score the candidates, drop the weak ones, order the rest."""
        records = {rec.id: rec for rec, _ in found.lexical}
        covered = {
            rec.id: coverage(found.terms, rec.text, self.stopword) for rec, _ in found.lexical
        }
        matched = self._unseen(found, covered)
        bm25 = self._bm25(matched, found.mean_words)
        floor = self.min_similarity if found.min_similarity is None else found.min_similarity
        vector: dict[str, float] = {}
        for rec, similarity in found.vector or ():
            vector[rec.id] = similarity
            if rec.id in records or similarity >= floor:
                records[rec.id] = rec
        share = self.coverage if found.vector is None else self.hybrid_coverage
        lexical = {rid: share * c + (1 - share) * bm25[rid] for rid, c in covered.items()}
        weight, fill_lexical, fill_vector = self._blend(lexical, vector)
        named = self._named_speakers(found.query, found.terms, records.values())
        days = query_days(found.query) if self.dated > 0 else ()
        recent = _days_back(found.query, found.now) if self.dated > 0 else frozenset()
        # standing instructions and stated preferences govern requests on their topic, not
        # questions about what happened (preferences only count with vectors)
        instructing, preferring = (
            (1.0, 1.0)
            if recounts(found.query)
            else (self.instructing, self.preferring if found.vector is not None else 1.0)
        )
        scored: list[tuple[AnyRecord, dict[str, float], float]] = []
        for rid, rec in records.items():
            scores: dict[str, float] = {"lexical": lexical.get(rid, 0.0)}
            if rid in lexical:
                scores["coverage"], scores["bm25"] = covered[rid], bm25[rid]
            if found.vector is None:
                relevance = scores["lexical"]
            else:
                scores["vector"] = vector.get(rid, fill_vector)
                scores["lexical_weight"] = weight
                relevance = weight * lexical.get(rid, fill_lexical) + (1 - weight) * max(
                    scores["vector"], 0.0
                )
            if isinstance(rec, Episode):
                scores["speaker"] = 1 + self.speaker if rec.role in named else 1.0
                if self.asking != 1.0 and asks(rec.text):
                    scores["asks"] = self.asking
                if instructing != 1.0 and instructs(rec.text):
                    scores["instructs"] = instructing
                elif preferring != 1.0 and prefers(rec.text):
                    scores["prefers"] = preferring
            if days or recent:
                on = _on_days(rec.valid_from, days, recent)
                scores["date"] = 1 + self.dated if on else 1.0
            scored.append((rec, scores, self._score(rec, found, scores, relevance)))
        top = max((sc["relevance"] for _, sc, _ in scored), default=0.0)
        kept = [
            (rec, sc, score)
            for rec, sc, score in scored
            if sc["relevance"] >= self.relative_floor * top and sc["relevance"] > 0
        ]
        # ordered before the hits are built, and only the kept ones built: most candidates
        # are not among the caller's first ``limit``
        kept.sort(key=lambda t: self._order_key(t[0], t[1], t[2]))
        return [
            Hit.model_construct(record=rec, score=score, scores=sc)
            for rec, sc, score in kept[: found.limit]
        ]

    def _unseen(
        self, found: Candidates, covered: dict[str, float]
    ) -> list[tuple[AnyRecord, float]]:
        """The lexical matches, with an engine score for each vector candidate the lexical
        search did not return that shares a term with the query: ``unseen`` times the weakest
        returned score (its own is below that one's). Fills ``covered`` with their coverage.
        One that shares no term is left out (it counts as the weakest candidate)."""
        if not found.vector or not found.lexical or self.unseen <= 0:
            return list(found.lexical)
        weakest = min(score for _, score in found.lexical)
        out = list(found.lexical)
        for rec, _ in found.vector:
            if rec.id in covered:
                continue
            c = coverage(found.terms, rec.text, self.stopword)
            if c > 0:
                covered[rec.id] = c
                out.append((rec, self.unseen * weakest))
        return out

    def _blend(
        self, lexical: dict[str, float], vector: dict[str, float]
    ) -> tuple[float, float, float]:
        """This query's lexical weight, and the scores that stand in for a side's missing
        candidate: that side's weakest candidate's (it ranked below all of them).

        The weight makes the blend order the candidates as the sum of the two sides'
        standard scores would, the lexical one weighed ``lexical`` times the ratio of the
        two sides' best standard scores to the power ``stand_out``: the side whose best
        candidates stand out from the rest counts more for this query."""
        fill_lexical = min(lexical.values(), default=0.0)
        fill_vector = min(vector.values(), default=0.0)
        lex_spread, vec_spread = _spread(lexical.values()), _spread(vector.values())
        lex_flat, vec_flat = lex_spread < self.spread_floor, vec_spread < self.spread_floor
        if not vector or (vec_flat and not lex_flat):  # the vectors tell nothing apart
            return 1.0, fill_lexical, fill_vector
        if not lexical or (lex_flat and not vec_flat):  # nor the words (stop words alone)
            return 0.0, fill_lexical, fill_vector
        if lex_flat and vec_flat:
            return 0.5, fill_lexical, fill_vector
        odds = (self.lexical / lex_spread) / (1 / vec_spread)
        if self.stand_out:
            lex_z = _stand_out(lexical.values(), lex_spread)
            vec_z = _stand_out(vector.values(), vec_spread)
            if lex_z > 0 and vec_z > 0:
                odds *= (lex_z / vec_z) ** self.stand_out
        return odds / (1 + odds), fill_lexical, fill_vector

    @staticmethod
    def _named_speakers(
        query: str, terms: Sequence[str], records: Iterable[AnyRecord]
    ) -> frozenset[str]:
        """The roles of the candidate episodes that the query names, unless it names them all:
        a question about one speaker's turns ("what did Caroline paint?") prefers that
        speaker's, one that names every speaker, or none, prefers nobody.

        A role is named when every word of it is among the query's terms, or when the query
        has one of its name words (:func:`name_words`) that no other role has, as is or, when
        the query writes it capitalized (a proper noun), spelled closely
        (:func:`spelled_alike`): real questions call "Fahim Khan" "Fahim" and "Muhhamed"
        "Muhammad". Lower-case words are matched exactly only: "used" is not "user"."""
        roles = {rec.role for rec in records if isinstance(rec, Episode)}
        if len(roles) < 2:
            return frozenset()
        asked = {t.lower() for t in terms}
        proper = {w.lower() for w in words(query) if w[0].isupper()}
        owned = {r: name_words(r) for r in roles}
        owners: dict[str, int] = {}
        for names in owned.values():
            for n in names:
                owners[n] = owners.get(n, 0) + 1
        named = frozenset(
            r
            for r in roles
            if ((w := words(r.lower())) and set(w) <= asked)
            or any(
                owners[n] == 1 and (n in asked or any(spelled_alike(n, a) for a in proper))
                for n in owned[r]
            )
        )
        return named if named != roles else frozenset()

    def order(self, hits: Iterable[Hit]) -> list[Hit]:
        """Most specific scope, then score, then newest first (``tiered``); or score first."""
        return sorted(hits, key=lambda h: self._order_key(h.record, h.scores, h.score))

    def _order_key(
        self, rec: AnyRecord, scores: dict[str, float], score: float
    ) -> tuple[float, float, int]:
        if self.tiered:
            return (scores["scope_distance"], -score, -to_us(rec.valid_from))
        return (-score, scores["scope_distance"], -to_us(rec.valid_from))

    def _bm25(
        self, found: Sequence[tuple[AnyRecord, float]], mean_words: float | None
    ) -> dict[str, float]:
        """Engine scores times BM25's length normalization, over the best of them.

        With a term frequency of 1 the normalization is one factor per record, so it applies
        on top of the engine's IDF sum. The mean length is the store's (``mean_words``) when
        the backend knows it, else the candidates' own: those are the records that matched
        the most terms, so longer than the store's typical one, which would let long records
        off lightly."""
        lengths = {rec.id: max(text_terms(rec.text)[0], 1) for rec, _ in found}
        if mean_words is not None and mean_words > 0:
            mean = mean_words
        else:
            mean = sum(lengths.values()) / len(lengths) if lengths else 1.0
        k1, b = self.bm25_k1, self.bm25_b
        normed = {
            rec.id: s * (k1 + 1) / (1 + k1 * (1 - b + b * lengths[rec.id] / mean))
            for rec, s in found
        }
        best = max(normed.values(), default=0.0)
        return {rid: s / best if best > 0 else 1.0 for rid, s in normed.items()}

    def _score(
        self, rec: AnyRecord, found: Candidates, scores: dict[str, float], relevance: float
    ) -> float:
        """The final score; fills ``scores`` with the factors."""
        distance = max(path_depth(found.scope) - path_depth(rec.scope), 0)
        age_days = max(found.now - to_us(rec.valid_from), 0) / 86_400e6
        scores["relevance"] = relevance
        scores["scope_distance"] = float(distance)
        scores["scope"] = self.scope_decay**distance
        scores["kind"] = 1.0 if isinstance(rec, Fact) else self.episode
        scores["recency"] = 1 + self.recency * 0.5 ** (age_days / self.half_life_days)
        score = relevance * scores["kind"] * scores.get("speaker", 1.0) * scores["recency"]
        score *= scores.get("date", 1.0) * scores.get("asks", 1.0)
        score *= scores.get("instructs", 1.0) * scores.get("prefers", 1.0)
        if not self.tiered:
            score *= scores["scope"]
        return score


def _stand_out(values: Collection[float], sd: float) -> float:
    """How far the best of ``values`` stands above their mean, in ``sd`` (their standard
    deviation, :func:`_spread`); 0 for fewer than two or when they are all alike."""
    return (max(values) - sum(values) / len(values)) / sd if len(values) > 1 and sd > 0 else 0.0


_MONTH_NAMES = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
_MONTHS = {m: n for n, m in enumerate(_MONTH_NAMES, 1)}
_MONTH = "(" + "|".join(_MONTH_NAMES) + r")[a-z]*\.?"
_DAY_MONTH = re.compile(
    r"\b(\d{1,2})(?:st|nd|rd|th)?\s+(?:of\s+)?" + _MONTH + r"(?:,?\s*(\d{4}))?", re.IGNORECASE
)
_MONTH_DAY = re.compile(
    r"\b" + _MONTH + r"\s+(\d{1,2})(?:st|nd|rd|th)?\b(?:,?\s*(\d{4}))?", re.IGNORECASE
)
_ISO_DAY = re.compile(r"\b(\d{4})-(\d{2})-(\d{2})\b")


@functools.lru_cache(maxsize=1024)
def query_days(query: str) -> tuple[tuple[int | None, int, int], ...]:
    """The calendar days ``query`` names, as (year or None, month, day): "7 Jan 2024",
    "January 6th", "2024-01-06". Impossible days are left out."""
    found: list[tuple[int | None, int, int]] = [
        (_year(m.group(3)), _MONTHS[m.group(2).lower()[:3]], int(m.group(1)))
        for m in _DAY_MONTH.finditer(query)
    ]
    found += [
        (_year(m.group(3)), _MONTHS[m.group(1).lower()[:3]], int(m.group(2)))
        for m in _MONTH_DAY.finditer(query)
    ]
    found += [(int(m.group(1)), int(m.group(2)), int(m.group(3))) for m in _ISO_DAY.finditer(query)]
    return tuple(d for d in dict.fromkeys(found) if _valid_day(d))


def _year(text: str | None) -> int | None:
    return int(text) if text else None


def _valid_day(day: tuple[int | None, int, int]) -> bool:
    year, month, dom = day
    try:
        date(2024 if year is None else year, month, dom)  # 2024: a leap year, for 29 Feb
    except ValueError:
        return False
    return True


_NUMBER = {"a": 1, "an": 1, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6}
_NUMBER |= {"seven": 7, "eight": 8, "nine": 9, "ten": 10, "a couple of": 2, "a few": 3}
_WEEKDAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")
_TODAY = re.compile(r"\b(?:today|tonight|this (?:morning|afternoon|evening))\b", re.IGNORECASE)
_YESTERDAY = re.compile(r"\b(?:(?:the )?day before )?yesterday\b|\blast night\b", re.IGNORECASE)
_AGO = re.compile(
    r"\b(\d{1,3}|" + "|".join(sorted(_NUMBER, key=len, reverse=True)) + r")\s+"
    r"(day|week|month)s?\s+ago\b",
    re.IGNORECASE,
)
_WEEKDAY = re.compile(r"\b(?:on|last|this past) (" + "|".join(_WEEKDAYS) + r")\b", re.IGNORECASE)
_SPAN = re.compile(r"\b(this|last|past) (weekend|week|month)\b", re.IGNORECASE)


@functools.lru_cache(maxsize=1024)
def relative_days(query: str, today: date) -> tuple[tuple[int, int, int], ...]:
    """The calendar days ``query`` names counting from ``today``, as (year, month, day):
    "today" / "this morning" / "tonight"; "yesterday" / "last night"; "the day before
    yesterday"; "3 days ago", "two weeks ago" (that day, +-3 days), "a month ago" (+-7 days);
    "on Monday" / "last Monday" (the latest Monday before today); "this week" (since Monday),
    "last week" (Monday to Sunday before it), "past week" (the 7 days before today); "this
    weekend" / "last weekend" (Saturday and Sunday of this calendar week / the one before);
    "this month", "last month". Nothing else: "recently" or "this year" name no day."""
    # each span as (first, last) days back from today, a negative one ahead of it
    spans: list[tuple[int, int]] = []
    if _TODAY.search(query):
        spans.append((0, 0))
    for m in _YESTERDAY.finditer(query):
        back = 2 if "before" in m.group(0).lower() else 1
        spans.append((back, back))
    for m in _AGO.finditer(query):
        n = _NUMBER.get(m.group(1).lower()) or int(m.group(1))
        unit = m.group(2).lower()
        mid = n * {"day": 1, "week": 7, "month": 30}[unit]
        pad = {"day": 0, "week": 3, "month": 7}[unit]
        spans.append((mid + pad, mid - pad))
    for m in _WEEKDAY.finditer(query):
        back = (today.weekday() - _WEEKDAYS.index(m.group(1).lower())) % 7 or 7
        spans.append((back, back))
    monday = today.weekday()  # days back to this week's Monday
    for m in _SPAN.finditer(query):
        which, unit = m.group(1).lower(), m.group(2).lower()
        if unit == "weekend":  # Saturday and Sunday of this calendar week, or the one before
            spans.append((monday - 5, monday - 6) if which == "this" else (monday + 2, monday + 1))
        elif unit == "week":
            spans.append(
                (monday, 0)
                if which == "this"
                else (monday + 7, monday + 1)
                if which == "last"
                else (7, 1)
            )
        elif which == "this":
            spans.append((today.day - 1, 0))
        elif today.replace(day=1) > date.min:  # last month: it ends the day before the 1st
            length = (today.replace(day=1) - timedelta(days=1)).day
            spans.append((today.day + length - 1, today.day))
    reach_back, reach_ahead = (today - date.min).days, (date.max - today).days
    days: dict[tuple[int, int, int], None] = {}
    for first, last in spans:
        for back in range(min(first, reach_back), max(last, -reach_ahead) - 1, -1):
            d = today - timedelta(days=back)
            days[(d.year, d.month, d.day)] = None
    return tuple(days)


def _days_back(query: str, now_us: int) -> frozenset[date]:
    """The days ``query`` names from the day it is asked on (:func:`relative_days`;
    ``now_us``: that instant), as dates."""
    today = datetime.fromtimestamp(now_us / 1e6, UTC).date()
    return frozenset(date(*day) for day in relative_days(query, today))


def _on_days(
    when: datetime, named: Sequence[tuple[int | None, int, int]], counted: Collection[date]
) -> bool:
    """Whether ``when`` (UTC) falls on one of ``counted`` (days counted from the asking), or
    on one of ``named`` (a year of None: any year) or the day after one."""
    day = when.astimezone(UTC).date()
    if day in counted:
        return True
    told = (day,) if day == date.min else (day, day - timedelta(days=1))
    return any(
        d.month == month and d.day == dom and (year is None or d.year == year)
        for d in told
        for year, month, dom in named
    )


def _spread(values: Iterable[float]) -> float:
    """The population standard deviation of ``values`` (0 for fewer than two)."""
    xs = list(values)
    if len(xs) < 2:
        return 0.0
    mean = sum(xs) / len(xs)
    return math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))
