"""Cloning children from a frozen sandbox: the machinery under fork and restore.

A frozen dir (see :func:`~torpor.sandbox.storage.snapshots.freeze`) holds a hibernated machine: RAM,
device state and a disk layer. :class:`Cloner` turns it into ``count`` new sandboxes in two
phases, so a fork can clone while its source is still paused and wake the children alongside
it: :meth:`~Cloner.prepare` makes the registry rows and machine dirs,
:meth:`~Cloner.wake_children` wakes them (fresh entropy and clock) and mounts the drives
they inherit. Both are all or none. A component of
:class:`~torpor.sandbox.checkpoints.Checkpoints`, working on the manager through
:class:`~torpor.sandbox.manager.Held` only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torpor.errors import DriveNotFound, EngineError, TorporError
from torpor.sandbox.manager import Held
from torpor.sandbox.models import SandboxInfo
from torpor.sandbox.models import SandboxState as S
from torpor.sandbox.registry import SandboxRecord
from torpor.sandbox.storage.captures import drop_ram
from torpor.sandbox.storage.drives import DriveInfo, DriveStore, mount_in_guest
from torpor.sandbox.storage.volumes import Attachment

__all__ = ["Children", "Cloner", "PendingChild", "drop_ram"]

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


@dataclass
class PendingChild:
    """A fork's child started before its source stopped (:meth:`Cloner.start_pending`): its
    QEMU starts while the source's stop fills its RAM; it loads its state once
    :meth:`released <release>`."""

    record: SandboxRecord
    directory: Path
    ready: asyncio.Future[None]
    #: its wake (all or none: on failure the child is removed), the children it made
    woken: asyncio.Future[list[SandboxInfo]]

    def release(self, state: Path) -> None:
        """Called inside the source's stop once its RAM (the child's, filled in place) and
        its device state (the file ``state``) are whole: link the state into the child's
        directory and let its wake load it and run, while the source resumes. Raises
        EngineError (the freeze then fails and the child is abandoned)."""
        from torpor.sandbox.vm.machine_dir import link_state

        link_state(state, self.directory)
        if not self.ready.done():
            self.ready.set_result(None)

    async def abandon(self, why: str, *, wait: bool = True) -> list[SandboxInfo]:
        """The freeze failed: the child's wake fails (it removes the child) unless it was
        released already; ``wait`` for it. Returns the children made anyway (released
        before the failure: the caller removes them)."""
        if not self.ready.done():
            self.ready.set_exception(EngineError(f"the fork's source was not frozen: {why}"))
        if not wait:
            return []
        await asyncio.wait([self.woken])
        if self.woken.cancelled() or self.woken.exception() is not None:
            return []  # retrieved: the freeze's failure is what is raised
        return self.woken.result()


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
        """Clone, wake and refresh ``children`` from a frozen dir; all or none (``take_ram``,
        ``spare``: as for :meth:`prepare`)."""
        drives = self.drives_for(frozen, drives_of, recorded_drives)
        recs = await self.prepare(frozen, children, take_ram=take_ram, spare=spare)
        return await self.wake_children(
            recs, drives, tenant=children.tenant, reason=children.reason
        )

    async def prepare(
        self,
        frozen: Path,
        children: Children,
        *,
        take_ram: bool = False,
        spare: Callable[[Path], bool] | None = None,
    ) -> list[SandboxRecord]:
        """Registry rows (``creating``) and hibernated machine dirs cloned from ``frozen`` for
        ``children``. ``take_ram``: the caller drops the frozen RAM afterwards, so the last
        child may take it (when it has no other name). ``spare(path)``: moves a ready clone
        of ``frozen`` (a cached snapshot's spare) to the directory ``path`` if there is one
        (True): the last child's, instead of cloning. All or none: on failure every row and
        dir made here is removed."""
        from torpor.sandbox.vm.machine import clone_machine_dir

        m = self.manager
        recs: list[SandboxRecord] = []
        try:
            self._insert_rows(frozen, children, recs)
            # the last child takes the frozen RAM itself when no one else has a name for it
            # (a live freeze's or a restore's copy; the caller drops it after): one copy fewer
            own = (frozen / "ram").stat().st_nlink == 1 and take_ram
            copies = [
                asyncio.to_thread(clone_machine_dir, frozen, m.directory(r.id)) for r in recs[:-1]
            ]
            last = m.directory(recs[-1].id)
            if not own and spare is not None and await asyncio.to_thread(spare, last):
                await asyncio.gather(*copies)
            else:
                await asyncio.gather(
                    *copies, asyncio.to_thread(clone_machine_dir, frozen, last, take_ram=own)
                )
        except BaseException as exc:
            for rec in recs:
                await m.abort_create(rec, m.live(rec.id), exc)
            raise
        return recs

    def _insert_rows(self, frozen: Path, children: Children, recs: list[SandboxRecord]) -> None:
        """Check the quota and insert ``children``'s registry rows (``creating``, shaped as
        the machine in ``frozen``), appending each to ``recs`` (the caller removes them on
        failure). Raises Conflict (a name taken), InvalidArgument (quota)."""
        m = self.manager
        config = json.loads((frozen / "machine.json").read_text())
        memory = int(config.get("memory_mib", 512))
        m.check_room(children.tenant, sandboxes=children.count, memory_mib=children.count * memory)
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
            m.registry.insert(rec, reason=children.reason)
            recs.append(rec)

    async def start_pending(self, frozen: Path, children: Children, size: int) -> PendingChild:
        """Start the one child of a fork whose running source is about to stop, before it
        stops: its row, a directory from the frozen dir being made
        (:func:`~torpor.sandbox.vm.machine_dir.clone_pending`; ``size``: the disk's) and its
        wake, which starts QEMU and then waits for :meth:`PendingChild.release`. All or none:
        on failure nothing is left. Raises as :meth:`prepare`."""
        from torpor.sandbox.vm.machine_dir import clone_pending

        m = self.manager
        recs: list[SandboxRecord] = []
        try:
            self._insert_rows(frozen, children, recs)
            await asyncio.to_thread(clone_pending, frozen, m.directory(recs[0].id), size=size)
        except BaseException as exc:
            for rec in recs:
                await m.abort_create(rec, m.live(rec.id), exc)
            raise
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(
            self.wake_children(
                recs, [], tenant=children.tenant, reason=children.reason, ram_ready=ready
            )
        )
        return PendingChild(recs[0], m.directory(recs[0].id), ready, task)

    async def wake_children(
        self,
        recs: list[SandboxRecord],
        drives: list[tuple[DriveInfo, str, bool]],
        *,
        tenant: str,
        reason: str,
        ram_ready: Awaitable[object] | None = None,
    ) -> list[SandboxInfo]:
        """Wake the prepared children concurrently, refresh their randomness and clock, mount
        their drives. All or none. ``ram_ready``: their RAM and state are still being
        written (:meth:`start_pending`)."""
        m = self.manager

        async def one(rec: SandboxRecord) -> SandboxInfo:
            live = m.live(rec.id)
            async with live.lock:
                try:
                    await m.boot(rec, live, ram_ready=ram_ready)
                    for drive, path, ro in drives:
                        self.drives.attach(
                            drive.id, rec.id, path, read_only=ro, tenant=drive.tenant
                        )
                        await mount_in_guest(live.channel, drive, path, ro)
                except BaseException as exc:
                    self.drives.release({rec.id})
                    await m.abort_create(rec, live, exc)
                    raise
                return m.move(rec, S.RUNNING, reason, last_active_at=time.time()).to_info()

        # children wake concurrently (QEMU start-up overlaps); all or none
        results = await asyncio.gather(*(one(r) for r in recs), return_exceptions=True)
        made = [r for r in results if isinstance(r, SandboxInfo)]
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            for child in made:
                with contextlib.suppress(TorporError):
                    await m.kill(child.id, tenant=tenant)
                self.drives.release({child.id})
            raise failed[0]
        log.info("%s: %d sandbox(es) %s", reason, len(made), [c.id for c in made])
        return made

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
