"""A crash at each step of a drive attach, and while a sandbox with a drive hibernates or
wakes, on real QEMU (issue 12: crash points for attach; a 9p device without its record).

One sandbox, one home, four rounds. In each, a worker process (a manager of its own) runs one
operation and is SIGKILLed at a deterministic step; QEMU outlives it, as it would a server
crash. Then a new manager starts on the home and recovers as the server does
(``Checkpoints.recover``), and:

* the registry claims nothing its files do not back (``tests/sandbox/test_crash.py``),
* the interpreter's variable is still in RAM,
* every drive whose share the machine has is recorded as attached, and mounted in the guest:
  a file written there from the guest is on the host, in the drive's directory,
* and it stays so across one more hibernate and wake.

The steps: ``attach:plugged`` (share plugged, record not written: the record is restored),
``attach:recorded`` (recorded, not mounted: mounted at recovery), and a pause killed at
``pause:saved`` and a wake at ``wake:woken`` with both drives attached.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.sandbox.test_crash import _check_registry_backed
from torpor.config import paths
from torpor.sandbox.checkpoints import Checkpoints
from torpor.sandbox.engine import QemuEngine
from torpor.sandbox.manager import SandboxManager
from torpor.sandbox.models import SandboxState as S

pytestmark = pytest.mark.qemu

WORKER = r"""
import asyncio, os, signal, sys
from torpor.config import paths
from torpor.sandbox.checkpoints import Checkpoints
from torpor.sandbox.manager import SandboxManager
from torpor.sandbox.storage import snapshots as snapmod

op, step, arg = sys.argv[1:4]

def die(name, *_):
    if name == step:
        os.kill(os.getpid(), signal.SIGKILL)  # no finally, no cleanup: a crash

async def main():
    mgr = SandboxManager(paths())
    await mgr.start(supervise=False)
    cp = Checkpoints(mgr)
    mgr.on_step = die
    snapmod.failpoint = die
    if op == "create":
        info = await mgr.create(name="drv")
        await mgr.run_code(info.id, "v = 'kept-in-ram'")
        await mgr.close(pause=False)  # QEMU runs on for the next manager
        return
    sid = (await mgr.get("drv")).id
    if op == "attach":
        drive = cp.drives.create(arg)
        await cp.attachments.attach_drive(sid, drive=drive.id, path=f"/mnt/{arg}")
    elif op == "pause":
        await mgr.pause(sid)
    elif op == "resume":
        await mgr.pause(sid)
        await mgr.resume(sid)
    sys.exit(3)  # the step was never reached

asyncio.run(main())
"""

ROUNDS = [
    ("attach", "attach:plugged", "first"),
    ("attach", "attach:recorded", "second"),
    ("pause", "pause:saved", ""),
    ("resume", "wake:woken", ""),
]


def _worker(script: Path, home: Path, op: str, step: str, arg: str) -> int:
    proc = subprocess.run(
        [sys.executable, str(script), op, step, arg],
        env={**os.environ, "TORPOR_HOME": str(home), "PYTHONPATH": os.pathsep.join(sys.path)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if op == "create":
        assert proc.returncode == 0, proc.stderr[-3000:]
    else:
        assert proc.returncode == -9, (step, proc.returncode, proc.stderr[-3000:])
    return proc.returncode


async def _check(home: Path, names: list[str], round_no: int) -> None:
    mgr = SandboxManager(paths(home))
    await mgr.start(supervise=False)
    try:
        _check_registry_backed(home)
        cp = Checkpoints(mgr)
        await cp.recover()
        info = await mgr.get("drv")
        assert info.state in (S.PAUSED, S.RUNNING), info.state
        assert (await mgr.run_code(info.id, "v")).text == "'kept-in-ram'"

        async def drives_work(tag: str) -> None:
            attached = {d.name: a for d, a in cp.drives.attached_to(info.id)}
            assert sorted(attached) == sorted(names), attached
            for name in names:
                drive = cp.drives.get(name)
                note = f"{tag}-{round_no}-{name}"
                await mgr.write_file(info.id, f"/mnt/{name}/{note}.txt", note)
                # the guest's file is the host's: the drive is mounted, not a plain directory
                assert (cp.drives.directory(drive.id) / f"{note}.txt").read_text() == note

        await drives_work("recovered")
        await mgr.pause(info.id)
        await mgr.resume(info.id)
        assert (await mgr.run_code(info.id, "v")).text == "'kept-in-ram'"
        await drives_work("after-wake")
        if round_no == len(ROUNDS) - 1:
            await mgr.kill(info.id)
    finally:
        await mgr.close(pause=False)


def _check_in_a_process(home: Path, names: list[str], round_no: int) -> None:
    """:func:`_check` in a process of its own, as a restarted server: a manager closed
    without pausing keeps its QMP connection while its process lives, and QEMU serves one
    QMP client at a time, so the next round's manager could not take the machine over."""
    code = (
        "import asyncio, sys; from pathlib import Path; "
        "from tests.faults.test_drive_crash import _check; "
        "asyncio.run(_check(Path(sys.argv[1]), sys.argv[3:], int(sys.argv[2])))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(home), str(round_no), *names],
        env={**os.environ, "TORPOR_HOME": str(home), "PYTHONPATH": os.pathsep.join(sys.path)},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, (ROUNDS[round_no], proc.stderr[-4000:])


def test_crash_at_each_step_of_a_drive_attach_and_of_a_hibernate_with_drives(
    qemu_home: Path, tmp_path: Path
) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    try:
        _worker(script, qemu_home, "create", "", "")
        names: list[str] = []
        for i, (op, step, arg) in enumerate(ROUNDS):
            _worker(script, qemu_home, op, step, arg)
            if arg:
                names.append(arg)
            _check_in_a_process(qemu_home, names, i)
    finally:  # a failed round leaves a QEMU that outlived its managers: stop it
        engine = QemuEngine(paths(qemu_home))
        for directory in (qemu_home / "sandboxes").glob("*"):
            pid = engine.inspect(directory).qemu_pid
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
