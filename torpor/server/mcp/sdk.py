"""The sandbox tools over the SDK (a :class:`~torpor.client.Runtime`), for ``torpor mcp``.

The stdio server runs in the user's process, not in the server that owns engine state, so its
sandbox tools call the server's HTTP API: the local one over its unix socket (started on
demand), or a remote one (``$TORPOR_URL`` / ``$TORPOR_TOKEN``), whose token decides the tenant.
Each call is one API request made in a worker thread (the Runtime is synchronous).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import anyio.to_thread

from torpor.client import Runtime
from torpor.client.sandbox_calls import at, route
from torpor.sandbox.models import CommandResult, Execution, SandboxInfo
from torpor.sandbox.requests import CodeSpec, CommandSpec, ForkSpec, SandboxOptions, SnapshotSpec

__all__ = ["RuntimeOps"]


def _sbx(ref: str, suffix: str = "") -> str:
    """The API path of sandbox ``ref`` plus ``suffix``. Raises :class:`InvalidArgument` for a
    ref that names no path segment (``""``, ``.``, ``..``: a client normalizes them away)."""
    return route(ref, suffix)


@dataclass
class RuntimeOps:
    """:class:`~torpor.server.mcp.tools.SandboxOps` over a server's HTTP API."""

    runtime: Runtime

    async def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        return await anyio.to_thread.run_sync(lambda: self.runtime.json(method, path, **kwargs))

    async def get_or_create(self, name: str, options: SandboxOptions) -> SandboxInfo:
        path = at("/v1/sandboxes/by-name", name)
        return SandboxInfo.model_validate(await self._json("PUT", path, json=options.given()))

    async def run_command(self, sandbox: str, spec: CommandSpec) -> CommandResult:
        data = await self._json("POST", _sbx(sandbox, "/commands"), json=spec.given())
        return CommandResult.model_validate(data)

    async def run_code(self, sandbox: str, spec: CodeSpec) -> Execution:
        data = await self._json("POST", _sbx(sandbox, "/interpreter"), json=spec.given())
        return Execution.model_validate(data)

    async def read_file(self, sandbox: str, path: str) -> bytes:
        def read() -> bytes:
            return self.runtime.request(
                "GET", _sbx(sandbox, "/files"), params={"path": path}
            ).content

        return await anyio.to_thread.run_sync(read)

    async def write_file(self, sandbox: str, path: str, data: bytes) -> None:
        def write() -> None:
            self.runtime.request(
                "PUT", _sbx(sandbox, "/files"), params={"path": path}, content=data
            )

        await anyio.to_thread.run_sync(write)

    async def pause(self, sandbox: str) -> SandboxInfo:
        return SandboxInfo.model_validate(await self._json("POST", _sbx(sandbox, "/pause")))

    async def snapshot(self, sandbox: str, spec: SnapshotSpec) -> Mapping[str, Any]:
        data: dict[str, Any] = await self._json(
            "POST", _sbx(sandbox, "/snapshots"), json=spec.given()
        )
        return data

    async def fork(self, sandbox: str, spec: ForkSpec) -> list[SandboxInfo]:
        data = await self._json("POST", _sbx(sandbox, "/fork"), json=spec.given())
        return [SandboxInfo.model_validate(d) for d in data]
