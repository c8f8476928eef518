"""The HTTP API: the one process that owns engine state.

:func:`create_app` builds a FastAPI app around a sandbox manager. The app's lifespan starts the
manager (which reconciles its registry with the files left by a previous server, e.g. after a
crash) and the idle supervisor (pauses sandboxes idle longer than their ``idle_pause_seconds``),
and closes both on shutdown.

Errors: every :class:`~torpor.errors.TorporError` becomes its ``http_status`` with the body
``{"error": err.to_wire()}``, which the client turns back into the same class
(:func:`torpor.errors.from_wire`); a request the API cannot parse is an ``InvalidArgument`` (400);
anything else is a 500 whose traceback goes to the log, never to the caller.

``/openapi.json`` documents that error body on every operation and ``/docs`` lists the
operations on a page that needs no network (:mod:`torpor.server.schema`).

Each area is an :class:`fastapi.APIRouter` in its own module; :data:`ROUTERS` lists the modules
whose ``router`` is included (a module not written yet is skipped).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from torpor._version import __version__
from torpor.config import LIMITS
from torpor.errors import InvalidArgument, NotFound, TorporError
from torpor.memory.backends import open_backend
from torpor.memory.backends.base import MemoryBackend
from torpor.memory.embeddings import Embedder
from torpor.memory.rerank import Reranker, resolve_reranker
from torpor.sandbox.requests import invalid_argument
from torpor.server.auth import Identity, TokenStore
from torpor.server.deps import CallerDep
from torpor.server.fastpath import FastPath
from torpor.server.limits import BodyLimit
from torpor.server.mcp.http import mount as mount_mcp
from torpor.server.schema import EscapedJSONResponse
from torpor.server.schema import install as install_schema
from torpor.server.timing import instrument

__all__ = ["ROUTERS", "create_app", "error_response"]

log = logging.getLogger(__name__)

#: Modules whose ``router`` the app includes, in order.
ROUTERS = [
    "torpor.server.routes_sandboxes",
    "torpor.server.routes_exec",
    "torpor.server.routes_checkpoints",
    "torpor.server.routes_volume_files",
    "torpor.server.routes_usage",
    "torpor.server.routes_tokens",
    "torpor.server.routes_memory",
    "torpor.server.routes_events",
    "torpor.server.routes_pty",
    "torpor.server.routes_ports",
    "torpor.server.routes_nodes",
]


def error_response(exc: TorporError) -> JSONResponse:
    """The HTTP form of a torpor error (its message or data may quote what the caller sent,
    a lone surrogate too: :class:`~torpor.server.schema.EscapedJSONResponse`)."""
    return EscapedJSONResponse(status_code=exc.http_status, content={"error": exc.to_wire()})


async def _torpor_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, TorporError)
    if exc.http_status >= 500:
        log.warning("%s %s -> %s: %s", request.method, request.url.path, type(exc).__name__, exc)
    return error_response(exc)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return error_response(invalid_argument(exc.errors(), "bad request"))


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        err: TorporError = NotFound(
            f"no route {request.method} {request.url.path}", kind="route", name=request.url.path
        )
    elif exc.status_code < 500:
        err = InvalidArgument(str(exc.detail))
        err.http_status = exc.status_code
    else:
        err = TorporError(str(exc.detail))
    return error_response(err)


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    log.error("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(TorporError(f"internal server error: {type(exc).__name__}"))


#: seconds between two compaction sweeps of the server's supervisor
COMPACT_SWEEP_SECONDS = 10.0


async def _supervise(manager: Any, interval: float) -> None:
    """Pause idle sandboxes every ``interval`` seconds, and compact long-paused ones every
    :data:`COMPACT_SWEEP_SECONDS` (``manager.compact_sweep``), until cancelled."""
    last_compact = time.monotonic()
    while True:
        await asyncio.sleep(interval)
        try:
            paused = await manager.idle_sweep()
            if paused:
                log.info("idle supervisor paused %s", ", ".join(paused))
            compact = getattr(manager, "compact_sweep", None)
            if compact is not None and time.monotonic() - last_compact >= COMPACT_SWEEP_SECONDS:
                last_compact = time.monotonic()
                await compact()
        except asyncio.CancelledError:
            raise
        except Exception:  # one bad sweep must not stop the supervisor
            log.exception("idle sweep failed")


def _memory_backend(manager: Any, memory: MemoryBackend | str | None) -> tuple[MemoryBackend, bool]:
    """The memory backend to serve, and whether the app opened it (and so closes it)."""
    if isinstance(memory, MemoryBackend):
        return memory, False
    home = getattr(manager, "paths", None)
    if home is not None:
        return open_backend(memory or "sqlite", Path(home.memory)), True
    # a test double of the manager: a store of this app's own, removed with it
    directory = Path(tempfile.mkdtemp(prefix="torpor-memory-"))
    backend = open_backend(memory or "sqlite", directory)
    close = backend.close

    def close_and_remove() -> None:
        close()
        shutil.rmtree(directory, ignore_errors=True)

    backend.close = close_and_remove  # type: ignore[method-assign]
    return backend, True


def create_app(
    manager: Any,
    *,
    tokens: TokenStore | None = None,
    memory: MemoryBackend | str | None = None,
    memory_embedder: Embedder | str | None = "default",
    memory_reranker: Reranker | str | None = None,
    max_import_bytes: int = 256 << 20,
    require_token: bool | None = None,
    supervise: bool = True,
    idle_interval: float = 1.0,
    max_file_bytes: int = LIMITS.max_file_bytes,
    on_shutdown: list[Any] | None = None,
    fast_memory: bool = True,
) -> FastAPI:
    """A FastAPI app serving ``manager`` (a :class:`~torpor.sandbox.manager.SandboxManager`).

    ``memory``: the memory store (a backend, or a spec for
    :func:`~torpor.memory.backends.open_backend`: ``"sqlite"`` (default) under the manager's
    home, or a PostgreSQL DSN); it also holds the tokens and the audit log
    (:class:`~torpor.server.auth.Identity`). ``require_token``: tokenless requests that do not
    come over the unix socket are refused (default: when ``tokens`` is given).
    ``tokens``: a deprecated token file's tokens, imported into the store at start.
    ``memory_embedder``: the memory routes' embedder (as ``Memory(embedder=...)``; loaded on
    first use); ``memory_reranker``: their reranker (as ``Memory(reranker=...)``, default
    none; resolved here, so a missing model fails the start with :class:`InvalidArgument`);
    ``max_import_bytes``: the largest memory import body.
    ``supervise``: run the idle supervisor (``manager.idle_sweep()`` every ``idle_interval``
    seconds). ``on_shutdown``: plain callables run after the manager closed (the daemon
    removes its socket and pidfile there). ``fast_memory``: answer the hot memory routes
    without FastAPI's routing (:mod:`torpor.server.fastpath`; False: the benchmarks' baseline).
    """

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The server owns the supervisor (below) so its interval and lifetime follow the app.
        await manager.start(supervise=False)
        task = asyncio.create_task(_supervise(manager, idle_interval)) if supervise else None
        gc_task = None
        with contextlib.suppress(ModuleNotFoundError):  # CHECKPOINTS: drive hooks + periodic GC
            from torpor.server.routes_checkpoints import start_background

            gc_task = start_background(app, manager) if supervise else None
        log.info("torpor server ready (pid %d)", os.getpid())
        try:
            async with mcp_running():
                yield
        finally:
            for background in (task, gc_task):
                if background is not None:
                    background.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await background
            checkpoints = getattr(app.state, "checkpoints", None)
            if checkpoints is not None:  # snapshots still being stored: finished first
                with contextlib.suppress(Exception):
                    await checkpoints.settle()
            await manager.close()
            for callback in on_shutdown or ():
                callback()
            log.info("torpor server stopped")

    app = FastAPI(
        title="torpor", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None
    )
    app.state.manager = manager
    backend, owned = _memory_backend(manager, memory)
    if owned:
        on_shutdown = [*(on_shutdown or ()), backend.close]
    identity = Identity(
        backend, require_token=tokens is not None if require_token is None else require_token
    )
    if tokens is not None:
        identity.adopt(tokens)
    app.state.identity = identity
    app.state.memory_backend = backend
    app.state.memory_embedder = memory_embedder
    app.state.memory_reranker = resolve_reranker(memory_reranker)
    app.state.max_import_bytes = max_import_bytes
    app.state.max_file_bytes = max_file_bytes
    app.add_middleware(FastPath, enabled=fast_memory)  # innermost: inside the body limit
    app.add_middleware(BodyLimit)  # every body bounded before it is parsed
    cluster = getattr(manager, "cluster", None)
    if cluster is not None:  # a sandbox another node runs: the request goes there
        from torpor.server.proxy import OwnerProxy

        app.add_middleware(OwnerProxy, node=cluster.node)
    instrument(app, manager)  # outermost: $TORPOR_SERVER_TIMING (the benchmarks) only
    app.add_exception_handler(TorporError, _torpor_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)

    @app.get("/v1/health")
    async def health(caller: CallerDep) -> dict[str, Any]:
        """Liveness, and who this server is (the client's auto-start polls it)."""
        tenant = caller.tenant
        home = getattr(manager, "paths", None)
        return {
            "ok": True,
            "pid": os.getpid(),
            "version": __version__,
            "tenant": tenant,
            "home": str(getattr(home, "home", "")) or None,
        }

    mcp_running = mount_mcp(app)  # /mcp: the MCP tools (torpor.server.mcp)
    for name in ROUTERS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # an area not written yet
                continue
            raise
        app.include_router(module.router)
    install_schema(app)  # /openapi.json with the typed error body, and /docs
    return app
