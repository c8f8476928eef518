"""Hot-plug into a running QEMU machine: disks (virtio-blk), network cards and host shares
(virtio-9p), and their removal.

:class:`HotPlug` is mixed into :class:`~torpor.sandbox.vm.machine.QemuMachine`; every change
is recorded in the directory's ``machine.json``, so every later wake starts with the same
devices. A device is recorded *before* QEMU gets it and its record dropped only once QEMU has
let it go (or never got it): a device in the machine is always in its record (what the undo of
a failed attach reads to decide whether to unplug).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

from torpor.errors import EngineError, InvalidArgument
from torpor.sandbox.vm.jail import prepare_path
from torpor.sandbox.vm.machine_dir import (
    QMP_TIMEOUT,
    DiskSpec,
    MachineSpec,
    ShareSpec,
    add_device,
    add_nic,
    disk_args,
    nic_args,
    read_machine_json,
    share_args,
    write_machine_json,
)

__all__ = ["HotPlug"]


class HotPlug:
    """The hot-plug methods of :class:`~torpor.sandbox.vm.machine.QemuMachine` (which
    provides the QMP, state and lifecycle methods declared here)."""

    directory: Path
    spec: MachineSpec

    def _require_running(self, op: str) -> None:
        raise NotImplementedError

    async def _qmp_exec(
        self, cmd: str, args: dict[str, Any] | None = None, timeout: float = QMP_TIMEOUT
    ) -> Any:
        raise NotImplementedError

    async def hibernate(
        self, *, ready: Awaitable[object] | None = None, linger: bool = True
    ) -> None:
        raise NotImplementedError

    async def _wake(self, pending_shares: list[dict[str, Any]] | None = None) -> None:
        raise NotImplementedError

    async def attach_disk(self, disk: DiskSpec) -> None:
        """Hot-plug a virtio-blk disk into the running guest and record it in machine.json
        (so every later wake has it). Raises InvalidArgument, EngineError, InvalidState."""
        self._require_running("attach a disk")
        config = read_machine_json(self.directory)
        rec = add_device(config, disk)
        if self.spec.jail is not None:
            await asyncio.to_thread(
                prepare_path, self.directory / rec["path"], self.spec.jail, write=not disk.read_only
            )
        node, dev = disk_args(rec)
        _record(self.directory, config)
        try:
            await self._qmp_exec("blockdev-add", node)
        except BaseException:
            _forget(self.directory, config, rec)
            raise
        try:
            await self._qmp_exec("device_add", dev)
        except BaseException:
            with contextlib.suppress(EngineError):  # still in use: keep the record
                await self._qmp_exec("blockdev-del", {"node-name": node["node-name"]})
                _forget(self.directory, config, rec)
            raise

    async def attach_nic(self) -> None:
        """Hot-plug a network card on QEMU's user-mode network (see
        :func:`~torpor.sandbox.vm.machine_dir.nic_args`) and record it in machine.json, so
        every later wake has it. The guest still has to bring it up. Raises InvalidArgument
        (one already), EngineError, InvalidState."""
        self._require_running("attach a network card")
        config = read_machine_json(self.directory)
        rec = add_nic(config)
        netdev, dev = nic_args(rec)
        _record(self.directory, config)
        try:
            await self._qmp_exec("netdev_add", netdev)
        except BaseException:
            _forget(self.directory, config, rec)
            raise
        try:
            await self._qmp_exec("device_add", dev)
        except BaseException:
            with contextlib.suppress(EngineError):  # still in use: keep the record
                await self._qmp_exec("netdev_del", {"id": netdev["id"]})
                _forget(self.directory, config, rec)
            raise

    async def attach_share(self, share: ShareSpec) -> None:
        """Share a host directory into the running guest (virtio-9p, tag ``share.tag``).

        QEMU cannot create a 9p backend at run time, so this hibernates, wakes with the backend
        on the command line, then hot-plugs the device (~a wake's cost). Raises
        InvalidArgument, EngineError, InvalidState.
        """
        self._require_running("attach a share")
        if not share.path.is_dir():
            raise EngineError(f"share path {share.path} is not a directory")
        config = read_machine_json(self.directory)
        rec = add_device(config, share)  # validates and picks the slot; saved after plug
        await self.hibernate(linger=False)  # (its QEMU is replaced at once)
        await self._wake(pending_shares=[rec])
        _fsdev, dev = share_args(rec)
        _record(self.directory, config)  # (after the wake: its command line has no device)
        try:
            await self._qmp_exec("device_add", dev)
        except BaseException:
            _forget(self.directory, config, rec)  # (the backend alone is no device)
            raise

    async def detach(self, device_id: str, *, timeout: float = 30.0) -> None:
        """Unplug a hot-plugged disk or share (the guest must release it: unmount first) and
        drop it from machine.json. Raises InvalidArgument (unknown id), EngineError (the guest
        did not let go within ``timeout``), InvalidState."""
        self._require_running("detach a device")
        config = read_machine_json(self.directory)
        recs = [d for d in config["devices"] if d["id"] == device_id]
        if not recs:
            raise InvalidArgument(f"no device {device_id!r} on this machine", id=device_id)
        await self._qmp_exec("device_del", {"id": device_id})
        deadline = time.monotonic() + timeout
        while True:  # the guest acknowledges the ACPI eject on its own time
            children = await self._qmp_exec("qom-list", {"path": "/machine/peripheral"})
            if not any(c.get("name") == device_id for c in children):
                break
            if time.monotonic() > deadline:
                raise EngineError(f"the guest did not release {device_id!r} within {timeout}s")
            await asyncio.sleep(0.05)
        if recs[0]["kind"] == "disk":
            with contextlib.suppress(EngineError):
                await self._qmp_exec("blockdev-del", {"node-name": f"blk-{device_id}"})
        config["devices"] = [d for d in config["devices"] if d["id"] != device_id]
        _record(self.directory, config)


def _record(directory: Path, config: dict[str, Any]) -> None:
    """Save ``config`` as the machine.json of ``directory``. Raises EngineError."""
    try:
        write_machine_json(directory, config)
    except OSError as exc:
        raise EngineError(f"cannot record the devices of {directory}: {exc}", exc=exc) from exc


def _forget(directory: Path, config: dict[str, Any], rec: dict[str, Any]) -> None:
    """Drop the record ``rec`` of a device QEMU does not have from ``config`` and save it;
    best effort (a record left of a device that is not there only plugs it at the next
    wake, where the attachment's own record has it too)."""
    config["devices"] = [d for d in config["devices"] if d is not rec]
    with contextlib.suppress(EngineError):
        _record(directory, config)
