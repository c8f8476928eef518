"""A QMP socket that accepts and never greets is an EngineError, not a hang.

QEMU serves one QMP client at a time: while another process keeps its connection (a manager
closed without pausing, in a process that lives on), a new connect is accepted by the kernel
and then never greeted. Re-attaching to that QEMU used to wait forever."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from torpor.errors import EngineError
from torpor.sandbox.vm import machine as machine_mod
from torpor.sandbox.vm.machine import MachineSpec, QemuMachine


def test_a_qmp_that_never_greets_fails_within_its_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tmp_path / "m"
    directory.mkdir()
    holder = subprocess.Popen(["sleep", "60"], cwd=directory)  # stands in for the QEMU
    mute = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        (directory / "qemu.pid").write_text(str(holder.pid))
        mute.bind(str(directory / "qmp.sock"))
        mute.listen(4)  # connects are queued, never accepted nor greeted
        monkeypatch.setattr(machine_mod, "QMP_TIMEOUT", 1.0)
        template: Any = None
        t0 = time.monotonic()
        with pytest.raises(EngineError, match="did not answer"):
            asyncio.run(QemuMachine.attach(directory, template, MachineSpec()))
        assert time.monotonic() - t0 < 20  # bounded (a hang is what this guards against)
    finally:
        mute.close()
        holder.kill()
        holder.wait()
