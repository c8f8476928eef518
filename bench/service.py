"""Benchmark memory over HTTP against the embedded store, in the same run.

Run from the repository root::

    python -m bench.service                 # 100k records, 300 recalls, 20k remembers
    python -m bench.service --quick         # 10k records: a smoke run
    python -m bench.service --baseline      # and a server without the memory fast path

A real ``torpor serve`` process (lexical only, ``--embedder none``) owns a throwaway home
holding N records (100 users of one app). The same recall queries run through the embedded
``Memory`` (this process, same files) and through ``rt.memory`` over the server's unix socket
and over TCP with a token; then ``remember_many`` batches of lexical facts go through HTTP.

Targets (issue 8): recall p50 over the local socket at most 2 ms above the embedded call at
100k records (the difference of the two p50s; the table also shows the median of the
per-query differences, each query timed through every transport in turn, which the spread
between queries does not blur); remember through HTTP, lexical only, batched, at least
1,000 records/s.
``--baseline`` starts a second server, on a copy of the home, with ``TORPOR_FAST_MEMORY=0``
(every request through FastAPI's routing, :mod:`torpor.server.fastpath` off) and interleaves it
with the others (``recall_http-socket-baseline``: always its server's first call for a query,
so compare it with the socket's "server's first" column); the table also gives each server's
CPU per recall (``/proc``; the main server's covers its socket and TCP calls alike).
Prints a table, writes ``bench/results/service.json`` and ends with PASS/FAIL per target.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench._common import write_results

console = Console(width=120)
OUT = Path(__file__).resolve().parent / "results" / "service.json"

# fmt: off
_WORDS = (
    "summary", "invoice", "garden", "travel", "lisbon", "berlin", "coffee", "meeting", "report",
    "weekly", "daily", "plan", "budget", "project", "deadline", "holiday", "music", "guitar",
    "running", "swimming", "family", "dinner", "recipe", "doctor", "dentist", "flight", "hotel",
    "train", "ticket", "birthday", "gift", "book", "movie", "series", "podcast", "kotlin",
    "python", "rust", "database", "server", "backup", "laptop", "phone", "camera", "bicycle",
    "car", "insurance", "mortgage", "salary", "bonus", "review", "promotion", "team", "manager",
    "colleague", "client", "contract",
)
# fmt: on


def _text(rng: random.Random, n: int = 8) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _p(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] * 1000


def fill(home: Path, records: int, users: int, seed: int) -> float:
    """Write ``records`` lexical facts (embedded, batched) into the home; returns seconds."""
    from torpor.memory import Memory

    rng = random.Random(seed)
    t0 = time.perf_counter()
    with Memory(str(home), embedder=None) as mem:
        per_user = records // users
        for u in range(users):
            s = mem.scope(app="bench", user=f"u{u}")
            for start in range(0, per_user, 5000):
                s.remember_many([_text(rng) for _ in range(min(5000, per_user - start))])
    return time.perf_counter() - t0


def serve(home: Path, port: int, fast: bool = True) -> subprocess.Popen[bytes]:
    """``torpor serve`` on ``home`` (socket + TCP), lexical only (``fast``: False turns the
    memory routes' fast path off, :mod:`torpor.server.fastpath`)."""
    env = {**os.environ, "TORPOR_HOME": str(home), "TORPOR_FAST_MEMORY": "1" if fast else "0"}
    env.pop("TORPOR_URL", None)
    env.pop("TORPOR_TOKEN", None)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torpor.cli",
            "serve",
            "--embedder",
            "none",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _cpu(pid: int) -> float:
    """CPU seconds (user + system, all threads) process ``pid`` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _load(avg: tuple[float, float, float]) -> str:
    return " ".join(f"{x:.1f}" for x in avg)


def time_recalls(scopes: list[Any], queries: list[str], k: int = 5) -> list[float]:
    """One recall per query (scope i % len), each timed."""
    out = []
    for i, q in enumerate(queries):
        s = scopes[i % len(scopes)]
        t0 = time.perf_counter()
        s.recall(q, k)
        out.append(time.perf_counter() - t0)
    return out


def time_remember(scope: Any, total: int, batch: int, seed: int) -> float:
    """Records per second of ``remember_many`` in batches of ``batch``."""
    rng = random.Random(seed)
    texts = [_text(rng) for _ in range(total)]
    t0 = time.perf_counter()
    for start in range(0, total, batch):
        scope.remember_many(texts[start : start + batch])
    return total / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns 0 when every target passes."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="10k records, fewer repetitions")
    p.add_argument("--records", type=int, default=None)
    p.add_argument("--reps", type=int, default=None, help="recall queries per transport")
    p.add_argument("--writes", type=int, default=None, help="records remembered over HTTP")
    p.add_argument("--batch", type=int, default=500)
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument(
        "--baseline",
        action="store_true",
        help="also a second server (a copy of the home) without the memory fast path, "
        "interleaved with the others (torpor.server.fastpath's before/after in one run)",
    )
    args = p.parse_args(argv)
    records = args.records or (10_000 if args.quick else 100_000)
    reps = args.reps or (100 if args.quick else 300)
    writes = args.writes or (5_000 if args.quick else 20_000)
    users = 100

    from torpor.client import Runtime
    from torpor.memory import Memory

    home = Path(tempfile.mkdtemp(prefix="tsb"))
    home2 = home.with_name(home.name + "-baseline")
    served = home  # the main server's home (a copy, like the baseline's, with --baseline)
    proc = proc2 = None
    load_before = os.getloadavg()
    try:
        console.print(f"filling {records:,} records ...")
        fill_s = fill(home, records, users, args.seed)
        if args.baseline:
            # both servers on copies made alike, so neither has the other's files (nor the
            # embedded store's, which reads the original)
            served = home.with_name(home.name + "-served")
            shutil.copytree(home, served)
            shutil.copytree(home, home2)
            proc2 = serve(home2, _free_port(), fast=False)
            baseline = Runtime(home=home2, autostart=False)
        port = _free_port()
        proc = serve(served, port)
        local = Runtime(home=served, autostart=False)
        for rt, server in ((local, proc), *(((baseline, proc2),) if args.baseline else ())):
            deadline = time.monotonic() + 120
            while True:
                try:
                    rt.health()
                    break
                except Exception:
                    if server.poll() is not None or time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
        token = local.tokens.create(grants=[("write", "")], name="bench").token
        tcp = Runtime(url=f"http://127.0.0.1:{port}", token=token)

        rng = random.Random(args.seed + 1)
        queries = [_text(rng, 3) for _ in range(reps)]
        names = [f"u{i}" for i in rng.sample(range(users), 20)]
        results: dict[str, Any] = {}
        with Memory(str(home), embedder=None) as mem:
            transports: dict[str, list[Any]] = {
                "embedded": [mem.scope(app="bench", user=n) for n in names],
                "http-socket": [local.memory.scope(app="bench", user=n) for n in names],
                "http-tcp": [tcp.memory.scope(app="bench", user=n) for n in names],
            }
            if args.baseline:
                transports["http-socket-baseline"] = [
                    baseline.memory.scope(app="bench", user=n) for n in names
                ]
            for scopes in transports.values():  # warm caches and connections
                time_recalls(scopes, queries[:20])
            samples: dict[str, list[float]] = {name: [] for name in transports}
            # per-query extra over the embedded call, when the transport was the server's
            # first call for that query: the server's SQLite connection has a page cache of
            # its own, which the first call warms for the second (the embedded call, in this
            # process, always starts from its own)
            first_extra: dict[str, list[float]] = {name: [] for name in transports}
            cpu_before = {p.pid: _cpu(p.pid) for p in (proc, proc2) if p is not None}
            for _ in range(3):
                # interleaved query by query: load on the shared machine hits all alike; the
                # server's two transports take turns going first
                for i, query in enumerate(queries):
                    order = ["embedded", "http-socket", "http-tcp"]
                    if i % 2:
                        order[1:] = order[:0:-1]
                    if args.baseline:  # a server of its own: always its first call
                        order.insert(1 + (i // 2) % 3, "http-socket-baseline")
                    for name in order:
                        scopes = transports[name]
                        samples[name] += time_recalls([scopes[i % len(scopes)]], [query])
                    for name in (
                        order[1] if order[1] != "http-socket-baseline" else order[2],
                        "http-socket-baseline",
                    ):
                        if name in samples:
                            first_extra[name].append(samples[name][-1] - samples["embedded"][-1])
            cpu_after = {pid: _cpu(pid) for pid in cpu_before}
        for name, s in samples.items():
            results[f"recall_{name}"] = {
                "p50_ms": statistics.median(s) * 1000,
                "p95_ms": _p(s, 0.95),
                "n": len(s),
            }
        # the same query through each transport in turn: the median of the per-query
        # differences is the transport's cost without the spread between queries
        embedded = samples["embedded"]
        # the servers' CPU per recall (the main server answers both of its transports)
        calls = 3 * len(queries)
        results["server_cpu_per_recall"] = {
            "cpu_ms": (cpu_after[proc.pid] - cpu_before[proc.pid]) / (2 * calls) * 1000
        }
        if proc2 is not None:
            results["server_cpu_per_recall_baseline"] = {
                "cpu_ms": (cpu_after[proc2.pid] - cpu_before[proc2.pid]) / calls * 1000
            }
        for name in [t for t in transports if t != "embedded"]:
            diffs = [a - b for a, b in zip(samples[name], embedded, strict=True)]
            results[f"recall_{name}"]["paired_extra_p50_ms"] = statistics.median(diffs) * 1000
            results[f"recall_{name}"]["paired_extra_first_p50_ms"] = (
                statistics.median(first_extra[name]) * 1000
            )
        rates = {}
        for name, rt in (("http-socket", local), ("http-tcp", tcp)):
            scope = rt.memory.scope(app="writes", user=name)
            rates[name] = statistics.median(
                [time_remember(scope, writes // 3, args.batch, args.seed + r) for r in range(3)]
            )
        with Memory(str(home), embedder=None) as mem:
            rates["embedded"] = statistics.median(
                [
                    time_remember(mem.scope(app="writes", user="emb"), writes // 3, args.batch, r)
                    for r in range(3)
                ]
            )
        for name, rate in rates.items():
            results[f"remember_{name}"] = {"records_per_s": rate, "batch": args.batch}
    finally:
        for server in (proc, proc2):
            if server is not None:
                server.terminate()
                try:
                    server.wait(60)
                except subprocess.TimeoutExpired:
                    server.kill()
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(home2, ignore_errors=True)
        shutil.rmtree(served, ignore_errors=True)

    load_after = os.getloadavg()
    delta = results["recall_http-socket"]["p50_ms"] - results["recall_embedded"]["p50_ms"]
    rate = results["remember_http-socket"]["records_per_s"]
    targets = [
        ("recall p50: socket minus embedded <= 2 ms", delta <= 2.0, f"{delta:.2f} ms"),
        ("remember over HTTP >= 1,000/s (lexical, batched)", rate >= 1000, f"{rate:,.0f}/s"),
    ]
    table = Table(
        "measure", "p50 ms", "p95 ms", "paired extra p50 ms", "(server's first)", "records/s", "n"
    )
    for name, row in results.items():
        table.add_row(
            name,
            f"{row['p50_ms']:.2f}"
            if "p50_ms" in row
            else (f"{row['cpu_ms']:.2f} (CPU, mean)" if "cpu_ms" in row else ""),
            f"{row['p95_ms']:.2f}" if "p95_ms" in row else "",
            f"{row['paired_extra_p50_ms']:.2f}" if "paired_extra_p50_ms" in row else "",
            f"{row['paired_extra_first_p50_ms']:.2f}" if "paired_extra_first_p50_ms" in row else "",
            f"{row['records_per_s']:,.0f}" if "records_per_s" in row else "",
            str(row.get("n", row.get("batch", ""))),
        )
    console.print(f"[bold]memory over HTTP[/] ({records:,} records, filled in {fill_s:.1f}s)")
    console.print(table)
    console.print(
        f"load average (1, 5, 15 min): {_load(load_before)} before, {_load(load_after)} after, "
        f"on {os.cpu_count()} CPUs"
    )
    for name, ok, value in targets:
        console.print(f"  {'[green]PASS' if ok else '[red]FAIL'}[/] {name}: {value}")
    write_results(
        args.out or OUT,
        {
            "records": records,
            "reps": reps,
            "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
            "load": {"before": load_before, "after": load_after},
            "results": results,
            "targets": [{"name": n, "pass": ok, "value": v} for n, ok, v in targets],
        },
    )
    return 0 if all(ok for _, ok, _ in targets) else 1


if __name__ == "__main__":
    sys.exit(main())
