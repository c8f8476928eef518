"""Where torpor keeps its files, and the limits it enforces.

Everything lives under one home directory, ``$TORPOR_HOME`` (default
``~/.local/share/torpor``)::

    templates/<name>/      built guest images and each template's booted snapshot
    sandboxes/<id>/        one directory per sandbox: RAM file, device state, disk overlay
    snapshots/             snapshot manifests
    chunks/                the content-addressed chunk store
    volumes/<id>.img       volume disk images
    drives/<id>/           shared host directories
    registry.db            the server's SQLite registry
    server.sock            the local server's unix socket
    memory/<tenant>.db     the embedded memory store, one file per tenant

The home is private: 0700, so no other local user reads a guest's RAM, a disk or a tenant's
memory through it (:meth:`Paths.ensure` makes it so, and fixes, with a warning, a home found
open); the server runs with umask 077, so what it and QEMU create is 0600 as well. When the
server is root, its QEMU processes run as unprivileged uids of group :data:`QEMU_GID`
(:mod:`torpor.sandbox.vm.jail`), and the directories they must pass through (the home among
them) are ``0710`` with that group: traversable by QEMU, closed to every other user.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from torpor.errors import InvalidArgument, InvalidName, QuotaExceeded

__all__ = [
    "LIMITS",
    "LINGER_MAX_ENV",
    "LINGER_SECONDS_ENV",
    "NAME_RE",
    "QEMU_GID",
    "QEMU_UID_BASE",
    "QEMU_UID_COUNT",
    "Limits",
    "Linger",
    "Paths",
    "Quotas",
    "check_name",
    "internet_allowed",
    "make_private",
    "paths",
    "server_pid",
]

log = logging.getLogger(__name__)

#: Names of sandboxes, templates, snapshots, volumes and drives: 1-63 characters,
#: lowercase letters, digits, ``-``, ``_`` and ``.``, starting with a letter or digit.
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")


def check_name(name: str, what: str = "name") -> str:
    """Return ``name`` if it is valid, else raise :class:`InvalidName`."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):  # match() lets "a\n" past "$"
        raise InvalidName(
            f"invalid {what} {name!r}: use 1-63 characters of a-z, 0-9, '.', '_' and '-', "
            "starting with a letter or digit",
            name=str(name),
        )
    return name


#: The reserved range of numeric uids QEMU runs as when the server is root (one per tenant,
#: :mod:`torpor.sandbox.vm.jail`; no /etc/passwd entry needed), and their one group, which may
#: traverse the home and read the templates.
QEMU_UID_BASE = 1_610_000_000
QEMU_UID_COUNT = 1_000_000
QEMU_GID = QEMU_UID_BASE


@dataclass(frozen=True)
class Limits:
    """Sizes torpor refuses to go past, with a :class:`~torpor.errors.PayloadTooLarge`."""

    max_file_bytes: int = 256 * 1024 * 1024
    max_output_bytes: int = 128 * 1024 * 1024
    max_code_bytes: int = 16 * 1024 * 1024
    max_fork_count: int = 16
    max_memory_text_chars: int = 32_000


LIMITS = Limits()

#: the operator's settings of :class:`Linger` (seconds, and how many at once per process)
LINGER_SECONDS_ENV = "TORPOR_LINGER_SECONDS"
LINGER_MAX_ENV = "TORPOR_LINGER_MAX"


@dataclass(frozen=True)
class Linger:
    """How long the stopped QEMU of a pause is kept for a warm wake, and how many at once.

    A pause makes its state durable as always; with a window, its QEMU is then kept,
    stopped, for ``seconds`` instead of being told to quit, and a wake within the window
    that finds the files exactly as the pause left them only resumes it
    (:mod:`torpor.sandbox.vm.linger`). At most ``max_count`` are kept per process (the
    oldest goes first); each holds its QEMU's own memory (tens of MiB; the guest's RAM is
    the sandbox's file either way). ``seconds`` 0 (the default) or ``max_count`` 0: off,
    a paused sandbox holds no process, as without this.

    :meth:`from_env` reads ``TORPOR_LINGER_SECONDS`` (0-3600) and ``TORPOR_LINGER_MAX``
    (0-64, default 4).
    """

    seconds: float = 0.0
    max_count: int = 4

    @property
    def enabled(self) -> bool:
        """Whether a pause keeps its QEMU at all."""
        return self.seconds > 0 and self.max_count > 0

    @classmethod
    def from_env(cls) -> Linger:
        """The setting from the environment; a value that is not a number in range is
        ignored (logged) and the default used, as for the other environment settings."""
        default = cls()
        seconds, max_count = default.seconds, default.max_count
        raw = os.environ.get(LINGER_SECONDS_ENV, "").strip()
        if raw:
            try:
                seconds = float(raw)
                if not 0 <= seconds <= 3600:
                    raise ValueError(raw)
            except ValueError:
                log.warning("%s=%r is not 0-3600 seconds; ignored", LINGER_SECONDS_ENV, raw)
                seconds = default.seconds
        raw = os.environ.get(LINGER_MAX_ENV, "").strip()
        if raw:
            if raw.isdecimal() and int(raw) <= 64:
                max_count = int(raw)
            else:
                log.warning("%s=%r is not 0-64; using %d", LINGER_MAX_ENV, raw, max_count)
        return cls(seconds, max_count)


@dataclass(frozen=True)
class Paths:
    """The layout of one torpor home directory."""

    home: Path

    @property
    def templates(self) -> Path:
        return self.home / "templates"

    @property
    def sandboxes(self) -> Path:
        return self.home / "sandboxes"

    @property
    def snapshots(self) -> Path:
        return self.home / "snapshots"

    @property
    def chunks(self) -> Path:
        return self.home / "chunks"

    @property
    def volumes(self) -> Path:
        return self.home / "volumes"

    @property
    def drives(self) -> Path:
        return self.home / "drives"

    @property
    def memory(self) -> Path:
        return self.home / "memory"

    @property
    def registry(self) -> Path:
        return self.home / "registry.db"

    @property
    def socket(self) -> Path:
        return self.home / "server.sock"

    @property
    def server_pid(self) -> Path:
        """Where the owning server's pid and lock live."""
        return self.home / "server.pid"

    @property
    def cache(self) -> Path:
        return self.home / "cache"

    def ensure(self) -> Paths:
        """Create the home (private, see :meth:`make_private`) and its directories."""
        self.make_private()
        for d in (
            self.templates,
            self.sandboxes,
            self.snapshots,
            self.chunks,
            self.volumes,
            self.drives,
            self.memory,
            self.cache,
        ):
            d.mkdir(parents=True, exist_ok=True)
        return self

    def make_private(self) -> None:
        """Create the home 0700, or close a home found open (see :func:`make_private`).

        As root, QEMU's group may traverse the home (:mod:`torpor.sandbox.vm.jail`), so no
        file in it may rely on the home's mode alone: the process's umask becomes 077 and what
        lies directly in the home loses every group and other bit but the QEMU group's
        traversal of a directory."""
        make_private(self.home)
        if os.geteuid() != 0:
            return
        os.umask(0o077)
        for entry in self.home.iterdir():
            st = entry.lstat()
            if stat.S_ISLNK(st.st_mode):
                continue
            mode = stat.S_IMODE(st.st_mode)
            keep = 0o010 if stat.S_ISDIR(st.st_mode) and st.st_gid == QEMU_GID else 0
            if mode & 0o077 & ~keep:
                entry.chmod(mode & (0o700 | keep))


@dataclass(frozen=True)
class Quotas:
    """What one tenant may hold at once. Over one, an operation raises
    :class:`~torpor.errors.QuotaExceeded` and makes nothing.

    Set per home in ``<home>/quotas.json``: ``{"*": {...}, "<tenant>": {...}}`` with any of
    these field names (``"*"`` applies to every tenant, a tenant's own entry over it).
    """

    running_sandboxes: int = 32
    running_memory_mib: int = 64 * 1024
    volumes: int = 64
    volume_mib: int = 256 * 1024
    snapshots: int = 256
    #: records in the tenant's memory store: facts and episodes, current, superseded and
    #: expired-but-not-yet-purged alike (every row it stores; history is kept forever, so
    #: it counts); profiles and policies do not count
    memory_records: int = 1_000_000

    @classmethod
    def of(cls, paths: Paths, tenant: str) -> Quotas:
        """The quotas of ``tenant`` in the home of ``paths`` (defaults when none are set).
        Raises InvalidArgument for a quotas.json that is not what this says."""
        file = paths.home / "quotas.json"
        try:
            table = json.loads(file.read_text())
        except FileNotFoundError:
            return cls()
        except (OSError, ValueError) as exc:
            raise InvalidArgument(f"cannot read {file}: {exc}", path=str(file)) from exc
        try:
            if not isinstance(table, dict):
                raise TypeError("not an object of tenants")
            entries = [table.get("*", {}), table.get(tenant, {})]
            if not all(isinstance(entry, dict) for entry in entries):
                raise TypeError("a tenant's entry is not an object of quotas")
            merged = {**entries[0], **entries[1]}
            return cls(**{k: int(v) for k, v in merged.items()})
        except (TypeError, ValueError, OverflowError) as exc:
            raise InvalidArgument(f"bad quota in {file}: {exc}", path=str(file)) from exc

    def check(self, tenant: str, quota: str, used: int, adding: int = 1) -> None:
        """Raise QuotaExceeded if ``used + adding`` goes over the quota named ``quota``."""
        limit = int(getattr(self, quota))
        if used + adding > limit:
            raise QuotaExceeded(
                f"tenant {tenant!r} is at its {quota.replace('_', ' ')} quota: {used} of "
                f"{limit} used, {adding} more asked (raise it in quotas.json)",
                tenant=tenant,
                quota=quota,
                limit=limit,
                used=used,
            )


#: the operator's switch for sandboxes on the internet (see :func:`internet_allowed`)
ALLOW_INTERNET_ENV = "TORPOR_ALLOW_INTERNET"


def internet_allowed() -> bool:
    """Whether this host lets sandboxes reach the internet: the operator sets
    ``TORPOR_ALLOW_INTERNET=1`` (or true/yes/on) for the server. Off by default: a sandbox
    runs code an agent wrote, and a network card would also let it reach services on the
    host's loopback. When allowed, new sandboxes are on the internet unless created with
    ``internet=False``; when not, asking for ``internet=True`` is refused."""
    return os.environ.get(ALLOW_INTERNET_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def make_private(directory: Path) -> None:
    """Create ``directory`` 0700, or make it 0700 if it lets group or others in (logged: a home
    found open may have leaked already). A home that only lets the QEMU group (:data:`QEMU_GID`)
    traverse it (``0710``) is private too. Raises OSError."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = directory.stat()
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077 and not (mode & 0o077 == 0o010 and st.st_gid == QEMU_GID):
        directory.chmod(mode & 0o700 | 0o700)
        log.warning("%s was readable by other users (mode %o); made it 0700", directory, mode)


def paths(home: str | os.PathLike[str] | None = None) -> Paths:
    """The paths for ``home``, else ``$TORPOR_HOME``, else ``~/.local/share/torpor``."""
    if home is None:
        home = os.environ.get("TORPOR_HOME") or Path.home() / ".local" / "share" / "torpor"
    return Paths(Path(home).expanduser().resolve())


def server_pid(home: str | os.PathLike[str] | None = None) -> int | None:
    """The pid of the server that owns ``home`` (it holds the pid file's lock), or None."""
    try:
        with open(paths(home).server_pid) as handle:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                text = handle.read().strip()
                return int(text) if text.isdecimal() else None
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
            return None
    except FileNotFoundError:
        return None
