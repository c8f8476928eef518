"""Disk and file utilities every layer of the sandbox package shares: one copy of each.

* :func:`copy_sparse` — copy a (mostly sparse) RAM file or image: a reflink where the file
  system can, else only its data extents (each allocated in one call first); across file
  systems too.
* :func:`new_overlay` — a new qcow2 overlay on a backing image, written here (no process).
* :func:`qemu_img` — run ``qemu-img``, errors as EngineError; :func:`rebase` and
  :func:`set_backing` for what every layer does with it.
* :func:`write_atomic` — a file appears whole or not at all (tmp + fsync + rename + dir fsync).
* :func:`fsync_dir` — make the renames and unlinks in a directory durable.

These raise ``OSError`` (except :func:`qemu_img`); callers translate it into the error of their
layer (EngineError for a machine directory, StorageError for stored data).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import struct
import subprocess
from pathlib import Path
from typing import Any

from torpor._files import open_regular
from torpor.errors import EngineError

__all__ = [
    "copy_range",
    "copy_sparse",
    "fsync_dir",
    "is_qcow2",
    "new_overlay",
    "preallocate",
    "qemu_img",
    "rebase",
    "set_backing",
    "virtual_size",
    "write_atomic",
    "write_overlay",
]

_FICLONE = 0x40049409  # ioctl: share the source's extents (btrfs, xfs)
#: errors after which copy_file_range cannot work between these two files: copy by hand
_NO_COPY_RANGE = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}
_BLOCK = 1 << 20


def _find_fallocate() -> Any:
    """fallocate(2) itself, or None where the C library has none (not Linux):
    ``os.posix_fallocate`` falls back to writing every block where the file system has no
    fallocate, a second copy's worth of writes."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).fallocate
    except (OSError, TypeError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return fn


_fallocate = _find_fallocate()


def copy_sparse(src: Path, dst: Path, *, in_place: bool = False) -> None:
    """Copy ``src`` to ``dst`` (replacing it): a reflink if the file system can, else the data
    extents only, so holes stay holes. Works across file systems.

    ``in_place``: ``dst`` exists already at ``src``'s size (a new sparse RAM file a QEMU may
    have mapped, waiting for it, or an earlier copy of ``src``: see
    :meth:`QemuMachine.capture`) and is written over in place, never truncated: where
    ``src`` has data it gets ``src``'s, where ``src`` has a hole it reads zeros (data it held
    there is zeroed). Over an earlier copy this writes into page cache and blocks that exist
    already, so it is faster than a new copy.

    Without a reflink, a ``dst`` that is new or all holes gets each of ``src``'s data extents
    allocated in one call before it is copied (:func:`preallocate`): copied page by page into
    holes, ext4 reserves and maps blocks page by page (delayed allocation); measured here, a
    512 MiB guest's RAM file (170 MiB of data) copies with ~25 % less CPU.
    Raises OSError (also when that ``dst`` has another size; ENOSPC when the disk is full)."""
    with open(src, "rb") as fin, open(dst, "r+b" if in_place else "wb") as fout:
        ifd, ofd = fin.fileno(), fout.fileno()
        size = os.fstat(ifd).st_size
        if in_place and os.fstat(ofd).st_size != size:
            raise OSError(errno.EINVAL, f"{dst} is not {size} bytes long like {src}")
        try:
            fcntl.ioctl(ofd, _FICLONE, ifd)
            return
        except OSError:
            pass
        if not in_place:
            os.ftruncate(ofd, size)
        # a new file, or one all holes (a child's RAM file): allocate each extent first;
        # over an earlier copy (a live snapshot's stop) the blocks are there already
        can_allocate = not in_place or os.fstat(ofd).st_blocks == 0
        pos = 0
        while pos < size:
            try:
                start = os.lseek(ifd, pos, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno != errno.ENXIO:
                    raise
                start = size  # no data after pos
            if in_place and start > pos:
                _zero_data(ofd, pos, start)
            if start >= size:
                break
            end = os.lseek(ifd, start, os.SEEK_HOLE)
            if can_allocate:
                can_allocate = preallocate(ofd, start, end - start)
            copy_range(ifd, ofd, start, end)
            pos = end


def preallocate(fd: int, start: int, length: int) -> bool:
    """Allocate bytes ``start``..``start + length`` of ``fd`` (``fallocate(2)``, mode 0: the
    size and any data there are kept, holes become allocated blocks that read zeros). False
    if the file system cannot (nothing done). Raises OSError (ENOSPC: the disk is full)."""
    if _fallocate is None:
        return False
    if _fallocate(fd, 0, start, length) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.ENODEV):
        return False
    raise OSError(err, os.strerror(err))


def _zero_data(fd: int, start: int, end: int) -> None:
    """Write zeros over whatever data ``fd`` holds between ``start`` and ``end`` (its holes
    read zeros already: nothing is written into them)."""
    pos = start
    while pos < end:
        try:
            data = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:
                return
            raise
        if data >= end:
            return
        stop = min(end, os.lseek(fd, data, os.SEEK_HOLE))
        while data < stop:
            n = min(_BLOCK, stop - data)
            os.pwrite(fd, bytes(n), data)
            data += n
        pos = stop


def copy_range(ifd: int, ofd: int, start: int, end: int) -> None:
    """Copy bytes ``start``-``end`` of ``ifd`` to the same offsets of ``ofd``: in the kernel
    (``copy_file_range``) where it can, by hand where it cannot (another file system: EXDEV).
    Stops early at the end of ``ifd``. Raises OSError."""
    off = start
    while off < end:
        try:
            n = os.copy_file_range(ifd, ofd, end - off, off, off)
        except OSError as exc:
            if exc.errno not in _NO_COPY_RANGE:
                raise
            n = _copy_by_hand(ifd, ofd, off, end)
        if n == 0:
            return
        off += n


def _copy_by_hand(ifd: int, ofd: int, off: int, end: int) -> int:
    """Copy one block with pread/pwrite (a home split across file systems: EXDEV)."""
    data = os.pread(ifd, min(_BLOCK, end - off), off)
    if data:
        os.pwrite(ofd, data, off)
    return len(data)


def qemu_img(*args: str) -> None:
    """Run ``qemu-img *args``. Raises EngineError with its stderr if it fails or is missing."""
    try:
        proc = subprocess.run(["qemu-img", *args], capture_output=True, text=True, check=False)
    except OSError as exc:
        raise EngineError(f"cannot run qemu-img: {exc}", exc=exc) from exc
    if proc.returncode != 0:
        raise EngineError(f"qemu-img {args[0]} failed: {proc.stderr.strip()}")


def is_qcow2(path: Path) -> bool:
    """True if ``path`` starts with the qcow2 magic (False when it cannot be read)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"QFI\xfb"
    except OSError:
        return False


def new_overlay(backing: Path, path: Path, *, size: int | None = None) -> None:
    """Make ``path`` a new, empty qcow2 overlay on ``backing`` (a qcow2). With ``size`` (the
    backing's virtual size in bytes) ``backing`` is not opened: it may be a layer a running
    QEMU still writes, or not exist yet; without it the size is read from ``backing``'s
    header. The image is written here (:func:`write_overlay`), not by a ``qemu-img``
    process: forks, restores and creates make one or two each, and a process start costs
    tens of milliseconds on a loaded host. In a directory an unprivileged QEMU owns
    (:mod:`torpor.sandbox.vm.jail`), the overlay is that QEMU's too, so it can open it while
    running. Raises EngineError."""
    try:
        if size is None:
            size = virtual_size(backing)
        write_overlay(path, os.fsencode(str(backing)), size)
    except OSError as exc:
        raise EngineError(f"cannot make the overlay {path} on {backing}: {exc}", exc=exc) from exc
    if os.geteuid() == 0:
        try:
            owner = path.parent.stat()
            if owner.st_uid != 0:
                os.chown(path, owner.st_uid, owner.st_gid)
        except OSError as exc:
            raise EngineError(f"cannot hand {path} to its machine's user: {exc}", exc=exc) from exc


# The layout ``qemu-img create -f qcow2 -F qcow2 -b <backing>`` writes (qcow2 version 3,
# 64 KiB clusters, 16-bit refcounts), from QEMU's docs/interop/qcow2.txt: cluster 0 holds the
# header, its extensions (the backing file's format) and the backing file's name; cluster 1
# the refcount table, whose one entry names cluster 2, the refcount block counting clusters
# 0-3 once each; cluster 3 the L1 table, all zero (no cluster allocated: every read falls
# through to the backing file). The file ends after the L1 table, as qemu-img's does.
_CLUSTER_BITS = 16
_CLUSTER = 1 << _CLUSTER_BITS
_HEADER_LENGTH = 112
_EXT_BACKING_FORMAT = 0xE2792ACA
_MAX_BACKING_NAME = 1023  # QEMU's own limit


def write_overlay(path: Path, backing: bytes, size: int) -> None:
    """Write ``path`` as an empty qcow2 image of ``size`` bytes whose backing file is the
    qcow2 named ``backing`` (stored as given: absolute, or relative to ``path``'s folder).
    Raises OSError: also for a size of 0 or over 4 TiB (one L1 cluster) or a name over
    1023 bytes, which qemu-img handles and this does not."""
    l1_entries = -(-size // (_CLUSTER * (_CLUSTER // 8)))
    if size <= 0 or l1_entries * 8 > _CLUSTER or not 0 < len(backing) <= _MAX_BACKING_NAME:
        raise OSError(errno.EINVAL, f"no overlay of {size} bytes on a {len(backing)}-byte name")
    ext = struct.pack(">II", _EXT_BACKING_FORMAT, 5) + b"qcow2\0\0\0" + bytes(8)  # + the end
    name_offset = _HEADER_LENGTH + len(ext)
    header = struct.pack(
        ">4sIQIIQIIQQIIQQQQII8x",
        b"QFI\xfb",
        3,  # version
        name_offset,
        len(backing),
        _CLUSTER_BITS,
        size,
        0,  # no encryption
        l1_entries,
        3 * _CLUSTER,  # L1 table
        _CLUSTER,  # refcount table
        1,  # its clusters
        0,  # snapshots
        0,
        0,  # incompatible features
        0,  # compatible features
        0,  # autoclear features
        4,  # refcount order: 16 bits
        _HEADER_LENGTH,  # then compression type 0 (zlib) and padding
    )
    assert len(header) == _HEADER_LENGTH
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.pwrite(fd, header + ext + backing, 0)
        os.pwrite(fd, struct.pack(">Q", 2 * _CLUSTER), _CLUSTER)
        os.pwrite(fd, struct.pack(">4H", 1, 1, 1, 1), 2 * _CLUSTER)
        os.ftruncate(fd, 3 * _CLUSTER + l1_entries * 8)
    finally:
        os.close(fd)


def virtual_size(path: Path) -> int:
    """The guest-visible size of the qcow2 ``path`` (its header's u64 at offset 24), read
    without ``qemu-img``. Raises OSError (also when it is not a qcow2)."""
    with open(path, "rb") as f:
        header = f.read(32)
    if len(header) < 32 or header[:4] != b"QFI\xfb":
        raise OSError(f"{path} is not a qcow2 image")
    return int.from_bytes(header[24:32], "big")


def rebase(path: Path, backing: Path | None) -> None:
    """Rewrite the qcow2 ``path`` onto ``backing`` (None: standalone), folding in the layers
    between them, so the image reads the same. Raises EngineError."""
    qemu_img(
        "rebase",
        "-q",
        "-f",
        "qcow2",
        "-F",
        "qcow2",
        "-b",
        "" if backing is None else str(backing),
        str(path),
    )


def set_backing(path: Path, backing: Path) -> None:
    """Name ``backing`` as the qcow2 ``path``'s backing file without touching its data (the
    same image under another path: a moved home). Raises EngineError."""
    qemu_img("rebase", "-u", "-f", "qcow2", "-F", "qcow2", "-b", str(backing), str(path))


def fsync_dir(path: Path, *, missing_ok: bool = False) -> None:
    """fsync a directory, so the renames and unlinks in it are durable. Raises OSError."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        if missing_ok:
            return
        raise
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, *, sync_dir: bool = True) -> None:
    """Write ``data`` to ``path`` so that it appears whole or not at all (a hidden tmp file,
    fsync, rename; with ``sync_dir`` the directory too, so the rename survives a crash). No tmp
    file is left behind on failure. Raises OSError."""
    tmp = path.with_name(f".{path.name}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    try:
        try:
            fd = open_regular(tmp, flags, 0o666)  # the mode open() gives
        except OSError as exc:  # a link or FIFO planted in a machine's directory: not followed
            if exc.errno not in (errno.ELOOP, errno.EINVAL):
                raise
            tmp.unlink()
            fd = open_regular(tmp, flags | os.O_EXCL, 0o666)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if sync_dir:
        fsync_dir(path.parent)
