"""A disk that cannot back a guest's RAM: the machine is not started (a guest touching a page
the file system cannot allocate gets QEMU killed by SIGBUS, its RAM with it). A small tmpfs
stands in for a full disk."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.sandbox.fakes import FakeEngine
from torpor.config import paths
from torpor.errors import StorageError
from torpor.sandbox.manager import SandboxManager
from torpor.sandbox.models import SandboxState as S


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB file system (tmpfs), unmounted after."""
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("needs root to mount a small file system")
    where = tmp_path / "small"
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_machine_whose_ram_the_disk_cannot_hold_is_not_started(
    small_disk: Path, tmp_path: Path
) -> None:
    async def main() -> None:
        m = SandboxManager(paths(small_disk / "home"), engine=FakeEngine())
        try:
            with pytest.raises(StorageError, match="not enough disk to back 128 MiB") as err:
                await m.create(name="big", memory_mib=128)
            assert err.value.data["needed"] == 128 << 20
            assert await m.list(include_stopped=True) == []  # nothing made
            assert list(m.paths.sandboxes.iterdir()) == []
        finally:
            await m.close(pause=False)

    asyncio.run(main())

    async def roomy() -> None:  # the same on a disk with room: it starts, pauses and wakes
        m = SandboxManager(paths(tmp_path / "home"), engine=FakeEngine())
        try:
            sbx = await m.create(name="big", memory_mib=128)
            await m.pause(sbx.id)
            await m.resume(sbx.id)
            assert (await m.get(sbx.id)).state is S.RUNNING
        finally:
            await m.close(pause=False)

    asyncio.run(roomy())
