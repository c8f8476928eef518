"""What volumes and drives share: a JSON record per resource, with its attachments.

It also holds :func:`check_mount_path` (where in the guest a volume or drive may be mounted) and
:func:`write_record`, the atomic JSON write that snapshot manifests use too.

A shared resource (a :mod:`~torpor.sandbox.storage.volumes` volume, a
:mod:`~torpor.sandbox.storage.drives` drive) lives in one directory as ``<prefix>-<hex>.json``
records next to its data, guarded by
``<directory>/.lock`` across processes. :class:`RecordStore` holds the code both stores run on
those records (list, get, create, attach, detach, who is attached, release, delete); each store
adds how its data is made and removed.

Where the records are kept is a :class:`RecordMedium`: :class:`LocalRecords` (the files above,
the embedded default) or, in cluster mode, the PostgreSQL registry's ``volumes`` and ``drives``
tables (:class:`~torpor.sandbox.manager.cluster.RegistryRecords`), so every node lists, gets and
deletes every volume and drive of a tenant. A shared medium also says which node the
resource's data is on (``node``: where a volume's latest image is, where a drive's directory
is); a record is listed there even when its data is not on this node.
"""

from __future__ import annotations

import builtins
import contextlib
import fcntl
import json
import logging
import os
import uuid
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from pydantic import BaseModel

from torpor.errors import Conflict, NotFound, StorageError
from torpor.sandbox.requests import SYSTEM_DIRS, check_mount_path
from torpor.sandbox.vm.disk import write_atomic

__all__ = [
    "SYSTEM_DIRS",
    "Attachment",
    "LiveIds",
    "LocalRecords",
    "RecordMedium",
    "RecordStore",
    "check_attach",
    "check_mount_path",
    "live_now",
    "locked",
    "read_records",
    "rewrite_prefix",
    "write_record",
]

log = logging.getLogger(__name__)


#: the ids of the sandboxes that still exist: a set, or a function that gives it (called under
#: the store's lock, so a sandbox made while the caller waited for the lock is in it)
LiveIds = set[str] | Callable[[], set[str]]


def live_now(live: LiveIds) -> set[str]:
    """The set ``live`` is, or gives."""
    return live() if callable(live) else live


class Attachment(BaseModel):
    """One sandbox using a volume or drive."""

    sandbox_id: str
    path: str
    read_only: bool = False


def write_record(
    path: Path,
    data: dict[str, Any],
    *,
    what: str | None = None,
    sync_dir: bool = False,
    **context: Any,
) -> None:
    """Write ``data`` as JSON to ``path`` atomically (tmp + fsync + rename; with ``sync_dir``
    the directory too, so the rename survives a crash). Raises StorageError naming ``what``
    (default: the file name) and carrying ``context``; no tmp file is left behind."""
    try:
        write_atomic(path, json.dumps(data, sort_keys=True).encode(), sync_dir=sync_dir)
    except OSError as exc:
        raise StorageError(f"cannot write {what or path.name}: {exc}", exc=exc, **context) from exc


def rewrite_prefix(value: Any, old: str, new: str) -> Any:
    """``value`` (a JSON value) with every string under directory ``old`` moved under ``new``.
    When ``new`` lies under ``old``, a string under ``new`` is moved already (a rewrite that
    failed half way and is tried again) and stays as it is."""
    if isinstance(value, str):
        if _under(value, old) and not (_under(new, old) and _under(value, new)):
            return new + value[len(old) :]
        return value
    if isinstance(value, list):
        return [rewrite_prefix(v, old, new) for v in value]
    if isinstance(value, dict):
        return {k: rewrite_prefix(v, old, new) for k, v in value.items()}
    return value


def _under(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory + "/")


@contextlib.contextmanager
def locked(directory: Path) -> Iterator[None]:
    """Hold ``<directory>/.lock`` exclusively: serializes create/attach/delete across processes."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def read_records(directory: Path, prefix: str) -> Iterator[tuple[Path, dict[str, Any]]]:
    """Every readable ``<prefix>-*.json`` record in ``directory``; bad ones are logged."""
    for path in sorted(directory.glob(f"{prefix}-*.json")):
        try:
            yield path, json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            log.warning("skipping unreadable record %s: %s", path, exc)


def check_attach(
    kind: str,
    rid: str,
    attachments: list[Attachment],
    sandbox_id: str,
    read_only: bool,
    *,
    exclusive_writer: bool,
) -> None:
    """Raise Conflict if attaching would break the sharing rule: never twice to one sandbox,
    and with ``exclusive_writer`` (volumes) one writer or any number of readers, not both."""
    for a in attachments:
        if a.sandbox_id == sandbox_id:
            raise Conflict(
                f"{kind} {rid} is already attached to sandbox {sandbox_id} at {a.path}",
                kind=kind,
                id=rid,
                sandbox_id=sandbox_id,
            )
    if not exclusive_writer:
        return
    writer = next((a for a in attachments if not a.read_only), None)
    if writer is not None:
        raise Conflict(
            f"{kind} {rid} is attached read-write to sandbox {writer.sandbox_id}; detach it there "
            "first, or attach it read-only after that",
            kind=kind,
            id=rid,
            holder=writer.sandbox_id,
        )
    if not read_only and attachments:
        raise Conflict(
            f"{kind} {rid} is attached read-only to {len(attachments)} sandbox(es) "
            f"({', '.join(a.sandbox_id for a in attachments)}); a read-write attach needs it to "
            "be attached nowhere else",
            kind=kind,
            id=rid,
            holders=[a.sandbox_id for a in attachments],
        )


class RecordMedium(Protocol):
    """Where a :class:`RecordStore` keeps its records. Every method raises StorageError when
    the medium fails."""

    #: True when other nodes keep records here too (a record's data may be on another node)
    shared: bool
    #: the node this store runs on (None: one machine)
    node: str | None

    def rows(self) -> Iterator[dict[str, Any]]:
        """Every record's data (bad ones skipped, logged)."""
        ...

    def save(self, data: dict[str, Any]) -> None:
        """Write one record (new or not), durably. Raises Conflict when another record of
        the tenant has its name (a shared medium checks it itself: two nodes may race)."""
        ...

    def remove(self, rid: str) -> None:
        """Forget a record (no error when it is not there)."""
        ...

    def lock(self) -> contextlib.AbstractContextManager[None]:
        """Serialize create/attach/detach/delete across processes (and nodes)."""
        ...

    def written_at(self, rid: str) -> float | None:
        """When the record was last written (Unix time; None: not there)."""
        ...

    def node_url(self, node: str) -> str | None:
        """The URL another node of a shared medium answers at (None: unknown, or one
        machine): where a request for a record's data on that node goes."""
        ...


class LocalRecords:
    """Records as files ``<root>/<prefix>-<hex>.json`` under ``<root>/.lock``."""

    shared = False
    node: str | None = None

    def __init__(self, root: Path, prefix: str) -> None:
        self.root = root
        self.prefix = prefix

    def path(self, rid: str) -> Path:
        return self.root / f"{rid}.json"

    def rows(self) -> Iterator[dict[str, Any]]:
        for _, data in read_records(self.root, self.prefix):
            yield data

    def save(self, data: dict[str, Any]) -> None:
        write_record(self.path(str(data["id"])), data)

    def remove(self, rid: str) -> None:
        try:
            self.path(rid).unlink(missing_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot delete the record of {rid}: {exc}", exc=exc) from exc

    def lock(self) -> contextlib.AbstractContextManager[None]:
        return locked(self.root)

    def written_at(self, rid: str) -> float | None:
        try:
            return self.path(rid).stat().st_mtime
        except FileNotFoundError:
            return None

    def node_url(self, node: str) -> str | None:
        return None


class SharedInfo(Protocol):
    """What a store needs of its record model (VolumeInfo, DriveInfo)."""

    id: str
    name: str
    tenant: str
    created_at: datetime
    attachments: list[Attachment]
    labels: dict[str, str]
    node: str | None

    def model_dump(self, *, mode: str = ...) -> dict[str, Any]: ...


InfoT = TypeVar("InfoT", bound=SharedInfo)


class RecordStore(Generic[InfoT]):
    """The records of one kind of shared resource in ``root``.

    A subclass sets ``kind`` ("volume"), ``prefix`` ("vol"), ``not_found`` (the NotFound
    subclass), ``in_use`` (how a delete refusal names the holders), ``exclusive_writer`` (the
    sharing rule of :func:`check_attach`) and implements :meth:`_exists` and
    :meth:`_remove_data` and :meth:`_discard`; it may override :meth:`_before_attach`.
    """

    kind: ClassVar[str]
    prefix: ClassVar[str]
    not_found: ClassVar[type[NotFound]]
    in_use: ClassVar[str]
    exclusive_writer: ClassVar[bool]

    def __init__(
        self, root: Path, parse: Callable[[Any], InfoT], records: RecordMedium | None = None
    ) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self._parse = parse
        #: where the records are (default: files in ``root``)
        self.records: RecordMedium = records or LocalRecords(root, self.prefix)

    def _listed(self, info: InfoT) -> bool:
        """Whether a record is listed: its data is here, or (a shared medium) on its node."""
        return self._exists(info.id) or (self.records.shared and info.node != self.records.node)

    def _exists(self, rid: str) -> bool:
        """Whether the resource's data is there (a record without it is not listed)."""
        raise NotImplementedError

    def _remove_data(self, rid: str) -> None:
        """Delete the resource's data. May raise OSError."""
        raise NotImplementedError

    def _before_attach(self, info: InfoT, first: bool) -> None:
        """Runs under the lock before an attach is recorded, ``first`` when nobody else has
        the resource attached; may change ``info`` (saved with the attachment). Default:
        nothing."""

    def _save(self, info: InfoT) -> None:
        self.records.save(info.model_dump(mode="json"))

    def _infos(self) -> Iterator[InfoT]:
        """Every valid record, any tenant (an invalid one is skipped quietly)."""
        for data in builtins.list(self.records.rows()):
            try:
                yield self._parse(data)
            except ValueError:
                continue

    def list(
        self, *, tenant: str = "default", labels: Mapping[str, str] | None = None
    ) -> builtins.list[InfoT]:
        """The tenant's resources whose data exists, oldest first; only those carrying every
        ``key=value`` of ``labels`` when given."""
        wanted = dict(labels or {})
        found = []
        for data in self.records.rows():
            try:
                info = self._parse(data)
            except ValueError as exc:
                log.warning("skipping bad %s record: %s", self.kind, exc)
                continue
            if (
                info.tenant == tenant
                and all(info.labels.get(k) == v for k, v in wanted.items())
                and self._listed(info)
            ):
                found.append(info)
        return sorted(found, key=lambda i: i.created_at)

    def list_all(self) -> builtins.list[InfoT]:
        """Every tenant's resources whose data exists, oldest first (usage meters them)."""
        found = [info for info in self._infos() if self._listed(info)]
        return sorted(found, key=lambda i: i.created_at)

    def get(self, id_or_name: str, *, tenant: str = "default") -> InfoT:
        """One resource by id or name. Raises the store's NotFound subclass."""
        for info in self.list(tenant=tenant):
            if id_or_name in (info.id, info.name):
                return info
        raise self.not_found(
            f"{self.kind} {id_or_name!r} not found", kind=self.kind, name=id_or_name
        )

    def _discard(self, rid: str) -> None:
        """Remove what a failed create left of the resource's data. Never raises."""
        raise NotImplementedError

    def _create(
        self,
        name: str,
        tenant: str,
        make: Callable[[str], InfoT],
        admit: Callable[[builtins.list[InfoT]], None] | None = None,
    ) -> InfoT:
        """A new resource named ``name``, under the store's lock: ``admit(held)`` (the
        tenant's resources, under the lock: a quota check) may refuse it, then ``make(id)``
        builds its data for a fresh ``<prefix>-<hex>`` id and returns the record, saved here.
        On any failure :meth:`_discard` removes what was made. Raises Conflict (name taken in
        the tenant), StorageError (an OSError), or what ``admit`` or ``make`` raised."""
        rid = f"{self.prefix}-{uuid.uuid4().hex[:12]}"
        with self.records.lock():
            held = self.list(tenant=tenant)
            if any(i.name == name for i in held):
                raise Conflict(
                    f"a {self.kind} named {name!r} already exists", kind=self.kind, name=name
                )
            if admit is not None:
                admit(held)
            try:
                info = make(rid)
                self._save(info)
            except OSError as exc:
                self._discard(rid)
                raise StorageError(f"cannot create {self.kind} {name!r}: {exc}", exc=exc) from exc
            except BaseException:
                self._discard(rid)
                raise
        return info

    def attach(
        self,
        id_or_name: str,
        sandbox_id: str,
        path: str,
        *,
        read_only: bool = False,
        tenant: str = "default",
    ) -> InfoT:
        """Record that ``sandbox_id`` mounts the resource at ``path`` (checked and normalized
        here), under the store's lock, after :meth:`_before_attach`. Raises the store's
        NotFound subclass, InvalidArgument (path), Conflict (the sharing rule of
        :func:`check_attach`: never twice to one sandbox; for a volume, one writer or any
        number of readers)."""
        path = check_mount_path(path)
        with self.records.lock():
            info = self.get(id_or_name, tenant=tenant)
            check_attach(
                self.kind,
                info.id,
                info.attachments,
                sandbox_id,
                read_only,
                exclusive_writer=self.exclusive_writer,
            )
            self._before_attach(info, not info.attachments)
            info.attachments.append(
                Attachment(sandbox_id=sandbox_id, path=path, read_only=read_only)
            )
            self._save(info)
        log.info(
            "%s %s attached to %s at %s (%s)",
            self.kind,
            info.id,
            sandbox_id,
            path,
            "ro" if read_only else "rw",
        )
        return info

    def detach(self, id_or_name: str, sandbox_id: str, *, tenant: str = "default") -> InfoT:
        """Forget ``sandbox_id``'s attachment (no error if there was none). Raises NotFound."""
        with self.records.lock():
            info = self.get(id_or_name, tenant=tenant)
            info.attachments = [a for a in info.attachments if a.sandbox_id != sandbox_id]
            self._save(info)
        return info

    def attached_to(self, sandbox_id: str) -> builtins.list[tuple[InfoT, Attachment]]:
        """Every resource (any tenant) attached to ``sandbox_id``, with the attachment."""
        return [
            (info, a)
            for info in self._infos()
            for a in info.attachments
            if a.sandbox_id == sandbox_id
        ]

    def release(self, sandbox_ids: set[str] | None = None, *, keep: LiveIds | None = None) -> int:
        """Drop attachments of the sandboxes in ``sandbox_ids`` (or of every sandbox not in
        ``keep``, taken under the lock: see :data:`LiveIds`). Returns how many were dropped.
        Used on kill and by GC."""
        dropped = 0
        with self.records.lock():
            keep = None if keep is None else live_now(keep)
            for info in self._infos():
                kept = [
                    a
                    for a in info.attachments
                    if not (
                        (sandbox_ids is not None and a.sandbox_id in sandbox_ids)
                        or (keep is not None and a.sandbox_id not in keep)
                    )
                ]
                if len(kept) != len(info.attachments):
                    dropped += len(info.attachments) - len(kept)
                    info.attachments = kept
                    self._save(info)
        return dropped

    def release_unplugged(self, plugged: Callable[[str, str], bool], *, before: float) -> int:
        """Drop attachments whose sandbox's machine has no device for the resource
        (``plugged(sandbox_id, resource_id)`` is False), in records last written before
        ``before`` (a Unix time: an attach in flight is younger). A process that died between
        recording an attach and plugging the device leaves exactly that; the resource stays
        attached for good otherwise. Returns how many were dropped. Used by GC."""
        dropped = 0
        with self.records.lock():
            for info in self._infos():
                written = self.records.written_at(info.id)
                if written is None or written >= before:
                    continue
                kept = [a for a in info.attachments if plugged(a.sandbox_id, info.id)]
                if len(kept) != len(info.attachments):
                    for a in info.attachments:
                        if a not in kept:
                            log.warning(
                                "%s %s was recorded as attached to %s but never plugged into "
                                "it (a crash mid-attach): released",
                                self.kind,
                                info.id,
                                a.sandbox_id,
                            )
                    dropped += len(info.attachments) - len(kept)
                    info.attachments = kept
                    self._save(info)
        return dropped

    def delete(self, id_or_name: str, *, tenant: str = "default") -> InfoT:
        """Delete a resource and its data. Raises NotFound, Conflict while attached,
        StorageError."""
        with self.records.lock():
            info = self.get(id_or_name, tenant=tenant)
            if info.attachments:
                raise Conflict(
                    f"{self.kind} {info.name!r} {self.in_use} "
                    f"{', '.join(a.sandbox_id for a in info.attachments)}; kill or detach those "
                    "sandboxes first",
                    kind=self.kind,
                    id=info.id,
                )
            try:
                self.records.remove(info.id)
                self._remove_data(info.id)
            except OSError as exc:
                raise StorageError(f"cannot delete {self.kind} {info.id}: {exc}", exc=exc) from exc
        log.info("deleted %s %s (%s)", self.kind, info.id, info.name)
        return info
