"""Hybrid recall, one query at a time: terms -> candidates -> ranker -> the first ``k`` hits.

1. **Terms.** :func:`query_terms` splits the query into lower-cased words, stop words kept
   (with or without an embedder: the lexical side of hybrid recall is lexical-only recall).
2. **Candidates.** The backend's lexical search (FTS5 / PostgreSQL full text) and, with an
   embedder, its vector search each return up to ``max(3k, 30)`` records, already confined by
   the :class:`~torpor.memory.backends.base.RecordFilter` to what the caller may see
   (:class:`~torpor.memory.ranking.Candidates`). The query is embedded in a worker thread while
   the lexical search runs (the model releases the GIL) and the lexical candidates' texts are
   tokenized for the ranker; the last 256 query vectors are kept, since ``context()`` asks
   twice and agents repeat themselves. Both searches share one
   :class:`~torpor.memory.backends.base.SearchMemo`, so a record both find is built once.
3. **Ranker.** A :class:`~torpor.memory.ranking.Ranker` scores them, drops the weak ones and
   orders the rest; the default, :class:`~torpor.memory.ranking.HybridRanker`, puts the most
   specific scope first, then relevance, then recency (its formulas are in
   :mod:`torpor.memory.ranking`). Another one is passed as ``torpor.Memory(ranking=...)``.
4. **Replies.** With an embedder and the default ranker, the store is asked for the turn
   before each of the first ``reply_top`` hits (same scope and session, by ``at``, then by
   the order logged; turns logged without a session are one log of their scope), and
   :meth:`~torpor.memory.ranking.HybridRanker.with_replies` lifts those turns by a share of
   their reply's score (one indexed lookup per hit); the ranker keeps twice ``reply_top`` hits
   for it, so a turn ranked below ``reply_top`` can still rise.
5. **Reranking** (opt-in, ``torpor.Memory(reranker=...)``): a cross-encoder reorders the
   first ``depth`` hits (:mod:`torpor.memory.rerank`); the ranker keeps at least that many.
6. **The first k** of that order are the answer.

Why stop words are searched: a question is mostly function words ("what is
my ...", "who am I ..."), and when its content words are paraphrased away they are all that
links it to the statement that answers it ("My role is nurse now."). Dropping them left
lexical-only recall with nothing to rank, far below plain BM25, which keeps them and lets IDF
weigh them. They are kept off the hot path all the same: the backend is first asked for the
content words alone, and for all the words only when that finds fewer candidates than wanted,
so a query whose content words match costs what it did without stop words, and one whose
content words match nothing costs one more search, bounded by the backend's per-term cap,
instead of an empty answer. Hybrid recall used to drop stop words from its lexical side; on
real conversations keeping them measured the same with vectors and better without, so both
modes now share one lexical search. The figures behind each choice are in
``bench/README.md`` ("Ranking").
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.typing as npt

from torpor.memory.backends.base import AnyRecord, RecordFilter, SearchMemo, TenantStore
from torpor.memory.embeddings import Embedder
from torpor.memory.models import Episode, Hit
from torpor.memory.ranking import (
    STOPWORDS,
    Candidates,
    HybridRanker,
    Ranker,
    text_terms,
    words,
)
from torpor.memory.rerank import Reranker

log = logging.getLogger(__name__)

__all__ = ["STOPWORDS", "candidates", "previous_turns", "query_terms", "recall"]

DEFAULT_RANKING = HybridRanker()
#: the lexical side's candidates are this many times the vector side's: the engine orders
#: them by IDF alone, before length normalization, so the records that the normalization
#: lifts (short ones that match) must be among them
LEXICAL_POOL = 2


def query_terms(text: str) -> list[str]:
    """Lower-cased word tokens of ``text``, stop words included, deduplicated in order: what
    the backends' lexical search receives (see the module docstring for why stop words stay)."""
    return list(dict.fromkeys(w.lower() for w in words(text)))


def _lexical(
    store: TenantStore, terms: list[str], flt: RecordFilter, pool: int, memo: SearchMemo
) -> list[tuple[AnyRecord, float]]:
    """The backend's lexical matches for ``terms``: the content words' first, and all the
    terms' only if those are fewer than ``pool`` (stop words match a large share of a big
    store, so they are searched only where the content words leave room). The second search
    reuses the first one's term lookups and records through ``memo``."""
    content = [t for t in terms if t not in STOPWORDS]
    found = store.lexical_search(content, flt, pool, memo=memo) if content else []
    if len(found) < pool and len(content) < len(terms):
        found = store.lexical_search(terms, flt, pool, memo=memo)
    return found


_QUERY_CACHE_SIZE = 256
_query_vectors: OrderedDict[tuple[int, str, str], npt.NDArray[np.float32]] = OrderedDict()
_query_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def _embed_query(
    embedder: Embedder, query: str
) -> npt.NDArray[np.float32] | Future[npt.NDArray[np.float32]]:
    """The query's vector if it was embedded lately (the last :data:`_QUERY_CACHE_SIZE`
    queries: ``context()`` asks twice, agents repeat themselves), else a future of it."""
    global _pool
    key = (id(embedder), embedder.name, query)
    with _query_lock:
        vec = _query_vectors.get(key)
        if vec is not None:
            _query_vectors.move_to_end(key)
            return vec
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="torpor-embed")
    return _pool.submit(_embed_and_keep, embedder, query, key)


def _embed_and_keep(
    embedder: Embedder, query: str, key: tuple[int, str, str]
) -> npt.NDArray[np.float32]:
    vec: npt.NDArray[np.float32] = embedder.embed([query])[0]
    with _query_lock:
        _query_vectors[key] = vec
        while len(_query_vectors) > _QUERY_CACHE_SIZE:
            _query_vectors.popitem(last=False)
    return vec


def candidates(
    store: TenantStore,
    query: str,
    flt: RecordFilter,
    pool: int,
    *,
    query_scope: str,
    embedder: Embedder | None,
    min_similarity: float | None = None,
    limit: int | None = None,
) -> Candidates:
    """Up to ``pool`` lexical and ``pool`` vector matches for ``query`` under ``flt``
    (``limit``: how many hits the caller will keep, passed on to the ranker).

    Raises what the store raises (:class:`StorageError`).
    """
    terms = query_terms(query)
    memo = SearchMemo()  # this query's only: each record found is built once
    if embedder is None:
        return Candidates(
            query=query,
            terms=tuple(terms),
            scope=query_scope,
            now=flt.as_of if flt.as_of is not None else flt.now,
            lexical=_lexical(store, terms, flt, pool * LEXICAL_POOL, memo),
            vector=None,
            min_similarity=min_similarity,
            mean_words=store.mean_words(),
            limit=limit,
        )
    # the query's embedding (the slow part) runs in a worker thread while the lexical
    # search runs here: the model releases the GIL, so the two overlap
    pending = _embed_query(embedder, query)
    lexical = _lexical(store, terms, flt, pool * LEXICAL_POOL, memo)
    mean_words = store.mean_words()
    if isinstance(pending, Future):
        # still embedding: tokenize the lexical candidates for the ranker meanwhile
        # (cached per text, so the ranker's coverage and BM25 lengths find them ready)
        for rec, _ in lexical:
            if pending.done():
                break
            text_terms(rec.text)
        qvec = pending.result()
    else:
        qvec = pending
    vector = store.vector_search(qvec.tolist(), flt, pool, memo=memo)
    return Candidates(
        query=query,
        terms=tuple(terms),
        scope=query_scope,
        now=flt.as_of if flt.as_of is not None else flt.now,
        lexical=lexical,
        vector=vector,
        min_similarity=min_similarity,
        mean_words=mean_words,
        limit=limit,
    )


def recall(
    store: TenantStore,
    query: str,
    flt: RecordFilter,
    k: int,
    *,
    query_scope: str,
    embedder: Embedder | None,
    ranking: Ranker = DEFAULT_RANKING,
    min_similarity: float | None = None,
    reranker: Reranker | None = None,
) -> list[Hit]:
    """The ``k`` best hits for ``query`` among the records ``flt`` lets through, as
    ``ranking`` orders them, then ``reranker`` when there is one (``min_similarity``: this
    query's vector floor, None for the ranker's own).

    Raises what the store raises (:class:`StorageError`) and what the ranker raises.
    """
    if k <= 0:
        return []
    # candidates per source: enough to fuse, cheap to materialize; so a k above 10 reaches
    # deeper and may reorder the first hits (BEAM 100K R@5 0.536 at k=10, 0.556 at k=20;
    # a depth of 60 at every k was tried: bench/README.md, "Candidate depth, again")
    pool = max(k * 3, 30)
    # the reply share needs the default ranker and vectors (see HybridRanker.with_replies)
    replies = (
        ranking
        if isinstance(ranking, HybridRanker)
        and embedder is not None
        and ranking.reply > 0
        and ranking.reply_top > 0
        else None
    )
    found = candidates(
        store,
        query,
        flt,
        pool,
        query_scope=query_scope,
        embedder=embedder,
        min_similarity=min_similarity,
        # with the reply share, twice reply_top are kept: a turn ranked below reply_top can
        # still take its reply's share (BEAM dev R@10 0.523 -> 0.538; bench/README.md)
        limit=max(
            k if replies is None else max(k, 2 * replies.reply_top),
            reranker.depth if reranker is not None else 0,
        ),
    )
    hits = ranking.rank(found)
    if replies is not None:
        hits = replies.with_replies(hits, previous_turns(store, hits[: replies.reply_top], flt))
    if reranker is not None:
        hits = reranker.rerank(query, hits)
    return hits[:k]


def previous_turns(store: TenantStore, hits: Sequence[Hit], flt: RecordFilter) -> dict[str, str]:
    """For each episode among ``hits``: the id of the visible episode just before it in the
    same scope and session (by ``valid_from``, then the order logged; the turns without a
    session are their scope's one log), when there is one
    (:meth:`~torpor.memory.backends.base.TenantStore.previous_episodes`).

    Raises what the store raises (:class:`StorageError`)."""
    episodes = [h.record for h in hits if isinstance(h.record, Episode)]
    return store.previous_episodes(episodes, flt) if episodes else {}


def __getattr__(name: str) -> Any:
    if name == "RankWeights":
        warnings.warn(
            "torpor.memory.recall.RankWeights is deprecated: use torpor.memory.HybridRanker "
            "(the same fields), passed as torpor.Memory(ranking=...)",
            DeprecationWarning,
            stacklevel=2,
        )
        return HybridRanker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
