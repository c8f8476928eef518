"""A registry that lost its rows: detect it at start, rebuild it on request.

The registry is the one record of which sandbox directories are whose. If ``registry.db`` is
deleted or truncated, a server that started anyway would see an empty world: every sandbox
directory orphaned (paused machines never woken, then collected as garbage), running QEMUs
left behind. So :func:`orphans` lists the sandbox directories the registry has no row for, and
the manager refuses to start while there are any; ``torpor doctor --repair`` calls
:func:`repair`, which gives each orphan a row again from what its directory holds:

* a QEMU still running on it -> ``running`` (the manager re-attaches it at start);
* a whole saved machine -> ``paused``;
* neither -> ``error`` (the RAM is gone; the disk is kept).

What the directory cannot tell is lost and said so in the row's transition: the sandbox's name
(it becomes its id), tenant (``default``), labels and idle pause. Its pause retention is lost
too: a rebuilt row keeps its pause the longest a sandbox may
(:data:`~torpor.sandbox.requests.MAX_RETENTION_DAYS`) from when it was paused, so GC deletes
no pause the lost row may have kept.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from torpor.config import Paths
from torpor.sandbox.models import SandboxState
from torpor.sandbox.registry.sqlite import Registry, SandboxRecord
from torpor.sandbox.requests import MAX_RETENTION_DAYS
from torpor.sandbox.vm.machine_dir import inspect_dir

__all__ = ["orphans", "repair"]

log = logging.getLogger(__name__)

#: the note every rebuilt row carries in its first transition
REBUILT = (
    "rebuilt by torpor doctor --repair: name, tenant, labels, idle pause and pause retention "
    "were lost"
)


def orphans(paths: Paths, registry: Registry) -> list[Path]:
    """The sandbox directories the registry has no row for, oldest first."""
    root = paths.sandboxes
    if not root.is_dir():
        return []
    known = {rec.id for rec in registry.list()}
    found = [d for d in root.iterdir() if d.is_dir() and d.name.startswith("sbx-")]
    return sorted((d for d in found if d.name not in known), key=lambda d: d.stat().st_mtime)


def repair(paths: Paths, registry: Registry) -> list[SandboxRecord]:
    """Give every orphaned sandbox directory a registry row again (see the module docstring);
    return the rows made. Raises StorageError when the registry cannot be written."""
    made = []
    for directory in orphans(paths, registry):
        rec = _record(directory)
        registry.insert(rec, reason=REBUILT)
        log.warning("registry: rebuilt %s as %s", rec.id, rec.state.value)
        made.append(rec)
    return made


def _machine(directory: Path) -> tuple[str, int, int]:
    """(template, vcpus, memory_mib) of the machine.json in ``directory``, the defaults for
    what it does not say, or says wrong (a torn file; an escaped QEMU can rewrite it)."""
    try:
        config = json.loads((directory / "machine.json").read_text())
    except (OSError, ValueError):
        config = None
    if not isinstance(config, dict):
        config = {}

    def size(key: str, default: int) -> int:
        value = config.get(key)
        return value if type(value) is int and value > 0 else default

    template = config.get("template")
    return (
        template if isinstance(template, str) else "python",
        size("vcpus", 1),
        size("memory_mib", 512),
    )


def _record(directory: Path) -> SandboxRecord:
    template, vcpus, memory_mib = _machine(directory)
    status = inspect_dir(directory)
    now = time.time()
    started = directory.stat().st_mtime
    if status.has_state:  # the guest never ran past a whole state: a QEMU beside it is one
        # told to quit after its pause, or kept stopped for a warm wake (vm/linger.py)
        state, error, paused_at = SandboxState.PAUSED, None, (directory / "state").stat().st_mtime
    elif status.qemu_pid is not None:
        state, error, paused_at = SandboxState.RUNNING, None, None
    else:
        state, error, paused_at = SandboxState.ERROR, "RAM and processes; disk kept", None
    return SandboxRecord(
        id=directory.name,
        tenant="default",
        name=directory.name,
        template=template,
        state=state,
        labels={},
        vcpus=vcpus,
        memory_mib=memory_mib,
        pause_retention_days=MAX_RETENTION_DAYS,
        created_at=started,
        last_active_at=now,
        paused_at=paused_at,
        error=error,
    )
