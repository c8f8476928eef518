"""QEMU processes told to quit after a hibernate, exiting on their own time.

Once a hibernate's device state is durable and QEMU has been told to ``quit``, the machine is
saved: the guest is stopped, the migration inactivated the disks (flushed, their locks
released) and nothing writes the RAM file any more. What is left is QEMU's own exit (freeing
its mappings, threads and translation cache: ~10 ms of a 50 ms pause on a 2-core TCG host),
which the pause does not wait for: :func:`hand_off` gives the process to a thread that reaps it
(SIGKILL after :data:`EXIT_TIMEOUT`), and anything that starts a QEMU on the same directory
first awaits :func:`settle_exit` (QEMU removes its pid file as it exits, so a new QEMU must
not start before the old one is gone). A manager that closes awaits :func:`settle_exits`, so
no QEMU outlives it. A process that dies meanwhile leaves the quitting QEMU to finish alone:
its directory already holds a whole saved state. A process that exits normally joins its
reapers first (:func:`_join_at_exit`), so a pause in one process and a wake in the next (the
demo's two processes) never meet the old QEMU; a wake that does meet another process's exiting
QEMU waits for it (:func:`settle_foreign_exit`).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from torpor.sandbox.vm.machine_dir import qemu_pid

__all__ = [
    "EXIT_TIMEOUT",
    "exiting",
    "hand_off",
    "settle_exit",
    "settle_exits",
    "settle_foreign_exit",
]

log = logging.getLogger(__name__)

#: seconds a QEMU told to quit has to exit before it is killed
EXIT_TIMEOUT = 10.0

#: the reaper thread of each directory whose QEMU is exiting
_EXITING: dict[Path, threading.Thread] = {}


def _reap(directory: Path, proc: subprocess.Popen[bytes] | None, pid: int | None) -> None:
    try:
        if proc is not None:
            try:
                proc.wait(EXIT_TIMEOUT)
            except subprocess.TimeoutExpired:
                log.warning("%s: QEMU %d did not quit; killing it", directory, proc.pid)
                proc.kill()
                proc.wait()
        elif pid is not None:  # not this process's child (a re-attached QEMU): watch its pid
            deadline = time.monotonic() + EXIT_TIMEOUT
            while qemu_pid(directory) == pid:
                if time.monotonic() > deadline:
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
                    deadline = time.monotonic() + EXIT_TIMEOUT
                time.sleep(0.002)
    finally:
        if _EXITING.get(directory) is threading.current_thread():
            del _EXITING[directory]


def hand_off(directory: Path, proc: subprocess.Popen[bytes] | None, pid: int | None) -> None:
    """Let the QEMU of ``directory`` (resolved; ``proc``, or only its ``pid`` when it is not
    this process's child), already told to quit, exit on its own: a thread reaps it."""
    if proc is None and pid is None:
        return
    thread = threading.Thread(
        target=_reap, args=(directory, proc, pid), name=f"reap-{directory.name}", daemon=True
    )
    _EXITING[directory] = thread
    thread.start()


def exiting(directory: Path) -> bool:
    """Whether a QEMU handed off for ``directory`` (resolved) is still exiting."""
    thread = _EXITING.get(directory)
    return thread is not None and thread.is_alive()


async def settle_exit(directory: Path) -> None:
    """Wait until the QEMU handed off for ``directory`` (an absolute, resolved path, as
    :attr:`QemuMachine.directory <torpor.sandbox.vm.machine.QemuMachine.directory>`) has
    exited; at once when there is none."""
    thread = _EXITING.get(directory)
    while thread is not None and thread.is_alive():  # noqa: ASYNC110 - a thread reaps it
        await asyncio.sleep(0.001)


async def settle_exits() -> None:
    """Wait until every QEMU handed off by this process has exited."""
    for thread in list(_EXITING.values()):
        while thread.is_alive():  # noqa: ASYNC110 - a thread reaps it
            await asyncio.sleep(0.001)


async def settle_foreign_exit(directory: Path) -> None:
    """Wait, up to :data:`EXIT_TIMEOUT`, until no QEMU of another process runs on
    ``directory`` (one told to quit after its hibernate and still exiting). A QEMU still there
    then is left for the caller's check to refuse."""
    deadline = time.monotonic() + EXIT_TIMEOUT
    while qemu_pid(directory) is not None and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.002)


@atexit.register
def _join_at_exit() -> None:
    """No QEMU this process told to quit outlives it (each reaper kills after its timeout)."""
    for thread in list(_EXITING.values()):
        thread.join()
