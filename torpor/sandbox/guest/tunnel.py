"""TCP connections to a port in the guest, carried over the agent's channel (stdlib only).

This is how the host reaches a server in the sandbox (``sbx.get_host(8000)``) with no network
device at all: the host accepts a connection on its own port and asks the agent, with a
``tunnel`` request that lasts as long as the connection, to connect to ``127.0.0.1:PORT`` in
the guest. The agent answers with a ``started`` event, then ``data`` events carrying what the
guest's server sends, and a reply when the server closes its side. ``tunnel_send`` (payload:
bytes for the server) and ``tunnel_close`` (no more bytes: shut the write side) name the
connection by the host's id. Bytes to the server are written by a thread per connection, in
order, so the agent's read loop never waits on a slow server.

A connection belongs to the host connection that opened it: when the host hangs up (a pause),
or a new host connection starts, every tunnel is closed, and the host opens new ones after
the wake.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Tunnels"]

#: a close (shut the write side) in the send queue
_CLOSE = b""


class _Conn:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._out: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        threading.Thread(target=self._writer, daemon=True, name="tunnel-out").start()

    def send(self, data: bytes) -> None:
        if data:
            self._out.put(data)

    def close_write(self) -> None:
        self._out.put(_CLOSE)

    def finish(self) -> None:
        """Stop the writer; it closes the socket once what was queued is dealt with."""
        self._out.put(None)

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def _writer(self) -> None:
        broken = False
        while (data := self._out.get()) is not None:
            if broken:
                continue
            try:
                if data == _CLOSE:
                    self.sock.shutdown(socket.SHUT_WR)
                else:
                    self.sock.sendall(data)
            except OSError:
                broken = True
        self.sock.close()  # here, so no write can reach a reused descriptor


class Tunnels:
    """The open tunnels by the host's id; ``failure`` makes the agent's errors."""

    def __init__(self, failure: Callable[..., Exception]) -> None:
        self.Failure = failure
        self._open: dict[str, _Conn] = {}
        self._lock = threading.Lock()

    def _get(self, tid: str) -> _Conn:
        with self._lock:
            conn = self._open.get(tid)
        if conn is None:
            raise self.Failure("NotFound", f"no open tunnel {tid!r}", kind="tunnel", name=tid)
        return conn

    def run(self, req: Any) -> dict[str, Any]:
        """Serve a ``tunnel`` request until the guest's server closes: ``{"bytes"}`` it sent."""
        tid, port = str(req.args["id"]), int(req.args["port"])
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        except OSError as exc:
            raise self.Failure(
                "NotFound",
                f"nothing accepts connections on port {port} in the sandbox ({exc.strerror})",
                kind="port",
                name=str(port),
            ) from None
        sock.settimeout(None)
        conn = _Conn(sock)
        with self._lock:
            self._open[tid] = conn
        req.cancel_hook = conn.abort
        if req.cancelled:  # the host gave up while this was connecting
            conn.abort()
        total = 0
        try:
            req.event("started", b"")
            while True:
                try:
                    chunk = sock.recv(1 << 16)
                except OSError:
                    break
                if not chunk:
                    break
                total += len(chunk)
                req.event("data", chunk)
        finally:
            req.cancel_hook = None
            with self._lock:
                self._open.pop(tid, None)
            conn.finish()
        return {"bytes": total}

    def send(self, req: Any, payload: bytes) -> dict[str, Any]:
        self._get(str(req.args["id"])).send(payload)
        return {}

    def close(self, req: Any) -> dict[str, Any]:
        self._get(str(req.args["id"])).close_write()
        return {}

    def hang_up(self) -> None:
        """The host went away: nobody reads these connections any more; end them."""
        with self._lock:
            conns = list(self._open.values())
        for conn in conns:
            conn.abort()
