"""SandboxManager: create, pause, wake and kill sandboxes, and run calls inside them.

The one owner of engine state (the server holds one manager). Each sandbox is a directory
``sandboxes/<id>/`` (RAM file, device state, disk overlay) plus a row in the registry. Create is
a fork of the template's booted snapshot, never a cold boot. Pause hibernates the whole machine
to its directory, so a paused sandbox holds no QEMU process and no RAM; any call on a paused
sandbox wakes it first (wake-on-request). After every wake the guest gets fresh entropy and the
host's clock, so clones of one snapshot never share random state.

Crash safety rests on one ordering rule: **the registry records a state only after the files
that back it are durable** (the engine writes a state file whole, tmp + fsync + rename, and the
registry commits with ``synchronous=FULL``). A crash in between leaves the registry one step
behind the files — ``pausing`` or ``waking`` — and :meth:`SandboxManager.start` resolves it from
what the directory holds. When RAM cannot be recovered the sandbox goes to ``error`` and calls
raise :class:`~torpor.errors.StateLost` whose ``lost`` says what went and what was kept.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import os
import secrets
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from torpor.config import Paths, check_name
from torpor.errors import (
    Conflict,
    EngineError,
    GuestError,
    InvalidArgument,
    SandboxNotFound,
    StateLost,
    TorporError,
)
from torpor.sandbox.engine import Channel, Engine, Machine, MachineConfig, QemuEngine
from torpor.sandbox.lifecycle import Lifecycle, Recovery, recovery, require_for
from torpor.sandbox.models import CommandResult, EntryInfo, Execution, SandboxInfo
from torpor.sandbox.models import SandboxState as S
from torpor.sandbox.registry import Registry, SandboxRecord

__all__ = ["SandboxManager"]

log = logging.getLogger(__name__)

#: Seconds a pause waits for the guest to flush its file systems before hibernating anyway.
SYNC_TIMEOUT = 5.0

#: Called at named points of create/pause/wake (``"pause:saved"`` ...) with the sandbox id;
#: tests use it to crash the process at an exact step.
StepHook = Callable[[str, str], Awaitable[None] | None]
OutputCallback = Callable[[str], Any]


@dataclass
class _Live:
    """The in-process side of one sandbox: its lock, machine, channel and in-flight calls."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    idle: asyncio.Condition = field(default_factory=asyncio.Condition)
    machine: Machine | None = None
    channel: Channel | None = None
    busy: int = 0


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=UTC).isoformat(timespec="seconds")


def _wrap(exc: BaseException, what: str, sandbox_id: str) -> TorporError:
    if isinstance(exc, TorporError):
        return exc
    return EngineError(f"{what} failed for sandbox {sandbox_id}: {exc}", exc=exc,
                       sandbox_id=sandbox_id)


class SandboxManager:
    """Owns every sandbox of one torpor home. All methods are coroutines; ``tenant`` (keyword,
    default ``"default"``) scopes names and lookups.

    Errors: SandboxNotFound, TemplateNotFound, InvalidName / InvalidArgument (bad input, nothing
    created), Conflict (a name taken concurrently by another process), InvalidState /
    SandboxClosed (the sandbox's state forbids the call), StateLost (a crash destroyed RAM),
    EngineError / GuestError / OperationTimeout from the machine and the agent.
    """

    def __init__(self, paths: Paths, *, engine: Engine | None = None) -> None:
        self.paths = paths.ensure()
        self.engine: Engine = engine if engine is not None else QemuEngine(paths)
        self.registry = Registry(paths.registry)
        self.on_step: StepHook | None = None
        #: objects with ``async before_pause(sandbox_id, channel)`` / ``after_wake(...)``,
        #: e.g. torpor.sandbox.checkpoints (9p drives must be unmounted to hibernate)
        self.guest_hooks: builtins.list[Any] = []
        self._lives: dict[str, _Live] = {}
        self._name_locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._supervisor: asyncio.Task[None] | None = None
        self._closed = False

    # -- helpers --------------------------------------------------------------------------

    def directory(self, sandbox_id: str) -> Path:
        """The sandbox's machine directory."""
        return self.paths.sandboxes / sandbox_id

    def _live(self, sandbox_id: str) -> _Live:
        return self._lives.setdefault(sandbox_id, _Live())

    @staticmethod
    def _config(rec: SandboxRecord) -> MachineConfig:
        return MachineConfig(template=rec.template, vcpus=rec.vcpus, memory_mib=rec.memory_mib)

    def _move(self, rec: SandboxRecord, dst: S, reason: str = "", **columns: Any) -> SandboxRecord:
        """Record ``rec -> dst`` in the registry (the lifecycle table guards it) and return the
        fresh row."""
        lifecycle = Lifecycle(rec.id, rec.state, record=lambda t: self.registry.set_state(
            t.sandbox_id, rec.state, t.dst, reason=t.reason, at=t.at, **columns))
        lifecycle.to(dst, reason)
        return self.registry.get(rec.id)

    async def _step(self, step: str, sandbox_id: str) -> None:
        if self.on_step is not None:
            result = self.on_step(step, sandbox_id)
            if result is not None:
                await result

    def _lost_message(self, rec: SandboxRecord) -> str:
        since = max((t.at for t in self.registry.transitions(rec.id) if t.dst is S.RUNNING),
                    default=rec.created_at)
        return (f"RAM and processes since {_iso(since)} (the last wake); disk kept, "
                "minus writes the guest had not flushed")

    def _lost(self, rec: SandboxRecord) -> StateLost:
        return StateLost(f"sandbox {rec.id} lost its state: {rec.error}", sandbox_id=rec.id,
                         state=rec.state.value, lost=rec.error or "RAM and processes")

    def _mark_lost(self, rec: SandboxRecord, reason: str) -> StateLost:
        lost = self._lost_message(rec)
        rec = self._move(rec, S.ERROR, reason, error=lost)
        return self._lost(rec)

    async def _current(self, sandbox_id: str, live: _Live) -> SandboxRecord:
        """The sandbox's row, read under its lock. A running sandbox this manager never
        attached (``start()`` not called after a restart) is reconciled first, so a pause can
        never hibernate a machine it does not hold. Raises StateLost for one in ``error``."""
        rec = self.registry.get(sandbox_id)
        if rec.state is S.RUNNING and live.machine is None:
            await self._reconcile(rec)
            rec = self.registry.get(sandbox_id)
        if rec.state is S.ERROR:
            raise self._lost(rec)
        return rec

    def _find(self, tenant: str, id_or_name: str) -> SandboxRecord:
        return self.registry.find(tenant, id_or_name)

    async def _quiet_kill(self, live: _Live, directory: Path) -> None:
        """Close the channel and make sure no QEMU runs on ``directory`` (best effort)."""
        channel, live.channel = live.channel, None
        if channel is not None:
            with suppress(Exception):
                await channel.close()
        machine, live.machine = live.machine, None
        if machine is not None:
            with suppress(Exception):
                await machine.kill()
        with suppress(TorporError):
            self.engine.terminate(directory)

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgument("this SandboxManager is closed")

    # -- create ---------------------------------------------------------------------------

    async def create(
        self,
        template: str = "python",
        name: str | None = None,
        labels: Mapping[str, str] | None = None,
        idle_pause_seconds: int | None = None,
        vcpus: int = 1,
        memory_mib: int = 512,
        pause_retention_days: int = 30,
        *,
        tenant: str = "default",
    ) -> SandboxInfo:
        """Fork a new running sandbox from ``template``'s booted snapshot.

        Raises InvalidName / InvalidArgument / TemplateNotFound before anything is made,
        Conflict when ``name`` is taken, EngineError / GuestError when the machine fails (the
        half-made sandbox is then removed and its name freed).
        """
        self._check_open()
        sandbox_id = "sbx-" + secrets.token_hex(6)
        name = sandbox_id if name is None else check_name(name, "sandbox name")
        check_name(tenant, "tenant")
        _check_sizes(idle_pause_seconds, vcpus, memory_mib, pause_retention_days)
        self.engine.check_template(template, MachineConfig(template, vcpus, memory_mib))
        now = time.time()
        rec = SandboxRecord(
            id=sandbox_id, tenant=tenant, name=name, template=template, state=S.CREATING,
            labels=dict(labels or {}), vcpus=vcpus, memory_mib=memory_mib,
            idle_pause_seconds=idle_pause_seconds, pause_retention_days=pause_retention_days,
            created_at=now, last_active_at=now)
        self.registry.insert(rec)
        live = self._live(sandbox_id)
        directory = self.directory(sandbox_id)
        async with live.lock:
            try:
                await self.engine.clone(template, directory, self._config(rec))
                await self._step("create:cloned", sandbox_id)
                machine = self.engine.machine(directory, self._config(rec))
                live.machine = machine
                await machine.wake()
                await self._step("create:woken", sandbox_id)
                live.channel = await self.engine.connect(machine, directory)
                await live.channel.refresh(entropy=os.urandom(64), unix_time=time.time())
            except BaseException as exc:
                await self._abort_create(rec, live, exc)
                if isinstance(exc, Exception) and not isinstance(exc, TorporError):
                    raise _wrap(exc, "create", sandbox_id) from exc
                raise
            rec = self._move(rec, S.RUNNING, "created", last_active_at=time.time())
        log.info("created sandbox %s (%s) from %s", sandbox_id, name, template)
        return rec.to_info()

    async def _abort_create(self, rec: SandboxRecord, live: _Live, exc: BaseException) -> None:
        log.warning("create of %s failed: %r; removing it", rec.id, exc)
        directory = self.directory(rec.id)
        await self._quiet_kill(live, directory)
        rec = self._move(rec, S.ERROR, "create failed", error=f"create failed: {exc}")
        self._move(rec, S.STOPPED, "create failed")
        await asyncio.to_thread(shutil.rmtree, directory, True)
        self._lives.pop(rec.id, None)

    async def get_or_create(self, name: str, *, tenant: str = "default",
                            **kwargs: Any) -> SandboxInfo:
        """The tenant's live sandbox called ``name`` (woken if paused; ``reused=True``), else a
        new one made with ``kwargs`` (as :meth:`create`). N concurrent callers get one sandbox.
        Options of an existing sandbox are not changed. Raises like :meth:`create`; a sandbox
        in ``error`` is returned as is (its calls raise StateLost)."""
        check_name(name, "sandbox name")
        lock = self._name_locks.setdefault((tenant, name), asyncio.Lock())
        async with lock:
            rec = self.registry.live_by_name(tenant, name)
            if rec is None:
                try:
                    return await self.create(name=name, tenant=tenant, **kwargs)
                except Conflict:  # another process created it between our look and insert
                    rec = self.registry.live_by_name(tenant, name)
                    if rec is None:
                        raise
            if rec.state in (S.PAUSED, S.RUNNING):
                info = await self.resume(rec.id, tenant=tenant)
                return info.model_copy(update={"reused": True})
            return rec.to_info(reused=True)

    # -- queries --------------------------------------------------------------------------

    async def get(self, id_or_name: str, *, tenant: str = "default") -> SandboxInfo:
        """A sandbox by id or name (killed ones too). Raises SandboxNotFound."""
        return self._find(tenant, id_or_name).to_info()

    async def list(self, labels: Mapping[str, str] | None = None, *, tenant: str = "default",
                   include_stopped: bool = False) -> builtins.list[SandboxInfo]:
        """The tenant's sandboxes whose labels include all of ``labels``, oldest first."""
        states: set[S] | None = (None if include_stopped
                                 else {s for s in S if s is not S.STOPPED})
        return [r.to_info() for r in self.registry.list(tenant=tenant, labels=labels,
                                                         states=states)]

    def transitions(self, sandbox_id: str) -> builtins.list[tuple[str | None, str]]:
        """The recorded (from, to) state pairs of a sandbox, in order."""
        return [(t.src.value if t.src else None, t.dst.value)
                for t in self.registry.transitions(sandbox_id)]

    # -- pause / wake / kill --------------------------------------------------------------

    async def pause(self, id_or_name: str, *, tenant: str = "default") -> SandboxInfo:
        """Hibernate a running sandbox to disk (waits for in-flight calls; idempotent when
        already paused). Raises SandboxClosed, InvalidState, StateLost, EngineError."""
        rec = self._find(tenant, id_or_name)
        live = self._live(rec.id)
        async with live.lock:
            rec = await self._current(rec.id, live)
            require_for("pause", rec.id, rec.state)
            if rec.state is S.RUNNING:
                async with live.idle:
                    await live.idle.wait_for(lambda: live.busy == 0)
                rec = await self._pause_locked(rec, live, "pause")
        return rec.to_info()

    async def _pause_locked(self, rec: SandboxRecord, live: _Live, reason: str) -> SandboxRecord:
        if live.channel is not None:
            for hook in self.guest_hooks:  # may refuse (busy drive): still running then
                await hook.before_pause(rec.id, live.channel)
        rec = self._move(rec, S.PAUSING, reason)
        await self._step("pause:begin", rec.id)
        directory = self.directory(rec.id)
        channel, live.channel = live.channel, None
        if channel is not None:
            try:  # flush the guest's page cache so the disk overlay is whole; a hung guest
                # must not hold the pause (its RAM is saved either way)
                await asyncio.wait_for(channel.sync(), SYNC_TIMEOUT)
            except Exception as exc:  # noqa: BLE001
                log.warning("sync before pausing %s failed: %r", rec.id, exc)
            with suppress(Exception):
                await channel.close()
        machine = live.machine or self.engine.machine(directory, self._config(rec))
        try:
            await machine.hibernate()
        except Exception as exc:  # noqa: BLE001
            return await self._pause_failed(rec, live, machine, exc)
        live.machine = None
        await self._step("pause:saved", rec.id)
        # Only now, with the state file durable, does the registry say "paused".
        return self._move(rec, S.PAUSED, reason, paused_at=time.time())

    async def _pause_failed(self, rec: SandboxRecord, live: _Live, machine: Machine,
                            exc: Exception) -> SandboxRecord:
        directory = self.directory(rec.id)
        log.warning("hibernate of %s failed: %r", rec.id, exc)
        if machine.is_running():
            try:  # the machine is still up: roll back to running
                live.machine = machine
                live.channel = await self.engine.connect(machine, directory)
            except Exception:  # noqa: BLE001
                await self._quiet_kill(live, directory)
            else:
                self._move(rec, S.RUNNING, "pause failed; still running")
                if isinstance(exc, TorporError):
                    raise exc
                raise _wrap(exc, "pause", rec.id) from exc
        await self._quiet_kill(live, directory)
        if self.engine.inspect(directory).has_state:
            log.warning("sandbox %s: QEMU died after its state was saved; paused", rec.id)
            return self._move(rec, S.PAUSED, "state saved before QEMU died", paused_at=time.time())
        raise self._mark_lost(rec, f"QEMU died while pausing: {exc}") from exc

    async def resume(self, id_or_name: str, *, tenant: str = "default") -> SandboxInfo:
        """Wake a paused sandbox (idempotent when running). Raises SandboxClosed, InvalidState,
        StateLost (state gone), EngineError (wake failed, the sandbox stays paused)."""
        rec = self._find(tenant, id_or_name)
        live = self._live(rec.id)
        async with live.lock:
            rec = await self._current(rec.id, live)
            require_for("resume", rec.id, rec.state)
            if rec.state is S.PAUSED:
                rec = await self._wake_locked(rec, live, "resume")
        return rec.to_info()

    async def _wake_locked(self, rec: SandboxRecord, live: _Live, reason: str) -> SandboxRecord:
        rec = self._move(rec, S.WAKING, reason)
        await self._step("wake:begin", rec.id)
        directory = self.directory(rec.id)
        machine = self.engine.machine(directory, self._config(rec))
        live.machine = machine
        try:
            await machine.wake()
        except Exception as exc:
            await self._quiet_kill(live, directory)
            if self.engine.inspect(directory).has_state:
                self._move(rec, S.PAUSED, f"wake failed, saved state intact: {exc}")
                raise EngineError(f"waking sandbox {rec.id} failed: {exc}; it stays paused "
                                  "with its state intact and can be woken again", exc=exc,
                                  sandbox_id=rec.id) from exc
            raise self._mark_lost(rec, f"wake failed and the state is gone: {exc}") from exc
        await self._step("wake:woken", rec.id)
        try:
            live.channel = await self.engine.connect(machine, directory)
            await live.channel.refresh(entropy=os.urandom(64), unix_time=time.time())
        except Exception as exc:  # noqa: BLE001 - any failure: save what can be saved
            return await self._guest_unreachable(rec, live, machine, exc)
        for hook in self.guest_hooks:
            try:
                await hook.after_wake(rec.id, live.channel)
            except TorporError as exc:
                log.warning("after-wake hook of %s failed: %s", rec.id, exc)
        return self._move(rec, S.RUNNING, reason, last_active_at=time.time(), paused_at=None)

    async def _guest_unreachable(self, rec: SandboxRecord, live: _Live, machine: Machine,
                                 exc: Exception) -> SandboxRecord:
        """The guest ran but its agent did not answer. If QEMU is still up, hibernate it again
        (its RAM is intact, the sandbox stays paused: a later wake may find the agent back);
        else the RAM is gone. Always raises."""
        directory = self.directory(rec.id)
        channel, live.channel = live.channel, None
        if channel is not None:
            with suppress(Exception):
                await channel.close()
        if machine.is_running():
            try:
                await machine.hibernate()
            except Exception as again:  # noqa: BLE001
                log.warning("re-hibernating %s failed: %r", rec.id, again)
            else:
                live.machine = None
                self._move(rec, S.PAUSED, f"guest unreachable after wake; re-hibernated: {exc}",
                           paused_at=time.time())
                raise GuestError(f"sandbox {rec.id} woke but its guest agent did not answer "
                                 f"({exc}); it was paused again with its RAM intact",
                                 exc=exc, sandbox_id=rec.id) from exc
        await self._quiet_kill(live, directory)
        raise self._mark_lost(rec, f"guest unreachable after wake: {exc}") from exc

    async def kill(self, id_or_name: str, *, tenant: str = "default") -> SandboxInfo:
        """Stop a sandbox for good and delete its files (idempotent). In-flight calls fail with
        GuestError. Raises SandboxNotFound."""
        rec = self._find(tenant, id_or_name)
        live = self._live(rec.id)
        if rec.state is not S.STOPPED and live.lock.locked():
            # Another operation holds the sandbox (a pause draining a call that never ends, a
            # slow wake): cut it short instead of queueing behind it. It fails on the dead
            # machine and records what it lost; the kill below then ends the sandbox.
            log.info("kill of %s interrupts an operation in progress", rec.id)
            await self._quiet_kill(live, self.directory(rec.id))
        async with live.lock:
            rec = self.registry.get(rec.id)
            if rec.state is not S.STOPPED:
                directory = self.directory(rec.id)
                await self._quiet_kill(live, directory)
                rec = self._move(rec, S.STOPPED, "kill")
                await asyncio.to_thread(shutil.rmtree, directory, True)
        # a killed sandbox needs no lock any more: every later call reads "stopped" and fails
        self._lives.pop(rec.id, None)
        return rec.to_info()

    # -- calls inside a sandbox -----------------------------------------------------------

    @asynccontextmanager
    async def _use(self, tenant: str, id_or_name: str) -> AsyncIterator[Channel]:
        """Wake the sandbox if paused, count the call as in flight, touch the idle clock."""
        self._check_open()
        rec = self._find(tenant, id_or_name)
        live = self._live(rec.id)
        async with live.lock:
            rec = await self._current(rec.id, live)
            require_for("call", rec.id, rec.state)
            if rec.state is S.PAUSED:
                rec = await self._wake_locked(rec, live, "wake on request")
            channel = live.channel
            if channel is None:
                raise GuestError(f"sandbox {rec.id} has no guest channel", sandbox_id=rec.id)
            live.busy += 1
            self.registry.touch(rec.id)
        try:
            yield channel
        except (GuestError, EngineError):
            machine = live.machine
            if machine is not None and not machine.is_running():
                await self._machine_died(rec.id, live)
            raise
        finally:
            live.busy -= 1
            with suppress(TorporError):
                self.registry.touch(rec.id)
            async with live.idle:
                live.idle.notify_all()

    async def _machine_died(self, sandbox_id: str, live: _Live) -> None:
        rec = self.registry.get(sandbox_id)
        if rec.state is S.RUNNING:
            log.error("sandbox %s: QEMU died while running", sandbox_id)
            await self._quiet_kill(live, self.directory(sandbox_id))
            self._mark_lost(rec, "QEMU died while running")

    async def run_command(self, id_or_name: str, cmd: str, *, tenant: str = "default",
                          cwd: str | None = None, env: dict[str, str] | None = None,
                          timeout: float | None = 60, background: bool = False,
                          on_stdout: OutputCallback | None = None,
                          on_stderr: OutputCallback | None = None) -> CommandResult:
        """Run a shell command in the sandbox (waking it first)."""
        async with self._use(tenant, id_or_name) as ch:
            return await ch.run_command(cmd, cwd=cwd, env=env, timeout=timeout,
                                        background=background, on_stdout=on_stdout,
                                        on_stderr=on_stderr)

    async def run_code(self, id_or_name: str, code: str, *, tenant: str = "default",
                       timeout: float | None = None, on_stdout: OutputCallback | None = None,
                       on_stderr: OutputCallback | None = None) -> Execution:
        """Run code in the sandbox's long-lived interpreter (waking it first)."""
        async with self._use(tenant, id_or_name) as ch:
            return await ch.run_code(code, timeout=timeout, on_stdout=on_stdout,
                                     on_stderr=on_stderr)

    async def read_file(self, id_or_name: str, path: str, *, tenant: str = "default") -> bytes:
        """A file's bytes. Raises PathNotFound."""
        async with self._use(tenant, id_or_name) as ch:
            return await ch.read_file(path)

    async def write_file(self, id_or_name: str, path: str, data: bytes | str, *,
                         tenant: str = "default") -> None:
        """Write a file (parents created)."""
        async with self._use(tenant, id_or_name) as ch:
            await ch.write_file(path, data)

    async def list_dir(self, id_or_name: str, path: str, *,
                       tenant: str = "default") -> builtins.list[EntryInfo]:
        """A directory's entries. Raises PathNotFound."""
        async with self._use(tenant, id_or_name) as ch:
            return await ch.list_dir(path)

    async def exists(self, id_or_name: str, path: str, *, tenant: str = "default") -> bool:
        """Whether a path exists in the sandbox."""
        async with self._use(tenant, id_or_name) as ch:
            return await ch.exists(path)

    async def remove(self, id_or_name: str, path: str, *, tenant: str = "default") -> None:
        """Remove a file or a tree. Raises PathNotFound."""
        async with self._use(tenant, id_or_name) as ch:
            await ch.remove(path)

    async def make_dir(self, id_or_name: str, path: str, *, tenant: str = "default") -> None:
        """Make a directory (and parents)."""
        async with self._use(tenant, id_or_name) as ch:
            await ch.make_dir(path)

    # -- idle pause, start, close ---------------------------------------------------------

    async def idle_sweep(self, now: float | None = None) -> builtins.list[str]:
        """Pause every running sandbox idle for at least its ``idle_pause_seconds`` and with
        no call in flight. Returns the ids paused; a failure is logged, not raised."""
        now = time.time() if now is None else now
        paused: builtins.list[str] = []
        for rec in self.registry.list(states={S.RUNNING}):
            if rec.idle_pause_seconds is None or rec.id not in self._lives:
                continue
            if now - rec.last_active_at < rec.idle_pause_seconds:
                continue
            live = self._lives[rec.id]
            if live.busy or live.lock.locked():
                continue
            try:
                async with live.lock:
                    rec = self.registry.get(rec.id)  # re-check: a call may have just come in
                    if (rec.state is S.RUNNING and live.busy == 0
                            and now - rec.last_active_at >= (rec.idle_pause_seconds or 0)):
                        await self._pause_locked(rec, live, "idle")
                        paused.append(rec.id)
            except TorporError as exc:
                log.warning("idle pause of %s failed: %s", rec.id, exc)
        return paused

    async def supervise(self, interval: float = 1.0) -> None:
        """Run :meth:`idle_sweep` every ``interval`` seconds until cancelled."""
        while True:
            try:
                await self.idle_sweep()
            except Exception:  # keep supervising; a bad sweep must not end idle pausing
                log.exception("idle sweep failed")
            await asyncio.sleep(interval)

    async def start(self, *, supervise: bool = True, interval: float = 1.0) -> None:
        """Reconcile the registry with the sandbox directories after a (re)start, then start
        the idle supervisor. Paused sandboxes stay paused; running ones whose QEMU is alive
        are re-attached; half-done pauses and wakes are resolved (see ``recovery``)."""
        self._check_open()
        for rec in self.registry.list():
            try:
                await self._reconcile(rec)
            except Exception:  # one broken sandbox must not keep the others from starting
                log.exception("reconciling sandbox %s failed", rec.id)
        if supervise and self._supervisor is None:
            self._supervisor = asyncio.get_running_loop().create_task(
                self.supervise(interval), name="torpor-idle-supervisor")

    async def _reconcile(self, rec: SandboxRecord) -> None:
        """Bring one registry row in line with its directory after a restart (the table is
        :func:`~torpor.sandbox.lifecycle.recovery`)."""
        directory = self.directory(rec.id)
        status = self.engine.inspect(directory)
        if rec.state is S.STOPPED and not status.exists:
            return  # the common case for killed sandboxes: nothing left to clean
        live = self._live(rec.id)
        action = recovery(rec.state, has_state=status.has_state,
                          qemu_alive=status.qemu_pid is not None)
        log.info("sandbox %s: %s on start -> %s", rec.id, rec.state.value, action.value)
        if action is Recovery.REATTACH:
            try:
                await self._reattach(rec, live, directory)
                return
            except Exception as exc:  # noqa: BLE001 - fall back to what the files hold
                log.warning("sandbox %s: cannot re-attach its QEMU: %r", rec.id, exc)
                await self._rehibernate(live)
                rec = self.registry.get(rec.id)
                action = recovery(rec.state, has_state=self.engine.inspect(directory).has_state,
                                  qemu_alive=False)
        if action is Recovery.UNDO_CREATE:
            await self._abort_create(rec, live, EngineError("interrupted by a restart"))
            return
        await self._quiet_kill(live, directory)
        if action is Recovery.DELETE_FILES:
            await asyncio.to_thread(shutil.rmtree, directory, True)
        elif action is Recovery.PAUSED:
            if rec.state is S.RUNNING:
                rec = self._move(rec, S.PAUSING, "recovered: re-hibernated")
            self._move(rec, S.PAUSED, "recovered: saved state is whole", paused_at=time.time())
        elif action is Recovery.LOST:
            self._mark_lost(rec, f"recovered: no QEMU and no saved state while "
                                 f"{rec.state.value}")

    async def _rehibernate(self, live: _Live) -> None:
        """Save the RAM of a machine whose guest does not answer (best effort)."""
        machine = live.machine
        if machine is not None and machine.is_running():
            with suppress(Exception):
                await machine.hibernate()
                live.machine = None

    async def _reattach(self, rec: SandboxRecord, live: _Live, directory: Path) -> None:
        """Take over a QEMU that outlived its manager; finish a half-done pause or wake."""
        machine = await self.engine.attach(directory, self._config(rec))
        live.machine = machine
        if rec.state is S.PAUSING:  # finish the pause it was in
            await self._pause_locked(self._move(rec, S.RUNNING, "recovered: re-attached"),
                                     live, "recovered: finish pause")
            return
        live.channel = await self.engine.connect(machine, directory)
        if rec.state is S.WAKING:
            await live.channel.refresh(entropy=os.urandom(64), unix_time=time.time())
            self._move(rec, S.RUNNING, "recovered: wake finished", last_active_at=time.time(),
                       paused_at=None)
        log.info("sandbox %s: re-attached to its running QEMU", rec.id)

    async def close(self, *, pause: bool = True) -> None:
        """Stop the supervisor; pause running sandboxes (``pause=True``) so no QEMU outlives
        the manager, else just drop the channels; close the registry. Idempotent."""
        if self._closed:
            return
        if self._supervisor is not None:
            self._supervisor.cancel()
            with suppress(asyncio.CancelledError):
                await self._supervisor
            self._supervisor = None
        for sandbox_id, live in builtins.list(self._lives.items()):
            try:
                rec = self.registry.get(sandbox_id)
                if pause and rec.state is S.RUNNING and live.machine is not None:
                    await self.pause(sandbox_id, tenant=rec.tenant)
            except (TorporError, SandboxNotFound) as exc:
                log.warning("closing %s: %s", sandbox_id, exc)
            if live.channel is not None:
                with suppress(Exception):
                    await live.channel.close()
                live.channel = None
        self._closed = True
        self.registry.close()


def _check_sizes(idle_pause_seconds: int | None, vcpus: int, memory_mib: int,
                 pause_retention_days: int) -> None:
    if idle_pause_seconds is not None and (
            not isinstance(idle_pause_seconds, int) or idle_pause_seconds < 1):
        raise InvalidArgument("idle_pause_seconds must be a positive integer or None",
                              idle_pause_seconds=idle_pause_seconds)
    if not isinstance(vcpus, int) or not 1 <= vcpus <= 64:
        raise InvalidArgument("vcpus must be 1-64", vcpus=vcpus)
    if not isinstance(memory_mib, int) or not 64 <= memory_mib <= 65536:
        raise InvalidArgument("memory_mib must be 64-65536", memory_mib=memory_mib)
    if not isinstance(pause_retention_days, int) or not 1 <= pause_retention_days <= 365:
        raise InvalidArgument("pause_retention_days must be 1-365",
                              pause_retention_days=pause_retention_days)
