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
import functools
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from mcp.server.transport_security import TransportSecuritySettings
from starlette.requests import Request
from starlette.routing import Route

from torpor.errors import AccessDenied, SandboxNotFound
from torpor.sandbox.checkpoints import Checkpoints
from torpor.sandbox.models import CommandResult, Execution, SandboxInfo
from torpor.sandbox.requests import CodeSpec, CommandSpec, ForkSpec, SandboxOptions, SnapshotSpec
from torpor.server.auth import Caller, Identity
from torpor.server.deps import get_caller, get_identity
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
    #: the caller, whose sandbox label selector limits what the tools reach (None: the owner)
    caller: Caller | None = None
    identity: Identity | None = None

    def _own(self, info: SandboxInfo, ref: str) -> SandboxInfo:
        from torpor.server.routes_sandboxes import own

        return own(info, self.tenant, ref)

    @property
    def _selector(self) -> dict[str, str]:
        return {} if self.caller is None else dict(self.caller.sandboxes or {})

    def _deny(self, action: str, target: str, message: str) -> Exception:
        assert self.caller is not None and self.identity is not None
        return self.identity.deny(self.caller, f"mcp {action}", target, message)

    async def _check(self, sandbox: str, action: str) -> None:
        """SandboxNotFound (audited) for a sandbox outside the caller's label selector, as
        the HTTP routes answer."""
        if not self._selector:
            return
        assert self.caller is not None and self.identity is not None
        info = await self.manager.get(sandbox, tenant=self.tenant)
        if not self.caller.sees(info.labels):
            self.identity.audit(self.caller, f"mcp {action}", f"sandbox:{sandbox}", allowed=False)
            raise SandboxNotFound(f"no sandbox {sandbox!r}", kind="sandbox", name=sandbox)

    def _labelled(self, labels: Mapping[str, str] | None, action: str, name: str) -> dict[str, str]:
        """``labels`` with the caller's selector added (AccessDenied if they contradict it)."""
        out = dict(labels or {})
        if any(out.get(k, v) != v for k, v in self._selector.items()):
            raise self._deny(
                action, f"sandbox:{name}", f"labels {out} are outside {self._selector}"
            )
        return {**out, **self._selector}

    async def get_or_create(self, name: str, options: SandboxOptions) -> SandboxInfo:
        if self._selector:
            labels = self._labelled(options.labels, "get_or_create", name)
            options = options.model_copy(update={"labels": labels})
        try:  # the manager checks the selector under the name's lock (see the HTTP route)
            info = await self.manager.get_or_create(
                name, options, tenant=self.tenant, selector=self._selector or None
            )
        except AccessDenied:
            raise self._deny("get_or_create", f"sandbox:{name}", f"{name!r} is another's") from None
        if self._selector and not self.caller.sees(info.labels):  # type: ignore[union-attr]
            raise self._deny("get_or_create", f"sandbox:{name}", f"{name!r} is another's")
        return self._own(info, name)

    async def run_command(self, sandbox: str, spec: CommandSpec) -> CommandResult:
        await self._check(sandbox, "exec")
        result: CommandResult = await self.manager.run_command(sandbox, spec, tenant=self.tenant)
        return result

    async def run_code(self, sandbox: str, spec: CodeSpec) -> Execution:
        await self._check(sandbox, "run_code")
        result: Execution = await self.manager.run_code(sandbox, spec, tenant=self.tenant)
        return result

    async def read_file(self, sandbox: str, path: str) -> bytes:
        await self._check(sandbox, "read_file")
        data: bytes = await self.manager.read_file(sandbox, path, tenant=self.tenant)
        return data

    async def write_file(self, sandbox: str, path: str, data: bytes) -> None:
        await self._check(sandbox, "write_file")
        await self.manager.write_file(sandbox, path, data, tenant=self.tenant)

    async def pause(self, sandbox: str) -> SandboxInfo:
        await self._check(sandbox, "pause")
        result = await self.manager.pause(sandbox, tenant=self.tenant)
        if not isinstance(result, SandboxInfo):
            result = await self.manager.get(sandbox, tenant=self.tenant)
        return self._own(result, sandbox)

    async def snapshot(self, sandbox: str, spec: SnapshotSpec) -> Mapping[str, Any]:
        await self._check(sandbox, "snapshot")  # the snapshot then belongs to its labels
        info = await self.checkpoints.snapshot(sandbox, spec, tenant=self.tenant)
        dumped: dict[str, Any] = info.model_dump(mode="json")
        return dumped

    async def fork(self, sandbox: str, spec: ForkSpec) -> list[SandboxInfo]:
        await self._check(sandbox, "fork")
        if self._selector:
            spec = spec.model_copy(update={"labels": self._labelled(spec.labels, "fork", sandbox)})
        children: list[SandboxInfo] = await self.checkpoints.fork(sandbox, spec, tenant=self.tenant)
        return children


async def caller_context(request: Request) -> ToolContext:
    """Who this HTTP request acts for, as the tools' context: THE place identity enters MCP.

    The caller is the server's one identity (:func:`torpor.server.deps.get_caller`: the bearer
    token, or the unix socket's trusted owner), never anything in the URL or the MCP message.
    Its memory grants apply to the memory tools (the tenant's memory seen through them, as the
    memory routes do), its sandbox label selector to the sandbox tools (:class:`ManagerOps`);
    a token without sandbox rights gets no sandbox tools at all.

    Raises :class:`~torpor.errors.AccessDenied` (audited) for a missing, malformed, unknown,
    expired or revoked token.
    """
    from torpor.server.routes_checkpoints import checkpoints_of

    caller = await get_caller(request)
    app: FastAPI = request.app
    manager = app.state.manager
    memory = await memory_for(app, caller.tenant)
    if not caller.is_owner:
        memory = memory.acting_as(caller.access(memory.backend))
    identity = get_identity(request)
    sandboxes = None
    if caller.sandboxes is not None:
        sandboxes = ManagerOps(
            manager,
            checkpoints_of(request, manager),
            caller.tenant,
            caller=caller,
            identity=identity,
        )
    return ToolContext(
        tenant=caller.tenant,
        memory=memory,
        sandboxes=sandboxes,
        deny=functools.partial(identity.deny, caller),
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
    app.state.mcp_memories = {}
    app.state.mcp_memories_lock = asyncio.Lock()
    endpoint = Endpoint(server, caller_context)
    engine = getattr(app.state.manager, "engine", None)
    if engine is not None and hasattr(engine, "guest_calls"):  # QEMU: sandboxes ask through it
        engine.guest_calls = guest
    # POST only, as the guest relay: the endpoint is stateless and answers each call whole,
    # so a GET's event stream would carry nothing and never end (405, as MCP allows)
    app.router.routes.append(
        Route(PATH, endpoint=endpoint, methods=["POST"], include_in_schema=False)
    )

    @contextlib.asynccontextmanager
    async def running() -> AsyncIterator[None]:
        new_session_manager()
        app.state.mcp_memories_lock = asyncio.Lock()  # of this start's event loop
        try:
            async with server.session_manager.run(), guest.server.session_manager.run():
                yield
        finally:
            await guest.close()
            memories: dict[str, Any] = app.state.mcp_memories
            for memory in memories.values():
                with contextlib.suppress(Exception):
                    memory.close()
            memories.clear()

    return running
