"""Routes that act inside a sandbox: commands, files, the interpreter.

Each wakes a paused sandbox first (the manager does that: wake-on-request). ::

    POST   /v1/sandboxes/{id}/commands          run a shell command      -> CommandResult
    POST   /v1/sandboxes/{id}/commands/stream   same, streamed as NDJSON lines:
               {"type": "stdout"|"stderr", "data": "..."} ... then one
               {"type": "result", "result": CommandResult} or {"type": "error", "error": {...}}
    GET    /v1/sandboxes/{id}/files?path=       read                     -> raw bytes
    PUT    /v1/sandboxes/{id}/files?path=       write (raw bytes body)   -> 204
    DELETE /v1/sandboxes/{id}/files?path=       remove (file or tree)    -> 204
    GET    /v1/sandboxes/{id}/files/list?path=  list                     -> [EntryInfo]
    GET    /v1/sandboxes/{id}/files/exists?path= exists                  -> {"exists": bool}
    POST   /v1/sandboxes/{id}/files/mkdir?path= make_dir                 -> 204
    POST   /v1/sandboxes/{id}/interpreter       run code                 -> Execution
    POST   /v1/sandboxes/{id}/interpreter/stream same, streamed like commands/stream

The JSON bodies are :class:`~torpor.sandbox.requests.CommandSpec` and
:class:`~torpor.sandbox.requests.CodeSpec`. File bodies over the limit
(``app.state.max_file_bytes``, :data:`torpor.config.LIMITS`) and code or commands over theirs are
refused with :class:`~torpor.errors.PayloadTooLarge` (413), files before they are read in full.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from torpor.config import LIMITS
from torpor.errors import PayloadTooLarge, TorporError
from torpor.sandbox.models import CommandResult, EntryInfo, Execution
from torpor.sandbox.requests import CodeSpec, CommandSpec, Spec
from torpor.server.deps import Manager, Tenant
from torpor.server.schema import EscapedJSONResponse, NDJSONResponse

__all__ = ["MAX_BACKLOG", "ndjson_events", "owned_here", "read_body", "router", "stream_ndjson"]

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/sandboxes/{id_or_name}", tags=["exec"])

#: ``?path=``: an absolute path, or one relative to the guest's working directory.
PathQuery = Annotated[str, Query(min_length=1)]


@router.post("/commands")
async def run_command(
    id_or_name: str, body: CommandSpec, manager: Manager, tenant: Tenant
) -> CommandResult:
    """Run a command and answer when it ends (or at once with its pid, if ``background``)."""
    result: CommandResult = await manager.run_command(id_or_name, body, tenant=tenant)
    return result


def _text(chunk: str | bytes) -> str:
    return chunk.decode("utf-8", "replace") if isinstance(chunk, bytes) else chunk


#: ``call(on_stdout, on_stderr)`` -> the final result; what a streamed route runs.
StreamedCall = Callable[
    [Callable[[str | bytes], None], Callable[[str | bytes], None]], Awaitable[BaseModel]
]


#: ``work(emit)``: runs something, handing each event to ``emit`` as it happens.
EventSource = Callable[[Callable[[dict[str, Any]], None]], Awaitable[None]]


#: the most a stream's lines may hold in the server while its caller has not taken them
#: (bytes): twice the most output a command may print
MAX_BACKLOG = 2 * LIMITS.max_output_bytes


def ndjson_events(work: EventSource, what: str) -> StreamingResponse:
    """Stream the events ``work`` emits as NDJSON lines, then end the answer.

    An error arrives as the last line, ``{"type": "error", "error": {...}}``, since the status
    line has already gone out when ``work`` starts (so check what can be checked before: a
    missing sandbox is a plain 404, see :func:`_stream`). If the caller hangs up, ``work`` is
    cancelled; so it is when the lines waiting for the caller go over :data:`MAX_BACKLOG`
    (a terminal printing faster than its caller reads), the last line then a
    :class:`PayloadTooLarge`. Shared by the streamed commands and the terminals
    (:mod:`.routes_pty`).
    """
    queue: asyncio.Queue[str | None] = asyncio.Queue()
    backlog = 0  # bytes of the lines in the queue
    too_slow: PayloadTooLarge | None = None
    running: list[asyncio.Task[None]] = []

    def put(item: dict[str, Any]) -> None:
        nonlocal backlog
        line = json.dumps(item) + "\n"
        backlog += len(line)
        queue.put_nowait(line)

    def emit(item: dict[str, Any]) -> None:
        nonlocal too_slow
        if too_slow is not None:
            return
        put(item)
        if backlog > MAX_BACKLOG:  # the caller does not keep up: stop what runs for it
            too_slow = PayloadTooLarge(
                f"over {MAX_BACKLOG} bytes of {what}'s output wait for a caller that "
                "does not read them as fast as they come",
                size=backlog,
                limit=MAX_BACKLOG,
            )
            running[0].cancel()

    async def run() -> None:
        try:
            await work(emit)
        except asyncio.CancelledError:
            if too_slow is None:
                raise
            put({"type": "error", "error": too_slow.to_wire()})
        except TorporError as exc:
            put({"type": "error", "error": exc.to_wire()})
        except Exception as exc:  # a bug below us: log it, tell the caller something useful
            log.exception("streamed %s failed", what)
            wire = TorporError(f"internal server error: {type(exc).__name__}").to_wire()
            put({"type": "error", "error": wire})
        finally:
            queue.put_nowait(None)

    async def lines() -> AsyncIterator[str]:
        nonlocal backlog
        task = asyncio.create_task(run())
        running.append(task)
        try:
            while (line := await queue.get()) is not None:
                backlog -= len(line)
                yield line
        finally:
            if not task.done():  # the caller hung up: stop what runs for it
                task.cancel()

    return NDJSONResponse(lines())


def stream_ndjson(call: StreamedCall, what: str) -> StreamingResponse:
    """Run ``call``, streaming its output chunks and then its result (or error) as NDJSON
    (:func:`ndjson_events`)."""

    async def work(emit: Callable[[dict[str, Any]], None]) -> None:
        result = await call(
            lambda chunk: emit({"type": "stdout", "data": _text(chunk)}),
            lambda chunk: emit({"type": "stderr", "data": _text(chunk)}),
        )
        emit({"type": "result", "result": result.model_dump(mode="json")})

    return ndjson_events(work, what)


async def owned_here(manager: Any, sandbox_id: str) -> None:
    """Cluster mode: raise the Conflict a call on the sandbox would raise here (another node
    runs it, or should wake it), before a streamed answer's status line goes out, so the
    proxy (:mod:`torpor.server.proxy`) sends the request to that node as it does any call's;
    inside the stream it would only be its last line. Nothing on one machine. Raises
    Conflict, NoNodeAvailable."""
    if getattr(manager, "cluster", None) is None:
        return
    await manager.take(sandbox_id)
    await manager.give_back(sandbox_id)  # the call takes it again (a paused one: to wake it)


async def _stream(
    manager: Any,
    run: Callable[..., Awaitable[BaseModel]],
    id_or_name: str,
    body: Spec,
    tenant: str,
    what: str,
) -> StreamingResponse:
    """:func:`stream_ndjson` of the manager's ``run`` (``run_command`` / ``run_code``), once
    the sandbox is known to exist: a missing one is a plain 404 with the typed error body,
    not a 200 whose stream says so, and one another node runs is that node's to answer
    (:func:`owned_here`)."""
    info = await manager.get(id_or_name, tenant=tenant)
    await owned_here(manager, info.id)
    return stream_ndjson(
        lambda out, err: run(id_or_name, body, on_stdout=out, on_stderr=err, tenant=tenant),
        f"{what} in {id_or_name}",
    )


@router.post("/commands/stream", response_class=NDJSONResponse)
async def run_command_stream(
    id_or_name: str, body: CommandSpec, manager: Manager, tenant: Tenant
) -> StreamingResponse:
    """Run a command, streaming its output as it comes (NDJSON, see the module docstring)."""
    return await _stream(manager, manager.run_command, id_or_name, body, tenant, "command")


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing more than ``limit`` bytes.

    Checks ``Content-Length`` first so an oversized upload is refused before it is read, then
    counts while reading (a chunked body has no length). Raises :class:`PayloadTooLarge`.
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdecimal() and int(declared) > limit:
        raise PayloadTooLarge(
            f"body of {declared} bytes is over the {limit}-byte limit",
            size=int(declared),
            limit=limit,
        )
    parts: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"body is over the {limit}-byte limit", size=size, limit=limit)
        parts.append(chunk)
    return b"".join(parts)


def _file_limit(request: Request) -> int:
    return int(getattr(request.app.state, "max_file_bytes", LIMITS.max_file_bytes))


@router.get("/files")
async def read_file(id_or_name: str, manager: Manager, tenant: Tenant, path: PathQuery) -> Response:
    """A file's bytes."""
    data: bytes = await manager.read_file(id_or_name, path, tenant=tenant)
    return Response(content=data, media_type="application/octet-stream")


@router.put("/files", status_code=204)
async def write_file(
    id_or_name: str, request: Request, manager: Manager, tenant: Tenant, path: PathQuery
) -> Response:
    """Write the raw body to ``path`` (parents created, replaced atomically)."""
    data = await read_body(request, _file_limit(request))
    await manager.write_file(id_or_name, path, data, tenant=tenant)
    return Response(status_code=204)


@router.delete("/files", status_code=204)
async def remove(id_or_name: str, manager: Manager, tenant: Tenant, path: PathQuery) -> Response:
    """Remove a file or a whole tree."""
    await manager.remove(id_or_name, path, tenant=tenant)
    return Response(status_code=204)


@router.get("/files/list", response_model=list[EntryInfo])
async def list_dir(
    id_or_name: str, manager: Manager, tenant: Tenant, path: PathQuery
) -> EscapedJSONResponse:
    """A directory's entries (a name that is not UTF-8 comes as a ``\\u`` escape of a lone
    surrogate per bad byte, as Python reads it)."""
    entries: list[EntryInfo] = await manager.list_dir(id_or_name, path, tenant=tenant)
    return EscapedJSONResponse([e.model_dump(mode="json") for e in entries])


@router.get("/files/exists")
async def exists(
    id_or_name: str, manager: Manager, tenant: Tenant, path: PathQuery
) -> dict[str, bool]:
    """Whether ``path`` exists."""
    return {"exists": bool(await manager.exists(id_or_name, path, tenant=tenant))}


@router.post("/files/mkdir", status_code=204)
async def make_dir(id_or_name: str, manager: Manager, tenant: Tenant, path: PathQuery) -> Response:
    """Create a directory and its parents (no error if it exists)."""
    await manager.make_dir(id_or_name, path, tenant=tenant)
    return Response(status_code=204)


@router.post("/interpreter", response_model=Execution)
async def run_code(
    id_or_name: str, body: CodeSpec, manager: Manager, tenant: Tenant
) -> EscapedJSONResponse:
    """Run code in the sandbox's interpreter; variables persist between calls and pauses."""
    execution: Execution = await manager.run_code(id_or_name, body, tenant=tenant)
    # (escaped: a result's text may hold a lone surrogate, which FastAPI's encoding refuses)
    return EscapedJSONResponse(execution.model_dump(mode="json"))


@router.post("/interpreter/stream", response_class=NDJSONResponse)
async def run_code_stream(
    id_or_name: str, body: CodeSpec, manager: Manager, tenant: Tenant
) -> StreamingResponse:
    """Run code, streaming what it prints as it comes, then the Execution (NDJSON)."""
    return await _stream(manager, manager.run_code, id_or_name, body, tenant, "code")
