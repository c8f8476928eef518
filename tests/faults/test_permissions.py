"""Another local user reads nothing of a torpor home: not a guest's RAM, not a disk, not a
tenant's memory rows. The home is 0700 (fixed with a warning when found open), memory
databases are 0600, and the server creates what it (and QEMU) writes with umask 077."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from torpor.config import paths
from torpor.memory import Memory

NOBODY = 65534


@pytest.fixture
def open_base() -> Iterator[Path]:
    """A world-traversable directory, as /home or /srv is: only the home's own mode protects."""
    base = Path(tempfile.mkdtemp(prefix="torpor-perm-"))
    base.chmod(0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_new_home_is_private(open_base: Path) -> None:
    p = paths(open_base / "home").ensure()
    assert _mode(p.home) == 0o700


def test_an_open_home_is_closed_with_a_warning(
    open_base: Path, caplog: pytest.LogCaptureFixture
) -> None:
    home = open_base / "home"
    home.mkdir(mode=0o755)
    home.chmod(0o755)
    with caplog.at_level(logging.WARNING, logger="torpor.config"):
        paths(home).ensure()
    assert _mode(home) == 0o700
    assert any("readable by other users" in r.getMessage() for r in caplog.records)


def test_memory_databases_are_private(open_base: Path) -> None:
    old = os.umask(0o022)  # a permissive umask must not leak the rows
    try:
        mem = Memory(str(open_base / "home"), tenant="acme", embedder=None)
        mem.scope(app="a", user="u").remember("the vault code is 4912")
        mem.close()
    finally:
        os.umask(old)
    db = open_base / "home" / "memory" / "acme.db"
    assert _mode(db) == 0o600
    assert _mode(db.parent) == 0o700


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root + setpriv")
def test_another_user_cannot_read_a_tenants_rows(open_base: Path) -> None:
    mem = Memory(str(open_base / "home"), tenant="acme", embedder=None)
    mem.scope(app="a", user="u").remember("the vault code is 4912")
    mem.close()
    db = open_base / "home" / "memory" / "acme.db"
    as_nobody = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    proc = subprocess.run([*as_nobody, "cat", str(db)], capture_output=True, check=False)
    assert proc.returncode != 0 and b"4912" not in proc.stdout
    assert b"Permission denied" in proc.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root")
def test_as_root_what_lies_in_the_home_is_closed(open_base: Path) -> None:
    """As root the QEMU group may traverse the home (torpor.sandbox.vm.jail), so nothing in it
    may rely on the home's mode: opening a home closes what is directly in it and sets umask
    077 for what comes after."""
    home = open_base / "home"
    home.mkdir()
    (home / "registry.db").write_text("rows")
    (home / "registry.db").chmod(0o644)
    (home / "chunks").mkdir(mode=0o755)
    (home / "chunks").chmod(0o755)
    old = os.umask(0o022)
    try:
        paths(home).ensure()
        now = os.umask(0o022)
    finally:
        os.umask(old)
    assert now == 0o077
    assert _mode(home / "registry.db") == 0o600
    assert _mode(home / "chunks") == 0o700
