"""An in-process torpor server (uvicorn in a thread) over a fake manager, for SDK tests."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import uvicorn

# The fake manager lives with the server tests; share it rather than keep two.
from tests.server.fake_manager import FakeManager
from torpor.client import Runtime
from torpor.server.app import create_app
from torpor.server.auth import TokenStore
from torpor.server.daemon import bind_unix_socket


@dataclass
class Served:
    manager: FakeManager
    runtime: Runtime
    home: Path


def _run(app: object, sock: socket.socket) -> Iterator[uvicorn.Server]:
    server = uvicorn.Server(uvicorn.Config(app, lifespan="on", log_level="warning"))  # type: ignore[arg-type]
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    try:
        yield server
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    """A fake-backed server on ``<tmp>/h/server.sock`` and a Runtime connected to it."""
    home = tmp_path / "h"
    home.mkdir()
    manager = FakeManager()
    app = create_app(manager, supervise=False, max_file_bytes=4096)
    sock = bind_unix_socket(home / "server.sock")
    for _ in _run(app, sock):
        rt = Runtime(home=home, autostart=False)
        yield Served(manager, rt, home)
        rt.close()


@pytest.fixture
def tcp_served() -> Iterator[tuple[FakeManager, str]]:
    """A fake-backed server on TCP with two tenants' tokens; yields (manager, base URL)."""
    manager = FakeManager()
    tokens = TokenStore({"a" * 32: "acme", "b" * 32: "globex"})
    app = create_app(manager, tokens=tokens, supervise=False)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    port = sock.getsockname()[1]
    for _ in _run(app, sock):
        yield manager, f"http://127.0.0.1:{port}"
