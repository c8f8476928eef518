"""Every error torpor raises, under one root.

::

    TorporError                      root; .data carries the structured details
    ├── InvalidArgument              bad input from the caller (name, path, size, count ...)
    │   ├── InvalidName
    │   ├── PayloadTooLarge          .size, .limit
    │   └── SchemaViolation          a profile that breaks its schema
    ├── NotFound                     .kind, .name
    │   ├── SandboxNotFound
    │   ├── TemplateNotFound
    │   ├── SnapshotNotFound
    │   ├── VolumeNotFound
    │   ├── DriveNotFound
    │   ├── RecordNotFound           a memory record (fact, episode ...)
    │   └── PathNotFound             a file inside a sandbox
    ├── Conflict                     a name already taken, a volume already attached read-write
    ├── InvalidState                 .sandbox_id, .state, .required: an illegal transition
    │   └── SandboxClosed            the sandbox was killed
    ├── OperationTimeout             .seconds: a command or wake that ran out of time
    ├── AccessDenied                 .tenant, .scope: a token reaching outside its grants
    │   └── Unauthenticated          no token, or one that is malformed, unknown or revoked
    ├── QuotaExceeded                .tenant, .quota, .limit, .used: over a per-tenant quota
    ├── EngineError                  QEMU / QMP / host tooling failed (.exc wraps the cause)
    │   └── AccelerationUnavailable
    ├── GuestError                   the agent inside the VM failed or hung up
    ├── StorageError                 SQLite / PostgreSQL / the file system (.exc)
    │   ├── CorruptData              a chunk or database that fails its checks (.snapshot_id ...)
    │   └── StateLost                a crash destroyed state; .lost says what
    └── ServerUnavailable            the local or remote server cannot be reached

Errors cross the HTTP boundary as ``{"error": {"type", "message", "data"}}`` and are rebuilt
on the client as the same class (:func:`from_wire`), so a caller catches the same exception
whether it talks to a local engine or a remote server.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AccelerationUnavailable",
    "AccessDenied",
    "Conflict",
    "CorruptData",
    "DriveNotFound",
    "EngineError",
    "GuestError",
    "InvalidArgument",
    "InvalidName",
    "InvalidState",
    "NotFound",
    "OperationTimeout",
    "PathNotFound",
    "PayloadTooLarge",
    "QuotaExceeded",
    "RecordNotFound",
    "SandboxClosed",
    "SandboxNotFound",
    "SchemaViolation",
    "ServerUnavailable",
    "SnapshotNotFound",
    "StateLost",
    "StorageError",
    "TemplateNotFound",
    "TorporError",
    "Unauthenticated",
    "VolumeNotFound",
    "from_wire",
]


class TorporError(Exception):
    """Root of every torpor error.

    ``message`` is for people; keyword arguments become attributes and ``.data`` (for
    programs and for the wire). ``exc``, when given, is the wrapped lower-level exception
    and is chained as ``__cause__``.
    """

    http_status = 500

    def __init__(self, message: str, *, exc: BaseException | None = None, **data: Any) -> None:
        super().__init__(message)
        self.message = message
        self.exc = exc
        self.data: dict[str, Any] = data
        for key, value in data.items():
            setattr(self, key, value)
        if exc is not None:
            self.__cause__ = exc

    def to_wire(self) -> dict[str, Any]:
        """The JSON shape used by the HTTP API."""
        data = {k: v for k, v in self.data.items() if _jsonable(v)}
        return {"type": type(self).__name__, "message": self.message, "data": data}

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self).__name__, self.message, self.data))


class InvalidArgument(TorporError):
    """The caller passed something torpor cannot accept."""

    http_status = 400


class InvalidName(InvalidArgument):
    """A sandbox, template, snapshot, volume or drive name that breaks the naming rule."""


class PayloadTooLarge(InvalidArgument):
    """A file, output or text over its limit (``size``, ``limit`` in bytes)."""

    http_status = 413


class SchemaViolation(InvalidArgument):
    """A profile document that does not match its schema."""


class NotFound(TorporError):
    """Something named does not exist (``kind``, ``name``)."""

    http_status = 404


class SandboxNotFound(NotFound):
    pass


class TemplateNotFound(NotFound):
    pass


class SnapshotNotFound(NotFound):
    pass


class VolumeNotFound(NotFound):
    pass


class DriveNotFound(NotFound):
    pass


class RecordNotFound(NotFound):
    pass


class PathNotFound(NotFound):
    pass


class Conflict(TorporError):
    """A name already taken, or a resource held by someone else."""

    http_status = 409


class InvalidState(TorporError):
    """An operation that the sandbox's state does not allow (``sandbox_id``, ``state``,
    ``required``)."""

    http_status = 409


class SandboxClosed(InvalidState):
    """The sandbox was killed; nothing more can run in it."""


class OperationTimeout(TorporError):
    """A command, wake or request that did not finish within ``seconds``."""

    http_status = 504


class AccessDenied(TorporError):
    """A token reaching outside its tenant or grants (``tenant``, ``scope``)."""

    http_status = 403


class Unauthenticated(AccessDenied):
    """A request without a usable credential: no token where one is required, or one that is
    malformed, unknown, revoked or expired (HTTP 401; a valid token that lacks a right is
    :class:`AccessDenied`, 403). Catching AccessDenied catches both."""

    http_status = 401


class QuotaExceeded(TorporError):
    """A tenant at one of its quotas (``tenant``, ``quota``, ``limit``, ``used``): running
    sandboxes, their RAM, volumes and their size, snapshots, memory records. Nothing was made."""

    http_status = 429


class EngineError(TorporError):
    """QEMU, QMP or a host tool failed."""


class AccelerationUnavailable(EngineError):
    """KVM was required but does not work on this host."""


class GuestError(TorporError):
    """The agent inside the VM failed, or the channel to it broke."""

    http_status = 502


class StorageError(TorporError):
    """A database or the file system failed."""


class CorruptData(StorageError):
    """Stored data failed its integrity check (names what: ``snapshot_id``, ``chunk``, ``path``)."""


class StateLost(StorageError):
    """A crash destroyed state; ``lost`` says what is gone and what was kept."""

    http_status = 410


class ServerUnavailable(TorporError):
    """The torpor server could not be reached or started."""

    http_status = 503


class NoNodeAvailable(TorporError):
    """Cluster mode: no live node can take this (``accelerator``, ``cpu_model`` a pause needs;
    ``node`` a draining node that refused it). Nothing was changed."""

    http_status = 503


def _jsonable(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool, list, dict))


def _all_subclasses(cls: type[TorporError]) -> dict[str, type[TorporError]]:
    found = {cls.__name__: cls}
    for sub in cls.__subclasses__():
        found.update(_all_subclasses(sub))
    return found


def _rebuild(type_name: str, message: str, data: dict[str, Any]) -> TorporError:
    cls = _all_subclasses(TorporError).get(type_name, TorporError)
    return cls(message, **data)


def from_wire(payload: dict[str, Any]) -> TorporError:
    """Rebuild the error a server sent (the inverse of :meth:`TorporError.to_wire`)."""
    return _rebuild(
        str(payload.get("type", "TorporError")),
        str(payload.get("message", "unknown error")),
        dict(payload.get("data") or {}),
    )
