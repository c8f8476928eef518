"""Drives: host directories shared read-write into many sandboxes at once (virtio-9p).

A drive is ``drives/<id>/`` on the host plus a record ``drives/<id>.json``. Each sandbox that uses
it gets a virtio-9p device whose mount tag is the drive id, and the guest agent mounts it at a
path; what one agent writes, another reads at once (9p has no guest page cache for data with
``cache=none``, the default).

virtio-9p blocks migration while it is mounted in the guest, so a sandbox with a drive unmounts
its drives before it hibernates and mounts them again after it wakes
(:mod:`torpor.sandbox.checkpoints` does this; a mount that is busy is a Conflict, not a hang).
A drive's contents are not part of a snapshot: it is shared state. Deleting a drive that is
attached is a Conflict; deleting a sandbox only detaches it.
"""

from __future__ import annotations

import builtins
import logging
import shutil
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from torpor.config import Paths, check_name
from torpor.errors import Conflict, DriveNotFound, GuestError, StorageError
from torpor.sandbox.volumes import (
    Attachment,
    check_attach,
    check_mount_path,
    locked,
    read_records,
    write_record,
)

__all__ = ["DriveInfo", "DriveStore", "mount_in_guest"]

log = logging.getLogger(__name__)


class DriveInfo(BaseModel):
    """A drive as callers see it."""

    id: str
    name: str
    tenant: str = "default"
    created_at: datetime
    attachments: list[Attachment] = Field(default_factory=list)

    @property
    def mount_tag(self) -> str:
        """The virtio-9p mount tag (at most 31 bytes: the id is 16)."""
        return self.id


class DriveStore:
    """The drives of one torpor home."""

    def __init__(self, paths: Paths) -> None:
        self.root = paths.drives
        self.root.mkdir(parents=True, exist_ok=True)

    def directory(self, drive_id: str) -> Path:
        """The host directory a drive shares."""
        return self.root / drive_id

    def _record(self, drive_id: str) -> Path:
        return self.root / f"{drive_id}.json"

    def _save(self, info: DriveInfo) -> None:
        write_record(self._record(info.id), info.model_dump(mode="json"))

    def create(self, name: str, *, tenant: str = "default") -> DriveInfo:
        """Make an empty drive. Raises InvalidName, Conflict (name taken), StorageError."""
        check_name(name, "drive name")
        did = f"drv-{uuid.uuid4().hex[:12]}"
        with locked(self.root):
            if any(d.name == name for d in self.list(tenant=tenant)):
                raise Conflict(f"a drive named {name!r} already exists", kind="drive", name=name)
            try:
                # world-writable so any guest uid can write (9p security_model=mapped-xattr
                # keeps guest ownership in xattrs, the host files stay ours)
                self.directory(did).mkdir(mode=0o777)
                self.directory(did).chmod(0o777)
                info = DriveInfo(id=did, name=name, tenant=tenant, created_at=datetime.now(UTC))
                self._save(info)
            except OSError as exc:
                shutil.rmtree(self.directory(did), ignore_errors=True)
                raise StorageError(f"cannot create drive {name!r}: {exc}", exc=exc) from exc
            except BaseException:
                shutil.rmtree(self.directory(did), ignore_errors=True)
                raise
        log.info("created drive %s (%s)", did, name)
        return info

    def list(self, *, tenant: str = "default") -> list[DriveInfo]:
        """The tenant's drives, oldest first."""
        found = []
        for _, data in read_records(self.root, "drv"):
            try:
                info = DriveInfo.model_validate(data)
            except ValueError as exc:
                log.warning("skipping bad drive record: %s", exc)
                continue
            if info.tenant == tenant and self.directory(info.id).is_dir():
                found.append(info)
        return sorted(found, key=lambda d: d.created_at)

    def get(self, id_or_name: str, *, tenant: str = "default") -> DriveInfo:
        """One drive by id or name. Raises DriveNotFound."""
        for d in self.list(tenant=tenant):
            if id_or_name in (d.id, d.name):
                return d
        raise DriveNotFound(f"drive {id_or_name!r} not found", kind="drive", name=id_or_name)

    def attach(self, id_or_name: str, sandbox_id: str, path: str, *, read_only: bool = False,
               tenant: str = "default") -> DriveInfo:
        """Record that ``sandbox_id`` mounts the drive at ``path`` (any number may, read-write).

        Raises DriveNotFound, InvalidArgument (path), Conflict (already attached there).
        """
        path = check_mount_path(path)
        with locked(self.root):
            info = self.get(id_or_name, tenant=tenant)
            check_attach("drive", info.id, info.attachments, sandbox_id, read_only,
                         exclusive_writer=False)
            info.attachments.append(Attachment(sandbox_id=sandbox_id, path=path,
                                               read_only=read_only))
            self._save(info)
        return info

    def detach(self, id_or_name: str, sandbox_id: str, *, tenant: str = "default") -> DriveInfo:
        """Forget ``sandbox_id``'s attachment. Raises DriveNotFound."""
        with locked(self.root):
            info = self.get(id_or_name, tenant=tenant)
            info.attachments = [a for a in info.attachments if a.sandbox_id != sandbox_id]
            self._save(info)
        return info

    def attached_to(self, sandbox_id: str) -> builtins.list[tuple[DriveInfo, Attachment]]:
        """Every drive (any tenant) attached to ``sandbox_id``, with the attachment."""
        out = []
        for _, data in read_records(self.root, "drv"):
            try:
                info = DriveInfo.model_validate(data)
            except ValueError:
                continue
            out += [(info, a) for a in info.attachments if a.sandbox_id == sandbox_id]
        return out

    def release(self, sandbox_ids: set[str] | None = None, *,
                keep: set[str] | None = None) -> int:
        """Drop attachments of ``sandbox_ids`` (or of every sandbox not in ``keep``)."""
        dropped = 0
        with locked(self.root):
            for _, data in list(read_records(self.root, "drv")):
                try:
                    info = DriveInfo.model_validate(data)
                except ValueError:
                    continue
                kept = [a for a in info.attachments
                        if not ((sandbox_ids is not None and a.sandbox_id in sandbox_ids)
                                or (keep is not None and a.sandbox_id not in keep))]
                if len(kept) != len(info.attachments):
                    dropped += len(info.attachments) - len(kept)
                    info.attachments = kept
                    self._save(info)
        return dropped

    def delete(self, id_or_name: str, *, tenant: str = "default") -> DriveInfo:
        """Delete a drive and its files. Raises DriveNotFound, Conflict while attached."""
        with locked(self.root):
            info = self.get(id_or_name, tenant=tenant)
            if info.attachments:
                raise Conflict(
                    f"drive {info.name!r} is mounted in "
                    f"{', '.join(a.sandbox_id for a in info.attachments)}; kill or detach those "
                    "sandboxes first", kind="drive", id=info.id)
            try:
                self._record(info.id).unlink()
                shutil.rmtree(self.directory(info.id))
            except OSError as exc:
                raise StorageError(f"cannot delete drive {info.id}: {exc}", exc=exc) from exc
        log.info("deleted drive %s (%s)", info.id, info.name)
        return info


async def mount_in_guest(channel: Any, drive: DriveInfo, path: str, read_only: bool,
                         timeout: float = 20.0) -> None:
    """Mount ``drive`` at ``path`` in the guest over ``channel`` (a GuestChannel).

    Raises GuestError if the 9p device does not show up within ``timeout`` or mount fails."""
    # a hot-plugged 9p device shows up a moment after device_add: wait for its tag
    tag = drive.mount_tag
    script = (f"i=0; while [ $i -lt {int(timeout * 10)} ]; do "
              f"grep -qs '{tag}' /sys/bus/virtio/devices/*/mount_tag && exit 0; "
              "sleep 0.1; i=$((i+1)); done; exit 1")
    result = await channel.run_command(script, timeout=timeout + 10)
    if result.exit_code != 0:
        raise GuestError(f"the guest did not see drive {drive.name} ({tag}) within {timeout} s",
                         drive=drive.id)
    options = "trans=virtio,version=9p2000.L,msize=262144" + (",ro" if read_only else "")
    await channel.mount(drive.mount_tag, path, fstype="9p", options=options)
