"""The default configuration's speed: search latency with the real query embedding, and batch
ingest against the embedder's own batch throughput (issue 10's targets).

* **Search** at ~600 records in one scope (a long conversation: real sentences, embedded by
  the real MiniLM model) and at 100k records. At 100k the records carry random-projection
  vectors (:class:`bench._scale.ProjectionEmbedder`: MiniLM would need most of an hour to embed
  them here) while **every query is embedded by the real MiniLM model**, so the search path does
  exactly the default's work: one query embedding, the lexical search, the vector search over
  every record, the ranking. The same stores are also read lexical-only (``embedder=None``).
* **Ingest**: ``log_many`` of the same texts with the model as the store's embedder, against
  ``model.embed`` of those texts alone, interleaved, medians of the repetitions.
* **Single-record ingest**: the same texts logged one ``log()`` call each, from one thread
  and from several threads into one memory (what the HTTP server's thread pool does with
  concurrent requests: their embeddings share model calls, :mod:`torpor.memory._coalesce`),
  interleaved with the model alone and ``log_many``.
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from bench._scale import BATCH, ProjectionEmbedder, _chunks
from bench._torpor import open_memory
from bench.memgen import synthetic_texts

__all__ = ["QueryModelEmbedder", "ingest_ratio", "search_latency", "single_ingest"]


class QueryModelEmbedder:
    """Records through random projections, queries (single texts) through the real model."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.name = model.name
        self.dim = 384
        self.projection = ProjectionEmbedder()

    def embed(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        if len(texts) == 1:
            out: npt.NDArray[np.float32] = self.model.embed(texts)
            return out
        return self.projection.embed(texts)


def _pct(xs: list[float], q: float) -> float:
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _time_queries(scope: Any, queries: Sequence[str], k: int = 10) -> list[float]:
    scope.recall(queries[-1], k=k)  # warm: index load, caches
    out = []
    for q in queries:
        t0 = time.perf_counter()
        scope.recall(q, k=k)
        out.append((time.perf_counter() - t0) * 1000)
    return out


def search_latency(
    size: int, model: Any, sentences: Sequence[str], questions: Sequence[str], reps: int
) -> dict[str, Any]:
    """Recall (k=10) p50/p95 in ms with the default embedder and lexical-only, on one scope
    of ``size`` records (real sentences and questions below 2,000 records, else synthetic)."""
    real = size <= 2000
    embedder = model if real else QueryModelEmbedder(model)
    with tempfile.TemporaryDirectory(prefix="torpor-bench-speed-") as tmp:
        mem = open_memory(Path(tmp), embedder)
        scope = mem.scope(app="bench", user="speed")
        queries: list[str]
        if real:
            texts = [sentences[i % len(sentences)] for i in range(size)]
            scope.log_many([{"role": "user", "text": t} for t in texts])
            # distinct queries: a repeated one would be served from the query-vector cache
            queries = list(dict.fromkeys(questions))[:reps]
        else:
            queries = []
            for chunk in _chunks(iter(synthetic_texts(size, seed=size)), BATCH):
                scope.remember_many(chunk)
                queries += [" ".join(t.split()[1:4]) for t in chunk[:: max(size // reps, 1)]]
            queries = list(dict.fromkeys(queries))[:reps]
        default = _time_queries(scope, queries)
        embed_ms = []  # one query embedding alone: the floor of the default's search time
        for q in queries:
            t0 = time.perf_counter()
            model.embed([q + " ?"])  # not the cached vector recall used
            embed_ms.append((time.perf_counter() - t0) * 1000)
        mem.close()
        lex_mem = open_memory(Path(tmp), None)
        lexical = _time_queries(lex_mem.scope(app="bench", user="speed"), queries)
        lex_mem.close()
    return {
        "size": size,
        "records": "MiniLM sentences" if real else "synthetic, projection vectors",
        "queries": len(queries),
        "default_p50_ms": _pct(default, 0.5),
        "default_p95_ms": _pct(default, 0.95),
        "query_embedding_p50_ms": _pct(embed_ms, 0.5),
        "lexical_p50_ms": _pct(lexical, 0.5),
        "lexical_p95_ms": _pct(lexical, 0.95),
    }


def ingest_ratio(model: Any, texts: Sequence[str], reps: int = 3) -> dict[str, Any]:
    """Records/s of ``log_many(texts)`` with ``model`` as the embedder, and of
    ``model.embed(texts)`` alone, interleaved ``reps`` times; medians and their ratio."""
    alone, logged = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        model.embed(list(texts))
        alone.append(len(texts) / (time.perf_counter() - t0))
        with tempfile.TemporaryDirectory(prefix="torpor-bench-ingest-") as tmp:
            mem = open_memory(Path(tmp), model)
            scope = mem.scope(app="bench", user="ingest")
            scope.log_many([{"role": "user", "text": "warm"}])  # records the model, once
            t0 = time.perf_counter()
            scope.log_many([{"role": "user", "text": t} for t in texts])
            logged.append(len(texts) / (time.perf_counter() - t0))
            mem.close()
    a, b = statistics.median(alone), statistics.median(logged)
    return {
        "texts": len(texts),
        "reps": reps,
        "embedder_records_per_s": a,
        "log_many_records_per_s": b,
        "ratio": b / a,
    }


def _log_rate(model: Any, texts: Sequence[str], threads: int) -> float:
    """Records/s logging ``texts`` into a fresh memory with ``model``: one ``log_many`` when
    ``threads`` is 0, else one ``log()`` per text from ``threads`` threads (texts dealt out
    round-robin)."""
    with tempfile.TemporaryDirectory(prefix="torpor-bench-single-") as tmp:
        mem = open_memory(Path(tmp), model)
        scope = mem.scope(app="bench", user="single")
        scope.log("user", "warm")  # records the model, once
        if threads == 0:
            t0 = time.perf_counter()
            scope.log_many([{"role": "user", "text": t} for t in texts])
        else:

            def work(part: Sequence[str]) -> None:
                for text in part:
                    scope.log("user", text)

            pool = [
                threading.Thread(target=work, args=(texts[i::threads],)) for i in range(threads)
            ]
            t0 = time.perf_counter()
            for th in pool:
                th.start()
            for th in pool:
                th.join()
        rate = len(texts) / (time.perf_counter() - t0)
        mem.close()
    return rate


def single_ingest(
    model: Any, texts: Sequence[str], threads: int = 8, reps: int = 3
) -> dict[str, Any]:
    """Records/s of single ``log()`` calls from one thread and from ``threads`` threads,
    of ``log_many`` and of ``model.embed`` alone on the same texts, interleaved ``reps``
    times; medians, and each against the model's batch rate."""
    runs: dict[str, list[float]] = {"model": [], "log_many": [], "one_thread": [], "threads": []}
    for _ in range(reps):
        t0 = time.perf_counter()
        model.embed(list(texts))
        runs["model"].append(len(texts) / (time.perf_counter() - t0))
        runs["log_many"].append(_log_rate(model, texts, 0))
        runs["one_thread"].append(_log_rate(model, texts, 1))
        runs["threads"].append(_log_rate(model, texts, threads))
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {
        "texts": len(texts),
        "threads": threads,
        "reps": reps,
        "embedder_records_per_s": med["model"],
        "log_many_records_per_s": med["log_many"],
        "one_thread_log_records_per_s": med["one_thread"],
        "threads_log_records_per_s": med["threads"],
        "threads_ratio": med["threads"] / med["model"],
        "one_thread_ratio": med["one_thread"] / med["model"],
    }
