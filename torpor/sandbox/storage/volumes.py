"""Volumes: disk images that outlive every sandbox that used them.

A volume is a sparse raw file ``volumes/<id>.img`` holding an ext4 file system, plus a record
``volumes/<id>.json`` (name, tenant, size, attachments). It is attached to a sandbox as an extra
virtio-blk disk and mounted by the guest agent at a path:

* read-write to **one** sandbox at a time, or read-only to **any number** — never both at once,
  because ext4 has no cache coherence between two kernels (a second attach that would break this
  is a :class:`~torpor.errors.Conflict`);
* deleting a sandbox detaches its volumes; their data stays. Deleting a volume that is attached
  is a Conflict. What the guest wrote is on the volume once it is flushed: a pause flushes it
  (the manager syncs before hibernating), ``sync`` in the guest does too; a *kill* of a running
  sandbox loses writes still in the guest's page cache, as pulling a disk would. The next
  attach replays the ext4 journal on the host, so a read-only mount sees every flushed write.

**Snapshots and volumes.** A volume is *not* part of a snapshot (it is shared, long-lived data;
rolling it back with a sandbox would lose what others wrote). Because the guest's kernel has the
volume mounted with cached state, a snapshot of a sandbox with a volume attached would restore a
kernel that believes it has a disk that has moved on. So :mod:`torpor.sandbox.checkpoints` refuses
to snapshot or fork such a sandbox with a Conflict that says how to proceed (detach the volume,
or copy what you need into the sandbox's own disk). Nothing is lost either way.

The record code volumes and drives share (list, get, create, attach, detach, release, delete, and
:func:`check_mount_path`, re-exported here) is :mod:`torpor.sandbox.storage.records`.
"""

from __future__ import annotations

import logging
import subprocess
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from torpor.config import Paths, Quotas
from torpor.errors import (
    EngineError,
    GuestError,
    OperationTimeout,
    VolumeNotFound,
)
from torpor.sandbox.requests import MAX_VOLUME_MIB, VolumeSpec  # MAX_VOLUME_MIB: re-exported
from torpor.sandbox.storage.records import (  # check_mount_path, SYSTEM_DIRS: re-exported
    SYSTEM_DIRS,
    Attachment,
    RecordMedium,
    RecordStore,
    check_mount_path,
)

__all__ = [
    "MAX_VOLUME_MIB",
    "SYSTEM_DIRS",
    "Attachment",
    "VolumeInfo",
    "VolumeStore",
    "check_mount_path",
    "replay_image_journal",
]

log = logging.getLogger(__name__)

#: Seconds a journal replay may take. A killed sandbox's journal replays in seconds, but the
#: guest chooses its journal's size and contents (up to the whole volume), and a replay runs
#: under the volumes' lock.
REPLAY_TIMEOUT = 120.0


def replay_image_journal(image: Path, what: str) -> None:
    """Replay the ext4 journal of ``image`` (``what`` names it in errors) with e2fsck, in at
    most :data:`REPLAY_TIMEOUT` seconds. A replay cut short leaves the journal marked for
    replay (it is restartable: the next one redoes it whole). Raises OperationTimeout,
    EngineError (e2fsck cannot run, or finds more than the journal to fix)."""
    try:
        proc = subprocess.run(
            ["e2fsck", "-p", "-E", "journal_only", str(image)],
            capture_output=True,
            text=True,
            check=False,
            timeout=REPLAY_TIMEOUT,
        )
    except subprocess.TimeoutExpired as exc:
        raise OperationTimeout(
            f"replaying the journal of {what} took over {REPLAY_TIMEOUT:g} s",
            seconds=REPLAY_TIMEOUT,
            exc=exc,
        ) from exc
    except OSError as exc:
        raise EngineError(f"cannot run e2fsck on {what}: {exc}", exc=exc) from exc
    if proc.returncode >= 4:
        raise EngineError(
            f"{what} needs repair: {proc.stdout.strip()} {proc.stderr.strip()}",
            exit_code=proc.returncode,
        )


class VolumeInfo(BaseModel):
    """A volume as callers see it."""

    id: str
    name: str
    tenant: str = "default"
    size_mib: int
    created_at: datetime
    attachments: list[Attachment] = Field(default_factory=list)
    #: given at create (a record from before labels has none)
    labels: dict[str, str] = Field(default_factory=dict)
    #: cluster mode: the node its latest image is on (a wake or attach elsewhere pulls it
    #: from the store); None on one machine
    node: str | None = None


class VolumeStore(RecordStore[VolumeInfo]):
    """The volumes of one torpor home (list, get, attach, detach, release, delete: see
    RecordStore): one writer or any number of readers."""

    kind = "volume"
    prefix = "vol"
    not_found = VolumeNotFound
    in_use = "is attached to"
    exclusive_writer = True

    def __init__(self, paths: Paths, records: RecordMedium | None = None) -> None:
        super().__init__(paths.volumes, VolumeInfo.model_validate, records)
        self.paths = paths

    def image(self, volume_id: str) -> Path:
        """The disk image of a volume."""
        return self.root / f"{volume_id}.img"

    def _exists(self, rid: str) -> bool:
        return self.image(rid).exists()

    def _remove_data(self, rid: str) -> None:
        self.image(rid).unlink(missing_ok=True)

    def _discard(self, rid: str) -> None:
        self.image(rid).unlink(missing_ok=True)

    def create(
        self, spec: VolumeSpec | str | None = None, /, *, tenant: str = "default", **fields: Any
    ) -> VolumeInfo:
        """Make an empty ext4 volume (sparse): a :class:`~torpor.sandbox.requests.VolumeSpec`,
        or its ``name`` and ``size_mib``.

        Raises InvalidName, InvalidArgument (size, a bad quotas.json), Conflict (name taken in
        the tenant), QuotaExceeded (checked under the volumes' lock), EngineError (mkfs
        failed), StorageError. Nothing is left behind on failure.
        """
        want = VolumeSpec.of(spec, **fields)
        name, size_mib, labels = want.name, want.size_mib, dict(want.labels or {})
        quotas = Quotas.of(self.paths, tenant)

        def admit(held: list[VolumeInfo]) -> None:
            # under the volumes' lock: two creates at once cannot both take the last room
            quotas.check(tenant, "volumes", len(held))
            quotas.check(tenant, "volume_mib", sum(v.size_mib for v in held), size_mib)

        def make(vid: str) -> VolumeInfo:
            image = self.image(vid)
            with open(image, "wb") as f:
                f.truncate(size_mib << 20)
            try:
                subprocess.run(
                    [
                        "mkfs.ext4",
                        "-q",
                        "-F",
                        "-L",
                        name[:16],
                        "-m",
                        "0",
                        "-E",
                        "lazy_itable_init=1,lazy_journal_init=1",
                        str(image),
                    ],
                    check=True,
                    capture_output=True,
                    text=True,
                )
            except subprocess.CalledProcessError as exc:
                raise EngineError(
                    f"mkfs.ext4 failed for volume {name!r}: {exc.stderr.strip()}", exc=exc
                ) from exc
            return VolumeInfo(
                id=vid,
                name=name,
                tenant=tenant,
                size_mib=size_mib,
                created_at=datetime.now(UTC),
                labels=labels,
                node=self.records.node,
            )

        info = self._create(name, tenant, make, admit)
        log.info("created volume %s (%s, %d MiB)", info.id, name, size_mib)
        return info

    def _before_attach(self, info: VolumeInfo, first: bool) -> None:
        if first:
            self.replay_journal(info.id)

    def replay_journal(self, volume_id: str) -> None:
        """Replay the ext4 journal of an image nobody has attached.

        A sandbox killed with the volume mounted leaves a journal to replay; a guest mounting
        read-only cannot replay it (and without the replay would miss synced writes), so the
        host does it here. Raises EngineError when e2fsck finds more than the journal to fix,
        OperationTimeout when the replay takes over :data:`REPLAY_TIMEOUT` (the journal stays
        to replay).
        """
        replay_image_journal(self.image(volume_id), f"volume {volume_id}")


async def find_guest_disk(channel: Any, serial: str, timeout: float = 20.0) -> str:
    """The guest device of a hot-plugged virtio disk, found by its serial (the guest has no
    udev, so no /dev/disk/by-id): polls /sys/block/*/serial until the kernel has probed it."""
    script = (
        f"i=0; while [ $i -lt {int(timeout * 10)} ]; do for b in /sys/block/vd*; do "
        f"[ \"$(cat $b/serial 2>/dev/null)\" = '{serial}' ] && echo /dev/${{b##*/}} && "
        "exit 0; done; sleep 0.1; i=$((i+1)); done; exit 1"
    )
    result = await channel.run_command(script, timeout=timeout + 10)
    if result.exit_code != 0 or not result.stdout.strip():
        raise GuestError(f"the guest did not see disk {serial} within {timeout} s", serial=serial)
    return str(result.stdout.strip())
