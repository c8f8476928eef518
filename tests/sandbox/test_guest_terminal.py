"""Terminals (``pty`` requests) served by the real guest agent, run on the host as a process
(``agent.py --socket``) and driven through GuestChannel. The same code runs in the VM:
``tests/client/test_pty.py`` checks that path."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from tests.sandbox.test_guest_agent import AgentProcess, agent, alive, run
from torpor.errors import NotFound, PathNotFound
from torpor.sandbox.vm.channel import GuestChannel

__all__ = ["agent"]  # the fixture, imported for its name


async def _until(out: bytearray, needle: bytes, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while needle not in out:
        if time.monotonic() > deadline:
            raise AssertionError(f"{needle!r} never came; got {bytes(out)!r}")
        await asyncio.sleep(0.02)


def test_a_terminal_is_a_tty_and_answers_input(agent: AgentProcess) -> None:
    async def body(ch: GuestChannel) -> None:
        out = bytearray()
        pid, done = await ch.pty_open("t1", "sh", out.extend, cols=100, rows=30)
        assert alive(pid)
        await ch.pty_input("t1", b"echo hi-$((40+2))\n")
        await _until(out, b"hi-42")
        await ch.pty_input(
            "t1",
            b"python3 -c 'import os,sys;print(sys.stdin.isatty(), os.get_terminal_size())'\n",
        )
        await _until(out, b"True os.terminal_size(columns=100, lines=30)")
        await ch.pty_resize("t1", 120, 40)
        await ch.pty_input("t1", b"stty size\n")
        await _until(out, b"40 120")
        await ch.pty_input("t1", b"exit 3\n")
        assert await asyncio.wait_for(done, 20) == 3
        with pytest.raises(NotFound):  # gone once it exited
            await ch.pty_input("t1", b"x")

    run(agent, body)


def test_ctrl_c_reaches_the_foreground_program_and_kill_ends_it(agent: AgentProcess) -> None:
    async def body(ch: GuestChannel) -> None:
        out = bytearray()
        pid, done = await ch.pty_open("t2", "sh", out.extend)
        await ch.pty_input("t2", b"sleep 30; echo after-$((1+1))\n")
        await asyncio.sleep(0.5)
        await ch.pty_input("t2", b"\x03")  # the terminal turns it into SIGINT
        await ch.pty_input("t2", b"echo back-$((2+2))\n")
        await _until(out, b"back-4")
        assert b"after-2" not in out  # the sleep was interrupted, and the line with it
        await ch.pty_kill("t2")
        assert await asyncio.wait_for(done, 20) == 137
        assert not alive(pid)

    run(agent, body)


def test_a_bad_working_directory_is_refused(agent: AgentProcess) -> None:
    async def body(ch: GuestChannel) -> None:
        with pytest.raises(PathNotFound):
            await ch.pty_open("t3", "sh", lambda b: None, cwd="/no/such/dir")

    run(agent, body)


def _running(token: str) -> list[int]:
    """The pids of live processes whose command line holds ``token``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdecimal():
            try:
                if token.encode() in (entry / "cmdline").read_bytes() and alive(int(entry.name)):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_a_terminal_whose_opener_gives_up_is_killed(agent: AgentProcess) -> None:
    """A pty_open cancelled before the guest said the program started (the HTTP caller hung
    up) leaves nothing running: the request is cancelled, and the guest kills the program
    (or never lets it run)."""
    token = f"opener-{time.time_ns()}"

    async def body(ch: GuestChannel) -> None:
        opening = asyncio.create_task(ch.pty_open("t5", f"sleep 300; : {token}", lambda b: None))
        for _ in range(3):  # the request is sent; the guest has not answered yet
            await asyncio.sleep(0)
        assert not opening.done()
        opening.cancel()
        with pytest.raises(asyncio.CancelledError):
            await opening
        deadline = time.monotonic() + 3  # time for the guest to start (and end) it
        while time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        left = _running(token)
        agent.pids.extend(left)
        assert not left, "the terminal's program outlived its cancelled open"

    run(agent, body)
