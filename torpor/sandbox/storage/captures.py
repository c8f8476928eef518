"""Snapshots still being captured, and the local cache of frozen dirs a restore clones from.

A snapshot is taken in two parts. The first stops the source for a few milliseconds and
leaves an immutable frozen dir (:func:`~torpor.sandbox.storage.snapshots.freeze_live`); the
second hashes that dir into the content-addressed chunk store and writes the manifest
(:meth:`~torpor.sandbox.storage.snapshots.SnapshotStore.save`, hundreds of milliseconds). The
caller gets the snapshot after the first part: the frozen dir is named by a **cache link**
(``snapshots/cache/<snapshot id>`` -> ``../frozen/frz-...``) and a **pending record**
(``snapshots/pending/<snapshot id>.json``, written atomically with a digest of its body, after
the link) says what the manifest will hold. The snapshot is listed as ``capturing`` until its
manifest is written, then the pending record goes.

Crash safety (SIGKILL at any step): before the pending record exists nothing was returned to
the caller, and GC removes a link that names no snapshot (then its frozen dir, which no disk
chain names, goes too); once it exists, a restarted :class:`~torpor.sandbox.checkpoints.Checkpoints`
finishes the capture from the frozen dir (:meth:`PendingCaptures.records`); a manifest
written before the record was removed wins (the record is dropped).

A restore or fork of a snapshot whose frozen dir still holds its RAM clones that dir directly
(no chunk is read): the dir is local, was never run and is read-only (mode 0400). At most
:func:`cache_size` captured snapshots keep their RAM (``$TORPOR_SNAPSHOT_CACHE``, default 4);
older ones give it back and are materialized from verified chunks as before. Each cached
snapshot also keeps one **spare** clone (``snapshots/cache/spare/<snapshot id>/``: a
hibernated machine dir made by ``clone_machine_dir``: its own RAM copy, a new overlay on the
frozen disk, the device state), made in the background: the next restore or fork of the
snapshot moves it in as its (last) child's directory instead of cloning while the caller
waits, and a new spare is made after it. Clones hold
``snapshots/.cache.lock`` shared while they copy, and eviction only takes it exclusively
without waiting (a busy cache is evicted at the next capture).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torpor.errors import EngineError, InvalidArgument, InvalidState, StorageError
from torpor.sandbox.storage.records import write_record
from torpor.sandbox.vm.disk import fsync_dir
from torpor.sandbox.vm.machine_dir import clone_machine_dir

__all__ = ["CACHE_ENV", "DEFAULT_CACHE_SIZE", "PendingCaptures", "cache_size", "drop_ram"]

log = logging.getLogger(__name__)

#: environment variable: how many captured snapshots keep their frozen RAM locally
CACHE_ENV = "TORPOR_SNAPSHOT_CACHE"
DEFAULT_CACHE_SIZE = 4


def cache_size() -> int:
    """``$TORPOR_SNAPSHOT_CACHE`` (default :data:`DEFAULT_CACHE_SIZE`; 0 keeps none once
    captured). Raises InvalidArgument for a value that is not a whole number >= 0."""
    raw = os.environ.get(CACHE_ENV, "").strip()
    if not raw:
        return DEFAULT_CACHE_SIZE
    try:
        value = int(raw)
    except ValueError as exc:
        raise InvalidArgument(f"{CACHE_ENV} must be a whole number, not {raw!r}") from exc
    if value < 0:
        raise InvalidArgument(f"{CACHE_ENV} must be >= 0, not {raw!r}")
    return value


def drop_ram(frozen: Path) -> None:
    """Remove a frozen dir's RAM and state once every clone has its own copy (the disk layer
    stays: overlays are backed by it; an empty dir goes), and what a capture cut short left
    of them (``ram.tmp``, ``state.tmp``)."""
    for name in ("ram", "state", "ram.tmp", "state.tmp"):
        with contextlib.suppress(FileNotFoundError):
            (frozen / name).unlink()
    with contextlib.suppress(OSError):
        if not any(frozen.iterdir()):
            shutil.rmtree(frozen)


def _digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


class PendingCaptures:
    """Pending records and cache links of one snapshot store (``root`` = ``snapshots/``)."""

    def __init__(self, root: Path, frozen_root: Path) -> None:
        self.root = root
        self.pending_root = root / "pending"
        self.cache_root = root / "cache"
        self.frozen_root = frozen_root

    # -- cache links ------------------------------------------------------------------------

    def link(self, snapshot_id: str, frozen: Path) -> None:
        """Name ``frozen`` as ``snapshot_id``'s local copy (durably). Raises StorageError."""
        try:
            self.cache_root.mkdir(parents=True, exist_ok=True)
            tmp = self.cache_root / f".{snapshot_id}.tmp"
            tmp.unlink(missing_ok=True)
            os.symlink(os.path.relpath(frozen, self.cache_root), tmp)
            os.replace(tmp, self.cache_root / snapshot_id)
            fsync_dir(self.cache_root)
        except OSError as exc:
            raise StorageError(f"cannot cache snapshot {snapshot_id}: {exc}", exc=exc) from exc

    def frozen_of(self, snapshot_id: str) -> Path | None:
        """The frozen dir the cache link of ``snapshot_id`` names (whole or not), or None."""
        link = self.cache_root / snapshot_id
        try:
            target = os.readlink(link)
        except OSError:
            return None
        return (self.cache_root / target).resolve()

    def cached(self, snapshot_id: str) -> Path | None:
        """``snapshot_id``'s local frozen dir if it still holds RAM and device state (a
        restore may clone it), else None."""
        frozen = self.frozen_of(snapshot_id)
        if frozen is None or not (frozen / "ram").is_file() or not (frozen / "state").is_file():
            return None
        return frozen

    def links(self) -> dict[str, Path]:
        """Every cache link: snapshot id -> the frozen dir it names."""
        found: dict[str, Path] = {}
        if not self.cache_root.is_dir():
            return found
        for entry in self.cache_root.iterdir():
            if entry.name.startswith("snap-"):
                frozen = self.frozen_of(entry.name)
                if frozen is not None:
                    found[entry.name] = frozen
        return found

    def unlink(self, snapshot_id: str) -> Path | None:
        """Remove ``snapshot_id``'s cache link and spare; returns the frozen dir it named."""
        frozen = self.frozen_of(snapshot_id)
        with contextlib.suppress(FileNotFoundError):
            (self.cache_root / snapshot_id).unlink()
        shutil.rmtree(self.spare_of(snapshot_id), ignore_errors=True)
        return frozen

    def forget(self, snapshot_id: str) -> None:
        """Remove only the cache link of ``snapshot_id`` (its spare and RAM go at GC)."""
        with contextlib.suppress(FileNotFoundError):
            (self.cache_root / snapshot_id).unlink()

    # -- spare RAM copies -------------------------------------------------------------------

    def spare_of(self, snapshot_id: str) -> Path:
        return self.cache_root / "spare" / snapshot_id

    def make_spare(self, snapshot_id: str) -> bool:
        """Clone the cached frozen dir of ``snapshot_id`` into its spare, unless it has one or
        is not cached. Returns True if a spare was made. Raises StorageError."""
        spare = self.spare_of(snapshot_id)
        frozen = self.cached(snapshot_id)
        if frozen is None or spare.exists():
            return False
        tmp = spare.with_name(f".{snapshot_id}.tmp")
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            spare.parent.mkdir(parents=True, exist_ok=True)
            clone_machine_dir(frozen, tmp)
            os.rename(tmp, spare)
        except (OSError, EngineError, InvalidState) as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            if self.cached(snapshot_id) is None:  # evicted or deleted meanwhile
                return False
            raise StorageError(f"cannot make a spare of {snapshot_id}: {exc}", exc=exc) from exc
        if self.cached(snapshot_id) is None:  # evicted while cloning
            shutil.rmtree(spare, ignore_errors=True)
            return False
        return True

    def take_spare(self, snapshot_id: str, into: Path) -> bool:
        """Move ``snapshot_id``'s spare clone to the directory ``into`` (absent or empty; one
        taker wins); False if there is none."""
        try:
            os.rename(self.spare_of(snapshot_id), into)
        except FileNotFoundError:
            return False
        return True

    def drop_stale_spares(self, keep: set[str]) -> None:
        """Remove the spares of snapshots not in ``keep`` (not cached any more)."""
        root = self.cache_root / "spare"
        if root.is_dir():
            for spare in root.iterdir():
                if not spare.name.startswith(".") and spare.name not in keep:
                    shutil.rmtree(spare, ignore_errors=True)

    @contextlib.contextmanager
    def in_use(self) -> Iterator[None]:
        """Hold the cache shared while a clone copies a cached frozen dir's RAM."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / ".cache.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def evicting(self) -> Iterator[bool]:
        """Yields True while the cache is held exclusively (no clone copies from it), False
        if a clone holds it now (then evict nothing)."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / ".cache.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)

    # -- pending records --------------------------------------------------------------------

    def write(self, snapshot_id: str, body: dict[str, Any]) -> None:
        """Write ``snapshot_id``'s pending record (atomically, durably, with a digest).
        Raises StorageError."""
        self.pending_root.mkdir(parents=True, exist_ok=True)
        write_record(
            self.pending_root / f"{snapshot_id}.json",
            dict(body, digest=_digest(body)),
            what=f"the pending record of {snapshot_id}",
            sync_dir=True,
            snapshot_id=snapshot_id,
        )

    def read(self, snapshot_id: str) -> dict[str, Any] | None:
        """``snapshot_id``'s pending record if it exists and its digest checks, else None."""
        path = self.pending_root / f"{snapshot_id}.json"
        try:
            body = json.loads(path.read_text())
            digest = body.pop("digest")
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, AttributeError) as exc:
            log.warning("pending record %s is unreadable: %r", path.name, exc)
            return None
        if digest != _digest(body):
            log.warning("pending record %s fails its digest", path.name)
            return None
        return dict(body)

    def records(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """Every pending record that checks, as (snapshot id, body)."""
        if not self.pending_root.is_dir():
            return
        for path in sorted(self.pending_root.glob("snap-*.json")):
            body = self.read(path.stem)
            if body is not None:
                yield path.stem, body

    def ids(self) -> set[str]:
        """The snapshot id of every pending record there is, whether it reads or not (what GC
        must keep: an unreadable record may read again, and its link is the snapshot's
        only copy)."""
        if not self.pending_root.is_dir():
            return set()
        return {path.stem for path in self.pending_root.glob("snap-*.json")}

    def remove(self, snapshot_id: str) -> bool:
        """Remove ``snapshot_id``'s pending record (durably); False if there was none."""
        try:
            (self.pending_root / f"{snapshot_id}.json").unlink()
        except FileNotFoundError:
            return False
        with contextlib.suppress(OSError):
            fsync_dir(self.pending_root)
        return True
