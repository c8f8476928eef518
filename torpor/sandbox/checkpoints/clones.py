"""Cloning children from a frozen sandbox: the machinery under fork and restore.

A frozen dir (see :func:`~torpor.sandbox.storage.snapshots.freeze`) holds a hibernated machine: RAM,
device state and a disk layer. :class:`Cloner` turns it into ``count`` new sandboxes in two
phases, so a fork can clone while its source is still paused and wake the children alongside
it: :meth:`~Cloner.prepare` makes the registry rows and machine dirs,
:meth:`~Cloner.wake_children` wakes them (fresh entropy and clock) and mounts the drives
they inherit. Both are all or none. :meth:`~Cloner.start_pending` starts the children
before their RAM is whole (a fork of a running source, a clone of a cached snapshot): each
QEMU starts while the RAM is written and loads once its own copy is done (:class:`Pending`).
A component of
:class:`~torpor.sandbox.checkpoints.Checkpoints`, working on the manager through
:class:`~torpor.sandbox.manager.Held` only.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torpor.errors import DriveNotFound, EngineError, TorporError
from torpor.sandbox.manager import Held
from torpor.sandbox.manager.core import Live
from torpor.sandbox.models import SandboxInfo
from torpor.sandbox.models import SandboxState as S
from torpor.sandbox.registry import SandboxRecord
from torpor.sandbox.storage.captures import drop_ram
from torpor.sandbox.storage.drives import DriveInfo, DriveStore, mount_in_guest
from torpor.sandbox.storage.volumes import Attachment
from torpor.sandbox.vm.disk import virtual_size

__all__ = ["COPIES_AT_ONCE", "Children", "Cloner", "Pending", "drop_ram"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Children:
    """The sandboxes one clone makes: how many, their names (None: their ids) and labels,
    their pause settings, their tenant, and the reason their registry rows record."""

    count: int
    labels: Mapping[str, str] | None
    names: list[str] | None
    idle_pause_seconds: int | None
    pause_retention_days: int
    tenant: str
    reason: str
    #: the memory scope the children reach from inside (a fork: the source's unless given)
    memory_scope: dict[str, Any] | None = None
    #: environment variables of the children's commands (a fork's are its source's)
    envs: Mapping[str, str] | None = None


#: how many RAM copies into pending children run at once (each child loads as soon as its
#: own copy is done: fewer at once lets the first ones start sooner on a small host)
COPIES_AT_ONCE = 2


@dataclass
class Pending:
    """Children started before their RAM is whole (:meth:`Cloner.start_pending`): each QEMU
    starts (it only maps its RAM file) while the RAM is written, and loads its state once its
    own RAM and state are there."""

    records: list[SandboxRecord]
    directories: list[Path]
    #: per child, set once its RAM and state are whole (None: a child whole already)
    ready: list[asyncio.Future[None] | None]
    #: their wake (all or none: on failure every child is removed), the children it made
    woken: asyncio.Future[list[SandboxInfo]]
    #: the last child's RAM file is the frozen RAM itself (a live fork's, filled by the stop)
    linked: bool = False
    #: per child that waits for its RAM: set once its QEMU runs and waits for it
    waiting: list[asyncio.Future[None]] = field(default_factory=list)

    async def started(self) -> None:
        """Wait until every child's QEMU runs and waits for its RAM, or their wake ended (it
        failed: :meth:`abandon` and the wake say why)."""
        while not self.woken.done() and not all(f.done() for f in self.waiting):
            waits: list[asyncio.Future[Any]] = [f for f in self.waiting if not f.done()]
            await asyncio.wait([*waits, self.woken], return_when=asyncio.FIRST_COMPLETED)

    def release(self, state: Path) -> None:
        """Called inside a live source's stop once the frozen RAM and the device state (the
        file ``state``) are whole: link the state into every child's directory. A lone child
        (whose RAM is the frozen one) loads it at once, while the source resumes; the
        children of a fork of more wait for :meth:`fill`. Raises EngineError (the freeze then
        fails and the children are abandoned)."""
        from torpor.sandbox.vm.machine_dir import link_state

        for directory in self.directories:
            link_state(state, directory)
        if len(self.directories) == 1:
            self._go(0)

    async def fill(self, ram: Path, state: Path | None = None) -> None:
        """Copy ``ram`` in place into each child's own RAM file (with ``state``, then a copy
        of it), :data:`COPIES_AT_ONCE` at a time, each child loading as soon as its own is
        whole; then the :attr:`linked` child, whose RAM is ``ram`` itself, once nothing reads
        it any more. Never raises: a failure fails every child still waiting (their wake then
        removes them all and raises it)."""
        from torpor.sandbox.vm.machine_dir import fill_pending

        last = len(self.ready) - 1
        own = [
            i for i, f in enumerate(self.ready) if f is not None and not (self.linked and i == last)
        ]
        gate = asyncio.Semaphore(COPIES_AT_ONCE)
        failed: list[BaseException] = []

        async def one(i: int) -> None:
            async with gate:
                if failed:
                    return
                try:
                    await asyncio.to_thread(fill_pending, ram, self.directories[i], state)
                except Exception as exc:
                    failed.append(exc)
                    return
            self._go(i)

        try:  # every copy ends before anything else: no thread is left writing a removed file
            await asyncio.gather(*(one(i) for i in own), return_exceptions=True)
        except BaseException:  # cancelled: the children must not wait for ever
            self._fail(EngineError("cloning was cancelled"))
            raise
        if failed:
            self._fail(failed[0])
        elif self.linked:
            self._go(last)

    async def abandon(self, why: str, *, wait: bool = True) -> list[SandboxInfo]:
        """The freeze failed: the children's wake fails (it removes them) unless they were
        all released already; ``wait`` for it. Returns the children made anyway (released
        before the failure: the caller removes them)."""
        self._fail(EngineError(f"the fork's source was not frozen: {why}"))
        if not wait:
            return []
        await asyncio.wait([self.woken])
        if self.woken.cancelled() or self.woken.exception() is not None:
            return []  # retrieved: the freeze's failure is what is raised
        return self.woken.result()

    def _go(self, i: int) -> None:
        f = self.ready[i]
        if f is not None and not f.done():
            f.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        for f in self.ready:
            if f is not None and not f.done():
                f.set_exception(exc)


class _Gate:
    """What a pending child's wake awaits for its RAM: notes that its QEMU waits (the first
    time it is awaited), then waits for ``ready``."""

    def __init__(self, ready: asyncio.Future[None], waiting: asyncio.Future[None]) -> None:
        self.ready, self.waiting = ready, waiting

    def __await__(self) -> Generator[Any, None, None]:
        if not self.waiting.done():
            self.waiting.set_result(None)
        return self.ready.__await__()


class Cloner:
    """Makes sandboxes out of a frozen dir: rows, machine dirs, wakes, inherited drives."""

    def __init__(self, manager: Held, drives: DriveStore) -> None:
        self.manager = manager
        self.drives = drives

    async def spawn(
        self,
        frozen: Path,
        children: Children,
        *,
        drives_of: str | None,
        recorded_drives: list[dict[str, Any]] | None = None,
        take_ram: bool = False,
        spare: Callable[[Path], bool] | None = None,
    ) -> list[SandboxInfo]:
        """Clone, wake and refresh ``children`` from a frozen dir; all or none. ``take_ram``:
        the frozen RAM is the caller's own (dropped after), the last child takes it (see
        :meth:`prepare`). Else ``frozen`` is a cached, read-only one: the children's QEMUs
        start while their RAM is copied (:meth:`start_pending`, then :meth:`Pending.fill`),
        and ``spare(path)`` may move a ready clone into the last one's directory."""
        drives = self.drives_for(frozen, drives_of, recorded_drives)
        if take_ram:
            recs = await self.prepare(frozen, children, take_ram=True)
            return await self.wake_children(recs, drives, reason=children.reason)
        size = await asyncio.to_thread(virtual_size, frozen / "disk.qcow2")
        pending = await self.start_pending(frozen, children, size, drives=drives, spare=spare)
        await pending.fill(frozen / "ram", frozen / "state")
        return await pending.woken

    async def prepare(
        self,
        frozen: Path,
        children: Children,
        *,
        take_ram: bool = False,
    ) -> list[SandboxRecord]:
        """Registry rows (``creating``) and hibernated machine dirs cloned from ``frozen`` for
        ``children``. ``take_ram``: the caller drops the frozen RAM afterwards, so the last
        child may take it (when it has no other name). All or none: on failure every row and
        dir made here is removed."""
        from torpor.sandbox.vm.machine import clone_machine_dir

        m = self.manager
        recs: list[SandboxRecord] = []
        try:
            self._insert_rows(frozen, children, recs)
            await self._hold(recs)
            # the last child takes the frozen RAM itself when no one else has a name for it
            # (a live freeze's or a restore's copy; the caller drops it after): one copy fewer
            own = (frozen / "ram").stat().st_nlink == 1 and take_ram
            copies = [
                asyncio.to_thread(clone_machine_dir, frozen, m.directory(r.id)) for r in recs[:-1]
            ]
            last = m.directory(recs[-1].id)
            await asyncio.gather(
                *copies, asyncio.to_thread(clone_machine_dir, frozen, last, take_ram=own)
            )
        except BaseException as exc:
            await self._abort(recs, exc)
            raise
        return recs

    async def _hold(self, recs: list[SandboxRecord]) -> None:
        """Cluster mode: hold the new children's leases, this node's before any of them runs
        here (unheld, another node asked for one would take it, find no machine and mark it
        lost). Raises StorageError."""
        for rec in recs:
            await self.manager.take(rec.id, place=False)

    async def _abort(self, recs: list[SandboxRecord], exc: BaseException) -> None:
        """Remove the children made so far and give their leases back."""
        for rec in recs:
            await self.manager.abort_create(rec, self.manager.live(rec.id), exc)
            await self.manager.give_back(rec.id, held=True)

    def _insert_rows(self, frozen: Path, children: Children, recs: list[SandboxRecord]) -> None:
        """Check the quota and insert ``children``'s registry rows (``creating``, shaped as
        the machine in ``frozen``) in one transaction (one sync for all, before any QEMU
        starts), then append them to ``recs`` (the caller removes them on a later failure).
        Raises Conflict (a name taken: no row is left), InvalidArgument (quota)."""
        m = self.manager
        config = json.loads((frozen / "machine.json").read_text())
        memory = int(config.get("memory_mib", 512))
        m.check_room(children.tenant, sandboxes=children.count, memory_mib=children.count * memory)
        made: list[SandboxRecord] = []
        for i in range(children.count):  # registry rows first: a taken name fails first
            sid = "sbx-" + secrets.token_hex(6)
            now = time.time()
            rec = SandboxRecord(
                id=sid,
                tenant=children.tenant,
                name=children.names[i] if children.names else sid,
                template=str(config.get("template", "python")),
                state=S.CREATING,
                labels=dict(children.labels or {}),
                vcpus=int(config.get("vcpus", 1)),
                memory_mib=memory,
                idle_pause_seconds=children.idle_pause_seconds,
                pause_retention_days=children.pause_retention_days,
                envs=dict(children.envs or {}),
                created_at=now,
                last_active_at=now,
                memory_scope=children.memory_scope,
            )
            made.append(rec)
        m.registry.insert_many(made, reason=children.reason)
        recs.extend(made)

    async def start_pending(
        self,
        frozen: Path,
        children: Children,
        size: int,
        *,
        linked: bool = False,
        drives: list[tuple[DriveInfo, str, bool]] | None = None,
        spare: Callable[[Path], bool] | None = None,
    ) -> Pending:
        """Start ``children`` before their RAM is whole: their rows, directories from the
        frozen dir (:func:`~torpor.sandbox.vm.machine_dir.clone_pending`; ``size``: the
        disk's) and their wake, which starts each QEMU and then waits for its RAM and state
        (:meth:`Pending.release`, :meth:`Pending.fill`). ``linked``: ``frozen`` is being
        frozen from a running source (``ram.tmp``, filled by its stop), which the last child
        takes as its RAM; every other child has a RAM file of its own. ``spare(path)``: moves
        a ready clone into the last child's directory if there is one (True; that child needs
        nothing more). All or none: on failure nothing is left. Raises as :meth:`prepare`."""
        from torpor.sandbox.vm.machine_dir import clone_pending

        m = self.manager
        recs: list[SandboxRecord] = []
        loop = asyncio.get_running_loop()
        ready: list[asyncio.Future[None] | None] = []
        try:
            self._insert_rows(frozen, children, recs)
            await self._hold(recs)
            dirs = [m.directory(r.id) for r in recs]

            def make() -> None:
                last = len(dirs) - 1
                for i, d in enumerate(dirs):
                    if i == last and spare is not None and spare(d):
                        ready.append(None)
                        continue
                    clone_pending(frozen, d, size=size, own_ram=not (linked and i == last))
                    ready.append(loop.create_future())

            await asyncio.to_thread(make)
        except BaseException as exc:
            await self._abort(recs, exc)
            raise
        waiting = [loop.create_future() for f in ready if f is not None]
        gates = iter(waiting)
        task = asyncio.ensure_future(
            self.wake_children(
                recs,
                drives or [],
                reason=children.reason,
                ram_ready=[None if f is None else _Gate(f, next(gates)) for f in ready],
            )
        )
        return Pending(recs, dirs, ready, task, linked=linked, waiting=waiting)

    async def wake_children(
        self,
        recs: list[SandboxRecord],
        drives: list[tuple[DriveInfo, str, bool]],
        *,
        reason: str,
        ram_ready: Sequence[Awaitable[object] | None] | None = None,
    ) -> list[SandboxInfo]:
        """Wake the prepared children concurrently, refresh their randomness and clock, mount
        their drives, then move them all to ``running`` in one registry commit. All or none:
        until that commit every child is ``creating`` (a crash before it undoes them all), and
        on a failure every child is removed. ``ram_ready``: per child, None or what is awaited
        for its RAM and state, still being written (:meth:`start_pending`)."""
        m = self.manager
        lives = [m.live(rec.id) for rec in recs]

        async def one(rec: SandboxRecord, live: Live, ready: Awaitable[object] | None) -> None:
            await m.boot(rec, live, ram_ready=ready, cold=True)
            for drive, path, ro in drives:
                # in a thread: a drive's delete holds the drives' lock while it removes its files
                await asyncio.to_thread(
                    functools.partial(
                        self.drives.attach,
                        drive.id,
                        rec.id,
                        path,
                        read_only=ro,
                        tenant=drive.tenant,
                    )
                )
                await mount_in_guest(live.channel, drive, path, ro)

        # every child's lock is held until its row says running (or it is removed)
        async with contextlib.AsyncExitStack() as held:
            for live in lives:
                await held.enter_async_context(live.lock)
            readies = list(ram_ready) if ram_ready is not None else [None] * len(recs)
            # children wake concurrently (QEMU start-up overlaps); all or none
            try:
                results = await asyncio.gather(
                    *(one(r, lv, w) for r, lv, w in zip(recs, lives, readies, strict=True)),
                    return_exceptions=True,
                )
            except BaseException as exc:  # cancelled: no child is left half made
                results = [exc]
            failed = [r for r in results if isinstance(r, BaseException)]
            if not failed:
                moving = asyncio.ensure_future(
                    m.move_many(recs, S.RUNNING, reason, last_active_at=time.time())
                )
                try:
                    rows = await asyncio.shield(moving)
                except BaseException as exc:
                    # cancelled while the commit runs in its thread: it decides (committed,
                    # the children are whole and running: they stay)
                    await asyncio.wait([moving])
                    if moving.cancelled() or moving.exception() is not None:
                        failed = [exc]
                    else:
                        raise
            if failed:
                await asyncio.to_thread(self.drives.release, {rec.id for rec in recs})
                for rec, live in zip(recs, lives, strict=True):
                    with contextlib.suppress(TorporError):
                        await m.abort_create(rec, live, failed[0])
                    await m.give_back(rec.id, held=True)
                raise failed[0]
        log.info("%s: %d sandbox(es) %s", reason, len(rows), [r.id for r in rows])
        return [r.to_info() for r in rows]

    def drive_records(self, sandbox_id: str) -> list[dict[str, Any]]:
        return [
            {"id": d.id, "tenant": d.tenant, "path": a.path, "read_only": a.read_only}
            for d, a in self.drives.attached_to(sandbox_id)
        ]

    def drives_for(
        self,
        frozen: Path,
        source: str | None,
        recorded: list[dict[str, Any]] | None = None,
    ) -> list[tuple[DriveInfo, str, bool]]:
        """The drives a clone of ``frozen`` must mount, for the 9p devices in its machine.json:
        ``recorded`` (a snapshot's) or else the source's current attachments. Raises
        DriveNotFound if one was deleted."""
        config = json.loads((frozen / "machine.json").read_text())
        shares = [d for d in config.get("devices", []) if d.get("kind") == "share"]
        found: list[tuple[DriveInfo, str, bool]] = []
        attached: dict[str, Any] = {}
        if recorded is not None:
            for r in recorded:
                with contextlib.suppress(DriveNotFound):
                    d = self.drives.get(r["id"], tenant=r["tenant"])
                    attached[d.id] = (
                        d,
                        Attachment(sandbox_id="", path=r["path"], read_only=bool(r["read_only"])),
                    )
        elif source:
            attached = {d.id: (d, a) for d, a in self.drives.attached_to(source)}
        for share in shares:
            if not Path(share["path"]).is_dir():
                raise DriveNotFound(
                    f"drive {share['tag']} that this machine mounts was deleted",
                    kind="drive",
                    name=share["tag"],
                )
            hit = attached.get(share["tag"])
            if hit is not None:
                found.append((hit[0], hit[1].path, hit[1].read_only))
        return found
