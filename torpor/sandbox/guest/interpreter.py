"""The long-lived Python interpreter of a sandbox (stdlib only).

Two halves in one file:

* the **kernel** (``python3 interpreter.py --kernel CMD_FD REPLY_FD``): a child process of the
  agent that keeps user variables between runs. Its fd 1/2 are pipes the agent streams to the
  host, so output of subprocesses started by user code is captured too. It reads ``exec`` and
  ``reseed`` frames (``protocol.py`` framing) on CMD_FD and answers on REPLY_FD.
* :class:`KernelClient`, used by the agent: starts the kernel on demand, runs code with a
  timeout (SIGINT, so variables survive), and notices a kernel that died (``os._exit``, a
  segfault): the next run starts a fresh one.

Results follow Jupyter's MIME-bundle shape: ``text/plain`` is the repr of the last expression,
plus ``text/html``, ``image/png`` (base64) ... from the object's ``_repr_*_`` methods.
"""

from __future__ import annotations

import ast
import base64
import builtins
import contextlib
import json
import linecache
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable
from typing import Any

if __package__:
    from . import protocol as proto
else:
    import protocol as proto  # type: ignore[no-redef]

log = logging.getLogger("torpor.agent.interpreter")

#: seconds a SIGINT-ed run gets to stop before the kernel is killed
INTERRUPT_GRACE = 3.0
_LOCAL_MAX = 1 << 30  # frame size on the local pipe (code may be 16 MiB)
_MIME_METHODS = (
    ("_repr_html_", "text/html"),
    ("_repr_markdown_", "text/markdown"),
    ("_repr_json_", "application/json"),
    ("_repr_latex_", "text/latex"),
    ("_repr_svg_", "image/svg+xml"),
    ("_repr_png_", "image/png"),
    ("_repr_jpeg_", "image/jpeg"),
)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


# -- kernel side ---------------------------------------------------------------------------


def mime_bundle(obj: Any) -> dict[str, Any]:
    """The Jupyter MIME bundle of ``obj``; a failing ``_repr_*_`` method is skipped."""
    data: dict[str, Any] = {"text/plain": repr(obj)}
    if isinstance(obj, type):  # a class has the methods unbound
        return data
    for method, mime in _MIME_METHODS:
        fn = getattr(obj, method, None)
        if not callable(fn):
            continue
        try:
            value = fn()
        except Exception:
            continue
        if isinstance(value, tuple):  # (data, metadata)
            value = value[0]
        if value is None:
            continue
        if isinstance(value, (bytes, bytearray)):
            value = base64.b64encode(bytes(value)).decode("ascii")
        elif mime == "application/json":
            try:
                json.dumps(value)
            except (TypeError, ValueError):
                continue
        data[mime] = value
    return data


class Kernel:
    """Runs cells in one namespace. SIGINT interrupts only while a cell runs."""

    def __init__(self) -> None:
        # User code gets a __main__ module of its own, so pickle finds its classes.
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        self.ns: dict[str, Any] = main.__dict__
        self.ns["__builtins__"] = builtins
        self.count = 0
        self.executing = False
        #: the kernel's own pid: a process user code forked (``os.fork()``) that comes back
        #: from its cell is not the kernel and must not serve the next one
        self.pid = os.getpid()
        self.results: list[dict[str, Any]] = []
        builtins.display = self.display  # type: ignore[attr-defined]
        signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigint(self, signum: int, frame: Any) -> None:
        # Between cells an interrupt (a timeout racing the end of a run) is ignored.
        if self.executing:
            raise KeyboardInterrupt

    def display(self, *objs: Any) -> None:
        for obj in objs:
            self.results.append({"data": mime_bundle(obj), "is_main_result": False})

    def run_cell(self, code: str) -> dict[str, Any]:
        self.count += 1
        filename = f"<cell-{self.count}>"
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        self.results = []
        error = None
        exit_code = 0  # of a forked child that comes back here
        try:
            tree = ast.parse(code, filename)
            last = None
            if tree.body and isinstance(tree.body[-1], ast.Expr):
                last = ast.Expression(tree.body.pop().value)  # type: ignore[attr-defined]
            body = compile(tree, filename, "exec")
            tail = None if last is None else compile(last, filename, "eval")
            self.executing = True
            try:
                exec(body, self.ns)
                value = None if tail is None else eval(tail, self.ns)
            finally:
                self.executing = False
            if value is not None:
                self.ns["_"] = value
                self.results.append({"data": mime_bundle(value), "is_main_result": True})
        # SystemExit too: user code must not end the kernel.
        except BaseException as exc:
            exit_code = _exit_status(exc)
            error = {
                "name": type(exc).__name__,
                "value": str(exc),
                "traceback": "".join(
                    traceback.format_exception(type(exc), exc, _user_frames(exc.__traceback__))
                ),
            }
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        if os.getpid() != self.pid:
            # A child user code forked, back from the cell (its sys.exit() or no exit at
            # all): it shares the kernel's pipes, so serving on would make two kernels take
            # turns at the next cells, each with variables of its own.
            os._exit(exit_code)
        return {"results": self.results, "error": error}

    def reseed(self, seed: bytes) -> None:
        import hashlib
        import random

        random.seed(seed)
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            numpy.random.seed(int.from_bytes(hashlib.sha256(seed).digest()[:4], "big"))

    def serve(self, cmd_fd: int, reply_fd: int) -> None:
        decoder = proto.FrameDecoder(max_payload=_LOCAL_MAX)
        while True:
            try:
                data = os.read(cmd_fd, 1 << 20)
            except KeyboardInterrupt:
                continue
            if not data:
                return  # the agent is gone
            for frame in decoder.feed(data):
                op = frame.header.get("op")
                if op == "exec":
                    reply = self.run_cell(frame.payload.decode("utf-8"))
                elif op == "reseed":
                    self.reseed(frame.payload)
                    reply = {}
                else:
                    reply = {
                        "error": {"name": "ValueError", "value": f"bad op {op}", "traceback": ""}
                    }
                try:
                    body = json.dumps(reply).encode("utf-8")
                except (TypeError, ValueError) as exc:  # an unserialisable _repr_json_
                    body = json.dumps(
                        {
                            "results": [],
                            "error": {
                                "name": type(exc).__name__,
                                "value": str(exc),
                                "traceback": "",
                            },
                        }
                    ).encode()
                # The reply goes in the payload: a big repr must not hit the header bound.
                _write_all(
                    reply_fd,
                    proto.encode_frame(
                        {"i": frame.id, "t": proto.REPLY}, body, max_payload=_LOCAL_MAX
                    ),
                )


def _exit_status(exc: BaseException) -> int:
    """The exit status ``exc`` would end a Python process with (``sys.exit(n)``: n)."""
    if not isinstance(exc, SystemExit):
        return 1
    if exc.code is None or isinstance(exc.code, int):
        return exc.code or 0
    return 1


def _user_frames(tb: Any) -> Any:
    # Hide the kernel's own frames: the traceback starts in the user's cell.
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return tb


def kernel_main(cmd_fd: int, reply_fd: int) -> None:
    # User code imports from its working directory, as in `python3 -i`, not from ours.
    if sys.path and sys.path[0] == os.path.dirname(os.path.abspath(__file__)):
        sys.path[0] = ""
    sys.argv = [""]
    # Not for the commands user code runs (os.system('server &')): one holding the reply
    # pipe would keep the agent from seeing this kernel die.
    os.set_inheritable(cmd_fd, False)
    os.set_inheritable(reply_fd, False)
    # Whole lines, promptly (PYTHONUNBUFFERED would split every print in two writes).
    sys.stdout.reconfigure(line_buffering=True, write_through=False)  # type: ignore[union-attr]
    sys.stderr.reconfigure(line_buffering=True, write_through=False)  # type: ignore[union-attr]
    Kernel().serve(cmd_fd, reply_fd)


# -- agent side ----------------------------------------------------------------------------


class KernelClient:
    """Starts, feeds and restarts the kernel process. One run at a time."""

    def __init__(self, python: str = sys.executable) -> None:
        self.python = python
        self.lock = threading.Lock()
        self.proc: subprocess.Popen[bytes] | None = None
        self.fds: dict[str, int] = {}
        self.pending_seed: bytes | None = None
        self.next_id = 0

    def _start(self) -> None:
        cmd_r, cmd_w = os.pipe()
        rep_r, rep_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        script = os.path.abspath(__file__)
        self.proc = subprocess.Popen(
            [self.python, script, "--kernel", str(cmd_r), str(rep_w)],
            stdin=subprocess.DEVNULL,
            stdout=out_w,
            stderr=err_w,
            pass_fds=(cmd_r, rep_w),
            start_new_session=True,
            cwd=os.getcwd(),
        )
        for fd in (cmd_r, rep_w, out_w, err_w):
            os.close(fd)
        for fd in (rep_r, out_r, err_r):
            os.set_blocking(fd, False)
        self.fds = {"cmd": cmd_w, "reply": rep_r, "stdout": out_r, "stderr": err_r}
        log.info("interpreter started (pid %d)", self.proc.pid)

    def warm_up(self) -> None:
        """Start the kernel now if none runs. The agent does this at boot, so a template's
        snapshot holds a ready interpreter and a sandbox's first run skips Python's start-up
        (a second or more under TCG)."""
        with self.lock:
            self._ensure()

    def _ensure(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            if self.proc is not None:  # it died since the last run: its variables are gone
                self._stop()
            self._start()

    def stop(self) -> None:
        """Kill the kernel (its variables are lost); the next run starts a new one."""
        with self.lock:
            self._stop()

    def _stop(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.proc = None
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}

    def _call(self, op: str, payload: bytes) -> int:
        self.next_id += 1
        _write_all(
            self.fds["cmd"],
            proto.encode_frame(
                {"i": self.next_id, "t": proto.REQ, "op": op}, payload, max_payload=_LOCAL_MAX
            ),
        )
        return self.next_id

    def reseed(self, seed: bytes) -> bool:
        """Reseed the kernel's ``random``: now if it is idle, else before its next run."""
        if not self.lock.acquire(timeout=0.5):
            self.pending_seed = seed
            return False
        try:
            if self.proc is None or self.proc.poll() is not None:
                return False  # a new kernel seeds itself from the (refreshed) pool
            self.pending_seed = seed
            self._flush_seed()
            return True
        finally:
            self.lock.release()

    def _flush_seed(self) -> None:
        if self.pending_seed is not None:
            seed, self.pending_seed = self.pending_seed, None
            self._call("reseed", seed)  # its reply is read (and skipped) by the next run

    def run(
        self,
        code: str,
        timeout: float | None,
        emit: Callable[[str, bytes], None],
        limit: int,
        set_cancel: Callable[[Callable[[], None] | None], None],
    ) -> dict[str, Any]:
        """Run ``code``; stream its output with ``emit``. Returns ``{"reply": ...}``, or
        ``{"timed_out": True, "kernel_alive": bool}``, or ``{"too_large": True, "size": n,
        "kernel_alive": bool}``. A run stopped (timeout, cancel, too much output) has ended
        when this returns: interrupted, or killed with its kernel after
        :data:`INTERRUPT_GRACE` seconds, so nothing of it reaches the next run."""
        with self.lock:
            self._ensure()
            assert self.proc is not None
            self._discard_output()  # stray output of background threads between runs
            self._flush_seed()
            rid = self._call("exec", code.encode("utf-8"))
            interrupted = threading.Event()
            set_cancel(lambda: self._interrupt(interrupted))
            try:
                return self._wait(rid, timeout, emit, limit, interrupted)
            finally:
                set_cancel(None)

    def _interrupt(self, flag: threading.Event) -> None:
        flag.set()
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGINT)

    def _discard_output(self) -> None:
        for name in ("stdout", "stderr"):
            for _ in range(256):  # bounded: a runaway thread may print for ever
                if not _read_nonblocking(self.fds[name]):
                    break

    def _wait(
        self,
        rid: int,
        timeout: float | None,
        emit: Callable[[str, bytes], None],
        limit: int,
        interrupted: threading.Event,
    ) -> dict[str, Any]:
        assert self.proc is not None
        decoder = proto.FrameDecoder(max_payload=_LOCAL_MAX)
        deadline = None if timeout is None else time.monotonic() + float(timeout)
        kill_at: float | None = None
        total = 0
        #: the output's size once it went over ``limit``: the run is interrupted and what it
        #: prints until it stops is dropped
        over: int | None = None
        names = {self.fds[n]: n for n in ("reply", "stdout", "stderr")}
        while True:
            now = time.monotonic()
            if deadline is not None and now > deadline and not interrupted.is_set():
                self._interrupt(interrupted)
            if interrupted.is_set() and kill_at is None:
                kill_at = now + INTERRUPT_GRACE
            if kill_at is not None and now > kill_at:
                self._stop()  # it ignored SIGINT: variables are lost, the agent is not
                if over is not None:
                    return {"too_large": True, "size": over, "kernel_alive": False}
                return {"timed_out": True, "kernel_alive": False}
            ready, _, _ = select.select(list(names), [], [], 0.05)
            if not ready and self.proc.poll() is not None:
                # The kernel is gone, but what it started may hold its reply pipe open (a
                # forked worker, a command of an older kernel): no EOF would come, so read
                # it as one
                ready = [self.fds["reply"]]
            for fd in ready:
                chunk = _read_nonblocking(fd)
                if names[fd] != "reply":
                    if not chunk:  # readable and empty: at EOF, user code closed its fd 1/2
                        del names[fd]  # (else select finds it ready at once, for ever)
                        continue
                    if over is not None:
                        continue
                    total += len(chunk)
                    if total > limit:
                        # wait for the run to stop (or kill it): left running, it would
                        # print into the next runs, and fill their output too
                        over = total
                        emit = _discard
                        self._interrupt(interrupted)
                    elif chunk:
                        emit(names[fd], chunk)
                    continue
                if not chunk:
                    self._drain(emit)
                    if over is not None:
                        self._stop()
                        return {"too_large": True, "size": over, "kernel_alive": False}
                    code = self.proc.wait()
                    self._stop()
                    return {
                        "reply": {
                            "results": [],
                            "error": {
                                "name": "KernelDied",
                                "value": f"the interpreter exited with code {code}; its variables "
                                "are lost and the next run starts a new one",
                                "traceback": "",
                            },
                        }
                    }
                for frame in decoder.feed(chunk):
                    if frame.id != rid:
                        continue  # the reply to a reseed
                    self._drain(emit)
                    if over is not None:
                        return {"too_large": True, "size": over, "kernel_alive": True}
                    reply = dict(json.loads(frame.payload))
                    error = reply.get("error") or {}
                    if interrupted.is_set() and error.get("name") == "KeyboardInterrupt":
                        return {"timed_out": True, "kernel_alive": True}
                    return {"reply": reply}

    def _drain(self, emit: Callable[[str, bytes], None]) -> None:
        # The kernel flushed before replying, so all its output is in the pipes by now.
        for name in ("stdout", "stderr"):
            while chunk := _read_nonblocking(self.fds[name]):
                emit(name, chunk)


def _discard(stream: str, chunk: bytes) -> None:
    """An ``emit`` that drops the output."""


def _read_nonblocking(fd: int) -> bytes:
    """Up to 64 KiB from ``fd``; b"" when nothing is there (or at EOF)."""
    try:
        return os.read(fd, 1 << 16)
    except BlockingIOError:
        return b""


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--kernel":
    kernel_main(int(sys.argv[2]), int(sys.argv[3]))
