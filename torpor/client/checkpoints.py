"""``torpor.Snapshot``, ``torpor.Volume``, ``torpor.Drive`` and the checkpoint calls of a Sandbox.

::

    before = sbx.snapshot(name="u-42-before-import", retention_days=30)   # RAM + disk
    restored = torpor.Sandbox.create(snapshot=before.id)                   # back to that point
    forks = sbx.fork(count=3, labels={"strategy": "try"})                  # live copies
    kids = torpor.Sandbox.fork(before.id, count=2)                         # copies of a snapshot
    vol = torpor.Volume.create("memory-u-42", size_mib=1024)               # outlives sandboxes
    torpor.Sandbox.create(volumes=[{"volume": vol.id, "path": "/memory"}])
    drive = torpor.Drive.create("research")                                # many writers
    torpor.Sandbox.create(drives=[{"drive": drive.id, "path": "/shared"}])

A snapshot of a sandbox with a volume attached is refused (Conflict): volumes are never part of a
snapshot, see :mod:`torpor.sandbox.checkpoints`.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, Self, TypeVar, cast
from urllib.parse import quote

from pydantic import BaseModel

from torpor.client.runtime import Runtime, default_runtime
from torpor.sandbox.drives import DriveInfo
from torpor.sandbox.models import SandboxInfo
from torpor.sandbox.requests import (
    DriveSpec,
    ForkSpec,
    GcSpec,
    RestoreSpec,
    SnapshotSpec,
    Spec,
    VolumeSpec,
)
from torpor.sandbox.snapshots import SnapshotInfo
from torpor.sandbox.volumes import VolumeInfo
from torpor.types import Labels

if TYPE_CHECKING:
    from torpor.client.sandbox import Sandbox

__all__ = [
    "LONG_TIMEOUT",
    "Drive",
    "ForkMethod",
    "Snapshot",
    "Volume",
    "collect_garbage",
    "snapshot_sandbox",
]

#: seconds to wait for snapshots, restores and forks: they copy RAM and wake machines
LONG_TIMEOUT = 600.0


class _Named(Protocol):
    @property
    def id(self) -> str: ...
    @property
    def name(self) -> str: ...


InfoT = TypeVar("InfoT", bound=_Named)


def _q(value: str) -> str:
    return quote(value, safe="")


def _sandboxes(data: Any, rt: Runtime) -> builtins.list[Sandbox]:
    from torpor.client.sandbox import Sandbox

    return [Sandbox(SandboxInfo.model_validate(d), rt) for d in data]


class _Resource(Generic[InfoT]):
    """What Snapshot, Volume and Drive share: an info model, a runtime, and the list / get /
    delete calls on ``<_route>`` and ``<_route>/<id>``."""

    _route: ClassVar[str]
    _model: ClassVar[type[BaseModel]]

    def __init__(self, info: InfoT, runtime: Runtime) -> None:
        self.info = info
        self._runtime = runtime

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def name(self) -> str:
        return self.info.name

    @classmethod
    def _from(cls, data: Any, rt: Runtime) -> Self:
        return cls(cast(InfoT, cls._model.model_validate(data)), rt)

    @classmethod
    def list(cls, *, runtime: Runtime | None = None) -> builtins.list[Self]:
        """This tenant's, oldest first (snapshots: only checked, unexpired ones)."""
        rt = runtime or default_runtime()
        return [cls._from(d, rt) for d in rt.json("GET", cls._route)]

    @classmethod
    def get(cls, id_or_name: str, *, runtime: Runtime | None = None) -> Self:
        """One by id or name. Raises SnapshotNotFound (also once expired) / VolumeNotFound /
        DriveNotFound."""
        rt = runtime or default_runtime()
        return cls._from(rt.json("GET", f"{cls._route}/{_q(id_or_name)}"), rt)

    def _delete(self) -> None:
        self._runtime.request("DELETE", f"{self._route}/{_q(self.id)}")


class Snapshot(_Resource[SnapshotInfo]):
    """An immutable copy of a whole sandbox (RAM, processes, disk), kept for ``retention_days``."""

    _route = "/v1/snapshots"
    _model = SnapshotInfo

    def __repr__(self) -> str:
        return f"<Snapshot {self.id} {self.name!r}>"

    def delete(self) -> None:
        """Delete the snapshot (its storage is reclaimed by the next GC)."""
        self._delete()

    def restore(self, *, name: str | None = None, labels: Labels | None = None) -> Sandbox:
        """A new running sandbox as the snapshot was. Raises SnapshotNotFound, CorruptData."""
        from torpor.client.sandbox import Sandbox

        spec = RestoreSpec.of(name=name, labels=labels)
        data = _post(self._runtime, f"/v1/snapshots/{_q(self.id)}/restore", spec)
        return Sandbox(SandboxInfo.model_validate(data), self._runtime)

    def fork(
        self, count: int | None = None, *, labels: Labels | None = None
    ) -> builtins.list[Sandbox]:
        """``count`` (default 1) new sandboxes from this snapshot."""
        return _fork_snapshot(self.id, count, labels=labels, runtime=self._runtime)


def _post(rt: Runtime, path: str, spec: Spec) -> Any:
    """POST the fields of ``spec`` the caller gave; the decoded answer. These calls copy RAM
    and wake machines: they get :data:`LONG_TIMEOUT`."""
    return rt.json("POST", path, json=spec.given(), timeout=LONG_TIMEOUT)


def _fork_snapshot(
    snapshot_id: str,
    count: int | None = None,
    *,
    labels: Labels | None = None,
    names: builtins.list[str] | None = None,
    runtime: Runtime | None = None,
) -> builtins.list[Sandbox]:
    rt = runtime or default_runtime()
    spec = ForkSpec.of(count=count, labels=labels, names=names)
    return _sandboxes(_post(rt, f"/v1/snapshots/{_q(snapshot_id)}/fork", spec), rt)


def snapshot_sandbox(
    sbx: Sandbox,
    name: str | None = None,
    *,
    retention_days: int | None = None,
    labels: Labels | None = None,
) -> Snapshot:
    """``sbx.snapshot(...)``: see :meth:`torpor.sandbox.checkpoints.Checkpoints.snapshot`."""
    rt: Runtime = sbx._runtime
    spec = SnapshotSpec.of(name=name, retention_days=retention_days, labels=labels)
    data = _post(rt, f"/v1/sandboxes/{_q(sbx.id)}/snapshots", spec)
    return Snapshot(SnapshotInfo.model_validate(data), rt)


class ForkMethod:
    """``sbx.fork(count=N)`` forks a live sandbox; ``Sandbox.fork(snapshot_id, count=N)`` forks
    a stored snapshot. One name, two receivers: a descriptor picks by how it is reached."""

    def __get__(self, obj: Sandbox | None, owner: type | None = None) -> Callable[..., Any]:
        if obj is None:
            return _fork_snapshot
        sbx = obj

        def fork(
            count: int | None = None,
            *,
            labels: Labels | None = None,
            names: builtins.list[str] | None = None,
        ) -> builtins.list[Sandbox]:
            """``count`` (default 1) live copies of this sandbox (it keeps running, or stays
            paused). Raises InvalidArgument (count 0 or over the limit), Conflict (a volume
            attached)."""
            rt: Runtime = sbx._runtime
            spec = ForkSpec.of(count=count, labels=labels, names=names)
            return _sandboxes(_post(rt, f"/v1/sandboxes/{_q(sbx.id)}/fork", spec), rt)

        return fork


def collect_garbage(*, dry_run: bool = False, runtime: Runtime | None = None) -> dict[str, Any]:
    """Run the server's retention + GC now; returns its report."""
    result: dict[str, Any] = _post(
        runtime or default_runtime(), "/v1/gc", GcSpec.of(dry_run=dry_run)
    )
    return result


class Volume(_Resource[VolumeInfo]):
    """A disk image that outlives sandboxes: read-write in one sandbox or read-only in many."""

    _route = "/v1/volumes"
    _model = VolumeInfo

    def __repr__(self) -> str:
        return f"<Volume {self.id} {self.name!r} {self.info.size_mib} MiB>"

    @classmethod
    def create(
        cls, name: str, size_mib: int | None = None, *, runtime: Runtime | None = None
    ) -> Volume:
        """A new empty (ext4) volume of ``size_mib`` (default 1024). Raises InvalidName,
        InvalidArgument, Conflict."""
        rt = runtime or default_runtime()
        return cls._from(_post(rt, cls._route, VolumeSpec.of(name, size_mib=size_mib)), rt)

    def delete(self) -> None:
        """Delete the volume and its data. Raises Conflict while a sandbox has it attached."""
        self._delete()

    def read_file(self, path: str) -> bytes:
        """The bytes of ``path`` inside the volume (its root is the volume's root), read on the
        server with no sandbox running. A volume attached read-write shows what the guest has
        flushed (``sync``, or a pause). Raises PathNotFound, InvalidArgument (a directory or
        link), PayloadTooLarge, EngineError."""
        response = self._runtime.request(
            "GET", f"{self._route}/{_q(self.id)}/files", params={"path": path}
        )
        content: bytes = response.content
        return content


class Drive(_Resource[DriveInfo]):
    """A host directory mounted read-write into many sandboxes at once (virtio-9p)."""

    _route = "/v1/drives"
    _model = DriveInfo

    def __repr__(self) -> str:
        return f"<Drive {self.id} {self.name!r}>"

    @classmethod
    def create(cls, name: str, *, runtime: Runtime | None = None) -> Drive:
        """A new empty drive. Raises InvalidName, Conflict."""
        rt = runtime or default_runtime()
        return cls._from(_post(rt, cls._route, DriveSpec.of(name)), rt)

    def delete(self) -> None:
        """Delete the drive and its files. Raises Conflict while mounted somewhere."""
        self._delete()
