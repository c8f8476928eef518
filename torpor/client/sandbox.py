"""``torpor.Sandbox``: an agent's machine, seen from the SDK.

::

    with torpor.Sandbox.create(name="scratch") as sbx:            # killed on exit
        sbx.commands.run("echo hi").stdout                        # 'hi\\n'
        sbx.files.write("/workspace/a.txt", "hello")
        sbx.interpreter.run("x = 41")
        sbx.interpreter.run("x + 1").text                         # '42'

    sbx = torpor.Sandbox.get_or_create("agent-u-42", idle_pause_seconds=600)
    sbx.pause()             # hibernate: RAM and processes to disk, no CPU, no RAM held
    sbx.info.reused         # True when get_or_create found it

Every call that acts inside a paused sandbox wakes it first (the server does it).
"""

from __future__ import annotations

import builtins
import contextlib
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any, Literal, Self, TypeVar

from pydantic import BaseModel

import torpor.client.runtime as _runtime_module
from torpor.client import sandbox_calls as calls
from torpor.client import storage_calls
from torpor.client.calls import Call
from torpor.client.processes import ProcessHandle, list_processes
from torpor.client.processes import start as start_process
from torpor.client.pty import Pty
from torpor.client.runtime import Runtime, default_runtime
from torpor.client.storage import Resource
from torpor.errors import InvalidState, NotFound, SandboxClosed, ServerUnavailable
from torpor.sandbox.models import (
    CommandResult,
    EntryInfo,
    Execution,
    ProcessInfo,
    SandboxEvent,
    SandboxInfo,
)
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

__all__ = ["Commands", "Files", "Interpreter", "Sandbox", "Sandboxes", "Snapshot"]

M = TypeVar("M", bound=BaseModel)


def _run(
    sbx: Sandbox,
    call: Call[M],
    model: type[M],
    on_stdout: OutputCallback | None,
    on_stderr: OutputCallback | None,
) -> M:
    """Send a run ``call``: one JSON answer when no callback is given, else its streamed
    variant, feeding output to the callbacks as it comes."""
    rt = sbx.runtime
    if on_stdout is None and on_stderr is None:
        return rt.do(call)
    kwargs = call.request_kwargs()
    with rt.stream_events(call.method, calls.stream_path(call), **kwargs) as events:
        for event in events:
            result = calls.feed(event, model, on_stdout, on_stderr)
            if result is not None:
                return result
    raise ServerUnavailable("the server closed the stream without a result")


class Commands:
    """Shell commands in a sandbox (``sbx.commands``)."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sbx = sandbox

    def run(
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
        """Run ``cmd`` with ``/bin/sh -c`` and return its exit code and output.

        ``background=True`` returns at once with the pid; the process keeps running (and
        survives pause/resume). ``on_stdout``/``on_stderr`` receive output as it comes.
        A non-zero exit is not an error (see ``exit_code``). Raises
        :class:`~torpor.errors.OperationTimeout` after ``timeout`` seconds (the process group
        is killed), :class:`~torpor.errors.PayloadTooLarge` for output over the limit.
        """
        spec = CommandSpec.of(cmd=cmd, cwd=cwd, env=env, timeout=timeout, background=background)
        call = calls.run_command(self._sbx.id, spec)
        return _run(self._sbx, call, CommandResult, on_stdout, on_stderr)

    def start(self, cmd: str, *, cwd: str | None = None) -> ProcessHandle:
        """Start ``cmd`` in the background and return a handle to wait for it, read its
        output, send it stdin or kill it (see :mod:`torpor.client.processes`). Raises
        InvalidArgument."""
        return start_process(self._sbx, cmd, cwd=cwd)

    def list(self, *, include_exited: bool = False) -> builtins.list[ProcessInfo]:
        """The background processes :meth:`start` made that still run (all of them with
        ``include_exited``)."""
        return list_processes(self._sbx, include_exited=include_exited)

    def connect(self, pid: int) -> ProcessHandle:
        """A handle on a process :meth:`start` made (e.g. in another session)."""
        return ProcessHandle(self._sbx, pid)


class Files:
    """The sandbox's file system (``sbx.files``). Paths are absolute or relative to the
    guest's working directory."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sbx = sandbox

    def read(self, path: str) -> bytes:
        """The file's bytes. Raises :class:`~torpor.errors.PathNotFound`."""
        return self._sbx.runtime.do(calls.read_file(self._sbx.id, path))

    def read_text(self, path: str, encoding: str = "utf-8") -> str:
        """The file decoded as text. Raises :class:`~torpor.errors.PathNotFound`."""
        return self.read(path).decode(encoding)

    def write(self, path: str, data: str | bytes) -> None:
        """Write ``data`` (str is UTF-8 encoded), creating parent directories.

        Raises :class:`~torpor.errors.PayloadTooLarge` over the server's file limit.
        """
        self._sbx.runtime.do(calls.write_file(self._sbx.id, path, data))

    def list(self, path: str) -> list[EntryInfo]:
        """The entries of a directory. Raises :class:`~torpor.errors.PathNotFound`."""
        return self._sbx.runtime.do(calls.list_files(self._sbx.id, path))

    def exists(self, path: str) -> bool:
        """Whether ``path`` exists."""
        return self._sbx.runtime.do(calls.exists(self._sbx.id, path))

    def remove(self, path: str) -> None:
        """Remove a file or a directory tree. Raises :class:`~torpor.errors.PathNotFound`."""
        self._sbx.runtime.do(calls.remove(self._sbx.id, path))

    def make_dir(self, path: str) -> None:
        """Create a directory and its parents; an existing one is fine."""
        self._sbx.runtime.do(calls.make_dir(self._sbx.id, path))


class Interpreter:
    """The sandbox's long-lived Python interpreter (``sbx.interpreter``)."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sbx = sandbox

    def run(
        self,
        code: str,
        *,
        timeout: float | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
    ) -> Execution:
        """Run ``code``; variables persist between runs and across pause/resume.

        The last expression's value is ``results[0].data["text/plain"]``; an exception in the
        code is ``Execution.error`` (not raised). ``on_stdout``/``on_stderr`` receive what the
        code prints as it prints it. Raises :class:`~torpor.errors.OperationTimeout` after
        ``timeout`` seconds (variables kept).
        """
        spec = CodeSpec.of(code=code, timeout=timeout)
        return _run(self._sbx, calls.run_code(self._sbx.id, spec), Execution, on_stdout, on_stderr)


# -- snapshots and forks ------------------------------------------------------------------


class Snapshot(Resource[SnapshotInfo]):
    """An immutable copy of a whole sandbox (RAM, processes, disk), kept for ``retention_days``."""

    _route = "/v1/snapshots"
    _model = SnapshotInfo

    def __repr__(self) -> str:
        return f"<Snapshot {self.id} {self.name!r}>"

    def delete(self) -> None:
        """Delete the snapshot (its storage is reclaimed by the next GC)."""
        self._delete()

    def set_retention(self, days: int) -> SnapshotInfo:
        """Keep the snapshot ``days`` days (1-365) from when it was taken; returns the info
        with its new ``expires_at``. Raises InvalidArgument, SnapshotNotFound."""
        self.info = self._runtime.do(
            storage_calls.set_retention(self.id, RetentionSpec.of(days=days))
        )
        return self.info

    def restore(
        self, *, name: str | None = None, labels: Labels | None = None, envs: Env | None = None
    ) -> Sandbox:
        """A new running sandbox as the snapshot was; it keeps the source's labels and envs,
        updated with ``labels``/``envs``. Raises SnapshotNotFound, CorruptData."""
        spec = RestoreSpec.of(name=name, labels=labels, envs=envs)
        return Sandbox(self._runtime.do(storage_calls.restore(self.id, spec)), self._runtime)

    def fork(
        self, count: int | None = None, *, labels: Labels | None = None, envs: Env | None = None
    ) -> builtins.list[Sandbox]:
        """``count`` (default 1) new sandboxes from this snapshot (its labels and envs
        carried over, updated with ``labels``/``envs``)."""
        return _fork_snapshot(self.id, count, labels=labels, envs=envs, runtime=self._runtime)


def _fork_snapshot(
    snapshot_id: str,
    count: int | None = None,
    *,
    labels: Labels | None = None,
    names: builtins.list[str] | None = None,
    envs: Env | None = None,
    runtime: Runtime | None = None,
) -> builtins.list[Sandbox]:
    rt = runtime or default_runtime()
    spec = ForkSpec.of(count=count, labels=labels, names=names, envs=envs)
    return [Sandbox(i, rt) for i in rt.do(storage_calls.fork_snapshot(snapshot_id, spec))]


def snapshot_sandbox(
    sbx: Sandbox,
    name: str | None = None,
    *,
    retention_days: int | None = None,
    labels: Labels | None = None,
) -> Snapshot:
    """``sbx.snapshot(...)``: see :meth:`torpor.sandbox.checkpoints.Checkpoints.snapshot`."""
    rt: Runtime = sbx.runtime
    spec = SnapshotSpec.of(name=name, retention_days=retention_days, labels=labels)
    return Snapshot(rt.do(calls.snapshot(sbx.id, spec)), rt)


class ForkMethod:
    """``sbx.fork(count=N)`` forks a live sandbox; ``Sandbox.fork(snapshot_id, count=N)`` forks
    a stored snapshot. One name, two receivers: a descriptor picks by how it is reached."""

    def __get__(self, obj: Sandbox | None, owner: type | None = None) -> Callable[..., Any]:
        if obj is None:
            return _fork_snapshot
        sbx = obj

        def fork(
            count: int | None = None,
            *,
            labels: Labels | None = None,
            names: builtins.list[str] | None = None,
            memory_scope: MemoryScope | dict[str, Any] | None = None,
            envs: Env | None = None,
        ) -> builtins.list[Sandbox]:
            """``count`` (default 1) live copies of this sandbox (it keeps running, or stays
            paused); they keep its ``memory_scope`` unless given another, and its labels and
            envs updated with ``labels``/``envs``. Raises InvalidArgument (count 0 or over the
            limit), Conflict (a volume attached)."""
            rt: Runtime = sbx.runtime
            spec = ForkSpec.of(
                count=count, labels=labels, names=names, memory_scope=memory_scope, envs=envs
            )
            return [Sandbox(info, rt) for info in rt.do(calls.fork(sbx.id, spec))]

        return fork


class Sandbox:
    """A handle on one sandbox. Build it with :meth:`create`, :meth:`get_or_create` or
    :meth:`get`.

    It is a context manager, and what leaving the ``with`` block does depends on where the
    handle came from: a sandbox made by :meth:`create` (or a fork or restore) is killed, as in
    E2B — it was made for the block; one reached by name with :meth:`get_or_create` or
    :meth:`get` is **paused**, never killed — it is an agent's persistent machine, and its
    RAM, processes and files are what the next session wakes to."""

    def __init__(
        self, info: SandboxInfo, runtime: Runtime, *, on_exit: Literal["kill", "pause"] = "kill"
    ) -> None:
        self._runtime = runtime
        self._on_exit = on_exit
        self._info = info
        self._reused = info.reused
        self.commands = Commands(self)
        self.files = Files(self)
        self.interpreter = Interpreter(self)
        self.pty = Pty(self)

    def __repr__(self) -> str:
        return f"<Sandbox {self.id} {self.name!r} {self._info.state.value}>"

    # -- constructors ---------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        template: str | None = None,
        *,
        name: str | None = None,
        labels: Labels | None = None,
        idle_pause_seconds: int | None = None,
        vcpus: int | None = None,
        memory_mib: int | None = None,
        pause_retention_days: int | None = None,
        snapshot: str | None = None,
        volumes: list[VolumeMount | dict[str, Any]] | None = None,
        drives: list[DriveMount | dict[str, Any]] | None = None,
        memory_scope: MemoryScope | dict[str, Any] | None = None,
        envs: Env | None = None,
        internet: bool | None = None,
        runtime: Runtime | None = None,
    ) -> Sandbox:
        """A new running sandbox from ``template`` (default ``"python"``: a fork of its booted
        snapshot). Options left out (None) take the server's defaults; the bounds are those of
        :class:`~torpor.sandbox.requests.SandboxSpec`.

        ``idle_pause_seconds``: hibernate after that long without a call.
        ``snapshot``: restore that snapshot instead (template and sizes come from it);
        ``volumes=[{"volume", "path", "read_only"}]``, ``drives=[{"drive", "path"}]``: mount
        those (see :mod:`torpor.client.checkpoints`).
        ``memory_scope={"app": ..., "user": ...}``: the memory its agent reaches at
        ``localhost:7777`` inside the VM, with no credential (``"read_only": True``: recall
        only).
        ``envs``: environment variables (secrets too) of every command and of the interpreter;
        kept in the server's registry, never shown in ``info`` (a fork has its source's).
        ``internet``: a network card to the internet; None: on when the server's host allows
        it (its operator sets ``TORPOR_ALLOW_INTERNET=1``), else off; True where the host
        does not allow it is refused (a restore or fork keeps its source's card).
        Raises :class:`~torpor.errors.InvalidArgument` (a value out of bounds, before anything
        is sent), :class:`~torpor.errors.TemplateNotFound`, :class:`~torpor.errors.InvalidName`,
        :class:`~torpor.errors.Conflict` (name taken).
        """
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
        rt = runtime or default_runtime()
        return cls(rt.do(calls.create(spec)), rt)

    @classmethod
    def get_or_create(
        cls,
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
        runtime: Runtime | None = None,
    ) -> Sandbox:
        """The sandbox called ``name``, woken if paused (``info.reused`` is True), or a new one
        made with the given options (as :meth:`create`). Concurrent callers get one sandbox.
        For an existing one, labels, idle pause, retention and ``envs`` given are applied;
        another ``memory_scope`` or ``internet`` than its own is a Conflict."""
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
        rt = runtime or default_runtime()
        # a persistent, named machine: leaving a ``with`` block pauses it, never kills it
        return cls(rt.do(calls.get_or_create(name, spec)), rt, on_exit="pause")

    @classmethod
    def get(cls, id_or_name: str, *, runtime: Runtime | None = None) -> Sandbox:
        """A handle on an existing sandbox (not woken). Raises
        :class:`~torpor.errors.SandboxNotFound`."""
        rt = runtime or default_runtime()
        return cls(rt.do(calls.get(id_or_name)), rt, on_exit="pause")

    @classmethod
    def list(
        cls,
        labels: Labels | None = None,
        *,
        include_stopped: bool = False,
        runtime: Runtime | None = None,
    ) -> list[SandboxInfo]:
        """The sandboxes of this tenant, optionally only those with all of ``labels``
        (killed ones only with ``include_stopped``)."""
        rt = runtime or default_runtime()
        return rt.do(calls.list_sandboxes(labels, include_stopped))

    # -- state ----------------------------------------------------------------------------------

    @property
    def runtime(self) -> Runtime:
        """The server this handle talks to."""
        return self._runtime

    def route(self, suffix: str = "") -> str:
        """The API path of this sandbox (``/v1/sandboxes/<id>``), plus ``suffix``."""
        return calls.route(self._info.id, suffix)

    def _update(self, info: SandboxInfo) -> SandboxInfo:
        self._info = info.model_copy(update={"reused": self._reused})
        return self._info

    @property
    def id(self) -> str:
        """The sandbox's id (stable for its life)."""
        return self._info.id

    @property
    def name(self) -> str:
        """The sandbox's name (its id when none was given)."""
        return self._info.name

    @property
    def info(self) -> SandboxInfo:
        """Fresh details from the server; ``reused`` is that of the call that made this
        handle."""
        return self._update(self._runtime.do(calls.get(self.id)))

    def pause(self) -> SandboxInfo:
        """Hibernate: RAM, processes and files go to disk; the sandbox holds no CPU or RAM.
        Raises :class:`~torpor.errors.InvalidState` if it is not running."""
        return self._update(self._runtime.do(calls.pause(self.id)))

    def resume(self) -> SandboxInfo:
        """Wake a paused sandbox (any call inside it does this too)."""
        return self._update(self._runtime.do(calls.resume(self.id)))

    def set_retention(self, days: int) -> SandboxInfo:
        """Keep this sandbox's pause ``days`` days (1-365) from when it was paused (a running
        sandbox: from its next pause); the info's ``expires_at`` says until when. Raises
        InvalidArgument, SandboxClosed."""
        spec = RetentionSpec.of(days=days)
        return self._update(self._runtime.do(calls.set_retention(self.id, spec)))

    def set(
        self, *, labels: Labels | None = None, idle_pause_seconds: int | None = None
    ) -> SandboxInfo:
        """Change the sandbox's ``labels`` (the given dict replaces them all) and/or its
        ``idle_pause_seconds`` (``0``: never pause when idle); None leaves a field as it is.
        Works on a paused sandbox without waking it. Raises
        :class:`~torpor.errors.InvalidArgument` (before anything is sent),
        :class:`~torpor.errors.SandboxClosed` (killed)."""
        spec = SandboxSettings.of(labels=labels, idle_pause_seconds=idle_pause_seconds)
        return self._update(self._runtime.do(calls.update(self.id, spec)))

    def get_host(self, port: int) -> str:
        """``127.0.0.1:NNNNN``: where a connection reaches ``port`` in this sandbox, on the
        server's host (the local server: this machine). The same address for one port until
        the sandbox is killed; a connection wakes it if paused, and a pause closes the
        connections open then. Nothing needs to listen yet. Raises InvalidArgument,
        SandboxNotFound, SandboxClosed."""
        data = self._runtime.json("POST", self.route(f"/ports/{int(port)}"))
        return str(data["host"])

    def logs(self, lines: int = 100) -> str:
        """The last ``lines`` lines of the guest's console (does not wake a paused sandbox)."""
        return self._runtime.do(calls.logs(self.id, lines))

    def events(self, *, after: int = 0, follow: bool = False) -> Iterator[SandboxEvent]:
        """This sandbox's lifecycle events (see :meth:`torpor.Runtime.events`)."""
        return self._runtime.events(after=after, sandbox=self.id, follow=follow)

    def snapshot(
        self,
        name: str | None = None,
        *,
        retention_days: int | None = None,
        labels: Labels | None = None,
    ) -> Snapshot:
        """An immutable copy of the whole machine (RAM + disk), kept ``retention_days``
        (default 7); the sandbox keeps running (or stays paused). Raises Conflict (name taken,
        or a volume attached: volumes are never part of a snapshot), InvalidArgument
        (retention_days outside 1-365)."""
        return snapshot_sandbox(self, name, retention_days=retention_days, labels=labels)

    #: ``sbx.fork(count=N)`` (live copies) / ``Sandbox.fork(snapshot_id, count=N)``
    fork = ForkMethod()

    def kill(self) -> None:
        """Stop the sandbox for good and delete its machine files."""
        self._runtime.do(calls.kill(self.id))

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._on_exit == "pause":
            # already paused, killed or gone: nothing to keep safe
            with contextlib.suppress(NotFound, SandboxClosed, InvalidState):
                self.pause()
            return
        with contextlib.suppress(NotFound, SandboxClosed):  # already gone: nothing to clean up
            self.kill()


class Sandboxes:
    """``runtime.sandboxes``: :class:`Sandbox`'s constructors bound to one runtime, so
    ``torpor.Runtime(url=..., token=...).sandboxes.get_or_create("agent-u-42")`` needs no
    ``runtime=`` argument."""

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime

    def create(self, **options: Any) -> Sandbox:
        """As :meth:`Sandbox.create` on this runtime."""
        return Sandbox.create(runtime=self._runtime, **options)

    def get_or_create(self, name: str, **options: Any) -> Sandbox:
        """As :meth:`Sandbox.get_or_create` on this runtime."""
        return Sandbox.get_or_create(name, runtime=self._runtime, **options)

    def get(self, id_or_name: str) -> Sandbox:
        """As :meth:`Sandbox.get` on this runtime."""
        return Sandbox.get(id_or_name, runtime=self._runtime)

    def list(
        self, labels: Labels | None = None, *, include_stopped: bool = False
    ) -> builtins.list[SandboxInfo]:
        """As :meth:`Sandbox.list` on this runtime."""
        return Sandbox.list(labels, include_stopped=include_stopped, runtime=self._runtime)


_runtime_module.sandboxes_factory = Sandboxes
