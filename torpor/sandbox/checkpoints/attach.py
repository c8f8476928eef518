"""Attaching volumes and drives to a running sandbox, and keeping drives mounted across a
hibernate.

A volume is hot-plugged as a virtio disk and mounted by the guest agent; a drive is a virtio-9p
share, which QEMU can only add to a hibernated machine and which blocks migration while mounted,
so :class:`Attachments` is also a manager guest hook: it unmounts a sandbox's drives before
every hibernate and mounts them again after the wake (a busy mount is a Conflict). A component
of :class:`~torpor.sandbox.checkpoints.Checkpoints`, working on the manager through
:class:`~torpor.sandbox.manager.Held` only; the stores are
:mod:`torpor.sandbox.storage.volumes` and :mod:`torpor.sandbox.storage.drives`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import shlex
import time
from collections.abc import Callable
from typing import Any

from torpor.errors import Conflict, GuestError, InvalidArgument, InvalidState, TorporError
from torpor.sandbox.engine import Channel, Machine
from torpor.sandbox.manager import Held
from torpor.sandbox.manager.core import Live
from torpor.sandbox.models import SandboxState as S
from torpor.sandbox.registry import SandboxRecord
from torpor.sandbox.requests import CommandSpec, DriveMount, VolumeMount
from torpor.sandbox.storage.drives import DriveInfo, DriveStore, mount_in_guest
from torpor.sandbox.storage.records import RecordStore
from torpor.sandbox.storage.snapshots import step
from torpor.sandbox.storage.volumes import VolumeInfo, VolumeStore, find_guest_disk
from torpor.sandbox.vm.machine_dir import read_machine_json

__all__ = ["Attachments"]

log = logging.getLogger(__name__)


class Attachments:
    """Attaches volumes and drives to running sandboxes; the manager's guest hook for drives."""

    def __init__(self, manager: Held, volumes: VolumeStore, drives: DriveStore) -> None:
        self.manager = manager
        self.volumes = volumes
        self.drives = drives

    # -- drives around a hibernate (the manager calls these: guest_hooks) -----------------

    async def before_pause(self, sandbox_id: str, channel: Any) -> None:
        """Unmount the sandbox's drives (9p blocks migration). Busy -> Conflict."""
        for drive, att in self.drives.attached_to(sandbox_id):
            try:
                await channel.umount(att.path)
            except GuestError as exc:
                if "not mounted" in str(exc):
                    continue
                raise Conflict(
                    f"drive {drive.name!r} at {att.path} in sandbox {sandbox_id} is busy (a "
                    f"process has it open or is inside it), so the sandbox cannot hibernate: "
                    f"{exc}",
                    kind="drive",
                    id=drive.id,
                    sandbox_id=sandbox_id,
                ) from exc

    async def after_wake(self, sandbox_id: str, channel: Any) -> None:
        """Mount the sandbox's drives again after a wake."""
        for drive, att in self.drives.attached_to(sandbox_id):
            await mount_in_guest(channel, drive, att.path, att.read_only)

    async def remount_running(self) -> int:
        """Mount, in every running sandbox, the attached drives its guest has not mounted: a
        restart after a crash between a drive's plug (or a wake) and its mount finds them
        recorded, plugged and unmounted. Returns how many it mounted; a failure is logged."""
        mounted = 0
        for rec in self.manager.registry.list(states={S.RUNNING}):
            attached = self.drives.attached_to(rec.id)
            if not attached:
                continue
            live = self.manager.live(rec.id)
            async with live.lock:
                channel = live.channel
                if channel is None:
                    continue
                for drive, att in attached:
                    probe = (
                        f"awk -v p={shlex.quote(att.path)} '$2 == p {{f = 1}} END {{exit !f}}' "
                        "/proc/mounts"
                    )
                    try:
                        found = await channel.run_command(CommandSpec(cmd=probe, timeout=30))
                        if found.exit_code == 0:
                            continue
                        await mount_in_guest(channel, drive, att.path, att.read_only)
                    except TorporError as exc:
                        log.warning("cannot mount drive %s in %s: %s", drive.id, rec.id, exc)
                        continue
                    log.info("drive %s mounted again in %s at %s", drive.id, rec.id, att.path)
                    mounted += 1
        return mounted

    # -- attaching -----------------------------------------------------------------------

    def live_ids(self) -> set[str]:
        """Ids of the sandboxes not killed (attachments of the others are stale)."""
        return {r.id for r in self.manager.registry.list() if r.state is not S.STOPPED}

    async def running_channel(self, tenant: str, id_or_name: str) -> SandboxRecord:
        rec = self.manager.registry.find(tenant, id_or_name)
        if rec.state is S.PAUSED:
            await self.manager.resume(rec.id, tenant=tenant)
        rec = self.manager.registry.get(rec.id)
        if rec.state is not S.RUNNING:
            raise InvalidState(
                f"sandbox {rec.id} is {rec.state.value}; attach needs it running",
                sandbox_id=rec.id,
                state=rec.state.value,
                required="running",
            )
        return rec

    async def attachable(
        self, store: RecordStore[Any], tenant: str, id_or_name: str, path: str
    ) -> SandboxRecord:
        """The running sandbox to attach a resource of ``store`` to at ``path``, once the
        attachments of killed sandboxes are dropped. Raises InvalidState, InvalidArgument
        (``path`` overlaps a mount). The store's calls run in a thread, as every one below:
        they wait for its lock, which a volume file read holds for as long as it takes."""
        await asyncio.to_thread(store.release, keep=self.live_ids)  # (ids: under the lock)
        rec = await self.running_channel(tenant, id_or_name)
        self.check_path_free(rec.id, path)
        return rec

    @staticmethod
    def running_machine(sandbox_id: str, live: Live) -> tuple[Machine, Channel]:
        """The machine and guest channel of ``live`` (the sandbox's live side, its lock held).
        Raises InvalidState when it has none (a pause came between the wake and the lock)."""
        if live.machine is None or live.channel is None:
            raise InvalidState(
                f"sandbox {sandbox_id} has no running machine",
                sandbox_id=sandbox_id,
                state="paused",
                required="running",
            )
        return live.machine, live.channel

    def check_path_free(self, sandbox_id: str, path: str) -> None:
        used = [a.path for _, a in self.volumes.attached_to(sandbox_id)]
        used += [a.path for _, a in self.drives.attached_to(sandbox_id)]
        for other in used:
            if path == other or path.startswith(other + "/") or other.startswith(path + "/"):
                raise InvalidArgument(
                    f"{path} overlaps {other}, already mounted in the sandbox",
                    field="path",
                    value=path,
                )

    async def attach_volume(
        self,
        id_or_name: str,
        mount: VolumeMount | None = None,
        /,
        *,
        tenant: str = "default",
        **fields: Any,
    ) -> VolumeInfo:
        """Attach a volume to a sandbox (hot-plugged) and mount it: a
        :class:`~torpor.sandbox.requests.VolumeMount`, or its fields (``volume``, ``path``,
        ``read_only``).

        Raises VolumeNotFound, InvalidArgument (path), Conflict (read-write elsewhere),
        InvalidState, EngineError/GuestError (then the attachment is undone).
        """
        from torpor.sandbox.vm.machine import DiskSpec

        spec = VolumeMount.of(mount, **fields)
        path, read_only = spec.path, spec.read_only
        rec = await self.attachable(self.volumes, tenant, id_or_name, path)
        # (a journal left by a killed sandbox is replayed here: e2fsck)
        vol = await asyncio.to_thread(
            functools.partial(
                self.volumes.attach, spec.volume, rec.id, path, read_only=read_only, tenant=tenant
            )
        )

        def drop() -> None:
            self.volumes.detach(vol.id, rec.id, tenant=tenant)

        live = self.manager.live(rec.id)
        undone = False
        try:
            async with live.lock:
                machine, channel = self.running_machine(rec.id, live)
                try:
                    await machine.attach_disk(  # type: ignore[attr-defined]
                        DiskSpec(
                            id=vol.id,
                            path=self.volumes.image(vol.id),
                            read_only=read_only,
                            format="raw",
                            serial=vol.id,
                        )
                    )
                    device = await find_guest_disk(channel, vol.id)
                    await channel.mount(  # type: ignore[attr-defined]
                        device, path, fstype="ext4", options="ro" if read_only else None
                    )
                except BaseException:
                    # a disk left plugged must stay recorded: unrecorded, a second writer
                    # could attach the volume, and a snapshot would carry it
                    undone = True
                    await self._unplug(machine, vol.id, rec.id, drop)
                    raise
        except BaseException:
            if not undone:  # it failed before the machine was reached: nothing is plugged
                await asyncio.to_thread(drop)
            raise
        log.info("volume %s mounted in %s at %s", vol.id, rec.id, path)
        return self.volumes.get(vol.id, tenant=tenant)

    def _plugged(self, sandbox_id: str) -> set[str] | None:
        """The ids of the devices in the sandbox's machine.json (None if it cannot be read)."""
        try:
            config = read_machine_json(self.manager.directory(sandbox_id))
        except (OSError, ValueError, TorporError):
            return None
        return {d.get("id") for d in config.get("devices", [])}

    async def _unplug(
        self, machine: Machine, device_id: str, sandbox_id: str, drop: Callable[[], object] | None
    ) -> None:
        """Undo an attach that failed after its device may have been plugged: unplug it (if
        it is in the machine), then ``drop`` its record. A device the guest will not release
        stays recorded (the guest can still use it)."""
        plugged = self._plugged(sandbox_id)
        if plugged is None or device_id in plugged:  # unknown: unplug to be sure
            try:
                await machine.detach(device_id)  # type: ignore[attr-defined]
            except Exception as exc:
                log.warning(
                    "cannot unplug %s from %s: %s; it stays attached", device_id, sandbox_id, exc
                )
                return
        if drop is not None:
            await asyncio.to_thread(drop)

    async def attach_drive(
        self,
        id_or_name: str,
        mount: DriveMount | None = None,
        /,
        *,
        tenant: str = "default",
        **fields: Any,
    ) -> DriveInfo:
        """Share a drive into a sandbox (virtio-9p) and mount it: a
        :class:`~torpor.sandbox.requests.DriveMount`, or its fields (``drive``, ``path``,
        ``read_only``).

        Adding a 9p device costs one hibernate + wake of the sandbox. Raises DriveNotFound,
        InvalidArgument, Conflict (busy mounts), InvalidState, EngineError/GuestError (then
        the share is unplugged and the attachment undone; if the guest will not let the
        device go, the attachment stays, since the guest can still mount it).

        Steps (crash points, ``snapshots.step``): ``attach:plugged`` (the share is in the
        machine and its machine.json, with the mount path), ``attach:recorded`` (the drive's
        attachment record), ``attach:mounted``. A crash between the first two leaves a
        device without a record: :func:`~torpor.sandbox.storage.retention.restore_unrecorded_drives`
        restores the record at the restart (:meth:`Checkpoints.recover`) or in GC.
        """
        from torpor.sandbox.vm.machine import ShareSpec

        spec = DriveMount.of(mount, **fields)
        path, read_only = spec.path, spec.read_only
        rec = await self.attachable(self.drives, tenant, id_or_name, path)
        info = self.drives.get(spec.drive, tenant=tenant)
        m = self.manager
        live = m.live(rec.id)
        async with live.lock:
            machine, channel = self.running_machine(rec.id, live)
            await self.before_pause(rec.id, channel)  # attach_share hibernates once
            live.channel = None
            with contextlib.suppress(Exception):
                await channel.sync()
                await channel.close()
            try:
                await machine.attach_share(  # type: ignore[attr-defined]
                    ShareSpec(
                        id=info.id,
                        path=self.drives.directory(info.id),
                        tag=info.mount_tag,
                        read_only=read_only,
                        guest_path=path,
                    )
                )
            finally:
                live.channel = await m.engine.connect(machine, m.directory(rec.id))
                await live.channel.refresh(entropy=os.urandom(64), unix_time=time.time())
                await self.after_wake(rec.id, live.channel)
            step("attach:plugged")
            try:  # the drive may have been deleted while the share was plugged
                await asyncio.to_thread(
                    functools.partial(
                        self.drives.attach,
                        info.id,
                        rec.id,
                        path,
                        read_only=read_only,
                        tenant=tenant,
                    )
                )
            except BaseException:
                await self._unplug(machine, info.id, rec.id, None)
                raise
            step("attach:recorded")
            try:
                await mount_in_guest(live.channel, info, path, read_only)
            except BaseException:
                await self._unplug(
                    machine,
                    info.id,
                    rec.id,
                    lambda: self.drives.detach(info.id, rec.id, tenant=tenant),
                )
                raise
            step("attach:mounted")
        log.info("drive %s mounted in %s at %s", info.id, rec.id, path)
        return self.drives.get(info.id, tenant=tenant)
