"""A node's own chunks in front of a shared store: how a cluster node saves snapshots.

In cluster mode a snapshot is saved as fast as on one machine, into the node's local chunk
directory, and then pushed to the shared S3 store in the background (the registry records when
it became durable there). :class:`TieredChunkBackend` is the
:class:`~torpor.sandbox.storage.chunk_backends.ChunkBackend` that makes this one store:

* **writes** go to the local directory only; :meth:`TieredChunkBackend.push` later copies a
  chunk to the shared store (skipped when it is there: names are content hashes);
* **reads** take the local copy when there is one, else the shared store's (through its own
  bounded cache): a node restores a snapshot taken elsewhere by pulling the chunks it lacks.
  The chunk store verifies every blob it gets, and a bad local copy is read again from the
  shared store (``cached=False``) before the chunk is judged corrupt; a bad copy is
  quarantined where it was read (:meth:`TieredChunkBackend.quarantine`);
* **existence** is asked of the local directory only, so saving costs no request to the
  shared store (a chunk the node lacks is written locally, and pushed only if the store
  lacks it too);
* **listing, deleting** (a local GC) touch the local directory only: the shared store is swept
  with the whole cluster's marks
  (:func:`~torpor.sandbox.storage.retention.sweep_shared_store`);
* **eviction** (:meth:`TieredChunkBackend.evict`): once a snapshot is durable, the local copies
  of its chunks move into the shared store's bounded node cache, which lets them go least
  recently used first; the node's ``chunks/`` holds only what is not durable yet.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from torpor.errors import CorruptData, StorageError
from torpor.sandbox.storage.chunk_backends import ChunkBackend, ChunkEntry, LocalChunkBackend

__all__ = ["TieredChunkBackend"]


class TieredChunkBackend:
    """``local`` (this node's directory) in front of ``remote`` (the shared store); see the
    module docstring. Every method raises StorageError when a medium fails."""

    shared = False  # a sweep of it is a sweep of the local directory alone
    caches = True

    def __init__(self, local: LocalChunkBackend, remote: ChunkBackend) -> None:
        self.local = local
        self.remote = remote
        self.location = f"{local.location} (pushed to {remote.location})"

    def exists(self, digest: str) -> bool:
        return self.local.exists(digest)

    def read(self, digest: str, *, cached: bool = True) -> bytes | None:
        if cached:
            blob = self.local.read(digest)
            if blob is not None:
                return blob
        blob = self.remote.read(digest, cached=cached)
        return blob if blob is not None or cached else self.local.read(digest)

    def write(self, digest: str, blob: bytes) -> int:
        return self.local.write(digest, blob)

    def repair(self, digest: str, blob: bytes) -> None:
        """Replace this node's copy of chunk ``digest``, found bad, with ``blob``, the shared
        store's copy found whole (else a save of the same data would skip it as stored)."""
        if self.local.exists(digest):
            self.local.write(digest, blob)

    def delete(self, digest: str, *, before: float | None = None) -> int | None:
        return self.local.delete(digest, before=before)

    def quarantine(self, digest: str, *, cached: bool = True) -> None:
        """Move aside the copy the bad blob came from: this node's when it has one (reads
        take it first), else the shared store's, so the next push of the same data writes
        it again instead of skipping it as there already. ``cached=False``: the copy a read
        of the store itself gave, the shared store's when it has one (a scrub of it must
        not move aside this node's copy, maybe the only good one, and leave the bad)."""
        if cached and self.local.exists(digest):
            self.local.quarantine(digest)
        elif cached or self.remote.exists(digest) or not self.local.exists(digest):
            self.remote.quarantine(digest)
        else:
            self.local.quarantine(digest)

    def entries(self) -> Iterator[ChunkEntry]:
        return self.local.entries()

    def sync(self) -> None:
        self.local.sync()

    def push(self, digest: str, check: Callable[[bytes], None]) -> int:
        """Copy chunk ``digest`` to the shared store unless it is there; ``check(blob)``
        raises CorruptData for a bad local copy before it could go. Returns the bytes sent.
        One there already is made young when the store can (``keep``): the snapshot naming
        it was recorded before its push, but a sweep whose marks were read before that
        deletes old chunks nothing else names. Raises CorruptData (the chunk is in neither
        place), StorageError."""
        keep = getattr(self.remote, "keep", None)
        if keep(digest) if keep is not None else self.remote.exists(digest):
            return 0
        blob = self.local.read(digest)
        if blob is None:
            raise CorruptData(
                f"chunk {digest[:12]} is neither on this node ({self.local.location}) nor in "
                f"{self.remote.location}",
                chunk=digest,
            )
        check(blob)
        try:
            return self.remote.write(digest, blob)
        except StorageError as exc:
            exc.data.setdefault("chunk", digest)
            raise

    def evict(self, digest: str) -> int:
        """Move chunk ``digest``, which the shared store holds (the caller pushed it), from
        the local directory into the remote's bounded cache (when it has one: else the local
        copy just goes); reads then find it there, or in the shared store once the cache let
        it go. Returns the local bytes freed (0: no local copy). Raises StorageError."""
        blob = self.local.read(digest)
        if blob is None:
            return 0
        cache = getattr(self.remote, "cache", None)
        if cache is not None:
            cache.put(digest, blob)
        return self.local.delete(digest) or 0
