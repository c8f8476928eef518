"""CLI start-up: what one ``torpor`` invocation and one ``torpor serve`` start cost.

Each command runs in a new interpreter, as a user's shell (or a test's subprocess) runs it; the
floor is the bare interpreter (``python3 -c pass``) measured in the same run. With
``--checkout DIR`` (repeatable) the same commands run against other checkouts too (e.g. ``main``
before a change), interleaved with this one, so their ratio is a same-run comparison::

    python -m bench.cli                            # this checkout, 7 repetitions
    python -m bench.cli --checkout /work/main --reps 9

Reported per command and checkout: median and min wall time (ms), and the median over the
floor's median. ``serve`` is the time from spawning ``torpor serve`` to its first answer on
``/v1/health`` (what a test that starts a server, or the SDK's autostart, waits for).
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
    return {**os.environ, "PYTHONPATH": str(checkout), "TORPOR_HOME": str(home)}


def _once(checkout: Path, args: list[str] | None, home: Path) -> float:
    """Seconds one invocation took (raises CalledProcessError if it failed)."""
    env = _env(checkout, home)
    if args is None:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], env=env, check=True)
        return time.perf_counter() - t0
    if args != ["serve"]:
        t0 = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "torpor.cli", *args],
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        return time.perf_counter() - t0
    return _serve_once(env, home)


def _serve_once(env: dict[str, str], home: Path) -> float:
    from torpor.client._local import is_alive

    sock = home / "bench.sock"
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "torpor.cli", "serve", "--socket", str(sock)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while not is_alive(sock, timeout=5):
            if proc.poll() is not None:
                raise RuntimeError(f"torpor serve exited with {proc.returncode}")
            time.sleep(0.02)
        return time.perf_counter() - t0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)


def run(checkouts: list[Path], reps: int) -> dict[str, Any]:
    """Every command against every checkout, ``reps`` rounds, interleaved within a round."""
    samples: dict[tuple[str, str], list[float]] = {}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="torpor-bench-cli-") as tmp:
        for checkout in checkouts:  # one home per checkout, with one remembered fact
            home = Path(tmp) / checkout.name
            subprocess.run(
                [sys.executable, "-m", "torpor.cli", "memory", *SCOPE, "remember", "weekly"],
                env=_env(checkout, home),
                check=True,
                stdout=subprocess.DEVNULL,
            )
        for _ in range(reps):
            for name, args in COMMANDS.items():
                for checkout in checkouts:
                    home = Path(tmp) / checkout.name
                    took = _once(checkout, args, home)
                    samples.setdefault((name, str(checkout)), []).append(took)
    floors = {str(c): summary(samples[(next(iter(COMMANDS)), str(c))]) for c in checkouts}
    rows = []
    for (name, where), values in samples.items():
        s = summary(values)
        rows.append(
            {
                "command": name,
                "checkout": where,
                **s,
                "over_floor": s["median_ms"] / floors[where]["median_ms"],
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
    table = Table(title=f"CLI start-up, {opts.reps} reps (load {result['load_before']:.1f})")
    for col in ("command", "checkout", "median ms", "min ms", "x floor"):
        table.add_column(col)
    for r in result["rows"]:
        table.add_row(
            r["command"],
            r["checkout"],
            f"{r['median_ms']:.0f}",
            f"{r['min_ms']:.0f}",
            f"{r['over_floor']:.1f}",
        )
    Console().print(table)
    write_results(opts.out, result)


if __name__ == "__main__":
    main()
