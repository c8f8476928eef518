"""A moved or copied home points every stored path at itself.

A torpor home stores absolute paths in a few places: qcow2 backing files (a sandbox's disk is
an overlay on its template's), ``machine.json`` (kernel, initrd, volume disks, drive
directories), snapshot manifests (the template disk a snapshot was taken on) and caches. A home
that is copied or moved (``cp -a``, a restored backup, a bigger disk) would go on using the
*original's* files through those paths, or fail once the original is gone.

``<home>/home.json`` records where the home was last opened. :func:`relocate` runs when the
sandbox manager starts: if the home is somewhere else now, every stored path under the old
location is rewritten to the new one — JSON values by prefix, qcow2 backing files with
``qemu-img rebase -u`` (metadata only; the file's mtime is kept, since snapshot manifests
identify a template disk by size and mtime), manifests through the snapshot store so their
digests stay valid. ``home.json`` is written last, so a crash part-way leaves a home that the
next start relocates again (every rewrite is idempotent).

A home from before ``home.json`` existed has its old location in its templates'
``template.json`` (``directory``), which is how such a copy is recognised.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from torpor.config import Paths
from torpor.errors import StorageError
from torpor.sandbox.storage.records import rewrite_prefix, write_record
from torpor.sandbox.storage.snapshots import SnapshotStore, backing_file
from torpor.sandbox.vm.disk import is_qcow2, set_backing

__all__ = ["Relocation", "relocate"]

log = logging.getLogger(__name__)

#: Directories of a home whose files never hold a path (content-addressed chunks, the memory
#: store's database files).
_SKIP = ("chunks", "chunk-cache", "memory")


@dataclass(frozen=True)
class Relocation:
    """What :func:`relocate` changed: the home's old location and the files rewritten."""

    old: Path
    new: Path
    json_files: int
    disks: int
    manifests: int


def _marker(paths: Paths) -> Path:
    return paths.home / "home.json"


def _recorded_home(paths: Paths) -> Path | None:
    """Where this home was last opened, or None when nothing says."""
    try:
        return Path(json.loads(_marker(paths).read_text())["path"])
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring unreadable %s: %s", _marker(paths), exc)
    # A home from before home.json: a template records its absolute directory (unless the
    # templates are shared from another home through a symlink, as the test suite does).
    if paths.templates.resolve() != paths.home.resolve() / "templates":
        return None
    for tj in sorted(paths.templates.glob("*/template.json")) if paths.templates.is_dir() else []:
        try:
            directory = json.loads(tj.read_text()).get("directory", "")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(directory, str) and Path(directory).is_absolute():
            return Path(directory).parent.parent  # <home>/templates/<name>
    return None


def _files(home: Path) -> Iterator[Path]:
    """The regular files of ``home`` that may hold its paths: not the stores of :data:`_SKIP`,
    not what agents wrote into a drive (``drives/<id>/``: their files are theirs, whatever
    they contain; the drive's record ``drives/<id>.json`` is ours), not the template build's
    root file system (``cache/rootfs``: device nodes, FIFOs, a Debian tree). A device or a FIFO
    is never opened: reading one may block for ever."""
    for root, dirs, files in os.walk(home):
        here = Path(root)
        if here == home:
            dirs[:] = [d for d in dirs if d not in _SKIP]
        elif here == home / "drives":
            dirs[:] = []
        elif here == home / "cache":
            dirs[:] = [d for d in dirs if d != "rootfs"]
        for name in files:
            path = here / name
            try:
                regular = stat.S_ISREG(path.lstat().st_mode)
            except OSError:
                continue
            if regular:
                yield path


def _rewrite_json(path: Path, old: str, new: str) -> bool:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False  # not ours to judge: a broken file is reported by whatever reads it
    if not isinstance(data, dict):
        return False
    moved = rewrite_prefix(data, old, new)
    if moved == data:
        return False
    write_record(path, moved, what=str(path))
    return True


def _rebase_disk(path: Path, old: str, new: str) -> bool:
    try:
        backing = backing_file(path)
    except StorageError:
        return False
    if backing is None:
        return False
    target = rewrite_prefix(str(backing), old, new)
    if target == str(backing):  # elsewhere, or moved already
        return False
    st = path.stat()
    set_backing(path, Path(target))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    return True


def relocate(paths: Paths, snapshots: SnapshotStore | None = None) -> Relocation | None:
    """Point every stored path of the home at ``paths.home`` if it was somewhere else, and
    record where it is. Returns what changed, or None when the home had not moved.

    Raises :class:`StorageError` / :class:`EngineError` when a file cannot be rewritten (the
    next start tries again; nothing is half-written: each file is replaced atomically).
    """
    home = paths.home.resolve()
    old = _recorded_home(paths)
    moved: Relocation | None = None
    if old is not None and old != home:
        o, n = str(old), str(home)
        json_files = disks = 0
        store = snapshots or SnapshotStore(paths)
        for path in _files(home):
            if path.parent == store.root and path.name.startswith("snap-"):
                continue  # manifests: below, with their digests
            if path.suffix == ".json" and path != _marker(paths):
                json_files += _rewrite_json(path, o, n)
            elif is_qcow2(path):
                disks += _rebase_disk(path, o, n)
        manifests = store.rewrite_paths(o, n)
        moved = Relocation(old, home, json_files, disks, manifests)
        log.warning(
            "this home moved from %s to %s: rewrote %d JSON files, %d disk headers, %d "
            "snapshot manifests",
            old,
            home,
            json_files,
            disks,
            manifests,
        )
    if moved is not None or old is None or not _marker(paths).exists():
        write_record(_marker(paths), {"path": str(home)}, what=str(_marker(paths)))
    return moved
