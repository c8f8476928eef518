"""The clone pool (no VM: a hibernated machine dir on real qcow2 files stands for a template's
booted machine, a ``sleep`` for a warm clone's QEMU; creates through the pool on real QEMU
are in test_wake.py and test_live_snapshot.py)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.sandbox.storage_helpers import make_home, make_machine
from torpor.sandbox.storage.snapshots import backing_file
from torpor.sandbox.vm.pool import TENANT_FILE, ClonePool, pool_size_from_env, process_token


def _template(tmp_path: Path, build: str) -> Path:
    """A template build dir ``<build>/snapshot`` holding a hibernated machine."""
    home = tmp_path / "home"
    if home.exists():
        machine = home / "sandboxes" / "booted"
    else:
        machine = make_machine(make_home(tmp_path), "booted")
    snap = home / "templates" / "python" / build / "snapshot"
    snap.parent.mkdir(parents=True)
    shutil.copytree(machine, snap)
    return snap


def _wait_ready(pool: ClonePool, snap: Path, n: int) -> None:
    deadline = time.monotonic() + 30
    while len(pool.ready("python", snap)) < n:
        assert time.monotonic() < deadline, "the pool was not refilled"
        time.sleep(0.02)
    time.sleep(0.05)  # let the filler finish its loop


def _warm_entry(pool_root: Path, name: str, *, orphan: bool) -> tuple[Path, int]:
    """A ready pool entry with a process standing for its warm QEMU (a ``sleep`` whose cwd
    is the entry, named by ``qemu.pid``), made by this process or by one that has exited
    (its server died)."""
    entry = pool_root / "python" / "b1" / name
    entry.mkdir(parents=True)
    if orphan:  # made by a shell that exits at once (a server that died)
        maker = subprocess.Popen(["sh", "-c", "sleep 60 & echo $! > qemu.pid"], cwd=entry)
        owner = process_token(maker.pid)
        maker.wait()
        pid = int((entry / "qemu.pid").read_text())
    else:
        owner = process_token(os.getpid())
        pid = subprocess.Popen(["sleep", "60"], cwd=entry).pid
        (entry / "qemu.pid").write_text(str(pid))
    (entry / TENANT_FILE).write_text(f"default\n{owner}\n")
    return entry, pid


def _gone(pid: int) -> bool:
    for _ in range(500):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except FileNotFoundError:
            return True
        if stat.rsplit(")", 1)[1].split()[0] in ("Z", "X"):
            return True
        time.sleep(0.01)
    return False


def test_a_pool_is_filled_taken_from_and_refilled(tmp_path: Path) -> None:
    snap = _template(tmp_path, "b1")
    pool = ClonePool(tmp_path / "pool", 2)
    assert not pool.take("python", snap, tmp_path / "sbx-0")  # empty: the caller clones
    pool.refill_soon("python", snap)
    _wait_ready(pool, snap, 2)
    target = tmp_path / "sbx-1"
    target.mkdir()  # an empty dir made by the caller is fine
    assert pool.take("python", snap, target)
    assert {"ram", "state", "disk.qcow2", "machine.json"} <= {p.name for p in target.iterdir()}
    assert (target / "ram").read_bytes() == (snap / "ram").read_bytes()
    assert backing_file(target / "disk.qcow2") == snap.resolve() / "disk.qcow2"
    ids = [json.loads((d / "machine.json").read_text()).get("vmgenid") for d in (target, snap)]
    assert ids[0] is not None and ids[0] != ids[1]  # a new generation
    assert len(pool.ready("python", snap)) == 1
    pool.refill_soon("python", snap)
    _wait_ready(pool, snap, 2)
    assert len(pool.ready("python", snap)) == 2


def test_a_rebuilt_template_and_half_made_clones_are_dropped(tmp_path: Path) -> None:
    old = _template(tmp_path, "b1")
    pool = ClonePool(tmp_path / "pool", 1)
    pool.refill_soon("python", old)
    _wait_ready(pool, old, 1)
    _, old_qemu = _warm_entry(pool.root, "warm", orphan=False)  # the old build's, running
    new = _template(tmp_path, "b2")
    half = tmp_path / "pool" / "python" / "b2" / ".dead.tmp"
    half.mkdir(parents=True)
    assert not pool.take("python", new, tmp_path / "sbx")  # the old build's clone is not used
    pool.refill_soon("python", new)
    _wait_ready(pool, new, 1)
    assert not (tmp_path / "pool" / "python" / "b1").exists()
    assert _gone(old_qemu)  # its QEMU went with it
    assert not half.exists()


def test_no_pool_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORPOR_CLONE_POOL", raising=False)
    assert pool_size_from_env() == 0
    monkeypatch.setenv("TORPOR_CLONE_POOL", "3")
    assert pool_size_from_env() == 3
    monkeypatch.setenv("TORPOR_CLONE_POOL", "lots")
    assert pool_size_from_env() == 0
    monkeypatch.setenv("TORPOR_CLONE_POOL", "²")  # a digit to str.isdigit, not to int()
    assert pool_size_from_env() == 0


def test_a_sweep_kills_and_removes_what_a_dead_server_left_warm(tmp_path: Path) -> None:
    pool = ClonePool(tmp_path / "pool", 1)
    orphan, orphan_pid = _warm_entry(pool.root, "aaa", orphan=True)
    ours, our_pid = _warm_entry(pool.root, "bbb", orphan=False)
    half = pool.root / "python" / "b1" / ".ccc.tmp"
    half.mkdir()
    try:
        pool.sweep()
        assert _gone(orphan_pid) and not orphan.exists()
        assert not half.exists()
        assert ours.exists() and not _gone(our_pid)  # a live pool's (this process's) clone
        pool.close()  # the server stops: its warm clones go with their QEMU
        assert _gone(our_pid) and not ours.exists()
    finally:
        for pid in (orphan_pid, our_pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_warm_clone_of_another_tenant_is_not_taken(tmp_path: Path) -> None:
    snap = _template(tmp_path, "b1")
    pool = ClonePool(tmp_path / "pool", 1)
    entry, pid = _warm_entry(pool.root, "aaa", orphan=False)
    try:
        # its QEMU runs as the other tenant's uid: removed, and the caller clones
        assert not pool.take("python", snap, tmp_path / "sbx", "acme")
        assert _gone(pid) and not entry.exists()
        assert pool.tenant == "acme"  # the next clones are warmed for the last taker
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_gc_sweeps_the_pool_a_dead_server_left(tmp_path: Path) -> None:
    from torpor.sandbox.storage.retention import collect_garbage

    p = make_home(tmp_path)
    pool_root = p.cache / "pool"
    orphan, orphan_pid = _warm_entry(pool_root, "aaa", orphan=True)
    ours, our_pid = _warm_entry(pool_root, "bbb", orphan=False)  # a live server's
    try:
        collect_garbage(p)
        assert _gone(orphan_pid) and not orphan.exists()
        assert ours.exists() and not _gone(our_pid)
    finally:
        for pid in (orphan_pid, our_pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_warm_up_refused_at_exit_leaves_no_qemu_behind(tmp_path: Path) -> None:
    snap = _template(tmp_path, "b1")
    started: list[int] = []

    def warm(directory: Path, template: str, tenant: str) -> None:
        started.append(subprocess.Popen(["sleep", "60"], cwd=directory).pid)
        (directory / "qemu.pid").write_text(str(started[-1]))
        # what asyncio raises in a filler thread once the interpreter is exiting
        raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    pool = ClonePool(tmp_path / "pool", 1, warm=warm)
    pool.refill_soon("python", snap)
    deadline = time.monotonic() + 30
    while pool._filling and time.monotonic() < deadline:
        time.sleep(0.02)
    assert started and _gone(started[0])  # its "QEMU" was killed ...
    assert list((tmp_path / "pool" / "python" / "b1").iterdir()) == []  # ... and removed
