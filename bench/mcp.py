"""MCP tool call round trip: ``recall`` over streamable HTTP against a real ``torpor serve``.

The server runs as its own process on TCP with a bearer token (as a remote deployment does),
over a throwaway home whose memory holds ``--records`` facts for one user; the client is the
official ``mcp`` SDK's. Each sample is one ``tools/call`` of ``recall`` (the server embeds the
query with the default model when it is installed, as it would for a real agent). The peer,
measured in the same run, is the same recall made on the embedded library in this process.

``--lexical`` takes the model out (the server is started with no embedding model), so what
is left is the MCP round trip itself plus a lexical recall.

Target: p50 of the MCP round trip <= 15 ms.

    python3 -m bench.mcp [--reps 200] [--records 1000] [--lexical]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from bench._common import summary, write_results

RESULTS = Path(__file__).parent / "results" / "mcp.json"  # mcp-lexical.json with --lexical
TARGET_MS = 15.0
QUERIES = ["how often should I send summaries?", "which plan is the user on?", "favourite tea"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.contextmanager
def served(home: Path, token_file: Path, lexical: bool) -> Iterator[str]:
    """``torpor serve`` on a free TCP port of 127.0.0.1; yields its MCP URL."""
    port = _free_port()
    env = {**os.environ, "TORPOR_HOME": str(home)}
    if lexical:  # no model where the server looks for one: its memory is lexical only
        env["TORPOR_EMBEDDING_MODEL"] = str(home / "no-model")
    cmd = [sys.executable, "-m", "torpor.cli", "serve", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--token-file", str(token_file), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=env)
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/v1/health").status_code == 401:
                    break  # up, and asking for a token
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.terminate()
        proc.wait(60)


def fill(home: Path, records: int, lexical: bool) -> Any:
    """``records`` facts for app support / user u-42 of tenant bench; the scope."""
    from torpor.memory import Memory

    mem = Memory(home, tenant="bench", embedder=None if lexical else "default")
    scope = mem.scope(app="support", user="u-42")
    texts = [f"note {i}: the user mentioned topic {i % 97} and item {i}" for i in range(records)]
    texts[: len(QUERIES)] = [
        "prefers daily summaries",
        "is on the Pro plan since March",
        "likes green tea",
    ]
    for start in range(0, records, 500):
        scope.remember_many(texts[start : start + 500])
    return mem, scope


async def measure(url: str, token: str, reps: int) -> list[float]:
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    samples: list[float] = []
    headers = {"Authorization": f"Bearer {token}"}
    async with (
        httpx2.AsyncClient(headers=headers, timeout=120) as http,
        Client(streamable_http_client(url, http_client=http)) as client,
    ):
        for i in range(reps + 5):
            args = {"query": QUERIES[i % len(QUERIES)], "k": 5, "app": "support", "user": "u-42"}
            t0 = time.perf_counter()
            result = await client.call_tool("recall", args)
            took = time.perf_counter() - t0
            if result.is_error:
                raise RuntimeError(f"recall failed: {result.content}")
            if i >= 5:  # the first calls load the model and warm the caches
                samples.append(took)
    return samples


def run(reps: int, records: int, lexical: bool) -> dict[str, Any]:
    from torpor.server.auth import add_token

    with tempfile.TemporaryDirectory(prefix="torpor-bench-mcp-") as tmp:
        home = Path(tmp)
        mem, scope = fill(home, records, lexical)
        embedded = []
        for i in range(reps + 5):
            t0 = time.perf_counter()
            scope.recall(QUERIES[i % len(QUERIES)], 5)
            if i >= 5:
                embedded.append(time.perf_counter() - t0)
        embedder = mem.embedder.name if mem.embedder is not None else None
        mem.close()
        token = add_token(home / "tokens.json", "bench")
        with served(home, home / "tokens.json", lexical) as url:
            over_mcp = asyncio.run(measure(url, token, reps))
    return {
        "records": records,
        "embedder": embedder,
        "mcp_recall": summary(over_mcp),
        "embedded_recall": summary(embedded),
    }


def render(result: dict[str, Any]) -> bool:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"MCP recall, {result['records']} records, embedder {result['embedder']}")
    for col in ("call", "p50 ms", "p95 ms", "min ms", "n"):
        table.add_column(col)
    for name, key in (("MCP tools/call over HTTP", "mcp_recall"), ("embedded", "embedded_recall")):
        s = result[key]
        table.add_row(
            name, f"{s['median_ms']:.2f}", f"{s['p95_ms']:.2f}", f"{s['min_ms']:.2f}", str(s["n"])
        )
    console = Console()
    console.print(table)
    p50 = float(result["mcp_recall"]["median_ms"])
    overhead = p50 - result["embedded_recall"]["median_ms"]
    console.print(f"MCP over HTTP adds {overhead:.2f} ms (p50) to the embedded recall")
    ok = p50 <= TARGET_MS
    console.print(
        f"{'PASS' if ok else 'FAIL'}: MCP recall p50 {p50:.2f} ms (target <= {TARGET_MS} ms)"
    )
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--records", type=int, default=1000)
    parser.add_argument("--lexical", action="store_true", help="no embedding model")
    args = parser.parse_args()
    result = run(args.reps, args.records, args.lexical)
    result["host"] = {
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    ok = render(result)
    result["targets"] = [
        {
            "name": "mcp_recall_p50_ms",
            "measured": result["mcp_recall"]["median_ms"],
            "target": TARGET_MS,
            "pass": ok,
        }
    ]
    write_results(RESULTS.with_stem("mcp-lexical") if args.lexical else RESULTS, result)


if __name__ == "__main__":
    main()
