"""The content-addressed chunk store: where snapshot files live once captured.

A file is cut into fixed-size chunks (256 KiB by default: measured on sibling sandboxes of one
template, each adds 35% fewer new bytes than with 1 MiB chunks, for 40% more time on a first
capture into an empty store). Each chunk is named by the sha256 of its
raw bytes and stored once, zstd-compressed, under ``chunks/<first two hex digits>/<hash>.zst``.
Two snapshots of the same template share most of their chunks, so the second one costs only what
changed. Chunks that are all zeros are not stored at all: the manifest records them as ``None`` and
a restore leaves a hole (the RAM file of a 512 MiB guest is mostly zeros).

Durability: a chunk is written to a temporary file, fsynced, then renamed into place, so a chunk
file is either whole or absent. :meth:`ChunkStore.sync_dirs` fsyncs the directories touched, and
the snapshot layer writes its manifest only after that (see
:mod:`torpor.sandbox.storage.snapshots`).

Integrity: :meth:`ChunkStore.get` checks every chunk against its name on the way out, and raises
:class:`~torpor.errors.CorruptData` on a mismatch, so a flipped byte on disk never reaches a guest.

Where: the store hashes, compresses and verifies; a backend
(:mod:`torpor.sandbox.storage.chunk_backends`) only keeps the blobs. The default is the home's
``chunks/`` directory; a store URL ``s3://bucket/prefix`` (:func:`open_chunk_store`,
``$TORPOR_STORE``) keeps them in S3-compatible object storage shared by many nodes, with a
bounded cache on each (:mod:`torpor.sandbox.storage.object_store`). Garbage collection is
mark-and-sweep: whoever holds the manifests gives the mark set, :meth:`ChunkStore.sweep` removes
the rest.
"""

from __future__ import annotations

import bisect
import errno
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zstandard

from torpor.config import Paths
from torpor.errors import CorruptData, InvalidArgument, StorageError
from torpor.sandbox.storage.chunk_backends import (
    ChunkBackend,
    LocalChunkBackend,
    check_hash,
    is_hash,
)

__all__ = [
    "CACHE_ENV",
    "DEFAULT_CHUNK_SIZE",
    "STORE_ENV",
    "ChunkStore",
    "FileManifest",
    "PutStats",
    "SweepReport",
    "home_chunk_store",
    "open_chunk_store",
]

log = logging.getLogger(__name__)

DEFAULT_CHUNK_SIZE = 256 * 1024


@dataclass
class FileManifest:
    """One file as an ordered list of chunk hashes (``None`` = an all-zero chunk)."""

    size: int
    chunk_size: int
    chunks: list[str | None] = field(default_factory=list)
    #: bytes this file added to the store when it was written (0 when fully deduplicated)
    new_bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "chunk_size": self.chunk_size, "chunks": list(self.chunks)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FileManifest:
        """Parse a manifest entry; raises CorruptData when it is malformed."""
        try:
            size, chunk_size, chunks = int(data["size"]), int(data["chunk_size"]), data["chunks"]
            if size < 0 or chunk_size <= 0 or not isinstance(chunks, list):
                raise ValueError("bad sizes")
            if len(chunks) != -(-size // chunk_size):
                raise ValueError("chunk count does not match the size")
            for c in chunks:
                if c is not None and not is_hash(c):
                    raise ValueError(f"bad chunk name {c!r}")
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptData(f"malformed file manifest: {exc}", exc=exc) from exc
        return cls(size=size, chunk_size=chunk_size, chunks=list(chunks))

    def hashes(self) -> set[str]:
        """The distinct chunks this file needs."""
        return {c for c in self.chunks if c is not None}


@dataclass
class SweepReport:
    """What a sweep removed (or would remove, in a dry run) and kept."""

    removed: int = 0
    kept: int = 0
    freed_bytes: int = 0


class PutStats:
    """Where the time of storing chunks went: seconds summed over the worker threads per
    stage (``read`` the file, ``hash``, ``compress``, ``upload`` a new chunk, ``ask`` the
    store whether it has one) and chunks counted per outcome (``stored``: sent to the store,
    ``known``: skipped, the store has it; ``template``: equal to the template's; ``zero``).
    Thread-safe; filled by :meth:`ChunkStore.put_file` and the pause push when given one."""

    STAGES = ("read", "hash", "compress", "upload", "ask")

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(self.STAGES, 0.0)
        self.chunks: dict[str, int] = {}
        self.stored_bytes = 0
        self._lock = threading.Lock()

    def add(self, stage: str, seconds: float) -> None:
        with self._lock:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds

    def count(self, outcome: str, stored_bytes: int = 0) -> None:
        with self._lock:
            self.chunks[outcome] = self.chunks.get(outcome, 0) + 1
            self.stored_bytes += stored_bytes

    def to_json(self) -> dict[str, Any]:
        with self._lock:
            return {
                "seconds": {k: round(v, 4) for k, v in self.seconds.items()},
                "chunks": dict(self.chunks),
                "stored_bytes": self.stored_bytes,
            }


class ChunkStore:
    """Chunks named by sha256, kept by a :class:`ChunkBackend`; see the module docstring.

    ``root`` is the local directory of the embedded default; ``backend`` replaces it (an S3
    bucket, see :func:`open_chunk_store`). ``level`` is the zstd level (low: snapshots are on
    the hot path). ``workers`` threads hash, compress and move chunks in parallel (all release
    the GIL).
    """

    def __init__(
        self,
        root: Path | None = None,
        *,
        backend: ChunkBackend | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        level: int = 1,
        workers: int = 2,
    ) -> None:
        if chunk_size <= 0 or chunk_size % 4096:
            raise InvalidArgument(
                f"chunk size must be a positive multiple of 4096, not {chunk_size}"
            )
        if backend is None:
            if root is None:
                raise InvalidArgument("a chunk store needs a directory or a backend")
            backend = LocalChunkBackend(Path(root))
        self.backend: ChunkBackend = backend
        self.chunk_size = chunk_size
        self.level = level
        self.workers = max(1, workers)
        self._zero = bytes(chunk_size)

    @property
    def location(self) -> str:
        """Where the chunks live (a directory or ``s3://bucket/prefix``)."""
        return self.backend.location

    @property
    def root(self) -> Path:
        """The local directory of the chunks. Raises InvalidArgument for a remote store."""
        return self._local().root

    def _local(self) -> LocalChunkBackend:
        if not isinstance(self.backend, LocalChunkBackend):
            raise InvalidArgument(f"chunks in {self.location} have no local path")
        return self.backend

    # -- single chunks ------------------------------------------------------------------------

    def path_of(self, digest: str) -> Path:
        """Where the chunk ``digest`` lives on this disk (whether or not it exists).

        Raises InvalidArgument for a bad name, or when the chunks are not in a local directory.
        """
        return self._local().path_of(digest)

    def has(self, digest: str) -> bool:
        """Whether chunk ``digest`` is stored. Raises StorageError when the store fails."""
        return self.backend.exists(check_hash(digest))

    def put(
        self,
        data: bytes,
        *,
        digest: str | None = None,
        ask: bool = True,
        stats: PutStats | None = None,
    ) -> tuple[str, int]:
        """Store ``data``; return (its sha256, bytes newly written: 0 if it was there already).
        ``digest``: its sha256 when the caller computed it already. ``ask=False`` writes
        without first asking whether the store has it: for data the caller has reason to
        believe is new (a remote store answers that question with a round trip that nearly
        always says no; writing a chunk again is harmless, the content names it).

        ``stats`` adds the time of each stage to it.

        Raises StorageError when the store fails.
        """
        digest = digest or hashlib.sha256(data).hexdigest()
        return digest, self._put_known(digest, data, ask=ask, stats=stats)

    def _put_known(
        self, digest: str, data: bytes, *, ask: bool = True, stats: PutStats | None = None
    ) -> int:
        # idempotent: content names the chunk, so one already there is this very data (or a
        # corrupt copy, which its first failed read quarantines, so the next put rewrites it)
        t0 = time.perf_counter()
        if ask and self.backend.exists(digest):
            if stats is not None:
                stats.add("ask", time.perf_counter() - t0)
                stats.count("known")
            return 0
        t1 = time.perf_counter()
        blob = _compressor(self.level).compress(data)
        t2 = time.perf_counter()
        written = self.backend.write(digest, blob)
        if stats is not None:
            if ask:
                stats.add("ask", t1 - t0)
            stats.add("compress", t2 - t1)
            stats.add("upload", time.perf_counter() - t2)
            stats.count("stored", written)
        return written

    def get(self, digest: str, *, snapshot_id: str | None = None) -> bytes:
        """The raw bytes of chunk ``digest``, checked against its name.

        Raises CorruptData (naming ``snapshot_id`` when given) if the chunk is missing,
        undecodable or its hash does not match; StorageError when the store cannot be read.
        """
        check_hash(digest)
        who = f"snapshot {snapshot_id}: " if snapshot_id else ""
        try:
            blob = self.backend.read(digest)
            data = None if blob is None else self._decode(digest, blob)
            if data is None and self.backend.caches:
                # a bad local copy is not a bad chunk: read the store itself before judging
                bad = blob
                blob = self.backend.read(digest, cached=False)
                data = None if blob is None else self._decode(digest, blob)
                repair = getattr(self.backend, "repair", None)
                if bad is not None and data is not None and blob is not None and repair:
                    try:  # the bad local copy, which a put would trust
                        repair(digest, blob)
                    except StorageError as exc:
                        log.error("cannot replace the bad copy of chunk %s: %s", digest[:12], exc)
        except StorageError as exc:
            exc.data.setdefault("snapshot_id", snapshot_id)
            exc.data.setdefault("chunk", digest)
            raise
        if blob is None:
            raise CorruptData(
                f"{who}chunk {digest[:12]} is missing from the store ({self.location})",
                snapshot_id=snapshot_id,
                chunk=digest,
            )
        if data is None:
            self._quarantine(digest)
            raise CorruptData(
                f"{who}chunk {digest[:12]} is corrupt (quarantined: the next snapshot holding "
                "the same data writes it again, and every snapshot naming it reads again)",
                snapshot_id=snapshot_id,
                chunk=digest,
            )
        return data

    def check(self, digest: str, blob: bytes, snapshot_id: str | None = None) -> None:
        """Raise CorruptData (naming ``snapshot_id``) unless ``blob`` is chunk ``digest``'s
        data, whole (a blob about to be copied elsewhere, e.g. pushed to a shared store); a
        bad one is quarantined here."""
        if self._decode(check_hash(digest), blob) is None:
            self._quarantine(digest)
            who = f"snapshot {snapshot_id}: " if snapshot_id else ""
            raise CorruptData(
                f"{who}chunk {digest[:12]} is corrupt in {self.location} (quarantined)",
                snapshot_id=snapshot_id,
                chunk=digest,
            )

    @staticmethod
    def _decode(digest: str, blob: bytes) -> bytes | None:
        """The chunk's data, or None when it does not decompress or match its name."""
        try:
            data = zstandard.ZstdDecompressor().decompress(blob)
        except zstandard.ZstdError:
            return None
        return data if hashlib.sha256(data).hexdigest() == digest else None

    def _quarantine(self, digest: str, *, cached: bool = True) -> None:
        """Move a bad chunk aside (the copy a read with ``cached`` gave), so a put of the same
        data rewrites it instead of trusting it: one flipped byte must not poison every later
        snapshot."""
        try:
            self.backend.quarantine(digest, cached=cached)
        except StorageError as exc:
            log.error("cannot quarantine chunk %s: %s", digest[:12], exc)
            return
        log.error("chunk %s failed its check; quarantined in %s", digest[:12], self.location)

    def verify(self, digest: str) -> bool:
        """True if chunk ``digest`` reads back whole from the store itself (not a cache); a
        bad one is quarantined. A missing one is False. Raises StorageError when the store
        cannot be read."""
        blob = self.backend.read(check_hash(digest), cached=False)
        if blob is None:
            return False
        if self._decode(digest, blob) is None:
            self._quarantine(digest, cached=False)
            return False
        return True

    def remove(self, digest: str) -> int:
        """Delete a chunk; return the bytes freed (0 if it was not there)."""
        return self.backend.delete(check_hash(digest)) or 0

    def __iter__(self) -> Iterator[str]:
        """Every chunk name in the store (temporary and quarantined files excluded)."""
        return (entry.digest for entry in self.backend.entries())

    def stored_bytes(self) -> int:
        """Bytes the store occupies (compressed chunks)."""
        return sum(entry.size for entry in self.backend.entries())

    def sync_dirs(self) -> None:
        """Make every chunk written so far durable, names included (fsync of the directories
        for a local store). Raises StorageError."""
        self.backend.sync()

    def sweep(
        self,
        marked: set[str],
        *,
        min_age_seconds: float = 0.0,
        dry_run: bool = False,
        now: float | None = None,
        on_removed: Callable[[str], None] | None = None,
    ) -> SweepReport:
        """Mark-and-sweep's sweep: delete every chunk not in ``marked``.

        ``marked`` must be every chunk any manifest names, from whatever holds the manifests
        (for a shared store: every node's). Chunks written less than ``min_age_seconds`` ago
        are kept, since a snapshot being saved writes its chunks before its manifest (the
        caller also holds the store's exclusive lock; the age covers writers that do not
        share that lock); so is one written again after the listing, when it is deleted.
        ``dry_run`` counts and deletes nothing; ``on_removed`` is called with each chunk
        deleted (a crash point in the fault tests). Raises StorageError.
        """
        now = time.time() if now is None else now
        # a chunk written again after the listing (a writer whose manifest is not recorded
        # yet) is spared when it is deleted: the listing's times are old by then
        before = now - min_age_seconds if min_age_seconds > 0 else None
        report = SweepReport()
        for entry in list(self.backend.entries()):
            if entry.digest in marked or now - entry.modified < min_age_seconds:
                report.kept += 1
                continue
            if dry_run:
                report.removed += 1
                report.freed_bytes += entry.size
                continue
            freed = self.backend.delete(entry.digest, before=before)
            if freed is None:
                report.kept += 1
                continue
            report.removed += 1
            report.freed_bytes += freed
            if on_removed is not None:
                on_removed(entry.digest)
        log.info(
            "sweep of %s: %d removed, %d kept, %d bytes%s",
            self.location,
            report.removed,
            report.kept,
            report.freed_bytes,
            " (dry run)" if dry_run else "",
        )
        return report

    # -- whole files --------------------------------------------------------------------------

    def put_file(
        self, path: Path, *, stats: PutStats | None = None, known: set[str] | None = None
    ) -> FileManifest:
        """Cut ``path`` into chunks, store the new ones, and return its manifest (``stats``:
        where the time went is added to it).

        ``known``: the chunks the store holds until this file's manifest is recorded (those
        of the manifest it replaces). When given, only those are skipped and every other
        chunk is written without asking the store whether it has it: another node's sweep of
        a shared store may remove one it has now (named by no manifest yet), whereas a chunk
        written afresh is spared as young.

        Holes (SEEK_HOLE) and all-zero chunks are recorded as ``None`` and not stored.
        Raises StorageError when the file cannot be read or a chunk cannot be written.
        """
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                count = -(-size // self.chunk_size)
                extents = data_ranges(f.fileno(), size)

                def work(index: int) -> tuple[str | None, int]:
                    start = index * self.chunk_size
                    length = min(self.chunk_size, size - start)
                    if not overlaps(extents, start, start + length):
                        return None, 0
                    t0 = time.perf_counter()
                    data = os.pread(f.fileno(), length, start)
                    if len(data) != length:
                        raise StorageError(
                            f"{path} changed while it was being stored", path=str(path)
                        )
                    if data == self._zero[:length]:
                        return None, 0
                    t1 = time.perf_counter()
                    digest = hashlib.sha256(data).hexdigest()
                    if stats is not None:
                        stats.add("read", t1 - t0)
                        stats.add("hash", time.perf_counter() - t1)
                    if known is not None and digest in known:
                        if stats is not None:
                            stats.count("known")
                        return digest, 0
                    return digest, self._put_known(digest, data, ask=known is None, stats=stats)

                with ThreadPoolExecutor(self.workers) as pool:
                    results = list(pool.map(work, range(count)))
        except OSError as exc:
            raise StorageError(f"cannot store {path}: {exc}", exc=exc, path=str(path)) from exc
        manifest = FileManifest(
            size=size,
            chunk_size=self.chunk_size,
            chunks=[digest for digest, _ in results],
            new_bytes=sum(n for _, n in results),
        )
        log.debug("stored %s: %d chunks, %d new bytes", path, count, manifest.new_bytes)
        return manifest

    def restore_file(
        self, manifest: FileManifest, dest: Path, *, snapshot_id: str | None = None
    ) -> None:
        """Write the file ``manifest`` describes to ``dest`` (sparse: zero chunks stay holes).

        Every chunk is verified. Raises CorruptData on a bad chunk (``dest`` is removed then),
        StorageError when the file system fails.
        """
        try:
            fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.ftruncate(fd, manifest.size)

                def work(item: tuple[int, str | None]) -> None:
                    index, digest = item
                    if digest is None:
                        return
                    data = self.get(digest, snapshot_id=snapshot_id)
                    start = index * manifest.chunk_size
                    expected = min(manifest.chunk_size, manifest.size - start)
                    if len(data) != expected:
                        raise CorruptData(
                            f"snapshot {snapshot_id}: chunk {digest[:12]} has {len(data)} bytes, "
                            f"the manifest says {expected}",
                            snapshot_id=snapshot_id,
                            chunk=digest,
                        )
                    os.pwrite(fd, data, start)

                with ThreadPoolExecutor(self.workers) as pool:
                    list(pool.map(work, enumerate(manifest.chunks)))
                os.fsync(fd)
            finally:
                os.close(fd)
        except (CorruptData, StorageError):
            dest.unlink(missing_ok=True)
            raise
        except OSError as exc:
            dest.unlink(missing_ok=True)
            raise StorageError(
                f"cannot restore {dest}: {exc}", exc=exc, path=str(dest), snapshot_id=snapshot_id
            ) from exc


_compressors = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    """A zstd compressor of ``level`` for this thread (one is not safe to share between
    threads; making one per chunk costs a context allocation each time)."""
    mine: dict[int, zstandard.ZstdCompressor] | None = getattr(_compressors, "by_level", None)
    if mine is None:
        mine = _compressors.by_level = {}
    if level not in mine:
        mine[level] = zstandard.ZstdCompressor(level=level)
    return mine[level]


def data_ranges(fd: int, size: int) -> list[tuple[int, int]]:
    """The (start, end) extents of ``fd`` that hold data, found with SEEK_DATA/SEEK_HOLE
    (all of it when they fail: a hole is never guessed)."""
    ranges: list[tuple[int, int]] = []
    pos = 0
    try:
        while pos < size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno != errno.ENXIO:  # only ENXIO says no data after pos
                    raise
                break
            end = os.lseek(fd, start, os.SEEK_HOLE)
            ranges.append((start, end))
            pos = end
    except (AttributeError, OSError):  # no SEEK_DATA support: treat everything as data
        return [(0, size)]
    return ranges


def overlaps(ranges: list[tuple[int, int]], start: int, end: int) -> bool:
    # Ranges are sorted and disjoint: the first one ending after ``start`` decides.
    i = bisect.bisect_right(ranges, (start, start))
    if i > 0 and ranges[i - 1][1] > start:
        return True
    return i < len(ranges) and ranges[i][0] < end


#: the store URL of a home when none is given (empty: the local ``chunks/`` directory)
STORE_ENV = "TORPOR_STORE"
#: the byte budget of a node's cache of a remote store, in MiB
CACHE_ENV = "TORPOR_STORE_CACHE_MIB"


def open_chunk_store(
    url: str | None,
    home: Path,
    *,
    endpoint_url: str | None = None,
    cache_bytes: int | None = None,
    client: Any = None,
) -> ChunkStore:
    """The chunk store a store URL names, for the torpor home ``home``.

    ``None`` or ``""`` is the embedded default: ``<home>/chunks``, zero configuration.
    ``s3://bucket/prefix`` keeps chunks in an S3-compatible bucket (see
    :mod:`torpor.sandbox.storage.object_store` for the endpoint and credentials), with this
    node's cache in ``<home>/chunk-cache`` bounded by ``cache_bytes`` (default
    ``$TORPOR_STORE_CACHE_MIB`` MiB, else 2 GiB). Raises InvalidArgument for another URL or
    a bad size, StorageError when boto3 is missing.
    """
    if not url:
        return ChunkStore(home / "chunks")
    if not url.startswith("s3://"):
        raise InvalidArgument(f"unknown chunk store {url!r}: use s3://bucket/prefix or none")
    from torpor.sandbox.storage.object_store import (
        DEFAULT_CACHE_BYTES,
        ChunkCache,
        S3ChunkBackend,
    )

    if cache_bytes is None:
        raw = os.environ.get(CACHE_ENV)
        try:
            cache_bytes = int(raw) * 1024 * 1024 if raw else DEFAULT_CACHE_BYTES
        except ValueError as exc:
            raise InvalidArgument(
                f"{CACHE_ENV} must be a whole number of MiB, not {raw!r}"
            ) from exc
    backend = S3ChunkBackend(
        url,
        cache=ChunkCache(home / "chunk-cache", cache_bytes),
        client=client,
        endpoint_url=endpoint_url,
    )
    # remote requests wait on the network, not the CPU: more of them in flight
    return ChunkStore(backend=backend, workers=8)


def home_chunk_store(paths: Paths) -> ChunkStore:
    """The chunk store of the home ``paths``: ``$TORPOR_STORE`` when set, else ``chunks/``.
    Raises as :func:`open_chunk_store`."""
    url = os.environ.get(STORE_ENV)
    return open_chunk_store(url, paths.home) if url else ChunkStore(paths.chunks)
