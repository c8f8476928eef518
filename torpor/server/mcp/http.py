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
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from mcp.server.transport_security import TransportSecuritySettings
from starlette.requests import Request
from starlette.routing import Route

from torpor.sandbox.checkpoints import Checkpoints
from torpor.sandbox.models import CommandResult, Execution, SandboxInfo
from torpor.sandbox.requests import CodeSpec, CommandSpec, ForkSpec, SandboxOptions, SnapshotSpec
from torpor.server.deps import get_tenant
from torpor.server.mcp.endpoint import Endpoint, from_request, memory_for
from torpor.server.mcp.relay import GuestRelay
from torpor.server.mcp.tools import ToolContext, build_server

__all__ = ["PATH", "ManagerOps", "caller_context", "mount"]

log = logging.getLogger(__name__)

#: where the endpoint is served
PATH = "/mcp"


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


async def caller_context(request: Request) -> ToolContext:
    """Who this HTTP request acts for, as the tools' context: THE place identity enters MCP.

    Today the bearer token's tenant (:func:`~torpor.server.deps.get_tenant`), owning its whole
    memory and every sandbox of the tenant. A caller with narrower grants maps onto the same
    context: memory scope prefixes onto ``ToolContext.scope`` / ``read_only``, a sandbox label
    selector onto a check in :class:`ManagerOps`.

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


def mount(app: FastAPI) -> Callable[[], contextlib.AbstractAsyncContextManager[None]]:
    """Serve the MCP tools at :data:`PATH` on ``app``; returns what its lifespan enters."""
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
