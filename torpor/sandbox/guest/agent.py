#!/usr/bin/env python3
"""The torpor guest agent: serves the host over a virtio-serial port (stdlib only).

Runs inside the VM as ``python3 /opt/torpor/agent.py --port /dev/virtio-ports/org.torpor.agent``
(tests run it on the host with ``--socket PATH``: it then listens on a unix socket, the way
QEMU does for the real port, and the host connects). Next to it in /opt/torpor:
``protocol.py`` (the wire format), ``ops.py`` (what each request does) and ``interpreter.py``
(the long-lived Python kernel). This file is the transport: links, framing, dispatch.

The host hangs up on every hibernate and a new QEMU reconnects on wake, so a hang-up is normal:
the agent drops the half-received frame, keeps every process and variable, and polls again
every 10 ms. Each request runs on its own thread (``ping`` and ``refresh`` run in order on the
read loop); replies to requests of an earlier connection are dropped (``generation``). It never
exits on its own.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import logging
import os
import select
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

if __package__:  # imported as torpor.sandbox.guest.agent (type checks, host tools)
    from . import interpreter, ops, relay
    from . import protocol as proto
else:  # run as a script in the guest: the modules sit next to this file
    import interpreter  # type: ignore[no-redef]
    import ops  # type: ignore[no-redef]
    import protocol as proto  # type: ignore[no-redef]
    import relay  # type: ignore[no-redef]

log = logging.getLogger("torpor.agent")

Failure = ops.Failure
#: how long to wait before polling a hung-up port again (a wake must not wait longer)
HANGUP_POLL = 0.01
#: results larger than this (JSON bytes) go in data frames, not in the reply's header
BIG_RESULT = 256 * 1024
#: ops served on the read loop itself, in arrival order: quick, and after a wake the first
#: answer is what the host waits for (a thread start costs milliseconds of freshly
#: translated code under TCG); a refresh also takes effect before any later request starts.
#: Keystrokes, resizes and bytes for a tunnel too: they must arrive in order (they are only
#: queued here, never waited on).
INLINE_OPS = frozenset(
    {"ping", "refresh", "pty_input", "pty_resize", "tunnel_send", "tunnel_close"}
)


class Link:
    """A byte stream to the host that survives hang-ups: ``read`` returns b"" on a hang-up,
    and the next ``read`` waits for the host to come back."""

    #: CLOCK_MONOTONIC when a read first found the host connected with nothing to read yet
    #: (after a hang-up; None until then): when the guest saw the host come back
    host_seen: float | None = None

    def read(self) -> bytes:
        raise NotImplementedError

    def write(self, data: bytes) -> bool:
        """Write all of ``data``; False if the host hung up (the rest is dropped)."""
        raise NotImplementedError


class PortLink(Link):
    """A virtio-serial character device. While no host is connected, poll() reports POLLHUP
    and writes would block, so writes are non-blocking and abandoned on POLLHUP."""

    def __init__(self, path: str) -> None:
        for attempt in itertools.count():
            try:
                self.fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
                return
            except OSError as exc:  # the device node may appear late in boot
                if attempt % 100 == 0:
                    log.warning("cannot open %s (%s); retrying", path, exc)
                time.sleep(0.1)

    def read(self) -> bytes:
        # Try the read first: during a transfer data is nearly always there, and a poll()
        # per 4 KiB buffer doubles the system calls (slow under TCG).
        try:
            data = os.read(self.fd, 1 << 18)
            if data:
                return data
        except BlockingIOError:  # the host is connected, nothing to read yet
            if self.host_seen is None:
                self.host_seen = time.monotonic()
        except OSError:
            return b""
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        while True:
            events = poller.poll(1000)
            if not events:
                continue
            mask = events[0][1]
            if mask & select.POLLIN:
                try:
                    return os.read(self.fd, 1 << 18)
                except BlockingIOError:
                    continue
                except OSError:
                    return b""
            if mask & (select.POLLHUP | select.POLLERR):
                return b""

    def write(self, data: bytes) -> bool:
        view = memoryview(data)
        poller = select.poll()
        poller.register(self.fd, select.POLLOUT)
        while view:
            try:
                n = os.write(self.fd, view)
                view = view[n:]
                continue
            except BlockingIOError:
                pass
            except OSError:
                return False
            events = poller.poll(1000)
            if events and events[0][1] & (select.POLLHUP | select.POLLERR):
                return False
        return True


class SocketLink(Link):
    """Test mode: listen on a unix socket and serve one host connection at a time."""

    def __init__(self, path: str) -> None:
        if os.path.exists(path):
            os.unlink(path)
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(path)
        self.server.listen(4)
        self.conn: socket.socket | None = None

    def read(self) -> bytes:
        if self.conn is None:
            conn, _ = self.server.accept()
            self.conn = conn
        try:
            data = self.conn.recv(1 << 18)
        except OSError:
            data = b""
        if not data:
            conn, self.conn = self.conn, None
            conn.close()
        return data

    def write(self, data: bytes) -> bool:
        conn = self.conn
        if conn is None:
            return False
        try:
            conn.sendall(data)
            return True
        except OSError:
            return False


class Request:
    """One request being served: sends its events, data and reply on the right connection."""

    def __init__(
        self, agent: Agent, generation: int, req_id: int, op: str, args: dict[str, Any]
    ) -> None:
        self.agent = agent
        self.generation = generation
        self.id = req_id
        self.op = op
        self.args = args
        self.cancel_hook: Callable[[], None] | None = None
        self.cancelled = False

    def event(self, stream: str, chunk: bytes) -> None:
        self.agent.send(self.generation, {"i": self.id, "t": proto.EVENT, "s": stream}, chunk)

    def data(self, chunk: bytes) -> None:
        self.agent.send(self.generation, {"i": self.id, "t": proto.DATA}, chunk)

    def cancel(self) -> None:
        self.cancelled = True
        if self.cancel_hook is not None:
            self.cancel_hook()


class _Call:
    """A call to the host (the memory relay) waiting for its answer."""

    def __init__(self, generation: int) -> None:
        self.generation = generation
        self.done = threading.Event()
        self.answer: dict[str, Any] | None = None
        self.payload = b""


class Agent:
    """Reads frames from the link and runs each request on a thread of its own; makes the
    relay's calls to the host (:meth:`call`)."""

    def __init__(self, link: Link, *, set_clock: bool = True) -> None:
        self.link = link
        self.generation = 0
        self.connected = False
        self._send_lock = threading.Lock()
        self._active: dict[int, Request] = {}
        self._uploads: dict[int, tuple[Request, ops.Upload]] = {}
        self.kernel = interpreter.KernelClient()
        self.ops = ops.Operations(self.kernel, set_clock=set_clock)
        self._calls: dict[int, _Call] = {}
        self._call_ids = itertools.count(1)
        #: CLOCK_MONOTONIC of the last turns of the loop that waits for a host (one every
        #: :data:`HANGUP_POLL`): the guest's clock stands still while QEMU is stopped, so
        #: the turns after a wake show when the guest ran again
        self._idle_turns: collections.deque[float] = collections.deque(maxlen=6)
        #: how the current connection began, in the guest's CLOCK_MONOTONIC: ``turns`` (the
        #: idle turns before it), ``host_seen`` (a read found the host connected, if one did
        #: before the first bytes); the ping answers with it. Empty when the guest was
        #: frozen before it saw the last host hang up (a hibernate right after a request)
        self.wake_marks: dict[str, Any] = {}
        #: CLOCK_MONOTONIC when the last read from the host returned
        self.read_at = 0.0

    def call(
        self, request: dict[str, Any], body: bytes, timeout: float
    ) -> tuple[dict[str, Any], bytes]:
        """One round trip to the host: a ``call`` frame, then its ``answer``.

        Raises :class:`relay.CallFailed`: 503 with no host connected (or one that hung up
        before answering), 504 when no answer came within ``timeout`` seconds.
        """
        cid = next(self._call_ids)
        with self._send_lock:
            if not self.connected:
                raise relay.CallFailed(503, "the torpor host is not connected")
            pending = self._calls[cid] = _Call(self.generation)
        try:
            self.send(pending.generation, {"i": cid, "t": proto.CALL, **request}, body)
            if not pending.done.wait(timeout):
                raise relay.CallFailed(504, f"the torpor host did not answer within {timeout} s")
        finally:
            self._calls.pop(cid, None)
        if pending.answer is None:
            raise relay.CallFailed(503, "the torpor host hung up before answering")
        return pending.answer, pending.payload

    def send(self, generation: int, header: dict[str, Any], payload: bytes = b"") -> None:
        """Send one frame, unless the connection it answers has hung up since."""
        frame = proto.encode_frame(header, payload)
        with self._send_lock:
            if generation != self.generation or not self.connected:
                return
            if not self.link.write(frame):
                log.debug("host hung up while we were sending")

    def serve_forever(self) -> None:
        """Serve requests until the process is killed; host hang-ups are survived."""
        decoder = proto.FrameDecoder()
        while True:
            data = self.link.read()
            self.read_at = time.monotonic()
            if not data:
                if self.connected:
                    self._hang_up()
                decoder.reset()
                self.link.host_seen = None
                self._idle_turns.append(self.read_at)
                time.sleep(HANGUP_POLL)
                continue
            if not self.connected:
                self.wake_marks = {"turns": list(self._idle_turns)}
                if self.link.host_seen is not None:
                    self.wake_marks["host_seen"] = self.link.host_seen
                self._idle_turns.clear()
                with self._send_lock:
                    self.connected = True
                # debug, not info: the agent's log is the serial console, and under TCG
                # each byte written there is a slow I/O exit, on every wake's critical path
                log.debug("host connected (generation %d)", self.generation)
            for frame in decoder.feed(data):
                try:
                    self._on_frame(frame)
                except Exception as exc:  # a bad frame must never stop the agent
                    log.exception("failed to handle frame %r", frame.header)
                    self._refuse(frame, exc)

    def _refuse(self, frame: proto.Frame, exc: Exception) -> None:
        """Answer the request ``frame`` belongs to with the error handling it raised (args
        that are not an object, a bad number, a path with NUL): the host would otherwise wait
        out its timeout for a reply that never comes."""
        if frame.type not in (proto.REQ, proto.DATA):
            return
        entry = self._uploads.pop(frame.id, None)
        if entry is not None:
            entry[1].abort()
        op = str(frame.header.get("op", "")) if frame.type == proto.REQ else ""
        error = proto.error_dict("GuestError", f"the guest cannot take request {op!r}: {exc!r}")
        try:
            self.send(
                self.generation, {"i": frame.id, "t": proto.REPLY, "ok": False, "error": error}
            )
        except Exception:  # the host went away: nobody is waiting
            log.exception("cannot answer request %d", frame.id)

    def _hang_up(self) -> None:
        with self._send_lock:
            self.connected = False
            self.generation += 1
        for _, upload in self._uploads.values():
            upload.abort()
        self._uploads.clear()
        for pending in list(self._calls.values()):  # their answers will never come
            pending.done.set()
        self.ops.terminals.hang_up()  # nobody reads them any more
        self.ops.tunnels.hang_up()
        log.debug("host hung up; now generation %d", self.generation)

    def _on_frame(self, frame: proto.Frame) -> None:
        header, rid = frame.header, frame.id
        if frame.type == proto.REQ:
            req = Request(
                self,
                self.generation,
                rid,
                str(header.get("op", "")),
                dict(header.get("args") or {}),
            )
            if req.op == "write":
                upload = self.ops.start_upload(req.id, req.args)
                upload.add(frame.payload)
                if header.get("more"):
                    self._uploads[rid] = (req, upload)
                else:
                    self._start(req, upload)
            elif header.get("more"):
                upload = ops.Upload(None, int(req.args.get("max_bytes") or 1 << 26))
                upload.add(frame.payload)
                self._uploads[rid] = (req, upload)
            elif req.op in INLINE_OPS:
                self._serve(req, frame.payload)
            else:
                self._start(req, frame.payload)
        elif frame.type == proto.DATA:
            entry = self._uploads.get(rid)
            if entry is None:
                return
            entry[1].add(frame.payload)
            if not header.get("more"):
                del self._uploads[rid]
                self._start(entry[0], entry[1])
        elif frame.type == proto.ANSWER:
            waiting = self._calls.get(rid)
            if waiting is not None and not waiting.done.is_set():
                waiting.answer, waiting.payload = dict(header), frame.payload
                waiting.done.set()
        elif frame.type == proto.CANCEL:
            req_or_none = self._active.get(rid)
            if req_or_none is not None:
                req_or_none.cancel()
            upload_entry = self._uploads.pop(rid, None)
            if upload_entry is not None:  # the host gave up half-way: leave no file behind
                upload_entry[1].abort()

    def _start(self, req: Request, payload: Any) -> None:
        self._active[req.id] = req
        threading.Thread(
            target=self._serve, args=(req, payload), daemon=True, name=f"req-{req.id}-{req.op}"
        ).start()

    def _serve(self, req: Request, payload: Any) -> None:
        header: dict[str, Any] = {"i": req.id, "t": proto.REPLY}
        try:
            handler = self.ops.handler(req.op)
            if isinstance(payload, ops.Upload) and req.op != "write":
                if payload.failure is not None:  # e.g. code over its limit
                    raise payload.failure
                payload = payload.bytes()
            result = handler(req, payload)
            raw = json.dumps(result, separators=(",", ":")).encode("utf-8")
            if len(raw) <= BIG_RESULT:
                header["result"] = result
            else:  # a long listing or a big repr: send it as data, the reply says so
                for at in range(0, len(raw), proto.CHUNK):
                    req.data(raw[at : at + proto.CHUNK])
                header["result_in_data"] = True
            header["ok"] = True
        except Failure as exc:
            header.update(ok=False, error=exc.wire())
        except OSError as exc:
            header.update(ok=False, error=ops.os_failure(exc, str(req.args.get("path", ""))).wire())
        except UnicodeEncodeError as exc:
            error = ops.unencodable(exc, str(req.args.get("path", "")))
            header.update(ok=False, error=error.wire())
        except Exception as exc:
            log.exception("%s failed", req.op)
            header.update(
                ok=False,
                error=proto.error_dict(
                    "GuestError",
                    f"{req.op} failed in the guest: {exc!r}",
                    op=req.op,
                    traceback=traceback.format_exc(),
                ),
            )
        finally:
            self._active.pop(req.id, None)
        try:
            self.send(req.generation, header)
        except proto.ProtocolError as exc:
            self.send(
                req.generation,
                {
                    "i": req.id,
                    "t": proto.REPLY,
                    "ok": False,
                    "error": proto.error_dict(
                        "PayloadTooLarge", str(exc), size=exc.size, limit=exc.limit
                    ),
                },
            )


def main(argv: list[str] | None = None) -> None:
    """Parse arguments and serve forever."""
    parser = argparse.ArgumentParser(description="torpor guest agent")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--port", help="virtio-serial device to serve")
    where.add_argument("--socket", help="test mode: listen on this unix socket")
    parser.add_argument(
        "--no-clock", action="store_true", help="never set the system clock (tests on a real host)"
    )
    parser.add_argument(
        "--workdir",
        help="working directory of commands, relative paths and "
        "the interpreter (default with --port: /workspace if it exists)",
    )
    parser.add_argument(
        "--cold-interpreter",
        action="store_true",
        help="start the interpreter on the first run, not at start-up",
    )
    parser.add_argument(
        "--relay-port",
        type=int,
        help=f"serve the memory relay on 127.0.0.1:PORT (default with --port: {relay.PORT}; "
        "0: none)",
    )
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    workdir = args.workdir or ("/workspace" if args.port and os.path.isdir("/workspace") else None)
    if workdir:
        os.chdir(workdir)
    logging.basicConfig(
        level=args.log_level,
        stream=sys.stderr,
        format="%(asctime)s torpor-agent %(levelname)s %(message)s",
    )
    link: Link = PortLink(args.port) if args.port else SocketLink(args.socket)
    agent = Agent(link, set_clock=not args.no_clock)
    relay_port = (
        args.relay_port if args.relay_port is not None else (relay.PORT if args.port else 0)
    )
    if relay_port:
        relay.serve(agent, relay_port)
    if not args.cold_interpreter:
        threading.Thread(target=agent.kernel.warm_up, daemon=True, name="warm-up").start()
    while True:  # exiting would lose the interpreter: log, pause, serve again
        try:
            agent.serve_forever()
        except Exception:
            log.exception("the serve loop failed; serving again")
            time.sleep(0.1)


if __name__ == "__main__":
    main()
