"""The clone pool (no VM: a hibernated machine dir on real qcow2 files stands for a template's
booted machine; a create through the pool on real QEMU is in test_live_snapshot.py)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from tests.sandbox.storage_helpers import make_home, make_machine
from torpor.sandbox.storage.snapshots import backing_file
from torpor.sandbox.vm.pool import ClonePool, pool_size_from_env


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
    assert "vmgenid" not in json.loads((target / "machine.json").read_text())  # a new one
    assert len(pool.ready("python", snap)) == 1
    pool.refill_soon("python", snap)
    _wait_ready(pool, snap, 2)
    assert len(pool.ready("python", snap)) == 2


def test_a_rebuilt_template_and_half_made_clones_are_dropped(tmp_path: Path) -> None:
    old = _template(tmp_path, "b1")
    pool = ClonePool(tmp_path / "pool", 1)
    pool.refill_soon("python", old)
    _wait_ready(pool, old, 1)
    new = _template(tmp_path, "b2")
    half = tmp_path / "pool" / "python" / "b2" / ".dead.tmp"
    half.mkdir(parents=True)
    assert not pool.take("python", new, tmp_path / "sbx")  # the old build's clone is not used
    pool.refill_soon("python", new)
    _wait_ready(pool, new, 1)
    assert not (tmp_path / "pool" / "python" / "b1").exists()
    assert not half.exists()


def test_no_pool_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORPOR_CLONE_POOL", raising=False)
    assert pool_size_from_env() == 0
    monkeypatch.setenv("TORPOR_CLONE_POOL", "3")
    assert pool_size_from_env() == 3
    monkeypatch.setenv("TORPOR_CLONE_POOL", "lots")
    assert pool_size_from_env() == 0
