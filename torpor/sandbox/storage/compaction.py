"""Compaction of long-paused sandboxes: their RAM file into the chunk store, out of the disk.

A paused sandbox keeps its RAM file in its directory for a fast wake: a sparse file holding
every page the guest touched (173 MiB for an idle 512 MiB guest), most of it the same as the
template's booted RAM it was cloned from. ext4 has no reflink, so each paused sandbox owns all
of those bytes. :func:`compact` stores the RAM file in the content-addressed chunk store (the
chunks it shares with the template's RAM and with its siblings are stored once), writes
``compacted.json`` (the RAM's manifest, and which chunks equal the template's at the same
offset), then empties the RAM file to a hole of the same size. What the sandbox owns after
that: its device state, its disk overlay and the chunks nobody else has.

:func:`expand` rebuilds the RAM file before anything reads it (a wake, a snapshot, a fork):
chunks equal to the template's are copied from the template's RAM file by the kernel
(``copy_file_range`` of its data ranges only, so its holes stay holes; no hashing: the
template file is the one every fork is cloned from, and its identity is checked), the others
are read from the chunk store and verified. A chunk that differs from the template's in at
most half its pages also gets a *patch*: those pages, stored as one chunk of their own. With
the template intact, such a chunk is the template's copy plus its patch: an agent that changed
little differs in ~140 of ~550 chunks but in only ~500 pages (2 MiB instead of 36 MiB read,
decompressed and hashed; that costs ~4x a template copy per byte). The whole chunks stay in the
store too, for a template that changed (every chunk from the store then).

A wake needs the file whole only when QEMU loads the device state (devices read guest memory
as they load), not when QEMU starts and maps it: :func:`begin_expand` gives the file its size,
the manager starts QEMU, and :meth:`Expansion.run` fills the file meanwhile
(``Machine.wake(ram_ready=...)``).

Crash safety: the manifest is durable before the RAM file is emptied, and it goes only when
the RAM file is whole and durable (``expand(durable=True)``, fsync first: a snapshot or fork
reads the file later) or when a wake has consumed the saved state the manifest was made with
(``expand(durable=False)`` then :func:`settle`: the manager's wake path, which skips the fsync
of ~150 MiB since until the state is consumed a crash finds the manifest and rebuilds again,
and after it the RAM is the running guest's, lost in a crash like any running machine's). So
a crash leaves either the RAM file whole, or the manifest that rebuilds it; :func:`expand` is
idempotent. The manifest records the sha256 of the saved state it pairs with: one older than
the state (a crash between a wake and its settle, then a pause) is stale and dropped, never
applied. A directory with the manifest is never woken as it is (the manager expands first).

Where a wake's time goes is printed by ``bench/compaction.py``.

Garbage collection keeps every chunk and patch a ``compacted.json`` names (see
:func:`referenced_by_compacted`).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torpor._files import open_regular
from torpor.errors import CorruptData, StorageError
from torpor.sandbox.storage.chunk_backends import is_hash
from torpor.sandbox.storage.chunks import ChunkStore, FileManifest, data_ranges, overlaps
from torpor.sandbox.vm.disk import copy_range, fsync_dir

__all__ = [
    "MARKER",
    "CompactionReport",
    "ExpandReport",
    "Expansion",
    "begin_expand",
    "compact",
    "expand",
    "is_compacted",
    "owned_bytes",
    "rebuild",
    "referenced_by_compacted",
    "settle",
    "template_hashes",
]

log = logging.getLogger(__name__)

#: the manifest of a compacted sandbox's RAM, in its directory
MARKER = "compacted.json"
_VERSION = 2  # 1: no patches (every chunk that differs from the template's stored whole)
#: the unit of a patch: a guest page
PAGE = 4096


@dataclass
class CompactionReport:
    """What one compaction did."""

    sandbox_dir: str
    ram_bytes_before: int  # bytes the RAM file held on disk
    ram_bytes_after: int
    new_chunk_bytes: int  # bytes this compaction added to the chunk store
    from_template: int  # chunks equal to the template's at the same offset
    chunks: int  # non-zero chunks in all
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def is_compacted(directory: Path) -> bool:
    """Whether ``directory``'s RAM lives in the chunk store (it must be expanded to wake)."""
    return (directory / MARKER).is_file()


def _allocated(path: Path) -> int:
    try:
        return path.stat().st_blocks * 512
    except FileNotFoundError:
        return 0


def _identity(path: Path) -> dict[str, Any]:
    st = path.stat()
    return {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def template_hashes(template_ram: Path, chunk_size: int) -> list[str | None]:
    """The sha256 of each chunk of the template's RAM (None for a hole or zeros): what a
    sandbox's chunk is compared with, here and by :mod:`~torpor.sandbox.storage.pauses`."""
    zero = bytes(chunk_size)
    with open(template_ram, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        ranges = data_ranges(f.fileno(), size)
        out: list[str | None] = []
        for index in range(-(-size // chunk_size)):
            start = index * chunk_size
            length = min(chunk_size, size - start)
            if not overlaps(ranges, start, start + length):
                out.append(None)
                continue
            data = os.pread(f.fileno(), length, start)
            out.append(None if data == zero[:length] else hashlib.sha256(data).hexdigest())
    return out


def _store_ram(
    ram: Path, template_ram: Path | None, theirs: list[str | None], chunks: ChunkStore
) -> tuple[FileManifest, list[int], list[list[Any]]]:
    """Put ``ram`` into ``chunks``: its manifest (every chunk's sha256, None for zeros), the
    chunks equal to the template's at the same offset (``theirs``), and the patches.

    A chunk that differs from the template's in at most half its pages is stored as a patch
    (those pages, one after the other) on the template's chunk (stored too, once for every
    sandbox of the template), not whole: [index, patch, [page numbers], template's chunk or
    None for zeros]. Any other chunk is stored whole. Raises StorageError, OSError.
    """
    zero = bytes(chunks.chunk_size)
    per_chunk = chunks.chunk_size // PAGE
    mine_fd = open_regular(ram, os.O_RDONLY)  # the sandbox's own file, never a link out
    with os.fdopen(mine_fd, "rb") as mine, open(template_ram or os.devnull, "rb") as base_file:
        size = os.fstat(mine.fileno()).st_size
        template_size = os.fstat(base_file.fileno()).st_size
        extents = data_ranges(mine.fileno(), size)

        def work(index: int) -> tuple[str | None, int, list[Any] | None]:
            start = index * chunks.chunk_size
            length = min(chunks.chunk_size, size - start)
            if not overlaps(extents, start, start + length):
                return None, 0, None
            a = os.pread(mine.fileno(), length, start)
            if len(a) != length:
                raise StorageError(f"{ram} changed while it was being stored", path=str(ram))
            if a == zero[:length]:
                return None, 0, None
            digest = hashlib.sha256(a).hexdigest()
            base = theirs[index] if index < len(theirs) else None
            whole_base = start + length <= template_size  # a base the chunk's own length
            if template_ram is not None and base != digest and whole_base and not length % PAGE:
                b = os.pread(base_file.fileno(), length, start)
                pages = [
                    p
                    for p in range(length // PAGE)
                    if a[p * PAGE : (p + 1) * PAGE] != b[p * PAGE : (p + 1) * PAGE]
                ]
                if len(pages) * 2 <= per_chunk:
                    added = 0
                    if base is not None:
                        base, added = chunks.put(b)
                    patch, more = chunks.put(b"".join(a[p * PAGE : (p + 1) * PAGE] for p in pages))
                    return digest, added + more, [index, patch, pages, base]
            return digest, chunks.put(a)[1], None

        with ThreadPoolExecutor(chunks.workers) as pool:
            results = list(pool.map(work, range(-(-size // chunks.chunk_size))))
    manifest = FileManifest(
        size=size,
        chunk_size=chunks.chunk_size,
        chunks=[digest for digest, _, _ in results],
        new_bytes=sum(n for _, n, _ in results),
    )
    equal = [
        i
        for i, d in enumerate(manifest.chunks)
        if d is not None and i < len(theirs) and theirs[i] == d
    ]
    return manifest, equal, [patch for _, _, patch in results if patch is not None]


def compact(directory: Path, chunks: ChunkStore, template_ram: Path | None) -> CompactionReport:
    """Move the hibernated machine's RAM file in ``directory`` into ``chunks``.

    The machine must be paused (no QEMU on the directory: the caller holds the sandbox's lock).
    ``template_ram`` is the RAM file the sandbox was cloned from (None: no template fast path
    at wake). Idempotent: a directory already compacted is left as it is. Raises StorageError
    (nothing changed then: the RAM file is emptied only after the manifest is durable).
    """
    started = time.perf_counter()
    ram = directory / "ram"
    if is_compacted(directory):
        try:
            stale = _is_stale(directory, _read_marker(directory))
        except CorruptData:  # left for expand to report; nothing is overwritten here
            stale = False
        if not stale:
            return CompactionReport(str(directory), 0, 0, 0, 0, 0, 0.0)
        log.warning("compaction: %s's manifest predates its saved state; dropped", directory)
        _drop_marker(directory, None)
    before = _allocated(ram)
    state = _state_digest(directory)
    template: dict[str, Any] | None = None
    theirs: list[str | None] = []
    if template_ram is not None and template_ram.is_file():
        try:
            template = _identity(template_ram)
            theirs = template_hashes(template_ram, chunks.chunk_size)
        except OSError as exc:
            log.warning("compaction: template RAM %s unreadable (%s)", template_ram, exc)
            template = None
    try:
        manifest, equal, patches = _store_ram(
            ram, template_ram if template is not None else None, theirs, chunks
        )
    except OSError as exc:
        raise StorageError(f"cannot store {ram}: {exc}", exc=exc, path=str(ram)) from exc
    chunks.sync_dirs()
    body = {
        "version": _VERSION,
        "ram": manifest.to_json(),
        "template": template,
        "from_template": equal,
        "store": chunks.location,
        "state": state,  # the saved state this RAM pairs with (see _is_stale)
        "page": PAGE,
        "patches": patches,  # [chunk index, patch, [pages that differ], template's chunk]
    }
    _write_json(directory / MARKER, body)
    try:
        with os.fdopen(open_regular(ram, os.O_RDWR), "r+b") as f:
            f.truncate(0)
            f.truncate(manifest.size)
            os.fsync(f.fileno())
    except OSError as exc:
        raise StorageError(
            f"cannot empty {ram} after compacting it: {exc}", exc=exc, path=str(ram)
        ) from exc
    report = CompactionReport(
        sandbox_dir=str(directory),
        ram_bytes_before=before,
        ram_bytes_after=_allocated(ram),
        new_chunk_bytes=manifest.new_bytes,
        from_template=len(equal),
        chunks=sum(c is not None for c in manifest.chunks),
        seconds=time.perf_counter() - started,
    )
    log.info(
        "compacted %s: RAM %d -> %d bytes on disk, %d new chunk bytes, %d/%d chunks as in the "
        "template (%.2f s)",
        directory.name,
        report.ram_bytes_before,
        report.ram_bytes_after,
        report.new_chunk_bytes,
        report.from_template,
        report.chunks,
        report.seconds,
    )
    return report


def _read_marker(directory: Path) -> dict[str, Any]:
    path = directory / MARKER
    try:
        body: dict[str, Any] = json.loads(path.read_text())
        if body.get("version") not in (1, _VERSION):
            raise ValueError(f"unknown version {body.get('version')!r}")
        FileManifest.from_json(body["ram"])
        [int(i) for i in body.get("from_template", [])]
        _read_patches(body)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CorruptData(
            f"{path} is unreadable ({exc}): the sandbox's RAM cannot be rebuilt",
            exc=exc,
            path=str(path),
        ) from exc
    return body


@dataclass
class ExpandReport:
    """What one rebuild of a compacted RAM file did, and where its time went.

    ``template_seconds``, ``store_seconds`` and ``write_seconds`` are summed over the worker
    threads (they overlap: their sum can exceed ``seconds``, the wall time of the whole call).
    """

    seconds: float = 0.0
    template_bytes: int = 0  # copied from the template's RAM file (copy_file_range)
    template_seconds: float = 0.0
    store_bytes: int = 0  # read from the chunk store (raw bytes after decompression)
    store_seconds: float = 0.0  # reading, decompressing and verifying those chunks
    write_seconds: float = 0.0  # writing them into the RAM file
    sync_seconds: float = 0.0  # fsync of the RAM file and the directory (durable only)
    durable: bool = True
    stale: bool = False  # the manifest was older than the saved state: dropped, nothing rebuilt

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _state_digest(directory: Path) -> str | None:
    """sha256 of the saved device state in ``directory`` (None: there is none). Raises
    StorageError when it cannot be read."""
    path = directory / "state"
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StorageError(f"cannot read {path}: {exc}", exc=exc, path=str(path)) from exc


def _is_stale(directory: Path, body: dict[str, Any]) -> bool:
    """Whether the manifest no longer describes the RAM the saved state pairs with: the state
    it was made with was consumed by a wake (and maybe replaced by a later pause's)."""
    made_with = body.get("state")
    return made_with is not None and _state_digest(directory) != made_with


def settle(directory: Path) -> bool:
    """Drop the manifest of ``directory`` once a wake has consumed the saved state it was made
    with (the RAM file is then the running guest's: the manifest describes a past). Returns
    whether a manifest was dropped. Never raises: a manifest left by a failure here is found
    stale by the next :func:`expand` or :func:`compact` (its state is gone) and dropped then.
    """
    marker = directory / MARKER
    try:
        body = json.loads(marker.read_text())
        if not isinstance(body, dict) or not _is_stale(directory, body):
            return False
        marker.unlink()
    except FileNotFoundError:
        return False
    except (OSError, ValueError, StorageError) as exc:
        log.warning("cannot drop the stale manifest %s: %s", marker, exc)
        return False
    log.info("dropped %s: its saved state was consumed by a wake", marker)
    return True


def _read_patches(body: dict[str, Any]) -> dict[int, tuple[str, list[int], str | None]]:
    """The manifest's patches by chunk index: (patch, pages, the template's chunk or None for
    zeros). Raises ValueError, TypeError, KeyError."""
    if not body.get("patches"):
        return {}
    if int(body["page"]) != PAGE:
        raise ValueError(f"patches of {body['page']}-byte pages")
    out: dict[int, tuple[str, list[int], str | None]] = {}
    for index, patch, pages, base in body["patches"]:
        if not is_hash(patch) or not isinstance(pages, list) or not pages:
            raise ValueError(f"bad patch of chunk {index!r}")
        if base is not None and not is_hash(base):
            raise ValueError(f"bad base of chunk {index!r}")
        out[int(index)] = (patch, [int(p) for p in pages], base)
    return out


def expand(
    directory: Path,
    chunks: ChunkStore,
    *,
    sandbox_id: str | None = None,
    durable: bool = True,
) -> float:
    """Rebuild the RAM file of a compacted ``directory``; return the seconds it took (0 when
    the directory was not compacted). See :func:`rebuild`, which also says where the time
    went. Raises as :func:`rebuild`."""
    return rebuild(directory, chunks, sandbox_id=sandbox_id, durable=durable).seconds


def rebuild(
    directory: Path,
    chunks: ChunkStore,
    *,
    sandbox_id: str | None = None,
    durable: bool = True,
) -> ExpandReport:
    """Rebuild the RAM file of a compacted ``directory`` from the template's RAM and the
    chunk store (every chunk read from the store is verified): :func:`begin_expand`, then
    :meth:`Expansion.run`.

    ``durable=True``: the RAM file is fsynced, then the manifest is dropped. ``durable=False``
    (a wake that follows at once): no fsync, and the manifest stays until the wake has
    consumed the saved state (:func:`settle`): until then a crash finds the manifest and
    rebuilds again, after it the RAM belongs to the running guest. A manifest older than the
    saved state (a crash between a wake and its :func:`settle`, then a pause) is stale: it is
    dropped and the RAM file left alone.

    Raises CorruptData (a chunk bad or missing, the manifest unreadable: the manifest stays, so
    nothing is lost by trying again once the chunk is back), StorageError.
    """
    job, stale = _begin(directory, chunks, sandbox_id, durable)
    return ExpandReport(durable=durable, stale=stale) if job is None else job.run()


def begin_expand(
    directory: Path,
    chunks: ChunkStore,
    *,
    sandbox_id: str | None = None,
    durable: bool = True,
) -> Expansion | None:
    """Start rebuilding the RAM file of a compacted ``directory``: read its manifest (a stale
    one is dropped: None), check the template's RAM, and give the RAM file its size (emptied
    first if a crash left data in it). From here a QEMU may map the file: :meth:`Expansion.run`
    fills it, and the guest's state must be loaded only after that. None when there is
    nothing to rebuild. Raises as :func:`rebuild`.
    """
    return _begin(directory, chunks, sandbox_id, durable)[0]


def _template_of(directory: Path, recorded: object) -> Path | None:
    """The template RAM ``recorded`` in ``directory``'s manifest if it is one: a
    ``.../snapshot/ram`` that lies, links followed, within the ``templates`` of a directory
    above ``directory`` (the home; a template's ``snapshot`` links to its current build,
    and ``templates`` itself may be a link). The manifest lies where the sandbox's QEMU uid
    can write, so another path is never read."""
    if not isinstance(recorded, str):
        return None
    named = Path(recorded)
    if named.name != "ram" or named.parent.name != "snapshot":
        return None
    real = named.resolve()  # the links are the home's own (root's), not the sandbox's
    homes = Path(directory).absolute().parents
    return named if any(real.is_relative_to((h / "templates").resolve()) for h in homes) else None


def _begin(
    directory: Path, chunks: ChunkStore, sandbox_id: str | None, durable: bool
) -> tuple[Expansion | None, bool]:
    """:func:`begin_expand`, and whether a stale manifest was dropped."""
    if not is_compacted(directory):
        return None, False
    started = time.perf_counter()
    body = _read_marker(directory)
    who = sandbox_id or directory.name
    if _is_stale(directory, body):
        log.warning("expand %s: its manifest predates the saved state; dropped", who)
        _drop_marker(directory, sandbox_id)
        return None, True
    manifest = FileManifest.from_json(body["ram"])
    from_template = {int(i) for i in body.get("from_template", [])}
    patches = _read_patches(body)
    template = body.get("template")
    template_fd: int | None = None
    if template and (from_template or patches):
        tpath = _template_of(directory, template.get("path"))
        try:
            if tpath is not None and _identity(tpath) == template:
                template_fd = os.open(tpath, os.O_RDONLY)
        except OSError:
            template_fd = None
        if template_fd is None:
            log.warning("expand %s: template RAM changed; every chunk from the store", directory)
            from_template = set()  # patches apply to the template's chunks from the store
    fd = -1
    try:
        # the template's holes stay holes: only its data ranges are copied
        tdata = [] if template_fd is None else data_ranges(template_fd, manifest.size)
        fd = open_regular(directory / "ram", os.O_WRONLY | os.O_CREAT)
        st = os.fstat(fd)
        if st.st_blocks or st.st_size != manifest.size:
            # data left by a crash before compaction emptied it, or by an interrupted
            # expand. Only then: on ext4 a truncation to 0 makes the close start writing
            # back the whole rebuilt file at once, in the middle of the wake that follows
            os.ftruncate(fd, 0)
            os.ftruncate(fd, manifest.size)
    except OSError as exc:
        for f in (fd, -1 if template_fd is None else template_fd):
            if f >= 0:
                os.close(f)
        raise StorageError(
            f"sandbox {who}: cannot rebuild its RAM: {exc}", exc=exc, sandbox_id=sandbox_id
        ) from exc
    job = Expansion(
        directory=directory,
        chunks=chunks,
        sandbox_id=sandbox_id,
        durable=durable,
        manifest=manifest,
        from_template=from_template,
        patches=patches,
        template_fd=template_fd,
        template_data=tdata,
        fd=fd,
        started=started,
    )
    return job, False


@dataclass
class Expansion:
    """A rebuild begun by :func:`begin_expand` (the RAM file has its size and is open);
    :meth:`run` fills it, once."""

    directory: Path
    chunks: ChunkStore
    sandbox_id: str | None
    durable: bool
    manifest: FileManifest
    from_template: set[int]
    patches: dict[int, tuple[str, list[int], str | None]]
    template_fd: int | None
    template_data: list[tuple[int, int]]
    fd: int
    started: float

    @property
    def who(self) -> str:
        return self.sandbox_id or self.directory.name

    def run(self) -> ExpandReport:
        """Fill the RAM file: the template's data ranges for the chunks equal to it (and the
        patched ones, then their pages), the other chunks from the store, verified. Closes
        the files whatever happens. Raises as :func:`rebuild`."""
        report = ExpandReport(durable=self.durable)
        try:
            try:
                with ThreadPoolExecutor(self.chunks.workers) as pool:
                    for part in pool.map(self._chunk, enumerate(self.manifest.chunks)):
                        for key, value in part.items():
                            setattr(report, key, getattr(report, key) + value)
                if self.durable:
                    t0 = time.perf_counter()
                    os.fsync(self.fd)
                    report.sync_seconds += time.perf_counter() - t0
            finally:
                self.close()
        except CorruptData as exc:
            exc.data["sandbox_id"] = self.sandbox_id
            exc.message = f"sandbox {self.who}: cannot rebuild its RAM: {exc.message}"
            exc.args = (exc.message,)
            raise
        except OSError as exc:
            raise StorageError(
                f"sandbox {self.who}: cannot rebuild its RAM: {exc}",
                exc=exc,
                sandbox_id=self.sandbox_id,
            ) from exc
        if self.durable:
            t0 = time.perf_counter()
            _drop_marker(self.directory, self.sandbox_id)
            report.sync_seconds += time.perf_counter() - t0
        report.seconds = time.perf_counter() - self.started
        log.info(
            "expanded %s's RAM in %.3f s (%d bytes from the template, %d from the store%s)",
            self.who,
            report.seconds,
            report.template_bytes,
            report.store_bytes,
            "" if self.durable else "; manifest kept until the wake",
        )
        return report

    def close(self) -> None:
        """Close the files (idempotent): a rebuild begun and never run leaves the manifest,
        so the next wake starts again."""
        for name in ("fd", "template_fd"):
            f = getattr(self, name)
            if f is not None and f >= 0:
                os.close(f)
                setattr(self, name, -1)

    def _copy(self, start: int, end: int) -> int:
        """Copy the template's data in [start, end) into the RAM file; return the bytes."""
        assert self.template_fd is not None
        done = 0
        for lo, hi in _clip(self.template_data, start, end):
            # the template may lie on another file system (a home split across them):
            # copy_range falls back to copying by hand there
            copy_range(self.template_fd, self.fd, lo, hi)
            if os.fstat(self.template_fd).st_size < hi:
                raise StorageError(f"template RAM ended before {hi}")
            done += hi - lo
        return done

    def _chunk(self, item: tuple[int, str | None]) -> dict[str, float]:
        """Write one chunk into the RAM file; return what it moved and how long it took."""
        index, digest = item
        if digest is None:
            return {}
        m = self.manifest
        start = index * m.chunk_size
        length = min(m.chunk_size, m.size - start)
        t0 = time.perf_counter()
        if index in self.from_template:
            n = self._copy(start, start + length)
            return {"template_bytes": n, "template_seconds": time.perf_counter() - t0}
        if index in self.patches:  # the template's chunk, then the pages that differ
            patch, pages, base = self.patches[index]
            n = 0
            whole: bytearray | None = None
            if self.template_fd is not None:
                n = self._copy(start, start + length)
            else:  # the template's file changed: its chunk from the store, patched, checked
                whole = bytearray(
                    self.chunks.get(base, snapshot_id=None) if base else bytes(length)
                )
            t1 = time.perf_counter()
            data = self.chunks.get(patch, snapshot_id=None)
            t2 = time.perf_counter()
            if (
                len(data) != len(pages) * PAGE
                or max(pages) * PAGE >= length
                or (whole is not None and len(whole) != length)
            ):
                raise CorruptData(
                    f"patch {patch[:12]} of chunk {index} does not fit its {len(pages)} pages",
                    sandbox_id=self.sandbox_id,
                    chunk=patch,
                )
            view = memoryview(data)
            if whole is None:
                for k, page in enumerate(pages):
                    os.pwrite(self.fd, view[k * PAGE : (k + 1) * PAGE], start + page * PAGE)
            else:
                for k, page in enumerate(pages):
                    whole[page * PAGE : (page + 1) * PAGE] = view[k * PAGE : (k + 1) * PAGE]
                if hashlib.sha256(whole).hexdigest() != digest:
                    raise CorruptData(
                        f"chunk {digest[:12]} rebuilt from the template's chunk and its patch "
                        "does not match its hash",
                        sandbox_id=self.sandbox_id,
                        chunk=digest,
                    )
                os.pwrite(self.fd, whole, start)
            copied = t1 - t0 if whole is None else 0.0  # else: the base came from the store
            return {
                "template_bytes": n,
                "template_seconds": copied,
                "store_bytes": len(data) + (0 if whole is None else length),
                "store_seconds": t2 - t0 - copied,
                "write_seconds": time.perf_counter() - t2,
            }
        data = self.chunks.get(digest, snapshot_id=None)
        t1 = time.perf_counter()
        if len(data) != length:
            raise CorruptData(
                f"chunk {digest[:12]} has {len(data)} bytes, the RAM manifest says {length}",
                sandbox_id=self.sandbox_id,
                chunk=digest,
            )
        os.pwrite(self.fd, data, start)
        return {
            "store_bytes": length,
            "store_seconds": t1 - t0,
            "write_seconds": time.perf_counter() - t1,
        }


def _clip(ranges: list[tuple[int, int]], start: int, end: int) -> Iterator[tuple[int, int]]:
    """The parts of the sorted, disjoint ``ranges`` inside [start, end)."""
    i = max(0, bisect.bisect_right(ranges, (start, start)) - 1)
    while i < len(ranges) and ranges[i][0] < end:
        lo, hi = max(ranges[i][0], start), min(ranges[i][1], end)
        if lo < hi:
            yield lo, hi
        i += 1


def _drop_marker(directory: Path, sandbox_id: str | None) -> None:
    try:
        (directory / MARKER).unlink(missing_ok=True)
        fsync_dir(directory)
    except OSError as exc:
        raise StorageError(
            f"sandbox {sandbox_id or directory.name}: cannot drop {MARKER}: {exc}",
            exc=exc,
            sandbox_id=sandbox_id,
        ) from exc


def owned_bytes(directory: Path, chunks: ChunkStore, template_ram: Path | None = None) -> int:
    """Bytes ``directory`` owns on this disk (allocated blocks of its files) plus, when it is
    compacted, the stored chunks its RAM needs that the template's RAM does not have at the
    same offset (the ones no template-mate shares by construction)."""
    local = sum(_allocated(f) for f in directory.iterdir() if f.is_file() and not f.is_symlink())
    if not is_compacted(directory):
        return local
    body = _read_marker(directory)
    manifest = FileManifest.from_json(body["ram"])
    equal = {int(i) for i in body.get("from_template", [])}
    patches = _read_patches(body)
    own = {
        d
        for i, d in enumerate(manifest.chunks)
        if d is not None and i not in equal and i not in patches
    }
    own |= {patch for patch, _, _ in patches.values()}  # bases are the template's chunks
    stored = {e.digest: e.size for e in chunks.backend.entries() if e.digest in own}
    return local + sum(stored.values())


def referenced_by_compacted(sandboxes_root: Path) -> Iterator[str]:
    """Every chunk some compacted sandbox under ``sandboxes_root`` needs (the GC's marks).
    Raises CorruptData for an unreadable manifest (the caller must then sweep nothing)."""
    if not sandboxes_root.is_dir():
        return
    for d in sandboxes_root.iterdir():
        marker = d / MARKER
        if marker.is_file():
            body = _read_marker(d)
            yield from FileManifest.from_json(body["ram"]).hashes()
            for patch, _, base in _read_patches(body).values():
                yield patch
                if base is not None:
                    yield base


def _write_json(path: Path, body: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(body, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise StorageError(f"cannot write {path}: {exc}", exc=exc, path=str(path)) from exc
