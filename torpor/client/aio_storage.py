"""``AsyncVolume``, ``AsyncDrive`` and what every async stored resource shares
(``AsyncSnapshot``, which returns sandboxes, lives with
:class:`~torpor.client.aio_sandbox.AsyncSandbox`).

::

    async with torpor.AsyncRuntime(url=..., token=tok) as rt:
        vol = await torpor.AsyncVolume.create("memory-u-42", size_mib=1024, runtime=rt)
        await rt.sandboxes.create(volumes=[{"volume": vol.id, "path": "/memory"}])
        drive = await torpor.AsyncDrive.get("research", runtime=rt)
        [d.name for d in await torpor.AsyncDrive.list(runtime=rt)]

The sync :class:`~torpor.client.Volume` and :class:`~torpor.client.Drive`, awaited: the same
class methods, methods, arguments, models and typed errors, built and read by
:mod:`torpor.client.storage_calls`. An async runtime has no process-wide default, so
``runtime`` is always named.
"""

from __future__ import annotations

import builtins
from typing import Any, ClassVar, Generic, Protocol, Self, TypeVar

from torpor.client import storage_calls as calls
from torpor.client.calls import Call
from torpor.sandbox.requests import DriveSpec, GcSpec, Spec, VolumeSpec
from torpor.sandbox.storage.drives import DriveInfo
from torpor.sandbox.storage.volumes import VolumeInfo
from torpor.types import Labels

__all__ = ["AsyncConnection", "AsyncDrive", "AsyncResource", "AsyncVolume", "collect_garbage"]

T = TypeVar("T")


class AsyncConnection(Protocol):
    """What an async resource needs of :class:`~torpor.client.aio.AsyncRuntime`."""

    async def do(self, call: Call[T]) -> T: ...


class _Named(Protocol):
    @property
    def id(self) -> str: ...
    @property
    def name(self) -> str: ...


InfoT = TypeVar("InfoT", bound=_Named)


class AsyncResource(Generic[InfoT]):
    """What AsyncSnapshot, AsyncVolume and AsyncDrive share (as the sync
    :class:`~torpor.client.storage.Resource`)."""

    _route: ClassVar[str]
    _model: ClassVar[type[Any]]

    def __init__(self, info: InfoT, runtime: AsyncConnection) -> None:
        self.info = info
        self._runtime = runtime

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def runtime(self) -> AsyncConnection:
        """The server this handle talks to."""
        return self._runtime

    @classmethod
    async def list(cls, *, runtime: AsyncConnection) -> builtins.list[Self]:
        """This tenant's, oldest first (snapshots: only checked, unexpired ones)."""
        return [cls(i, runtime) for i in await runtime.do(cls._list_call(None))]

    @classmethod
    def _list_call(cls, labels: Labels | None) -> Call[builtins.list[Any]]:
        return calls.list_resources(cls._route, cls._model, labels)

    @classmethod
    async def get(cls, id_or_name: str, *, runtime: AsyncConnection) -> Self:
        """One by id or name. Raises SnapshotNotFound (also once expired) / VolumeNotFound /
        DriveNotFound."""
        return cls(await runtime.do(calls.get(cls._route, cls._model, id_or_name)), runtime)

    @classmethod
    async def _create(cls, spec: Spec, runtime: AsyncConnection) -> Self:
        return cls(await runtime.do(calls.create(cls._route, cls._model, spec)), runtime)

    async def _delete(self) -> None:
        await self._runtime.do(calls.delete(self._route, self.id))


async def collect_garbage(*, dry_run: bool = False, runtime: AsyncConnection) -> dict[str, Any]:
    """Run the server's retention + GC now; returns its report."""
    return await runtime.do(calls.gc(GcSpec.of(dry_run=dry_run)))


class AsyncVolume(AsyncResource[VolumeInfo]):
    """:class:`~torpor.client.Volume`, awaited: a disk image that outlives sandboxes."""

    _route = "/v1/volumes"
    _model = VolumeInfo

    def __repr__(self) -> str:
        return f"<AsyncVolume {self.id} {self.name!r} {self.info.size_mib} MiB>"

    @classmethod
    async def create(
        cls,
        name: str,
        size_mib: int | None = None,
        *,
        labels: Labels | None = None,
        runtime: AsyncConnection,
    ) -> AsyncVolume:
        """As :meth:`Volume.create <torpor.client.Volume.create>`."""
        return await cls._create(VolumeSpec.of(name, size_mib=size_mib, labels=labels), runtime)

    @classmethod
    async def list(
        cls, labels: Labels | None = None, *, runtime: AsyncConnection
    ) -> builtins.list[AsyncVolume]:
        """As :meth:`Volume.list <torpor.client.Volume.list>`."""
        return [cls(i, runtime) for i in await runtime.do(cls._list_call(labels))]

    async def delete(self) -> None:
        """Delete the volume and its data. Raises Conflict while a sandbox has it attached."""
        await self._delete()

    async def read_file(self, path: str) -> bytes:
        """As :meth:`Volume.read_file <torpor.client.Volume.read_file>`."""
        return await self._runtime.do(calls.read_volume_file(self.id, path))


class AsyncDrive(AsyncResource[DriveInfo]):
    """:class:`~torpor.client.Drive`, awaited: a host directory many sandboxes mount."""

    _route = "/v1/drives"
    _model = DriveInfo

    def __repr__(self) -> str:
        return f"<AsyncDrive {self.id} {self.name!r}>"

    @classmethod
    async def create(
        cls, name: str, *, labels: Labels | None = None, runtime: AsyncConnection
    ) -> AsyncDrive:
        """As :meth:`Drive.create <torpor.client.Drive.create>`."""
        return await cls._create(DriveSpec.of(name, labels=labels), runtime)

    @classmethod
    async def list(
        cls, labels: Labels | None = None, *, runtime: AsyncConnection
    ) -> builtins.list[AsyncDrive]:
        """As :meth:`Drive.list <torpor.client.Drive.list>`."""
        return [cls(i, runtime) for i in await runtime.do(cls._list_call(labels))]

    async def delete(self) -> None:
        """Delete the drive and its files. Raises Conflict while mounted somewhere."""
        await self._delete()
