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

The steps these operations are made of (pause, wake, recovery after a restart) are in
:mod:`torpor.sandbox.manager.core`, the base class of :class:`SandboxManager`; the calls that
run inside a sandbox (commands, code, terminals, files, ports) in
:mod:`torpor.sandbox.manager.calls`, and what this node does in a cluster (join, drain, stale
directories) in :mod:`torpor.sandbox.manager.nodes`, the two parts it is made of.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import secrets
import shutil
import time
from collections.abc import Mapping
from contextlib import suppress
from typing import Any

from torpor._tail import log_tail
from torpor.config import check_name, internet_allowed
from torpor.errors import (
    AccessDenied,
    Conflict,
    CorruptData,
    GuestError,
    InvalidArgument,
    SandboxClosed,
    SandboxNotFound,
    TorporError,
)
from torpor.sandbox.engine import MachineConfig
from torpor.sandbox.manager.calls import SandboxCalls
from torpor.sandbox.manager.compacting import cluster_compact_sweep, sweep_due
from torpor.sandbox.manager.core import wrap_error
from torpor.sandbox.manager.nodes import NodeOperations
from torpor.sandbox.models import (
    SandboxEvent,
    SandboxInfo,
)
from torpor.sandbox.models import SandboxState as S
from torpor.sandbox.registry import Registry, SandboxRecord
from torpor.sandbox.registry.lifecycle import require
from torpor.sandbox.registry.repair import orphans
from torpor.sandbox.requests import (
    SandboxOptions,
    SandboxSettings,
)
from torpor.sandbox.storage.compaction import CompactionReport, compact, is_compacted
from torpor.sandbox.storage.relocate import relocate
from torpor.sandbox.storage.snapshots import check_retention, store_lock
from torpor.sandbox.vm.linger import settle_all
from torpor.sandbox.vm.machine_dir import has_nic, read_machine_json

__all__ = ["SandboxManager"]

log = logging.getLogger(__name__)

#: below this fraction of the disk free, every paused sandbox is compacted, whatever its age
LOW_DISK_FRACTION = 0.10
#: cluster mode: seconds between two looks for paused sandboxes to compact
CLUSTER_COMPACT_SECONDS = 10.0
#: cluster mode: seconds a closing node waits for its pauses to become durable
CLOSE_PUSH_SECONDS = 120.0

#: brings the hot-plugged network card up in the guest (no DHCP client there): QEMU's
#: user-mode network has the guest at 10.0.2.15, its gateway at .2 and a DNS at .3
NETWORK_UP = r"""modprobe virtio_net 2>/dev/null
dev=
for i in $(seq 1 100); do
  dev=$(ls /sys/class/net | grep -v '^lo$' | head -n 1)
  [ -n "$dev" ] && break
  sleep 0.1
done
[ -n "$dev" ] || { echo "no network device appeared" >&2; exit 1; }
ip link set lo up
ip link set "$dev" up
ip addr add 10.0.2.15/24 dev "$dev"
ip route add default via 10.0.2.2
printf 'nameserver 10.0.2.3\n' > /etc/resolv.conf
"""


def _internet_policy(wanted: bool | None) -> bool:
    """Whether a new sandbox gets a network card: what was asked, else the host's default
    (:func:`torpor.config.internet_allowed`). Raises InvalidArgument when it asks for one the
    host does not allow."""
    allowed = internet_allowed()
    if wanted and not allowed:
        raise InvalidArgument(
            "this host does not let sandboxes reach the internet (its operator allows it with "
            "TORPOR_ALLOW_INTERNET=1 for the server)",
            field="internet",
        )
    return allowed if wanted is None else wanted


def _scope_of(binding: Mapping[str, Any]) -> dict[str, Any]:
    """A ``memory_scope`` record without its ``grants``: the scope a get-or-create compares
    (the grants are the rights of whoever bound it, kept with the binding)."""
    return {k: v for k, v in binding.items() if k != "grants"}


class SandboxManager(NodeOperations, SandboxCalls):
    """Owns every sandbox of one torpor home. All methods are coroutines; ``tenant`` (keyword,
    default ``"default"``) scopes names and lookups.

    Errors: SandboxNotFound, TemplateNotFound, InvalidName / InvalidArgument (bad input, nothing
    created), Conflict (a name taken concurrently by another process), InvalidState /
    SandboxClosed (the sandbox's state forbids the call), StateLost (a crash destroyed RAM),
    EngineError / GuestError / OperationTimeout from the machine and the agent.
    """

    # -- create ---------------------------------------------------------------------------

    async def create(
        self, options: SandboxOptions | None = None, /, *, tenant: str = "default", **fields: Any
    ) -> SandboxInfo:
        """Fork a new running sandbox from its template's booted snapshot. ``options`` (or
        ``fields``: ``template``, ``name``, ``labels``, ``vcpus``, ... with their bounds and
        defaults) are a :class:`~torpor.sandbox.requests.SandboxOptions`.

        Raises InvalidName / InvalidArgument / TemplateNotFound before anything is made,
        Conflict when ``name`` is taken, EngineError / GuestError when the machine fails (the
        half-made sandbox is then removed and its name freed).
        """
        self._check_open()
        spec = SandboxOptions.of(options, **fields)
        check_name(tenant, "tenant")
        internet = _internet_policy(spec.internet)
        sandbox_id = "sbx-" + secrets.token_hex(6)
        template = spec.template
        self.engine.check_template(template, MachineConfig(template, spec.vcpus, spec.memory_mib))
        self.check_room(tenant, sandboxes=1, memory_mib=spec.memory_mib)
        if self.cluster is not None:  # a draining node sends it elsewhere
            await asyncio.to_thread(self.cluster.accepting)
        now = time.time()
        rec = SandboxRecord(
            id=sandbox_id,
            tenant=tenant,
            name=spec.name or sandbox_id,
            template=template,
            state=S.CREATING,
            labels=dict(spec.labels or {}),
            vcpus=spec.vcpus,
            memory_mib=spec.memory_mib,
            idle_pause_seconds=spec.idle_pause_seconds,
            pause_retention_days=spec.pause_retention_days,
            envs=dict(spec.envs or {}),
            created_at=now,
            last_active_at=now,
            memory_scope=None if spec.memory_scope is None else spec.memory_scope.record(),
        )
        self.registry.insert(rec)
        live = self.live(sandbox_id)
        directory = self.directory(sandbox_id)
        async with live.lock:
            try:
                await self.take(sandbox_id)  # cluster mode: this node runs it
                await self.engine.clone(template, directory, self._config(rec))
                await self._step("create:cloned", sandbox_id)
                await self.boot(rec, live, woken_step="create:woken")
                if internet:
                    await self._connect_internet(rec, live)
            except BaseException as exc:
                await self.abort_create(rec, live, exc)
                await self.give_back(sandbox_id, held=True)
                if isinstance(exc, Exception) and not isinstance(exc, TorporError):
                    raise wrap_error(exc, "create", sandbox_id) from exc
                raise
            rec = self.move(rec, S.RUNNING, "created", last_active_at=time.time())
        log.info("created sandbox %s (%s) from %s", sandbox_id, rec.name, template)
        return rec.to_info().model_copy(update={"internet": internet})

    async def _connect_internet(self, rec: SandboxRecord, live: Any) -> None:
        """Plug a network card into the new machine and bring it up in the guest. Raises
        InvalidArgument (an engine without networks), EngineError, GuestError."""
        machine, channel = live.machine, live.channel
        if machine is None or channel is None or not hasattr(machine, "attach_nic"):
            raise InvalidArgument("this sandbox engine cannot give sandboxes a network")
        await machine.attach_nic()
        up = await channel.run_command(NETWORK_UP, timeout=60)
        if up.exit_code != 0:
            raise GuestError(
                f"the guest could not bring its network up: {(up.stderr or up.stdout).strip()}",
                sandbox_id=rec.id,
            )

    def _has_internet(self, sandbox_id: str) -> bool | None:
        """Whether the sandbox's machine has a network card (None: no machine.json)."""
        try:
            return has_nic(read_machine_json(self.directory(sandbox_id)))
        except TorporError:
            return None

    async def get_or_create(
        self,
        name: str,
        options: SandboxOptions | None = None,
        /,
        *,
        tenant: str = "default",
        selector: Mapping[str, str] | None = None,
        **fields: Any,
    ) -> SandboxInfo:
        """The tenant's live sandbox called ``name`` (woken if paused; ``reused=True``), else a
        new one made with ``options`` / ``fields`` (as :meth:`create`). N concurrent callers
        get one sandbox.

        ``selector``: a caller that may only touch sandboxes with these labels (a restricted
        token). An existing sandbox without them is refused with AccessDenied (nothing
        changed, not woken), checked under the name's lock so no concurrent get-or-create
        can slip another's sandbox in between; give the selector's labels in ``options`` too
        so a new sandbox carries them.

        Options given for an existing sandbox are applied where they can change (labels are
        updated with the given ones; idle pause and pause retention replaced) and refused where
        they cannot: a different ``template``, ``vcpus`` or ``memory_mib`` is a Conflict naming
        the field (the machine is what it is; nothing is changed then), and so is another
        ``memory_scope`` (the same scope bound with other ``grants`` is the same: the binding
        keeps its own). Raises like
        :meth:`create` (bad options even when the sandbox exists; InvalidArgument when they
        name another sandbox); a sandbox in ``error`` is returned as is (its calls raise
        StateLost)."""
        check_name(name, "sandbox name")
        spec = SandboxOptions.of(options, **fields).named(name)
        lock = self._name_locks.setdefault((tenant, name), asyncio.Lock())
        async with lock:
            rec = self.registry.live_by_name(tenant, name)
            if rec is None:
                try:
                    return await self.create(spec, tenant=tenant)
                except Conflict:  # another process created it between our look and insert
                    rec = self.registry.live_by_name(tenant, name)
                    if rec is None:
                        raise
            if selector and any(rec.labels.get(k) != v for k, v in selector.items()):
                raise AccessDenied(
                    f"sandbox {name!r} belongs to another: its labels are outside {dict(selector)}",
                    tenant=tenant,
                    scope=f"sandbox:{name}",
                )
            rec = self._apply_options(rec, spec)
            if rec.state in (S.PAUSED, S.RUNNING):
                info = await self.resume(rec.id, tenant=tenant)
                return info.model_copy(update={"reused": True})
            return rec.to_info(reused=True)

    def _apply_options(self, rec: SandboxRecord, spec: SandboxOptions) -> SandboxRecord:
        """Bring an existing sandbox in line with the options a get-or-create gave (see
        :meth:`get_or_create`); returns the fresh row. Raises Conflict for a fixed field."""
        given = spec.model_fields_set
        for field in ("template", "vcpus", "memory_mib"):
            if field in given and getattr(spec, field) != getattr(rec, field):
                raise Conflict(
                    f"sandbox {rec.name!r} exists with {field}={getattr(rec, field)!r}, not "
                    f"{getattr(spec, field)!r}; that cannot change on a live machine (kill it, "
                    "or fork it into a new one)",
                    sandbox_id=rec.id,
                    field=field,
                )
        # the scope itself (levels, read_only) is fixed at create; its ``grants`` are the rights
        # of whoever bound it (a restricted token's own), kept with the binding: another
        # caller's naming the same scope reuses it
        wanted_scope = None if spec.memory_scope is None else _scope_of(spec.memory_scope.record())
        had = self._has_internet(rec.id)
        if "internet" in given and had is not None and bool(spec.internet) != had:
            raise Conflict(
                f"sandbox {rec.name!r} exists with internet={had}, not {spec.internet}; it is "
                "fixed at create (kill it and create it again)",
                sandbox_id=rec.id,
                field="internet",
            )
        had_scope = None if rec.memory_scope is None else _scope_of(rec.memory_scope)
        if "memory_scope" in given and wanted_scope != had_scope:
            raise Conflict(
                f"sandbox {rec.name!r} exists with memory_scope={had_scope!r}, not "
                f"{wanted_scope!r}; it is fixed at create (fork it with another scope)",
                sandbox_id=rec.id,
                field="memory_scope",
            )
        changes: dict[str, Any] = {}
        if "labels" in given and spec.labels:
            changes["labels"] = {**rec.labels, **spec.labels}
        if "idle_pause_seconds" in given:
            changes["idle_pause_seconds"] = spec.idle_pause_seconds
        if "pause_retention_days" in given:
            changes["pause_retention_days"] = spec.pause_retention_days
        if "envs" in given and spec.envs != rec.envs:
            changes["envs"] = spec.envs or {}
            self.live(rec.id).envs_sent = False  # the interpreter gets the new ones
        if changes:
            self.registry.update_settings(rec.id, **changes)
            log.info("sandbox %s: options updated: %s", rec.id, sorted(changes))
            rec = self.registry.get(rec.id)
        return rec

    async def set_retention(
        self, id_or_name: str, days: int, *, tenant: str = "default"
    ) -> SandboxInfo:
        """Keep the sandbox's pauses ``days`` days (1-365), counted from when it was paused:
        a paused sandbox's ``expires_at`` moves at once (GC deletes it then, unless woken),
        a running one's applies to its next pause. Raises InvalidArgument (days),
        SandboxNotFound, SandboxClosed (killed)."""
        check_retention(days, what="pause_retention_days")
        rec = self._find(tenant, id_or_name)
        async with self.live(rec.id).lock:  # not while a pause or wake is changing it
            rec = self.registry.get(rec.id)
            if rec.state is S.STOPPED:
                raise SandboxClosed(
                    f"sandbox {rec.id} was killed; it has no retention to change",
                    sandbox_id=rec.id,
                    state=rec.state.value,
                    required=[s.value for s in S if s is not S.STOPPED],
                )
            self.registry.update_settings(rec.id, pause_retention_days=days)
        log.info("sandbox %s: pause retention set to %d days", rec.id, days)
        return self.registry.get(rec.id).to_info()

    # -- queries --------------------------------------------------------------------------

    async def get(self, id_or_name: str, *, tenant: str = "default") -> SandboxInfo:
        """A sandbox by id or name (killed ones too), with the disk it owns measured. Raises
        SandboxNotFound."""
        return self._measured(self._find(tenant, id_or_name))

    def _measured(self, rec: SandboxRecord) -> SandboxInfo:
        """``rec``'s info with ``owned_bytes``: the blocks its directory holds (RAM file,
        saved state, disk overlay); the template's base image is shared, so not counted."""
        info = rec.to_info()
        directory = self.directory(rec.id)
        total = 0
        with suppress(OSError):
            for path in directory.rglob("*"):
                with suppress(OSError):  # a file removed while counting
                    if path.is_file() and not path.is_symlink():
                        total += path.stat().st_blocks * 512
        return info.model_copy(
            update={"owned_bytes": total, "internet": self._has_internet(rec.id)}
        )

    async def update(
        self,
        id_or_name: str,
        settings: SandboxSettings | None = None,
        /,
        *,
        tenant: str = "default",
        **fields: Any,
    ) -> SandboxInfo:
        """Change what may change on a sandbox that is not killed: its labels (replaced) and
        idle pause (``0``: never); ``settings`` or ``fields`` are a
        :class:`~torpor.sandbox.requests.SandboxSettings`, fields left out stay. The new idle
        pause counts from the last call, so a sandbox idle for longer pauses at the next sweep.

        Raises InvalidArgument (a bad value, nothing changed), SandboxNotFound, SandboxClosed
        (killed)."""
        spec = SandboxSettings.of(settings, **fields)
        rec = self._find(tenant, id_or_name)
        require(rec.id, rec.state, {s for s in S if s is not S.STOPPED})
        changes: dict[str, Any] = {}
        if spec.labels is not None:
            changes["labels"] = spec.labels
        if spec.idle_pause_seconds is not None:
            changes["idle_pause_seconds"] = spec.idle_pause_seconds or None
        if changes:
            self.registry.update_settings(rec.id, **changes)
            log.info("sandbox %s: settings changed: %s", rec.id, sorted(changes))
        return self._measured(self.registry.get(rec.id))

    async def logs(self, id_or_name: str, *, tenant: str = "default", lines: int = 100) -> str:
        """The last ``lines`` lines of the sandbox's guest console (boot messages, kernel
        warnings, what the guest wrote to its console); read from disk, so a paused sandbox is
        not woken. Empty for a killed one. Raises SandboxNotFound."""
        rec = self._find(tenant, id_or_name)
        return log_tail(self.directory(rec.id) / "console.log", lines, max_bytes=1 << 20)

    def events_mark(self) -> int:
        """A number that changes whenever a transition is recorded (followers of
        :meth:`events` check it before they query)."""
        return self.registry.generation

    async def events(
        self,
        *,
        tenant: str = "default",
        after: int = 0,
        sandbox: str | None = None,
        limit: int = 500,
    ) -> tuple[builtins.list[SandboxEvent], int]:
        """The tenant's lifecycle events after ``seq`` ``after`` (only those of the sandbox
        id or name ``sandbox`` if given) and the ``seq`` to continue from; see
        :meth:`Registry.events <torpor.sandbox.registry.Registry.events>`. Raises
        SandboxNotFound for an unknown ``sandbox``."""
        sandbox_id = None if sandbox is None else self._find(tenant, sandbox).id
        return self.registry.events(tenant, after=after, sandbox=sandbox_id, limit=limit)

    async def list(
        self,
        labels: Mapping[str, str] | None = None,
        *,
        tenant: str = "default",
        include_stopped: bool = False,
    ) -> builtins.list[SandboxInfo]:
        """The tenant's sandboxes whose labels include all of ``labels``, oldest first."""
        states: set[S] | None = None if include_stopped else {s for s in S if s is not S.STOPPED}
        return [
            self._measured(r)
            for r in self.registry.list(tenant=tenant, labels=labels, states=states)
        ]

    def transitions(self, sandbox_id: str) -> builtins.list[tuple[str | None, str]]:
        """The recorded (from, to) state pairs of a sandbox, in order."""
        return [
            (t.src.value if t.src else None, t.dst.value)
            for t in self.registry.transitions(sandbox_id)
        ]

    # -- pause / wake / kill --------------------------------------------------------------

    async def pause(self, id_or_name: str, *, tenant: str = "default") -> SandboxInfo:
        """Hibernate a running sandbox to disk (waits for in-flight calls; idempotent when
        already paused). Raises SandboxClosed, InvalidState, StateLost, EngineError."""
        async with self._held(tenant, id_or_name, "pause") as (rec, live):
            if rec.state is S.RUNNING:
                await self.drain(live)
                rec = await self.pause_held(rec, live, "pause")
        return rec.to_info()

    async def resume(self, id_or_name: str, *, tenant: str = "default") -> SandboxInfo:
        """Wake a paused sandbox (idempotent when running). Raises SandboxClosed, InvalidState,
        StateLost (state gone), EngineError (wake failed, the sandbox stays paused)."""
        async with self._held(tenant, id_or_name, "resume") as (rec, live):
            if rec.state is S.PAUSED:
                rec = await self.wake_held(rec, live, "resume")
        return rec.to_info()

    async def kill(
        self, id_or_name: str, *, tenant: str = "default", reason: str = "kill"
    ) -> SandboxInfo:
        """Stop a sandbox for good and delete its files (idempotent). In-flight calls fail with
        GuestError. ``reason`` is recorded (``"expired"``: retention ran out). Raises
        SandboxNotFound."""
        rec = self._find(tenant, id_or_name)
        if rec.state is not S.STOPPED:  # cluster mode: Conflict when another node runs it
            await self.take(rec.id, place=False)  # (a paused one is killed where asked)
        live = self.live(rec.id)
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
                cpu = self.cpu_reading(rec.id)  # before the machine goes: usage meters it
                await self._quiet_kill(live, directory)
                rec = self.move(rec, S.STOPPED, reason, cpu_reading=cpu)
                await asyncio.to_thread(shutil.rmtree, directory, True)
        await self.forwards.close_sandbox(rec.id)
        await self.give_back(rec.id)
        # a killed sandbox needs no lock any more: every later call reads "stopped" and fails
        self._lives.pop(rec.id, None)
        return rec.to_info()

    # -- idle pause, start, close ---------------------------------------------------------

    async def idle_sweep(self, now: float | None = None) -> builtins.list[str]:
        """Pause every running sandbox idle for at least its ``idle_pause_seconds`` and with
        no call in flight (in a cluster, that this node holds). Returns the ids paused; a
        failure is logged, not raised."""
        now = time.time() if now is None else now
        paused: builtins.list[str] = []
        for rec in self.registry.list(states={S.RUNNING}):
            if rec.idle_pause_seconds is None or rec.id not in self._lives:
                continue
            if now - rec.last_active_at < rec.idle_pause_seconds:
                continue
            live = self._lives[rec.id]
            if live.busy or live.lock.locked() or (self.cluster and live.machine is None):
                continue  # (in a cluster, a machine this node does not run is not its own)
            try:
                async with live.lock:
                    rec = self.registry.get(rec.id)  # re-check: a call may have just come in
                    if (
                        rec.state is S.RUNNING
                        and live.busy == 0
                        and now - rec.last_active_at >= (rec.idle_pause_seconds or 0)
                    ):
                        # in a cluster, still this node's: a node cut off past its lease
                        # may run a stale copy of a sandbox another node took over (Conflict)
                        await self.take(rec.id, place=False)
                        await self.pause_held(rec, live, "idle")
                        paused.append(rec.id)
            except TorporError as exc:
                log.warning("idle pause of %s failed: %s", rec.id, exc)
        return paused

    async def compact_sweep(
        self, now: float | None = None, *, limit: int = 1
    ) -> builtins.list[CompactionReport]:
        """Compact (see :mod:`torpor.sandbox.storage.compaction`) up to ``limit`` sandboxes
        paused for at least ``compact_after_seconds`` — or any paused one, longest first, when
        the disk is below :data:`LOW_DISK_FRACTION` free. In cluster mode only sandboxes whose
        pause is durable, by dropping their local files (:mod:`.compacting`). Returns what was
        done; a failure is logged, not raised (the sandbox stays paused with its files)."""
        now = time.time() if now is None else now
        usage = shutil.disk_usage(self.paths.sandboxes)
        low_disk = usage.free < usage.total * LOW_DISK_FRACTION
        if self.cluster is not None:
            return await cluster_compact_sweep(self, now, low_disk=low_disk, limit=limit)
        after = self.compact_after_seconds
        if after is None and not low_disk:
            return []
        candidates = [
            r
            for r in self.registry.list(states={S.PAUSED})
            if not is_compacted(self.directory(r.id))
        ]

        async def compact_one(rec: SandboxRecord) -> CompactionReport | None:
            rec = self.registry.get(rec.id)
            if rec.state is not S.PAUSED:
                return None
            template_ram = self.paths.templates / rec.template / "snapshot" / "ram"
            directory = self.directory(rec.id)

            def run() -> CompactionReport:
                # its chunks are named by no manifest until compacted.json is durable: a GC
                # sweep (POST /v1/gc, `torpor gc`) waits for the store's lock meanwhile
                with store_lock(self.paths):
                    return compact(directory, self.chunk_store, template_ram)

            return await asyncio.to_thread(run)

        return await sweep_due(
            self, candidates, now, low_disk=low_disk, limit=limit, one=compact_one
        )

    async def supervise(self, interval: float = 1.0) -> None:
        """Run :meth:`idle_sweep` (and :meth:`compact_sweep`) every ``interval`` seconds until
        cancelled."""
        last_compact = 0.0
        while True:
            try:
                await self.idle_sweep()
                self.trim_logs()
                # a cluster node asks PostgreSQL which of its sandboxes qualify: not every tick
                due = time.monotonic() - last_compact >= CLUSTER_COMPACT_SECONDS
                if self.cluster is None or due:
                    last_compact = time.monotonic()
                    await self.compact_sweep()
            except Exception:  # keep supervising; a bad sweep must not end idle pausing
                log.exception("idle sweep failed")
            await asyncio.sleep(interval)

    def trim_logs(self) -> None:
        """Keep each running machine's logs within their bound (a guest can print gigabytes
        of console a day; its directory must not grow with them)."""
        for sandbox_id, live in builtins.list(self._lives.items()):
            if live.machine is not None:
                self.engine.trim_logs(self.directory(sandbox_id))

    async def start(self, *, supervise: bool = True, interval: float = 1.0) -> None:
        """Reconcile the registry with the sandbox directories after a (re)start, then start
        the idle supervisor. Paused sandboxes stay paused; running ones whose QEMU is alive
        are re-attached; half-done pauses and wakes are resolved (see ``recovery``).

        Raises CorruptData, and starts nothing, when sandbox directories have no registry
        row: the registry was deleted or truncated, and starting would orphan them (``torpor
        doctor --repair`` rebuilds the rows; see :mod:`torpor.sandbox.registry.repair`)."""
        self._check_open()
        relocate(self.paths)  # a copied or moved home points its stored paths at itself
        if self.cluster is not None:
            await self._start_node()
        else:
            await self._start_alone()
        if supervise and self._supervisor is None:
            self._supervisor = asyncio.get_running_loop().create_task(
                self.supervise(interval), name="torpor-idle-supervisor"
            )

    async def _start_alone(self) -> None:
        assert isinstance(self.registry, Registry)  # a manager without a cluster has SQLite's
        lost = orphans(self.paths, self.registry)
        if lost:
            raise CorruptData(
                f"the registry ({self.paths.registry}) has no row for {len(lost)} sandbox "
                f"director{'y' if len(lost) == 1 else 'ies'} ({', '.join(d.name for d in lost[:5])}"
                f"{' ...' if len(lost) > 5 else ''}): it was deleted or truncated. Nothing was "
                "started or changed; run `torpor doctor --repair` to rebuild it from the "
                "directories",
                path=str(self.paths.registry),
                orphans=[d.name for d in lost],
            )
        for rec in self.registry.list():
            try:
                await self._reconcile(rec)
            except Exception:  # one broken sandbox must not keep the others from starting
                log.exception("reconciling sandbox %s failed", rec.id)

    async def close(self, *, pause: bool = True) -> None:
        """Stop the supervisor; pause running sandboxes (``pause=True``) so no QEMU outlives
        the manager, else just drop the channels; close the registry. Idempotent."""
        if self._closed:
            return
        await self.forwards.close_all()
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
            if live.machine is not None:  # still running (not paused): let the next attach
                with suppress(Exception):
                    await live.machine.release()
        # the QEMUs of those pauses, still exiting or lingering: none outlives this manager
        await settle_all(self.paths.sandboxes)
        if self.cluster is not None:  # the pauses just made: durable before the node goes
            await self.cluster.wait_pushes(CLOSE_PUSH_SECONDS)
            await self.cluster.close()
        self._closed = True
        self.registry.close()
