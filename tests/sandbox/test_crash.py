"""Crash safety on real QEMU: SIGKILL QEMU, or the manager's own process, in the middle of a
pause or a wake, then restart a manager on the same home.

Afterwards the sandbox either wakes from its last complete state (the interpreter's variable
is still there) or reports StateLost naming what was lost, and at no moment does the registry
claim a state that the files do not back (``paused`` => a whole state file and no QEMU).
The manager under test runs in a subprocess (``WORKER`` below) so it can really be SIGKILLed.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from torpor.config import paths
from torpor.errors import StateLost
from torpor.sandbox.engine import QemuEngine
from torpor.sandbox.manager import SandboxManager
from torpor.sandbox.models import SandboxState as S
from torpor.sandbox.registry import Registry

pytestmark = pytest.mark.qemu

WORKER = r'''
import asyncio, json, os, signal, sys, threading, time
from pathlib import Path
from torpor.config import paths
from torpor.errors import TorporError
from torpor.sandbox.manager import SandboxManager

phase, step, action = sys.argv[1:4]

def kill_when(ready):
    """SIGKILL the pid `ready()` returns as soon as it returns one (a watcher thread)."""
    def watch():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            pid = ready()
            if pid:
                os.kill(pid, signal.SIGKILL)
                return
            time.sleep(0.0005)
    threading.Thread(target=watch, daemon=True).start()

async def main():
    mgr = SandboxManager(paths())
    await mgr.start(supervise=False)
    info = await mgr.create(name="crashy")
    directory = mgr.directory(info.id)
    await mgr.run_code(info.id, "v = 'kept-in-ram'")
    await mgr.write_file(info.id, "/root/disk.txt", "on disk")
    if phase == "wake":
        await mgr.pause(info.id)
    pid = lambda: mgr.engine.inspect(directory).qemu_pid

    def hook(name, sandbox_id):
        if name != step:
            return
        if action == "manager":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "qemu":
            mgr.engine.terminate(directory)
        elif action == "qemu-mid-save":  # while the device state is being written
            kill_when(lambda: (directory / "state.tmp").exists() and pid())
        elif action == "qemu-before-cont":  # the new QEMU exists, the guest has not run yet
            kill_when(pid)
        elif action == "manager-mid-save":  # QEMU is writing state.tmp; nobody will rename it
            kill_when(lambda: (directory / "state.tmp").exists() and os.getpid())
        elif action == "manager-before-cont":  # the new QEMU is loading the state
            kill_when(lambda: pid() and os.getpid())

    mgr.on_step = hook
    outcome = "ok"
    if phase == "snapshot":  # a live snapshot: the manager dies at a step of its capture
        from torpor.sandbox.checkpoints import Checkpoints
        from torpor.sandbox.storage import snapshots as snapmod

        def failpoint(name):
            if name == step:
                os.kill(os.getpid(), signal.SIGKILL)

        snapmod.failpoint = failpoint
        await Checkpoints(mgr).snapshot(info.id, name="crashy-snap")
        return
    try:
        await (mgr.pause(info.id) if phase == "pause" else mgr.resume(info.id))
    except TorporError as exc:
        outcome = type(exc).__name__
    print(json.dumps({"id": info.id, "outcome": outcome}), flush=True)
    await mgr.close(pause=False)

asyncio.run(main())
'''


def _check_registry_backed(home: Path) -> dict[str, Any]:
    """The invariant: every registry state is backed by the directory's files."""
    reg = Registry(home / "registry.db")
    try:
        rows = reg.list()
    finally:
        reg.close()
    engine = QemuEngine(paths(home))
    seen = {}
    for rec in rows:
        status = engine.inspect(home / "sandboxes" / rec.id)
        if rec.state is S.PAUSED:
            assert status.has_state, f"registry says paused but {rec.id} has no whole state"
            assert status.qemu_pid is None
        if rec.state is S.RUNNING:
            assert status.qemu_pid is not None, f"registry says running but no QEMU: {rec.id}"
        seen[rec.id] = rec.state
    return seen


#: (phase, step, action) -> the outcomes allowed: "intact" (wakes with RAM) or "lost"
CASES = [
    pytest.param("pause", "pause:begin", "manager", {"intact"}, id="manager-dies-pause-begin"),
    pytest.param("pause", "pause:saved", "manager", {"intact"}, id="manager-dies-state-saved"),
    pytest.param("wake", "wake:begin", "manager", {"intact"}, id="manager-dies-wake-begin"),
    pytest.param("wake", "wake:woken", "manager", {"intact"}, id="manager-dies-after-cont"),
    pytest.param(
        "pause", "pause:begin", "manager-mid-save", {"intact"}, id="manager-dies-mid-save"
    ),
    pytest.param(
        "wake", "wake:begin", "manager-before-cont", {"intact"}, id="manager-dies-before-cont"
    ),
    pytest.param("pause", "pause:begin", "qemu", {"lost"}, id="qemu-dies-before-save"),
    # a race with the rename: killed mid-save is lost, killed just after it is intact
    pytest.param(
        "pause", "pause:begin", "qemu-mid-save", {"lost", "intact"}, id="qemu-dies-mid-save"
    ),
    # after the state is saved QEMU has already quit: nothing left to kill, the pause stands
    pytest.param("pause", "pause:saved", "qemu", {"intact"}, id="qemu-killed-state-saved"),
    pytest.param("wake", "wake:begin", "qemu-before-cont", {"intact"}, id="qemu-dies-before-cont"),
    pytest.param("wake", "wake:woken", "qemu", {"lost"}, id="qemu-dies-after-cont"),
    # a live snapshot: the manager dies while the guest is stopped, after QEMU switched to the
    # new overlay (the restart adopts it and runs the guest on), and after the state was saved
    pytest.param(
        "snapshot", "capture:switched", "manager", {"intact"}, id="manager-dies-capture-switched"
    ),
    pytest.param(
        "snapshot", "capture:swapped", "manager", {"intact"}, id="manager-dies-capture-swapped"
    ),
    pytest.param(
        "snapshot", "capture:saved", "manager", {"intact"}, id="manager-dies-capture-saved"
    ),
]


@pytest.mark.parametrize(("phase", "step", "action", "allowed"), CASES)
def test_crash_then_restart(
    qemu_home: Path, tmp_path: Path, phase: str, step: str, action: str, allowed: set[str]
) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    proc = subprocess.run(
        [sys.executable, str(script), phase, step, action],
        env={**os.environ, "TORPOR_HOME": str(qemu_home)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if action.startswith("manager"):
        assert proc.returncode == -9, proc.stderr[-3000:]
    else:
        assert proc.returncode == 0, proc.stderr[-3000:]
    # Right after the crash, before any recovery: the registry claims nothing unbacked.
    states = _check_registry_backed(qemu_home)
    assert len(states) == 1
    sandbox_id = next(iter(states))

    async def recover() -> str:
        mgr = SandboxManager(paths(qemu_home))
        try:
            await mgr.start(supervise=False)
            _check_registry_backed(qemu_home)
            info = await mgr.get(sandbox_id)
            if info.state is S.ERROR:
                with pytest.raises(StateLost) as err:
                    await mgr.run_code(sandbox_id, "v")
                lost = err.value.data["lost"]
                assert "RAM and processes since" in lost and "disk kept" in lost
                assert (mgr.directory(sandbox_id) / "disk.qcow2").exists()  # disk kept
                return "lost"
            assert info.state in (S.PAUSED, S.RUNNING)
            assert (await mgr.run_code(sandbox_id, "v")).text == "'kept-in-ram'"
            assert await mgr.read_file(sandbox_id, "/root/disk.txt") == b"on disk"
            if phase == "snapshot":  # the disk name follows what QEMU writes: a wake sees it
                await mgr.run_command(sandbox_id, "echo after > /root/after.txt && sync")
                await mgr.pause(sandbox_id)
                await mgr.resume(sandbox_id)
                assert await mgr.read_file(sandbox_id, "/root/after.txt") == b"after\n"
                assert await mgr.read_file(sandbox_id, "/root/disk.txt") == b"on disk"
            return "intact"
        finally:
            await mgr.kill(sandbox_id)
            await mgr.close()

    outcome = asyncio.run(recover())
    assert outcome in allowed, (outcome, proc.stdout, proc.stderr[-2000:])
    if not action.startswith("manager"):
        reported = json.loads(proc.stdout.strip().splitlines()[-1])["outcome"]
        # the worker saw the failure as it happened: StateLost when lost, else no loss
        assert (reported == "StateLost") == (outcome == "lost"), reported
