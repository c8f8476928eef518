"""Which paused sandboxes are compacted, and in cluster mode how: they drop their local files.

:func:`sweep_due` picks, in both modes, the paused sandboxes that are due; the rest is
cluster mode's.

The storage side (what is dropped, how a crash is survived, why the wake path is the one a
wake on another node takes) is :mod:`torpor.sandbox.storage.evict`. Here the manager picks:
a sandbox whose files are on this node, paused for at least ``compact_after_seconds`` (any of
them, longest paused first, when the disk is low), with no machine, no call and no upload in
flight, and whose pause is durable as it is: the registry's durable manifest is of its
current pause, and the pause's files are this node's (:func:`durable_manifest`). Everything
is checked again under the sandbox's lock; a sandbox that does not qualify is left as it is.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from torpor.errors import TorporError
from torpor.sandbox.manager.core import ManagerCore
from torpor.sandbox.models import SandboxState as S
from torpor.sandbox.registry import SandboxRecord
from torpor.sandbox.storage.compaction import CompactionReport
from torpor.sandbox.storage.evict import clear_leftovers, drop_paused
from torpor.sandbox.storage.pauses import is_whole

__all__ = ["cluster_compact_sweep", "durable_manifest", "sweep_due"]

log = logging.getLogger(__name__)


def durable_manifest(manager: ManagerCore, rec: SandboxRecord) -> dict[str, Any] | None:
    """The durable manifest of ``rec``'s current pause when this node may drop the pause's
    local files, else None: ``rec`` is paused, its files are here and whole, no upload of it
    is in flight, and the registry's durable manifest is of this very pause, whose files
    this node holds. Raises StorageError (PostgreSQL), CorruptData (an unreadable manifest)."""
    cluster = manager.cluster
    if cluster is None or rec.state is not S.PAUSED or rec.paused_at is None:
        return None
    if cluster.pushing(rec.id) or not is_whole(manager.directory(rec.id)):
        return None
    pause = cluster.registry.pause_record(rec.id)
    if (
        pause is None
        or pause.manifest is None
        or pause.durable_at is None
        or pause.manifest_paused_at != rec.paused_at
        or pause.node != cluster.node
        or pause.paused_at != rec.paused_at
    ):
        return None
    return pause.manifest


async def cluster_compact_sweep(
    manager: ManagerCore, now: float, *, low_disk: bool, limit: int
) -> list[CompactionReport]:
    """Drop the local files of up to ``limit`` durable paused sandboxes of this node (see the
    module docstring); return what was done. A failure is logged, not raised (the sandbox
    keeps its files and stays paused)."""
    root = manager.paths.sandboxes
    await asyncio.to_thread(clear_leftovers, root)
    after = manager.compact_after_seconds
    if after is None and not low_disk:
        return []
    here = {d.name for d in root.iterdir() if d.is_dir()} if root.is_dir() else set()
    if not here:
        return []
    done: list[CompactionReport] = []
    try:
        paused = await asyncio.to_thread(manager.registry.list, states={S.PAUSED})
    except TorporError as exc:
        log.warning("compaction: cannot list the paused sandboxes: %s", exc)
        return done
    candidates = [r for r in paused if r.id in here]

    async def drop(rec: SandboxRecord) -> CompactionReport | None:
        rec = await asyncio.to_thread(manager.registry.get, rec.id)
        manifest = await asyncio.to_thread(durable_manifest, manager, rec)
        if manifest is None:
            return None
        directory = manager.directory(rec.id)
        return await asyncio.to_thread(drop_paused, directory, manifest, sandbox_id=rec.id)

    return await sweep_due(manager, candidates, now, low_disk=low_disk, limit=limit, one=drop)


async def sweep_due(
    manager: ManagerCore,
    candidates: Iterable[SandboxRecord],
    now: float,
    *,
    low_disk: bool,
    limit: int,
    one: Callable[[SandboxRecord], Awaitable[CompactionReport | None]],
) -> list[CompactionReport]:
    """Run ``one`` on up to ``limit`` of ``candidates`` that are due, longest paused first:
    paused for ``compact_after_seconds`` (any of them when ``low_disk``), not running, not
    busy, and whose lock is free. ``one`` runs under the sandbox's lock and returns None when
    the sandbox, read again, no longer qualifies. A failure is logged, not raised."""
    after = manager.compact_after_seconds
    done: list[CompactionReport] = []
    for rec in sorted(candidates, key=lambda r: r.paused_at or 0):
        if len(done) >= limit:
            break
        paused_for = now - (rec.paused_at or now)
        if not low_disk and (after is None or paused_for < after):
            continue
        live = manager.live(rec.id)
        if live.lock.locked() or live.machine is not None or live.busy:
            continue
        try:
            async with live.lock:
                if live.machine is not None:
                    continue
                report = await one(rec)
        except TorporError as exc:
            log.warning("compaction of %s failed: %s", rec.id, exc)
            continue
        if report is not None:
            done.append(report)
    return done
