"""QEMUs told to quit after a hibernate exit on their own time (torpor.sandbox.vm.exits): the
next start on the directory and a manager's close wait for them; one that never exits is
killed. Plain processes stand in for QEMU (no VM)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from torpor.sandbox.vm import exits


def _child(seconds: float) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])


def test_settle_exit_waits_for_the_handed_off_process(tmp_path: Path) -> None:
    proc = _child(0.3)
    exits.hand_off(tmp_path, proc, proc.pid)
    assert exits.exiting(tmp_path)

    async def main() -> float:
        t0 = time.monotonic()
        await exits.settle_exit(tmp_path)
        return time.monotonic() - t0

    waited = asyncio.run(main())
    assert proc.returncode == 0  # reaped: no zombie left
    assert not exits.exiting(tmp_path)
    assert waited > 0.05  # it did wait (the child sleeps 0.3 s)


def test_settle_exit_of_another_directory_does_not_wait(tmp_path: Path) -> None:
    proc = _child(5)
    exits.hand_off(tmp_path / "a", proc, proc.pid)
    try:

        async def main() -> None:
            await asyncio.wait_for(exits.settle_exit(tmp_path / "b"), 1)

        asyncio.run(main())
        assert exits.exiting(tmp_path / "a")
    finally:
        proc.kill()
        asyncio.run(exits.settle_exits())
    assert not exits.exiting(tmp_path / "a")


def test_a_process_that_does_not_exit_is_killed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(exits, "EXIT_TIMEOUT", 0.2)
    proc = _child(60)
    exits.hand_off(tmp_path, proc, proc.pid)
    asyncio.run(asyncio.wait_for(exits.settle_exits(), 10))
    assert proc.returncode is not None and proc.returncode < 0  # killed by a signal


def test_nothing_handed_off_is_a_no_op(tmp_path: Path) -> None:
    exits.hand_off(tmp_path, None, None)
    assert not exits.exiting(tmp_path)
    asyncio.run(asyncio.wait_for(exits.settle_exit(tmp_path), 1))


def test_a_process_known_by_its_pid_only_is_watched_through_its_pid_file(tmp_path: Path) -> None:
    # a QEMU re-attached after a restart is not this process's child: only its pid file says
    # it runs (here a child stands in; a zombie counts as gone)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"], cwd=tmp_path)
    (tmp_path / "qemu.pid").write_text(str(proc.pid))
    exits.hand_off(tmp_path, None, proc.pid)
    assert exits.exiting(tmp_path)

    async def main() -> float:
        t0 = time.monotonic()
        await asyncio.wait_for(exits.settle_exit(tmp_path), 10)
        return time.monotonic() - t0

    assert asyncio.run(main()) > 0.05
    assert not exits.exiting(tmp_path)
    proc.wait()


def test_a_process_that_exits_first_lets_its_quitting_qemus_finish(tmp_path: Path) -> None:
    """A pause in one process, a wake in the next: the first process's exit waits for the
    QEMU it handed off, so the second never meets it."""
    script = (
        "import subprocess, sys, pathlib\n"
        "from torpor.sandbox.vm import exits\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(0.5)'])\n"
        "print(p.pid, flush=True)\n"
        f"exits.hand_off(pathlib.Path({str(tmp_path)!r}), p, p.pid)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=30
    )
    pid = int(out.stdout.split()[0])
    assert not Path(f"/proc/{pid}").exists()  # reaped before its parent exited


def test_a_wake_waits_for_another_process_s_exiting_qemu(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(0.4)"], cwd=tmp_path
    )  # stands in for another process's QEMU: its pid file, its cwd the directory
    (tmp_path / "qemu.pid").write_text(f"{proc.pid}\n")
    reaper = threading.Thread(target=proc.wait)  # its parent reaps it, as that process would
    reaper.start()

    async def main() -> float:
        t0 = time.monotonic()
        await asyncio.wait_for(exits.settle_foreign_exit(tmp_path), 10)
        return time.monotonic() - t0

    waited = asyncio.run(main())
    reaper.join()
    assert proc.returncode == 0
    assert waited > 0.1  # it waited for the process, not only for a thread of this one
