"""Background process handles (torpor.client.processes): the guest-side shell they run is run
here by the host's /bin/sh through a stand-in sandbox (commands via ``sh -c``, files on the
local disk), so start, list, wait, stdin, kill and forget are exercised for real without a VM;
tests/test_readme.py and the qemu test below run them in a real guest."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any, cast

import pytest

from torpor.client import processes
from torpor.client.processes import ProcessHandle, list_processes, start
from torpor.errors import GuestError, InvalidArgument, NotFound, OperationTimeout
from torpor.sandbox.models import CommandResult


class _Commands:
    def run(self, cmd: str, *, timeout: float | None = None) -> CommandResult:
        try:
            done = subprocess.run(
                ["sh", "-c", cmd], capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            raise OperationTimeout(f"timed out after {timeout} s") from None
        return CommandResult(exit_code=done.returncode, stdout=done.stdout, stderr=done.stderr)


class _Files:
    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def read(self, path: str) -> bytes:
        return Path(path).read_bytes()


class LocalSandbox:
    """What ProcessHandle uses of a Sandbox, on this machine."""

    def __init__(self) -> None:
        self.commands = _Commands()
        self.files = _Files()


def _alive_in_session(sid: int) -> list[str]:
    """Processes of session ``sid`` that are not zombies (an init that reaps slowly)."""
    deadline = time.monotonic() + 5
    while True:
        ps = subprocess.run(
            ["ps", "-e", "-o", "sid=,stat=,pid="], capture_output=True, text=True
        ).stdout
        alive = [
            line
            for line in ps.splitlines()
            if line.split()[0] == str(sid) and not line.split()[1].startswith("Z")
        ]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


@pytest.fixture
def sbx(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(processes, "PROCS_DIR", str(tmp_path / "procs"))
    local = LocalSandbox()
    yield local
    for p in list_processes(cast(Any, local)):
        ProcessHandle(cast(Any, local), p.pid).kill()


def test_start_send_stdin_wait(sbx: Any) -> None:
    p = start(sbx, 'read line; echo "got $line"; echo oops >&2; exit 7')
    assert [(i.pid, i.cmd) for i in list_processes(sbx)] == [(p.pid, p.cmd)]
    assert p.exit_code() is None
    p.send_stdin("hello 'world' $HOME\n")
    result = p.wait(timeout=10)
    assert (result.exit_code, result.stdout, result.stderr) == (
        7,
        "got hello 'world' $HOME\n",
        "oops\n",
    )
    assert list_processes(sbx) == []  # exited
    assert [i.pid for i in list_processes(sbx, include_exited=True)] == [p.pid]
    p.forget()
    with pytest.raises(NotFound):
        p.wait()


def test_kill_and_timeouts(sbx: Any) -> None:
    p = start(sbx, "sleep 300 & sleep 300")
    with pytest.raises(OperationTimeout):
        p.wait(timeout=0.5)
    assert p.exit_code() is None  # a wait that timed out leaves it running
    assert p.kill() is True
    assert p.wait(timeout=10).exit_code == 137
    assert p.kill() is False  # already gone
    # the whole session went, the background sleep too
    assert _alive_in_session(p.pid) == []


def test_cwd_and_a_handle_from_another_session(sbx: Any, tmp_path: Path) -> None:
    p = start(sbx, "pwd", cwd=str(tmp_path))
    again = ProcessHandle(sbx, p.pid)
    deadline = time.monotonic() + 10
    while again.exit_code() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert again.output().stdout == f"{tmp_path}\n"
    with pytest.raises(InvalidArgument):
        start(sbx, "  ")


def test_a_shell_session_line_by_line(sbx: Any) -> None:
    from torpor.cli.sandbox import shell_session

    out: list[str] = []
    code = shell_session(sbx, ["x=41", "echo $((x + 1))", "echo err >&2", "false"], out.append)
    text = "".join(out)
    assert "42\n" in text and "err\n" in text
    assert code == 1  # `exit` after `false`: the shell exits with the last status
    assert list_processes(sbx, include_exited=True) == []  # forgotten


def test_what_other_guest_processes_leave_in_the_directory_is_no_raw_error(
    sbx: Any, tmp_path: Path
) -> None:
    # The directory is the guest's: any process there can add to it or write in it.
    p = start(sbx, "true")
    assert p.wait(timeout=10).exit_code == 0
    (tmp_path / "procs" / "12x").mkdir()  # matches the listing's [0-9]* glob
    (tmp_path / "procs" / "3 4").mkdir()
    assert [i.pid for i in list_processes(sbx, include_exited=True)] == [p.pid]
    (tmp_path / "procs" / str(p.pid) / "exit").write_text("junk\n")
    with pytest.raises(GuestError):
        p.exit_code()
    with pytest.raises(GuestError):
        p.wait(timeout=10)


def test_output_that_is_not_utf8_is_read_with_replacement_characters(sbx: Any) -> None:
    # A guest program's output is any bytes: wait() and output() raised UnicodeDecodeError.
    p = start(sbx, "printf 'a\\377b'; printf '\\303' >&2")
    result = p.wait(timeout=10)
    assert (result.exit_code, result.stdout, result.stderr) == (0, "a\ufffdb", "\ufffd")


class _ReplacingCommands(_Commands):
    """Output decoded as the server decodes it: bytes that are not UTF-8 become U+FFFD."""

    def run(self, cmd: str, *, timeout: float | None = None) -> CommandResult:
        done = subprocess.run(
            ["sh", "-c", cmd], capture_output=True, text=True, errors="replace", timeout=timeout
        )
        return CommandResult(exit_code=done.returncode, stdout=done.stdout, stderr=done.stderr)


def test_a_shell_session_loses_nothing_after_bytes_that_are_not_utf8(sbx: Any) -> None:
    # Each invalid byte came back as U+FFFD (3 bytes in UTF-8): the session counted those
    # and skipped as many bytes of what the shell printed next.
    from torpor.cli.sandbox import shell_session

    sbx.commands = _ReplacingCommands()
    out: list[str] = []
    lines = ["printf 'a\\377\\377\\377\\377\\303'", "sleep 1", "echo after-the-bytes"]
    assert shell_session(sbx, lines, out.append, poll=0.05) == 0
    text = "".join(out)
    assert "after-the-bytes\n" in text and text.count("\ufffd") == 5
