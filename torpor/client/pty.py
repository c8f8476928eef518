"""Interactive programs on a terminal in a sandbox (``sbx.pty``, E2B's ``sandbox.pty``). ::

    term = sbx.pty.create("bash", cols=100, rows=30, on_data=sys.stdout.buffer.write)
    term.send_stdin("echo hi\\n")
    term.resize(120, 40)          # the program gets SIGWINCH
    term.kill()                   # or term.send_stdin("exit\\n")
    term.wait()                   # its exit code

The program runs on a pseudo-terminal in the guest (``isatty()`` is true, Ctrl-C is SIGINT,
curses programs draw). Its output arrives on a thread of the handle, as raw bytes, to
``on_data`` and to :meth:`PtyHandle.output`. The terminal lives as long as the handle's stream:
:meth:`PtyHandle.close` (or the end of the process) ends it, and a pause of the sandbox ends
it too (see :mod:`torpor.sandbox.manager.terminals`).
"""

from __future__ import annotations

import base64
import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from torpor.client.runtime import Runtime
from torpor.errors import OperationTimeout, ServerUnavailable, TorporError, from_wire
from torpor.sandbox.requests import PtySize, PtySpec
from torpor.types import Env


class Sandbox(Protocol):
    """What a terminal uses of a :class:`torpor.Sandbox`."""

    @property
    def id(self) -> str: ...

    @property
    def runtime(self) -> Runtime: ...

    def route(self, suffix: str = "") -> str: ...


__all__ = ["Pty", "PtyHandle"]

#: seconds :meth:`Pty.create` waits for the program to start (a paused sandbox wakes first)
START_TIMEOUT = 180.0


class PtyHandle:
    """One program on a terminal (see the module docstring). ``id``: the terminal's id on the
    server; ``pid``: the program's pid in the guest."""

    def __init__(self, sbx: Sandbox, on_data: Callable[[bytes], Any] | None) -> None:
        self._sbx = sbx
        self._on_data = on_data
        self.id = ""
        self.pid = 0
        self._out = bytearray()
        self._lock = threading.Lock()
        self._started = threading.Event()
        self._ended = threading.Event()
        self._exit_code: int | None = None
        self._error: TorporError | None = None
        self._abandoned = False  # start() gave up waiting: a program that starts is hung up

    def __repr__(self) -> str:
        return f"<PtyHandle {self.id} pid={self.pid} in {self._sbx.id}>"

    def _run(self, body: dict[str, Any]) -> None:
        rt = self._sbx.runtime
        try:
            with rt.stream_events("POST", self._sbx.route("/pty"), json=body, timeout=None) as ev:
                for event in ev:
                    kind = event.get("type")
                    if kind == "output":
                        chunk = base64.b64decode(event["data"])
                        with self._lock:
                            self._out += chunk
                        if self._on_data is not None:
                            # the caller's callback must not end the stream
                            with contextlib.suppress(Exception):
                                self._on_data(chunk)
                    elif kind == "started":
                        with self._lock:
                            if self._abandoned:  # nobody holds this terminal: hang up
                                self._error = OperationTimeout("the terminal started too late")
                                return
                            self.id, self.pid = str(event["id"]), int(event["pid"])
                        self._started.set()
                    elif kind == "exit":
                        self._exit_code = int(event["exit_code"])
                        return
                    elif kind == "error":
                        self._error = from_wire(event["error"])
                        return
                self._error = ServerUnavailable("the server ended the terminal's stream")
        except TorporError as exc:
            self._error = exc
        except Exception as exc:  # the connection was closed under us (close())
            self._error = ServerUnavailable(f"the terminal's stream broke: {exc}", exc=exc)
        finally:
            self._ended.set()
            self._started.set()

    def start(self, body: dict[str, Any]) -> None:
        """Open the terminal (a :class:`PtySpec`'s fields) and return once its program runs
        (:meth:`Pty.create` calls it). Raises as :meth:`Pty.create` does; after
        OperationTimeout the stream is hung up when the program starts (which kills it)."""
        threading.Thread(target=self._run, args=(body,), daemon=True, name="torpor-pty").start()
        if not self._started.wait(START_TIMEOUT):
            with self._lock:
                self._abandoned = not self.id
            if self._abandoned:
                raise OperationTimeout(f"the terminal did not start within {START_TIMEOUT:.0f} s")
        if not self.id:
            raise self._error or ServerUnavailable("the terminal ended before it started")

    def _path(self, suffix: str = "") -> str:
        return self._sbx.route(f"/pty/{self.id}{suffix}")

    def send_stdin(self, data: str | bytes) -> None:
        """Type ``data`` on the terminal (a str is sent as UTF-8). Raises NotFound once the
        program has ended."""
        raw = data.encode() if isinstance(data, str) else bytes(data)
        self._sbx.runtime.request("POST", self._path("/input"), content=raw)

    def resize(self, cols: int, rows: int) -> None:
        """Set the window size; the program gets SIGWINCH. Raises InvalidArgument, NotFound."""
        size = PtySize.of(cols=cols, rows=rows)
        self._sbx.runtime.request("POST", self._path("/resize"), json=size.given())

    def kill(self) -> bool:
        """Kill the program and what it started; False if it had already ended."""
        if self._ended.is_set():
            return False
        with contextlib.suppress(TorporError):
            self._sbx.runtime.request("DELETE", self._path())
        return True

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the program to end; its exit code. Raises OperationTimeout after
        ``timeout`` seconds (it keeps running), the error that ended the stream (e.g.
        GuestError when a pause ended the terminal)."""
        if not self._ended.wait(timeout):
            raise OperationTimeout(f"terminal {self.id} still runs after {timeout} s")
        if self._exit_code is None:
            raise self._error or ServerUnavailable("the terminal ended without an exit code")
        return self._exit_code

    @property
    def ended(self) -> bool:
        """True once the program has ended (or its stream broke)."""
        return self._ended.is_set()

    @property
    def exit_code(self) -> int | None:
        """The exit code once the program has ended, else None."""
        return self._exit_code

    def output(self) -> bytes:
        """Everything the program wrote so far."""
        with self._lock:
            return bytes(self._out)

    def wait_for(self, text: str | bytes, timeout: float = 30.0) -> bytes:
        """Wait until the output contains ``text``; the output so far. Raises
        OperationTimeout, or the stream's error if the program ended first."""
        needle = text.encode() if isinstance(text, str) else text
        deadline = time.monotonic() + timeout
        while needle not in (out := self.output()):
            if self._ended.is_set():
                raise self._error or OperationTimeout(
                    f"terminal {self.id} ended before printing {needle!r}"
                )
            if time.monotonic() > deadline:
                raise OperationTimeout(f"{needle!r} did not appear within {timeout} s")
            time.sleep(0.02)
        return out

    def close(self) -> None:
        """Kill the program if it still runs (the terminal ends with it)."""
        self.kill()
        self._ended.wait(10)


class Pty:
    """Terminals in a sandbox (``sbx.pty``)."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sbx = sandbox

    def create(
        self,
        cmd: str = "bash",
        *,
        cols: int = 80,
        rows: int = 24,
        on_data: Callable[[bytes], Any] | None = None,
        envs: Env | None = None,
        cwd: str | None = None,
    ) -> PtyHandle:
        """Start ``cmd`` (``/bin/sh -c``) on a new ``cols`` x ``rows`` terminal, waking the
        sandbox first; returns once it runs. ``on_data(bytes)`` gets its output as it comes
        (on another thread). ``envs`` are set over the sandbox's (``TERM`` is
        ``xterm-256color`` unless given). Raises InvalidArgument, PathNotFound (``cwd``),
        SandboxNotFound, OperationTimeout."""
        spec = PtySpec.of(cmd=cmd, cols=cols, rows=rows, env=envs, cwd=cwd)
        handle = PtyHandle(self._sbx, on_data)
        handle.start(spec.given())
        return handle
