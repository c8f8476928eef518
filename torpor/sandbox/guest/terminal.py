"""Commands on a pseudo-terminal, for interactive programs (stdlib only; runs in the guest).

The host opens one with a ``pty`` request that lasts as long as the program: the agent makes
a pty pair, sets its window size, starts ``/bin/sh -c CMD`` as the leader of a new session
whose controlling terminal is the pty (``setsid --ctty``: Ctrl-C, job control and SIGWINCH
work as in a terminal), and answers with a ``started`` event (the pid), then ``pty`` events
carrying what the program writes, raw bytes, and last a reply with its exit code. Other
requests act on it by the id the host chose: ``pty_input`` (the payload goes to the
program's terminal), ``pty_resize`` (``cols``, ``rows``) and ``pty_kill``.

A terminal belongs to the connection that opened it: when the host hangs up (a pause, a
server restart) nobody reads it any more, so its session is killed; so it is when a new host
connection starts (its first ping refreshes the guest), for a guest frozen by a pause before
it noticed the hang-up.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import pty
import queue
import signal
import struct
import subprocess
import termios
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("torpor.agent.terminal")

__all__ = ["Terminal", "Terminals"]

#: the TERM a program sees unless the host sends another
DEFAULT_TERM = "xterm-256color"


def set_size(fd: int, cols: int, rows: int) -> None:
    """Set the window size of the terminal ``fd`` (its foreground group gets SIGWINCH)."""
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def _wait_for_session(proc: subprocess.Popen[bytes], limit: float = 2.0) -> None:
    """Wait (briefly) until ``setsid`` has made the program a session leader, so that from
    the moment the host hears "started" a kill of its group reaches all of it."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if os.getsid(proc.pid) == proc.pid:
                return
        except OSError:
            return
        time.sleep(0.005)


class Terminal:
    """One program on a pty: its master side and process. Input is queued and written by a
    thread of its own, in order: the agent takes it on its read loop, which must never block
    on a program that does not read its terminal."""

    def __init__(self, master: int, proc: subprocess.Popen[bytes]) -> None:
        self.master = master
        self.proc = proc
        self._input: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        threading.Thread(target=self._writer, daemon=True, name=f"pty-in-{proc.pid}").start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def write(self, data: bytes) -> None:
        self._input.put(data)

    def close(self) -> None:
        """Close the master side once the input queued before is written (or dropped)."""
        self._input.put(None)

    def _writer(self) -> None:
        broken = False
        while (data := self._input.get()) is not None:
            view = memoryview(data)
            try:
                while view and not broken:
                    view = view[os.write(self.master, view) :]
            except OSError:  # the terminal is gone: drop the rest
                broken = True
        os.close(self.master)  # here, so no write can reach a reused descriptor

    def kill(self) -> None:
        # the session's group, and the process itself in case it has not left ours yet
        for kill in (os.killpg, os.kill):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                kill(self.proc.pid, signal.SIGKILL)


class Terminals:
    """The open terminals by the host's id; ``Failure`` is the agent's error class."""

    def __init__(self, failure: Callable[..., Exception]) -> None:
        self.Failure = failure
        self._open: dict[str, Terminal] = {}
        self._lock = threading.Lock()

    def get(self, tid: str) -> Terminal:
        with self._lock:
            term = self._open.get(tid)
        if term is None:
            raise self.Failure("NotFound", f"no open terminal {tid!r}", kind="pty", name=tid)
        return term

    def run(self, req: Any) -> dict[str, Any]:
        """Serve a ``pty`` request until its program exits: ``{"exit_code"}``."""
        a = req.args
        tid = str(a["id"])
        cols, rows = int(a.get("cols") or 80), int(a.get("rows") or 24)
        cwd = a.get("cwd")
        if cwd is not None and not os.path.isdir(cwd):
            raise self.Failure(
                "PathNotFound", f"working directory {cwd} does not exist", kind="path", name=cwd
            )
        env = dict(os.environ)
        env["TERM"] = DEFAULT_TERM
        env.update({str(k): str(v) for k, v in (a.get("env") or {}).items()})
        master, slave = pty.openpty()
        try:
            set_size(slave, cols, rows)
            os.set_inheritable(slave, False)
            proc = subprocess.Popen(
                ["setsid", "--ctty", "/bin/sh", "-c", str(a["cmd"])],
                stdin=slave,
                stdout=slave,
                stderr=slave,
                cwd=cwd,
                env=env,
                close_fds=True,
            )
        except BaseException:
            os.close(master)
            raise
        finally:
            os.close(slave)  # the program holds its own copies: EIO on read once it is gone
        term = Terminal(master, proc)
        with self._lock:
            self._open[tid] = term
        req.cancel_hook = term.kill
        if req.cancelled:  # the host gave up while the program was starting
            term.kill()
        try:
            _wait_for_session(proc)
            req.event("started", str(proc.pid).encode())
            while True:
                try:
                    chunk = os.read(master, 1 << 16)
                except OSError:  # EIO: every writer of the terminal has closed it
                    break
                if not chunk:
                    break
                req.event("pty", chunk)
            code = proc.wait()
        finally:
            req.cancel_hook = None
            with self._lock:
                self._open.pop(tid, None)
            term.kill()  # what the program left running on the terminal goes with it
            proc.wait()
            term.close()
        return {"pid": proc.pid, "exit_code": 128 - code if code < 0 else code}

    def input(self, req: Any, payload: bytes) -> dict[str, Any]:
        self.get(str(req.args["id"])).write(payload)
        return {"size": len(payload)}

    def resize(self, req: Any) -> dict[str, Any]:
        term = self.get(str(req.args["id"]))
        set_size(term.master, int(req.args["cols"]), int(req.args["rows"]))
        return {}

    def kill(self, req: Any) -> dict[str, Any]:
        self.get(str(req.args["id"])).kill()
        return {}

    def hang_up(self) -> None:
        """The host went away: nobody reads the terminals any more; end them."""
        with self._lock:
            terms = list(self._open.values())
        for term in terms:
            term.kill()
