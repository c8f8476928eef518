"""The host's side of ``localhost:7777`` inside a sandbox: its agent's memory, no credential.

The guest agent turns each HTTP request made to ``localhost:7777`` into a ``call`` frame over
the sandbox's channel (:mod:`torpor.sandbox.guest.relay`); the engine hands it to
:class:`GuestRelay` with the sandbox's id. Identity enters here, in :meth:`GuestRelay.context_of`:
the registry's record of that sandbox says its tenant and the ``memory_scope`` it was created
with (kept over pause/wake, inherited by forks), and the grants it is limited to (a restricted
token's own, when one bound it). Nothing the guest sends can change any of them: a call may
name levels below the scope (an ``agent``, a ``session``) but never another one.

Inside the VM::

    POST /mcp                     MCP (streamable HTTP, JSON): the memory tools (GET, which
                                  would open an event stream, is 405)
    POST /v1/memory/<tool>        the same tools as plain JSON: ``{"text": ...}`` -> the result
                                  (200), or ``{"error": {type, message, data}}`` (4xx)

The request is answered in-process, by a small ASGI app of its own (the memory tools only:
sandbox tools are not offered to a sandbox).
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
from typing import Any

import httpx
from fastapi import FastAPI
from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ToolError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from torpor import errors
from torpor.errors import AccessDenied, InvalidArgument, NotFound, TorporError
from torpor.memory.access import Access
from torpor.memory.models import Grant
from torpor.sandbox.requests import MemoryScope
from torpor.server.mcp.endpoint import Endpoint, from_request, memory_for
from torpor.server.mcp.tools import LEVELS, ToolContext, build_server

__all__ = ["GuestRelay"]

log = logging.getLogger(__name__)

#: the caller of the guest call being answered (set around the in-process request)
_BOUND: contextvars.ContextVar[ToolContext | None] = contextvars.ContextVar(
    "torpor_guest_caller", default=None
)
_TOOL_ERROR = re.compile(r"^Error executing tool \w+: (?:(?P<kind>[A-Z]\w+): )?")


def _bound_context() -> ToolContext:
    found = _BOUND.get()
    if found is None:  # only GuestRelay.__call__ reaches the relay app
        raise InvalidArgument("this request does not come from a sandbox")
    return found


async def _resolve(request: Request) -> ToolContext:
    return _bound_context()


async def _tool_context(ctx: Context) -> ToolContext:
    try:  # over /mcp: the Endpoint left it on the request
        return await from_request(ctx)
    except (ValueError, InvalidArgument):  # a direct call_tool (the REST routes): no request
        return _bound_context()


def _error(exc: TorporError) -> JSONResponse:
    return JSONResponse(status_code=exc.http_status, content={"error": exc.to_wire()})


def _tool_error(tool: str, exc: ToolError) -> JSONResponse:
    """A tool's refusal as the server's typed JSON error."""
    text = str(exc)
    if text.startswith("Unknown tool"):
        return _error(NotFound(f"no memory tool {tool!r}", kind="tool", name=tool))
    match = _TOOL_ERROR.match(text)
    message = text[match.end() :] if match else text
    kind = match.group("kind") if match else None
    cls = getattr(errors, kind, None) if kind else None
    if not (isinstance(cls, type) and issubclass(cls, TorporError)):
        cls = InvalidArgument  # the arguments failed the tool's schema
    wire = {"type": cls.__name__, "message": message, "data": {}}
    return JSONResponse(status_code=cls.http_status, content={"error": wire})


class GuestRelay:
    """Answers the calls of every sandbox's guest (set as the engine's ``guest_calls``)."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self.server = build_server(_tool_context, sandbox_tools=False, name="torpor-sandbox")
        routes = [
            # POST only: a call is answered once, whole, and the endpoint is stateless, so a
            # GET's event stream would carry nothing and never end (405, as MCP allows)
            Route("/mcp", Endpoint(self.server, _resolve), methods=["POST"]),
            Route("/v1/memory/{tool}", self._rest, methods=["POST"]),
        ]
        self.asgi = Starlette(routes=routes)
        self._http = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=self.asgi), base_url="http://localhost:7777"
        )

    async def context_of(self, sandbox_id: str) -> ToolContext:
        """Who a sandbox's guest is: THE place identity enters for calls from inside a VM.

        Raises :class:`~torpor.errors.SandboxNotFound`, :class:`AccessDenied` for a sandbox
        created without a ``memory_scope``.
        """
        rec = self.app.state.manager.registry.get(sandbox_id)
        scope: dict[str, Any] = rec.memory_scope or {}
        levels = {lv: str(scope[lv]) for lv in LEVELS if scope.get(lv)}
        if not rec.memory_scope:
            raise AccessDenied(
                f"sandbox {rec.name!r} was created without a memory_scope",
                tenant=rec.tenant,
                scope="",
            )
        memory = await memory_for(self.app, rec.tenant)
        actor = f"sandbox:{rec.id}"
        if scope.get("grants") is not None:  # bound by a restricted token: its rights, no more
            given = MemoryScope.model_validate(scope).grants or []
            grants = [Grant(mode=g.mode, prefix=g.prefix) for g in given]
            memory = memory.acting_as(Access(memory.backend, rec.tenant, actor, grants))
        # a refusal is audited in the tenant's log, by the sandbox, as every other refusal
        audit = Access(self.app.state.identity.backend, rec.tenant, actor)
        return ToolContext(
            tenant=rec.tenant,
            memory=memory,
            scope=levels,
            read_only=bool(scope.get("read_only")),
            deny=audit.deny,
        )

    async def __call__(
        self, sandbox_id: str, method: str, path: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, dict[str, str], bytes]:
        """One HTTP request from inside sandbox ``sandbox_id``, answered in-process."""
        try:
            bound = await self.context_of(sandbox_id)
        except TorporError as exc:
            wire = json.dumps({"error": exc.to_wire()}).encode()
            return exc.http_status, {"content-type": "application/json"}, wire
        token = _BOUND.set(bound)
        try:
            response = await self._http.request(method, path, headers=headers, content=body)
        finally:
            _BOUND.reset(token)
        kept = {"content-type": response.headers.get("content-type", "application/json")}
        return response.status_code, kept, response.content

    async def _rest(self, request: Request) -> Response:
        tool = request.path_params["tool"]
        try:
            args = json.loads(await request.body() or b"{}")
        except (ValueError, RecursionError) as exc:  # (nested too deep: RecursionError)
            return _error(InvalidArgument(f"the body is not JSON: {exc}"))
        if not isinstance(args, dict):
            return _error(InvalidArgument("the body must be a JSON object of the tool's arguments"))
        try:
            result = await self.server.call_tool(tool, args)
        except ToolError as exc:
            return _tool_error(tool, exc)
        structured = getattr(result, "structured_content", None)
        if getattr(result, "is_error", False) or structured is None:
            return _error(TorporError(f"memory tool {tool!r} gave no result"))
        return JSONResponse(structured)

    async def close(self) -> None:
        """Close the in-process client."""
        await self._http.aclose()
