"""A small pool of ready clones of a template's booted machine, so a create skips the clone.

Creating a sandbox is cloning the template's hibernated, booted machine into the sandbox's
directory (the RAM file copied, a new overlay, the state last) and waking it. The clone is the
part that does not depend on the guest: :class:`ClonePool` makes it ahead of time. A create
takes a ready clone with one ``rename`` into its directory and wakes it; a background thread
then makes another. A pooled clone is only files under ``<home>/cache/pool/<template>/<build>/``:
no registry row, no QEMU, so it is never a user's sandbox and counts in no quota. It is a clone
like any other (:func:`~torpor.sandbox.vm.machine_dir.clone_machine_dir`): its first wake picks
a new VM generation id and the manager gives it fresh entropy and the clock, as for a fork.

Crash safety: a clone is made in a hidden ``.<id>.tmp`` dir and renamed ready when whole; a
take is one rename (two takers cannot get the same clone); a dir left half-made by a crash is
removed by the next refill. A rebuilt template gets a new build dir: clones of the old build
are never taken and are removed by the next refill.

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
import threading
import time
from pathlib import Path

from torpor.errors import TorporError
from torpor.sandbox.vm.machine_dir import clone_machine_dir

__all__ = ["ClonePool", "pool_size_from_env"]

log = logging.getLogger(__name__)

#: seconds a refill waits before it starts (the wake of the create that took a clone first)
REFILL_DELAY = 1.0


def pool_size_from_env() -> int:
    """``TORPOR_CLONE_POOL`` as a size (0 when unset or not a whole number from 0 to 64)."""
    raw = os.environ.get("TORPOR_CLONE_POOL", "0").strip()
    return int(raw) if raw.isdigit() and int(raw) <= 64 else 0


class ClonePool:
    """Ready clones of templates' booted machines under ``root``, ``size`` per template."""

    def __init__(self, root: Path, size: int) -> None:
        self.root = root
        self.size = size
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

    def take(self, template: str, snapshot_dir: Path, directory: Path) -> bool:
        """Move a ready clone into ``directory`` (absent or empty); False if there is none."""
        if self.size <= 0:
            return False
        for clone in self.ready(template, snapshot_dir):
            try:
                with contextlib.suppress(FileNotFoundError):
                    directory.rmdir()  # rename replaces only an empty dir: be sure it is
                os.rename(clone, directory)
            except OSError:
                continue  # another taker got it first
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
        # at the lowest CPU priority (this thread only; qemu-img inherits it)
        time.sleep(REFILL_DELAY)
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
                        shutil.rmtree(stale, ignore_errors=True)
                for half in d.glob(".*.tmp"):  # left by a crash
                    shutil.rmtree(half, ignore_errors=True)
                while len(self.ready(template, snapshot_dir)) < self.size:
                    cid = secrets.token_hex(6)
                    tmp = d / f".{cid}.tmp"
                    clone_machine_dir(snapshot_dir, tmp)
                    os.rename(tmp, d / cid)
            finally:
                os.close(fd)
        except (OSError, TorporError) as exc:
            log.warning("refilling the clone pool of %s failed: %s", template, exc)
        finally:
            with self._lock:
                self._filling.discard(d)

    def drain(self) -> None:
        """Remove every pooled clone (a pool resized to 0, tests)."""
        shutil.rmtree(self.root, ignore_errors=True)
