"""``/mcp``: the MCP tools over streamable HTTP, in the server's own app (and, through
:mod:`torpor.server.mcp.relay`, at ``localhost:7777`` inside each sandbox).

:func:`mount` adds the endpoint to a FastAPI app and returns the context manager the app's
lifespan enters (it runs the MCP session manager and closes the tenants' memories). The
endpoint is stateless and answers JSON: each POST is one MCP request, authenticated on its own
(no MCP session to carry from one token to another), so any number of server workers can
serve one client.

Who is calling is decided in ONE place, :func:`caller_context`: the bearer token's tenant
(:func:`torpor.server.deps.get_tenant`; the unix socket is the local owner), never anything in
the URL or the MCP message. It builds the :class:`~torpor.server.mcp.tools.ToolContext` of the
request: that tenant's :class:`torpor.Memory` (at the server's home, one per tenant, shared by
all requests) and the app's manager scoped to the tenant (:class:`ManagerOps`). A request
whose token is refused gets the typed JSON error (``AccessDenied``, 403) before MCP sees it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import anyio.to_thread
from fastapi import FastAPI
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.transport_security import TransportSecuritySettings
from starlette.requests import Request
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from torpor.errors import InvalidArgument, TorporError
from torpor.sandbox.checkpoints import Checkpoints
from torpor.sandbox.models import CommandResult, Execution, SandboxInfo
from torpor.sandbox.requests import CodeSpec, CommandSpec, ForkSpec, SandboxOptions, SnapshotSpec
from torpor.server.deps import get_tenant
from torpor.server.mcp.tools import ToolContext, build_server

__all__ = [
    "PATH",
    "Endpoint",
    "ManagerOps",
    "caller_context",
    "from_request",
    "memory_for",
    "mount",
]

log = logging.getLogger(__name__)

#: where the endpoint is served
PATH = "/mcp"
#: the request scope key under which the endpoint leaves the caller's ToolContext
_SCOPE_KEY = "torpor.mcp.context"


@dataclass
class ManagerOps:
    """The sandbox tools over the app's manager, for one tenant (what the HTTP routes do)."""

    manager: Any
    checkpoints: Checkpoints
    tenant: str

    def _own(self, info: SandboxInfo, ref: str) -> SandboxInfo:
        from torpor.server.routes_sandboxes import own

        return own(info, self.tenant, ref)

    async def get_or_create(self, name: str, options: SandboxOptions) -> SandboxInfo:
        info = await self.manager.get_or_create(name, options, tenant=self.tenant)
        return self._own(info, name)

    async def run_command(self, sandbox: str, spec: CommandSpec) -> CommandResult:
        result: CommandResult = await self.manager.run_command(sandbox, spec, tenant=self.tenant)
        return result

    async def run_code(self, sandbox: str, spec: CodeSpec) -> Execution:
        result: Execution = await self.manager.run_code(sandbox, spec, tenant=self.tenant)
        return result

    async def read_file(self, sandbox: str, path: str) -> bytes:
        data: bytes = await self.manager.read_file(sandbox, path, tenant=self.tenant)
        return data

    async def write_file(self, sandbox: str, path: str, data: bytes) -> None:
        await self.manager.write_file(sandbox, path, data, tenant=self.tenant)

    async def pause(self, sandbox: str) -> SandboxInfo:
        result = await self.manager.pause(sandbox, tenant=self.tenant)
        if not isinstance(result, SandboxInfo):
            result = await self.manager.get(sandbox, tenant=self.tenant)
        return self._own(result, sandbox)

    async def snapshot(self, sandbox: str, spec: SnapshotSpec) -> Mapping[str, Any]:
        info = await self.checkpoints.snapshot(sandbox, spec, tenant=self.tenant)
        dumped: dict[str, Any] = info.model_dump(mode="json")
        return dumped

    async def fork(self, sandbox: str, spec: ForkSpec) -> list[SandboxInfo]:
        children: list[SandboxInfo] = await self.checkpoints.fork(sandbox, spec, tenant=self.tenant)
        return children


#: ``factory(tenant)`` -> a memory of that tenant; the default opens ``torpor.Memory`` at the
#: server's home. Tests and embedders set ``app.state.memory_factory``.
MemoryFactory = Callable[[str], Any]


def _default_memory(app: FastAPI) -> MemoryFactory:
    from torpor.memory import Memory

    home = getattr(getattr(app.state.manager, "paths", None), "home", None)
    if home is None:
        raise InvalidArgument("this server has no home for memory (set app.state.memory_factory)")
    return lambda tenant: Memory(home, tenant=tenant)


async def memory_for(app: FastAPI, tenant: str) -> Any:
    """The app's memory of ``tenant``, opened on first use and kept until shutdown.

    Raises what opening the store raises (:class:`~torpor.errors.StorageError` ...).
    """
    memories: dict[str, Any] = app.state.memories
    found = memories.get(tenant)
    if found is not None:
        return found
    async with app.state.memories_lock:
        if tenant not in memories:
            factory: MemoryFactory = getattr(app.state, "memory_factory", None) or _default_memory(
                app
            )
            memories[tenant] = await anyio.to_thread.run_sync(factory, tenant)
        return memories[tenant]


async def caller_context(request: Request) -> ToolContext:
    """Who this HTTP request acts for, as the tools' context: THE place identity enters MCP.

    Raises :class:`~torpor.errors.AccessDenied` for a missing, malformed or unknown token.
    """
    from torpor.server.routes_checkpoints import checkpoints_of

    tenant = get_tenant(request)
    app: FastAPI = request.app
    manager = app.state.manager
    return ToolContext(
        tenant=tenant,
        memory=await memory_for(app, tenant),
        sandboxes=ManagerOps(manager, checkpoints_of(request, manager), tenant),
    )


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
        from torpor.server.app import error_response

        request = Request(scope, receive)
        try:
            scope[_SCOPE_KEY] = await self.resolve(request)
        except TorporError as exc:
            await error_response(exc)(scope, receive, send)
            return
        await self.server.session_manager.handle_request(scope, receive, send)


def mount(app: FastAPI) -> Callable[[], contextlib.AbstractAsyncContextManager[None]]:
    """Serve the MCP tools at :data:`PATH` on ``app``; returns what its lifespan enters."""
    from torpor.server.mcp.relay import GuestRelay  # it builds on this module

    server = build_server(from_request)
    guest = GuestRelay(app)
    app.state.guest_relay = guest

    def new_session_manager() -> None:
        # The Starlette app this returns is not used (the endpoint below is); the session
        # manager it makes runs once, so each start of the app makes its own. DNS-rebinding
        # checks are off: every TCP caller needs a bearer token, which a browser tricked into
        # calling us would not have, and the unix socket is not reachable from a browser.
        for each in (server, guest.server):
            each.streamable_http_app(
                stateless_http=True,
                json_response=True,
                transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False),
            )

    app.state.mcp = server
    app.state.memories = {}
    app.state.memories_lock = asyncio.Lock()
    endpoint = Endpoint(server, caller_context)
    engine = getattr(app.state.manager, "engine", None)
    if engine is not None and hasattr(engine, "guest_calls"):  # QEMU: sandboxes ask through it
        engine.guest_calls = guest
    app.router.routes.append(
        Route(PATH, endpoint=endpoint, methods=["GET", "POST", "DELETE"], include_in_schema=False)
    )

    @contextlib.asynccontextmanager
    async def running() -> AsyncIterator[None]:
        new_session_manager()
        app.state.memories_lock = asyncio.Lock()  # of this start's event loop
        try:
            async with server.session_manager.run(), guest.server.session_manager.run():
                yield
        finally:
            await guest.close()
            memories: dict[str, Any] = app.state.memories
            for memory in memories.values():
                with contextlib.suppress(Exception):
                    memory.close()
            memories.clear()

    return running
