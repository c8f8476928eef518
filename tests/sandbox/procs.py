"""Finding a sandbox directory's processes from outside (QEMU runs with its cwd there)."""

from __future__ import annotations

import os
from pathlib import Path


def procs_on(directory: Path) -> list[int]:
    """Pids of the live processes whose cwd is ``directory`` (a zombie's cwd cannot be read)."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.readlink(f"/proc/{pid}/cwd") == str(directory.resolve()):
                    found.append(int(pid))
            except OSError:
                continue
    return found
