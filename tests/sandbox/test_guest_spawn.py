"""The guest agent's command start (posix_spawn), run on the host."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from torpor.sandbox.guest.spawn import Spawned, spawn_shell


def _run(cmd: str, cwd: str | None = None) -> tuple[int, bytes, bytes, int]:
    proc = spawn_shell(cmd, cwd=cwd, env=dict(os.environ), capture=True)
    assert proc.stdout is not None and proc.stderr is not None
    out, err = proc.stdout.read(), proc.stderr.read()
    proc.stdout.close()
    proc.stderr.close()
    return proc.wait(), out, err, proc.pid


def test_output_exit_code_and_own_session() -> None:
    code, out, err, pid = _run("echo out; echo err >&2; ps -o sid= -p $$; exit 3")
    assert code == 3
    assert out.splitlines()[0] == b"out" and err == b"err\n"
    assert int(out.splitlines()[1]) == pid  # the shell leads a session of its own


def test_stdin_is_empty_and_sigpipe_is_default() -> None:
    code, out, _, _ = _run("cat; grep SigIgn /proc/self/status")
    assert code == 0
    ignored = int(out.split()[-1], 16)
    assert not ignored & (1 << (signal.SIGPIPE - 1))  # Python ignores it; commands must not


def test_a_killed_command_reports_the_signal() -> None:
    proc = spawn_shell("sleep 30", cwd=None, env=dict(os.environ), capture=True)
    assert isinstance(proc, Spawned) and proc.poll() is None
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert proc.poll() == -signal.SIGKILL  # reaped once, remembered
    for f in (proc.stdout, proc.stderr):
        assert f is not None
        f.close()


def test_a_working_directory_falls_back_to_popen(tmp_path: Path) -> None:
    code, out, _, _ = _run("pwd", cwd=str(tmp_path))
    assert (code, out) == (0, f"{tmp_path}\n".encode())


def test_background_has_no_pipes() -> None:
    proc = spawn_shell("echo lost", cwd=None, env=dict(os.environ), capture=False)
    assert proc.stdout is None and proc.stderr is None
    assert proc.wait() == 0
    assert not isinstance(proc, subprocess.Popen)
