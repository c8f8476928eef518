"""An in-memory stand-in for SandboxManager, for unit tests of the HTTP layer and the client.

It keeps the manager's contract (tenant scoping, names unique per tenant, typed errors, wake on
request) without VMs, so route and SDK tests run in milliseconds. The real manager is tested
with real QEMU in tests/sandbox and in this package's ``qemu`` tests.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import io
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from torpor.errors import (
    AccessDenied,
    InvalidState,
    OperationTimeout,
    PathNotFound,
    SandboxClosed,
    SandboxNotFound,
    TemplateNotFound,
)
from torpor.sandbox.models import (
    CommandResult,
    EntryInfo,
    Execution,
    Result,
    SandboxInfo,
    SandboxState,
)
from torpor.sandbox.requests import CodeSpec, CommandSpec, SandboxOptions, Spec


class FakeManager:
    """Sandboxes as dicts; commands echo; the interpreter evaluates with ``eval``/``exec``."""

    def __init__(self, *, leak_tenants: bool = False) -> None:
        self.infos: dict[str, SandboxInfo] = {}
        self.files: dict[str, dict[str, bytes]] = {}
        self.scopes: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, str]] = []  # (method, tenant)
        self.requests: list[Spec] = []  # the request models the calls got, in order
        self.started = False
        self.closed = False
        self.sweeps = 0
        # leak_tenants: behave like a buggy lower layer that ignores tenants, so tests can check
        # that the server's own fence holds.
        self.leak_tenants = leak_tenants
        self._lock = asyncio.Lock()

    async def start(self, *, supervise: bool = True, interval: float = 1.0) -> None:
        self.started = True

    async def close(self) -> None:
        self.closed = True

    async def idle_sweep(self, now: float | None = None) -> list[str]:
        self.sweeps += 1
        return []

    def _find(self, id_or_name: str, tenant: str) -> SandboxInfo:
        for info in self.infos.values():
            if (info.id == id_or_name or info.name == id_or_name) and (
                self.leak_tenants or info.tenant == tenant
            ):
                return info
        raise SandboxNotFound(f"no sandbox {id_or_name!r}", kind="sandbox", name=id_or_name)

    def _live(self, id_or_name: str, tenant: str) -> SandboxInfo:
        info = self._find(id_or_name, tenant)
        if info.state == SandboxState.STOPPED:
            raise SandboxClosed(
                f"sandbox {info.id} was killed",
                sandbox_id=info.id,
                state=info.state.value,
                required=["running", "paused"],
            )
        if info.state == SandboxState.PAUSED:  # wake on request
            info.state = SandboxState.RUNNING
        info.last_active_at = datetime.now(UTC)
        return info

    async def create(
        self, options: SandboxOptions | None = None, /, *, tenant: str = "default", **fields: Any
    ) -> SandboxInfo:
        spec = SandboxOptions.of(options, **fields)
        self.calls.append(("create", tenant))
        self.requests.append(spec)
        if spec.template != "python":
            raise TemplateNotFound(
                f"no template {spec.template!r}", kind="template", name=spec.template
            )
        sid = "sbx-" + uuid.uuid4().hex[:12]
        now = datetime.now(UTC)
        info = SandboxInfo(
            id=sid,
            name=spec.name or sid,
            tenant=tenant,
            template=spec.template,
            state=SandboxState.RUNNING,
            labels=spec.labels or {},
            vcpus=spec.vcpus,
            memory_mib=spec.memory_mib,
            idle_pause_seconds=spec.idle_pause_seconds,
            pause_retention_days=spec.pause_retention_days,
            created_at=now,
            last_active_at=now,
        )
        self.infos[sid] = info
        self.files[sid] = {}
        self.scopes[sid] = {}
        return info.model_copy()

    async def get_or_create(
        self,
        name: str,
        options: SandboxOptions | None = None,
        /,
        *,
        tenant: str = "default",
        selector: dict[str, str] | None = None,
        **fields: Any,
    ) -> SandboxInfo:
        spec = SandboxOptions.of(options, **fields).named(name)
        async with self._lock:
            try:
                info = self._live(name, tenant)
                if selector and any(info.labels.get(k) != v for k, v in selector.items()):
                    raise AccessDenied(f"sandbox {name!r} is another's", tenant=tenant)
                return info.model_copy(update={"reused": True})
            except SandboxNotFound:
                return await self.create(spec, tenant=tenant)

    async def get(self, id_or_name: str, *, tenant: str = "default") -> SandboxInfo:
        self.calls.append(("get", tenant))
        return self._find(id_or_name, tenant).model_copy()

    async def list(
        self,
        labels: dict[str, str] | None = None,
        *,
        tenant: str = "default",
        include_stopped: bool = False,
    ) -> list[SandboxInfo]:
        return [
            i.model_copy()
            for i in self.infos.values()
            if (self.leak_tenants or i.tenant == tenant)
            and (include_stopped or i.state != SandboxState.STOPPED)
            and all(i.labels.get(k) == v for k, v in (labels or {}).items())
        ]

    async def pause(self, id_or_name: str, *, tenant: str = "default") -> SandboxInfo:
        info = self._find(id_or_name, tenant)
        if info.state != SandboxState.RUNNING:
            raise InvalidState(
                f"cannot pause a {info.state.value} sandbox",
                sandbox_id=info.id,
                state=info.state.value,
                required=["running"],
            )
        info.state = SandboxState.PAUSED
        return info.model_copy()

    async def resume(self, id_or_name: str, *, tenant: str = "default") -> None:
        info = self._find(id_or_name, tenant)
        if info.state != SandboxState.PAUSED:
            raise InvalidState(
                f"cannot resume a {info.state.value} sandbox",
                sandbox_id=info.id,
                state=info.state.value,
                required=["paused"],
            )
        info.state = SandboxState.RUNNING

    async def kill(self, id_or_name: str, *, tenant: str = "default") -> None:
        self._find(id_or_name, tenant).state = SandboxState.STOPPED

    async def run_command(
        self,
        id_or_name: str,
        command: CommandSpec | str,
        /,
        *,
        on_stdout: Callable[[str], Any] | None = None,
        on_stderr: Callable[[str], Any] | None = None,
        tenant: str = "default",
        **fields: Any,
    ) -> CommandResult:
        """``echo X`` prints X; ``fail`` exits 3 with stderr; ``sleep`` times out; ``boom`` is a
        bug."""
        spec = CommandSpec.of(command, **fields)
        self.requests.append(spec)
        cmd, cwd, env, timeout = spec.cmd, spec.cwd, spec.env, spec.timeout
        self._live(id_or_name, tenant)
        if cmd == "boom":
            raise RuntimeError("a bug below the server")
        if cmd.startswith("sleep"):
            raise OperationTimeout("command timed out", seconds=timeout)
        if spec.background:
            return CommandResult(exit_code=0, pid=4242)
        if cmd == "fail":
            if on_stderr:
                on_stderr("bad\n")
            return CommandResult(exit_code=3, stderr="bad\n")
        words = cmd.split()[1:] if cmd.startswith("echo") else [cmd]
        out = ""
        for word in words:
            chunk = word + "\n"
            out += chunk
            if on_stdout:
                on_stdout(chunk)
                await asyncio.sleep(0)
        if env:
            out += "".join(f"{k}={v}\n" for k, v in env.items())
        if cwd:
            out += f"cwd={cwd}\n"
        return CommandResult(exit_code=0, stdout=out)

    async def read_file(self, id_or_name: str, path: str, *, tenant: str = "default") -> bytes:
        info = self._live(id_or_name, tenant)
        try:
            return self.files[info.id][path]
        except KeyError:
            raise PathNotFound(f"no such file {path}", kind="path", name=path) from None

    async def write_file(
        self, id_or_name: str, path: str, data: bytes | str, *, tenant: str = "default"
    ) -> None:
        info = self._live(id_or_name, tenant)
        self.files[info.id][path] = data.encode() if isinstance(data, str) else data

    async def list_dir(
        self, id_or_name: str, path: str, *, tenant: str = "default"
    ) -> builtins.list[EntryInfo]:
        info = self._live(id_or_name, tenant)
        prefix = path.rstrip("/") + "/"
        return [
            EntryInfo(name=p[len(prefix) :], path=p, type="file", size=len(d))
            for p, d in sorted(self.files[info.id].items())
            if p.startswith(prefix)
        ]

    async def exists(self, id_or_name: str, path: str, *, tenant: str = "default") -> bool:
        info = self._live(id_or_name, tenant)
        return path in self.files[info.id]

    async def remove(self, id_or_name: str, path: str, *, tenant: str = "default") -> None:
        info = self._live(id_or_name, tenant)
        if self.files[info.id].pop(path, None) is None:
            raise PathNotFound(f"no such file {path}", kind="path", name=path)

    async def make_dir(self, id_or_name: str, path: str, *, tenant: str = "default") -> None:
        self._live(id_or_name, tenant)

    async def run_code(
        self,
        id_or_name: str,
        code: CodeSpec | str,
        /,
        *,
        on_stdout: Callable[[str], Any] | None = None,
        on_stderr: Callable[[str], Any] | None = None,
        tenant: str = "default",
        **fields: Any,
    ) -> Execution:
        spec = CodeSpec.of(code, **fields)
        self.requests.append(spec)
        code = spec.code
        info = self._live(id_or_name, tenant)
        scope = self.scopes[info.id]
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            try:
                value = eval(code, scope)  # a test double
                results = [Result(data={"text/plain": repr(value)})]
            except SyntaxError:
                exec(code, scope)
                results = []
        for line in out.getvalue().splitlines(keepends=True):
            if on_stdout:
                on_stdout(line)
        return Execution(results=results, stdout=out.getvalue())
