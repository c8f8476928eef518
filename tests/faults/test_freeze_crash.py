"""A crash at every step of freezing a sandbox (under snapshot and fork) loses nothing.

Freezing once moved the machine's disk into the frozen dir before its replacement overlay
existed: a SIGKILL in between left a sandbox with no disk, and GC offered to delete the orphan
that held the only copy. Each step here is a deterministic crash point (``snapshots.failpoint``
raising a BaseException nothing catches, as a dying process would); after each, as after a
restart, GC runs, and the machine must still hold its whole disk and freeze again.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.sandbox.storage_helpers import make_home, make_machine, qemu_io
from torpor.sandbox.storage import retention
from torpor.sandbox.storage import snapshots as snapmod
from torpor.sandbox.storage.retention import collect_garbage
from torpor.sandbox.storage.snapshots import SnapshotStore, freeze, freeze_live
from torpor.sandbox.vm.disk import is_qcow2, virtual_size
from torpor.sandbox.vm.machine_dir import clone_pending, fill_pending, link_state


class Crash(BaseException):
    """The process dies here (nothing below catches a BaseException)."""


@pytest.fixture
def crash_at(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    steps: list[str] = []  # steps[0]: where to crash

    def failpoint(name: str) -> None:
        if steps and name == steps[0]:
            raise Crash(name)

    monkeypatch.setattr(snapmod, "failpoint", failpoint)
    yield steps


def _disk_is_whole(machine: Path) -> None:
    disk = machine / "disk.qcow2"
    assert is_qcow2(disk)
    assert "read 65536" in qemu_io(disk, "read -P 0x42 2M 64k")  # the machine's own write
    assert "read 1048576" in qemu_io(disk, "read -P 0x11 0 1M")  # the template's data


@pytest.mark.parametrize("step", ["freeze:copied", "freeze:published", "freeze:swapped"])
@pytest.mark.parametrize("link_ram", [False, True], ids=["snapshot", "fork"])
def test_a_crash_at_any_step_of_a_freeze_loses_nothing(
    tmp_path: Path, crash_at: list[str], step: str, link_ram: bool
) -> None:
    p = make_home(tmp_path)
    machine = make_machine(p, "sb1")
    store = SnapshotStore(p)
    crash_at.append(step)
    with pytest.raises(Crash):
        freeze(machine, store.frozen_root, link_ram=link_ram)
    crash_at.clear()
    _disk_is_whole(machine)
    collect_garbage(p)  # after the restart: GC must not take what the machine stands on
    _disk_is_whole(machine)
    qemu_io(machine / "disk.qcow2", "write -P 0x55 6M 64k")  # the machine runs on
    frozen = freeze(machine, store.frozen_root)  # and freezes again
    info = store.save(frozen, name="after-crash")
    out = store.materialize(info.id)
    assert "read 65536" in qemu_io(out / "disk.qcow2", "read -P 0x55 6M 64k")
    assert "read 65536" in qemu_io(out / "disk.qcow2", "read -P 0x42 2M 64k")


def _copy_into(src: Path, dst: Path, in_place: bool) -> None:
    with open(src, "rb") as fin, open(dst, "r+b" if in_place else "wb") as fout:
        shutil.copyfileobj(fin, fout)


class FakeLiveMachine:
    """The file side of a live capture, without QEMU (what the storage layer relies on): the
    disk name moves to the overlay at the switch, then device state and a RAM copy appear."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    async def capture(
        self,
        *,
        overlay: Path,
        state: Path,
        ram: Path,
        stopped: Callable[[str], None] | None = None,
        fill_ram: bool = False,
        precopy: bool = False,
    ) -> float:
        assert fill_ram == ram.exists()  # a fork's child maps it already: filled in place
        if precopy:  # while the guest runs: a first copy the one in the stop writes over
            _copy_into(self.directory / "ram", ram, fill_ram)
        os.link(overlay, self.directory / ".disk.qcow2.link")
        os.replace(self.directory / ".disk.qcow2.link", self.directory / "disk.qcow2")
        for old in self.directory.glob(".disk-*.qcow2"):  # the old top's name: done with
            if old != overlay:
                old.unlink()
        if stopped is not None:
            stopped("capture:swapped")
        state.write_bytes((self.directory / "state").read_bytes())
        _copy_into(self.directory / "ram", ram, fill_ram or precopy)
        if stopped is not None:
            stopped("capture:saved")
        return 0.001


@pytest.mark.parametrize(
    "step",
    ["freeze:copied", "freeze:published", "capture:swapped", "capture:saved", "freeze:captured"],
)
def test_a_crash_at_any_step_of_a_live_freeze_loses_nothing(
    tmp_path: Path, crash_at: list[str], step: str
) -> None:
    p = make_home(tmp_path)
    machine = make_machine(p, "sb1")
    store = SnapshotStore(p)
    crash_at.append(step)
    with pytest.raises(Crash):
        asyncio.run(freeze_live(machine, store.frozen_root, FakeLiveMachine(machine)))
    crash_at.clear()
    _disk_is_whole(machine)
    collect_garbage(p)  # after the restart: GC must not take what the machine stands on
    _disk_is_whole(machine)
    qemu_io(machine / "disk.qcow2", "write -P 0x55 6M 64k")  # the machine runs on
    frozen, _ = asyncio.run(freeze_live(machine, store.frozen_root, FakeLiveMachine(machine)))
    aliases = list(machine.glob(".disk-*.qcow2"))  # the name QEMU opened the overlay by
    assert len(aliases) == 1 and aliases[0].samefile(machine / "disk.qcow2")
    info = store.save(frozen, name="after-crash")
    out = store.materialize(info.id)
    assert "read 65536" in qemu_io(out / "disk.qcow2", "read -P 0x55 6M 64k")
    assert "read 65536" in qemu_io(out / "disk.qcow2", "read -P 0x42 2M 64k")
    assert (out / "ram").read_bytes() == (machine / "ram").read_bytes()


@pytest.mark.parametrize("count", [1, 2], ids=["one-child", "two-children"])
@pytest.mark.parametrize(
    "step",
    ["freeze:copied", "freeze:published", "capture:swapped", "capture:saved", "freeze:captured"],
)
def test_a_crash_while_fork_children_wait_loses_nothing(
    tmp_path: Path, crash_at: list[str], step: str, count: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The children of a fork from a running source are made before the stop
    (``published``): the last one's RAM is a link to the frozen dir's ``ram.tmp``, any other
    has a RAM file of its own, filled from it after the stop. A crash at any step leaves the
    source whole and GC leaves no frozen RAM behind once the children's directories are gone
    (children that were never woken are removed at the restart)."""
    p = make_home(tmp_path)
    machine = make_machine(p, "sb1")
    store = SnapshotStore(p)
    kids = [p.sandboxes / f"child{i}" for i in range(count)]
    size = virtual_size(machine / "disk.qcow2")

    async def published(frozen: Path) -> None:
        assert (frozen / "ram.tmp").stat().st_size == (machine / "ram").stat().st_size
        for i, kid in enumerate(kids):
            clone_pending(frozen, kid, size=size, own_ram=i < count - 1)

    def saved(state: Path) -> None:  # inside the stop: the state, linked into each child
        for kid in kids:
            link_state(state, kid)

    crash_at.append(step)
    with pytest.raises(Crash):
        asyncio.run(
            freeze_live(
                machine,
                store.frozen_root,
                FakeLiveMachine(machine),
                for_clones=True,
                published=published,
                saved=saved,
            )
        )
    crash_at.clear()
    for kid in kids:
        shutil.rmtree(kid, ignore_errors=True)  # the restart removes children that never ran
    _disk_is_whole(machine)
    monkeypatch.setattr(retention, "LEFTOVER_GRACE_SECONDS", 0.0)  # as if later
    collect_garbage(p)
    _disk_is_whole(machine)
    assert not [f for f in store.frozen_root.rglob("ram*") if f.is_file()]
    qemu_io(machine / "disk.qcow2", "write -P 0x55 6M 64k")  # the machine runs on
    frozen, _ = asyncio.run(
        freeze_live(
            machine,
            store.frozen_root,
            FakeLiveMachine(machine),
            for_clones=True,
            published=published,
            saved=saved,
        )
    )
    assert (kids[-1] / "ram").samefile(frozen / "ram")  # filled in place: the last child's
    for kid in kids[:-1]:  # the others' own RAM files, filled after the stop
        assert not (kid / "ram").samefile(frozen / "ram")
        fill_pending(kids[-1] / "ram", kid)
    for kid in kids:
        assert (kid / "state").samefile(frozen / "state")
        assert (kid / "ram").read_bytes() == (machine / "ram").read_bytes()


def test_a_failing_fork_child_start_undoes_the_freeze(tmp_path: Path) -> None:
    """``published`` raising (the child could not start) leaves no frozen RAM and the source
    on a whole disk, and the error is the one raised."""
    p = make_home(tmp_path)
    machine = make_machine(p, "sb1")
    store = SnapshotStore(p)

    async def published(frozen: Path) -> None:
        raise RuntimeError("no room for the child")

    with pytest.raises(RuntimeError, match="no room"):
        asyncio.run(
            freeze_live(
                machine,
                store.frozen_root,
                FakeLiveMachine(machine),
                for_clones=True,
                published=published,
            )
        )
    _disk_is_whole(machine)
    assert not [f for f in store.frozen_root.rglob("ram*") if f.is_file()]
    assert not list(machine.glob(".disk-*.qcow2"))
