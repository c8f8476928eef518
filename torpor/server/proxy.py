"""Cluster mode: a request for a sandbox another node runs is proxied to that node.

Any node accepts any request. When the manager answers ``Conflict`` with an ``owner_url`` (the
sandbox is held by another live node: :meth:`~torpor.sandbox.manager.cluster.ClusterNode.acquire`
raises it before anything is changed), :class:`OwnerProxy` sends the same request — method,
path, query, headers (the caller's token included), body — to the owner and streams its answer
back, so a client never needs to know where a sandbox runs. Proxied rather than redirected:
a redirect would need every client to follow a 307 with its body and its token to another host
(httpx, as the SDK uses it, does not resend a body or credentials across hosts by default),
and streamed command output would go through the same hop either way.

A proxied request carries ``X-Torpor-Proxied-By: <node>`` and is never proxied again (two
nodes that each think the other owns a sandbox answer the Conflict instead of looping); the
node it reaches sees it in :data:`~torpor.sandbox.manager.cluster.PROXIED`, so placement wakes
the sandbox there rather than naming yet another node. When
the owner cannot be reached, the caller gets the original Conflict (its lease lapses soon and
any node then recovers the sandbox); when it was a placement (the node chosen to wake a
paused sandbox: its origin, say, killed a moment ago and not yet stale), the receiving node
runs the request itself instead, as if it had been proxied there.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import httpx

from torpor.sandbox.manager.cluster import PROXIED

__all__ = ["PROXIED_HEADER", "OwnerProxy"]

log = logging.getLogger(__name__)

PROXIED_HEADER = "x-torpor-proxied-by"
_HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"host", b"content-length", b"te"}

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def _owner_url(body: bytes) -> tuple[str | None, bool]:
    """The URL a Conflict names and whether it is a placement (no node holds the sandbox)."""
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return None, False
    if not isinstance(error, dict) or error.get("type") != "Conflict":
        return None, False
    data = error.get("data") or {}
    url = data.get("owner_url") if isinstance(data, dict) else None
    if not (isinstance(url, str) and url.startswith(("http://", "https://"))):
        return None, False
    return url, bool(data.get("placed"))


class OwnerProxy:
    """ASGI middleware of a cluster node (see the module docstring). ``node`` is this node's
    name (sent along, so the owner never proxies it back)."""

    def __init__(self, app: Callable[..., Awaitable[None]], node: str) -> None:
        self.app = app
        self.node = node

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        via = next(
            (v for k, v in scope.get("headers", []) if k.lower() == PROXIED_HEADER.encode()), None
        )
        if via is not None:
            token = PROXIED.set(via.decode("latin-1") or "?")
            try:
                await self.app(scope, receive, send)
            finally:
                PROXIED.reset(token)
            return
        parts: list[bytes] = []
        ended = False

        async def recording() -> Message:
            nonlocal ended
            message = await receive()
            if message["type"] == "http.request":
                parts.append(message.get("body", b""))
                ended = not message.get("more_body", False)
            return message

        held: list[Message] = []

        async def holding(message: Message) -> None:
            if held or (message["type"] == "http.response.start" and message["status"] == 409):
                held.append(message)  # a Conflict: maybe the owner's to answer
                return
            await send(message)

        await self.app(scope, recording, holding)
        if not held:
            return
        body = b"".join(m.get("body", b"") for m in held[1:])
        url, placed = _owner_url(body)
        if url is not None:
            while not ended:  # the rest of a body the route did not read
                message = await receive()
                if message["type"] != "http.request":
                    break
                parts.append(message.get("body", b""))
                ended = not message.get("more_body", False)
            if await self._forward(url, scope, b"".join(parts), receive, send):
                return
            if placed:  # the node placement chose is unreachable: this node does it itself
                await self._here(scope, b"".join(parts), receive, send, url)
                return
        for message in held:
            await send(message)

    async def _here(
        self, scope: Scope, body: bytes, receive: Receive, send: Send, unreachable: str
    ) -> None:
        """Run the request again on this node as if proxied here (placement then wakes the
        sandbox here, when this node can)."""
        log.warning("%s unreachable: %s %s runs here", unreachable, scope["method"], scope["path"])
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if sent:  # the body was read: what comes next is the caller's disconnect
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        token = PROXIED.set(f"{self.node} (the node chosen, {unreachable}, is unreachable)")
        try:
            await self.app(scope, replay, send)
        finally:
            PROXIED.reset(token)

    async def _forward(
        self, base: str, scope: Scope, body: bytes, receive: Receive, send: Send
    ) -> bool:
        """Send the request to ``base`` and stream the answer; False when the owner cannot
        be reached (nothing was sent to the caller then). When the caller hangs up, the
        request to the owner is closed, so the owner ends what it runs for it (a terminal's
        program, a streamed command) as it would for a caller of its own."""
        path = scope.get("raw_path") or scope["path"].encode()
        query = scope.get("query_string", b"")
        target = base.rstrip("/") + path.decode("latin-1") + ("?" + query.decode() if query else "")
        headers = [
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in scope.get("headers", [])
            if k.lower() not in _HOP
        ]
        headers.append((PROXIED_HEADER, self.node))
        timeout = httpx.Timeout(None, connect=5.0)
        started = False
        try:
            async with httpx.AsyncClient(timeout=timeout) as client:
                request = client.build_request(
                    scope["method"], target, headers=headers, content=body
                )
                response = await client.send(request, stream=True)
                try:
                    started = True
                    await send(
                        {
                            "type": "http.response.start",
                            "status": response.status_code,
                            "headers": [
                                (k, v) for k, v in response.headers.raw if k.lower() not in _HOP
                            ],
                        }
                    )
                    await _relay(response, receive, send)
                finally:
                    await response.aclose()
        except httpx.HTTPError as exc:
            log.warning("cannot proxy %s %s to %s: %s", scope["method"], scope["path"], base, exc)
            return started  # once the answer began, the caller sees it cut short
        log.debug("proxied %s %s to %s", scope["method"], scope["path"], base)
        return True


async def _relay(response: httpx.Response, receive: Receive, send: Send) -> None:
    """Stream ``response`` 's body to the caller until it ends or the caller hangs up
    (``http.disconnect``: the body was read before, so that is all ``receive`` can say)."""

    async def body() -> None:
        async for chunk in response.aiter_raw():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def hang_up() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    relay, gone = asyncio.create_task(body()), asyncio.create_task(hang_up())
    try:
        await asyncio.wait({relay, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (relay, gone):
            task.cancel()
        await asyncio.gather(relay, gone, return_exceptions=True)
    if not relay.cancelled():
        relay.result()  # its error, if it had one
