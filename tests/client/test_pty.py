"""Terminals in a real sandbox (marked qemu): SDK -> local server -> manager -> guest agent.

The agent's side runs on the host in tests/sandbox/test_guest_terminal.py; this is the whole
path, in a VM built from this tree's guest files.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import torpor
from torpor.errors import NotFound, TorporError
from torpor.sandbox.models import SandboxState

pytestmark = pytest.mark.qemu


@pytest.fixture
def served_home(qemu_home: Path) -> Iterator[Path]:
    """``qemu_home`` with the real local server (auto-started by the SDK); stopped after."""
    from tests.served import stop_server_and_vms

    yield qemu_home
    stop_server_and_vms(qemu_home)


def test_pty_is_a_terminal_that_answers(served_home: Path) -> None:
    rt = torpor.Runtime(home=served_home)
    sbx = torpor.Sandbox.create(name="pty-test", envs={"TORPOR_GREETING": "hi"}, runtime=rt)
    try:
        seen: list[bytes] = []
        term = sbx.pty.create("sh", cols=100, rows=30, on_data=seen.append)
        assert term.pid > 0
        term.send_stdin("python3 -c 'import sys; print(sys.stdin.isatty())'\n")
        term.wait_for("True\r\n", timeout=60)
        term.send_stdin('echo "$TORPOR_GREETING-$((40+2))"\n')  # the sandbox's envs
        term.wait_for("hi-42", timeout=30)
        term.send_stdin("stty size\n")
        term.wait_for("30 100", timeout=30)
        term.resize(120, 40)
        term.send_stdin("stty size\n")
        term.wait_for("40 120", timeout=30)
        term.send_stdin("exit 5\n")
        assert term.wait(timeout=30) == 5
        assert b"hi-42" in b"".join(seen)  # the callback saw what output() holds
        with pytest.raises(NotFound):
            term.send_stdin("too late\n")
        # kill ends a program that never exits, and what it started
        top = sbx.pty.create("sleep 300")
        assert top.kill()
        assert top.wait(timeout=30) == 137
        assert "sleep 300" not in sbx.commands.run("ps -eo args").stdout
        # a pause does not wait for an open terminal; it ends it
        left_open = sbx.pty.create("sh")
        assert sbx.pause().state is SandboxState.PAUSED
        with pytest.raises(TorporError):
            left_open.wait(timeout=60)
        assert "pts/" not in sbx.commands.run("ps -eo tty").stdout  # its program is gone
    finally:
        sbx.kill()
