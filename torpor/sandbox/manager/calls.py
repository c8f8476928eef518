"""Calls that run inside a sandbox: commands, code, terminals, files, ports.

:class:`SandboxCalls` is the part of :class:`~torpor.sandbox.manager.SandboxManager` that
reaches into a running guest. Every call goes through :meth:`SandboxCalls._use`: it wakes a
paused sandbox first (wake-on-request), counts the call as in flight (a pause waits for it)
and touches the idle clock; when the call sees its machine die it raises what that lost
(:class:`~torpor.errors.StateLost`) rather than a broken connection.
"""

from __future__ import annotations

import asyncio
import builtins
import functools
import json
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager, suppress
from typing import Any

from torpor.errors import (
    EngineError,
    GuestError,
    InvalidArgument,
    OperationTimeout,
    StateLost,
    TorporError,
)
from torpor.sandbox.engine import Channel
from torpor.sandbox.manager.forwards import Forwards
from torpor.sandbox.manager.recovery import Reconciler
from torpor.sandbox.manager.terminals import Terminals, TerminalSession
from torpor.sandbox.models import CommandResult, EntryInfo, Execution
from torpor.sandbox.models import SandboxState as S
from torpor.sandbox.registry.lifecycle import require_for
from torpor.sandbox.requests import CodeSpec, CommandSpec, PtySpec, check_guest_path
from torpor.sandbox.storage.volume_files import read_disk_file
from torpor.types import OutputCallback

__all__ = ["SandboxCalls"]


async def _stopped(machine: Any, grace: float = 0.2) -> bool:
    """Whether ``machine``'s QEMU has exited, giving a process that is being killed
    ``grace`` seconds to be gone (a broken channel is often the first sign of its death)."""
    deadline = time.monotonic() + grace
    while machine.is_running():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.01)
    return True


def _set_envs_code(envs: Mapping[str, str]) -> str:
    """Python that puts ``envs`` into the interpreter's ``os.environ`` (what it starts
    inherits them) and leaves no name behind. A JSON object of strings is a Python literal."""
    return (
        "import os as _torpor_os\n"
        f"_torpor_os.environ.update({json.dumps(dict(envs))})\n"
        "del _torpor_os\n"
    )


class SandboxCalls(Reconciler):
    """The calls that run inside a sandbox, each waking it first (see the module)."""

    @functools.cached_property
    def terminals(self) -> Terminals:
        """Programs on terminals in the sandboxes (:mod:`torpor.sandbox.manager.terminals`)."""
        return Terminals(self)

    @functools.cached_property
    def forwards(self) -> Forwards:
        """Host listeners for ports in the sandboxes (:mod:`torpor.sandbox.manager.forwards`)."""
        return Forwards(self)

    # -- calls inside a sandbox -----------------------------------------------------------

    @asynccontextmanager
    async def _use(self, tenant: str, id_or_name: str) -> AsyncIterator[Channel]:
        """Wake the sandbox if paused, count the call as in flight, touch the idle clock."""
        self._check_open()
        async with self._held(tenant, id_or_name, "call") as (rec, live):
            if rec.state is S.PAUSED:
                rec = await self.wake_held(rec, live, "wake on request")
            channel = live.channel
            if channel is None:
                raise GuestError(f"sandbox {rec.id} has no guest channel", sandbox_id=rec.id)
            self.registry.touch(rec.id)  # first: if it raises, nothing is held yet
            live.busy += 1  # from here on, the finally below releases it
        try:
            yield channel
        except (GuestError, EngineError) as exc:
            machine = live.machine
            if machine is not None and await _stopped(machine):
                # the call saw its machine die: say what that lost, not "connection broke"
                await self._machine_died(rec.id, live)
                now = self.registry.get(rec.id)
                if now.state is S.ERROR:
                    raise self.lost(now) from exc
            raise
        finally:
            live.busy -= 1
            with suppress(TorporError):
                self.registry.touch(rec.id)
            async with live.idle:
                live.idle.notify_all()

    async def run_command(
        self,
        id_or_name: str,
        command: CommandSpec | str,
        /,
        *,
        tenant: str = "default",
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        **fields: Any,
    ) -> CommandResult:
        """Run a shell command in the sandbox (waking it first): a
        :class:`~torpor.sandbox.requests.CommandSpec`, or ``cmd`` and its fields (``cwd``,
        ``env``, ``timeout``, ``background``). Raises InvalidArgument / PayloadTooLarge for a
        bad spec before waking anything, then as the guest channel's ``run_command``."""
        spec = CommandSpec.of(command, **fields)
        envs = self._find(tenant, id_or_name).envs
        if envs:  # the sandbox's own variables, under the command's
            spec = CommandSpec.of(spec, env={**envs, **(spec.env or {})})
        async with self._use(tenant, id_or_name) as ch:
            return await ch.run_command(spec, on_stdout=on_stdout, on_stderr=on_stderr)

    async def run_code(
        self,
        id_or_name: str,
        code: CodeSpec | str,
        /,
        *,
        tenant: str = "default",
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        **fields: Any,
    ) -> Execution:
        """Run code in the sandbox's long-lived interpreter (waking it first): a
        :class:`~torpor.sandbox.requests.CodeSpec`, or ``code`` and its ``timeout``."""
        spec = CodeSpec.of(code, **fields)
        async with self._use(tenant, id_or_name) as ch:
            rec = self._find(tenant, id_or_name)
            live = self.live(rec.id)
            if rec.envs and not live.envs_sent:
                await ch.run_code(CodeSpec.of(_set_envs_code(rec.envs)))
                live.envs_sent = True
            try:
                return await ch.run_code(spec, on_stdout=on_stdout, on_stderr=on_stderr)
            except OperationTimeout:  # the guest may restart an interpreter it had to stop
                live.envs_sent = False
                raise

    async def open_pty(
        self,
        id_or_name: str,
        spec: PtySpec | str | None = None,
        on_data: Callable[[bytes], None] | None = None,
        *,
        tenant: str = "default",
    ) -> TerminalSession:
        """Start ``spec`` (a :class:`~torpor.sandbox.requests.PtySpec` or a command; default
        ``bash``) on a new terminal in the sandbox, waking it first; returns once it runs.
        ``on_data`` gets its output. Input, resize and kill: :attr:`terminals`. Raises
        InvalidArgument (a bad spec, an engine without terminals), PathNotFound (``cwd``),
        SandboxNotFound, InvalidState, GuestError."""
        spec = PtySpec.of(spec)
        async with self._use(tenant, id_or_name) as ch:
            rec = self._find(tenant, id_or_name)
            env = {**rec.envs, **(spec.env or {})}
            return await self.terminals.start(ch, rec.id, tenant, spec, env, on_data)

    async def get_host(self, id_or_name: str, port: int, *, tenant: str = "default") -> str:
        """``127.0.0.1:NNNNN``: where on this host a connection reaches ``port`` in the sandbox
        (the same address every time for one port, until the sandbox is killed; a connection
        wakes a paused sandbox). Nothing needs to listen yet. Raises InvalidArgument (not a
        port), SandboxNotFound, SandboxClosed (killed), EngineError."""
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise InvalidArgument(f"a port is 1 to 65535, not {port!r}", field="port")
        rec = self._find(tenant, id_or_name)
        require_for("call", rec.id, rec.state)
        return (await self.forwards.expose(rec.id, tenant, port)).address

    async def open_tunnel(
        self,
        id_or_name: str,
        port: int,
        tunnel_id: str,
        on_data: Callable[[bytes], object],
        *,
        tenant: str = "default",
    ) -> tuple[Any, asyncio.Task[int]]:
        """Connect to ``port`` in the sandbox (waking it) for :attr:`forwards`: the channel
        to send on (``tunnel_send``/``tunnel_close``) and a task ending when the guest's side
        closes. Raises NotFound (nothing listens), InvalidArgument (an engine without
        tunnels), SandboxNotFound, InvalidState, GuestError."""
        async with self._use(tenant, id_or_name) as ch:
            if not hasattr(ch, "tunnel_open"):
                raise InvalidArgument("this sandbox engine cannot reach ports in its sandboxes")
            done = await ch.tunnel_open(tunnel_id, port, on_data)
            return ch, done

    async def read_file(self, id_or_name: str, path: str, *, tenant: str = "default") -> bytes:
        """A file's bytes. Raises PathNotFound, InvalidArgument (a bad path).

        A sandbox that lost its machine (``error``, StateLost: "disk kept") is still read,
        from the disk it kept: what the guest had written to it (committed journal
        included). Every other call on it raises StateLost."""
        check_guest_path(path)
        try:
            async with self._use(tenant, id_or_name) as ch:
                return await ch.read_file(path)
        except StateLost:
            rec = self._find(tenant, id_or_name)
            disk = self.directory(rec.id) / "disk.qcow2"
            if rec.state is not S.ERROR or not disk.exists():
                raise
            async with self.live(rec.id).lock:  # nothing wakes or deletes it meanwhile
                return await asyncio.to_thread(read_disk_file, disk, path)

    async def write_file(
        self, id_or_name: str, path: str, data: bytes | str, *, tenant: str = "default"
    ) -> None:
        """Write a file (parents created). Raises InvalidArgument (a bad path)."""
        check_guest_path(path)
        async with self._use(tenant, id_or_name) as ch:
            await ch.write_file(path, data)

    async def list_dir(
        self, id_or_name: str, path: str, *, tenant: str = "default"
    ) -> builtins.list[EntryInfo]:
        """A directory's entries. Raises PathNotFound, InvalidArgument (a bad path)."""
        check_guest_path(path)
        async with self._use(tenant, id_or_name) as ch:
            return await ch.list_dir(path)

    async def exists(self, id_or_name: str, path: str, *, tenant: str = "default") -> bool:
        """Whether a path exists in the sandbox. Raises InvalidArgument (a bad path)."""
        check_guest_path(path)
        async with self._use(tenant, id_or_name) as ch:
            return await ch.exists(path)

    async def remove(self, id_or_name: str, path: str, *, tenant: str = "default") -> None:
        """Remove a file or a tree. Raises PathNotFound, InvalidArgument (a bad path, or one
        that would wipe the guest's OS: see :func:`~torpor.sandbox.requests.check_guest_path`)."""
        check_guest_path(path, removing=True)
        async with self._use(tenant, id_or_name) as ch:
            await ch.remove(path)

    async def make_dir(self, id_or_name: str, path: str, *, tenant: str = "default") -> None:
        """Make a directory (and parents). Raises InvalidArgument (a bad path)."""
        check_guest_path(path)
        async with self._use(tenant, id_or_name) as ch:
            await ch.make_dir(path)
