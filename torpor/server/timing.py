"""Where a request's time goes in the server, for the benchmarks (off unless asked).

With ``$TORPOR_SERVER_TIMING`` set to a file path, :func:`instrument` makes the app append one
JSON line per HTTP request to that file: its method and path, ``app_ms`` (from the request
reaching the app to its answer's start) and ``engine_ms`` (the part spent inside the
manager's and the checkpoint component's operations, the outermost call only). A client's
time for the same request minus ``engine_ms`` is what the SDK and the server add to the
engine's operation, paired request by request (``bench/lifecycle.py``), which load on a
shared machine blurs far less than a difference of two medians. Nothing changes when the
variable is unset. When it is set, the checkpoint component's methods are wrapped on its
class, for the whole process (outside a timed request the wrapper only calls through).
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import json
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from torpor.sandbox.checkpoints import Checkpoints

__all__ = ["ENV", "instrument"]

#: the environment variable naming the file the timings go to
ENV = "TORPOR_SERVER_TIMING"

#: the current request's [engine seconds, depth of timed calls], None outside a request
_SPENT: contextvars.ContextVar[list[float] | None] = contextvars.ContextVar(
    "torpor_server_timing", default=None
)

#: the manager's and the checkpoint component's operations a route awaits
_MANAGER_CALLS = (
    "create",
    "get_or_create",
    "get",
    "pause",
    "resume",
    "kill",
    "run_code",
    "run_command",
    "read_file",
    "write_file",
)
_CHECKPOINT_CALLS = ("create", "snapshot", "fork", "fork_snapshot", "restore")


def _timed(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    @functools.wraps(fn)
    async def timed(*args: Any, **kwargs: Any) -> Any:
        spent = _SPENT.get()
        if spent is None:
            return await fn(*args, **kwargs)
        spent[1] += 1
        t0 = time.perf_counter()
        try:
            return await fn(*args, **kwargs)
        finally:
            spent[1] -= 1
            if not spent[1]:
                spent[0] += time.perf_counter() - t0

    return timed


class _Timing:
    """Pure ASGI middleware: times each HTTP request and appends its line to ``path``."""

    def __init__(self, app: Any, path: str) -> None:
        self.app, self.path = app, path

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        spent = [0.0, 0.0]
        token = _SPENT.set(spent)
        t0 = time.perf_counter()

        async def timed_send(message: Any) -> None:
            if message["type"] == "http.response.start":  # written before the client has it
                self._write(scope, time.perf_counter() - t0, spent[0])
            await send(message)

        try:
            await self.app(scope, receive, timed_send)
        finally:
            _SPENT.reset(token)

    def _write(self, scope: Any, app_s: float, engine_s: float) -> None:
        line = {
            "method": scope.get("method"),
            "path": scope.get("path"),
            "app_ms": round(app_s * 1000, 3),
            "engine_ms": round(engine_s * 1000, 3),
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")


def instrument(app: Any, manager: Any) -> None:
    """With ``$TORPOR_SERVER_TIMING`` set, time ``app``'s requests and ``manager``'s
    operations (see the module's docstring); else nothing."""
    path = os.environ.get(ENV)
    if not path:
        return
    for name in _MANAGER_CALLS:
        fn = getattr(manager, name, None)
        if fn is not None and inspect.iscoroutinefunction(fn):
            setattr(manager, name, _timed(fn))
    for name in _CHECKPOINT_CALLS:
        fn = getattr(Checkpoints, name, None)
        if fn is not None and not hasattr(fn, "__wrapped__"):
            setattr(Checkpoints, name, _timed(fn))
    app.add_middleware(_Timing, path=path)
