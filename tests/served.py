"""Clean-up after a test that ran the real local server on a ``qemu_home``.

Import the helper with ``from tests.served import stop_server_and_vms`` and call it after the
test (in a fixture, after its ``yield``).
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

from torpor.errors import TorporError
from torpor.server.daemon import server_pid, stop_server

__all__ = ["stop_server_and_vms"]


def stop_server_and_vms(home: Path) -> None:
    """Stop the server of ``home`` (it pauses running sandboxes, so no QEMU outlives it; a
    server that does not stop is killed), then kill any QEMU still named by a pid file."""
    pid = server_pid(home)
    if pid is not None:
        try:
            stop_server(home, timeout=120)
        except TorporError:
            os.kill(pid, signal.SIGKILL)
    for pidfile in (home / "sandboxes").glob("*/qemu.pid"):
        text = pidfile.read_text().strip()
        if text.isdigit():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(text), signal.SIGKILL)
