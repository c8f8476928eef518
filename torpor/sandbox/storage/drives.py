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

import logging
import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from torpor.config import Paths
from torpor.errors import DriveNotFound, GuestError
from torpor.sandbox.requests import DriveSpec
from torpor.sandbox.storage.records import Attachment, RecordMedium, RecordStore

__all__ = ["DriveInfo", "DriveStore", "mount_in_guest"]

log = logging.getLogger(__name__)


class DriveInfo(BaseModel):
    """A drive as callers see it."""

    id: str
    name: str
    tenant: str = "default"
    created_at: datetime
    attachments: list[Attachment] = Field(default_factory=list)
    #: given at create (a record from before labels has none)
    labels: dict[str, str] = Field(default_factory=dict)
    #: cluster mode: the node its directory is on (its sandboxes wake only there); None on
    #: one machine
    node: str | None = None

    @property
    def mount_tag(self) -> str:
        """The virtio-9p mount tag (at most 31 bytes: the id is 16)."""
        return self.id


class DriveStore(RecordStore[DriveInfo]):
    """The drives of one torpor home (list, get, attach, detach, release, delete: see
    RecordStore): any number of sandboxes may attach one, read-write."""

    kind = "drive"
    prefix = "drv"
    not_found = DriveNotFound
    in_use = "is mounted in"
    exclusive_writer = False

    def __init__(self, paths: Paths, records: RecordMedium | None = None) -> None:
        super().__init__(paths.drives, DriveInfo.model_validate, records)

    def directory(self, drive_id: str) -> Path:
        """The host directory a drive shares."""
        return self.root / drive_id

    def _exists(self, rid: str) -> bool:
        return self.directory(rid).is_dir()

    def _remove_data(self, rid: str) -> None:
        shutil.rmtree(self.directory(rid))

    def _discard(self, rid: str) -> None:
        shutil.rmtree(self.directory(rid), ignore_errors=True)

    def create(
        self, spec: DriveSpec | str | None = None, /, *, tenant: str = "default", **fields: Any
    ) -> DriveInfo:
        """Make an empty drive: a :class:`~torpor.sandbox.requests.DriveSpec`, or its
        ``name``. Raises InvalidName, Conflict (name taken), StorageError."""
        want = DriveSpec.of(spec, **fields)
        name, labels = want.name, dict(want.labels or {})

        def make(did: str) -> DriveInfo:
            # private: QEMU (9p security_model=mapped-xattr) reads and writes it as the
            # owner, and keeps the guest's owners and modes in xattrs, never on the files
            self.directory(did).mkdir(mode=0o700)
            self.directory(did).chmod(0o700)
            return DriveInfo(
                id=did,
                name=name,
                tenant=tenant,
                created_at=datetime.now(UTC),
                labels=labels,
                node=self.records.node,
            )

        info = self._create(name, tenant, make)
        log.info("created drive %s (%s)", info.id, name)
        return info


async def mount_in_guest(
    channel: Any, drive: DriveInfo, path: str, read_only: bool, timeout: float = 20.0
) -> None:
    """Mount ``drive`` at ``path`` in the guest over ``channel`` (a GuestChannel).

    Raises GuestError if the 9p device does not show up within ``timeout`` or mount fails."""
    # a hot-plugged 9p device shows up a moment after device_add: wait for its tag
    tag = drive.mount_tag
    script = (
        f"i=0; while [ $i -lt {int(timeout * 10)} ]; do "
        f"grep -qs '{tag}' /sys/bus/virtio/devices/*/mount_tag && exit 0; "
        "sleep 0.1; i=$((i+1)); done; exit 1"
    )
    result = await channel.run_command(script, timeout=timeout + 10)
    if result.exit_code != 0:
        raise GuestError(
            f"the guest did not see drive {drive.name} ({tag}) within {timeout} s", drive=drive.id
        )
    options = "trans=virtio,version=9p2000.L,msize=262144" + (",ro" if read_only else "")
    await channel.mount(drive.mount_tag, path, fstype="9p", options=options)
