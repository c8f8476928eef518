"""Start a shell command with ``os.posix_spawn`` (stdlib only; runs in the guest).

``subprocess.Popen`` does a good deal of Python work per start (an error pipe, fd closing,
its own bookkeeping); under TCG that is ~20 ms of a ~55 ms ``true`` round trip. A
``posix_spawn`` (vfork + exec in glibc) costs about half. :class:`Spawned` is the small part
of the Popen interface the agent uses: ``pid``, ``stdout``/``stderr`` (binary pipes or None),
``poll()``, ``wait()``, ``returncode``.

Only for commands without a working directory of their own: posix_spawn cannot ``chdir``
(the child runs in the agent's), so :func:`spawn_shell` falls back to Popen then.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from typing import IO, Any

__all__ = ["Process", "Spawned", "spawn_shell"]

#: signals Python ignores that a shell command must see at their default (as Popen restores)
_DEFAULT_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGPIPE", "SIGXFSZ", "SIGXFZ") if hasattr(signal, name)
)


class Spawned:
    """A process started by :func:`spawn_shell`; reaped exactly once, from any thread."""

    def __init__(self, pid: int, stdout: IO[bytes] | None, stderr: IO[bytes] | None) -> None:
        self.pid = pid
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        """The exit code if the process has exited (negative: killed by that signal)."""
        if self.returncode is None and self._lock.acquire(blocking=False):
            try:
                self._reap(os.WNOHANG)
            finally:
                self._lock.release()
        return self.returncode

    def wait(self) -> int:
        """Wait for the process to exit; its exit code (negative: killed by that signal)."""
        while self.returncode is None:
            with self._lock:
                if self.returncode is None:
                    self._reap(0)
        return self.returncode

    def _reap(self, flags: int) -> None:
        try:
            pid, status = os.waitpid(self.pid, flags)
        except ChildProcessError:  # reaped elsewhere (cannot happen here): no status left
            self.returncode = 255
            return
        if pid == self.pid:
            self.returncode = os.waitstatus_to_exitcode(status)


#: what :func:`spawn_shell` returns
Process = Spawned | subprocess.Popen[bytes]


def spawn_shell(cmd: str, *, cwd: str | None, env: dict[str, str], capture: bool) -> Process:
    """Run ``/bin/sh -c cmd`` in a new session, stdin from /dev/null, stdout and stderr to
    pipes (``capture``) or /dev/null. Raises OSError if it cannot start."""
    if cwd is not None or not hasattr(os, "posix_spawn"):
        out: Any = subprocess.PIPE if capture else subprocess.DEVNULL
        return subprocess.Popen(
            ["/bin/sh", "-c", cmd],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,
        )
    pipes: list[tuple[int, int]] = []
    try:
        actions: list[tuple[Any, ...]] = [(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0)]
        if capture:
            pipes = [os.pipe(), os.pipe()]  # close-on-exec: only the dup2'd copies pass
            actions += [
                (os.POSIX_SPAWN_DUP2, pipes[0][1], 1),
                (os.POSIX_SPAWN_DUP2, pipes[1][1], 2),
            ]
        else:
            actions += [
                (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
                (os.POSIX_SPAWN_DUP2, 1, 2),
            ]
        pid = os.posix_spawn(
            "/bin/sh",
            ["/bin/sh", "-c", cmd],
            env,
            file_actions=actions,
            setsid=True,
            setsigmask=(),
            setsigdef=_DEFAULT_SIGNALS,
        )
    except BaseException:
        for r, w in pipes:
            os.close(r)
            os.close(w)
        raise
    for _, w in pipes:
        os.close(w)
    if not capture:
        return Spawned(pid, None, None)
    return Spawned(
        pid, os.fdopen(pipes[0][0], "rb", buffering=0), os.fdopen(pipes[1][0], "rb", buffering=0)
    )
