"""Compaction in cluster mode: a paused sandbox's local files dropped once its pause is durable.

On one machine a long-paused sandbox is compacted into the home's chunk store
(:mod:`~torpor.sandbox.storage.compaction`: its RAM stored as chunks and patches on the
template's RAM, its other files kept). A cluster node has something better already: once a
pause is *durable*, its manifest is in PostgreSQL and every chunk it needs is in the shared
store, most of them also in this node's bounded chunk cache (the push wrote them through it).
So a durable paused sandbox is compacted by dropping its whole local directory
(:func:`drop_paused`), and a wake on this node later rebuilds it from the manifest exactly as a
wake on another node does (:func:`~torpor.sandbox.storage.pauses.begin_rebuild`: the RAM's
template chunks copied from this node's template, the others read from the cache, or the store
when the cache let them go, each verified). Nothing new is written or uploaded, no second
format needs GC marks of its own (the shared store's sweep already marks from the pause
manifests), and a compacted sandbox is, to placement, recovery and the wake path, the same as
one whose node lost its files.

Only a pause that is durable *as it is* may go: the manager checks, under the sandbox's lock
and with no upload in flight, that the registry's durable manifest is of the sandbox's current
pause (``manifest_paused_at == paused_at``) and that this node holds that pause's files.

Crash safety: the directory is first renamed aside (``.<id>.dropping``, one atomic rename,
made durable with an fsync of the parent), then deleted. A crash before the rename leaves
the directory whole (a plain paused sandbox); after it, the sandbox has no directory here and
wakes from the store; the renamed leftover is deleted by :func:`clear_leftovers` (at start
and by every sweep). Nothing is lost in either case: every byte dropped is in the store.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from torpor.errors import StorageError
from torpor.sandbox.storage.compaction import CompactionReport
from torpor.sandbox.vm.disk import fsync_dir

__all__ = ["LEFTOVER", "allocated", "clear_leftovers", "drop_paused"]

log = logging.getLogger(__name__)

#: the suffix of a directory renamed aside to be deleted (``.<sandbox id>.dropping``)
LEFTOVER = ".dropping"


def allocated(directory: Path) -> int:
    """Bytes the files under ``directory`` hold on disk (0 when it is gone)."""
    total = 0
    for root, _dirs, names in os.walk(directory):
        for name in names:
            path = Path(root) / name
            try:
                if not path.is_symlink():
                    total += path.stat().st_blocks * 512
            except OSError:
                continue  # removed while counting
    return total


def _ram_chunks(manifest: dict[str, Any]) -> tuple[int, int]:
    """(non-zero RAM chunks, those equal to the template's) of a pause manifest."""
    ram = (manifest.get("files") or {}).get("ram") or {}
    chunks = sum(c is not None for c in ram.get("chunks") or [])
    return chunks, len(manifest.get("from_template") or [])


def drop_paused(
    directory: Path, manifest: dict[str, Any], *, sandbox_id: str = ""
) -> CompactionReport:
    """Drop the paused machine's directory, whose pause ``manifest`` says is durable (the
    caller checked it, holds the sandbox's lock, and no QEMU runs on it). Returns what was
    freed (``ram_bytes_before``: every byte the directory held; nothing is added to any store).
    Raises StorageError when the rename fails (nothing changed then); a failed delete after it
    only logs (the leftover goes with :func:`clear_leftovers`)."""
    started = time.perf_counter()
    who = sandbox_id or directory.name
    before = allocated(directory)
    aside = directory.with_name(f".{directory.name}{LEFTOVER}")
    try:
        if aside.exists():  # a leftover of an earlier drop of this sandbox
            shutil.rmtree(aside)
        os.replace(directory, aside)
        fsync_dir(directory.parent)
    except OSError as exc:
        raise StorageError(
            f"sandbox {who}: cannot drop its local files: {exc}", exc=exc, sandbox_id=sandbox_id
        ) from exc
    _remove(aside)
    chunks, same = _ram_chunks(manifest)
    report = CompactionReport(
        sandbox_dir=str(directory),
        ram_bytes_before=before,
        ram_bytes_after=0,
        new_chunk_bytes=0,
        from_template=same,
        chunks=chunks,
        seconds=time.perf_counter() - started,
    )
    log.info(
        "compacted %s: its pause is durable, its %d local bytes dropped (a wake here rebuilds "
        "it from the node's cache and the store) in %.2f s",
        who,
        before,
        report.seconds,
    )
    return report


def _remove(aside: Path) -> None:
    """Delete a directory renamed aside; a failure is logged (it is retried later)."""
    try:
        shutil.rmtree(aside)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("cannot delete %s yet: %s", aside, exc)


def clear_leftovers(root: Path) -> list[str]:
    """Delete the directories under ``root`` that a drop renamed aside and a crash (or a
    failed delete) left; return the sandbox ids they were of."""
    cleared: list[str] = []
    if not root.is_dir():
        return cleared
    for path in root.iterdir():
        name = path.name
        if name.startswith(".") and name.endswith(LEFTOVER) and path.is_dir():
            _remove(path)
            cleared.append(name[1 : -len(LEFTOVER)])
    if cleared:
        log.info("deleted the leftovers of %d interrupted compactions: %s", len(cleared), cleared)
    return cleared
