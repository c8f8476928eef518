"""``AsyncSandbox``: :class:`~torpor.client.Sandbox`, awaited, on ``httpx.AsyncClient``.

::

    async with torpor.AsyncRuntime(url=..., token=tok) as rt:
        sbx = await rt.sandboxes.get_or_create("agent-u-42", labels={"user": "u-42"})
        (await sbx.commands.run("echo hi")).stdout                  # 'hi\\n'
        await sbx.files.write("/workspace/a.txt", "hello")
        (await sbx.interpreter.run("6 * 7")).text                    # '42'
        await sbx.pause()

The same methods, arguments, models and typed errors as the sync handle, each a coroutine;
``await sbx.info`` reads fresh details. Both send the same
:class:`~torpor.client.calls.Call` s, built and read by :mod:`torpor.client.sandbox_calls`:
only the sending line differs. A ``snapshot`` answers an
:class:`AsyncSnapshot` (``await snap.restore()``, ``await snap.fork(2)``), as the sync
handle answers a :class:`~torpor.client.Snapshot`.
"""

from __future__ import annotations

import builtins
import contextlib
from collections.abc import AsyncIterator, Awaitable
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Any, Literal, Protocol, Self, TypeVar

from pydantic import BaseModel

from torpor.client import sandbox_calls as calls
from torpor.client import storage_calls
from torpor.client.aio_storage import AsyncResource
from torpor.client.calls import Call, decode
from torpor.client.processes import AsyncProcessHandle
from torpor.client.processes import list_processes_async as list_processes
from torpor.client.processes import start_async as start_process
from torpor.errors import InvalidState, NotFound, SandboxClosed, ServerUnavailable
from torpor.sandbox.models import CommandResult, EntryInfo, Execution, ProcessInfo, SandboxInfo
from torpor.sandbox.registry.usage import RetentionSpec
from torpor.sandbox.requests import (
    COMMAND_TIMEOUT,
    CodeSpec,
    CommandSpec,
    DriveMount,
    ForkSpec,
    MemoryScope,
    RestoreSpec,
    SandboxOptions,
    SandboxSettings,
    SandboxSpec,
    SnapshotSpec,
    VolumeMount,
)
from torpor.sandbox.storage.snapshots import SnapshotInfo
from torpor.types import Env, Labels, OutputCallback

T = TypeVar("T")


class AsyncRuntime(Protocol):
    """What an async handle needs of :class:`~torpor.client.aio.AsyncRuntime` (a Protocol,
    so this module does not import the one that makes its handles)."""

    async def do(self, call: Call[T]) -> T: ...

    def stream_lines(
        self, method: str, path: str, **kwargs: Any
    ) -> AbstractAsyncContextManager[AsyncIterator[str]]: ...


__all__ = [
    "AsyncCommands",
    "AsyncFiles",
    "AsyncInterpreter",
    "AsyncSandbox",
    "AsyncSandboxes",
    "AsyncSnapshot",
]

M = TypeVar("M", bound=BaseModel)


async def _run(
    sbx: AsyncSandbox,
    call: Call[M],
    model: type[M],
    on_stdout: OutputCallback | None,
    on_stderr: OutputCallback | None,
) -> M:
    """As the sync ``_run``: one answer, or the streamed variant feeding the callbacks."""
    rt = sbx.runtime
    if on_stdout is None and on_stderr is None:
        return await rt.do(call)
    kwargs = call.request_kwargs()
    async with rt.stream_lines(call.method, calls.stream_path(call), **kwargs) as lines:
        async for line in lines:
            if line.strip():
                result = calls.feed(decode(line), model, on_stdout, on_stderr)
                if result is not None:
                    return result
    raise ServerUnavailable("the server closed the stream without a result")


class AsyncCommands:
    """Shell commands in a sandbox (``sbx.commands``), awaited."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sbx = sandbox

    async def run(
        self,
        cmd: str,
        *,
        cwd: str | None = None,
        env: Env | None = None,
        timeout: float | None = COMMAND_TIMEOUT,
        background: bool = False,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
    ) -> CommandResult:
        """As :meth:`Commands.run <torpor.client.sandbox.Commands.run>`."""
        spec = CommandSpec.of(cmd=cmd, cwd=cwd, env=env, timeout=timeout, background=background)
        call = calls.run_command(self._sbx.id, spec)
        return await _run(self._sbx, call, CommandResult, on_stdout, on_stderr)

    async def start(self, cmd: str, *, cwd: str | None = None) -> AsyncProcessHandle:
        """As :meth:`Commands.start <torpor.client.sandbox.Commands.start>`: a handle to wait
        for it, read its output, send it stdin or kill it. Raises InvalidArgument."""
        return await start_process(self._sbx, cmd, cwd=cwd)

    async def list(self, *, include_exited: bool = False) -> builtins.list[ProcessInfo]:
        """As :meth:`Commands.list <torpor.client.sandbox.Commands.list>`."""
        return await list_processes(self._sbx, include_exited=include_exited)

    def connect(self, pid: int) -> AsyncProcessHandle:
        """A handle on a process :meth:`start` made (e.g. in another session)."""
        return AsyncProcessHandle(self._sbx, pid)


class AsyncFiles:
    """The sandbox's file system (``sbx.files``), awaited."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sbx = sandbox

    async def read(self, path: str) -> bytes:
        """The file's bytes. Raises :class:`~torpor.errors.PathNotFound`."""
        return await self._sbx.runtime.do(calls.read_file(self._sbx.id, path))

    async def read_text(self, path: str, encoding: str = "utf-8") -> str:
        """The file decoded as text. Raises :class:`~torpor.errors.PathNotFound`."""
        return (await self.read(path)).decode(encoding)

    async def write(self, path: str, data: str | bytes) -> None:
        """Write ``data`` (str is UTF-8 encoded), creating parent directories. Raises
        :class:`~torpor.errors.PayloadTooLarge` over the server's file limit."""
        await self._sbx.runtime.do(calls.write_file(self._sbx.id, path, data))

    async def list(self, path: str) -> builtins.list[EntryInfo]:
        """The entries of a directory. Raises :class:`~torpor.errors.PathNotFound`."""
        return await self._sbx.runtime.do(calls.list_files(self._sbx.id, path))

    async def exists(self, path: str) -> bool:
        """Whether ``path`` exists."""
        return await self._sbx.runtime.do(calls.exists(self._sbx.id, path))

    async def remove(self, path: str) -> None:
        """Remove a file or a directory tree. Raises :class:`~torpor.errors.PathNotFound`."""
        await self._sbx.runtime.do(calls.remove(self._sbx.id, path))

    async def make_dir(self, path: str) -> None:
        """Create a directory and its parents; an existing one is fine."""
        await self._sbx.runtime.do(calls.make_dir(self._sbx.id, path))


class AsyncInterpreter:
    """The sandbox's long-lived Python interpreter (``sbx.interpreter``), awaited."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sbx = sandbox

    async def run(
        self,
        code: str,
        *,
        timeout: float | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
    ) -> Execution:
        """As :meth:`Interpreter.run <torpor.client.sandbox.Interpreter.run>`."""
        spec = CodeSpec.of(code=code, timeout=timeout)
        call = calls.run_code(self._sbx.id, spec)
        return await _run(self._sbx, call, Execution, on_stdout, on_stderr)


class AsyncSandbox:
    """A handle on one sandbox, async. Made by ``rt.sandboxes`` (:class:`AsyncSandboxes`).

    ``async with`` it as the sync handle's ``with``: a sandbox made by ``create`` (or a fork)
    is killed on leaving, one reached by name (``get_or_create``, ``get``) is paused.
    """

    def __init__(
        self,
        info: SandboxInfo,
        runtime: AsyncRuntime,
        *,
        on_exit: Literal["kill", "pause"] = "kill",
    ) -> None:
        self._runtime = runtime
        self._on_exit = on_exit
        self._info = info
        self._reused = info.reused
        self.commands = AsyncCommands(self)
        self.files = AsyncFiles(self)
        self.interpreter = AsyncInterpreter(self)

    def __repr__(self) -> str:
        return f"<AsyncSandbox {self.id} {self.name!r} {self._info.state.value}>"

    @property
    def runtime(self) -> AsyncRuntime:
        """The server this handle talks to."""
        return self._runtime

    @property
    def id(self) -> str:
        """The sandbox's id (stable for its life)."""
        return self._info.id

    @property
    def name(self) -> str:
        """The sandbox's name (its id when none was given)."""
        return self._info.name

    @property
    def last_info(self) -> SandboxInfo:
        """The details as of the last call that answered them (no request)."""
        return self._info

    async def _send(self, call: Call[SandboxInfo]) -> SandboxInfo:
        info = await self._runtime.do(call)
        self._info = info.model_copy(update={"reused": self._reused})
        return self._info

    @property
    def info(self) -> Awaitable[SandboxInfo]:
        """Fresh details from the server (``await sbx.info``); ``reused`` is that of the call
        that made this handle."""
        return self._send(calls.get(self.id))

    async def pause(self) -> SandboxInfo:
        """Hibernate to disk. Raises :class:`~torpor.errors.InvalidState` if not running."""
        return await self._send(calls.pause(self.id))

    async def resume(self) -> SandboxInfo:
        """Wake a paused sandbox (any call inside it does this too)."""
        return await self._send(calls.resume(self.id))

    async def set(
        self, *, labels: Labels | None = None, idle_pause_seconds: int | None = None
    ) -> SandboxInfo:
        """As :meth:`Sandbox.set <torpor.client.Sandbox.set>`."""
        spec = SandboxSettings.of(labels=labels, idle_pause_seconds=idle_pause_seconds)
        return await self._send(calls.update(self.id, spec))

    async def set_retention(self, days: int) -> SandboxInfo:
        """As :meth:`Sandbox.set_retention <torpor.client.Sandbox.set_retention>`."""
        return await self._send(calls.set_retention(self.id, RetentionSpec.of(days=days)))

    async def logs(self, lines: int = 100) -> str:
        """The last ``lines`` lines of the guest's console (does not wake it)."""
        return await self._runtime.do(calls.logs(self.id, lines))

    async def snapshot(
        self,
        name: str | None = None,
        *,
        retention_days: int | None = None,
        labels: Labels | None = None,
    ) -> AsyncSnapshot:
        """As :meth:`Sandbox.snapshot <torpor.client.Sandbox.snapshot>`: a handle on the
        stored snapshot."""
        spec = SnapshotSpec.of(name=name, retention_days=retention_days, labels=labels)
        return AsyncSnapshot(await self._runtime.do(calls.snapshot(self.id, spec)), self._runtime)

    async def fork(
        self,
        count: int | None = None,
        *,
        labels: Labels | None = None,
        names: builtins.list[str] | None = None,
        memory_scope: MemoryScope | dict[str, Any] | None = None,
        envs: Env | None = None,
    ) -> builtins.list[AsyncSandbox]:
        """As ``sbx.fork(...)`` of the sync handle: ``count`` live copies."""
        spec = ForkSpec.of(
            count=count, labels=labels, names=names, memory_scope=memory_scope, envs=envs
        )
        return [
            AsyncSandbox(i, self._runtime)
            for i in await self._runtime.do(calls.fork(self.id, spec))
        ]

    async def kill(self) -> None:
        """Stop the sandbox for good and delete its machine files."""
        await self._runtime.do(calls.kill(self.id))

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._on_exit == "pause":
            with contextlib.suppress(NotFound, SandboxClosed, InvalidState):
                await self.pause()
            return
        with contextlib.suppress(NotFound, SandboxClosed):
            await self.kill()


class AsyncSnapshot(AsyncResource[SnapshotInfo]):
    """:class:`~torpor.client.Snapshot`, awaited: an immutable copy of a whole sandbox."""

    _route = "/v1/snapshots"
    _model = SnapshotInfo

    def __init__(self, info: SnapshotInfo, runtime: AsyncRuntime) -> None:
        super().__init__(info, runtime)
        self._sandboxes_runtime = runtime

    def __repr__(self) -> str:
        return f"<AsyncSnapshot {self.id} {self.name!r}>"

    @classmethod
    async def list(cls, *, runtime: AsyncRuntime) -> builtins.list[AsyncSnapshot]:  # type: ignore[override]
        """This tenant's checked, unexpired snapshots, oldest first."""
        return [cls(i, runtime) for i in await runtime.do(cls._list_call(None))]

    @classmethod
    async def get(cls, id_or_name: str, *, runtime: AsyncRuntime) -> AsyncSnapshot:  # type: ignore[override]
        """One by id or name. Raises SnapshotNotFound (also once expired)."""
        return cls(
            await runtime.do(storage_calls.get(cls._route, SnapshotInfo, id_or_name)), runtime
        )

    async def delete(self) -> None:
        """Delete the snapshot (its storage is reclaimed by the next GC)."""
        await self._delete()

    async def set_retention(self, days: int) -> SnapshotInfo:
        """As :meth:`Snapshot.set_retention <torpor.client.Snapshot.set_retention>`."""
        call = storage_calls.set_retention(self.id, RetentionSpec.of(days=days))
        self.info = await self._runtime.do(call)
        return self.info

    async def restore(
        self, *, name: str | None = None, labels: Labels | None = None, envs: Env | None = None
    ) -> AsyncSandbox:
        """As :meth:`Snapshot.restore <torpor.client.Snapshot.restore>`."""
        spec = RestoreSpec.of(name=name, labels=labels, envs=envs)
        rt = self._sandboxes_runtime
        return AsyncSandbox(await rt.do(storage_calls.restore(self.id, spec)), rt)

    async def fork(
        self, count: int | None = None, *, labels: Labels | None = None, envs: Env | None = None
    ) -> builtins.list[AsyncSandbox]:
        """As :meth:`Snapshot.fork <torpor.client.Snapshot.fork>`."""
        spec = ForkSpec.of(count=count, labels=labels, envs=envs)
        rt = self._sandboxes_runtime
        return [
            AsyncSandbox(i, rt) for i in await rt.do(storage_calls.fork_snapshot(self.id, spec))
        ]


class AsyncSandboxes:
    """``rt.sandboxes`` of an :class:`~torpor.client.aio.AsyncRuntime`: the sync
    :class:`~torpor.client.Sandbox` constructors, awaited, answering :class:`AsyncSandbox`."""

    def __init__(self, runtime: AsyncRuntime) -> None:
        self._runtime = runtime

    async def create(
        self,
        template: str | None = None,
        *,
        name: str | None = None,
        labels: Labels | None = None,
        idle_pause_seconds: int | None = None,
        vcpus: int | None = None,
        memory_mib: int | None = None,
        pause_retention_days: int | None = None,
        snapshot: str | None = None,
        volumes: builtins.list[VolumeMount | dict[str, Any]] | None = None,
        drives: builtins.list[DriveMount | dict[str, Any]] | None = None,
        memory_scope: MemoryScope | dict[str, Any] | None = None,
        envs: Env | None = None,
        internet: bool | None = None,
    ) -> AsyncSandbox:
        """As :meth:`Sandbox.create <torpor.client.Sandbox.create>`."""
        spec = SandboxSpec.of(
            template=template,
            name=name,
            labels=labels,
            idle_pause_seconds=idle_pause_seconds,
            vcpus=vcpus,
            memory_mib=memory_mib,
            pause_retention_days=pause_retention_days,
            snapshot=snapshot,
            volumes=volumes,
            drives=drives,
            memory_scope=memory_scope,
            envs=envs,
            internet=internet,
        )
        return AsyncSandbox(await self._runtime.do(calls.create(spec)), self._runtime)

    async def get_or_create(
        self,
        name: str,
        *,
        template: str | None = None,
        labels: Labels | None = None,
        idle_pause_seconds: int | None = None,
        vcpus: int | None = None,
        memory_mib: int | None = None,
        pause_retention_days: int | None = None,
        memory_scope: MemoryScope | dict[str, Any] | None = None,
        envs: Env | None = None,
        internet: bool | None = None,
    ) -> AsyncSandbox:
        """As :meth:`Sandbox.get_or_create <torpor.client.Sandbox.get_or_create>`."""
        spec = SandboxOptions.of(
            template=template,
            labels=labels,
            idle_pause_seconds=idle_pause_seconds,
            vcpus=vcpus,
            memory_mib=memory_mib,
            pause_retention_days=pause_retention_days,
            memory_scope=memory_scope,
            envs=envs,
            internet=internet,
        )
        info = await self._runtime.do(calls.get_or_create(name, spec))
        return AsyncSandbox(info, self._runtime, on_exit="pause")

    async def get(self, id_or_name: str) -> AsyncSandbox:
        """A handle on an existing sandbox (not woken). Raises SandboxNotFound."""
        info = await self._runtime.do(calls.get(id_or_name))
        return AsyncSandbox(info, self._runtime, on_exit="pause")

    async def list(
        self, labels: Labels | None = None, *, include_stopped: bool = False
    ) -> builtins.list[SandboxInfo]:
        """The tenant's sandboxes (those the token may see), optionally only those with all
        of ``labels``."""
        return await self._runtime.do(calls.list_sandboxes(labels, include_stopped))
