"""Checkpoint benchmark: snapshot, restore, fork of 1 and of 10, and storage deduplication.

Runs on real QEMU through :class:`torpor.sandbox.checkpoints.Checkpoints` with the built
``python`` template (512 MiB guest, TCG here), ``--reps`` times each:

* **snapshot** of a running sandbox (pause, freeze, wake, capture into the chunk store): wall
  time, logical bytes, bytes the snapshot added to the store (the first one fills an empty
  store; later ones deduplicate against it);
* **restore** of a stored snapshot into a new running sandbox (verified chunks -> frozen dir ->
  clone -> wake -> fresh entropy);
* **fork** of a running sandbox into 1 and into 10 children (time per child);
* **dedup**: 20 sandboxes from one template, each changes a little and is paused, then each is
  captured into the store. Compared with one template snapshot ``B``: the store must hold
  ``<= 2 x B + what they changed``; the dedup ratio is ``21 x B / store bytes`` (21 snapshots,
  each about B alone). The local paused directories are reported too (ext4 here has no
  reflink: each keeps its own RAM copy).
* **floor**: a sparse copy of the template's RAM file, the cost every fork and restore pays
  (measured in the same run).

    python3 -m bench.snapshots                 # 10 repetitions
    python3 -m bench.snapshots --reps 3 --sandboxes 5   # a quick look

Results go to ``bench/results/snapshots.json``; each target prints PASS/FAIL with the ratio
measured/target (<= 1.00 passes).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from bench._common import bench_home, summary, write_results

RESULTS = Path(__file__).parent / "results" / "snapshots.json"


def _du(path: Path) -> int:
    out = subprocess.run(
        ["du", "-s", "--block-size=1", str(path)], capture_output=True, text=True, check=True
    ).stdout
    return int(out.split()[0])


def _floor(template_dir: Path, scratch: Path) -> float:
    """A sparse copy of the template's RAM file: what every clone pays at least."""
    from torpor.sandbox.vm.disk import copy_sparse

    t0 = time.perf_counter()
    copy_sparse(template_dir / "ram", scratch / "ram-floor")
    dt = time.perf_counter() - t0
    (scratch / "ram-floor").unlink()
    return dt


async def run(reps: int, sandboxes: int, home: Path) -> dict[str, Any]:
    from torpor.config import paths
    from torpor.sandbox import template as templates
    from torpor.sandbox.checkpoints import Checkpoints
    from torpor.sandbox.manager import SandboxManager

    p = paths(home)
    manager = SandboxManager(p)
    await manager.start(supervise=False)
    cp = Checkpoints(manager)
    out: dict[str, Any] = {"reps": reps}
    snap_t: list[float] = []
    restore_t: list[float] = []
    fork1_t: list[float] = []
    fork10_t: list[float] = []
    floors: list[float] = []
    sizes: list[dict[str, int]] = []
    try:
        tdir = Path(templates.get("python").snapshot_dir)
        floors.extend(_floor(tdir, p.cache) for _ in range(reps))
        src = await manager.create(name="bench-src")
        await manager.run_code(src.id, "data = [i * i for i in range(200_000)]")
        for i in range(reps):
            await manager.run_code(src.id, f"step = {i}")
            t0 = time.perf_counter()
            snap = await cp.snapshot(src.id, name=f"bench-{i}")
            snap_t.append(time.perf_counter() - t0)
            sizes.append({"size_bytes": snap.size_bytes, "stored_bytes": snap.stored_bytes})
            t0 = time.perf_counter()
            restored = await cp.restore(snap.id)
            restore_t.append(time.perf_counter() - t0)
            assert (await manager.run_code(restored.id, "step")).text == str(i)
            await manager.kill(restored.id)
            t0 = time.perf_counter()
            kids = await cp.fork(src.id, count=1)
            fork1_t.append(time.perf_counter() - t0)
            for k in kids:
                await manager.kill(k.id)
        for _ in range(reps):
            t0 = time.perf_counter()
            kids = await cp.fork(src.id, count=10)
            fork10_t.append((time.perf_counter() - t0) / 10)
            for k in kids:
                await manager.kill(k.id)
        await manager.kill(src.id)
        out["snapshot"] = summary(snap_t)
        out["snapshot_first_ms"] = snap_t[0] * 1000
        out["snapshot_later"] = summary(snap_t[1:] or snap_t)
        out["snapshot_sizes"] = sizes
        out["restore"] = summary(restore_t)
        out["fork1_per_child"] = summary(fork1_t)
        out["fork10_per_child"] = summary(fork10_t)
        out["floor_ram_copy"] = summary(floors)
        out["dedup"] = await _dedup(manager, cp, sandboxes)
    finally:
        for info in await manager.list():
            with contextlib.suppress(Exception):  # clean up as much as possible
                await manager.kill(info.id)
        await manager.close(pause=False)
    return out


async def _dedup(manager: Any, cp: Any, n: int) -> dict[str, Any]:
    """n paused sandboxes from one template, each captured: store bytes vs one snapshot."""
    for s in cp.snapshots.list():  # start from an empty store
        cp.snapshots.delete(s.id)
    from torpor.sandbox.storage.retention import collect_garbage

    await asyncio.to_thread(collect_garbage, cp.paths)
    base_store = cp.snapshots.chunks.stored_bytes()
    fresh = await manager.create(name="dedup-template")
    await cp.snapshot(fresh.id, name="dedup-template")
    await manager.kill(fresh.id)
    one_bytes = cp.snapshots.chunks.stored_bytes() - base_store
    ids = []
    for i in range(n):
        sbx = await manager.create(name=f"dedup-{i}")
        await manager.run_code(sbx.id, f"mine = {i}; notes = ['note {i}'] * 100")
        await manager.write_file(sbx.id, f"/workspace/file-{i}.txt", f"sandbox {i}\n" * 1000)
        await manager.pause(sbx.id)
        ids.append(sbx.id)
    paused_local = sum(_du(manager.directory(i)) for i in ids)
    changed = 0
    for i, sid in enumerate(ids):
        snap = await cp.snapshot(sid, name=f"dedup-{i}")
        changed += snap.stored_bytes
    total = cp.snapshots.chunks.stored_bytes() - base_store
    for sid in ids:
        await manager.kill(sid)
    return {
        "sandboxes": n,
        "one_snapshot_bytes": one_bytes,
        "store_bytes": total,
        "changed_bytes": changed,
        "limit_bytes": 2 * one_bytes + changed,
        "dedup_ratio": (n + 1) * one_bytes / max(1, total),
        "store_over_one": total / max(1, one_bytes),
        "paused_dirs_local_bytes": paused_local,
    }


def render(result: dict[str, Any]) -> list[tuple[str, float, float]]:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table("operation", "median ms", "p95 ms", "n", title="torpor checkpoints (TCG)")
    for key, label in [
        ("snapshot", "snapshot (all)"),
        ("snapshot_later", "snapshot (dedup)"),
        ("restore", "restore"),
        ("fork1_per_child", "fork 1, per child"),
        ("fork10_per_child", "fork 10, per child"),
        ("floor_ram_copy", "floor: RAM file sparse copy"),
    ]:
        s = result[key]
        table.add_row(label, f"{s['median_ms']:.0f}", f"{s['p95_ms']:.0f}", str(s["n"]))
    console.print(table)
    d = result["dedup"]
    mib = 1 << 20
    sizes = result["snapshot_sizes"]
    later = statistics.median(s["stored_bytes"] for s in sizes[1:] or sizes)
    console.print(
        f"first snapshot {result['snapshot_first_ms']:.0f} ms, "
        f"{result['snapshot_sizes'][0]['size_bytes'] / mib:.0f} MiB logical, "
        f"{result['snapshot_sizes'][0]['stored_bytes'] / mib:.1f} MiB stored; later ones add "
        f"{later / mib:.1f} MiB each (median)"
    )
    console.print(
        f"dedup: {d['sandboxes']} paused sandboxes -> store {d['store_bytes'] / mib:.1f} MiB = "
        f"{d['store_over_one']:.2f} x one template snapshot ({d['one_snapshot_bytes'] / mib:.1f}"
        f" MiB); changed {d['changed_bytes'] / mib:.1f} MiB; dedup ratio {d['dedup_ratio']:.1f}x;"
        f" local paused dirs {d['paused_dirs_local_bytes'] / mib:.0f} MiB (no reflink on this FS)"
    )
    targets = [
        ("fork <= 500 ms per child (fork 1)", result["fork1_per_child"]["median_ms"], 500.0),
        ("fork <= 500 ms per child (fork 10)", result["fork10_per_child"]["median_ms"], 500.0),
        ("snapshot <= 3 s", result["snapshot"]["median_ms"], 3000.0),
        ("20 paused <= 2 x B + changed", float(d["store_bytes"]), float(d["limit_bytes"])),
    ]
    for name, got, limit in targets:
        ratio = got / limit
        console.print(f"{'PASS' if ratio <= 1 else 'FAIL'}  {name}: ratio {ratio:.2f}")
    return targets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--sandboxes", type=int, default=20)
    args = parser.parse_args()
    with bench_home() as home:
        result = asyncio.run(run(args.reps, args.sandboxes, home))
    result["host"] = {
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    targets = render(result)
    result["targets"] = [
        {"name": n, "measured": g, "target": t, "ratio": g / t} for n, g, t in targets
    ]
    write_results(RESULTS, result)


if __name__ == "__main__":
    main()
