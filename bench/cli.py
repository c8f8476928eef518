"""CLI start-up: what one ``torpor`` invocation and one ``torpor serve`` start cost.

Each command runs in a new interpreter, as a user's shell (or a test's subprocess) runs it; the
floor is the bare interpreter (``python3 -c pass``) measured in the same run. With
``--checkout DIR`` (repeatable) the same commands run against other checkouts too (e.g. ``main``
before a change), interleaved with this one, so their ratio is a same-run comparison::

    python -m bench.cli                            # this checkout, 7 repetitions
    python -m bench.cli --checkout /work/main --reps 9

Reported per command and checkout: the median wall time and the median CPU time (user +
system, of the process alone), each also over the floor's median. On a busy machine compare
the CPU times: wall time there mostly measures the others. ``serve``'s wall time is from
spawning ``torpor serve`` to its first answer on ``/v1/health`` (what a test that starts a
server, or the SDK's autostart, waits for); its CPU time is the whole process's.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench._common import summary, write_results

ROOT = Path(__file__).resolve().parents[1]
SCOPE = ["--scope", "app/bench/user/u"]
#: name -> torpor arguments (``None``: the floor, a bare interpreter)
COMMANDS: dict[str, list[str] | None] = {
    "floor (python -c pass)": None,
    "torpor --version": ["--version"],
    "torpor --help": ["--help"],
    "torpor memory recall": ["memory", *SCOPE, "--json", "recall", "weekly summaries"],
    "torpor serve (to /v1/health)": ["serve"],
}


def _env(checkout: Path, home: Path) -> dict[str, str]:
    # run in the checkout too: ``-m`` puts the working directory first on sys.path
    return {**os.environ, "PYTHONPATH": str(checkout), "TORPOR_HOME": str(home)}


def _wait(proc: subprocess.Popen[bytes]) -> float:
    """Wait for ``proc``; the CPU seconds (user + system) it used. CPU time hardly depends on
    what else the machine runs, so it compares checkouts on a busy machine where wall time
    cannot."""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_utime + usage.ru_stime


def _once(checkout: Path, args: list[str] | None, home: Path) -> tuple[float, float]:
    """Wall and CPU seconds one invocation took (raises RuntimeError if it failed)."""
    env = _env(checkout, home)
    if args == ["serve"]:
        return _serve_once(env, home, checkout)
    argv = [sys.executable, "-c", "pass"] if args is None else [sys.executable, "-m", "torpor.cli"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [*argv, *(args or [])], env=env, cwd=checkout, stdout=subprocess.DEVNULL
    )
    cpu = _wait(proc)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{argv} {args} exited with {proc.returncode}")
    return wall, cpu


def _serve_once(env: dict[str, str], home: Path, checkout: Path) -> tuple[float, float]:
    """Wall seconds to the first answer on /v1/health; CPU seconds of the whole process
    (start, that answer, and a SIGTERM stop)."""
    from torpor.client._local import is_alive

    sock = home / "bench.sock"
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "torpor.cli", "serve", "--socket", str(sock)],
        env=env,
        cwd=checkout,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while not is_alive(sock, timeout=5):
            if proc.poll() is not None:
                raise RuntimeError(f"torpor serve exited with {proc.returncode}")
            time.sleep(0.02)
        wall = time.perf_counter() - t0
    finally:
        proc.send_signal(signal.SIGTERM)
    return wall, _wait(proc)


def run(checkouts: list[Path], reps: int) -> dict[str, Any]:
    """Every command against every checkout, ``reps`` rounds, interleaved within a round."""
    walls: dict[tuple[str, str], list[float]] = {}
    cpus: dict[tuple[str, str], list[float]] = {}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="torpor-bench-cli-") as tmp:
        for checkout in checkouts:  # one home per checkout, with one remembered fact
            home = Path(tmp) / checkout.name
            subprocess.run(
                [sys.executable, "-m", "torpor.cli", "memory", *SCOPE, "remember", "weekly"],
                env=_env(checkout, home),
                cwd=checkout,
                check=True,
                stdout=subprocess.DEVNULL,
            )
        for _ in range(reps):
            for name, args in COMMANDS.items():
                for checkout in checkouts:
                    wall, cpu = _once(checkout, args, Path(tmp) / checkout.name)
                    walls.setdefault((name, str(checkout)), []).append(wall)
                    cpus.setdefault((name, str(checkout)), []).append(cpu)
    floor = next(iter(COMMANDS))
    rows = []
    for (name, where), values in walls.items():
        wall_s = summary(values)
        cpu_s = summary(cpus[(name, where)])
        rows.append(
            {
                "command": name,
                "checkout": where,
                "wall": wall_s,
                "cpu": cpu_s,
                "wall_over_floor": wall_s["median_ms"]
                / summary(walls[(floor, where)])["median_ms"],
                "cpu_over_floor": cpu_s["median_ms"] / summary(cpus[(floor, where)])["median_ms"],
            }
        )
    return {
        "reps": reps,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--checkout", type=Path, action="append", default=[])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cli.json")
    opts = parser.parse_args()
    checkouts = [ROOT, *(c.resolve() for c in opts.checkout)]
    result = run(checkouts, opts.reps)
    table = Table(
        title=f"CLI start-up, {opts.reps} reps (load {result['load_before']:.1f} -> "
        f"{result['load_after']:.1f})"
    )
    for col in ("command", "checkout", "wall ms (med)", "x floor", "CPU ms (med)", "x floor"):
        table.add_column(col)
    for r in result["rows"]:
        table.add_row(
            r["command"],
            r["checkout"],
            f"{r['wall']['median_ms']:.0f}",
            f"{r['wall_over_floor']:.1f}",
            f"{r['cpu']['median_ms']:.0f}",
            f"{r['cpu_over_floor']:.1f}",
        )
    Console().print(table)
    write_results(opts.out, result)


if __name__ == "__main__":
    main()
