"""Randomized crash soak: random sandbox operations on real QEMU, the manager's process killed
at random steps, a restart + GC after each death, and the invariants checked every time.

A worker process (``--worker``) runs random operations — create, exec, pause, wake, snapshot,
restore, fork, kill — through :class:`~torpor.sandbox.manager.SandboxManager` and
:class:`~torpor.sandbox.checkpoints.Checkpoints`. At every step the manager reports
(``on_step``: pause, wake, create) and every storage step (``snapshots.failpoint``: freeze,
materialize, GC), it SIGKILLs itself with probability ``--crash-rate``. The parent then
restarts a manager on the home, runs GC, and checks:

* the restart succeeds (no sandbox directory without a registry row);
* no row is left in a transitional state, ``running`` has a QEMU, ``paused`` a whole state
  file and no QEMU;
* every running sandbox answers a command, every paused one wakes and answers;
* every live sandbox's disk chain passes ``qemu-img check`` after GC;
* every listed snapshot still materializes (its chunks are all there and whole).

Any violation prints FAIL with what was seen (exit status 1). Results (operations, medians,
crashes, restarts, violations) are printed as a table and written to
``bench/results/soak.json``::

    python3 -m bench.soak                       # 40 operations, crash rate 0.08
    python3 -m bench.soak --ops 100 --crash-rate 0.15 --seed 7
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench._common import bench_home, write_results

RESULTS = Path(__file__).parent / "results" / "soak.json"
MAX_LIVE = 3  # sandboxes alive at once (each is a 512 MiB guest under TCG)
OPS = ("create", "exec", "pause", "wake", "snapshot", "restore", "fork", "kill")


# -- the worker: random operations until it is killed or done -----------------------------------


async def _worker(home: Path, seed: int, ops: int, crash_rate: float, log_path: Path) -> None:
    from torpor.config import paths
    from torpor.errors import TorporError
    from torpor.sandbox.checkpoints import Checkpoints
    from torpor.sandbox.manager import SandboxManager
    from torpor.sandbox.storage import snapshots as snapmod

    rng = random.Random(seed)
    logf = open(log_path, "a")  # noqa: SIM115, ASYNC230 - one line per finished operation

    def note(**entry: Any) -> None:
        logf.write(json.dumps(entry) + "\n")
        logf.flush()
        os.fsync(logf.fileno())

    def maybe_die(step: str, *_: Any) -> None:
        if rng.random() < crash_rate:
            note(event="crash", step=step)
            os.kill(os.getpid(), signal.SIGKILL)

    manager = SandboxManager(paths(home))
    await manager.start(supervise=False)
    cp = Checkpoints(manager)
    await cp.recover()  # as a restarted server does
    manager.on_step = maybe_die
    snapmod.failpoint = maybe_die
    for _ in range(ops):
        infos = await manager.list()
        live = [i for i in infos if i.state.value in ("running", "paused")]
        snaps = cp.list_snapshots()
        op = rng.choice(OPS)
        if op in ("create", "restore", "fork") and len(live) >= MAX_LIVE:
            op = "kill"
        if not live and op not in ("create", "restore"):
            op = "create"
        if op == "restore" and not snaps:
            op = "create"
        target = rng.choice(live).id if live else ""
        t0 = time.perf_counter()
        outcome = "ok"
        try:
            if op == "create":
                await cp.create()
            elif op == "exec":
                result = await manager.run_command(target, "echo soak >> /root/soak.log")
                outcome = "ok" if result.exit_code == 0 else f"exit {result.exit_code}"
            elif op == "pause":
                await manager.pause(target)
            elif op == "wake":
                await manager.resume(target)
            elif op == "snapshot":
                await cp.snapshot(target, retention_days=1)
                for old in cp.list_snapshots()[:-2]:  # keep the store small
                    cp.delete_snapshot(old.id)
            elif op == "restore":
                await cp.restore(rng.choice(snaps).id)
            elif op == "fork":
                await cp.fork(target, count=1)
            else:
                await manager.kill(target)
        except TorporError as exc:  # a typed refusal is an outcome, not a violation
            outcome = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        note(event="op", op=op, seconds=time.perf_counter() - t0, outcome=outcome)
    await manager.close(pause=False)


# -- the parent: restart, GC, invariants ---------------------------------------------------------


async def _restart_and_check(home: Path) -> tuple[list[str], float]:
    """Restart a manager on ``home``, run GC, check the invariants. Returns the violations
    and the seconds the restart took."""
    from torpor.config import paths
    from torpor.errors import TorporError
    from torpor.sandbox.checkpoints import Checkpoints
    from torpor.sandbox.manager import SandboxManager
    from torpor.sandbox.storage.retention import collect_garbage
    from torpor.sandbox.storage.snapshots import SnapshotStore

    p = paths(home)
    bad: list[str] = []
    t0 = time.perf_counter()
    manager = SandboxManager(p)
    try:
        await manager.start(supervise=False)
    except TorporError as exc:
        return [f"restart refused: {exc}"], time.perf_counter() - t0
    restart = time.perf_counter() - t0
    cp = Checkpoints(manager)
    try:
        await cp.recover()  # what a restarted server does: finish the captures a crash cut short
        rows = manager.registry.list()
        for rec in rows:
            state = rec.state.value
            status = manager.engine.inspect(manager.directory(rec.id))
            if state in ("creating", "pausing", "waking"):
                bad.append(f"{rec.id} left {state} after the restart")
            elif state == "running" and status.qemu_pid is None:
                bad.append(f"{rec.id} is running without a QEMU")
            elif state == "paused" and (not status.has_state or status.qemu_pid is not None):
                bad.append(
                    f"{rec.id} is paused but state={status.has_state} qemu={status.qemu_pid}"
                )
        collect_garbage(p, live_sandboxes={r.id for r in rows if r.state.value != "stopped"})
        for rec in rows:
            if rec.state.value not in ("running", "paused"):
                continue
            disk = manager.directory(rec.id) / "disk.qcow2"
            check = await asyncio.to_thread(
                subprocess.run,
                ["qemu-img", "check", "-U", str(disk)],
                capture_output=True,
                text=True,
                check=False,
            )
            if check.returncode != 0:
                bad.append(f"{rec.id}: disk chain broken after GC: {check.stderr.strip()[:200]}")
                continue
            try:
                result = await manager.run_command(rec.id, "true")  # wakes a paused one
                if result.exit_code != 0:
                    bad.append(f"{rec.id} ({rec.state.value}) does not answer: {result.stderr}")
            except TorporError as exc:
                bad.append(f"{rec.id} ({rec.state.value}) unusable: {exc}")
        store = SnapshotStore(p)
        for snap in cp.list_snapshots():
            try:
                await cp.wait_stored(snap.id)  # a capture the crash cut short is finished
                shutil.rmtree(store.materialize(snap.id))
            except TorporError as exc:
                bad.append(f"listed snapshot {snap.id} does not restore: {exc}")
    finally:
        await cp.settle()
        await manager.close(pause=False)
    return bad, restart


async def _kill_all(home: Path) -> None:
    """Kill every sandbox left (no QEMU outlives the bench)."""
    from torpor.config import paths
    from torpor.sandbox.manager import SandboxManager

    manager = SandboxManager(paths(home))
    await manager.start(supervise=False)
    for info in await manager.list():
        await manager.kill(info.id)
    await manager.close(pause=False)


def _parent(args: argparse.Namespace) -> int:
    with bench_home() as home:
        log_path = home / "soak.log"
        rounds: list[dict[str, Any]] = []
        done = 0
        t_start = time.perf_counter()
        while done < args.ops and len(rounds) < args.ops:
            before = _ops_logged(log_path)
            proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "bench.soak",
                    "--worker",
                    "--home",
                    str(home),
                    "--seed",
                    str(args.seed * 1000 + len(rounds)),
                    "--ops",
                    str(args.ops - done),
                    "--crash-rate",
                    str(args.crash_rate),
                    "--log",
                    str(log_path),
                ],
                env=os.environ.copy(),
                check=False,
            )
            done = _ops_logged(log_path)
            killed = proc.returncode == -signal.SIGKILL
            bad, restart = _check_in_a_process(home)
            rounds.append(
                {"ops": done - before, "killed": killed, "restart_s": restart, "violations": bad}
            )
            for b in bad:
                print(f"FAIL  {b}")
            if proc.returncode not in (0, -signal.SIGKILL):
                rounds[-1]["violations"].append(f"worker exited {proc.returncode}")
                print(f"FAIL  worker exited {proc.returncode}")
                break
        entries = [json.loads(line) for line in log_path.read_text().splitlines()]
        asyncio.run(_kill_all(home))
    return _report(args, rounds, entries, time.perf_counter() - t_start)


def _check_in_a_process(home: Path) -> tuple[list[str], float]:
    """Run :func:`_restart_and_check` in a process of its own: a manager closed without
    pausing keeps its QMP connections until its process exits, and QEMU serves one QMP client
    at a time, so the next worker must not share a process with the checker."""
    proc = subprocess.run(
        [sys.executable, "-m", "bench.soak", "--check", "--home", str(home)],
        env=os.environ.copy(),
        capture_output=True,
        text=True,
        check=False,
    )
    try:
        found = json.loads(proc.stdout.strip().splitlines()[-1])
        return list(found["violations"]), float(found["restart_s"])
    except (ValueError, IndexError, KeyError):
        return [f"the checker failed ({proc.returncode}): {proc.stderr.strip()[-300:]}"], 0.0


def _ops_logged(log_path: Path) -> int:
    if not log_path.exists():
        return 0
    return sum('"event": "op"' in line for line in log_path.read_text().splitlines())


def _report(
    args: argparse.Namespace,
    rounds: list[dict[str, Any]],
    entries: list[dict[str, Any]],
    elapsed: float,
) -> int:
    from rich.console import Console
    from rich.table import Table

    ops = [e for e in entries if e["event"] == "op"]
    crashes = [e for e in entries if e["event"] == "crash"]
    table = Table(title=f"soak: {len(ops)} operations, {len(crashes)} crashes, seed {args.seed}")
    for col in ("operation", "n", "ok", "typed refusal", "median ms"):
        table.add_column(col, justify="right" if col != "operation" else "left")
    per_op: dict[str, Any] = {}
    for name in OPS:
        mine = [e for e in ops if e["op"] == name]
        if not mine:
            continue
        ok = sum(e["outcome"] == "ok" for e in mine)
        med = statistics.median(e["seconds"] for e in mine) * 1000
        per_op[name] = {"n": len(mine), "ok": ok, "median_ms": med}
        table.add_row(name, str(len(mine)), str(ok), str(len(mine) - ok), f"{med:.0f}")
    console = Console()
    console.print(table)
    steps: dict[str, int] = {}
    for c in crashes:
        steps[c["step"]] = steps.get(c["step"], 0) + 1
    console.print(f"crash points hit: {steps or 'none'}")
    violations = [v for r in rounds for v in r["violations"]]
    restarts = [r["restart_s"] for r in rounds]
    console.print(
        f"restarts: {len(rounds)} (median {statistics.median(restarts) * 1000:.0f} ms), "
        f"violations: {len(violations)}, {elapsed:.0f} s in all"
    )
    write_results(
        Path(args.out),
        {
            "seed": args.seed,
            "ops": len(ops),
            "crash_rate": args.crash_rate,
            "crashes": steps,
            "per_op": per_op,
            "rounds": rounds,
            "violations": violations,
            "elapsed_s": elapsed,
        },
    )
    print(
        "PASS  no invariant violated" if not violations else f"FAIL  {len(violations)} violations"
    )
    return 0 if not violations else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ops", type=int, default=40)
    parser.add_argument("--crash-rate", type=float, default=0.08)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--check", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--home", help=argparse.SUPPRESS)
    parser.add_argument("--log", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        asyncio.run(_worker(Path(args.home), args.seed, args.ops, args.crash_rate, Path(args.log)))
        return 0
    if args.check:
        bad, restart = asyncio.run(_restart_and_check(Path(args.home)))
        print(json.dumps({"violations": bad, "restart_s": restart}))
        return 0
    return _parent(args)


if __name__ == "__main__":
    sys.exit(main())
