"""The machine's side of a stopped QEMU kept for a wake: a lingering pause's, or a pooled
clone's prestarted one (:mod:`torpor.sandbox.vm.linger` keeps the process's own and their
windows).

:class:`Kept` is mixed into :class:`~torpor.sandbox.vm.machine.QemuMachine`: after a
hibernate's save it may mark its QEMU as lingering instead of quitting it
(:meth:`Kept._keep_lingering`), and a wake first tries to resume such a QEMU
(:meth:`Kept._take_kept`) before starting a new one.
"""

from __future__ import annotations

import logging
import subprocess
import time
from pathlib import Path
from typing import Any

from torpor.config import Linger
from torpor.errors import EngineError
from torpor.sandbox.vm import linger as lingering
from torpor.sandbox.vm.machine_dir import QMP_TIMEOUT, discard_state, qemu_pid

__all__ = ["Kept"]

log = logging.getLogger(__name__)


class Kept:
    """The kept-QEMU methods of :class:`~torpor.sandbox.vm.machine.QemuMachine` (which
    provides the process, QMP and state members declared here)."""

    directory: Path
    linger: Linger | None
    resumed_at: float | None
    _proc: subprocess.Popen[bytes] | None
    _pid: int | None

    def is_running(self) -> bool:
        raise NotImplementedError

    async def _connect(self) -> None:
        raise NotImplementedError

    async def _qmp_exec(
        self, cmd: str, args: dict[str, Any] | None = None, timeout: float = QMP_TIMEOUT
    ) -> Any:
        raise NotImplementedError

    async def _reap(self, *, force: bool = False, timeout: float = 10.0) -> None:
        raise NotImplementedError

    def _keep_lingering(self) -> bool:
        """After a hibernate's save: when :attr:`linger` allows, mark this stopped QEMU as
        lingering (its marker, with the files' fingerprint) and hand it to
        :mod:`torpor.sandbox.vm.linger`, which ends it when its window is over; True if
        kept (the caller lets go of QMP), False to quit it as usual."""
        policy = self.linger
        pid = self._pid
        if policy is None or not policy.enabled or pid is None or not self.is_running():
            return False
        try:
            marker = lingering.Marker(
                kind="linger",
                pid=pid,
                owner=lingering.me(),
                expires=time.time() + policy.seconds,
                fingerprint=lingering.fingerprint(self.directory),
            )
            lingering.write_marker(self.directory, marker)
        except OSError as exc:
            log.warning("%s: cannot keep QEMU lingering (%s); it quits", self.directory, exc)
            return False
        lingering.keep(self.directory, self._proc, pid, policy.seconds, policy.max_count)
        return True

    async def _take_kept(self, *, resume: bool) -> bool:
        """Resume the stopped QEMU ``QemuMachine.prestart`` or a lingering pause left on
        this directory (its :data:`~torpor.sandbox.vm.linger.MARKER`): True if it did; False
        if there is none, or ``resume`` is False, or it fails its checks
        (:func:`~torpor.sandbox.vm.linger.stale_reason`: a lingering one's window is over or
        its files changed; or its QEMU is dead, or not stopped as it was left). A QEMU not
        resumed is killed and its marker dropped, so the caller wakes from ``state``.
        Raises EngineError only if that kill fails."""
        lingering.recover(self.directory)  # a claimer that died before it resumed or killed
        marker = lingering.read_marker(self.directory / lingering.MARKER)
        if marker is None:
            if (self.directory / lingering.MARKER).exists():  # unreadable: nothing to trust
                (self.directory / lingering.MARKER).unlink(missing_ok=True)
            return False
        claimed = lingering.claim(self.directory)  # from here no other process acts on it
        if claimed is None:
            return False
        proc = lingering.release(self.directory)  # this process's own: stop its window
        try:
            why = "this wake loads the state" if not resume else None
            why = why or lingering.stale_reason(marker, self.directory)
            if why is None:
                self._proc, self._pid = proc, marker.pid
                if await self._resume_stopped():
                    return True
            else:
                log.info("%s: not resuming its stopped QEMU: %s", self.directory, why)
            if qemu_pid(self.directory) == marker.pid:
                self._proc, self._pid = proc, marker.pid
                await self._reap(force=True)
            self._proc, self._pid = None, None
            return False
        finally:
            claimed.unlink(missing_ok=True)

    async def _resume_stopped(self) -> bool:
        """``cont`` the stopped QEMU :attr:`_pid` (left stopped by ``QemuMachine.prestart`` or
        a lingering hibernate) if it is in a :data:`~torpor.sandbox.vm.linger.RESUMABLE`
        runstate; True if it runs now (the consumed ``state`` is deleted first)."""
        try:
            await self._connect()
            status = await self._qmp_exec("query-status")
            runstate = status.get("status") if isinstance(status, dict) else None
            if runstate in lingering.RESUMABLE:
                discard_state(self.directory)  # the guest is about to change ``ram``
                await self._qmp_exec("cont")
                self.resumed_at = time.monotonic()
                return True
            log.warning("%s: the stopped QEMU is %s; waking afresh", self.directory, runstate)
        except EngineError as exc:
            log.warning("%s: the stopped QEMU failed (%s); waking afresh", self.directory, exc)
        return False
