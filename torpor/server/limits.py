"""A bound on every request body, before anything parses it.

The request models bound each field (labels, names, commands, env ...), but a model only sees
a body once it is parsed: 200 MB of labels used to take the server to 1.8 GiB of RSS before
any check ran. :class:`BodyLimit` refuses a body over its limit at the door: by its
``Content-Length`` at once, and by counting while it arrives when it has none (chunked). The
file upload route and the memory import read their own, larger bodies (``max_file_bytes``,
``max_import_bytes``) and are exempt here; every
other body is JSON and bounded by :data:`MAX_JSON_BODY` (code, the largest field, plus room).
An oversized body is answered ``413`` with a :class:`~torpor.errors.PayloadTooLarge`.
"""

from __future__ import annotations

import json
import re

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from torpor.config import LIMITS
from torpor.errors import PayloadTooLarge

__all__ = ["MAX_JSON_BODY", "BodyLimit"]

#: the largest JSON body any route takes: interpreter code at its limit, and room for the rest
MAX_JSON_BODY = LIMITS.max_code_bytes + (1 << 20)
#: the routes that stream a raw body of their own (they enforce max_file_bytes themselves)
_RAW_BODY = re.compile(r"^/v1/sandboxes/[^/]+/files$|^/v1/memory/import$")


class BodyLimit:
    """ASGI middleware: refuse request bodies over ``limit`` bytes (see the module)."""

    def __init__(self, app: ASGIApp, limit: int = MAX_JSON_BODY) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _RAW_BODY.match(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            await self._refuse(send, int(declared))
            return
        seen = 0
        refused = started = False

        async def counted() -> Message:
            nonlocal seen, refused
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:  # stop reading: to the app, the client went away
                    refused = True
                    return {"type": "http.disconnect"}
            return message

        async def unless_refused(message: Message) -> None:
            nonlocal started
            if not refused:  # once refused, the answer is ours
                started = started or message["type"] == "http.response.start"
                await send(message)

        try:
            await self.app(scope, counted, unless_refused)
        except Exception:
            if not refused:
                raise
        if refused and not started:  # (an app that answered before reading keeps its answer)
            await self._refuse(send, seen)

    async def _refuse(self, send: Send, size: int) -> None:
        err = PayloadTooLarge(
            f"request body of {size} bytes is over the {self.limit}-byte limit",
            size=size,
            limit=self.limit,
        )
        body = json.dumps({"error": err.to_wire()}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": err.http_status,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})
