"""Compaction benchmark: what a long-paused sandbox owns on disk, and how fast it wakes.

On real QEMU with the built ``python`` template (512 MiB guest): ``--sandboxes`` sandboxes each
run a little code (an agent that changed little) and pause. For each, the bytes its paused
directory holds are measured, then it is compacted into the home's chunk store
(:mod:`torpor.sandbox.storage.compaction`) and what it owns beyond the template is measured
again (its local files plus the stored chunks that differ from the template's RAM at the same
offset). Then, ``--reps`` times, one sandbox is woken plain (the peer, same run) and compacted
(expand + wake, through the manager), and the manager's path is split: the rebuild without
fsync (template copy, store chunks: read / decompress / verify, writes), then the wake; the
durable rebuild (snapshots and forks of a compacted sandbox) adds its fsync. The load average
is printed with the numbers: on a shared machine, read the ratio to the plain wake.

    python3 -m bench.compaction                  # 3 sandboxes, 5 repetitions
    python3 -m bench.compaction --sandboxes 5 --reps 9
    python3 -m bench.compaction --cluster        # the cluster case (below)

``--cluster``: one cluster node (in process) on a throwaway PostgreSQL and SeaweedFS (started
as the tests start them). Each sandbox runs the same little code, pauses and becomes durable;
its paused directory is measured, then it is compacted the cluster's way
(:mod:`torpor.sandbox.storage.evict`: its local directory dropped) and what it owns is
measured again: local bytes (none) and the stored chunks its pause manifest names that are not
the template's (compressed, as stored). Then, ``--reps`` times, interleaved on one sandbox: a
plain same-node wake (its files kept: the peer), a wake after compaction (the pause rebuilt
from the node's chunk cache, QEMU starting meanwhile, split into the files but the RAM and
the RAM's fill), and a wake after compaction with the node's cache emptied (every chunk from
the S3 store). Results: ``bench/results/compaction_cluster.json``.

Goals (issue 9): a compacted sandbox owns <= 10 MiB beyond the template; it wakes in <= 500 ms.
Results go to ``bench/results/compaction.json``; each target prints PASS/FAIL with the ratio
measured/target (<= 1.00 passes).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import time
from pathlib import Path
from typing import Any

from bench._common import bench_home, summary, write_results

RESULTS = Path(__file__).parent / "results" / "compaction.json"
CLUSTER_RESULTS = Path(__file__).parent / "results" / "compaction_cluster.json"
MIB = 1 << 20
#: the plain wake of this guest on this machine when it is quiet (bench/README.md): the
#: 500 ms goal as a ratio to the plain wake measured in the same run holds under load too
QUIET_PLAIN_WAKE_MS = 300.0
STEPS = [
    "wake (plain)",
    "wake (compacted, through the manager)",
    "split: expand (no fsync: the wake path)",
    "  template copy (thread-summed)",
    "  store chunks: get (thread-summed)",
    "  store chunks: read (1 thread)",
    "  store chunks: decompress (1 thread)",
    "  store chunks: verify (1 thread)",
    "  write store chunks (thread-summed)",
    "split: wake after expand",
    "expand, durable (snapshot/fork path)",
    "  fsync of the rebuilt RAM + dir",
    "compact",
]


def _allocated(directory: Path) -> int:
    return sum(f.stat().st_blocks * 512 for f in directory.iterdir() if f.is_file())


def _primitives(directory: Path, store: Any) -> dict[str, float]:
    """Seconds to read, decompress and verify (sha256) what a compacted ``directory`` reads
    from the store (patches, and the chunks neither equal to the template's nor patched),
    one after the other."""
    import hashlib
    import json

    import zstandard

    body = json.loads((directory / "compacted.json").read_text())
    skip = set(body["from_template"]) | {entry[0] for entry in body.get("patches", [])}
    own = [c for i, c in enumerate(body["ram"]["chunks"]) if c and i not in skip]
    own += [entry[1] for entry in body.get("patches", [])]
    t0 = time.perf_counter()
    blobs = [store.backend.read(c) for c in own]
    t1 = time.perf_counter()
    raw = [zstandard.ZstdDecompressor().decompress(b) for b in blobs]
    t2 = time.perf_counter()
    for data in raw:
        hashlib.sha256(data).digest()
    t3 = time.perf_counter()
    return {"read": t1 - t0, "decompress": t2 - t1, "verify": t3 - t2}


async def run(sandboxes: int, reps: int, home: Path) -> dict[str, Any]:
    from torpor.config import paths
    from torpor.sandbox.manager import SandboxManager
    from torpor.sandbox.storage.compaction import MARKER, compact, owned_bytes, rebuild

    load_before = os.getloadavg()
    mgr = SandboxManager(paths(home))
    mgr.compact_after_seconds = None  # compaction here is explicit, timed
    store = mgr.chunk_store
    per: list[dict[str, Any]] = []
    samples: dict[str, list[float]] = {name: [] for name in STEPS}
    try:
        ids = []
        for i in range(sandboxes):
            info = await mgr.create(name=f"agent-{i}")
            await mgr.run_code(info.id, f"notes = [{i}] * 1000\nimport json, collections")
            await mgr.pause(info.id)
            ids.append(info.id)
        for sid in ids:
            rec = mgr.registry.get(sid)
            directory = mgr.directory(sid)
            template_ram = mgr.paths.templates / rec.template / "snapshot" / "ram"
            before = _allocated(directory)
            t0 = time.perf_counter()
            report = compact(directory, store, template_ram)
            samples["compact"].append(time.perf_counter() - t0)
            per.append(
                {
                    "sandbox": sid,
                    "paused_dir_mib": round(before / MIB, 1),
                    "owned_after_mib": round(owned_bytes(directory, store) / MIB, 2),
                    "local_after_mib": round(_allocated(directory) / MIB, 2),
                    "chunks": report.chunks,
                    "chunks_as_template": report.from_template,
                    "new_chunk_mib": round(report.new_chunk_bytes / MIB, 2),
                }
            )
        target = ids[0]
        directory = mgr.directory(target)
        rec = mgr.registry.get(target)
        template_ram = mgr.paths.templates / rec.template / "snapshot" / "ram"
        moved: dict[str, int] = {}
        for _ in range(reps):  # each round starts with the sandbox compacted
            t0 = time.perf_counter()
            await mgr.resume(target)
            samples["wake (compacted, through the manager)"].append(time.perf_counter() - t0)
            await mgr.pause(target)
            t0 = time.perf_counter()
            await mgr.resume(target)
            samples["wake (plain)"].append(time.perf_counter() - t0)
            await mgr.pause(target)

            # the manager's path, step by step: rebuild without fsync, then wake
            compact(directory, store, template_ram)
            for name, seconds in _primitives(directory, store).items():
                samples[f"  store chunks: {name} (1 thread)"].append(seconds)
            fast = rebuild(directory, store, sandbox_id=target, durable=False)
            (directory / MARKER).unlink()  # what settle does once the wake consumed the state
            t0 = time.perf_counter()
            await mgr.resume(target)
            samples["split: wake after expand"].append(time.perf_counter() - t0)
            samples["split: expand (no fsync: the wake path)"].append(fast.seconds)
            samples["  template copy (thread-summed)"].append(fast.template_seconds)
            samples["  store chunks: get (thread-summed)"].append(fast.store_seconds)
            samples["  write store chunks (thread-summed)"].append(fast.write_seconds)
            moved = {"template_bytes": fast.template_bytes, "store_bytes": fast.store_bytes}
            await mgr.pause(target)

            # the durable rebuild (snapshots and forks of a compacted sandbox): + fsync
            compact(directory, store, template_ram)
            durable = rebuild(directory, store, sandbox_id=target)
            samples["expand, durable (snapshot/fork path)"].append(durable.seconds)
            samples["  fsync of the rebuilt RAM + dir"].append(durable.sync_seconds)
            compact(directory, store, template_ram)
        ok = (await mgr.run_code(target, "len(notes)")).text == "1000"
        for sid in ids:
            await mgr.kill(sid)
    finally:
        await mgr.close(pause=False)
    load_after = os.getloadavg()
    stats = {k: summary(v) for k, v in samples.items() if v}
    worst_owned = max(p["owned_after_mib"] for p in per)
    plain = stats["wake (plain)"]["median_ms"]
    compacted = stats["wake (compacted, through the manager)"]["median_ms"]
    targets = [
        ("owned beyond the template, worst sandbox (MiB)", worst_owned, 10.0),
        ("compacted wake, median (ms)", compacted, 500.0),
        (
            "compacted wake / plain wake, same run (goal 500 ms / quiet plain wake 300 ms)",
            compacted / plain,
            500.0 / QUIET_PLAIN_WAKE_MS,
        ),
    ]
    return {
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": platform.node(),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in load_after],
        "sandboxes": per,
        "samples": stats,
        "bytes_per_expand": moved,
        "state_intact": ok,
        "store_mib": round(store.stored_bytes() / MIB, 1),
        "targets": [
            {"name": n, "measured": m, "target": t, "pass": m <= t, "ratio": m / t if t else None}
            for n, m, t in targets
        ],
    }


def _print(result: dict[str, Any]) -> None:
    print(
        f"{'sandbox':<18}{'paused dir MiB':>16}{'owned after MiB':>17}{'local MiB':>11}"
        f"{'chunks':>8}{'as template':>13}"
    )
    for p in result["sandboxes"]:
        print(
            f"{p['sandbox']:<18}{p['paused_dir_mib']:>16}{p['owned_after_mib']:>17}"
            f"{p['local_after_mib']:>11}{p['chunks']:>8}{p['chunks_as_template']:>13}"
        )
    print(
        f"chunk store: {result['store_mib']} MiB; state intact after the loop: "
        f"{result['state_intact']}; load average before {result['loadavg_before']}, "
        f"after {result['loadavg_after']}"
    )
    moved = result["bytes_per_expand"]
    if moved:
        print(
            f"one expand moves {moved['template_bytes'] / MIB:.1f} MiB from the template's RAM "
            f"and {moved['store_bytes'] / MIB:.1f} MiB from the store"
        )
    print(f"\n{'step':<48}{'median ms':>11}{'p95 ms':>9}{'n':>4}")
    for name, s in result["samples"].items():
        print(f"{name:<48}{s['median_ms']:>11.1f}{s['p95_ms']:>9.1f}{s['n']:>4}")
    print()
    for t in result["targets"]:
        verdict = "PASS" if t["pass"] else "FAIL"
        print(
            f"{verdict}  {t['name']}: {t['measured']:.2f} vs {t['target']:.2f} "
            f"(ratio {t['ratio']:.2f})"
        )


CLUSTER_STEPS = [
    "wake (cluster, plain, same node)",
    "wake (cluster, compacted, same node)",
    "  split: files but the RAM",
    "  split: RAM fill (QEMU starts meanwhile)",
    "wake (cluster, compacted, cache emptied)",
    "compact (drop the durable pause's files)",
]


async def _until_durable(mgr: Any, name: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while (await mgr.get(name)).durable is None or mgr.cluster.pushing((await mgr.get(name)).id):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} not durable after {timeout} s")
        await asyncio.sleep(0.05)


def _own_stored(manifest: dict[str, Any], sizes: dict[str, int]) -> tuple[int, int]:
    """(stored bytes, chunks) a pause manifest names beyond the template's RAM chunks."""
    from_template = set(manifest.get("from_template") or [])
    own: set[str] = set()
    for rel, fm in manifest["files"].items():
        for i, digest in enumerate(fm["chunks"]):
            if digest is not None and not (rel == "ram" and i in from_template):
                own.add(digest)
    for fm in (manifest.get("volumes") or {}).values():
        own.update(d for d in fm["chunks"] if d is not None)
    return sum(sizes.get(d, 0) for d in own), len(own)


async def run_cluster(
    sandboxes: int, reps: int, base: Path, dsn: str, store: str
) -> dict[str, Any]:
    from torpor.config import paths
    from torpor.sandbox.manager import SandboxManager
    from torpor.sandbox.manager.cluster import ClusterConfig
    from torpor.sandbox.storage.evict import allocated

    load_before = os.getloadavg()
    home = base / "n1"
    home.mkdir()
    (home / "templates").symlink_to(paths().templates.resolve())
    config = ClusterConfig(dsn=dsn, store=store, node="n1", url="http://n1")
    mgr = SandboxManager(paths(home), cluster=config)
    mgr.compact_after_seconds = None  # compaction here is explicit, timed
    cluster = mgr.cluster
    assert cluster is not None
    fills: list[Any] = []
    inner = cluster.begin_rebuild

    def timed(*args: Any) -> Any:
        job = inner(*args)
        fills.append(job)
        return job

    cluster.begin_rebuild = timed  # type: ignore[method-assign,assignment]
    samples: dict[str, list[float]] = {name: [] for name in CLUSTER_STEPS}
    per: list[dict[str, Any]] = []

    async def compacted(name: str) -> None:
        mgr.compact_after_seconds = 0.0
        try:
            t0 = time.perf_counter()
            done = await mgr.compact_sweep()
            samples["compact (drop the durable pause's files)"].append(time.perf_counter() - t0)
        finally:
            mgr.compact_after_seconds = None
        if len(done) != 1:
            raise RuntimeError(f"{name} was not compacted: {done}")

    await mgr.start(supervise=False)
    try:
        ids = []
        for i in range(sandboxes):
            info = await mgr.create(name=f"agent-{i}")
            await mgr.run_code(info.id, f"notes = [{i}] * 1000\nimport json, collections")
            await mgr.pause(info.id)
            await _until_durable(mgr, info.id)
            ids.append(info.id)
        sizes = {e.digest: e.size for e in cluster.chunks.backend.entries()}
        for sid in ids:
            directory = mgr.directory(sid)
            before = allocated(directory)
            await compacted(sid)
            pause = cluster.registry.pause_record(sid)
            assert pause is not None and pause.manifest is not None
            stored, chunks = _own_stored(pause.manifest, sizes)
            per.append(
                {
                    "sandbox": sid,
                    "paused_dir_mib": round(before / MIB, 1),
                    "local_after_mib": round(allocated(directory) / MIB, 2),
                    "stored_beyond_template_mib": round(stored / MIB, 2),
                    "owned_after_mib": round((allocated(directory) + stored) / MIB, 2),
                    "chunks_beyond_template": chunks,
                    "ram_chunks_as_template": len(pause.manifest.get("from_template") or []),
                }
            )
        target = ids[0]
        cache = getattr(cluster.chunks.backend, "cache", None)
        for _ in range(reps):  # each round starts with the sandbox compacted
            fills.clear()
            t0 = time.perf_counter()
            await mgr.resume(target)
            samples["wake (cluster, compacted, same node)"].append(time.perf_counter() - t0)
            (fill,) = fills
            samples["  split: files but the RAM"].append(fill.begin_seconds)
            samples["  split: RAM fill (QEMU starts meanwhile)"].append(fill.seconds)
            await mgr.pause(target)
            await _until_durable(mgr, target)
            t0 = time.perf_counter()
            await mgr.resume(target)
            samples["wake (cluster, plain, same node)"].append(time.perf_counter() - t0)
            await mgr.pause(target)
            await _until_durable(mgr, target)
            await compacted(target)
            if cache is not None:
                for blob in list(cache.root.glob("*/*.zst")):
                    cache.drop(blob.stem)
            t0 = time.perf_counter()
            await mgr.resume(target)
            samples["wake (cluster, compacted, cache emptied)"].append(time.perf_counter() - t0)
            await mgr.pause(target)
            await _until_durable(mgr, target)
            await compacted(target)
        ok = (await mgr.run_code(target, "len(notes)")).text == "1000"
        for sid in ids:
            await mgr.kill(sid)
    finally:
        await mgr.close(pause=False)
    load_after = os.getloadavg()
    stats = {k: summary(v) for k, v in samples.items() if v}
    worst_owned = max(p["owned_after_mib"] for p in per)
    plain = stats["wake (cluster, plain, same node)"]["median_ms"]
    compacted_ms = stats["wake (cluster, compacted, same node)"]["median_ms"]
    targets = [
        ("owned beyond the template, worst sandbox (MiB)", worst_owned, 10.0),
        ("compacted wake, median (ms)", compacted_ms, 500.0),
        (
            "compacted wake / plain wake, same run (goal 500 ms / quiet plain wake 300 ms)",
            compacted_ms / plain,
            500.0 / QUIET_PLAIN_WAKE_MS,
        ),
    ]
    return {
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": platform.node(),
        "mode": "cluster",
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in load_after],
        "sandboxes": per,
        "samples": stats,
        "state_intact": ok,
        "targets": [
            {"name": n, "measured": m, "target": t, "pass": m <= t, "ratio": m / t if t else None}
            for n, m, t in targets
        ],
    }


def _print_cluster(result: dict[str, Any]) -> None:
    print(
        f"{'sandbox':<18}{'paused dir MiB':>16}{'local after':>13}{'stored own MiB':>16}"
        f"{'own chunks':>12}{'RAM as template':>17}"
    )
    for p in result["sandboxes"]:
        print(
            f"{p['sandbox']:<18}{p['paused_dir_mib']:>16}{p['local_after_mib']:>13}"
            f"{p['stored_beyond_template_mib']:>16}{p['chunks_beyond_template']:>12}"
            f"{p['ram_chunks_as_template']:>17}"
        )
    print(
        f"state intact after the loop: {result['state_intact']}; load average before "
        f"{result['loadavg_before']}, after {result['loadavg_after']}"
    )
    print(f"\n{'step':<48}{'median ms':>11}{'p95 ms':>9}{'n':>4}")
    for name, s in result["samples"].items():
        print(f"{name:<48}{s['median_ms']:>11.1f}{s['p95_ms']:>9.1f}{s['n']:>4}")
    print()
    for t in result["targets"]:
        verdict = "PASS" if t["pass"] else "FAIL"
        print(
            f"{verdict}  {t['name']}: {t['measured']:.2f} vs {t['target']:.2f} "
            f"(ratio {t['ratio']:.2f})"
        )


def _main_cluster(sandboxes: int, reps: int) -> None:
    import shutil
    import tempfile

    from tests.pg import start_cluster
    from tests.s3 import start_seaweedfs

    base = Path(tempfile.mkdtemp(prefix="torpor-bench-compaction-"))
    (base / "pg").mkdir()
    pg = start_cluster(base / "pg")
    s3 = start_seaweedfs(base / "s3")
    try:
        os.environ.update(s3.env())
        dsn, store = pg.admin_dsn(), f"s3://{s3.create_bucket('bench')}/cluster"
        result = asyncio.run(run_cluster(sandboxes, reps, base, dsn, store))
    finally:
        s3.stop()
        pg.stop()
        shutil.rmtree(base, ignore_errors=True)
    _print_cluster(result)
    write_results(CLUSTER_RESULTS, result)
    print(f"\nwrote {CLUSTER_RESULTS}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sandboxes", type=int, default=3)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--cluster", action="store_true", help="the cluster case")
    args = parser.parse_args()
    if args.cluster:
        _main_cluster(args.sandboxes, args.reps)
        return
    with bench_home() as home:
        result = asyncio.run(run(args.sandboxes, args.reps, home))
    _print(result)
    write_results(RESULTS, result)
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
