"""Drive mem0 (open source) for :class:`bench.peers.Mem0Peer`, in mem0's own Python environment.

Usage: ``python _mem0_worker.py WORKDIR MODEL_PATH``; then one JSON request per stdin line,
one JSON reply per stdout line (``{"result": ...}`` or ``{"error": "..."}``). Requests:
``ping``; ``add`` with ``docs`` (id, user, text, ts, kind); ``search`` with user, query, k,
as_of (epoch seconds or null); ``quit``.

mem0 runs with ``infer=False`` (each text is stored as given, no LLM call), a local Qdrant
collection in WORKDIR and the ``huggingface`` embedder pointed at the local MiniLM copy. Its
LLM client is constructed but never called, so a dummy OpenAI key is enough.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from typing import Any


def _open(workdir: str, model: str) -> Any:
    from mem0 import Memory

    cfg = {
        "embedder": {"provider": "huggingface", "config": {"model": model, "embedding_dims": 384}},
        "vector_store": {
            "provider": "qdrant",
            "config": {
                "collection_name": "bench",
                "embedding_model_dims": 384,
                "path": os.path.join(workdir, "qdrant"),
                "on_disk": False,
            },
        },
        "history_db_path": os.path.join(workdir, "history.db"),
    }
    return Memory.from_config(cfg)


def _handle(mem: Any, req: dict[str, Any]) -> Any:
    op = req["op"]
    if op in ("ping", "quit"):
        return op
    if op == "add":
        for d in req["docs"]:
            mem.add(
                [{"role": "user", "content": d["text"]}],
                user_id=d["user"],
                infer=False,
                metadata={"gid": d["id"], "ts": d["ts"], "kind": d["kind"]},
            )
        return len(req["docs"])
    if op == "search":
        filters: dict[str, Any] = {"user_id": req["user"]}
        if req.get("as_of") is not None:
            filters["ts"] = {"lte": req["as_of"]}
        res = mem.search(req["query"], filters=filters, top_k=req["k"], threshold=0.0)
        return [[r["metadata"]["gid"], r["score"]] for r in res["results"]]
    raise ValueError(f"unknown op {op!r}")


def main() -> None:
    workdir, model = sys.argv[1], sys.argv[2]
    out = sys.stdout
    # mem0 and its libraries print progress and warnings: keep stdout for replies only
    sys.stdout = io.StringIO()
    with contextlib.redirect_stdout(sys.stdout):
        mem = _open(workdir, model)
    for line in sys.stdin:
        req = json.loads(line)
        try:
            result = _handle(mem, req)
            reply: dict[str, Any] = {"result": result}
        except Exception as exc:
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.seek(0)
        sys.stdout.truncate()
        out.write(json.dumps(reply) + "\n")
        out.flush()
        if req.get("op") == "quit":
            break


if __name__ == "__main__":
    main()
