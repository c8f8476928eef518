"""Who a sandbox's QEMU runs as: defence in depth behind the guest/host boundary.

A guest that escaped into its QEMU process holds what that process holds. When the server runs
as root, QEMU does not: each tenant's machines run under a numeric uid of their own, from a
reserved range (:data:`~torpor.config.QEMU_UID_BASE` on, no ``/etc/passwd`` entry needed),
with the group :data:`~torpor.config.QEMU_GID` and no supplementary groups. The uid is dropped
before ``exec`` (``subprocess.Popen(user=, group=, extra_groups=[])``), so QEMU never holds root,
and its own seccomp filter then forbids any privilege change.

One uid per *tenant*, not per sandbox: a drive is shared read-write by many sandboxes of a
tenant, and 9p (``security_model=mapped-xattr``) creates every host file 0600 as the QEMU that
wrote it, so another sandbox of the tenant must be the same uid to read it. Sandboxes of one
tenant trust each other as much as the tenant's API token already lets them; tenants do not.

What that uid may touch (:func:`prepare`, before each QEMU start and hot-plug):

* its sandbox directory, owned by it, 0700;
* the disks under its root disk (a snapshot's or a fork parent's frozen disk), owned by it
  read-only in practice (QEMU opens backing files read-only); one another tenant already owns
  is opened to the QEMU group instead;
* the template's kernel, initrd and base disks: group-readable by :data:`QEMU_GID`;
* its volumes' images and its drives' directories, owned by it;
* the directories leading there, by *traversal* only (mode ``0710``, group QEMU_GID): no QEMU
  lists a directory, and the registry, the memory databases, chunks and other sandboxes'
  directories stay root's 0600/0700 (``tests/faults/test_qemu_jail.py`` runs a stand-in for an
  escaped guest under a sandbox's uid and checks it reads none of them).

Which uid a tenant has is kept in ``<home>/uids.json`` (allocated in order, under a lock, never
reused); a copied home (``cp -a``) keeps it with the files it owns.

When the server is not root there is nothing to drop to: QEMU runs as the server's user, as
before (logged once). When the home sits below a directory other users cannot traverse (a
0700 ``/root`` or pytest's ``/tmp/pytest-of-root``), no unprivileged QEMU could reach a backing
file by its absolute path: QEMU then runs as root, with a warning naming that directory.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torpor.config import QEMU_GID, QEMU_UID_BASE, QEMU_UID_COUNT
from torpor.errors import EngineError
from torpor.sandbox.vm.disk import write_atomic

__all__ = ["Jail", "can_reach", "jail_for", "popen_args", "prepare", "prepare_path"]

log = logging.getLogger(__name__)

_QCOW2_MAGIC = b"QFI\xfb"
#: directories of a torpor home whose parent is the home: walking up from a file, the parent
#: of the first of these is where granting traversal stops
_HOME_DIRS = frozenset({"templates", "sandboxes", "snapshots", "volumes", "drives"})
_said: set[str] = set()


@dataclass(frozen=True)
class Jail:
    """The unprivileged identity a machine's QEMU runs as."""

    uid: int
    gid: int = QEMU_GID


def _say_once(key: str, level: int, msg: str, *args: Any) -> None:
    if key not in _said:
        _said.add(key)
        log.log(level, msg, *args)


def _allows(st: os.stat_result, jail: Jail, bits: int) -> bool:
    """Whether ``jail`` (no supplementary groups) has every permission in ``bits`` (r=4,
    w=2, x=1) on a file of status ``st``."""
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid == jail.uid:
        have = mode >> 6
    elif st.st_gid == jail.gid:
        have = mode >> 3
    else:
        have = mode
    return have & bits == bits


def can_reach(path: Path, jail: Jail) -> Path | None:
    """The first directory from ``/`` down to ``path`` (exclusive) that ``jail`` cannot
    traverse, or None when it can reach ``path``. Raises OSError."""
    for parent in reversed(Path(path).resolve().parents):
        if not _allows(parent.stat(), jail, 1):
            return parent
    return None


def _allocate(home: Path, owner: str) -> int:
    """The uid of ``owner`` in ``home``'s uids.json, allocated on first use. Raises OSError,
    EngineError (the range is used up)."""
    table_path = home / "uids.json"
    with open(home / "uids.json.lock", "a+") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            table: dict[str, int] = json.loads(table_path.read_text())
        except FileNotFoundError:
            table = {}
        except ValueError as exc:
            raise EngineError(f"{table_path} is damaged: {exc}", exc=exc) from exc
        if owner in table:
            return int(table[owner])
        uid = QEMU_UID_BASE + 1 + len(table)
        if uid >= QEMU_UID_BASE + QEMU_UID_COUNT:
            raise EngineError(f"no QEMU uid left for {owner!r} in {table_path}")
        table[owner] = uid
        write_atomic(table_path, json.dumps(table, indent=2, sort_keys=True).encode())
        table_path.chmod(0o600)
        log.info("tenant %r runs its QEMU machines as uid %d", owner, uid)
        return uid


def jail_for(home: Path, owner: str) -> Jail | None:
    """The identity the machines of ``owner`` (a tenant) in ``home`` run as, or None when QEMU
    runs as the server's own user (the server is not root, or the home is out of an
    unprivileged user's reach: logged). Raises EngineError."""
    if os.geteuid() != 0:
        _say_once(
            "not-root",
            logging.INFO,
            "the server is not root: QEMU runs as its user (uid %d), no per-tenant uid",
            os.geteuid(),
        )
        return None
    try:
        uid = _allocate(Path(home), owner)
        blocked = can_reach(Path(home), Jail(uid))
    except OSError as exc:
        raise EngineError(f"cannot choose the QEMU user of {owner!r}: {exc}", exc=exc) from exc
    if blocked is not None:
        _say_once(
            f"blocked:{home}",
            logging.WARNING,
            "%s is not traversable by other users, so no unprivileged QEMU can reach the home "
            "%s: QEMU runs as root there (move the home, or chmod o+x %s)",
            blocked,
            home,
            blocked,
        )
        return None
    return Jail(uid)


def popen_args(jail: Jail | None) -> dict[str, Any]:
    """The ``subprocess.Popen`` arguments that start a process as ``jail`` (it changes
    directory before it drops root, so its cwd need not be reachable)."""
    if jail is None:
        return {}
    return {"user": jail.uid, "group": jail.gid, "extra_groups": []}


# -- making what a machine uses reachable ------------------------------------------------------


def _backing(path: Path) -> Path | None:
    """The backing file named in the qcow2 header of ``path`` (None: raw, or no backing)."""
    with open(path, "rb") as f:
        header = f.read(20)
        if len(header) < 20 or header[:4] != _QCOW2_MAGIC:
            return None
        offset = int.from_bytes(header[8:16], "big")
        length = int.from_bytes(header[16:20], "big")
        if not offset or not length:
            return None
        f.seek(offset)
        name = Path(f.read(length).decode(errors="replace"))
    return name if name.is_absolute() else path.parent / name


def _own(path: Path, jail: Jail) -> None:
    st = path.lstat()
    if stat.S_ISLNK(st.st_mode):
        return
    if st.st_uid != jail.uid or st.st_gid != jail.gid:
        os.chown(path, jail.uid, jail.gid, follow_symlinks=False)


def _grant(path: Path, jail: Jail, bits: int) -> None:
    """Let the QEMU group have ``bits`` on ``path`` (root keeps owning it)."""
    st = path.stat()
    if _allows(st, jail, bits):
        return
    if st.st_gid != jail.gid:
        os.chown(path, -1, jail.gid)
    os.chmod(path, stat.S_IMODE(st.st_mode) | bits << 3)


#: where machines run from: a home's sandboxes, and the clone pool under its cache
_MACHINE_DIRS = _HOME_DIRS | {"cache"}
#: where a machine's disk chain may lead: a template's disk, a snapshot's frozen layers, the
#: clone pool's (never another sandbox's directory, a volume's image or a drive's files,
#: which are another tenant's as often as not)
_BACKING_DIRS = frozenset({"templates", "snapshots", "cache"})
#: where machine.json may name a device's file: a disk is a volume's image
#: (``volumes/<id>.img``), a share a drive's directory (``drives/<id>/``); their neighbours
#: there are the volumes' and drives' records and locks
_DEVICE_FILES = {"disk": ("volumes", ".img"), "share": ("drives", "")}


def _home_of(path: Path) -> Path | None:
    """The torpor home ``path`` lies in: the parent of its nearest ancestor named as a home's
    directory (``sandboxes``, ``cache``, ...), or None."""
    return next((p.parent for p in path.parents if p.name in _MACHINE_DIRS), None)


def _open_way(path: Path, jail: Jail) -> None:
    """Grant traversal of the directories of a torpor home above ``path``: up to the home
    (the parent of its ``templates``/``sandboxes``/... directory), then check the rest."""
    parents = list(Path(path).parents)
    for i, parent in enumerate(parents):
        _grant(parent, jail, 1)
        if parent.name in _HOME_DIRS and i + 1 < len(parents):
            _grant(parents[i + 1], jail, 1)
            break
    blocked = can_reach(path, jail)
    if blocked is not None:
        raise EngineError(f"QEMU (uid {jail.uid}) cannot reach {path}: {blocked} is closed")


def prepare_path(path: Path, jail: Jail, *, shared: bool = False, write: bool = False) -> None:
    """Make the file or directory ``path`` usable by ``jail``: a ``shared`` one (a template's
    file) group-readable, any other owned by it (a root-owned one taken over, one another
    tenant owns opened to the group, read-only unless ``write``). A directory's tree is taken
    over whole the first time. Raises EngineError."""
    path = Path(path).resolve()
    try:
        _open_way(path, jail)
        st = path.stat()
        if shared:
            _grant(path, jail, 4)
        elif st.st_uid in (0, jail.uid):
            if st.st_uid != jail.uid and stat.S_ISDIR(st.st_mode):
                for root, dirs, files in os.walk(path):
                    for name in dirs + files:
                        _own(Path(root) / name, jail)
            _own(path, jail)
        elif not write:
            _grant(path, jail, 4)
        else:
            raise EngineError(f"{path} belongs to uid {st.st_uid}, not to QEMU uid {jail.uid}")
    except OSError as exc:
        raise EngineError(f"cannot open {path} to QEMU uid {jail.uid}: {exc}", exc=exc) from exc


def prepare(directory: Path, jail: Jail, config: dict[str, Any]) -> None:
    """Make the machine directory ``directory`` (machine.json ``config``) and everything its
    QEMU opens usable by ``jail`` (see the module docstring). Raises EngineError."""
    home = _home_of(Path(directory).absolute()) or _home_of(Path(directory).resolve())
    directory = Path(directory).resolve()
    try:
        _open_way(directory, jail)  # QEMU resolves its pid file's path from the root down
        for entry in directory.iterdir():
            _own(entry, jail)
        _own(directory, jail)
        os.chmod(directory, 0o700)
        for key in ("kernel", "initrd"):
            if config.get(key):
                path = Path(config[key]).resolve()
                templates = None if home is None else (home / "templates").resolve()
                if templates is None or not path.is_relative_to(templates):
                    raise EngineError(f"{directory}: its {key} {path} is not a template's ({home})")
                prepare_path(path, jail, shared=True)
        # the home's disk layers only: the home itself also holds the registry, the tenants'
        # memory databases and the uid table; its sandboxes, volumes and drives hold other
        # tenants' machines and data
        roots = [] if home is None else [(home / d).resolve() for d in _BACKING_DIRS]
        current = _backing(directory / "disk.qcow2")
        for _ in range(256):
            if current is None:
                break
            real = current.resolve()
            # the overlay's header is the jailed uid's to write: a backing file named there
            # outside the home's disk layers (an escaped QEMU's "/etc/shadow", the home's
            # registry.db, another tenant's volume image) is never handed to it
            if not any(real.is_relative_to(root) for root in roots):
                raise EngineError(
                    f"{directory}: its disk's backing file {real} is outside the disk layers "
                    f"({', '.join(sorted(_BACKING_DIRS))}) of {home}"
                )
            prepare_path(real, jail, shared=any(p.name == "templates" for p in real.parents))
            current = _backing(real)
    except OSError as exc:
        raise EngineError(f"cannot prepare {directory} for QEMU uid {jail.uid}: {exc}") from exc
    for rec in config.get("devices", []):
        if "path" in rec:  # a disk or a share (a network card has no file)
            path = _device_file(directory, home, rec)
            prepare_path(path, jail, write=not rec.get("read_only"))


def _device_file(directory: Path, home: Path | None, rec: dict[str, Any]) -> Path:
    """The file of the device record ``rec`` of the machine in ``directory`` (machine.json,
    which the jailed uid can rewrite), checked to be what such a device is: a volume's image
    or a drive's directory of the ``home``. Raises EngineError."""
    path = (directory / str(rec["path"])).resolve()
    where, suffix = _DEVICE_FILES.get(str(rec.get("kind")), ("", "-"))
    root = None if home is None or not where else (home / where).resolve()
    is_dir = suffix == ""
    if (
        root is None
        or path.parent != root
        or path.name.startswith(".")
        or not path.name.endswith(suffix)
        or path.is_dir() != is_dir
    ):
        raise EngineError(
            f"{directory}: its device {rec.get('id')!r} names {path}, not a "
            f"{'drive' if is_dir else 'volume'} of {home}"
        )
    return path
