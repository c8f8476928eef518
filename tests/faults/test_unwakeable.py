"""A sandbox whose saved machine is damaged for good (a truncated state or RAM file, a bad
disk, an unreadable machine.json) is not reported as "can be woken again": the row goes to
``error`` with the cause, and calls raise StateLost saying what is lost and why."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from torpor.config import paths
from torpor.errors import StateLost
from torpor.sandbox.manager import SandboxManager
from torpor.sandbox.models import SandboxState
from torpor.sandbox.vm.machine_dir import find_damage


def _machine(d: Path) -> Path:
    d.mkdir()
    (d / "machine.json").write_text(json.dumps({"memory_mib": 1}))
    with open(d / "ram", "wb") as f:
        f.truncate(1 << 20)
    description = b'{"page_size": 4096}'  # a stream's end: 0x06, its length, the JSON
    (d / "state").write_bytes(
        b"QEVM" + b"\0" * 100 + b"\x06" + len(description).to_bytes(4, "big") + description
    )
    subprocess.run(
        ["qemu-img", "create", "-q", "-f", "qcow2", str(d / "disk.qcow2"), "1M"], check=True
    )
    return d


@pytest.mark.parametrize(
    ("harm", "found"),
    [
        pytest.param(lambda d: (d / "state").write_bytes(b""), "state is not a whole", id="state"),
        pytest.param(
            lambda d: (d / "state").write_bytes((d / "state").read_bytes()[:-3]),
            "state is not a whole",
            id="state-cut-short",
        ),
        pytest.param(lambda d: (d / "ram").write_bytes(b"x"), "ram is not 1 MiB", id="ram"),
        pytest.param(lambda d: (d / "disk.qcow2").unlink(), "disk.qcow2 is missing", id="disk"),
        pytest.param(
            lambda d: (d / "disk.qcow2").write_bytes(b"garbage"), "not a qcow2", id="qcow2"
        ),
        pytest.param(
            lambda d: (d / "machine.json").write_text("{"), "machine.json", id="machine-json"
        ),
    ],
)
def test_damage_is_named(tmp_path: Path, harm: Callable[[Path], object], found: str) -> None:
    d = _machine(tmp_path / "m")
    assert find_damage(d) is None  # a whole machine: a failed wake may be retried
    harm(d)
    damage = find_damage(d)
    assert damage is not None and found in damage


@pytest.mark.qemu
def test_a_truncated_state_puts_the_sandbox_in_error_with_its_cause(qemu_home: Path) -> None:
    async def main() -> None:
        m = SandboxManager(paths(qemu_home))
        await m.start(supervise=False)
        try:
            sbx = await m.create(name="agent-u-5")
            await m.pause(sbx.id)
            state = m.directory(sbx.id) / "state"
            state.write_bytes(state.read_bytes()[:100])  # truncated, as by a full disk
            with pytest.raises(StateLost) as err:
                await m.run_code(sbx.id, "1 + 1")
            assert "state is not a whole saved state" in str(err.value)
            got = await m.get(sbx.id)
            assert got.state is SandboxState.ERROR and got.error and "cause:" in got.error
            with pytest.raises(StateLost):  # the same answer every time, no retry loop
                await m.run_code(sbx.id, "1 + 1")
            assert (m.directory(sbx.id) / "disk.qcow2").exists()  # the disk is kept
        finally:
            for info in await m.list():
                await m.kill(info.id)
            await m.close(pause=False)

    asyncio.run(main())


@pytest.mark.qemu
def test_a_sandbox_whose_machine_died_is_still_read_from_its_kept_disk(qemu_home: Path) -> None:
    """QEMU dies under a running sandbox: RAM is lost (StateLost), but the disk it kept is
    readable through the same ``read_file`` (hardening item 12: "disk kept" must mean the
    files can be had), while every other call keeps saying what was lost."""
    import os
    import signal

    from torpor.errors import PathNotFound

    async def body() -> None:
        mgr = SandboxManager(paths())
        await mgr.start(supervise=False)
        try:
            info = await mgr.create(name="doomed")
            await mgr.write_file(info.id, "/root/report.md", "# findings\nkept on disk\n")
            await mgr.run_command(info.id, "sync")
            pid = mgr.engine.inspect(mgr.directory(info.id)).qemu_pid
            assert pid
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(StateLost) as err:
                await mgr.run_code(info.id, "1 + 1")
            assert "disk kept" in err.value.data["lost"]
            assert (await mgr.get(info.id)).state is SandboxState.ERROR
            # reading still works, from the kept disk; writing does not
            got = await mgr.read_file(info.id, "/root/report.md")
            assert got == b"# findings\nkept on disk\n"
            with pytest.raises(PathNotFound):
                await mgr.read_file(info.id, "/root/never-written")
            with pytest.raises(StateLost):
                await mgr.write_file(info.id, "/root/report.md", "new")
            killed = await mgr.kill(info.id)
            assert killed.state is SandboxState.STOPPED
        finally:
            await mgr.close(pause=False)

    asyncio.run(body())


@pytest.mark.parametrize("length", [0x4006, 0x0611, 0x10603])
def test_a_whole_state_whose_description_length_holds_the_marker_byte_is_whole(
    tmp_path: Path, length: int
) -> None:
    """The description's 32-bit length follows its 0x06 marker: a length with a 0x06 byte
    in it (1 in ~128 machines) must not make a whole state read as cut short (a failed wake
    would then mark a healthy sandbox lost for good)."""
    d = _machine(tmp_path / "m")
    description = b'{"page_size": 4096, "devices": [' + b" " * (length - 34) + b"]}"
    assert len(description) == length
    (d / "state").write_bytes(
        b"QEVM" + b"\0" * 100 + b"\x01\x06" + length.to_bytes(4, "big") + description
    )
    assert find_damage(d) is None
