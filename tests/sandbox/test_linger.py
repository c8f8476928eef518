"""A pause that keeps its stopped QEMU for a short window (torpor.sandbox.vm.linger), on real
QEMU (marked qemu): a wake within the window resumes the very same QEMU with the sandbox's
RAM and disk intact and the same registry transitions as a cold wake; past the window, with
linger off, over the count, with a file changed since the pause, or with its marker claimed by
a process that died before it resumed or killed it, the wake is cold (a new QEMU) and as
correct; another OS process can take the lingering QEMU over; a kill leaves no
QEMU; a manager killed in the window loses nothing.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.sandbox.procs import procs_on
from torpor.config import Linger, paths
from torpor.sandbox.engine import QemuEngine
from torpor.sandbox.manager import SandboxManager
from torpor.sandbox.models import SandboxState as S
from torpor.sandbox.vm.linger import CLAIMED, MARKER, read_marker
from torpor.sandbox.vm.machine_dir import qemu_pid

pytestmark = pytest.mark.qemu

#: the transitions of a pause and of a wake, warm or cold
PAUSE_WAKE = [
    ("running", "pausing"),
    ("pausing", "paused"),
    ("paused", "waking"),
    ("waking", "running"),
]


def _manager(home: Path, linger: Linger) -> SandboxManager:
    return SandboxManager(paths(home), engine=QemuEngine(paths(home), pool_size=0, linger=linger))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][:1] != "Z"
    except OSError:
        return False


async def _wait_gone(pid: int, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return not _alive(pid)


async def _prepared(m: SandboxManager, name: str) -> tuple[str, Path]:
    info = await m.create(name=name)
    await m.run_code(info.id, "v = 'kept-in-ram'")
    await m.write_file(info.id, "/root/disk.txt", "on disk")
    return info.id, m.directory(info.id)


async def _intact(m: SandboxManager, sandbox_id: str) -> None:
    assert (await m.run_code(sandbox_id, "v")).text == "'kept-in-ram'"
    assert await m.read_file(sandbox_id, "/root/disk.txt") == b"on disk"


def test_a_wake_within_the_window_resumes_the_same_qemu(qemu_home: Path) -> None:
    async def main() -> None:
        m = _manager(qemu_home, Linger(60, 4))
        try:
            sid, d = await _prepared(m, "warm")
            pid = qemu_pid(d)
            assert pid is not None
            await m.pause(sid)
            assert (await m.get(sid)).state is S.PAUSED
            assert (d / "state").is_file()  # durable as always: the QEMU is only kept
            marker = read_marker(d / MARKER)
            assert marker is not None and marker.kind == "linger" and marker.pid == pid
            assert procs_on(d) == [pid]
            await m.resume(sid)
            assert qemu_pid(d) == pid  # the very same QEMU, resumed
            assert not (d / MARKER).exists() and not (d / "state").exists()
            await _intact(m, sid)
            assert m.transitions(sid)[-4:] == PAUSE_WAKE
            await m.run_code(sid, "v2 = v.upper()")  # it runs on: and lingers again
            await m.pause(sid)
            await m.resume(sid)
            assert qemu_pid(d) == pid
            assert (await m.run_code(sid, "v2")).text == "'KEPT-IN-RAM'"
            await m.kill(sid)  # kill while running, then one while lingering below
            assert procs_on(d) == [] and not d.exists()
        finally:
            await m.close()

    asyncio.run(main())


def _touch_ram(d: Path) -> None:
    os.utime(d / "ram")  # written to, as far as its times say


def _replace_state(d: Path) -> None:
    shutil.copy2(d / "state", d / "state.copy")  # same bytes and mtime, another inode
    os.replace(d / "state.copy", d / "state")


def _claim_and_die(d: Path) -> None:
    os.rename(d / MARKER, d / f"{CLAIMED}1:0")  # claimed by a process that died at once


@pytest.mark.parametrize(
    ("linger", "meddle", "why"),
    [
        pytest.param(Linger(0, 4), None, "off", id="linger-off"),
        pytest.param(Linger(1.0, 4), None, "expired", id="window-over"),
        pytest.param(Linger(60, 4), _touch_ram, "changed", id="ram-touched"),
        pytest.param(Linger(60, 4), _replace_state, "changed", id="state-replaced"),
        pytest.param(Linger(60, 4), _claim_and_die, "claimed", id="claimer-died"),
    ],
)
def test_a_wake_that_cannot_use_the_lingering_qemu_is_cold_and_correct(
    qemu_home: Path, linger: Linger, meddle: object, why: str
) -> None:
    async def main() -> None:
        m = _manager(qemu_home, linger)
        try:
            sid, d = await _prepared(m, "cold")
            pid = qemu_pid(d)
            assert pid is not None
            await m.pause(sid)
            if why == "off":
                assert not (d / MARKER).exists()
                assert await _wait_gone(pid)  # told to quit, as without linger
            elif why == "expired":
                assert _alive(pid)  # lingering ...
                assert await _wait_gone(pid, 15)  # ... until its window ends
                assert not (d / MARKER).exists()
            else:
                assert _alive(pid)
                assert callable(meddle)
                meddle(d)
            await m.resume(sid)
            woke = qemu_pid(d)
            assert woke is not None and woke != pid  # a new QEMU, from the saved state
            assert not _alive(pid)  # and never the stale one
            await _intact(m, sid)
            assert m.transitions(sid)[-4:] == PAUSE_WAKE
            assert procs_on(d) == [woke]
        finally:
            await m.close()

    asyncio.run(main())


def test_the_oldest_lingering_qemu_goes_first_over_the_count(qemu_home: Path) -> None:
    async def main() -> None:
        m = _manager(qemu_home, Linger(60, 1))
        try:
            a, da = await _prepared(m, "a")
            b, db = await _prepared(m, "b")
            pa, pb = qemu_pid(da), qemu_pid(db)
            assert pa is not None and pb is not None
            await m.pause(a)
            await m.pause(b)  # one may linger: a's QEMU goes
            assert await _wait_gone(pa) and _alive(pb)
            await m.resume(b)
            await m.resume(a)
            assert qemu_pid(db) == pb and qemu_pid(da) not in (None, pa)
            await _intact(m, a)
            await _intact(m, b)
        finally:
            await m.close()
        assert procs_on(da) == [] and procs_on(db) == []  # the close paused them: gone

    asyncio.run(main())


#: another OS process: wakes the sandbox by name, reports its QEMU and its variable, pauses
#: it again and closes its manager (which ends what it keeps lingering)
OTHER = r"""
import asyncio, json, sys
from torpor.config import Linger, paths
from torpor.sandbox.engine import QemuEngine
from torpor.sandbox.manager import SandboxManager
from torpor.sandbox.vm.machine_dir import qemu_pid

async def main():
    m = SandboxManager(paths(), engine=QemuEngine(paths(), pool_size=0, linger=Linger(60, 4)))
    await m.resume(sys.argv[1])
    v = (await m.run_code(sys.argv[1], "v")).text
    pid = qemu_pid(m.directory((await m.get(sys.argv[1])).id))
    await m.pause(sys.argv[1])
    await m.close()
    print(json.dumps({"pid": pid, "v": v}), flush=True)

asyncio.run(main())
"""


def test_another_process_wakes_the_lingering_qemu(qemu_home: Path) -> None:
    async def main() -> None:
        m = _manager(qemu_home, Linger(60, 4))
        try:
            sid, d = await _prepared(m, "shared")
            pid = qemu_pid(d)
            await m.pause(sid)
            out = await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-c", OTHER, "shared"],
                capture_output=True,
                text=True,
                timeout=300,
                env={**os.environ, "TORPOR_HOME": str(qemu_home)},
            )
            assert out.returncode == 0, out.stderr
            seen = json.loads(out.stdout.strip().splitlines()[-1])
            assert seen == {"pid": pid, "v": "'kept-in-ram'"}  # resumed there, warm
            assert pid is not None and await _wait_gone(pid)  # its close ended it
            await m.resume(sid)  # here again: cold, as the QEMU is gone, and whole
            assert qemu_pid(d) not in (None, pid)
            await _intact(m, sid)
            await m.pause(sid)
            lingering = qemu_pid(d)
            assert lingering is not None
            await m.kill(sid)  # a kill while lingering: no QEMU left
            assert await _wait_gone(lingering) and procs_on(d) == []
        finally:
            await m.close()

    asyncio.run(main())


#: a manager that pauses a sandbox (its QEMU lingers) and is SIGKILLed in the window
DIES = r"""
import asyncio, json, os, signal
from torpor.config import Linger, paths
from torpor.sandbox.engine import QemuEngine
from torpor.sandbox.manager import SandboxManager
from torpor.sandbox.vm.machine_dir import qemu_pid

async def main():
    m = SandboxManager(paths(), engine=QemuEngine(paths(), pool_size=0, linger=Linger(600, 4)))
    info = await m.create(name="crashy")
    await m.run_code(info.id, "v = 'kept-in-ram'")
    await m.write_file(info.id, "/root/disk.txt", "on disk")
    await m.pause(info.id)
    print(json.dumps({"id": info.id, "pid": qemu_pid(m.directory(info.id))}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

asyncio.run(main())
"""


def test_a_manager_killed_in_the_window_loses_nothing(qemu_home: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", DIES],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TORPOR_HOME": str(qemu_home)},
    )
    assert out.returncode == -9, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    sid, pid = seen["id"], seen["pid"]
    d = paths(qemu_home).sandboxes / sid
    assert _alive(pid)  # its lingering QEMU outlived it (nothing expires it now)

    async def main() -> None:
        m = _manager(qemu_home, Linger(60, 4))  # a new engine sweeps what the dead one kept
        try:
            assert await _wait_gone(pid)
            await m.start(supervise=False)
            assert (await m.get(sid)).state is S.PAUSED
            await m.resume(sid)
            await _intact(m, sid)
        finally:
            await m.close()
        assert procs_on(d) == []

    asyncio.run(main())
