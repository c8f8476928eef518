"""Routes for programs on terminals in a sandbox (``sbx.pty``, ``torpor sandbox shell``). ::

    POST   /v1/sandboxes/{id}/pty                 start (PtySpec) -> NDJSON stream:
               {"type": "started", "id": "pty-...", "pid": N}
               {"type": "output", "data": "<base64>"} ...
               {"type": "exit", "exit_code": N}  or  {"type": "error", "error": {...}}
    POST   /v1/sandboxes/{id}/pty/{pty}/input     raw bytes body: typed on the terminal -> 204
    POST   /v1/sandboxes/{id}/pty/{pty}/resize    PtySize {cols, rows}                  -> 204
    DELETE /v1/sandboxes/{id}/pty/{pty}           kill its program                      -> 204

Why a streamed response and POSTs rather than a websocket: it is the shape every other
streamed call here has (``commands/stream``), it needs no websocket library on either side
(httpx speaks it, also over the server's unix socket), and any HTTP proxy passes it. A
keystroke costs one small POST, which on a local or nearby server is far below what a person
notices. The terminal lives as long as its stream: when the caller hangs up, its program is
killed, so nothing is left running that nobody can reach.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from torpor.errors import NotFound
from torpor.sandbox.requests import PtySize, PtySpec
from torpor.server.deps import Manager, Tenant
from torpor.server.routes_exec import ndjson_events, owned_here, read_body
from torpor.server.schema import NDJSONResponse

__all__ = ["router"]

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/sandboxes/{id_or_name}/pty", tags=["pty"])

#: the largest input body (one paste)
MAX_INPUT_BYTES = 1 << 20


@router.post("", response_class=NDJSONResponse)
async def open_pty(
    id_or_name: str, body: PtySpec, manager: Manager, tenant: Tenant
) -> StreamingResponse:
    """Start a program on a new terminal; its output streams as NDJSON (see the module
    docstring) until it exits. Hanging up kills it. A missing sandbox is a plain 404 with the
    typed error body, not a 200 whose stream says so; one another node runs is that node's
    to answer (:func:`~torpor.server.routes_exec.owned_here`)."""
    info = await manager.get(id_or_name, tenant=tenant)
    await owned_here(manager, info.id)

    async def work(emit: Callable[[dict[str, Any]], None]) -> None:
        def on_data(chunk: bytes) -> None:
            emit({"type": "output", "data": base64.b64encode(chunk).decode()})

        session = await manager.open_pty(id_or_name, body, on_data, tenant=tenant)
        emit({"type": "started", "id": session.id, "pid": session.pid})
        try:
            code = await session.done
        except asyncio.CancelledError:  # the caller hung up
            session.done.cancel()  # the guest kills the program
            raise
        emit({"type": "exit", "exit_code": code})

    return ndjson_events(work, f"terminal in {id_or_name}")


@contextlib.asynccontextmanager
async def _or_its_node(manager: Any, id_or_name: str, tenant: str) -> AsyncIterator[None]:
    """Around a call on an open terminal. Cluster mode: a terminal this node does not have
    may be open on the node that runs its sandbox (opened through this one, proxied there):
    its NotFound becomes the Conflict naming that node, so the proxy sends the request there
    too. The NotFound stays when the sandbox is this node's (or on one machine)."""
    try:
        yield
    except NotFound as exc:
        if exc.data.get("kind") == "pty" and getattr(manager, "cluster", None) is not None:
            info = await manager.get(id_or_name, tenant=tenant)
            await owned_here(manager, info.id)
        raise


@router.post("/{pty_id}/input", status_code=204)
async def pty_input(
    id_or_name: str, pty_id: str, request: Request, manager: Manager, tenant: Tenant
) -> Response:
    """Type the raw body on the terminal."""
    data = await read_body(request, MAX_INPUT_BYTES)
    async with _or_its_node(manager, id_or_name, tenant):
        await manager.terminals.send_input(id_or_name, pty_id, data, tenant=tenant)
    return Response(status_code=204)


@router.post("/{pty_id}/resize", status_code=204)
async def pty_resize(
    id_or_name: str, pty_id: str, body: PtySize, manager: Manager, tenant: Tenant
) -> Response:
    """Set the terminal's window size (its program gets SIGWINCH)."""
    async with _or_its_node(manager, id_or_name, tenant):
        await manager.terminals.resize(id_or_name, pty_id, body, tenant=tenant)
    return Response(status_code=204)


@router.delete("/{pty_id}", status_code=204)
async def pty_kill(id_or_name: str, pty_id: str, manager: Manager, tenant: Tenant) -> Response:
    """Kill the terminal's program and what it started."""
    async with _or_its_node(manager, id_or_name, tenant):
        await manager.terminals.kill(id_or_name, pty_id, tenant=tenant)
    return Response(status_code=204)
