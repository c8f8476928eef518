"""The manager's recovery after a restart: bring each registry row in line with what its
sandbox directory holds.

:class:`Reconciler` adds to :class:`~torpor.sandbox.manager.core.ManagerCore` the steps the
table :func:`~torpor.sandbox.registry.lifecycle.recovery` names: re-attach to a QEMU that
outlived its manager (and finish the pause or wake it was in), call a whole saved state
paused, undo a create, delete a killed sandbox's files, or mark the RAM lost.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from contextlib import suppress
from pathlib import Path

from torpor.errors import EngineError
from torpor.sandbox.manager.core import Live, ManagerCore
from torpor.sandbox.models import SandboxState as S
from torpor.sandbox.registry import SandboxRecord
from torpor.sandbox.registry.lifecycle import Recovery, recovery
from torpor.sandbox.storage.compaction import settle
from torpor.sandbox.storage.pauses import settle_fill

__all__ = ["Reconciler"]

log = logging.getLogger(__name__)


class Reconciler(ManagerCore):
    """:class:`~torpor.sandbox.manager.core.ManagerCore` with its recovery after a restart."""

    async def _reconcile(self, rec: SandboxRecord) -> None:
        """Bring one registry row in line with its directory after a restart (the table is
        :func:`~torpor.sandbox.registry.lifecycle.recovery`)."""
        directory = self.directory(rec.id)
        status = self.engine.inspect(directory)
        if rec.state is S.STOPPED and not status.exists:
            return  # the common case for killed sandboxes: nothing left to clean
        live = self.live(rec.id)
        action = recovery(
            rec.state, has_state=status.has_state, qemu_alive=status.qemu_pid is not None
        )
        log.info("sandbox %s: %s on start -> %s", rec.id, rec.state.value, action.value)
        if action is Recovery.REATTACH:
            try:
                await self._reattach(rec, live, directory)
                return
            except Exception as exc:
                log.warning("sandbox %s: cannot re-attach its QEMU: %r", rec.id, exc)
                await self._rehibernate(live)
                rec = self.registry.get(rec.id)
                action = recovery(
                    rec.state, has_state=self.engine.inspect(directory).has_state, qemu_alive=False
                )
        if action is Recovery.UNDO_CREATE:
            await self.abort_create(rec, live, EngineError("interrupted by a restart"))
            return
        await self._quiet_kill(live, directory)
        if action is Recovery.DELETE_FILES:
            await asyncio.to_thread(shutil.rmtree, directory, True)
        elif action is Recovery.PAUSED:
            if rec.state is S.RUNNING:
                rec = self.move(rec, S.PAUSING, "recovered: re-hibernated")
            rec = self.move(rec, S.PAUSED, "recovered: saved state is whole", paused_at=time.time())
            self._paused(rec)  # cluster mode: made durable like any pause
        elif action is Recovery.LOST:
            self._mark_lost(rec, f"recovered: no QEMU and no saved state while {rec.state.value}")

    async def _rehibernate(self, live: Live) -> None:
        """Save the RAM of a machine whose guest does not answer (best effort)."""
        machine = live.machine
        if machine is not None and machine.is_running():
            with suppress(Exception):
                await machine.hibernate()
                live.machine = None

    async def _reattach(self, rec: SandboxRecord, live: Live, directory: Path) -> None:
        """Take over a QEMU that outlived its manager; finish a half-done pause or wake."""
        machine = await self.engine.attach(directory, self._config(rec))
        live.machine = machine
        if rec.state is S.PAUSING:  # finish the pause it was in
            await self.pause_held(
                self.move(rec, S.RUNNING, "recovered: re-attached"),
                live,
                "recovered: finish pause",
            )
            return
        settle(directory)  # a wake that consumed the state of a compacted RAM: drop its manifest
        settle_fill(directory)  # (likewise a RAM rebuilt from the store)
        live.channel = await self.engine.connect(machine, directory)
        if rec.state is S.WAKING:
            await live.channel.refresh(entropy=os.urandom(64), unix_time=time.time())
            self.move(
                rec,
                S.RUNNING,
                "recovered: wake finished",
                last_active_at=time.time(),
                paused_at=None,
            )
        log.info("sandbox %s: re-attached to its running QEMU", rec.id)
