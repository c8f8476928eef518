"""The cluster proxy (torpor.server.proxy.OwnerProxy) on its own: a node whose app answers a
Conflict naming another node's URL relays the request there and streams the answer back.
Two real uvicorn servers on loopback (no cluster, no database): the owner, and a front node
whose app always answers that Conflict."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from torpor.server.proxy import OwnerProxy


def _serve(app: Any) -> Iterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive()
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


class _Owner:
    """The owner node: ``/stream`` sends a line every 20 ms until its caller goes away."""

    def __init__(self) -> None:
        self.streaming = threading.Event()
        self.ended = threading.Event()

    async def stream(self, request: Request) -> StreamingResponse:
        async def lines() -> AsyncIterator[bytes]:
            self.streaming.set()
            try:
                while True:
                    yield b'{"type": "output"}\n'
                    await asyncio.sleep(0.02)
            finally:
                self.ended.set()

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/stream", self.stream, methods=["POST"])])


def _conflict_to(url: str) -> Any:
    """An app that answers every request with the Conflict naming ``url`` as the owner."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = json.dumps(
            {"error": {"type": "Conflict", "message": "held", "data": {"owner_url": url}}}
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 409,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})

    return app


@pytest.fixture
def owner() -> Iterator[tuple[_Owner, str]]:
    node = _Owner()
    for url in _serve(node.app()):
        yield node, url


def test_a_caller_hanging_up_ends_the_proxied_stream(owner: tuple[_Owner, str]) -> None:
    """The caller of a proxied stream (a terminal, a streamed command) hangs up: the proxy
    stops relaying and closes its request to the owner, which then ends what it ran for it
    (a terminal's program is killed when its stream's caller goes away)."""
    node, owner_url = owner
    for front in _serve(OwnerProxy(_conflict_to(owner_url), node="n2")):
        with (
            httpx.Client(timeout=10) as client,
            client.stream("POST", f"{front}/stream", content=b"{}") as response,
        ):
            assert response.status_code == 200
            assert next(response.iter_lines()) == '{"type": "output"}'
        assert node.streaming.is_set()
        assert node.ended.wait(10), "the owner still streams to a caller that hung up"
