"""Usage report benchmark: 10,000 sandboxes x 30 days of transitions, target <= 1 s.

A registry (the real SQLite file, schema and indexes) is filled with a month for 10,000
sandboxes of one tenant, each labelled with its user: created on day 0, then one session a day
(wake, run, pause: four transitions a day with CPU readings and owned bytes, as the manager
writes them), plus 1,000 snapshots in the ledger. Then, ``--reps`` times each:

* **report by label:user** over the month (10,000 lines), the issue's target: <= 1 s;
* **report by tenant** (one line) and **by sandbox** (10,000 lines);
* **report by label:user from day 10**: a window that starts inside every sandbox's history,
  so each sandbox costs four index seeks instead of two (reported, not the target);
* **replay** (the peer, once): the same usage computed the obvious way, reading every
  transition of the month and accruing it in Python. Its totals must equal the report's
  (a check that the cumulative meters are right), and it shows what they save.

The fill is not timed. The sync of the snapshot and volume stores into the ledger is not
either (the report is built with ``paths=None``): it reads the manifests on disk, bounded by the
snapshot and volume quotas, not by the length of the history.

    python3 -m bench.usage                  # 10,000 sandboxes, 30 days, 5 repetitions
    python3 -m bench.usage --sandboxes 1000 --reps 3   # a quick look

Results go to ``bench/results/usage.json``; PASS when the median of the label report is
<= 1 s.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sqlite3
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench._common import summary, write_results
from torpor.sandbox.models import SandboxState as S
from torpor.sandbox.registry import Registry
from torpor.sandbox.registry.meters import MeterRow, Meters, accrue
from torpor.sandbox.registry.usage import build

RESULTS = Path(__file__).parent / "results" / "usage.json"
TARGET_S = 1.0
T0 = 1_790_000_000.0
DAY = 86400.0


def fill(path: Path, sandboxes: int, days: int, seed: int = 1) -> int:
    """Write the month into a fresh registry at ``path``; returns the number of transitions."""
    Registry(path).close()  # the schema, at its current version
    db = sqlite3.connect(path)
    db.execute("PRAGMA synchronous=OFF")
    rng = random.Random(seed)
    count = 0
    sandbox_rows: list[tuple[Any, ...]] = []
    rows: list[tuple[Any, ...]] = []
    for n in range(sandboxes):
        sid = f"sbx-{n:06d}"
        sandbox_rows.append(
            (
                sid,
                "acme",
                f"agent-u-{n}",
                "python",
                "paused",
                json.dumps({"user": f"u-{n % 1000}"}),
                json.dumps({"vcpus": 2, "memory_mib": 4096}),
                30,
                T0,
                T0,
                T0,
            )
        )
        steps: list[tuple[float, S, float | None, int | None]] = [(T0, S.CREATING, None, None)]
        for day in range(days):
            start = T0 + day * DAY + rng.uniform(0, DAY / 2)
            up = rng.uniform(600, 7200)
            cpu = rng.uniform(0.02, 0.5)
            if day:
                steps.append((start, S.WAKING, None, None))
            steps.append((start + 0.3, S.RUNNING, cpu * 0.3, None))
            steps.append((start + up, S.PAUSING, cpu * up, None))
            steps.append((start + up + 0.05, S.PAUSED, None, rng.randint(10**8, 10**9)))
        prev: MeterRow | None = None
        src: S | None = None
        for at, state, reading, owned in steps:
            row = accrue(
                prev,
                at,
                state,
                vcpus=2,
                memory_mib=4096,
                cpu_reading=reading,
                owned_bytes=owned,
            )
            m = row.meters
            rows.append(
                (
                    sid,
                    None if src is None else src.value,
                    state.value,
                    at,
                    reading,
                    row.owned_bytes,
                    m.vcpu_seconds,
                    m.cpu_seconds,
                    m.ram_gib_seconds,
                    m.paused_byte_seconds,
                    row.cpu_ratio,
                )
            )
            prev, src = row, state
        count += len(steps)
        if len(rows) > 200_000:
            _flush(db, rows)
    _flush(db, rows)
    db.executemany(
        "INSERT INTO sandboxes (id, tenant, name, template, state, labels, spec,"
        " pause_retention_days, created_at, last_active_at, paused_at)"
        " VALUES (?,?,?,?,?,?,?,?,?,?,?)",
        sandbox_rows,
    )
    db.executemany(
        "INSERT INTO stored (kind, id, tenant, name, labels, bytes, started_at, expires_at)"
        " VALUES ('snapshot',?,?,?,?,?,?,?)",
        [
            (
                f"snap-{i:06d}",
                "acme",
                f"s{i}",
                json.dumps({"user": f"u-{i % 1000}"}),
                rng.randint(10**7, 10**9),
                T0 + rng.uniform(0, days * DAY),
                T0 + rng.uniform(0, 2 * days * DAY),
            )
            for i in range(1000)
        ],
    )
    db.commit()
    db.execute("ANALYZE")
    db.close()
    return count


def _flush(db: sqlite3.Connection, rows: list[tuple[Any, ...]]) -> None:
    db.executemany(
        "INSERT INTO transitions (sandbox_id, src, dst, at, cpu_reading, owned_bytes,"
        " m_vcpu, m_cpu, m_ram, m_paused, cpu_ratio) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
        rows,
    )
    db.commit()
    rows.clear()


def replay(path: Path, until: float) -> Meters:
    """The peer: every transition up to ``until`` read and accrued in Python (the window
    starts before the first one here, so nothing is clipped at its start)."""
    db = sqlite3.connect(path)
    total = Meters()
    prev: MeterRow | None = None
    current = None

    def end(last: MeterRow | None) -> Meters:
        if last is None:
            return Meters()
        return accrue(last, until, last.state, vcpus=2, memory_mib=4096).meters

    for sid, dst, at, reading, owned in db.execute(
        "SELECT sandbox_id, dst, at, cpu_reading, owned_bytes FROM transitions"
        " WHERE at <= ? ORDER BY sandbox_id, seq",
        (until,),
    ):
        if sid != current:
            total = total + end(prev)
            current, prev = sid, None
        prev = accrue(
            prev, at, S(dst), vcpus=2, memory_mib=4096, cpu_reading=reading, owned_bytes=owned
        )
    total = total + end(prev)
    db.close()
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sandboxes", type=int, default=10_000)
    parser.add_argument("--days", type=int, default=30)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="torpor-bench-usage-") as tmp:
        path = Path(tmp) / "registry.db"
        t = time.perf_counter()
        transitions = fill(path, args.sandboxes, args.days)
        fill_s = time.perf_counter() - t
        print(f"filled {args.sandboxes} sandboxes, {transitions} transitions in {fill_s:.1f} s")
        since, until = T0, T0 + args.days * DAY
        now = datetime.fromtimestamp(until, UTC)
        reg = Registry(path)
        samples: dict[str, list[float]] = {}
        cpu: dict[str, list[float]] = {}  # CPU time: what the report costs, whatever the load
        reports: dict[str, Any] = {}
        # the month (every sandbox created in it), and the general case: a window that
        # starts in the middle of every sandbox's history (two seeks per instant)
        cases = [(by, since) for by in ("label:user", "tenant", "sandbox")]
        cases.append(("label:user from day 10", since + 10 * DAY))
        for name, start in cases:
            by = name.split()[0]
            samples[name] = []
            cpu[name] = []
            for _ in range(args.reps):
                t, c = time.perf_counter(), time.process_time()
                reports[name] = build(reg, tenant="acme", by=by, since=start, until=until, now=now)
                samples[name].append(time.perf_counter() - t)
                cpu[name].append(time.process_time() - c)
        reg.close()
        t = time.perf_counter()
        peer = replay(path, until)
        replay_s = time.perf_counter() - t

    total = reports["tenant"].total
    agree = all(
        abs(a - b) <= 1e-6 * max(1.0, abs(b))
        for a, b in [
            (total.vcpu_hours * 3600, peer.vcpu_seconds),
            (total.cpu_hours * 3600, peer.cpu_seconds),
            (total.ram_gib_hours * 3600, peer.ram_gib_seconds),
            (total.paused_gb_months * 1e9 * 3600 * 720, peer.paused_byte_seconds),
        ]
    )
    label_median = statistics.median(samples["label:user"])
    label_cpu = statistics.median(cpu["label:user"])
    print()
    print(f"{'measure':<36}{'median':>10}{'p95':>10}{'min':>10}{'CPU time':>10}")
    for by, values in samples.items():
        s = summary(values)
        print(
            f"{'report by ' + by:<36}{s['median_ms']:>8.0f}ms{s['p95_ms']:>8.0f}ms"
            f"{s['min_ms']:>8.0f}ms{statistics.median(cpu[by]) * 1000:>8.0f}ms"
        )
    print(f"{'replay every transition':<36}{replay_s * 1000:>8.0f}ms")
    print()
    print(
        f"month total {total.cost.total:,.2f} {reports['tenant'].rates.currency} over "
        f"{total.sandboxes} sandboxes; the replay agrees: {agree}"
    )
    verdict = "PASS" if label_median <= TARGET_S and agree else "FAIL"
    print(
        f"{verdict}: report by label:user over {args.sandboxes} sandboxes x {args.days} days "
        f"({transitions} transitions) in {label_median:.3f} s wall, {label_cpu:.3f} s CPU "
        f"(target <= {TARGET_S} s; ratio {label_median / TARGET_S:.2f}); "
        f"{replay_s / label_median:.0f}x faster than the replay (load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs: wall time above CPU time is "
        "time spent waiting for a CPU)"
    )
    write_results(
        RESULTS,
        {
            "machine": platform.machine(),
            "load_average": os.getloadavg(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "sandboxes": args.sandboxes,
            "days": args.days,
            "transitions": transitions,
            "reports": {by: summary(v) for by, v in samples.items()},
            "reports_cpu_median_ms": {by: statistics.median(v) * 1000 for by, v in cpu.items()},
            "replay_s": replay_s,
            "replay_agrees": agree,
            "target_s": TARGET_S,
            "verdict": verdict,
        },
    )


if __name__ == "__main__":
    main()
