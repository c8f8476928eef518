"""The manager's state, and the steps that move one sandbox's machine between states.

:class:`ManagerCore` is the base of :class:`~torpor.sandbox.manager.SandboxManager`: it holds
the manager's state (engine, registry, one :class:`Live` per sandbox) and the steps its public
operations are made of: pause (hibernate) and wake a held sandbox, undo a failed create, mark a
sandbox whose RAM is gone as lost. Bringing a registry row in line with what its directory
holds after a restart is :mod:`torpor.sandbox.manager.recovery`'s (the table is
:func:`~torpor.sandbox.registry.lifecycle.recovery`).

Every step that changes state goes through :meth:`ManagerCore.move`, which the lifecycle table
guards, and records a state only after the files that back it are durable (see
:mod:`torpor.sandbox.manager` for the crash-safety rule).

**The held-sandbox interface.** :class:`Held` names the part of the core that the checkpoint
component (:mod:`torpor.sandbox.checkpoints`: snapshot, fork, attachments) works with, and
nothing else of the manager's state: look a sandbox's :class:`Live` up, take ``live.lock``,
then pause, wake or boot it, record a transition, undo a failed create. Everything else here is
private to the manager.
"""

from __future__ import annotations

import asyncio
import builtins
import functools
import logging
import os
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from torpor.config import Paths, Quotas
from torpor.errors import (
    Conflict,
    EngineError,
    GuestError,
    InvalidArgument,
    NoNodeAvailable,
    StateLost,
    StorageError,
    TorporError,
)
from torpor.sandbox.engine import Channel, Engine, Machine, MachineConfig, QemuEngine
from torpor.sandbox.manager.cluster import (
    ClusterConfig,
    ClusterNode,
    compatible,
    upload_failed,
)
from torpor.sandbox.models import SandboxInfo
from torpor.sandbox.models import SandboxState as S
from torpor.sandbox.registry import AnyRegistry, Move, Registry, SandboxRecord
from torpor.sandbox.registry.lifecycle import Lifecycle, require_for
from torpor.sandbox.registry.meters import UP_STATES
from torpor.sandbox.storage.chunks import ChunkStore, home_chunk_store
from torpor.sandbox.storage.compaction import Expansion, begin_expand, is_compacted, settle
from torpor.sandbox.storage.pauses import RamFill, is_whole, settle_fill
from torpor.sandbox.vm.machine_dir import process_cpu_seconds, qemu_pid

__all__ = ["SYNC_TIMEOUT", "Held", "Live", "ManagerCore", "StepHook", "wrap_error"]

log = logging.getLogger(__name__)

#: Seconds a pause waits for the guest to flush its file systems before hibernating anyway.
SYNC_TIMEOUT = 5.0

#: Called at named points of create/pause/wake (``"pause:saved"`` ...) with the sandbox id;
#: tests use it to crash the process at an exact step.
StepHook = Callable[[str, str], Awaitable[None] | None]


@dataclass
class Live:
    """The in-process side of one sandbox: its lock, machine, channel and in-flight calls."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    idle: asyncio.Condition = field(default_factory=asyncio.Condition)
    machine: Machine | None = None
    channel: Channel | None = None
    busy: int = 0
    #: the sandbox's ``envs`` were set in its interpreter (a new Live, e.g. after a restart,
    #: sets them again: harmless)
    envs_sent: bool = False


class Held(Protocol):
    """What the checkpoint component may use of the manager (``SandboxManager`` is one).

    Look up a sandbox's :meth:`live` side and hold ``live.lock``; then :meth:`drain` in-flight
    calls, :meth:`pause_held` / :meth:`wake_held` it, :meth:`boot` a freshly cloned machine,
    :meth:`move` its registry row (the lifecycle table guards it; :meth:`move_many` for many in
    one commit), :meth:`abort_create` a
    half-made one, or raise :meth:`lost` for one whose RAM is gone.
    """

    paths: Paths
    registry: AnyRegistry
    engine: Engine
    guest_hooks: builtins.list[Any]

    def directory(self, sandbox_id: str) -> Path: ...

    def live(self, sandbox_id: str) -> Live: ...

    async def drain(self, live: Live) -> None: ...

    async def pause_held(self, rec: SandboxRecord, live: Live, reason: str) -> SandboxRecord: ...

    async def wake_held(self, rec: SandboxRecord, live: Live, reason: str) -> SandboxRecord: ...

    async def boot(
        self,
        rec: SandboxRecord,
        live: Live,
        *,
        woken_step: str | None = None,
        ram_ready: Awaitable[object] | None = None,
        cold: bool = False,
    ) -> Channel: ...

    def move(
        self, rec: SandboxRecord, dst: S, reason: str = "", **columns: Any
    ) -> SandboxRecord: ...

    async def move_many(
        self, recs: builtins.list[SandboxRecord], dst: S, reason: str = "", **columns: Any
    ) -> builtins.list[SandboxRecord]: ...

    async def abort_create(self, rec: SandboxRecord, live: Live, exc: BaseException) -> None: ...

    def lost(self, rec: SandboxRecord) -> StateLost: ...

    # cluster mode (no-ops on one machine): hold the sandbox's lease, give it back, and bring
    # a pause held elsewhere onto this node
    async def take(self, sandbox_id: str, *, place: bool = True) -> None: ...

    async def give_back(self, sandbox_id: str, *, held: bool = False) -> None: ...

    async def fetch_pause(self, rec: SandboxRecord) -> None: ...

    def check_room(
        self, tenant: str, *, sandboxes: int, memory_mib: int, allocated: int = 0
    ) -> None: ...

    # two of the manager's own operations: a fork removes the children made before a failure;
    # an attach wakes a paused sandbox first
    async def kill(
        self, id_or_name: str, *, tenant: str = "default", reason: str = "kill"
    ) -> SandboxInfo: ...

    async def resume(self, id_or_name: str, *, tenant: str = "default") -> SandboxInfo: ...


#: seconds a sandbox stays paused before its RAM is compacted into the chunk store
#: (``$TORPOR_COMPACT_AFTER_SECONDS``; ``off`` never compacts)
COMPACT_AFTER_SECONDS = 3600.0
COMPACT_ENV = "TORPOR_COMPACT_AFTER_SECONDS"


def _compact_after() -> float | None:
    raw = os.environ.get(COMPACT_ENV, "").strip()
    if not raw:
        return COMPACT_AFTER_SECONDS
    if raw.lower() == "off":
        return None
    try:
        value = float(raw)
    except ValueError as exc:
        raise InvalidArgument(f"{COMPACT_ENV} must be seconds or 'off', not {raw!r}") from exc
    if value < 0:
        raise InvalidArgument(f"{COMPACT_ENV} must be >= 0, not {raw!r}")
    return value


#: the states in which a sandbox holds (or is about to hold) a machine with its RAM
_HOLDING_RAM = {S.CREATING, S.RUNNING, S.WAKING, S.PAUSING}


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=UTC).isoformat(timespec="seconds")


async def _outlast(task: asyncio.Future[Any]) -> None:
    """Wait for ``task`` (a thread writing a sandbox's files, which must not outlive the call
    that started it) to end, even if the waiter is cancelled meanwhile."""
    while not task.done():
        with suppress(asyncio.CancelledError):
            await asyncio.wait([task])


async def _settled(task: asyncio.Future[Any]) -> TorporError | None:
    """Wait for ``task`` (see :func:`_outlast`) and return the TorporError it failed with,
    if any."""
    await _outlast(task)
    if task.cancelled():
        return None
    exc = task.exception()
    return exc if isinstance(exc, TorporError) else None


def _retrieved(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # read (and logged by whoever waits for it), never "never retrieved"


async def _hang_up(sandbox_id: str, channel: Channel, flush: asyncio.Future[Any]) -> None:
    """Wait for the guest's flush before a pause stops it, then close the channel. A hung
    guest must not hold the pause (its RAM is saved either way): after SYNC_TIMEOUT, or if
    the flush failed, the pause goes on (logged)."""
    done, _ = await asyncio.wait([flush], timeout=SYNC_TIMEOUT)
    if not done:
        flush.cancel()
        log.warning("sync before pausing %s timed out after %ss", sandbox_id, SYNC_TIMEOUT)
    elif not flush.cancelled() and flush.exception() is not None:
        log.warning("sync before pausing %s failed: %r", sandbox_id, flush.exception())
    with suppress(Exception):
        await channel.close()


def wrap_error(exc: BaseException, what: str, sandbox_id: str) -> TorporError:
    """``exc`` as a TorporError: itself if it is one, else an EngineError wrapping it."""
    if isinstance(exc, TorporError):
        return exc
    return EngineError(
        f"{what} failed for sandbox {sandbox_id}: {exc}", exc=exc, sandbox_id=sandbox_id
    )


class ManagerCore:
    """The state and the locked steps of a :class:`~torpor.sandbox.manager.SandboxManager`
    (see the module docstring). Not used on its own."""

    def __init__(
        self,
        paths: Paths,
        *,
        engine: Engine | None = None,
        cluster: ClusterConfig | None = None,
    ) -> None:
        self.paths = paths.ensure()
        self.engine: Engine = engine if engine is not None else QemuEngine(paths)
        #: cluster mode (:mod:`torpor.sandbox.manager.cluster`): the shared registry and store
        self.cluster: ClusterNode | None = None if cluster is None else ClusterNode(cluster, paths)
        self.registry: AnyRegistry = (
            Registry(paths.registry) if self.cluster is None else self.cluster.registry
        )
        self.on_step: StepHook | None = None
        #: objects with ``async before_pause(sandbox_id, channel)`` / ``after_wake(...)``,
        #: e.g. torpor.sandbox.checkpoints (9p drives must be unmounted to hibernate)
        self.guest_hooks: builtins.list[Any] = []
        self._lives: dict[str, Live] = {}
        self._name_locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._supervisor: asyncio.Task[None] | None = None
        self._closed = False
        self._chunks: ChunkStore | None = None if self.cluster is None else self.cluster.chunks
        #: a sandbox paused longer than this is compacted (None: never): on one machine into
        #: the home's chunk store; in cluster mode, once its pause is durable, its local files
        #: are dropped (:mod:`torpor.sandbox.storage.evict`)
        self.compact_after_seconds: float | None = _compact_after()

    # -- helpers --------------------------------------------------------------------------

    @property
    def chunk_store(self) -> ChunkStore:
        """The home's chunk store (where compacted sandboxes keep their RAM), opened once."""
        if self._chunks is None:
            self._chunks = home_chunk_store(self.paths)
        return self._chunks

    def directory(self, sandbox_id: str) -> Path:
        """The sandbox's machine directory."""
        return self.paths.sandboxes / sandbox_id

    def check_room(
        self, tenant: str, *, sandboxes: int, memory_mib: int, allocated: int = 0
    ) -> None:
        """Raise QuotaExceeded unless ``tenant`` may run ``sandboxes`` more machines of
        ``memory_mib`` MiB of RAM in all (its :class:`~torpor.config.Quotas`), and
        StorageError unless the disk can back that RAM.

        Guest RAM is a shared file mapping: a guest touching a page the file system cannot
        allocate gets QEMU killed by SIGBUS, and the sandbox's RAM with it. So a machine only
        starts (create, wake, fork, restore) when the free space holds all of its RAM
        (``allocated``: bytes its RAM file already holds)."""
        need = (memory_mib << 20) - allocated
        free = shutil.disk_usage(self.paths.sandboxes).free
        if need > free:
            raise StorageError(
                f"not enough disk to back {memory_mib} MiB of guest RAM: {free >> 20} MiB free "
                f"under {self.paths.sandboxes}, {need >> 20} MiB needed (a guest that touched "
                "a page the disk could not hold would be killed); free some space",
                free=free,
                needed=need,
            )
        quotas = Quotas.of(self.paths, tenant)
        running = self.registry.list(tenant=tenant, states=_HOLDING_RAM)
        quotas.check(tenant, "running_sandboxes", len(running), sandboxes)
        quotas.check(tenant, "running_memory_mib", sum(r.memory_mib for r in running), memory_mib)

    def _ram_held(self, sandbox_id: str) -> int:
        """Bytes the sandbox's RAM file already holds on disk (0 when there is none)."""
        try:
            return (self.directory(sandbox_id) / "ram").stat().st_blocks * 512
        except OSError:
            return 0

    def cpu_reading(self, sandbox_id: str) -> float | None:
        """CPU seconds the QEMU process running the sandbox has used (None: none runs)."""
        pid = qemu_pid(self.directory(sandbox_id))
        return None if pid is None else process_cpu_seconds(pid)

    def owned_bytes(self, sandbox_id: str) -> int:
        """Bytes the sandbox's directory holds on disk (its RAM and state files, its own disk
        overlay; not the template or frozen layers it is backed by, which others share)."""
        total = 0
        with suppress(OSError):
            for f in self.directory(sandbox_id).iterdir():
                with suppress(OSError):
                    if f.is_file() and not f.is_symlink():
                        total += f.stat().st_blocks * 512
        return total

    def live(self, sandbox_id: str) -> Live:
        """The in-process side of a sandbox (its lock, machine, channel), made on first use."""
        return self._lives.setdefault(sandbox_id, Live())

    @staticmethod
    def _config(rec: SandboxRecord) -> MachineConfig:
        return MachineConfig(
            template=rec.template, vcpus=rec.vcpus, memory_mib=rec.memory_mib, tenant=rec.tenant
        )

    def _readings(self, rec: SandboxRecord, dst: S, columns: dict[str, Any]) -> dict[str, Any]:
        """``columns`` with what usage meters at ``rec -> dst``: the QEMU process's CPU seconds
        when leaving a state in which it runs (``cpu_reading``, unless given), and the bytes
        the sandbox owns on disk when entering ``paused``."""
        if rec.state in UP_STATES and "cpu_reading" not in columns:
            columns["cpu_reading"] = self.cpu_reading(rec.id)
        if dst is S.PAUSED:
            columns["owned_bytes"] = self.owned_bytes(rec.id)
        return columns

    def move(self, rec: SandboxRecord, dst: S, reason: str = "", **columns: Any) -> SandboxRecord:
        """Record ``rec -> dst`` in the registry (the lifecycle table guards it) and return the
        fresh row, with the usage readings of :meth:`_readings`."""
        columns = self._readings(rec, dst, columns)
        lifecycle = Lifecycle(
            rec.id,
            rec.state,
            record=lambda t: self.registry.set_state(
                t.sandbox_id, rec.state, t.dst, reason=t.reason, at=t.at, **columns
            ),
        )
        lifecycle.to(dst, reason)
        return self.registry.get(rec.id)

    async def move_many(
        self, recs: builtins.list[SandboxRecord], dst: S, reason: str = "", **columns: Any
    ) -> builtins.list[SandboxRecord]:
        """:meth:`move` every one of ``recs`` to ``dst`` in one registry transaction (one
        commit: a fork's children going to ``running``), all or none, in a worker thread (the
        commit waits for the disk); returns their fresh rows. Raises as :meth:`move`, for the
        first row that cannot move (then none moved)."""

        def record() -> builtins.list[SandboxRecord]:
            moves = []
            for rec in recs:
                got = self._readings(rec, dst, dict(columns))
                cpu, owned = got.pop("cpu_reading", None), got.pop("owned_bytes", None)
                moves.append(Move(rec.id, rec.state, dst, cpu, owned, got))
            self.registry.set_states(moves, reason=reason)
            for rec in recs:
                log.info("sandbox %s: %s -> %s (%s)", rec.id, rec.state.value, dst.value, reason)
            return [self.registry.get(rec.id) for rec in recs]

        return await asyncio.to_thread(record)

    async def _step(self, step: str, sandbox_id: str) -> None:
        if self.on_step is not None:
            result = self.on_step(step, sandbox_id)
            if result is not None:
                await result

    def _lost_message(self, rec: SandboxRecord) -> str:
        since = max(
            (t.at for t in self.registry.transitions(rec.id) if t.dst is S.RUNNING),
            default=rec.created_at,
        )
        return (
            f"RAM and processes since {_iso(since)} (the last wake); disk kept, "
            "minus writes the guest had not flushed (its files can still be read)"
        )

    def lost(self, rec: SandboxRecord) -> StateLost:
        return StateLost(
            f"sandbox {rec.id} lost its state: {rec.error}",
            sandbox_id=rec.id,
            state=rec.state.value,
            lost=rec.error or "RAM and processes",
        )

    def _mark_lost(self, rec: SandboxRecord, reason: str) -> StateLost:
        lost = f"{self._lost_message(rec)}; cause: {reason}"
        rec = self.move(rec, S.ERROR, reason, error=lost)
        return self.lost(rec)

    async def _current(self, sandbox_id: str, live: Live) -> SandboxRecord:
        """The sandbox's row, read under its lock. A running sandbox this manager never
        attached (``start()`` not called after a restart) is reconciled first, so a pause can
        never hibernate a machine it does not hold. So is a row left ``pausing`` or ``waking``:
        under the lock no pause or wake is under way, so the step that moved it on could not
        write the registry (PostgreSQL away) after its machine moved on; the machine says
        where it is (a woken one runs: ``running``; a saved one: ``paused``), and one whose
        pause or wake was cancelled half-way (its machine is let go and found again). Raises
        StateLost for one in ``error``."""
        rec = self.registry.get(sandbox_id)
        if rec.state is S.WAKING and live.machine is not None and live.channel is not None:
            log.warning("sandbox %s: its wake was not recorded; it runs", sandbox_id)
            rec = self.move(
                rec,
                S.RUNNING,
                "recovered: wake finished",
                last_active_at=time.time(),
                paused_at=None,
            )
        elif rec.state in (S.RUNNING, S.PAUSING, S.WAKING) and live.machine is None:
            await self._reconcile(rec)
            rec = self.registry.get(sandbox_id)
        elif rec.state in (S.PAUSING, S.WAKING):
            # a step cut short (its caller was cancelled) left its machine half-way: let go
            # of it and settle the row from where the machine is, as after a restart
            log.warning("sandbox %s: a %s was cut short; settling it", sandbox_id, rec.state.value)
            machine, live.machine, live.channel = live.machine, None, None
            if machine is not None:
                with suppress(Exception):
                    await machine.release()
            await self._reconcile(rec)
            rec = self.registry.get(sandbox_id)
        if rec.state is S.ERROR:
            raise self.lost(rec)
        return rec

    def _find(self, tenant: str, id_or_name: str) -> SandboxRecord:
        return self.registry.find(tenant, id_or_name)

    async def _quiet_kill(self, live: Live, directory: Path) -> None:
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

    @asynccontextmanager
    async def _held(
        self, tenant: str, id_or_name: str, operation: str
    ) -> AsyncIterator[tuple[SandboxRecord, Live]]:
        """Hold the sandbox's lock for ``operation`` ("pause", "resume", "call") and yield its
        current row and Live. Raises SandboxNotFound, StateLost, and InvalidState /
        SandboxClosed when the state forbids the operation."""
        rec = self._find(tenant, id_or_name)
        await self.take(rec.id, place=operation != "pause")  # a pause wakes nothing
        live = self.live(rec.id)
        try:
            async with live.lock:
                rec = await self._current(rec.id, live)
                require_for(operation, rec.id, rec.state)
                yield rec, live
        finally:
            await self.give_back(rec.id)

    async def take(self, sandbox_id: str, *, place: bool = True) -> None:
        """Cluster mode: hold the sandbox's lease before touching its machine; with
        ``place``, a paused sandbox another node should wake (its origin, or a less loaded
        node: :meth:`ClusterNode.place`) is a Conflict naming that node. Raises Conflict
        naming the node that runs it or should (and its URL), NoNodeAvailable; nothing on
        one machine."""
        if self.cluster is not None:
            await asyncio.to_thread(
                functools.partial(self.cluster.acquire, sandbox_id, place=place)
            )

    async def give_back(self, sandbox_id: str, *, held: bool = False) -> None:
        """Cluster mode: release the sandbox's lease unless it runs here or its pause is not
        durable yet (best effort); nothing on one machine. Under the sandbox's lock (``held``:
        the caller holds it), and not at all while another operation holds or awaits it (that
        one gives it back when done): a release decided on a row read just before a wake took
        the lock would leave the woken sandbox with no owner, free for another node to take
        and find no QEMU."""
        cluster = self.cluster
        if cluster is None or cluster.pushing(sandbox_id):
            return
        if held:
            await asyncio.to_thread(cluster.settle, sandbox_id)
            return
        live = self.live(sandbox_id)
        if live.lock.locked():
            return
        async with live.lock:
            await asyncio.to_thread(cluster.settle, sandbox_id)

    async def drain(self, live: Live) -> None:
        """Wait until no call is in flight on the sandbox (hold ``live.lock``: none can start)."""
        async with live.idle:
            await live.idle.wait_for(lambda: live.busy == 0)

    async def boot(
        self,
        rec: SandboxRecord,
        live: Live,
        *,
        woken_step: str | None = None,
        ram_ready: Awaitable[object] | None = None,
        cold: bool = False,
    ) -> Channel:
        """Start the hibernated machine in the sandbox's directory, connect to its agent and
        give the guest fresh entropy and the host's clock (clones of one snapshot must not
        share random state). ``woken_step`` is reported to ``on_step`` after the wake.
        ``ram_ready``: its RAM and state are still being written (a fork's child: see
        ``Machine.wake``). ``cold``: a fork's or a restore's child (see ``Engine.connect``).
        Raises what the engine and the channel raise; the caller undoes what was started."""
        directory = self.directory(rec.id)
        machine = self.engine.machine(directory, self._config(rec))
        live.machine = machine
        await machine.wake(ram_ready=ram_ready)
        if woken_step is not None:
            await self._step(woken_step, rec.id)
        live.channel = await self.engine.connect(machine, directory, cold=cold)
        await live.channel.refresh(entropy=os.urandom(64), unix_time=time.time())
        return live.channel

    # -- steps of create, pause and wake --------------------------------------------------

    async def abort_create(self, rec: SandboxRecord, live: Live, exc: BaseException) -> None:
        log.warning("create of %s failed: %r; removing it", rec.id, exc)
        directory = self.directory(rec.id)
        await self._quiet_kill(live, directory)
        rec = self.move(rec, S.ERROR, "create failed", error=f"create failed: {exc}")
        self.move(rec, S.STOPPED, "create failed")
        await asyncio.to_thread(shutil.rmtree, directory, True)
        self._lives.pop(rec.id, None)

    async def pause_held(self, rec: SandboxRecord, live: Live, reason: str) -> SandboxRecord:
        channel = live.channel
        if channel is not None:
            for hook in self.guest_hooks:  # may refuse (busy drive): still running then
                await hook.before_pause(rec.id, channel)
        # The guest flushes its page cache (so the disk overlay is whole) while the registry
        # records "pausing" and QEMU sets the save up; the stop waits for the flush.
        flush = None if channel is None else asyncio.ensure_future(channel.sync())
        if flush is not None:
            flush.add_done_callback(_retrieved)
            await asyncio.sleep(0)  # its request leaves before the registry's write blocks
        rec = self.move(rec, S.PAUSING, reason)
        await self._step("pause:begin", rec.id)
        directory = self.directory(rec.id)
        live.channel = None
        ready = None
        if channel is not None and flush is not None:
            ready = asyncio.ensure_future(_hang_up(rec.id, channel, flush))
        machine = live.machine or self.engine.machine(directory, self._config(rec))
        try:
            await machine.hibernate(ready=ready)
        except Exception as exc:
            if ready is not None:
                await asyncio.wait([ready])
            return await self._pause_failed(rec, live, machine, exc)
        live.machine = None
        settle_fill(directory, saved=True)  # (a marker a wake could not drop: the state is new)
        await self._step("pause:saved", rec.id)
        # Only now, with the state file durable, does the registry say "paused".
        rec = self.move(rec, S.PAUSED, reason, paused_at=time.time())
        self._paused(rec)
        return rec

    def _paused(self, rec: SandboxRecord) -> None:
        """Cluster mode: note that this node holds the new pause's files, and push them to the
        shared store in the background (retried until durable)."""
        cluster = self.cluster
        if cluster is None or rec.paused_at is None:
            return
        paused_at = rec.paused_at
        try:
            cluster.registry.note_pause(rec.id, cluster.node, paused_at)
        except TorporError as exc:
            log.warning("sandbox %s: cannot record its pause yet: %s", rec.id, exc)

        async def push() -> bool | None:
            live = self.live(rec.id)
            async with live.lock:
                try:
                    now = self.registry.get(rec.id)
                except TorporError as exc:  # PostgreSQL away: try again later
                    log.warning("sandbox %s: cannot check its pause: %s", rec.id, exc)
                    return False
                if now.state is not S.PAUSED or now.paused_at != paused_at or live.machine:
                    return None  # woken or killed meanwhile: this pause is gone
                try:
                    manifest = await asyncio.to_thread(
                        cluster.push, self.directory(rec.id), rec.template, rec.id
                    )
                    await asyncio.to_thread(cluster.record_durable, rec.id, paused_at, manifest)
                except InvalidArgument as exc:  # it can never leave this node
                    log.error("sandbox %s: pause not made durable: %s", rec.id, exc)
                    with suppress(TorporError):
                        cluster.registry.record_upload_error(rec.id, str(exc))
                    return None
                except Conflict as exc:  # taken over, or paused again, meanwhile: not ours
                    log.warning("sandbox %s: pause not recorded: %s", rec.id, exc)
                    return None
                except Exception as exc:
                    log.warning("sandbox %s: pause upload failed, retrying: %s", rec.id, exc)
                    with suppress(TorporError):
                        again = self.registry.get(rec.id)  # the upload took a while
                        if again.state is S.PAUSED and again.paused_at == paused_at:
                            cluster.registry.note_pause(rec.id, cluster.node, paused_at)
                            cluster.registry.record_upload_error(rec.id, upload_failed(exc))
                    return False
                log.info("sandbox %s: pause durable in %s", rec.id, cluster.chunks.location)
                return True

        cluster.push_later(rec.id, push, after=functools.partial(self.give_back, rec.id))

    async def _pause_failed(
        self, rec: SandboxRecord, live: Live, machine: Machine, exc: Exception
    ) -> SandboxRecord:
        directory = self.directory(rec.id)
        log.warning("hibernate of %s failed: %r", rec.id, exc)
        if machine.is_running():
            try:  # the machine is still up: roll back to running
                live.machine = machine
                live.channel = await self.engine.connect(machine, directory)
            except Exception:
                await self._quiet_kill(live, directory)
            else:
                self.move(rec, S.RUNNING, "pause failed; still running")
                if isinstance(exc, TorporError):
                    raise exc
                raise wrap_error(exc, "pause", rec.id) from exc
        await self._quiet_kill(live, directory)
        if self.engine.inspect(directory).has_state:
            log.warning("sandbox %s: QEMU died after its state was saved; paused", rec.id)
            rec = self.move(rec, S.PAUSED, "state saved before QEMU died", paused_at=time.time())
            self._paused(rec)
            return rec
        raise self._mark_lost(rec, f"QEMU died while pausing: {exc}") from exc

    async def wake_held(self, rec: SandboxRecord, live: Live, reason: str) -> SandboxRecord:
        allocated = self._ram_held(rec.id)
        self.check_room(rec.tenant, sandboxes=1, memory_mib=rec.memory_mib, allocated=allocated)
        # cluster mode: hold the lease again, now, under the lock: a call that ended just
        # before may have given it back after this call took it (Conflict if another node
        # took it since: the request goes there)
        await self.take(rec.id, place=False)
        directory = self.directory(rec.id)
        # cluster mode, its pause on another node: every file here but the RAM's content
        # (no fsync of the RAM: its marker stays until the wake consumed the state, below)
        job: Expansion | RamFill | None = await self.begin_fetch_pause(rec, durable=False)
        if job is None and is_compacted(directory):  # its RAM is in the chunk store
            # no fsync: the manifest stays until the wake consumes the state (settle below)
            job = await asyncio.to_thread(
                begin_expand, directory, self.chunk_store, sandbox_id=rec.id, durable=False
            )
        try:
            if job is not None or self.cluster is not None:
                # again: the steps above awaited, and another wake or a create may have
                # taken the room meanwhile (``waking`` is what makes this one count)
                self.check_room(
                    rec.tenant, sandboxes=1, memory_mib=rec.memory_mib, allocated=allocated
                )
            rec = self.move(rec, S.WAKING, reason)
            await self._step("wake:begin", rec.id)
        except BaseException:
            if job is not None:
                job.close()
            raise
        machine = self.engine.machine(directory, self._config(rec))
        live.machine = machine
        # QEMU starts while the RAM file is filled; it loads the state once that is done
        rebuilt = None if job is None else asyncio.ensure_future(asyncio.to_thread(job.run))
        # (shielded: a cancelled wake must not mark the thread's future done while the thread
        # still writes; a wake that fails first never awaits it: _settled reads the error)
        ready = None if rebuilt is None else asyncio.shield(rebuilt)
        if ready is not None:
            ready.add_done_callback(_retrieved)
        try:
            await (machine.wake() if ready is None else machine.wake(ram_ready=ready))
        except asyncio.CancelledError:
            # the caller gave up: the next call settles the sandbox from its files (see
            # _current), so the thread writing its RAM file must have ended by then
            if rebuilt is not None:
                await _settled(rebuilt)
            raise
        except Exception as exc:
            failed = None if rebuilt is None else await _settled(rebuilt)
            await self._quiet_kill(live, directory)
            if failed is not None:  # a chunk bad or missing: nothing ran, the manifest stays
                self.move(rec, S.PAUSED, f"wake failed: its RAM cannot be rebuilt: {failed}")
                raise failed from None if failed is exc else exc
            status = self.engine.inspect(directory)
            if status.damage is not None:  # it would fail the same way every time
                raise self._mark_lost(rec, f"cannot be woken: {status.damage}") from exc
            if status.has_state:
                self.move(rec, S.PAUSED, f"wake failed, saved state intact: {exc}")
                raise EngineError(
                    f"waking sandbox {rec.id} failed: {exc}; it stays paused "
                    "with its state intact and can be woken again",
                    exc=exc,
                    sandbox_id=rec.id,
                ) from exc
            raise self._mark_lost(rec, f"wake failed and the state is gone: {exc}") from exc
        settle(directory)  # the state is consumed: a compacted RAM's manifest is history now
        settle_fill(directory)  # and a RAM rebuilt from the store is the running guest's
        if isinstance(job, RamFill):
            await self._fetched(rec, job)
        await self._step("wake:woken", rec.id)
        try:
            # The guest that last ran on this RAM is the one woken (its state is deleted before
            # it runs): no other guest shares its random state, so it needs the host's clock
            # but no entropy or reseed (a fork, restore or create has them: boot()).
            live.channel = await self.engine.connect(machine, directory, reseed=False)
        except Exception as exc:
            return await self._guest_unreachable(rec, live, machine, exc)
        for hook in self.guest_hooks:
            try:
                await hook.after_wake(rec.id, live.channel)
            except TorporError as exc:
                log.warning("after-wake hook of %s failed: %s", rec.id, exc)
        return self.move(rec, S.RUNNING, reason, last_active_at=time.time(), paused_at=None)

    async def fetch_pause(self, rec: SandboxRecord) -> None:
        """Cluster mode: unless this node holds the files of the sandbox's latest pause,
        rebuild them from the shared store (its last durable pause). Raises as
        :meth:`begin_fetch_pause`."""
        fill = await self.begin_fetch_pause(rec)
        if fill is not None:
            filled = asyncio.ensure_future(asyncio.to_thread(fill.run))
            try:
                await asyncio.shield(filled)
            except asyncio.CancelledError:
                await _outlast(filled)  # (as a wake's rebuild: see wake_held)
                raise
            await self._fetched(rec, fill)

    async def _fetched(self, rec: SandboxRecord, fill: RamFill) -> None:
        """Record that this node holds the pause ``fill`` rebuilt."""
        cluster = self.cluster
        assert cluster is not None
        pause = await asyncio.to_thread(cluster.registry.pause_record, rec.id)
        if pause is not None:
            await asyncio.to_thread(
                cluster.registry.note_pause, rec.id, cluster.node, pause.manifest_paused_at or 0.0
            )
        log.info(
            "sandbox %s: pause fetched from %s in %.2f s",
            rec.id,
            cluster.chunks.location,
            fill.begin_seconds + fill.seconds,
        )

    async def begin_fetch_pause(
        self, rec: SandboxRecord, *, durable: bool = True
    ) -> RamFill | None:
        """Cluster mode: unless this node holds the files of the sandbox's latest pause,
        begin rebuilding them from the shared store (its last durable pause): every file but
        the RAM's content, which the returned job fills (None: nothing to fetch; ``durable``:
        see :func:`~torpor.sandbox.storage.pauses.begin_rebuild`). Raises
        StateLost when there is no durable pause to wake from, NoNodeAvailable (another
        accelerator or CPU model), TemplateNotFound (the template build is not on this node),
        CorruptData, StorageError."""
        cluster = self.cluster
        if cluster is None:
            return None
        directory = self.directory(rec.id)
        # where first (a light read): the manifest is read only when the files are not here
        where = await asyncio.to_thread(cluster.registry.pause_location, rec.id)
        if where is None or (where == (cluster.node, rec.paused_at) and is_whole(directory)):
            return None  # never paused in the cluster, or its files are here
        pause = await asyncio.to_thread(cluster.registry.pause_record, rec.id)
        if pause is None:
            return None
        if pause.manifest is None:
            raise StateLost(
                f"sandbox {rec.id}: its pause is on node {pause.node} and was never stored "
                "off-node, so it cannot be woken here",
                sandbox_id=rec.id,
                state=rec.state.value,
                lost="the pause's files (on its node only)",
                node=pause.node,
            )
        origin = pause.manifest.get("origin")
        here = await asyncio.to_thread(cluster.info)
        if isinstance(origin, dict) and not compatible(here, origin):
            raise NoNodeAvailable(
                f"sandbox {rec.id}: its pause was made on {origin.get('accelerator')} "
                f"({origin.get('cpu_model')}), node {cluster.node} is {here.accelerator} "
                f"({here.cpu_model}): it cannot wake here",
                sandbox_id=rec.id,
                accelerator=origin.get("accelerator"),
                cpu_model=origin.get("cpu_model"),
            )
        if pause.manifest_paused_at != rec.paused_at:
            log.warning(
                "sandbox %s: waking from its last durable pause (%s), not its latest",
                rec.id,
                pause.manifest_paused_at,
            )
        return await asyncio.to_thread(
            cluster.begin_rebuild, pause.manifest, directory, rec.template, rec.id, durable
        )

    async def _guest_unreachable(
        self, rec: SandboxRecord, live: Live, machine: Machine, exc: Exception
    ) -> SandboxRecord:
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
            except Exception as again:
                log.warning("re-hibernating %s failed: %r", rec.id, again)
            else:
                live.machine = None
                self.move(
                    rec,
                    S.PAUSED,
                    f"guest unreachable after wake; re-hibernated: {exc}",
                    paused_at=time.time(),
                )
                raise GuestError(
                    f"sandbox {rec.id} woke but its guest agent did not answer "
                    f"({exc}); it was paused again with its RAM intact",
                    exc=exc,
                    sandbox_id=rec.id,
                ) from exc
        await self._quiet_kill(live, directory)
        raise self._mark_lost(rec, f"guest unreachable after wake: {exc}") from exc

    async def _machine_died(self, sandbox_id: str, live: Live) -> None:
        rec = self.registry.get(sandbox_id)
        if rec.state is S.RUNNING:
            log.error("sandbox %s: QEMU died while running", sandbox_id)
            await self._quiet_kill(live, self.directory(sandbox_id))
            self._mark_lost(rec, "QEMU died while running")

    async def _reconcile(self, rec: SandboxRecord) -> None:
        """Bring one registry row in line with its directory after a restart (the
        manager's: :class:`~torpor.sandbox.manager.recovery.Reconciler`)."""
        raise NotImplementedError
