"""A timeline of one fork: per child, when each step of its making ran, and the CPU each
child's QEMU used (``/proc/<pid>/schedstat``), to see where a fork's wall time goes.

Wraps the functions that do the steps (as ``bench.snapshots`` does for its splits) and
records ``(child, step, start, end)`` in milliseconds from the fork's call; prints one table
per fork (steps in time order, with the child they belong to) and a per-child summary, and
writes JSON.

    python3 -m bench.fork_timeline --count 10 --reps 3            # a running source
    python3 -m bench.fork_timeline --count 10 --of-snapshot       # a snapshot id
    python3 -m bench.fork_timeline --count 10 --before            # the path before, to compare
    python3 -m bench.fork_timeline --count 10 --before-9          # before session 9's cuts
    python3 -m bench.fork_timeline --count 1 --template python,python-2g   # sizes in turn
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import inspect
import json
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from bench._common import bench_home, write_results

RESULTS = Path(__file__).parent / "results" / "fork_timeline.json"
#: the QEMU start floor (ms) of the idle host issue 13's goals were set on
ISSUE_FLOOR_MS = 36.0


def _faults(pid: int | None) -> int | None:
    """Page faults (minor + major) the process ``pid`` took so far, or None."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[7]) + int(fields[9])  # minflt, majflt (fields 10 and 12 of stat)


def _cpu_ms(pid: int | None) -> float | None:
    """Milliseconds of CPU the process ``pid`` ran so far (all its threads), or None."""
    if pid is None:
        return None
    total = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
    except OSError:
        return None
    return total / 1e6


class Timeline:
    """Records spans of the wrapped steps while :attr:`t0` is set."""

    def __init__(self) -> None:
        self.t0: float | None = None
        self.spans: list[dict[str, Any]] = []
        self.pids: dict[str, int] = {}
        self._undo: list[tuple[Any, str, Any]] = []
        self._lock = threading.Lock()

    def now(self) -> float:
        assert self.t0 is not None
        return (time.perf_counter() - self.t0) * 1000

    def add(self, who: str, what: str, start: float, end: float, **extra: Any) -> None:
        if self.t0 is None or who == "-":  # (a wrapper that only samples)
            return
        with self._lock:
            span = {"who": who, "what": what, "start": round(start, 1), "end": round(end, 1)}
            self.spans.append(span | extra)

    def wrap(self, where: str, attr: str, who: Any, what: Any = None, after: Any = None) -> None:
        """Wrap ``where`` (``module`` or ``module:Class``) ``.attr``; ``who(args, kwargs)``
        names the child, ``what(args, kwargs)`` the step (default: ``attr``); ``after(args,
        kwargs)`` is called once it returned."""
        module, _, cls = where.partition(":")
        owner: Any = importlib.import_module(module)
        if cls:
            owner = getattr(owner, cls)
        fn = inspect.getattr_static(owner, attr)
        if isinstance(fn, classmethod | staticmethod):
            raise TypeError(f"{where}.{attr}: wrap plain functions only")
        self._undo.append((owner, attr, fn))
        tl = self

        def names(a: tuple[Any, ...], k: dict[str, Any]) -> tuple[str, str]:
            try:
                w = str(who(a, k))
            except Exception:
                w = "?"
            try:
                s = attr if what is None else str(what(a, k))
            except Exception:
                s = attr
            return w, s

        if inspect.iscoroutinefunction(fn):

            async def timed_async(*a: Any, **k: Any) -> Any:
                if tl.t0 is None:
                    return await fn(*a, **k)
                w, s = names(a, k)
                t = tl.now()
                try:
                    return await fn(*a, **k)
                finally:
                    tl.add(w, s, t, tl.now(), thread=threading.current_thread().name[:12])
                    if after is not None:
                        after(a, k)

            setattr(owner, attr, timed_async)
        else:

            def timed(*a: Any, **k: Any) -> Any:
                if tl.t0 is None:
                    return fn(*a, **k)
                w, s = names(a, k)
                t, cpu = tl.now(), time.thread_time()
                try:
                    return fn(*a, **k)
                finally:
                    cpu_ms = round((time.thread_time() - cpu) * 1000, 1)
                    tl.add(
                        w, s, t, tl.now(), thread=threading.current_thread().name[:12], cpu=cpu_ms
                    )

            setattr(owner, attr, timed)

    def patch(self, owner: Any, attr: str, value: Any) -> None:
        """Set ``owner.attr`` to ``value`` until :meth:`close`."""
        self._undo.append((owner, attr, inspect.getattr_static(owner, attr)))
        setattr(owner, attr, value)

    def close(self) -> None:
        for owner, attr, fn in reversed(self._undo):
            setattr(owner, attr, fn)


def _stat() -> dict[str, int]:
    """Host-wide CPU ticks (all CPUs) from /proc/stat: user+nice, system, idle, iowait..."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return {"user": v[0] + v[1], "system": v[2] + v[5] + v[6], "idle": v[3], "iowait": v[4]}


def _threads() -> dict[str, float]:
    """CPU ms of each thread of this process so far, by thread name (the main thread,
    asyncio's to_thread workers)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ms = int(f.read().split()[0]) / 1e6
            name = names.get(int(tid), "other")
            key = "main" if name == "MainThread" else "workers" if "asyncio" in name else "other"
            out[key] = out.get(key, 0.0) + ms
    return out


def _vmstat() -> dict[str, int]:
    """The host's dirty and under-writeback page cache (MiB) and dirty throttling count."""
    want = {"nr_dirty", "nr_writeback", "nr_dirty_threshold", "nr_dirty_background_threshold"}
    out = {}
    with open("/proc/vmstat") as f:
        for line in f:
            k, v = line.split()
            if k in want:
                out[k] = int(v) * 4096 >> 20
    return out


def _short(path: Any) -> str:
    name = Path(str(path)).name
    return name[-6:] if name.startswith("sbx-") else name[:10]


def install(tl: Timeline) -> None:
    """Wrap every step of a fork's children."""

    def d0(a: tuple[Any, ...], k: dict[str, Any]) -> str:  # a QemuMachine method
        return _short(a[0].directory)

    def qmp(a: tuple[Any, ...], k: dict[str, Any]) -> str:
        return f"qmp {a[1]}"

    tl.wrap("torpor.sandbox.registry.sqlite:Registry", "insert", lambda a, k: _short(a[1].id))
    tl.wrap(
        "torpor.sandbox.registry.sqlite:Registry", "insert_many", lambda a, k: f"{len(a[1])} rows"
    )
    tl.wrap(
        "torpor.sandbox.registry.sqlite:Registry",
        "set_state",
        lambda a, k: _short(a[1]),
        lambda a, k: f"registry -> {a[3].value}",
    )
    tl.wrap(
        "torpor.sandbox.registry.sqlite:Registry",
        "set_states",
        lambda a, k: f"{len(a[1])} rows",
        lambda a, k: f"registry -> {a[1][0].dst.value if a[1] else '-'} (one commit)",
    )
    for fn in ("clone_pending", "fill_pending", "link_state", "clone_machine_dir"):
        tl.wrap("torpor.sandbox.vm.machine_dir", fn, lambda a, k: _short(a[1]))
    tl.wrap("torpor.sandbox.vm.machine_dir", "discard_state", lambda a, k: _short(a[0]))
    tl.wrap("torpor.sandbox.vm.machine:QemuMachine", "_start", d0, lambda a, k: "QEMU start+QMP")
    tl.wrap("torpor.sandbox.vm.machine:QemuMachine", "_load_state", d0)
    tl.wrap("torpor.sandbox.vm.machine:QemuMachine", "_qmp_exec", d0, qmp)
    tl.wrap("torpor.sandbox.vm.machine:QemuMachine", "capture", d0)
    tl.wrap("torpor.sandbox.vm.machine:QemuMachine", "wake", d0)
    tl.wrap(
        "torpor.sandbox.engine:QemuEngine",
        "connect",
        lambda a, k: _short(a[2]),
        lambda a, k: "connect+reseed",
    )
    tl.wrap("torpor.sandbox.vm.channel:GuestChannel", "refresh", lambda a, k: "?")
    tl.wrap("torpor.sandbox.storage.snapshots", "freeze_live", lambda a, k: "source")
    tl.wrap("torpor.sandbox.checkpoints.clones:Pending", "fill", lambda a, k: "all")
    tl.wrap("torpor.sandbox.checkpoints.clones:Pending", "release", lambda a, k: "all")
    tl.wrap("torpor.sandbox.checkpoints.clones:Cloner", "start_pending", lambda a, k: "all")
    tl.wrap("torpor.sandbox.checkpoints.clones:Cloner", "wake_children", lambda a, k: "all")
    tl.wrap("torpor.sandbox.vm.disk", "copy_sparse", lambda a, k: _short(Path(a[1]).parent))
    # the copy inside a live source's stop (the machine module imports it by name)
    tl.wrap(
        "torpor.sandbox.vm.machine",
        "copy_sparse",
        lambda a, k: "source",
        lambda a, k: "RAM copy in the stop",
    )


def _the_path_before(tl: Timeline) -> None:
    """Undo issue 13 session 8's cuts, for a comparison in the same run: one registry
    transaction per child, and RAM copies that allocate page by page."""
    import torpor.sandbox.vm.disk as disk
    from torpor.sandbox.registry.sqlite import Registry

    many = Registry.insert_many

    def one_by_one(self: Registry, recs: Any, *, reason: str = "create") -> None:
        for rec in recs:
            many(self, [rec], reason=reason)

    def cannot(fd: int, start: int, length: int) -> bool:
        return False

    tl.patch(Registry, "insert_many", one_by_one)
    tl.patch(disk, "preallocate", cannot)


def _the_path_before_session_9(tl: Timeline) -> None:
    """Undo issue 13 session 9's cuts, for a comparison in the same run: each child's move
    to ``running`` one commit on the event loop, and its first ping retried from 20 ms."""
    import torpor.sandbox.vm.channel as channel
    from torpor.sandbox.manager.core import ManagerCore

    async def one_by_one(
        self: ManagerCore, recs: Any, dst: Any, reason: str = "", **columns: Any
    ) -> Any:
        return [self.move(rec, dst, reason, **columns) for rec in recs]

    tl.patch(ManagerCore, "move_many", one_by_one)
    tl.patch(channel, "CLONE_FIRST_PING_RETRY", channel.FIRST_PING_RETRY)


def install_cpu(tl: Timeline, samples: dict[str, dict[str, Any]]) -> None:
    """Note each child's QEMU pid once it started, and its CPU when QMP first answers, when
    its state starts loading and at ``cont`` (into ``samples``)."""
    from torpor.sandbox.vm.machine_dir import qemu_pid

    def started(a: tuple[Any, ...], k: dict[str, Any]) -> None:
        pid = qemu_pid(a[0].directory)
        if pid is not None:
            tl.pids[_short(a[0].directory)] = pid

    keys = {"migrate-set-capabilities": "at_qmp", "getfd": "at_load", "cont": "at_cont"}

    def sample(a: tuple[Any, ...], k: dict[str, Any]) -> None:
        if a[1] in keys and tl.t0 is not None:
            who = _short(a[0].directory)
            got = samples.setdefault(who, {})
            got[keys[a[1]]] = _cpu_ms(tl.pids.get(who))
            got["faults_" + keys[a[1]]] = _faults(tl.pids.get(who))

    tl.wrap("torpor.sandbox.vm.machine:QemuMachine", "_start", lambda a, k: "-", after=started)
    tl.wrap("torpor.sandbox.vm.machine:QemuMachine", "_qmp_exec", lambda a, k: "-", after=sample)
    install_pings(tl, samples)


def install_pings(tl: Timeline, samples: dict[str, dict[str, Any]]) -> None:
    """Note, per child, how its channel's first ping went (``GuestChannel.first_ping``: pings
    sent, the one answered), its QEMU's CPU once the answer came (``at_answer``: from
    ``at_cont``, the guest's CPU to its first answer) and the guest's own split of that wait
    (``wake_split``, ms after ``cont``)."""
    from torpor.sandbox.engine import QemuEngine
    from torpor.sandbox.vm.channel import wake_split

    connect = QemuEngine.connect

    async def noted(self: Any, machine: Any, directory: Path, **k: Any) -> Any:
        channel = await connect(self, machine, directory, **k)
        if tl.t0 is not None:
            who = _short(directory)
            got = samples.setdefault(who, {})
            got["at_answer"] = _cpu_ms(tl.pids.get(who))
            got["faults_at_answer"] = _faults(tl.pids.get(who))
            first = getattr(channel, "first_ping", {})
            got["pings"], got["answered"] = first.get("pings"), first.get("answered")
            resumed = getattr(machine, "resumed_at", None)
            marks = getattr(channel, "guest_marks", {})
            if resumed is not None and marks:
                got["split"] = {k: round(v, 1) for k, v in wake_split(marks, resumed).items()}
        return channel

    tl.patch(QemuEngine, "connect", noted)


def render(spans: list[dict[str, Any]], cpu: dict[str, dict[str, Any]], total: float) -> None:
    spans = sorted(spans, key=lambda s: s["start"])
    print(f"{'start':>8} {'end':>8} {'dur':>7}  {'who':8} {'thread':12} what")
    for s in spans:
        if s["what"].startswith("qmp query-"):
            continue
        print(
            f"{s['start']:8.1f} {s['end']:8.1f} {s['end'] - s['start']:7.1f}  {s['who']:8} "
            f"{s.get('thread', ''):12} {s['what']}"
            + (f" (CPU {s['cpu']} ms)" if "cpu" in s else "")
        )
    print(f"total {total:.1f} ms")
    moves: dict[str, float] = {}
    for s in spans:  # set_state runs inside set_states: count the outer call only
        if s["what"].startswith("registry -> running") and not (
            s["what"] == "registry -> running" and s.get("thread") != "MainThread"
        ):
            key = "event loop" if s.get("thread") == "MainThread" else "worker thread"
            moves[key] = moves.get(key, 0.0) + s["end"] - s["start"]
    print(f"moves to running, ms spent: { {k: round(v, 1) for k, v in moves.items()} }")
    for who, c in sorted(cpu.items()):
        print(
            "  "
            + who
            + ": QEMU CPU ms at QMP "
            + f"{c.get('at_qmp') or 0:.0f}, at load {c.get('at_load') or 0:.0f}, at cont "
            + f"{c.get('at_cont') or 0:.0f}"
            + f", at answer {c.get('at_answer') or 0:.0f}, at end {c.get('at_end') or 0:.0f}"
            + f"; page faults at QMP {c.get('faults_at_qmp')}, at cont {c.get('faults_at_cont')}"
            + f", at answer {c.get('faults_at_answer')}, at end {c.get('faults_at_end')}"
            + f"; pings {c.get('pings')}, answered #{c.get('answered')}"
            + (f"; guest after cont {c['split']}" if c.get("split") else "")
        )
    kids = [c for c in cpu.values() if c.get("at_answer") and c.get("at_cont")]
    if kids:
        to_answer = [c["at_answer"] - c["at_cont"] for c in kids]
        pings = [c.get("pings") or 0 for c in kids]
        print(
            f"children: QEMU CPU from cont to the first answer median "
            f"{statistics.median(to_answer):.0f} ms; pings sent {sorted(pings)}, answered "
            f"{sorted(c.get('answered') or 0 for c in kids)}"
        )


def _median(values: list[float | None]) -> str:
    got = [v for v in values if v is not None]
    return f"{statistics.median(got):.1f}" if got else "-"


def summarize(name: str, runs: list[dict[str, Any]], count: int) -> None:
    """Print the medians of one template's forks: wall time per child, the source's stop and
    its RAM copy's CPU, and each child's QEMU CPU from its start to QMP, from there to
    ``cont`` (the state's load) and from ``cont`` to the first answer."""
    if not runs:
        return
    kids = [c for r in runs for c in r["cpu"].values()]

    def span(r: dict[str, Any], what: str, key: str) -> float | None:
        got = [s for s in r["spans"] if s["what"] == what]
        if not got:
            return None
        return float(got[0]["cpu"] if key == "cpu" else got[0]["end"] - got[0]["start"])

    def part(c: dict[str, Any], a: str, b: str | None) -> float | None:
        if c.get(a) is None or (b is not None and c.get(b) is None):
            return None
        return float(c[a] - (c[b] if b else 0))

    loads = [r["load"] for r in runs]
    goal = 150.0 if count == 1 else 100.0  # issue 13's, per child, on a host whose floor is 36 ms
    scaled = [r["total_ms"] / count / (goal * r["floor_ms"] / ISSUE_FLOOR_MS) for r in runs]
    print(
        f"{name}: {len(runs)} forks of {count}, load {min(loads):.1f}-{max(loads):.1f}, QEMU start "
        f"floor {_median([r['floor_ms'] for r in runs])}; medians, ms: per child "
        f"{_median([r['total_ms'] / count for r in runs])} ({statistics.median(scaled):.2f} x the "
        f"{goal:.0f} ms goal scaled by each fork's floor), source stood still "
        f"{_median([r['downtime_ms'] for r in runs])}, RAM copy in the stop wall "
        f"{_median([span(r, 'RAM copy in the stop', 'wall') for r in runs])} / CPU "
        f"{_median([span(r, 'RAM copy in the stop', 'cpu') for r in runs])}; a child's QEMU "
        f"CPU to QMP {_median([part(c, 'at_qmp', None) for c in kids])}, QMP -> cont "
        f"{_median([part(c, 'at_cont', 'at_qmp') for c in kids])}, cont -> first answer "
        f"{_median([part(c, 'at_answer', 'at_cont') for c in kids])}"
        + (
            f"; the other children's RAM copies, CPU per copy {_median(copies)}"
            if (
                copies := [
                    s.get("cpu") for r in runs for s in r["spans"] if s["what"] == "fill_pending"
                ]
            )
            else ""
        )
    )


def flatness(runs: list[dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    """With several templates forked in turn: each one's fork time over the first template's
    fork just before it (the pair met the same load), median over the pairs; printed as
    PASS/FAIL against ``bench.lifecycle``'s limit for "flat in the guest's size"."""
    from bench.lifecycle import FLAT_LIMIT

    out = []
    first = [r for r in runs if r["template"] == names[0]]
    for name in names[1:]:
        pairs = zip(first, [r for r in runs if r["template"] == name], strict=False)
        ratios = [b["total_ms"] / a["total_ms"] for a, b in pairs]
        if not ratios:
            continue
        ratio = statistics.median(ratios)
        out.append({"template": name, "over": names[0], "ratio": ratio, "pairs": len(ratios)})
        print(
            f"{'PASS' if ratio <= FLAT_LIMIT else 'FAIL'} flat: a fork of {name} is {ratio:.2f} "
            f"x one of {names[0]} (median of {len(ratios)} pairs forked in turn, "
            f"<= {FLAT_LIMIT})"
        )
    return out


async def run(args: argparse.Namespace, home: Path) -> dict[str, Any]:
    from torpor.config import paths
    from torpor.sandbox.checkpoints import Checkpoints
    from torpor.sandbox.manager import SandboxManager
    from torpor.sandbox.vm.machine_dir import qemu_pid

    p = paths(home)
    manager = SandboxManager(p)
    await manager.start(supervise=False)
    cp = Checkpoints(manager)
    tl = Timeline()
    if args.before:
        _the_path_before(tl)
    if args.before_9:
        _the_path_before_session_9(tl)
    install(tl)
    cont_cpu: dict[str, dict[str, Any]] = {}
    install_cpu(tl, cont_cpu)
    runs: list[dict[str, Any]] = []
    try:
        from bench.snapshots import _start_floor
        from torpor.sandbox import template as templates

        tdir = Path(templates.get("python").snapshot_dir)
        # one source per template (guest size), forked in turn: the sizes meet the same load
        names = args.template.split(",")
        sources: dict[str, Any] = {}
        snaps: dict[str, Any] = {}
        for name in names:
            mib = templates.get(name).memory_mib
            src = await manager.create(name=f"tl-src-{name}", template=name, memory_mib=mib)
            await manager.run_code(src.id, "data = [i * i for i in range(200_000)]")
            sources[name] = src
            if args.of_snapshot:
                snaps[name] = await cp.snapshot(src.id, name=f"tl-snap-{name}")
                await cp.wait_stored(snaps[name].id)
                await cp.settle()
        for _, name in ((r, n) for r in range(args.reps) for n in names):
            src, snap = sources[name], snaps.get(name)
            await cp.settle()
            floor = await _start_floor(tdir, p.cache) * 1000  # beside this fork: load drifts
            load = os.getloadavg()[0]
            tl.spans, tl.pids = [], {}
            cont_cpu.clear()
            src_pid = qemu_pid(manager.directory(src.id))
            src_cpu0 = _cpu_ms(src_pid)
            times0, stat0, th0 = os.times(), _stat(), _threads()
            tl.t0 = time.perf_counter()
            if snap is not None:
                kids = await cp.fork_snapshot(snap.id, count=args.count)
            else:
                kids = await cp.fork(src.id, count=args.count)
            total = tl.now()
            tl.t0 = None
            times1, stat1, th1 = os.times(), _stat(), _threads()
            print(f"page cache MiB at the end: {_vmstat()}")
            cpu = {
                who: {
                    **cont_cpu.get(who, {}),
                    "at_end": _cpu_ms(pid),
                    "faults_at_end": _faults(pid),
                }
                for who, pid in tl.pids.items()
            }
            qemu_sum = sum(c["at_end"] or 0 for c in cpu.values())
            own = (times1.user - times0.user + times1.system - times0.system) * 1000
            busy = {k: (stat1[k] - stat0[k]) * 10 for k in stat0}
            print(
                f"CPU ms: children's QEMUs {qemu_sum:.0f}, this process {own:.0f} "
                f"(user {1000 * (times1.user - times0.user):.0f}), source QEMU "
                f"{(_cpu_ms(src_pid) or 0) - (src_cpu0 or 0):.0f}; threads "
                f"{ {k: round(v - th0.get(k, 0.0)) for k, v in th1.items()} }; "
                f"host (all CPUs) {busy}; load {load:.2f}"
            )
            render(tl.spans, cpu, total)
            down = cp.last_downtime if snap is None else None
            parts = getattr(manager.live(src.id).machine, "last_capture", {})
            if down is not None:
                print(f"the source stood still {down * 1000:.1f} ms (stop -> cont): {parts}")
            runs.append(
                {
                    "template": name,
                    "total_ms": total,
                    "floor_ms": floor,
                    "load": load,
                    "downtime_ms": None if down is None else down * 1000,
                    "capture_parts_ms": dict(parts) if down is not None else None,
                    "spans": list(tl.spans),
                    "cpu": cpu,
                }
            )
            for kid in kids:
                await manager.kill(kid.id)
        for src in sources.values():
            await manager.kill(src.id)
    finally:
        tl.close()
        await cp.settle()
        for info in await manager.list():
            with contextlib.suppress(Exception):
                await manager.kill(info.id)
        await manager.close(pause=False)
    names = args.template.split(",")
    for name in names:
        summarize(name, [r for r in runs if r["template"] == name], args.count)
    flat = flatness(runs, names)
    return {
        "flatness": flat,
        "count": args.count,
        "template": args.template,
        "before": args.before,
        "before_9": args.before_9,
        "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=10)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--template",
        default="python",
        help="the source's template; several, comma-separated (python,python-2g): one source "
        "each, forked in turn in the same process",
    )
    parser.add_argument("--of-snapshot", action="store_true", help="fork a snapshot id")
    parser.add_argument(
        "--before",
        action="store_true",
        help="the path before issue 13 session 8 (one registry commit per child, no "
        "preallocation), to compare in the same run",
    )
    parser.add_argument(
        "--before-9",
        action="store_true",
        help="the path before issue 13 session 9 (one registry commit per child's move to "
        "running, first pings retried from 20 ms), to compare in the same run",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    with bench_home() as home:
        result = asyncio.run(run(args, home))
    write_results(args.out, json.loads(json.dumps(result, default=str)))


if __name__ == "__main__":
    main()
