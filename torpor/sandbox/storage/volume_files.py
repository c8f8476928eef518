"""Reading one file out of a volume's disk image on the host, without mounting it.

A memory fact may cite ``SourceRef(volume="memory-u-42", path="/facts.md", line=3)``; the path
is inside the volume (its root is the volume's root, wherever a sandbox mounts it). The server
reads it with ``debugfs`` (e2fsprogs) straight from ``volumes/<id>.img``, so no sandbox has to
run and no root privileges or loop devices are needed::

    data = read_volume_file(store, "memory-u-42", "/facts.md", tenant="acme")

What a read sees:

* **A detached volume**: everything its last sandbox flushed. When that sandbox was killed
  with the volume mounted, the image's ext4 journal may still hold committed writes (an
  ``fsync`` that was never followed by a full flush); the journal is replayed first, under the
  volume lock, exactly as the next attach would do it.
* **A volume attached to a sandbox** (read-write, running or paused): the image is read as it
  is on disk, never modified. That is what the guest has flushed: after ``sync`` in the guest
  (or a pause, which syncs) the file is there; writes still in the guest's page cache, or only
  in its journal (an ``fsync`` of one file), are not yet visible. While the guest writes, a
  read may catch metadata mid-update; that is an :class:`~torpor.errors.EngineError` naming
  the cause, and reading again (or pausing the sandbox first) gives a consistent answer.

Only regular files can be read; a directory or a symbolic link is
:class:`~torpor.errors.InvalidArgument` (a link's target depends on where the volume is
mounted, so cite the file it points to).
"""

from __future__ import annotations

import logging
import os
import posixpath
import re
import subprocess
import tempfile
from pathlib import Path

from torpor.config import LIMITS
from torpor.errors import (
    Conflict,
    EngineError,
    InvalidArgument,
    PathNotFound,
    PayloadTooLarge,
    StorageError,
    TorporError,
)
from torpor.sandbox.storage.records import LiveIds, live_now
from torpor.sandbox.storage.volumes import VolumeStore, replay_image_journal
from torpor.sandbox.vm.disk import qemu_img

__all__ = ["needs_recovery", "read_disk_file", "read_image_file", "read_volume_file"]

log = logging.getLogger(__name__)

#: ext4 superblock: at byte 1024 of the image; s_feature_incompat at offset 0x60 in it
_SB_OFFSET = 1024
_INCOMPAT_OFFSET = 0x60
_INCOMPAT_RECOVER = 0x4  # the journal must be replayed (set while mounted, or after a crash)

#: debugfs's own lines on stderr that are not errors
_NOISE = (
    re.compile(r"^debugfs \d"),
    re.compile(r"^\s*Using EXT2FS Library"),
    re.compile(r"catastrophic mode"),
)
_TYPE_RE = re.compile(r"Type:\s*(\S+)")
_SIZE_RE = re.compile(r"\bSize:\s*(\d+)")


def _quote(path: str) -> str:
    """``path`` as one debugfs argument: debugfs splits its command line on blanks and takes
    a double-quoted word whole, with ``""`` inside it standing for one quote."""
    return '"' + path.replace('"', '""') + '"'


def _normalize(path: str) -> str:
    """The absolute, normalized path inside the volume. Raises InvalidArgument."""
    if not isinstance(path, str) or not path.startswith("/") or "\0" in path:
        raise InvalidArgument(
            f"a volume path must be absolute, not {path!r}", field="path", value=str(path)
        )
    norm = posixpath.normpath(path)
    return norm[1:] if norm.startswith("//") else norm


def _errors(stderr: bytes) -> list[str]:
    lines = stderr.decode("utf-8", "replace").splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not any(p.search(ln) for p in _NOISE)]


def _fail(image: Path, path: str, errors: list[str]) -> None:
    """Raise the typed error for debugfs's complaints about ``path`` (when there are any)."""
    if not errors:
        return
    text = "; ".join(errors)
    if "File not found" in text or "inode is not a directory" in text:
        # the second: a file where the path needs a directory (``/a.txt/b``)
        raise PathNotFound(f"no such file {path} in the volume", kind="path", name=path)
    if "while trying to open" in text or "Filesystem not open" in text:
        raise EngineError(f"cannot open the volume image {image.name}: {text}", image=str(image))
    raise EngineError(
        f"debugfs could not read {path} from {image.name}: {text} (a sandbox "
        "writing to the volume can cause this; read again, or pause it first)",
        image=str(image),
        path=path,
    )


def _debugfs(image: Path, path: str, request: str, timeout: float) -> bytes:
    """The stdout of a read-only debugfs run of one ``request`` about ``path``. ``-c``
    (catastrophic mode) opens the image read-only without loading the allocation bitmaps:
    nothing to write, faster on a large volume, and a bitmap a live guest is rewriting cannot
    fail the open. Raises EngineError (debugfs missing or too slow), as :func:`_fail`."""
    # debugfs pipes some output through a pager when one is configured; never here.
    env = {**os.environ, "DEBUGFS_PAGER": "__none__", "PAGER": "__none__"}
    try:
        proc = subprocess.run(
            ["debugfs", "-c", "-R", request, str(image)],
            capture_output=True,
            env=env,
            check=False,
            timeout=timeout,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EngineError(f"cannot run debugfs: {exc}", exc=exc) from exc
    _fail(image, path, _errors(proc.stderr))
    return proc.stdout


def _stat(image: Path, path: str) -> tuple[str, int]:
    """The file type (``regular``, ``directory``, ``symlink`` ...) and size of ``path``."""
    out = _debugfs(image, path, f"stat {_quote(path)}", timeout=120).decode("utf-8", "replace")
    kind, size = _TYPE_RE.search(out), _SIZE_RE.search(out)
    if kind is None or size is None:
        raise EngineError(
            f"unexpected debugfs output for {path}: {out[:200]!r}", image=str(image), path=path
        )
    return kind.group(1), int(size.group(1))


def read_image_file(
    image: str | os.PathLike[str], path: str, *, max_bytes: int = LIMITS.max_file_bytes
) -> bytes:
    """The bytes of the regular file ``path`` inside the ext2/3/4 image ``image`` (read-only).

    Raises :class:`InvalidArgument` (a relative path, a directory, a symlink, a special file),
    :class:`PathNotFound`, :class:`PayloadTooLarge` (over ``max_bytes``), :class:`EngineError`
    (no debugfs, an image that does not open, or metadata that changed under the read).
    """
    image = Path(image)
    path = _normalize(path)
    if not image.is_file():
        raise EngineError(f"volume image {image} is missing", image=str(image))
    kind, size = _stat(image, path)
    if kind == "directory":
        raise InvalidArgument(f"{path} is a directory", path=path)
    if kind != "regular":
        raise InvalidArgument(
            f"{path} is a {kind}, not a regular file (a link's target "
            "depends on the mount point: cite the file itself)",
            path=path,
        )
    if size > max_bytes:
        raise PayloadTooLarge(
            f"{path} is {size} bytes, over {max_bytes}", size=size, limit=max_bytes, path=path
        )
    # ``dump`` into a private file, not ``cat`` to stdout: debugfs prints some warnings
    # (a superblock checksum retried while a guest rewrites it) on stdout, which would end up
    # in the content.
    with tempfile.TemporaryDirectory(prefix="torpor-volread-") as tmp:
        out = Path(tmp) / "file"
        stdout = _debugfs(image, path, f"dump {_quote(path)} {_quote(str(out))}", timeout=600)
        try:
            # The file may have grown since the stat (a live guest): check again.
            got = out.stat().st_size
            if got > max_bytes:
                raise PayloadTooLarge(
                    f"{path} grew over {max_bytes} bytes", size=got, limit=max_bytes, path=path
                )
            return out.read_bytes()
        except FileNotFoundError as exc:
            raise EngineError(
                f"debugfs wrote nothing for {path}: {stdout.decode('utf-8', 'replace')[:300]}",
                image=str(image),
                path=path,
                exc=exc,
            ) from exc
        except OSError as exc:
            raise StorageError(f"cannot read back {path}: {exc}", exc=exc) from exc


def needs_recovery(image: str | os.PathLike[str]) -> bool:
    """Whether the ext4 image's journal still has to be replayed (its superblock says so:
    the file system is mounted somewhere, or was when its machine stopped).
    Raises :class:`EngineError` when the superblock cannot be read."""
    try:
        with open(image, "rb") as f:
            f.seek(_SB_OFFSET + _INCOMPAT_OFFSET)
            raw = f.read(4)
    except OSError as exc:
        raise EngineError(f"cannot read the superblock of {image}: {exc}", exc=exc) from exc
    if len(raw) != 4:
        raise EngineError(f"{image} is too short to hold a file system", image=str(image))
    return bool(int.from_bytes(raw, "little") & _INCOMPAT_RECOVER)


def read_volume_file(
    store: VolumeStore,
    id_or_name: str,
    path: str,
    *,
    tenant: str = "default",
    max_bytes: int = LIMITS.max_file_bytes,
    live: LiveIds | None = None,
) -> bytes:
    """The bytes of ``path`` inside the volume ``id_or_name`` of ``tenant`` (see the module
    docstring for what a read sees while a sandbox has the volume attached).

    ``live``: the ids of sandboxes that still exist, or a function that gives them (called
    under the lock: see :data:`~torpor.sandbox.storage.records.LiveIds`); attachments of any
    other sandbox are stale (it was killed) and do not count as in use. None: every
    attachment counts.
    Holds the volumes' lock (``store.records.lock()``, the one every attach, detach and delete
    takes: in a cluster, the registry's) for the read, so the volume is not attached,
    detached or deleted meanwhile. Raises :class:`VolumeNotFound`, :class:`InvalidArgument`,
    :class:`PathNotFound`, :class:`PayloadTooLarge`, :class:`EngineError`, :class:`Conflict`
    (a cluster's volume whose latest image is on another node: this node's copy, if any, is
    stale; read it there), :class:`OperationTimeout` (its journal's replay took too long).
    """
    path = _normalize(path)
    with store.records.lock():
        info = store.get(id_or_name, tenant=tenant)
        here = store.records.node
        if store.records.shared and info.node not in (None, here):
            raise Conflict(
                f"volume {info.name!r} ({info.id}) is on node {info.node}, not {here}: read "
                "its files there",
                kind="volume",
                id=info.id,
                node=info.node,
                owner_node=info.node,
                owner_url=store.records.node_url(info.node),  # the server proxies it there
            )
        image = store.image(info.id)
        alive = None if live is None else live_now(live)
        users = [a for a in info.attachments if alive is None or a.sandbox_id in alive]
        if not users and needs_recovery(image):
            # Nobody has it mounted: the journal is safe to replay, and holds writes that a
            # killed sandbox committed but never wrote in place. The next attach would
            # replay the same journal.
            log.info("replaying the journal of volume %s before reading it", info.id)
            store.replay_journal(info.id)
        return read_image_file(image, path, max_bytes=max_bytes)


def read_disk_file(
    disk: str | os.PathLike[str], path: str, *, max_bytes: int = LIMITS.max_file_bytes
) -> bytes:
    """The bytes of ``path`` in the root file system of a machine's qcow2 ``disk`` (with its
    backing chain) that no QEMU has open: the disk a sandbox kept when its machine died.

    The chain is flattened into a private raw copy beside the disk (``rescue.raw``, made
    again when the disk is newer; it goes with the sandbox's directory) and its journal
    replayed there, so the read sees every write the guest had committed; the disk itself is
    never modified. Raises as :func:`read_image_file`, :class:`EngineError` when the disk
    cannot be flattened or its file system needs more than a journal replay, and
    :class:`OperationTimeout` when the replay takes too long (the guest chose its journal).
    """
    disk = Path(disk)
    path = _normalize(path)
    raw = disk.with_name("rescue.raw")
    try:
        fresh = raw.exists() and raw.stat().st_mtime_ns >= disk.stat().st_mtime_ns
    except OSError as exc:
        raise EngineError(f"the disk {disk} is gone: {exc}", exc=exc, path=str(disk)) from exc
    if not fresh:
        tmp = raw.with_name(raw.name + ".tmp")
        tmp.unlink(missing_ok=True)
        qemu_img("convert", "-U", "-f", "qcow2", "-O", "raw", str(disk), str(tmp))
        if needs_recovery(tmp):
            try:
                replay_image_journal(tmp, f"the kept disk {disk}")
            except TorporError:
                tmp.unlink(missing_ok=True)
                raise
        os.replace(tmp, raw)
    return read_image_file(raw, path, max_bytes=max_bytes)
