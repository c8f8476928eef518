"""``torpor.Volume``, ``torpor.Drive`` and what every stored resource shares (``Snapshot``,
which returns sandboxes, lives with :class:`~torpor.client.sandbox.Sandbox`).

::

    vol = torpor.Volume.create("memory-u-42", size_mib=1024)               # outlives sandboxes
    torpor.Sandbox.create(volumes=[{"volume": vol.id, "path": "/memory"}])
    drive = torpor.Drive.create("research")                                # many writers
    torpor.Sandbox.create(drives=[{"drive": drive.id, "path": "/shared"}])

A snapshot of a sandbox with a volume attached is refused (Conflict): volumes are never part of a
snapshot, see :mod:`torpor.sandbox.checkpoints`. ``collect_garbage`` runs the server's GC.
"""

from __future__ import annotations

import builtins
from typing import Any, ClassVar, Generic, Protocol, Self, TypeVar
from urllib.parse import quote

from pydantic import BaseModel

from torpor.client import storage_calls as calls
from torpor.client.runtime import Runtime, default_runtime
from torpor.client.sandbox_calls import LONG_TIMEOUT as _LONG_TIMEOUT
from torpor.sandbox.requests import (
    DriveSpec,
    GcSpec,
    Spec,
    VolumeSpec,
)
from torpor.sandbox.storage.drives import DriveInfo
from torpor.sandbox.storage.volumes import VolumeInfo
from torpor.types import Labels

__all__ = [
    "LONG_TIMEOUT",
    "Drive",
    "Resource",
    "Volume",
    "collect_garbage",
    "post_spec",
    "quote_id",
]

#: seconds to wait for snapshots, restores and forks: they copy RAM and wake machines
LONG_TIMEOUT = _LONG_TIMEOUT


class _Named(Protocol):
    @property
    def id(self) -> str: ...
    @property
    def name(self) -> str: ...


InfoT = TypeVar("InfoT", bound=_Named)


def quote_id(value: str) -> str:
    """``value`` safe as one path segment of a URL."""
    return quote(value, safe="")


class Resource(Generic[InfoT]):
    """What Snapshot, Volume and Drive share: an info model, a runtime, and the list / get /
    create / delete calls on ``<_route>`` and ``<_route>/<id>``."""

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
    def list(cls, *, runtime: Runtime | None = None) -> builtins.list[Self]:
        """This tenant's, oldest first (snapshots: only checked, unexpired ones)."""
        return cls._list(None, runtime)

    @classmethod
    def _list(cls, labels: Labels | None, runtime: Runtime | None) -> builtins.list[Self]:
        rt = runtime or default_runtime()
        call = calls.list_resources(cls._route, cls._info_model(), labels)
        return [cls(i, rt) for i in rt.do(call)]

    @classmethod
    def get(cls, id_or_name: str, *, runtime: Runtime | None = None) -> Self:
        """One by id or name. Raises SnapshotNotFound (also once expired) / VolumeNotFound /
        DriveNotFound."""
        rt = runtime or default_runtime()
        return cls(rt.do(calls.get(cls._route, cls._info_model(), id_or_name)), rt)

    @classmethod
    def _create(cls, spec: Spec, runtime: Runtime | None) -> Self:
        rt = runtime or default_runtime()
        return cls(rt.do(calls.create(cls._route, cls._info_model(), spec)), rt)

    @classmethod
    def _info_model(cls) -> type[Any]:
        return cls._model

    def _delete(self) -> None:
        self._runtime.do(calls.delete(self._route, self.id))


def post_spec(rt: Runtime, path: str, spec: Spec) -> Any:
    """POST the fields of ``spec`` the caller gave; the decoded answer. These calls copy RAM
    and wake machines: they get :data:`LONG_TIMEOUT`."""
    return rt.json("POST", path, json=spec.given(), timeout=LONG_TIMEOUT)


def collect_garbage(*, dry_run: bool = False, runtime: Runtime | None = None) -> dict[str, Any]:
    """Run the server's retention + GC now; returns its report."""
    return (runtime or default_runtime()).do(calls.gc(GcSpec.of(dry_run=dry_run)))


class Volume(Resource[VolumeInfo]):
    """A disk image that outlives sandboxes: read-write in one sandbox or read-only in many."""

    _route = "/v1/volumes"
    _model = VolumeInfo

    def __repr__(self) -> str:
        return f"<Volume {self.id} {self.name!r} {self.info.size_mib} MiB>"

    @classmethod
    def create(
        cls,
        name: str,
        size_mib: int | None = None,
        *,
        labels: Labels | None = None,
        runtime: Runtime | None = None,
    ) -> Volume:
        """A new empty (ext4) volume of ``size_mib`` (default 1024), carrying ``labels``
        (a token whose sandbox rights are ``{"user": "u-42"}`` reaches only volumes labelled
        so, and labels what it creates so). Raises InvalidName, InvalidArgument, Conflict,
        AccessDenied (labels outside the token's)."""
        return cls._create(VolumeSpec.of(name, size_mib=size_mib, labels=labels), runtime)

    @classmethod
    def list(
        cls, labels: Labels | None = None, *, runtime: Runtime | None = None
    ) -> builtins.list[Volume]:
        """This tenant's volumes (those the token may see), oldest first; only those carrying
        every one of ``labels`` when given."""
        return cls._list(labels, runtime)

    def delete(self) -> None:
        """Delete the volume and its data. Raises Conflict while a sandbox has it attached."""
        self._delete()

    def read_file(self, path: str) -> bytes:
        """The bytes of ``path`` inside the volume (its root is the volume's root), read on the
        server with no sandbox running. A volume attached read-write shows what the guest has
        flushed (``sync``, or a pause). Raises PathNotFound, InvalidArgument (a directory or
        link), PayloadTooLarge, EngineError."""
        return self._runtime.do(calls.read_volume_file(self.id, path))


class Drive(Resource[DriveInfo]):
    """A host directory mounted read-write into many sandboxes at once (virtio-9p)."""

    _route = "/v1/drives"
    _model = DriveInfo

    def __repr__(self) -> str:
        return f"<Drive {self.id} {self.name!r}>"

    @classmethod
    def create(
        cls, name: str, *, labels: Labels | None = None, runtime: Runtime | None = None
    ) -> Drive:
        """A new empty drive carrying ``labels`` (as :meth:`Volume.create`). Raises
        InvalidName, Conflict, AccessDenied."""
        return cls._create(DriveSpec.of(name, labels=labels), runtime)

    @classmethod
    def list(
        cls, labels: Labels | None = None, *, runtime: Runtime | None = None
    ) -> builtins.list[Drive]:
        """This tenant's drives (those the token may see), oldest first; only those carrying
        every one of ``labels`` when given."""
        return cls._list(labels, runtime)

    def delete(self) -> None:
        """Delete the drive and its files. Raises Conflict while mounted somewhere."""
        self._delete()
