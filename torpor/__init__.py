"""torpor: memory for AI agents.

Two layers under one identity:

* execution state — :class:`Sandbox`, a QEMU microVM that hibernates to disk with its RAM and
  wakes where it was (plus :class:`Snapshot`, :class:`Volume`, :class:`Drive`);
* knowledge — :class:`Memory`, a store of facts, episodes and profiles with hybrid recall.

Every error is a :class:`TorporError` (see :mod:`torpor.errors`).
The public names below are loaded lazily, so ``import torpor`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

from torpor import errors as _errors
from torpor._version import __version__

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

_ERRORS = frozenset(__all__) - set(_LAZY) - {"__version__"}


def __getattr__(name: str) -> Any:
    if name in _ERRORS:
        return getattr(_errors, name)
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'torpor' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
