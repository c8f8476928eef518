"""The memory endpoint inside the VM: ``localhost:7777``, relayed to the host (stdlib only).

An agent in the sandbox calls ``http://localhost:7777/mcp`` (MCP, streamable HTTP) or
``http://localhost:7777/v1/memory/...`` with no credential. Each HTTP request becomes one
``call`` frame to the host over the agent's port (:mod:`protocol`); the host answers it for the
sandbox's own tenant and memory scope, which it alone knows, and the ``answer`` frame becomes
the HTTP response. Nothing here holds a token: a process in the guest can reach exactly what
the host grants this sandbox.

The server listens on 127.0.0.1 only. A host that is not connected or does not answer in
time gives a 503/504 with a JSON error body shaped like the server's.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

log = logging.getLogger("torpor.agent.relay")

#: the port the endpoint listens on, inside the guest
PORT = 7777
#: the largest request body relayed (one frame's payload)
MAX_BODY = 1 << 20
#: seconds to wait for the host's answer
TIMEOUT = 120.0
#: request headers passed on to the host (the rest stay in the guest)
PASSED_HEADERS = ("content-type", "accept", "mcp-protocol-version", "mcp-session-id")

__all__ = ["MAX_BODY", "PORT", "CallFailed", "Caller", "serve"]


class CallFailed(Exception):
    """The host could not be asked (``status`` 503) or did not answer in time (504)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Caller(Protocol):
    """What the relay needs from the agent: one request/response round trip to the host."""

    def call(
        self, request: dict[str, Any], body: bytes, timeout: float
    ) -> tuple[dict[str, Any], bytes]: ...


def _error_body(kind: str, message: str) -> bytes:
    return json.dumps({"error": {"type": kind, "message": message, "data": {}}}).encode()


def _handler(caller: Caller) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "torpor-relay"

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("relay: " + format, *args)

        def _reply(self, status: int, headers: dict[str, str], body: bytes) -> None:
            self.send_response(status)
            for key, value in headers.items():
                if key.lower() not in ("content-length", "transfer-encoding", "connection"):
                    self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _relay(self) -> None:
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if length < 0 or length > MAX_BODY:
                self.close_connection = True
                # read (and drop) a moderately large body, so the client sees the answer
                # rather than a reset connection
                left = length if 0 < length <= 16 * MAX_BODY else 0
                while left > 0:
                    chunk = self.rfile.read(min(left, 1 << 16))
                    if not chunk:
                        break
                    left -= len(chunk)
                message = f"a body of {length} bytes is over the relay's {MAX_BODY}"
                self._reply(
                    413,
                    {"Content-Type": "application/json"},
                    _error_body("PayloadTooLarge", message),
                )
                return
            body = self.rfile.read(length) if length else b""
            headers = {k: v for k in PASSED_HEADERS if (v := self.headers.get(k)) is not None}
            request = {"method": self.command, "path": self.path, "headers": headers}
            try:
                answer, payload = caller.call(request, body, TIMEOUT)
            except CallFailed as exc:
                kind = "ServerUnavailable" if exc.status == 503 else "OperationTimeout"
                self._reply(
                    exc.status, {"Content-Type": "application/json"}, _error_body(kind, str(exc))
                )
                return
            raw_headers = answer.get("headers")
            out = (
                {str(k): str(v) for k, v in raw_headers.items()}
                if isinstance(raw_headers, dict)
                else {}
            )
            self._reply(int(answer.get("status") or 502), out, payload)

        do_GET = do_POST = do_PUT = do_DELETE = _relay

    return Handler


def serve(caller: Caller, port: int = PORT) -> ThreadingHTTPServer | None:
    """Start the endpoint on ``127.0.0.1:port`` in a daemon thread; None if the port is taken."""
    try:
        server = ThreadingHTTPServer(("127.0.0.1", port), _handler(caller))
    except OSError as exc:
        log.warning("memory relay: cannot listen on 127.0.0.1:%d: %s", port, exc)
        return None
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True, name="relay").start()
    return server
