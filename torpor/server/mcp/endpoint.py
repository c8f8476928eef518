"""What both MCP endpoints share: the per-tenant memories, and the ASGI endpoint that
decides who calls before the MCP session manager sees the request.

:class:`Endpoint` runs a ``resolve(request)`` (the bearer token for ``/mcp``, the sandbox for
``localhost:7777``) and leaves the resulting :class:`~torpor.server.mcp.tools.ToolContext` on
the request, where the tools find it (:func:`from_request`). A refused caller gets the typed
JSON error before MCP sees anything.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import anyio.to_thread
from fastapi import FastAPI
from mcp.server.mcpserver import Context, MCPServer
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import Receive, Scope, Send

from torpor.errors import InvalidArgument, TorporError
from torpor.server.mcp.tools import ToolContext

__all__ = ["Endpoint", "MemoryFactory", "from_request", "memory_for"]

log = logging.getLogger(__name__)

#: the request scope key under which the endpoint leaves the caller's ToolContext
_SCOPE_KEY = "torpor.mcp.context"


#: ``factory(tenant)`` -> a memory of that tenant, for tests and embedders that set
#: ``app.state.memory_factory``; without one the tools use the server's own memory (the one the
#: memory routes serve, :func:`torpor.server.routes_memory.tenant_memory`).
MemoryFactory = Callable[[str], Any]


async def memory_for(app: FastAPI, tenant: str) -> Any:
    """The app's memory of ``tenant`` as its owner (callers narrow it to their grants).

    Raises what opening the store raises (:class:`~torpor.errors.StorageError` ...).
    """
    factory: MemoryFactory | None = getattr(app.state, "memory_factory", None)
    if factory is None:
        from torpor.server.routes_memory import tenant_memory

        return await anyio.to_thread.run_sync(tenant_memory, app, tenant)
    memories: dict[str, Any] = app.state.mcp_memories
    found = memories.get(tenant)
    if found is not None:
        return found
    async with app.state.mcp_memories_lock:
        if tenant not in memories:
            memories[tenant] = await anyio.to_thread.run_sync(factory, tenant)
        return memories[tenant]


async def from_request(ctx: Context) -> ToolContext:
    """The :class:`ToolContext` an :class:`Endpoint` left on the tool call's HTTP request.

    Raises :class:`InvalidArgument` for a call that did not come through one (a wiring bug).
    """
    request = ctx.request_context.request
    found = getattr(request, "scope", {}).get(_SCOPE_KEY)
    if not isinstance(found, ToolContext):  # the endpoint always sets it: a wiring bug
        raise InvalidArgument("this MCP request carries no caller")
    return found


class Endpoint:
    """An ASGI endpoint: decide who calls (``resolve``), then hand the request to the MCP
    session manager of ``server``, whose tools find the caller with :func:`from_request`."""

    def __init__(
        self, server: MCPServer, resolve: Callable[[Request], Awaitable[ToolContext]]
    ) -> None:
        self.server = server
        self.resolve = resolve

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        try:
            scope[_SCOPE_KEY] = await self.resolve(request)
        except TorporError as exc:
            response = JSONResponse(status_code=exc.http_status, content={"error": exc.to_wire()})
            await response(scope, receive, send)
            return
        await self.server.session_manager.handle_request(scope, receive, send)
