"""Where compressed chunks are kept: the small interface the chunk store writes through, and
its local implementation.

:class:`~torpor.sandbox.storage.chunks.ChunkStore` does the hashing, compression and
verification; a :class:`ChunkBackend` only keeps blobs (the zstd bytes of one chunk) under
their sha256 names. Two implementations:

* :class:`LocalChunkBackend` — a directory, ``<root>/<first two hex digits>/<hash>.zst`` (the
  embedded default, zero configuration);
* :class:`~torpor.sandbox.storage.object_store.S3ChunkBackend` — an S3-compatible bucket, with
  a bounded cache on the node's disk.

A backend never judges content: a blob that fails its check is the store's to find, and the
backend's to move aside (:meth:`ChunkBackend.quarantine`) so a later write of the same data
replaces it instead of being skipped as "already there".
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from torpor.errors import InvalidArgument, StorageError
from torpor.sandbox.vm.disk import fsync_dir

__all__ = ["ChunkBackend", "ChunkEntry", "LocalChunkBackend", "is_hash"]

_HEX = frozenset("0123456789abcdef")


def is_hash(value: object) -> bool:
    """True for a chunk name: 64 lowercase hex digits."""
    return isinstance(value, str) and len(value) == 64 and set(value) <= _HEX


def check_hash(digest: str) -> str:
    """``digest`` if it is a chunk name, else InvalidArgument (names become paths and keys)."""
    if not is_hash(digest):
        raise InvalidArgument(f"not a chunk name: {digest!r}")
    return digest


@dataclass(frozen=True)
class ChunkEntry:
    """One stored chunk as a listing sees it: its name, stored size and last write time."""

    digest: str
    size: int
    modified: float  # seconds since the epoch


class ChunkBackend(Protocol):
    """Blobs named by sha256. Every method raises StorageError when the medium fails."""

    #: where the chunks live, for messages (a path or ``s3://bucket/prefix``)
    location: str
    #: True when other nodes write to the same chunks (a sweep then needs every node's marks)
    shared: bool
    #: True when reads may come from a local copy that :meth:`read` with ``cached=False`` skips
    caches: bool

    def exists(self, digest: str) -> bool:
        """Whether chunk ``digest`` is stored."""
        ...

    def read(self, digest: str, *, cached: bool = True) -> bytes | None:
        """The stored blob, or None when there is none. ``cached=False`` reads the store
        itself (and refreshes a local copy)."""
        ...

    def write(self, digest: str, blob: bytes) -> int:
        """Store ``blob`` as ``digest``, whole or not at all; return the bytes written."""
        ...

    def delete(self, digest: str, *, before: float | None = None) -> int | None:
        """Remove a chunk; return the bytes freed (0 when it was not there). ``before``: only
        a chunk last written before this Unix time (a sweep's cut-off); one written since
        stays and the answer is None."""
        ...

    def quarantine(self, digest: str, *, cached: bool = True) -> None:
        """Move a chunk that failed its check aside (kept for inspection, never read again):
        the copy :meth:`read` gave, with the same ``cached``."""
        ...

    def entries(self) -> Iterator[ChunkEntry]:
        """Every stored chunk (temporary and quarantined ones excluded)."""
        ...

    def sync(self) -> None:
        """Make the writes so far durable (names included)."""
        ...


class LocalChunkBackend:
    """Chunks as files under ``root``: written to a temporary file, fsynced, renamed into
    place, so a chunk file is whole or absent; :meth:`sync` fsyncs the directories touched."""

    shared = False
    caches = False

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.location = str(self.root)
        self._touched: set[Path] = set()

    def path_of(self, digest: str) -> Path:
        """Where the chunk ``digest`` lives (whether or not it exists)."""
        check_hash(digest)
        return self.root / digest[:2] / f"{digest}.zst"

    def exists(self, digest: str) -> bool:
        return self.path_of(digest).exists()

    def read(self, digest: str, *, cached: bool = True) -> bytes | None:
        try:
            return self.path_of(digest).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StorageError(
                f"cannot read chunk {digest[:12]}: {exc}", exc=exc, chunk=digest
            ) from exc

    def write(self, digest: str, blob: bytes) -> int:
        target = self.path_of(digest)
        tmp = target.with_name(f".{digest}.{os.getpid()}.{id(blob)}.tmp")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise StorageError(
                f"cannot write chunk {digest[:12]}: {exc}", exc=exc, chunk=digest
            ) from exc
        self._touched.add(target.parent)
        return len(blob)

    def delete(self, digest: str, *, before: float | None = None) -> int | None:
        path = self.path_of(digest)
        try:
            st = path.stat()
            if before is not None and st.st_mtime >= before:
                return None
            size = st.st_size
            path.unlink()
        except FileNotFoundError:
            return 0
        except OSError as exc:
            raise StorageError(f"cannot remove chunk {digest[:12]}: {exc}", exc=exc) from exc
        return size

    def quarantine(self, digest: str, *, cached: bool = True) -> None:
        bad = self.root / "quarantine" / f"{digest}.zst"
        try:
            bad.parent.mkdir(exist_ok=True)
            os.replace(self.path_of(digest), bad)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise StorageError(f"cannot quarantine chunk {digest[:12]}: {exc}", exc=exc) from exc

    def entries(self) -> Iterator[ChunkEntry]:
        if not self.root.is_dir():
            return
        for sub in self.root.iterdir():
            if len(sub.name) != 2 or not sub.is_dir():
                continue
            for f in sub.iterdir():
                name = f.name
                if name.endswith(".zst") and is_hash(name[:-4]):
                    try:
                        st = f.stat()
                    except FileNotFoundError:
                        continue
                    yield ChunkEntry(name[:-4], st.st_size, st.st_mtime)

    def sync(self) -> None:
        for d in sorted(self._touched | {self.root}):
            try:
                fsync_dir(d, missing_ok=True)
            except OSError as exc:
                raise StorageError(f"cannot fsync {d}: {exc}", exc=exc) from exc
        self._touched.clear()
