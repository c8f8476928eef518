"""Durable pauses: a paused sandbox's directory pushed to the shared chunk store, and rebuilt
from it on another node.

In cluster mode (``torpor serve --cluster ... --store s3://...``) a pause stays local and fast
(hibernate into the sandbox's directory); then :func:`push_pause` stores what a wake needs in
the content-addressed chunk store, and the manager records the returned manifest in the
registry (PostgreSQL, ``torpor_registry.pauses``). Once recorded, the pause is *durable*: the
sandbox wakes on any node with the same template, even if its node is gone.

What is pushed: every regular file of the directory but its logs, sockets and pid file — the
RAM file, the device state, ``machine.json``, the disk overlay. The RAM file is deduplicated
against the template's booted RAM it was cloned from (as
:mod:`~torpor.sandbox.storage.compaction` does): a chunk equal to the template's at the same
offset is not uploaded, the manifest lists its index in ``from_template``, and
:func:`rebuild_pause` copies it from the node's own template. The disk overlay is stored as
an overlay on the template's disk (an overlay on a deeper chain, e.g. after a restore, is
first folded onto the template's disk in a copy); the rebuild points it at the node's own
template disk. ``machine.json``'s paths under the template's directory are moved to the
node's. The images of the volumes attached (the disks of ``machine.json``: flushed, as the
guest synced before it hibernated) are stored too (``volumes``: only the chunks the store
lacks go up); a rebuild with ``volumes_dir`` writes them there and points ``machine.json`` at
them. A sandbox with drives attached is refused (:class:`InvalidArgument`: a drive is a
directory of its node, so the sandbox wakes only there), and so is a template build the
waking node does not have (:class:`TemplateNotFound`).

The manifest::

    {"version": 1, "files": {"ram": <FileManifest>, "state": ..., "disk.qcow2": ...},
     "from_template": [chunk indices of ram], "disk_backing": "template" | null,
     "template": {"name", "build_id", "directory"}, "new_bytes": N,
     "volumes": {<volume id>: <FileManifest>}, "volumes_dir": <where they were>}

``files`` is the key :meth:`~torpor.sandbox.registry.postgres.PostgresRegistry.referenced_chunks`
marks from, so a sweep of the shared store keeps every chunk a pause needs.

:func:`begin_rebuild` writes every file but the RAM's content into a temporary sibling
directory, gives the RAM file its size and a :data:`FILLING` marker, and renames it into
place; :meth:`RamFill.run` then fills the RAM (the template's chunks copied from the node's
own template, the others fetched from the store, verified) and removes the marker last. In
between a QEMU may start on the directory (it only maps the RAM file), so a cross-node wake
starts QEMU while the RAM is fetched and loads the device state once it is whole
(``Machine.wake(ram_ready=...)``). A directory with the marker is never taken for a whole
pause (:func:`is_whole`): a crash mid-fill leaves one the next wake rebuilds.
:func:`rebuild_pause` does both steps at once. A wake that follows at once asks for no fsync
(``durable=False``, as :func:`~torpor.sandbox.storage.compaction.expand` does): the marker
then stays until the wake has consumed the saved state (:func:`settle_fill`), so until then a
crash finds it and rebuilds again, and after it the RAM is the running guest's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from torpor.errors import CorruptData, InvalidArgument, StorageError, TemplateNotFound
from torpor.sandbox.storage.chunks import (
    ChunkStore,
    FileManifest,
    PutStats,
    data_ranges,
    overlaps,
)
from torpor.sandbox.storage.compaction import template_hashes
from torpor.sandbox.storage.records import rewrite_prefix
from torpor.sandbox.storage.snapshots import backing_file
from torpor.sandbox.vm.disk import fsync_dir, rebase, set_backing

__all__ = [
    "FILLING",
    "MANIFEST_VERSION",
    "RamFill",
    "begin_rebuild",
    "is_whole",
    "manifest_chunks",
    "push_pause",
    "rebuild_pause",
    "settle_fill",
    "template_identity",
    "warm_template",
]

log = logging.getLogger(__name__)

MANIFEST_VERSION = 1
#: a rebuilt directory whose RAM file is still being filled (see the module docstring)
FILLING = "rebuilding"
#: files of a sandbox directory a wake does not need (logs, sockets, pid, markers)
_SKIP = {"console.log", "qemu.log", "qemu.pid", "qmp.sock", "agent.sock", ".lock", FILLING}


def template_identity(template_dir: Path) -> dict[str, Any] | None:
    """The name, build and directory of the template at ``template_dir`` (None: it has no
    ``template.json``, e.g. a test engine's)."""
    try:
        body = json.loads((template_dir / "template.json").read_text())
    except (OSError, ValueError):
        return None
    return {
        "name": str(body.get("name", template_dir.name)),
        "build_id": str(body.get("build_id", "")),
        "directory": str(body.get("directory", template_dir)),
    }


@lru_cache(maxsize=8)
def _template_hashes(path: str, size: int, mtime_ns: int, chunk_size: int) -> list[str | None]:
    """:func:`~torpor.sandbox.storage.compaction.template_hashes`, cached by the file's
    identity, since every pause of its sandboxes compares against it."""
    return template_hashes(Path(path), chunk_size)


def warm_template(template_dir: Path, chunk_size: int) -> bool:
    """Hash the chunks of the template's booted RAM now (a node does it once, at start), so
    neither the first push nor the first rebuild of its sandboxes waits for it. False when
    the template has no RAM file. Raises OSError."""
    ram = (template_dir / "snapshot").resolve() / "ram"
    if not ram.is_file():
        return False
    st = ram.stat()
    _template_hashes(str(ram), st.st_size, st.st_mtime_ns, chunk_size)
    return True


def _put_chunks(
    path: Path,
    chunks: ChunkStore,
    template: Path | None,
    known: set[str],
    stats: PutStats,
) -> tuple[FileManifest, list[int]]:
    """Store ``path`` but its chunks equal to ``template``'s at the same offset (the RAM
    against the template's booted RAM) and those ``known`` to be in the store; return its
    manifest and the indices of the template's chunks.

    A chunk neither is sent without first asking a shared store whether it has it (a round
    trip per chunk that nearly always answers no: it is not in the sandbox's last pause;
    writing one again is harmless, the content names it). Nor is one skipped because this
    node's cache holds it: a sweep of the shared store may have removed it since, while a
    chunk the sandbox's recorded pause names stays until the new manifest replaces it, and
    one this node wrote a moment ago is spared by the sweep's grace."""
    theirs: list[str | None] = []
    if template is not None and template.is_file():
        st = template.stat()
        theirs = _template_hashes(str(template), st.st_size, st.st_mtime_ns, chunks.chunk_size)
    shared = chunks.backend.shared  # a local store answers "do you have it" from its disk
    recent = getattr(chunks.backend, "written_recently", None)
    try:
        tfd = os.open(template, os.O_RDONLY) if theirs and template is not None else -1
        try:
            return _put_chunks_of(path, chunks, theirs, tfd, known, stats, shared, recent)
        finally:
            if tfd >= 0:
                os.close(tfd)
    except OSError as exc:
        raise StorageError(f"cannot store {path}: {exc}", exc=exc, path=str(path)) from exc


def _put_chunks_of(
    path: Path,
    chunks: ChunkStore,
    theirs: list[str | None],
    tfd: int,
    known: set[str],
    stats: PutStats,
    shared: bool,
    recent: Any,
) -> tuple[FileManifest, list[int]]:
    size_ = chunks.chunk_size
    zero = bytes(size_)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        extents = data_ranges(f.fileno(), size)

        def work(index: int) -> tuple[str | None, bool, int]:
            start = index * size_
            length = min(size_, size - start)
            if not overlaps(extents, start, start + length):
                return None, False, 0
            t0 = time.perf_counter()
            data = os.pread(f.fileno(), length, start)
            if len(data) != length:
                raise StorageError(f"{path} changed while it was being stored", path=str(path))
            if data == zero[:length]:
                stats.count("zero")
                return None, False, 0
            theirs_ = theirs[index] if index < len(theirs) else None
            if theirs_ is not None and os.pread(tfd, length, start) == data:
                # the template's bytes (a compare costs a tenth of a hash): its hash, known
                stats.add("read", time.perf_counter() - t0)
                stats.count("template")
                return theirs_, True, 0
            t1 = time.perf_counter()
            digest = hashlib.sha256(data).hexdigest()
            stats.add("read", t1 - t0)
            stats.add("hash", time.perf_counter() - t1)
            if theirs_ == digest:
                stats.count("template")
                return digest, True, 0
            if digest in known or (recent is not None and recent(digest)):
                stats.count("known")
                return digest, False, 0
            _, new = chunks.put(data, digest=digest, ask=not shared, stats=stats)
            return digest, False, new

        with ThreadPoolExecutor(chunks.workers) as pool:
            results = list(pool.map(work, range(-(-size // size_))))
    manifest = FileManifest(
        size=size,
        chunk_size=size_,
        chunks=[d for d, _, _ in results],
        new_bytes=sum(n for _, _, n in results),
    )
    return manifest, [i for i, (_, same, _) in enumerate(results) if same]


def manifest_chunks(manifest: dict[str, Any] | None) -> set[str]:
    """Every chunk a pause manifest names that is in the store: its files' and volumes',
    but for the RAM chunks it takes from the template (those were never sent). Empty for
    None or a manifest that does not parse (nothing is then taken as known)."""
    out: set[str] = set()
    if not manifest:
        return out
    try:
        from_template = {int(i) for i in manifest.get("from_template") or []}
        for group in ("files", "volumes"):
            for name, body in (manifest.get(group) or {}).items():
                fm = FileManifest.from_json(body)
                skip = from_template if group == "files" and name == "ram" else set()
                out.update(c for i, c in enumerate(fm.chunks) if c is not None and i not in skip)
    except (CorruptData, AttributeError, TypeError, ValueError):
        return set()
    return out


def _files(directory: Path) -> list[Path]:
    out = []
    for root, _dirs, names in os.walk(directory):
        for name in names:
            path = Path(root) / name
            if name in _SKIP or name.endswith(".tmp") or path.is_symlink() or not path.is_file():
                continue
            out.append(path)
    return sorted(out)


def push_pause(
    directory: Path,
    chunks: ChunkStore,
    template_dir: Path | None,
    *,
    sandbox_id: str = "",
    known: set[str] | None = None,
    stats: PutStats | None = None,
) -> dict[str, Any]:
    """Store the hibernated machine in ``directory`` (no QEMU on it: the caller holds the
    sandbox's lock) in ``chunks`` and return its pause manifest (see the module docstring).

    ``template_dir`` is the template's directory on this node (its ``snapshot/ram`` and
    ``snapshot/disk.qcow2`` are what the sandbox was cloned from). ``known``: chunks the
    store holds for as long as this push runs and until its manifest is recorded (those of
    the sandbox's recorded pause, :func:`manifest_chunks`): not sent again. ``stats``: where
    the time went (per stage, and ``file <name>`` for each file's wall time). Raises
    InvalidArgument for
    a sandbox whose pause cannot leave this node (drives attached, a compacted directory),
    StorageError / EngineError when a file or the store fails (retry later)."""
    started = time.perf_counter()
    who = sandbox_id or directory.name
    if (directory / "compacted.json").exists():
        raise InvalidArgument(f"sandbox {who} is compacted; its pause is pushed before that")
    try:
        config = json.loads((directory / "machine.json").read_text())
    except FileNotFoundError:
        config = {}
    except (OSError, ValueError) as exc:
        raise StorageError(f"sandbox {who}: unreadable machine.json: {exc}", exc=exc) from exc
    shares = [d for d in config.get("devices") or [] if d.get("kind") == "share"]  # not a nic
    if shares:
        raise InvalidArgument(
            f"sandbox {who} has drives attached ({', '.join(str(d.get('id')) for d in shares)})"
            ": a drive is a directory of its node, so the sandbox wakes only there and its "
            "pause is not made durable off-node",
            sandbox_id=sandbox_id,
        )
    disks = [Path(str(d["path"])) for d in config.get("devices") or [] if d.get("kind") == "disk"]
    if len({p.parent for p in disks}) > 1 or any(p.suffix != ".img" for p in disks):
        raise InvalidArgument(
            f"sandbox {who} has disks that are not volumes of one home: {disks}",
            sandbox_id=sandbox_id,
        )
    template = None if template_dir is None else template_identity(template_dir)
    snapshot = None if template_dir is None else (template_dir / "snapshot").resolve()
    files: dict[str, Any] = {}
    from_template: list[int] = []
    disk_backing: str | None = None
    new_bytes = 0
    known = known or set()
    stats = stats if stats is not None else PutStats()
    with tempfile.TemporaryDirectory(prefix=".push-", dir=directory.parent) as scratch:
        for path in _files(directory):
            rel = str(path.relative_to(directory))
            t0 = time.perf_counter()
            if rel == "ram":
                ram = None if snapshot is None else snapshot / "ram"
                fm, from_template = _put_chunks(path, chunks, ram, known, stats)
            elif rel == "disk.qcow2" and snapshot is not None:
                fm, disk_backing = _put_disk(
                    path, chunks, snapshot / "disk.qcow2", Path(scratch), known, stats
                )
            else:
                fm = _put_chunks(path, chunks, None, known, stats)[0]
            stats.add(f"file {rel}", time.perf_counter() - t0)
            files[rel] = fm.to_json()
            new_bytes += fm.new_bytes
        volumes: dict[str, Any] = {}
        for image in disks:  # flushed: the guest synced before it hibernated
            t0 = time.perf_counter()
            fm = _put_chunks(image, chunks, None, known, stats)[0]
            stats.add(f"file {image.name}", time.perf_counter() - t0)
            volumes[image.stem] = fm.to_json()
            new_bytes += fm.new_bytes
    chunks.sync_dirs()
    log.info(
        "pushed the pause of %s: %d files, %d new bytes, %d RAM chunks from the template "
        "(%.2f s; %s)",
        who,
        len(files),
        new_bytes,
        len(from_template),
        time.perf_counter() - started,
        stats.to_json(),
    )
    return {
        "version": MANIFEST_VERSION,
        "files": files,
        "from_template": from_template,
        "disk_backing": disk_backing,
        "template": template,
        "new_bytes": new_bytes,
        "volumes": volumes,
        "volumes_dir": str(disks[0].parent) if disks else None,
    }


def _put_disk(
    disk: Path,
    chunks: ChunkStore,
    template_disk: Path,
    scratch: Path,
    known: set[str],
    stats: PutStats,
) -> tuple[FileManifest, str | None]:
    """Store the disk overlay as an overlay on ``template_disk`` (folding a deeper chain onto
    it in a copy first). Returns its manifest and ``"template"`` (or None for a standalone
    image)."""
    backing = backing_file(disk)
    if backing is None:
        return _put_chunks(disk, chunks, None, known, stats)[0], None
    if backing.resolve() == template_disk.resolve():
        return _put_chunks(disk, chunks, None, known, stats)[0], "template"
    folded = scratch / "disk.qcow2"
    shutil.copyfile(disk, folded)
    rebase(folded, template_disk)  # what the layers between hold is folded into the copy
    return _put_chunks(folded, chunks, None, known, stats)[0], "template"


def _rebuild_volumes(
    volumes: dict[str, FileManifest],
    old_dir: Any,
    volumes_dir: Path,
    tmp: Path,
    chunks: ChunkStore,
    who: str,
) -> None:
    """Write the volume images a pause carries into ``volumes_dir`` (each atomically: the
    one there, if any, is an older image of the same volume) and point the rebuilt
    machine.json (in ``tmp``) at them."""
    for vid, fm in volumes.items():
        if not vid.startswith("vol-") or "/" in vid or ".." in vid:
            raise CorruptData(f"sandbox {who}: its pause manifest names volume {vid!r}")
        image = volumes_dir / f"{vid}.img"
        part = volumes_dir / f".{vid}.img.pull"
        try:
            chunks.restore_file(fm, part)
            os.replace(part, image)
        finally:
            part.unlink(missing_ok=True)
    if isinstance(old_dir, str) and old_dir != str(volumes_dir) and (tmp / "machine.json").exists():
        config = json.loads((tmp / "machine.json").read_text())
        moved = rewrite_prefix(config, old_dir, str(volumes_dir))
        (tmp / "machine.json").write_text(json.dumps(moved, indent=2))


def settle_fill(directory: Path, *, saved: bool = False) -> None:
    """Drop the :data:`FILLING` marker a rebuild for a wake kept (``durable=False``) once
    the wake has consumed the saved state (it is gone: the RAM file is the running guest's
    now), or once ``saved``: a pause saved a new state of the running guest. A marker with
    the saved state still there stays (the RAM may be half filled). Best effort (logged): a
    marker left over makes the next wake rebuild from the store."""
    try:
        if (directory / FILLING).exists() and (saved or not (directory / "state").exists()):
            (directory / FILLING).unlink()
            fsync_dir(directory)
    except OSError as exc:
        log.warning("cannot drop %s's rebuild marker: %s", directory.name, exc)


def is_whole(directory: Path) -> bool:
    """Whether ``directory`` holds a whole hibernated machine: a state file, and no RAM
    still being filled by a rebuild (:data:`FILLING`)."""
    return (directory / "state").exists() and not (directory / FILLING).exists()


def rebuild_pause(
    manifest: dict[str, Any],
    directory: Path,
    chunks: ChunkStore,
    template_dir: Path,
    *,
    sandbox_id: str = "",
    volumes_dir: Path | None = None,
) -> float:
    """Write the hibernated machine ``manifest`` describes to ``directory`` (replacing what is
    there: a stale copy of an older pause) and return the seconds it took:
    :func:`begin_rebuild`, then :meth:`RamFill.run`. Raises as they do."""
    started = time.perf_counter()
    begin_rebuild(
        manifest, directory, chunks, template_dir, sandbox_id=sandbox_id, volumes_dir=volumes_dir
    ).run()
    return time.perf_counter() - started


@dataclass
class RamFill:
    """A rebuild begun by :func:`begin_rebuild`: the directory is in place with its RAM file
    sized and empty; :meth:`run` fills it (once). ``begin_seconds`` is what the first step
    took, ``seconds`` (after :meth:`run`) the fill."""

    directory: Path
    ram: FileManifest | None
    chunks: ChunkStore
    template_ram: Path
    from_template: set[int]
    sandbox_id: str
    begin_seconds: float
    seconds: float = 0.0
    #: fsync the RAM and drop the marker (False: neither; :func:`settle_fill` drops it)
    durable: bool = True

    @property
    def who(self) -> str:
        return self.sandbox_id or self.directory.name

    def close(self) -> None:
        """Nothing to release (files are opened by :meth:`run`); a job never run leaves the
        :data:`FILLING` marker, so the next wake rebuilds the directory."""

    def run(self) -> float:
        """Fill the RAM file, fsync it and drop the :data:`FILLING` marker (unless not
        ``durable``: then neither); return the seconds. Raises CorruptData naming the
        sandbox (a bad or missing chunk),
        StorageError when the store or the file system fails (the marker stays: the next
        wake rebuilds the directory)."""
        started = time.perf_counter()
        try:
            if self.ram is not None:
                _restore_ram(
                    self.ram,
                    self.directory / "ram",
                    self.chunks,
                    self.template_ram,
                    self.from_template,
                    self.who,
                    durable=self.durable,
                )
            if self.durable:
                (self.directory / FILLING).unlink(missing_ok=True)
                fsync_dir(self.directory)
        except CorruptData as exc:
            exc.data["sandbox_id"] = self.sandbox_id
            exc.message = f"sandbox {self.who}: cannot rebuild its pause: {exc.message}"
            exc.args = (exc.message,)
            raise
        except OSError as exc:
            raise StorageError(
                f"sandbox {self.who}: cannot rebuild its pause: {exc}",
                exc=exc,
                sandbox_id=self.sandbox_id,
            ) from exc
        self.seconds = time.perf_counter() - started
        log.info(
            "rebuilt %s's pause from %s in %.3f s (+ %.3f s for its other files)",
            self.who,
            self.chunks.location,
            self.seconds,
            self.begin_seconds,
        )
        return self.seconds


def begin_rebuild(
    manifest: dict[str, Any],
    directory: Path,
    chunks: ChunkStore,
    template_dir: Path,
    *,
    sandbox_id: str = "",
    volumes_dir: Path | None = None,
    durable: bool = True,
) -> RamFill:
    """Put the hibernated machine ``manifest`` describes in ``directory`` (replacing what is
    there: a stale copy of an older pause) but for its RAM's content: every other file
    written, the RAM file at its size, empty, and the :data:`FILLING` marker. The returned
    job fills the RAM (see the module docstring; ``durable`` is the job's).

    Raises TemplateNotFound when this node lacks the template build the pause was taken on,
    CorruptData for a bad manifest or chunk (naming the sandbox), StorageError / EngineError
    when the store or the file system fails (nothing is left half-written)."""
    started = time.perf_counter()
    who = sandbox_id or directory.name
    try:
        if manifest.get("version") != MANIFEST_VERSION:
            raise ValueError(f"unknown version {manifest.get('version')!r}")
        files = {k: FileManifest.from_json(v) for k, v in manifest["files"].items()}
        volumes = {
            str(k): FileManifest.from_json(v) for k, v in (manifest.get("volumes") or {}).items()
        }
        from_template = {int(i) for i in manifest.get("from_template") or []}
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CorruptData(
            f"sandbox {who}: its pause manifest is unreadable ({exc})", sandbox_id=sandbox_id
        ) from exc
    wanted = manifest.get("template")
    mine = template_identity(template_dir)
    if wanted and (mine is None or mine["build_id"] != wanted["build_id"]):
        raise TemplateNotFound(
            f"sandbox {who} was paused on template {wanted['name']!r} build "
            f"{wanted['build_id']}; this node has "
            + ("no such template" if mine is None else f"build {mine['build_id']}")
            + ": build the same template here (same name, same build) to wake it",
            kind="template",
            name=wanted["name"],
            build_id=wanted["build_id"],
        )
    snapshot = (template_dir / "snapshot").resolve()
    tmp = directory.with_name(f".{directory.name}.rebuild")
    shutil.rmtree(tmp, ignore_errors=True)
    ram = files.get("ram")
    try:
        tmp.mkdir(parents=True)
        (tmp / FILLING).write_bytes(b"")
        for rel, fm in files.items():
            if Path(rel).is_absolute() or ".." in Path(rel).parts:  # never outside the dir
                raise CorruptData(f"sandbox {who}: its pause manifest names {rel!r}")
            dest = tmp / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            if rel == "ram":
                with open(dest, "wb") as f:  # sized now, filled by the job
                    f.truncate(fm.size)
            else:
                chunks.restore_file(fm, dest, snapshot_id=None)
        if manifest.get("disk_backing") == "template" and (tmp / "disk.qcow2").exists():
            set_backing(tmp / "disk.qcow2", snapshot / "disk.qcow2")
        if (
            wanted
            and mine
            and wanted["directory"] != mine["directory"]
            and (tmp / "machine.json").exists()
        ):
            config = json.loads((tmp / "machine.json").read_text())
            moved = rewrite_prefix(config, wanted["directory"], mine["directory"])
            (tmp / "machine.json").write_text(json.dumps(moved, indent=2))
        if volumes and volumes_dir is not None:
            _rebuild_volumes(volumes, manifest.get("volumes_dir"), volumes_dir, tmp, chunks, who)
        fsync_dir(tmp)
        shutil.rmtree(directory, ignore_errors=True)
        os.replace(tmp, directory)
        fsync_dir(directory.parent)
    except CorruptData as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        exc.data["sandbox_id"] = sandbox_id
        exc.message = f"sandbox {who}: cannot rebuild its pause: {exc.message}"
        exc.args = (exc.message,)
        raise
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise StorageError(
            f"sandbox {who}: cannot rebuild its pause: {exc}", exc=exc, sandbox_id=sandbox_id
        ) from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return RamFill(
        directory=directory,
        ram=ram,
        chunks=chunks,
        template_ram=snapshot / "ram",
        from_template=from_template,
        sandbox_id=sandbox_id,
        begin_seconds=time.perf_counter() - started,
        durable=durable,
    )


def _restore_ram(
    fm: FileManifest,
    dest: Path,
    chunks: ChunkStore,
    template_ram: Path,
    from_template: set[int],
    who: str,
    *,
    durable: bool = True,
) -> None:
    """Write the RAM file: chunks in ``from_template`` that this node's template RAM holds
    at the same offset (by the hashes of its chunks, computed once per template file) copied
    from it by the kernel, the others from the store (verified on read)."""
    theirs: list[str | None] = []
    if from_template:
        st = template_ram.stat()
        theirs = _template_hashes(str(template_ram), st.st_size, st.st_mtime_ns, fm.chunk_size)
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        tfd = os.open(template_ram, os.O_RDONLY) if from_template else -1
    except OSError:
        os.close(fd)
        raise
    try:
        os.ftruncate(fd, fm.size)  # (sized by begin_rebuild already: a no-op)

        def work(item: tuple[int, str | None]) -> None:
            index, digest = item
            if digest is None:
                return
            start = index * fm.chunk_size
            length = min(fm.chunk_size, fm.size - start)
            if index in from_template and index < len(theirs) and theirs[index] == digest:
                done = 0  # the same bytes in this node's template (hashed once per node)
                while done < length:
                    n = os.copy_file_range(tfd, fd, length - done, start + done, start + done)
                    if n == 0:
                        raise OSError(f"{template_ram} ended at {start + done}")
                    done += n
                return
            data = chunks.get(digest)  # not in this node's template RAM: from the store
            if len(data) != length:
                raise CorruptData(
                    f"chunk {digest[:12]} of {who}'s RAM has {len(data)} bytes, not {length}",
                    chunk=digest,
                )
            os.pwrite(fd, data, start)

        with ThreadPoolExecutor(chunks.workers) as pool:
            list(pool.map(work, enumerate(fm.chunks)))
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
        if tfd >= 0:
            os.close(tfd)
