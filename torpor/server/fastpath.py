"""A shorter way through the server for the hot memory routes (recall, context, remember, log).

A recall over the local socket costs the server more CPU around the store call than the call
itself on a small store: FastAPI's router matching (the memory routes come late among ~60),
its dependency solving, the body's validation through its generic machinery. :class:`FastPath`
(ASGI middleware, innermost, so :class:`~torpor.server.limits.BodyLimit` and everything outside
it still apply) answers these four operations itself, with the route's own code
(:func:`~torpor.server.routes_memory.open_scope_of` and ``do_*``): one ``model_validate_json``
of the body, then one trip to the thread pool that resolves the caller exactly as
:func:`~torpor.server.deps.get_caller` does (the tokenless socket owner without a lookup, a token
looked up on every request so a revoke holds at once, every refusal audited), opens the scope
and renders the JSON.

It takes only requests it can answer as the route would: ``POST`` to one of :data:`ROUTES`
with a JSON ``Content-Type``, at most one ``scope`` and one ``tenant`` query parameter within
the route's bounds, and a body the route's model accepts. Anything else (a bad body, an odd
query, another content type) goes on, body replayed, to FastAPI, which answers it, errors
included, as it always did. An error of the operation is answered by the app's own exception
handlers, so its typed JSON body is the route's. The OpenAPI document does not change: the
routes stay declared in :mod:`torpor.server.routes_memory`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl

from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from torpor.server import routes_memory as rm
from torpor.server.auth import Caller

__all__ = ["ROUTES", "FastPath"]

#: path -> (the route's body model, its work once the scope is open)
ROUTES: dict[str, tuple[type[BaseModel], Callable[[Any, Any], Response]]] = {
    "/v1/memory/recall": (rm.RecallBody, rm.do_recall),
    "/v1/memory/context": (rm.ContextBody, rm.do_context),
    "/v1/memory/remember": (rm.RememberBody, rm.do_remember),
    "/v1/memory/log": (rm.LogBody, rm.do_log),
}
#: the query parameters of those routes, and their bounds (``ScopeQuery``, ``TenantQuery``)
_QUERY = {"scope": 2000, "tenant": 200}


def _json_type(headers: list[tuple[bytes, bytes]]) -> bool:
    for name, value in headers:
        if name == b"content-type":
            mime = value.split(b";", 1)[0].strip().lower()
            return mime == b"application/json" or (
                mime.startswith(b"application/") and mime.endswith(b"+json")
            )
    return False


def _query(raw: bytes) -> dict[str, str] | None:
    """``scope`` and ``tenant`` from a query string, or None where the route should judge."""
    try:
        pairs = parse_qsl(raw.decode("latin-1"), keep_blank_values=True)
    except ValueError:
        return None
    found: dict[str, str] = {}
    for key, value in pairs:
        bound = _QUERY.get(key)
        if bound is None or key in found or len(value) > bound:
            return None
        found[key] = value
    return found


class FastPath:
    """ASGI middleware: answer :data:`ROUTES` without FastAPI's routing (see the module).

    ``enabled``: False passes every request on (for benchmarks comparing both ways)."""

    def __init__(self, app: ASGIApp, enabled: bool = True) -> None:
        self.app = app
        self.enabled = enabled

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = ROUTES.get(scope.get("path", "")) if self.enabled else None
        if (
            route is None
            or scope["type"] != "http"
            or scope.get("method") != "POST"
            or not _json_type(scope.get("headers") or [])
        ):
            await self.app(scope, receive, send)
            return
        query = _query(scope.get("query_string", b""))
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away (or BodyLimit said so)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        raw = b"".join(chunks)
        model, work = route
        body: BaseModel | None = None
        if query is not None:
            try:
                body = model.model_validate_json(raw)
            except ValidationError:
                body = None
        if body is None:  # the route answers it, and its errors, as it always did
            await self.app(scope, _replay(raw, receive), send)
            return
        request = Request(scope, receive)
        try:
            response = await run_in_threadpool(_answer, request, query or {}, work, body)
        except Exception as exc:
            response = await _handled(request, exc)
        await response(scope, receive, send)


def _answer(
    request: Request, query: dict[str, str], work: Callable[[Any, Any], Response], body: Any
) -> Response:
    """On the worker thread: the caller (as ``get_caller``), the scope, the route's work."""
    caller: Caller = request.app.state.identity.caller(
        request.headers.get("authorization"), trusted=_over_socket(request.scope)
    )
    s = rm.open_scope_of(request, caller, query.get("scope", ""), query.get("tenant"))
    return work(s, body)


def _over_socket(scope: Scope) -> bool:
    server: Any = scope.get("server")
    return server is not None and server[1] is None


async def _handled(request: Request, exc: Exception) -> Response:
    """The app's own answer to ``exc`` (its exception handler for the nearest class)."""
    handlers: dict[Any, Any] = request.app.exception_handlers
    for cls in type(exc).__mro__:
        handler = handlers.get(cls)
        if handler is not None:
            response: Response = await handler(request, exc)
            return response
    raise exc


def _replay(raw: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives ``raw`` as the whole body once, then the client's own."""
    given = False

    async def replayed() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": raw, "more_body": False}
        return await receive()

    return replayed
