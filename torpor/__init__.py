"""torpor: memory for AI agents.

Two layers under one identity:

* execution state — :class:`Sandbox`, a QEMU microVM that hibernates to disk with its RAM and
  wakes where it was (plus :class:`Snapshot`, :class:`Volume`, :class:`Drive`);
* knowledge — :class:`Memory`, a store of facts, episodes and profiles with hybrid recall.

Every error is a :class:`TorporError` (see :mod:`torpor.errors`).
The public names below are loaded lazily, so ``import torpor`` stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torpor._lazy import lazy_exports
from torpor._version import __version__

if TYPE_CHECKING:  # the names mypy and editors see; at run time they load on first use
    from torpor.client import Drive, Runtime, Sandbox, Snapshot, Volume
    from torpor.client.aio import AsyncRuntime
    from torpor.client.aio_sandbox import AsyncSandbox, AsyncSnapshot
    from torpor.client.aio_storage import AsyncDrive, AsyncVolume
    from torpor.errors import (
        AccelerationUnavailable,
        AccessDenied,
        Conflict,
        CorruptData,
        DriveNotFound,
        EngineError,
        GuestError,
        InvalidArgument,
        InvalidName,
        InvalidState,
        NotFound,
        OperationTimeout,
        PathNotFound,
        PayloadTooLarge,
        QuotaExceeded,
        RecordNotFound,
        SandboxClosed,
        SandboxNotFound,
        SchemaViolation,
        ServerUnavailable,
        SnapshotNotFound,
        StateLost,
        StorageError,
        TemplateNotFound,
        TorporError,
        Unauthenticated,
        VolumeNotFound,
    )
    from torpor.memory import Memory, SourceRef

#: public name -> module that defines it
_LAZY = {
    "Runtime": "torpor.client",
    "Sandbox": "torpor.client",
    "Snapshot": "torpor.client",
    "Volume": "torpor.client",
    "Drive": "torpor.client",
    "Memory": "torpor.memory",
    "SourceRef": "torpor.memory",
    "AsyncRuntime": "torpor.client.aio",
    "AsyncSandbox": "torpor.client.aio_sandbox",
    "AsyncSnapshot": "torpor.client.aio_sandbox",
    "AsyncVolume": "torpor.client.aio_storage",
    "AsyncDrive": "torpor.client.aio_storage",
}

__all__ = [  # noqa: RUF022 (ordered by importance, not alphabet)
    "Runtime",
    "Sandbox",
    "Snapshot",
    "Volume",
    "Drive",
    "Memory",
    "SourceRef",
    "AsyncRuntime",
    "AsyncSandbox",
    "AsyncSnapshot",
    "AsyncVolume",
    "AsyncDrive",
    # the errors every caller may catch; the whole tree is drawn in torpor.errors
    "TorporError",
    "InvalidArgument",
    "InvalidName",
    "PayloadTooLarge",
    "SchemaViolation",
    "NotFound",
    "SandboxNotFound",
    "TemplateNotFound",
    "SnapshotNotFound",
    "VolumeNotFound",
    "DriveNotFound",
    "RecordNotFound",
    "PathNotFound",
    "Conflict",
    "InvalidState",
    "SandboxClosed",
    "OperationTimeout",
    "AccessDenied",
    "Unauthenticated",
    "QuotaExceeded",
    "EngineError",
    "AccelerationUnavailable",
    "GuestError",
    "StorageError",
    "CorruptData",
    "StateLost",
    "ServerUnavailable",
    "__version__",
]

# every other public name is an error class, defined in torpor.errors
_LAZY.update(dict.fromkeys(frozenset(__all__) - set(_LAZY) - {"__version__"}, "torpor.errors"))
__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals(), __all__)
