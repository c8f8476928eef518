"""What the sandbox benchmarks (lifecycle.py, snapshots.py) share: sample summaries, a
throwaway torpor home that reuses the built templates, and writing the results file."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["bench_home", "summary", "write_results"]


def summary(samples: list[float]) -> dict[str, float]:
    """Median, p95 and min of ``samples`` (seconds) in milliseconds, and their count."""
    ordered = sorted(samples)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return {
        "median_ms": statistics.median(ordered) * 1000,
        "p95_ms": p95 * 1000,
        "min_ms": ordered[0] * 1000,
        "n": len(ordered),
    }


@contextlib.contextmanager
def bench_home() -> Iterator[Path]:
    """A throwaway ``TORPOR_HOME`` (set in the environment) whose ``templates`` links to the
    built ones of the usual home, as the test fixtures do; removed on exit."""
    from torpor.config import paths

    shared = paths()
    home = Path(tempfile.mkdtemp(prefix="torpor-bench-"))
    (home / "templates").symlink_to(shared.templates)
    before = os.environ.get("TORPOR_HOME")
    os.environ["TORPOR_HOME"] = str(home)
    try:
        yield home
    finally:
        shutil.rmtree(home, ignore_errors=True)
        if before is None:  # the next home (another guest size) starts from the same one
            os.environ.pop("TORPOR_HOME", None)
        else:
            os.environ["TORPOR_HOME"] = before


def write_results(path: Path, result: dict[str, Any]) -> None:
    """Write ``result`` as indented JSON to ``path`` (its folder made if needed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str))
