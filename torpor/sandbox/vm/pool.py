"""A small pool of ready clones of a template's booted machine, so a create skips the clone
and, for a warm clone, QEMU's start and the state's load as well.

Creating a sandbox is cloning the template's hibernated, booted machine into the sandbox's
directory (the RAM file copied, a new overlay, the state last) and waking it: start QEMU, load
the device state, ``cont``, and wait for the guest's first answer, which under TCG is mostly
QEMU translating the guest code that answers (a new QEMU starts with no translated code).
None of this depends on who asks, so :class:`ClonePool` does it ahead of time. A pooled clone
is *warm*: a QEMU runs on it as the uid of the tenant it was made for, its guest was resumed
and exercised once (a ping, a command, an interpreter call: their code is translated), then
stopped (:meth:`~torpor.sandbox.vm.machine.QemuMachine.prestart`). A create takes a ready
clone with one ``rename`` into its directory (QEMU's working directory moves with it); its
wake is ``cont`` and the first ping, which gives the guest fresh entropy and the clock; a
background thread makes another clone. A warm clone of another tenant, or one whose QEMU
died, is removed instead of taken. Without a way to warm (``warm=None``) or when warming
fails, clones stay cold (files only) and are woken as usual.

A pooled clone is only files under ``<home>/cache/pool/<template>/<build>/`` and the QEMU on
them: no registry row, so it is never a user's sandbox, is never listed and counts in no quota
or usage. It is a clone like any other
(:func:`~torpor.sandbox.vm.machine_dir.clone_machine_dir`): a new VM generation id, and the
manager gives it fresh entropy, the clock and a reseeded interpreter when it is taken, as for
a fork.

Crash safety: a clone is made (and warmed) in a hidden ``.<id>.tmp`` dir and renamed
ready when whole; a take is one rename (two takers cannot get the same clone); a half-made dir,
and a warm clone whose maker has exited (the server died; the clone names its maker's pid and
start time), are removed and their QEMU killed by the next :meth:`sweep` (at the engine's
start, before every refill, and by the GC). A rebuilt template gets a new build dir:
clones of the old build are never taken and are removed by the next refill.

The size is :attr:`ClonePool.size` (``TORPOR_CLONE_POOL``, default 0: no pool, every create
clones as before).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import shutil
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from torpor.errors import TorporError
from torpor.sandbox.vm.machine_dir import clone_machine_dir, qemu_pid

#: ``warm(directory, template, tenant)``: start a QEMU on the clone in ``directory`` for
#: ``tenant``, exercise its guest and stop it (QemuEngine gives one); raises TorporError
Warm = Callable[[Path, str, str], None]
#: the file of a pooled clone that names the tenant its QEMU runs for
TENANT_FILE = "pool-tenant"

__all__ = ["ClonePool", "pool_size_from_env", "process_token"]

log = logging.getLogger(__name__)

#: seconds a refill waits before it starts (the wake of the create that took a clone first)
REFILL_DELAY = 1.0


def pool_size_from_env() -> int:
    """``TORPOR_CLONE_POOL`` as a size (0 when unset or not a whole number from 0 to 64)."""
    raw = os.environ.get("TORPOR_CLONE_POOL", "0").strip()
    return int(raw) if raw.isdecimal() and int(raw) <= 64 else 0


class ClonePool:
    """Ready clones of templates' booted machines under ``root``, ``size`` per template."""

    def __init__(self, root: Path, size: int, *, warm: Warm | None = None) -> None:
        self.root = root
        self.size = size
        #: starts a pooled clone's QEMU (None: the clones stay cold, files only)
        self.warm = warm
        #: the tenant new clones are warmed for: the last one that took a clone
        self.tenant = "default"
        self._lock = threading.Lock()
        self._filling: set[Path] = set()

    def _dir(self, template: str, snapshot_dir: Path) -> Path:
        return self.root / template / snapshot_dir.parent.name

    def ready(self, template: str, snapshot_dir: Path) -> list[Path]:
        """The ready clones of this build of ``template``."""
        d = self._dir(template, snapshot_dir)
        if not d.is_dir():
            return []
        return sorted(p for p in d.iterdir() if p.is_dir() and not p.name.startswith("."))

    def take(
        self, template: str, snapshot_dir: Path, directory: Path, tenant: str = "default"
    ) -> bool:
        """Move a ready clone of ``template`` into ``directory`` (absent or empty): a warm
        one of ``tenant`` or a cold one; False if there is none. Warm clones of another
        tenant (their QEMU runs as its uid) are removed on the way, and the refill makes
        clones for ``tenant``."""
        if self.size <= 0:
            return False
        self.tenant = tenant
        ready = self.ready(template, snapshot_dir)
        for clone in ready:
            owner = _tenant_of(clone)
            if owner is not None and (owner != tenant or qemu_pid(clone) is None):
                # its QEMU runs as another tenant's uid (the refill makes this tenant's
                # instead), or died after its guest ran: nothing this create can wake
                _remove(clone)
                continue
            try:
                with contextlib.suppress(FileNotFoundError):
                    directory.rmdir()  # rename replaces only an empty dir: be sure it is
                os.rename(clone, directory)
            except OSError:
                continue  # another taker got it first
            with contextlib.suppress(FileNotFoundError):
                (directory / TENANT_FILE).unlink()  # a sandbox's dir now, not the pool's
            log.info("took pooled clone %s for %s", clone.name, directory.name)
            return True
        return False

    def refill_soon(self, template: str, snapshot_dir: Path) -> None:
        """Start making clones in a background thread until ``size`` are ready (one filler
        per build at a time)."""
        if self.size <= 0:
            return
        d = self._dir(template, snapshot_dir)
        with self._lock:
            if d in self._filling:
                return
            self._filling.add(d)
        threading.Thread(
            target=self._fill, args=(template, snapshot_dir, d), daemon=True, name="clone-pool"
        ).start()

    def _fill(self, template: str, snapshot_dir: Path, d: Path) -> None:
        # the filler yields to the create that just took a clone: it starts a moment later,
        # at the lowest CPU priority (this thread only; qemu-img inherits it) unless it
        # starts QEMUs, which would inherit it too and run their sandboxes at it for good
        time.sleep(REFILL_DELAY)
        if self.warm is None:
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        try:
            d.mkdir(parents=True, exist_ok=True)
            fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # one filler per build
            except OSError:
                os.close(fd)
                return
            try:
                for stale in d.parent.iterdir():  # clones of an older build of the template
                    if stale != d:
                        for entry in stale.iterdir() if stale.is_dir() else []:
                            _kill_qemu(entry)
                        shutil.rmtree(stale, ignore_errors=True)
                self._sweep_dir(d)
                while len(self.ready(template, snapshot_dir)) < self.size:
                    cid = secrets.token_hex(6)
                    tmp = d / f".{cid}.tmp"
                    clone_machine_dir(snapshot_dir, tmp)
                    tenant = self.tenant
                    if self.warm is not None:
                        try:
                            self.warm(tmp, template, tenant)
                            (tmp / TENANT_FILE).write_text(f"{tenant}\n{_me()}\n")
                        # (RuntimeError: the interpreter is exiting and refuses new
                        # executor work; the half-warmed clone's QEMU must not outlive it)
                        except (OSError, TorporError, RuntimeError) as exc:  # its guest ran
                            _remove(tmp)
                            log.warning("cannot warm a pooled clone of %s: %s", template, exc)
                            break  # the next refill tries again
                    os.rename(tmp, d / cid)
            finally:
                os.close(fd)
        except (OSError, TorporError) as exc:
            log.warning("refilling the clone pool of %s failed: %s", template, exc)
        finally:
            with self._lock:
                self._filling.discard(d)

    def sweep(self) -> None:
        """Remove what a crash left in the pool: half-made clones no filler works on, and
        warm clones whose maker has exited (its server died), their QEMU killed. Safe to
        run from any process (``torpor gc``): a live server's clones are left alone."""
        if not self.root.is_dir():
            return
        for template in self.root.iterdir():
            for build in template.iterdir() if template.is_dir() else []:
                with contextlib.suppress(OSError):
                    fd = os.open(build, os.O_RDONLY | os.O_DIRECTORY)
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # no filler at work
                        self._sweep_dir(build)
                    finally:
                        os.close(fd)

    def _sweep_dir(self, d: Path) -> None:
        """Sweep one build dir; the caller holds its lock (no filler makes a clone there)."""
        for entry in list(d.iterdir()) if d.is_dir() else []:
            if entry.name.startswith("."):
                if entry.name.endswith(".tmp"):  # half made (the lock says by no filler)
                    _remove(entry)
            elif _tenant_of(entry) is not None and _orphaned(entry):
                _remove(entry)

    def close(self) -> None:
        """Kill the QEMUs of this process's warm clones and remove those clones (they are
        only worth their running QEMU; cold clones stay for the next server). Registered
        to run at exit by the engine."""
        if not self.root.is_dir():
            return
        for template in self.root.iterdir():
            for build in template.iterdir() if template.is_dir() else []:
                for entry in build.iterdir() if build.is_dir() else []:
                    if _owner_of(entry) == _me():
                        _remove(entry)

    def drain(self) -> None:
        """Remove every pooled clone, killing the QEMUs of warm ones (a pool resized to 0,
        a server that stops, tests)."""
        if self.root.is_dir():
            for template in self.root.iterdir():
                for build in template.iterdir() if template.is_dir() else []:
                    for entry in build.iterdir() if build.is_dir() else []:
                        _kill_qemu(entry)
        shutil.rmtree(self.root, ignore_errors=True)


def _tenant_of(clone: Path) -> str | None:
    """The tenant a warm clone's QEMU runs for; None for a cold clone."""
    try:
        return (clone / TENANT_FILE).read_text().split("\n")[0].strip() or None
    except OSError:
        return None


def process_token(pid: int) -> str | None:
    """``pid`` and its start time (a pid is reused; the pair is not); None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f"{pid}:{f.read().rsplit(') ', 1)[1].split()[19]}"
    except (OSError, IndexError):
        return None


def _me() -> str:
    return process_token(os.getpid()) or str(os.getpid())


def _owner_of(entry: Path) -> str | None:
    """The process that made a warm clone (:func:`process_token`), from its
    :data:`TENANT_FILE`; None for a cold clone."""
    try:
        return (entry / TENANT_FILE).read_text().split("\n")[1].strip() or None
    except (OSError, IndexError):
        return None


def _orphaned(entry: Path) -> bool:
    """A warm clone whose pool is gone: the process that made it has exited, or its QEMU."""
    owner = _owner_of(entry)
    if owner is None or qemu_pid(entry) is None:
        return True
    pid = owner.split(":")[0]
    return not pid.isdecimal() or process_token(int(pid)) != owner


def _kill_qemu(entry: Path) -> None:
    pid = qemu_pid(entry)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
        for _ in range(500):  # SIGKILL is asynchronous: let it go before its files do
            if qemu_pid(entry) is None:
                break
            time.sleep(0.002)


def _remove(entry: Path) -> None:
    _kill_qemu(entry)
    shutil.rmtree(entry, ignore_errors=True)
