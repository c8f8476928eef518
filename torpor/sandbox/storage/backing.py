"""Disk layers: the qcow2 backing chains under a machine's disk, and folding them into one.

Each freeze (:func:`~torpor.sandbox.storage.snapshots.freeze`) leaves the machine's disk one
layer deeper; these helpers read a chain from the qcow2 headers (no ``qemu-img`` process) and
copy a layer with the local layers under it folded in, so it rests on the template's disk alone.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from pathlib import Path

from torpor.errors import StorageError
from torpor.sandbox.vm.disk import copy_sparse, rebase

__all__ = [
    "backing_chain",
    "backing_file",
    "folded_copy",
    "is_under",
    "resting_on",
    "template_anchor",
]


def backing_file(path: Path) -> Path | None:
    """The backing file named in a qcow2 header (resolved against its directory), or None.

    Reads the header directly (offset 8: u64 name offset, offset 16: u32 name length) so a scan
    of many overlays costs no ``qemu-img`` process. Raises StorageError if unreadable.
    """
    try:
        with open(path, "rb") as f:
            header = f.read(20)
            if len(header) < 20 or header[:4] != b"QFI\xfb":
                return None
            offset, length = struct.unpack(">QI", header[8:20])
            if not offset or not length:
                return None
            f.seek(offset)
            name = f.read(length).decode()
    except (OSError, UnicodeDecodeError) as exc:
        raise StorageError(f"cannot read the qcow2 header of {path}: {exc}", exc=exc) from exc
    target = Path(name)
    return target if target.is_absolute() else path.parent / target


def backing_chain(path: Path) -> list[Path]:
    """Every backing file below ``path``, nearest first."""
    chain: list[Path] = []
    current: Path | None = path
    while current is not None and len(chain) < 256:
        current = backing_file(current) if current.exists() else None
        if current is not None:
            chain.append(current)
    return chain


def folded_copy(layer: Path, dest: Path, anchor: Path | None) -> None:
    """Copy the qcow2 ``layer`` to ``dest`` with the local layers under it folded in, so it
    is backed by ``anchor`` (the template's disk) alone. Raises OSError, EngineError."""
    copy_sparse(layer, dest)
    dest.chmod(0o600)
    rebase(dest, anchor)


def is_under(path: Path, root: Path) -> bool:
    """Whether ``path`` (symlinks resolved) is inside ``root``."""
    return path.resolve().is_relative_to(root.resolve())


def template_anchor(layer: Path, local_roots: tuple[Path, ...]) -> Path | None:
    """The first backing file of ``layer`` outside ``local_roots`` (the template's disk)."""
    for b in backing_chain(layer):
        if not any(b.resolve().is_relative_to(r.resolve()) for r in local_roots):
            return b
    return None


def resting_on(root: Path, dirs: Iterable[Path]) -> list[Path]:
    """The qcow2 disks below ``dirs`` whose backing chain reaches into ``root`` (a template's
    directory): the disks that stop working without it. A disk whose header does not read
    is left out."""
    found: list[Path] = []
    for d in dirs:
        for disk in sorted(d.rglob("*.qcow2")) if d.is_dir() else []:
            try:
                chain = backing_chain(disk)
            except StorageError:
                continue
            if any(is_under(b, root) for b in chain):
                found.append(disk)
    return found
