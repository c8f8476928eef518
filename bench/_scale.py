"""Speed at scale: batched add throughput, recall p50/p95 and context build time at N records.

The scale runs use synthetic one-line records (:func:`bench.memgen.synthetic_texts`) in a single
user scope, the worst case for one query (every record is a candidate). The ``hybrid`` mode needs
vectors for up to a million records; the real MiniLM model embeds about 0.5-1k texts/s on two
cores (15-30 minutes for 1M), so the scale runs use :class:`ProjectionEmbedder`, random
projections of hashed words to 384 dimensions: the same vector shape and the same index work
for torpor, at a fraction of the embedding cost. Model-backed throughput is measured
separately on a smaller batch (:func:`add_throughput` with the real embedder).
"""

from __future__ import annotations

import gc
import hashlib
import logging
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from bench._torpor import open_memory
from bench.memgen import synthetic_texts

__all__ = ["ProjectionEmbedder", "ScaleResult", "add_throughput", "batch_adder", "scale_run"]

log = logging.getLogger(__name__)

BATCH = 1000


class ProjectionEmbedder:
    """Bag of words through fixed random projections: fast, deterministic, 384 dimensions.

    Each distinct word gets a fixed Gaussian vector (seeded by a hash of the word); a text's
    vector is the normalized sum of its words' vectors.
    """

    name = "random-projection:384"
    dim = 384

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.rows: dict[str, int] = {}
        # row 0 stays the zero vector: short texts pad with it
        self.table = np.zeros((1024, self.dim), dtype=np.float32)

    def _row(self, w: str) -> int:
        r = self.rows.get(w)
        if r is None:
            h = int.from_bytes(hashlib.blake2b(f"{self.seed}:{w}".encode(), digest_size=8).digest())
            vec = np.random.default_rng(h).standard_normal(self.dim).astype(np.float32)
            if len(self.rows) + 1 == len(self.table):  # grow by doubling
                grown = np.zeros((2 * len(self.table), self.dim), dtype=np.float32)
                grown[: len(self.table)] = self.table
                self.table = grown
            r = self.rows[w] = len(self.rows) + 1
            self.table[r] = vec
        return r

    def embed(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        split = [t.lower().split() for t in texts]
        width = max((len(ws) for ws in split), default=0)
        idx = np.zeros((len(texts), max(width, 1)), dtype=np.int64)
        for i, ws in enumerate(split):
            idx[i, : len(ws)] = [self._row(w) for w in ws]
        out = self.table[idx].sum(axis=1)
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        norms[norms == 0] = 1.0
        result: npt.NDArray[np.float32] = out / norms
        return result


def batch_adder(scope: Any) -> Callable[[list[str]], None]:
    """The fastest way this torpor version offers to add many facts to ``scope``.

    Prefers a batch method (``remember_many`` / ``remember_batch`` / ``add_many``); falls
    back to one ``remember`` per text, which the report then calls unbatched.
    """
    for name in ("remember_many", "remember_batch", "add_many"):
        fn = getattr(scope, name, None)
        if fn is not None:
            return lambda texts, fn=fn: fn(texts)  # type: ignore[misc]

    def one_by_one(texts: list[str]) -> None:
        for t in texts:
            scope.remember(t)

    return one_by_one


def _chunks(it: Iterator[str], size: int) -> Iterator[list[str]]:
    while chunk := list(islice(it, size)):
        yield chunk


def add_throughput(n: int, embedder: Any | None, texts: Sequence[str] | None = None) -> float:
    """Records/s for adding ``n`` facts in batches of :data:`BATCH` to a fresh store.

    ``texts`` (cycled) are the records; default: synthetic ones, made before the timing.
    Pass real sentences when an embedding model does the work: its cost depends on the
    number of word pieces.
    """
    # made before the clock starts: generating a synthetic text costs about 10 us, a fifth
    # of what an add may take at the 20,000/s target
    records = [texts[i % len(texts)] for i in range(n)] if texts else list(synthetic_texts(n, 3))
    source: Iterator[str] = iter(records)
    with tempfile.TemporaryDirectory(prefix="torpor-bench-tp-") as tmp:
        mem = open_memory(Path(tmp), embedder)
        add = batch_adder(mem.scope(app="bench", user="tp"))
        t0 = time.perf_counter()
        for chunk in _chunks(source, BATCH):
            add(chunk)
        rate = n / (time.perf_counter() - t0)
        _close(mem)
    return rate


def _close(mem: Any) -> None:
    close = getattr(mem, "close", None)
    if close is not None:
        close()


@dataclass
class ScaleResult:
    """One store size in one mode."""

    mode: str
    size: int
    add_rate: float = 0.0
    recall_ms: list[float] = field(default_factory=list)
    context_ms: list[float] = field(default_factory=list)

    @staticmethod
    def _pct(xs: list[float], p: int) -> float:
        if len(xs) < 2:
            return xs[0] if xs else float("nan")
        return statistics.quantiles(xs, n=100, method="inclusive")[p - 1]

    def as_dict(self) -> dict[str, Any]:
        """Figures in ms and records/s."""
        return {
            "mode": self.mode,
            "size": self.size,
            "add_records_per_s": self.add_rate,
            "recall_p50_ms": self._pct(self.recall_ms, 50),
            "recall_p95_ms": self._pct(self.recall_ms, 95),
            "context_p50_ms": self._pct(self.context_ms, 50),
            "context_p95_ms": self._pct(self.context_ms, 95),
            "queries": len(self.recall_ms),
        }


def scale_run(size: int, mode: str, reps: int, progress: Callable[[str], None]) -> ScaleResult:
    """Fill a fresh store with ``size`` records (``mode`` = lexical or hybrid), then time
    ``reps`` recalls (k=10) and ``max(reps // 4, 5)`` context builds (300-token budget).

    Queries are three words of records spread evenly over the store (so each has matches,
    with the selectivity of real words: see :func:`bench.memgen.synthetic_texts`).
    """
    res = ScaleResult(mode, size)
    rng = random.Random(size)
    stride = max(size // reps, 1)
    queries: list[str] = []
    embedder = ProjectionEmbedder() if mode == "hybrid" else None
    with tempfile.TemporaryDirectory(prefix=f"torpor-bench-{mode}-{size}-") as tmp:
        mem = open_memory(Path(tmp), embedder)
        u = mem.scope(app="bench", user="scale")
        add = batch_adder(u)
        t0 = time.perf_counter()
        done = 0
        for chunk in _chunks(synthetic_texts(size, seed=size), BATCH):
            add(chunk)
            queries.extend(
                " ".join(rng.sample(chunk[i].split()[1:], k=3))
                for i in range(-done % stride, len(chunk), stride)
            )
            done += len(chunk)
            if done % 100_000 == 0:
                progress(f"{mode} {size:,}: {done:,} added")
        res.add_rate = size / (time.perf_counter() - t0)
        gc.collect()
        u.recall(queries[-1], k=10)  # warm: index load, caches
        for i in range(reps):
            q = queries[i % len(queries)]
            t1 = time.perf_counter()
            u.recall(q, k=10)
            res.recall_ms.append((time.perf_counter() - t1) * 1000)
        for i in range(max(reps // 4, 5)):
            q = queries[(i * 7) % len(queries)]
            t1 = time.perf_counter()
            u.context(q, budget_tokens=300)
            res.context_ms.append((time.perf_counter() - t1) * 1000)
        _close(mem)
    return res
