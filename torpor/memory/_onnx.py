"""The query path of the default embedder through ONNX Runtime: the same model, the same vectors.

A query is one short text, and PyTorch spends most of its time on it between operators (a
forward pass is a few hundred small kernels, each dispatched from Python). ONNX Runtime runs
the same graph in one call that releases the GIL, which also stops the query's embedding from
contending with the lexical search that recall runs beside it. Measured here: one query 2-2.5x
faster, identical vectors to float precision (``bench/README.md``, "Query embedding").

How it gets the graph: at first use, the locally installed sentence-transformers model
(transformer and mean pooling) is exported with ``torch.onnx`` into
``<home>/cache/onnx/<model>-<digest>.onnx`` (or ``$TORPOR_ONNX_CACHE``): a few seconds, once
per model and home; the digest covers the model's config, its weights file's size and time,
and the torch version. Nothing is downloaded. The session is then checked against PyTorch
on probe sentences and used only when the two agree (cosine >= :data:`AGREE`); batches keep
PyTorch, so stored vectors do not change.

Optional: it needs ``onnxruntime`` (and ``onnx`` for the export), the ``torpor[onnx]`` extra.
Without them, or with ``TORPOR_ONNX=0``, or for a model this does not know how to export
(a pooling other than mean), queries go through PyTorch as before.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from torpor.config import paths

log = logging.getLogger(__name__)

__all__ = ["AGREE", "INSTALL_HINT", "OnnxQueryModel", "cache_dir", "enabled"]

INSTALL_HINT = "pip install 'torpor[onnx]' (onnxruntime, onnx)"
#: the least cosine between the ONNX and the PyTorch vector of the probe for ONNX to be used
AGREE = 0.9999
_PROBE = "What did I say about the trip to Lisbon last spring, and who came along?"
_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def enabled() -> bool:
    """Whether the ONNX query path may be tried: the packages are installed and
    ``TORPOR_ONNX`` is not ``0``."""
    if os.environ.get("TORPOR_ONNX", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return importlib.util.find_spec("onnxruntime") is not None


def cache_dir() -> Path:
    """Where exported graphs are kept: ``$TORPOR_ONNX_CACHE``, else ``<home>/cache/onnx``."""
    env = os.environ.get("TORPOR_ONNX_CACHE")
    return Path(env) if env else paths().cache / "onnx"


class OnnxQueryModel:
    """One ONNX Runtime session of a sentence-transformers model (transformer + mean pooling),
    on one intra-op thread: for a handful of short texts at a time."""

    def __init__(self, st_model: Any, graph: Path) -> None:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        # one thread: a dozen tokens gain nothing from two, and a busy machine makes them wait
        opts.intra_op_num_threads = 1
        opts.inter_op_num_threads = 1
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self._session = ort.InferenceSession(str(graph), opts, providers=["CPUExecutionProvider"])
        self._st = st_model
        self._names = [i.name for i in self._session.get_inputs()]
        self.graph = graph

    def embed(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        """Mean-pooled, L2-normalized vectors of ``texts`` (tokenized by the model's own
        tokenizer, so truncation and special tokens are the model's)."""
        batch = _tokenize(self._st, texts)
        feed = {name: batch[name].numpy().astype(np.int64) for name in self._names}
        pooled = np.asarray(self._session.run(None, feed)[0], dtype=np.float32)
        norms = np.linalg.norm(pooled, axis=1, keepdims=True)
        norms[norms == 0] = 1.0
        out: npt.NDArray[np.float32] = (pooled / norms).astype(np.float32)
        return out

    @classmethod
    def load(cls, st_model: Any, model_dir: Path, cache: Path) -> OnnxQueryModel | None:
        """The session for ``st_model`` (loaded from ``model_dir``), exporting it into
        ``cache`` first if needed; None (with the reason logged) when it cannot be built or
        does not agree with PyTorch. Never raises: the caller falls back to PyTorch."""
        try:
            if not _exportable(st_model):
                log.info("ONNX query path: model %s is not transformer + mean pooling", model_dir)
                return None
            graph = cache / f"{_slug(model_dir)}-{_digest(model_dir)}.onnx"
            if not graph.exists():
                if importlib.util.find_spec("onnx") is None:
                    log.info("ONNX query path off: the export needs onnx (%s)", INSTALL_HINT)
                    return None
                _export(st_model, graph)
            model = cls(st_model, graph)
            agree = _agreement(st_model, model)
            if agree < AGREE:
                log.warning(
                    "ONNX query path off: %s disagrees with PyTorch (cosine %.6f)", graph, agree
                )
                return None
            log.info("ONNX query path on: %s (cosine %.7f to PyTorch)", graph, agree)
            return model
        except Exception:  # an optional speed-up must never break recall
            log.warning("ONNX query path off: could not build it", exc_info=True)
            return None


def _tokenize(st_model: Any, texts: Sequence[str]) -> Any:
    """``texts`` through the model's own tokenizer (``preprocess`` in newer
    sentence-transformers, ``tokenize`` before): its truncation and special tokens."""
    prepare = getattr(st_model, "preprocess", None) or st_model.tokenize
    return prepare(list(texts))


def _exportable(st_model: Any) -> bool:
    mods = list(st_model)
    if len(mods) < 2 or type(mods[0]).__name__ != "Transformer":
        return False
    if type(mods[1]).__name__ != "Pooling" or getattr(mods[1], "pooling_mode", None) != "mean":
        return False
    return all(type(m).__name__ == "Normalize" for m in mods[2:])


def _slug(model_dir: Path) -> str:
    name = model_dir.name if model_dir.name != "model" else model_dir.parent.name
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "model"


def _digest(model_dir: Path) -> str:
    """What the exported graph depends on: the model's config and weights, and torch."""
    import torch

    h = hashlib.sha256(str(model_dir.resolve()).encode())
    h.update(torch.__version__.encode())
    for path in sorted(model_dir.iterdir()):
        if path.suffix in (".json", ".txt"):
            h.update(path.name.encode() + path.read_bytes())
        elif path.is_file():
            st = path.stat()
            h.update(f"{path.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def _export(st_model: Any, graph: Path) -> None:
    """Trace the transformer and mean pooling into ``graph`` (written whole, then renamed:
    two processes exporting at once leave one good file)."""
    import torch

    transformer = st_model[0].auto_model

    class _Pooled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.transformer = transformer

        def forward(self, ids: Any, mask: Any, types: Any) -> Any:
            hidden = self.transformer(input_ids=ids, attention_mask=mask, token_type_ids=types)[0]
            weights = mask.unsqueeze(-1).to(hidden.dtype)
            return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)

    sample = _tokenize(st_model, [_PROBE, "hi"])
    args = tuple(sample[n] for n in _INPUTS)
    axes = {n: {0: "batch", 1: "tokens"} for n in _INPUTS} | {"embedding": {0: "batch"}}
    graph.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=graph.parent, suffix=".onnx.tmp")
    os.close(fd)
    try:
        import warnings

        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # the tracer's notes on constant shapes
            torch.onnx.export(
                _Pooled().eval(),
                args,
                tmp,
                input_names=list(_INPUTS),
                output_names=["embedding"],
                dynamic_axes=axes,
                opset_version=17,
                dynamo=False,
            )
        os.replace(tmp, graph)
        log.info("exported the query model to %s", graph)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _agreement(st_model: Any, model: OnnxQueryModel) -> float:
    """The least cosine between PyTorch's and ONNX's vectors of a probe batch (two lengths,
    so padding is covered too)."""
    import torch

    texts = [_PROBE, "hi", _PROBE * 12]  # the last one is truncated at the model's limit
    with torch.inference_mode():
        ref = st_model.forward(_tokenize(st_model, texts))["sentence_embedding"].float().numpy()
    ref /= np.linalg.norm(ref, axis=1, keepdims=True)
    got = model.embed(texts)
    return float((ref * got).sum(axis=1).min())
