"""The seam between the sandbox manager and the machines it runs.

The manager needs little from a backend: clone a template's booted snapshot into a sandbox
directory, start (wake) / hibernate / kill the machine of a directory, open the guest channel,
and — after a crash — say what the files in a directory can still back (:class:`DirStatus`) and
re-attach to a QEMU that outlived its manager. :class:`Engine` is that interface;
:class:`QemuEngine` is the real one (``torpor.sandbox.vm.machine``, ``template``, ``channel``), and
``tests/sandbox/fakes.py`` has an in-memory one for fast unit tests of the state logic.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from torpor._tail import LOG_KEEP, trim_log
from torpor.config import Linger, Paths
from torpor.errors import EngineError, InvalidArgument
from torpor.sandbox.models import CommandResult, EntryInfo, Execution
from torpor.sandbox.requests import CodeSpec, CommandSpec
from torpor.types import OutputCallback

__all__ = [
    "Channel",
    "DirStatus",
    "Engine",
    "GuestCalls",
    "Machine",
    "MachineConfig",
    "QemuEngine",
]

log = logging.getLogger(__name__)

#: what answers the calls of every sandbox's guest: ``(sandbox_id, method, path, headers,
#: body) -> (status, headers, body)`` (see :mod:`torpor.sandbox.guest.relay`)
GuestCalls = Callable[
    [str, str, str, dict[str, str], bytes], Awaitable[tuple[int, dict[str, str], bytes]]
]


@dataclass(frozen=True)
class MachineConfig:
    """What a sandbox's machine is made of."""

    template: str
    vcpus: int = 1
    memory_mib: int = 512
    #: whose machine it is: with a root server, QEMU runs as this tenant's own uid
    tenant: str = "default"


@dataclass(frozen=True)
class DirStatus:
    """What a sandbox directory holds, read from the files and the process table only.

    ``has_state`` means a whole saved device state sits next to the RAM file, so the pair is
    loadable (the engine guarantees a state file only ever appears whole). ``qemu_pid`` is a
    QEMU process still running on this directory, or None.
    """

    exists: bool
    has_state: bool
    qemu_pid: int | None = None
    #: what makes the saved machine unwakeable for good (a truncated file, a bad disk), if
    #: anything: a wake that failed with this set will fail every time
    damage: str | None = None


class Channel(Protocol):
    """The host side of the guest agent (``torpor.sandbox.vm.channel.GuestChannel``)."""

    async def run_command(
        self,
        command: CommandSpec,
        /,
        *,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
    ) -> CommandResult: ...

    async def read_file(self, path: str) -> bytes: ...

    async def write_file(self, path: str, data: bytes | str) -> None: ...

    async def list_dir(self, path: str) -> list[EntryInfo]: ...

    async def exists(self, path: str) -> bool: ...

    async def remove(self, path: str) -> None: ...

    async def make_dir(self, path: str) -> None: ...

    async def run_code(
        self,
        code: CodeSpec,
        /,
        *,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
    ) -> Execution: ...

    async def refresh(
        self, *, entropy: bytes | None = None, unix_time: float | None = None
    ) -> Any: ...

    async def sync(self) -> Any: ...

    async def close(self) -> None: ...


class Machine(Protocol):
    """One VM on one sandbox directory (``torpor.sandbox.vm.machine.Machine``)."""

    async def wake(self, *, ram_ready: Awaitable[object] | None = None) -> None:
        """Start the machine on its saved RAM and state. ``ram_ready``: the RAM file is
        still being filled (a compacted sandbox's, see
        :mod:`torpor.sandbox.storage.compaction`); start meanwhile, and load the state only
        once it is done (if it fails, so does the wake, with its error)."""
        ...

    async def hibernate(self, *, ready: Awaitable[object] | None = None) -> None:
        """Save the machine (its RAM file and a durable device state) and stop it.
        ``ready`` is awaited just before the guest stops (the caller's flush of the guest).
        The engine may keep the stopped process a short while for a faster next wake (see
        :class:`QemuEngine`'s ``linger``): the saved state is durable either way."""
        ...

    async def kill(self) -> None: ...

    async def release(self) -> None:
        """Drop this process's hold on the machine (its monitor connection), leaving it
        running: a manager that closes without pausing, so the next one can re-attach. A
        no-op when not connected."""
        ...

    def is_running(self) -> bool: ...


class Engine(Protocol):
    """What :class:`~torpor.sandbox.manager.SandboxManager` needs from a VM backend.

    Every method raises :class:`~torpor.errors.EngineError` (or a subclass of
    :class:`~torpor.errors.TorporError`) on failure, never a bare OSError.
    """

    def check_template(self, template: str, config: MachineConfig | None = None) -> None:
        """Raise InvalidName / TemplateNotFound unless ``template`` is built and usable, and
        InvalidArgument when ``config`` asks for a machine the template cannot give."""

    async def clone(self, template: str, directory: Path, config: MachineConfig) -> None:
        """Make ``directory`` a copy of the template's hibernated, booted machine."""

    def machine(self, directory: Path, config: MachineConfig) -> Machine:
        """The (not yet started) machine of a sandbox directory."""

    async def connect(
        self, machine: Machine, directory: Path, *, reseed: bool = True, cold: bool = False
    ) -> Channel:
        """Open the guest channel of a running machine and refresh the guest: host entropy,
        the host's clock and a reseed of its interpreter; without ``reseed`` (a plain wake,
        whose random state no other guest shares) the clock only. ``cold``: the guest was
        just started from a frozen dir (a fork's or a restore's child), so its first answer
        is slow: its first ping is sent again later (``CLONE_FIRST_PING_RETRY``)."""

    def inspect(self, directory: Path) -> DirStatus:
        """What the files (and any live QEMU) of ``directory`` can back."""

    async def attach(self, directory: Path, config: MachineConfig) -> Machine:
        """Re-attach to the live QEMU of ``directory`` (left by a manager that died) and make
        sure its guest runs (``cont`` if a wake stopped short of it). Only called when the
        directory has no whole state file. Raises EngineError when QEMU cannot be taken over."""

    def terminate(self, directory: Path) -> None:
        """Kill (SIGKILL) any QEMU still running on ``directory``; files are kept."""

    def trim_logs(self, directory: Path) -> None:
        """Keep the logs a running machine writes (its guest's console) within their bound."""


class QemuEngine:
    """The real backend: QEMU machines from ``torpor.sandbox.vm.machine`` on templates from
    ``torpor.sandbox.template``, talked to through ``torpor.sandbox.vm.channel.GuestChannel``.

    Templates are looked up in ``$TORPOR_HOME`` (``torpor.sandbox.template`` has no home
    argument), sandboxes live in the manager's home.
    """

    def __init__(
        self,
        paths: Paths,
        *,
        connect_timeout: float = 30.0,
        pool_size: int | None = None,
        linger: Linger | None = None,
    ) -> None:
        from torpor.sandbox.vm import linger as lingering
        from torpor.sandbox.vm.pool import ClonePool, pool_size_from_env

        self.paths = paths
        self.connect_timeout = connect_timeout
        #: how long a pause keeps its stopped QEMU for a warm wake (``linger`` or
        #: ``TORPOR_LINGER_SECONDS`` / ``TORPOR_LINGER_MAX``; off by default): see
        #: :mod:`torpor.sandbox.vm.linger`
        self.linger = Linger.from_env() if linger is None else linger
        lingering.sweep(paths.sandboxes)  # what a process that died left lingering
        #: ready clones a create takes instead of cloning (``pool_size`` or
        #: ``TORPOR_CLONE_POOL``; 0: none): see :mod:`torpor.sandbox.vm.pool`
        self.pool = ClonePool(
            paths.cache / "pool",
            pool_size_from_env() if pool_size is None else pool_size,
            warm=self._warm,
        )
        self.pool.sweep()  # what a server that died left warming in the pool
        atexit.register(self.pool.close)  # no warm QEMU outlives its server
        #: answers what a sandbox's guest asks at its ``localhost:7777`` (the server sets it):
        #: ``(sandbox_id, method, path, headers, body) -> (status, headers, body)``
        self.guest_calls: GuestCalls | None = None

    def check_template(self, template: str, config: MachineConfig | None = None) -> None:
        from torpor.sandbox import template as templates

        info = templates.get(template)
        if config is not None and (config.vcpus, config.memory_mib) != (
            info.vcpus,
            info.memory_mib,
        ):
            # A sandbox is a clone of the template's booted machine: its RAM size and CPU
            # count are fixed by that snapshot.
            raise InvalidArgument(
                f"template {template!r} was built with {info.vcpus} vCPU and "
                f"{info.memory_mib} MiB; a sandbox of it cannot have {config.vcpus} vCPU and "
                f"{config.memory_mib} MiB (build a template with that size)",
                vcpus=config.vcpus,
                memory_mib=config.memory_mib,
            )

    def _spec(self, config: MachineConfig) -> Any:
        from torpor.sandbox.vm.jail import jail_for
        from torpor.sandbox.vm.machine import MachineSpec

        return MachineSpec(
            vcpus=config.vcpus,
            memory_mib=config.memory_mib,
            jail=jail_for(self.paths.home, config.tenant),
        )

    async def clone(self, template: str, directory: Path, config: MachineConfig) -> None:
        from torpor.sandbox import template as templates
        from torpor.sandbox.vm.machine import clone_machine_dir

        info = templates.get(template)
        source = Path(info.snapshot_dir)
        took = await asyncio.to_thread(self.pool.take, template, source, directory, config.tenant)
        if not took:
            await asyncio.to_thread(clone_machine_dir, source, directory)
        self.pool.refill_soon(template, source)

    def _warm(self, directory: Path, template: str, tenant: str) -> None:
        """Start the QEMU of a pooled clone for ``tenant`` and exercise its guest once (a
        ping, a command, an interpreter call: what a create and its first call run, so
        under TCG their code is translated already), then stop it (the pool's filler
        thread). Raises EngineError, GuestError, OperationTimeout."""
        from torpor.sandbox import template as templates
        from torpor.sandbox.vm.channel import GuestChannel
        from torpor.sandbox.vm.machine import QemuMachine

        info = templates.get(template)
        config = MachineConfig(template, info.vcpus, info.memory_mib, tenant)
        machine = QemuMachine(directory, info, self._spec(config))

        async def exercise() -> None:
            channel = await GuestChannel.connect(machine.agent_socket, timeout=self.connect_timeout)
            try:
                await channel.run_command(CommandSpec(cmd="true"))
                await channel.run_code(CodeSpec(code="0"))
            finally:
                await channel.close()

        asyncio.run(machine.prestart(exercise))

    def machine(self, directory: Path, config: MachineConfig) -> Machine:
        from torpor.sandbox import template as templates
        from torpor.sandbox.vm.machine import QemuMachine

        machine: Machine = QemuMachine(
            directory, templates.get(config.template), self._spec(config), linger=self.linger
        )
        return machine

    async def connect(
        self, machine: Machine, directory: Path, *, reseed: bool = True, cold: bool = False
    ) -> Channel:
        from torpor.sandbox.vm.channel import (
            CLONE_FIRST_PING_RETRY,
            FIRST_PING_RETRY,
            GuestChannel,
        )

        socket = getattr(machine, "agent_socket", directory / "agent.sock")
        handler = self.guest_calls
        on_call = None
        if handler is not None:
            sandbox_id = directory.name

            async def on_call(
                method: str, path: str, headers: dict[str, str], body: bytes
            ) -> tuple[int, dict[str, str], bytes]:
                assert handler is not None
                return await handler(sandbox_id, method, path, headers, body)

        channel: Channel = await GuestChannel.connect(
            Path(socket),
            timeout=self.connect_timeout,
            reseed=reseed,
            on_call=on_call,
            first_retry=CLONE_FIRST_PING_RETRY if cold else FIRST_PING_RETRY,
        )
        return channel

    def inspect(self, directory: Path) -> DirStatus:
        from torpor.sandbox.vm.machine_dir import find_damage, inspect_dir

        if not directory.is_dir():
            return DirStatus(exists=False, has_state=False)
        found = inspect_dir(directory)
        damage = find_damage(directory) if found.has_state and found.qemu_pid is None else None
        return DirStatus(
            exists=True, has_state=found.has_state, qemu_pid=found.qemu_pid, damage=damage
        )

    async def attach(self, directory: Path, config: MachineConfig) -> Machine:
        from torpor.sandbox import template as templates
        from torpor.sandbox.vm.machine import QemuMachine

        machine = await QemuMachine.attach(
            directory, templates.get(config.template), self._spec(config)
        )
        await machine.adopt_top_layer()  # a capture interrupted between switch and rename
        # A wake that died between deleting the state and `cont` leaves the guest stopped;
        # a pause that died mid-save too. Either way the RAM file is the truth: run it.
        status = await machine.qmp("query-status")
        if isinstance(status, dict) and status.get("status") != "running":
            await machine.qmp("cont")
        result: Machine = machine
        return result

    def trim_logs(self, directory: Path) -> None:
        try:
            if trim_log(directory / "console.log"):
                log.info(
                    "%s: console.log trimmed to its last %d KiB", directory.name, LOG_KEEP >> 10
                )
        except OSError as exc:
            log.warning("cannot trim the console log of %s: %s", directory.name, exc)

    def terminate(self, directory: Path) -> None:
        from torpor.sandbox.vm import linger as lingering

        lingering.drop(directory.resolve())  # this process's lingering QEMU, at once
        pid = self.inspect(directory).qemu_pid
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            except OSError as exc:
                raise EngineError(f"cannot kill QEMU {pid}: {exc}", exc=exc) from exc
            # SIGKILL is asynchronous: wait (briefly) until the pid is gone so a new QEMU
            # on this directory does not meet the old one.
            for _ in range(500):
                if self.inspect(directory).qemu_pid is None:
                    break
                time.sleep(0.002)
        with contextlib.suppress(OSError):  # a dead QEMU's marker: nothing to resume
            (directory / lingering.MARKER).unlink(missing_ok=True)
