"""Helpers for storage tests that need no VM: a fake hibernated machine dir on real qcow2 files."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from torpor.config import Paths, paths


def qemu_io(image: Path, *commands: str) -> str:
    args = ["qemu-io"]
    for c in commands:
        args += ["-c", c]
    return subprocess.run([*args, str(image)], check=True, capture_output=True, text=True).stdout


def make_home(tmp_path: Path) -> Paths:
    p = paths(tmp_path / "home").ensure()
    tdir = p.templates / "python" / "snapshot"
    tdir.mkdir(parents=True)
    subprocess.run(
        ["qemu-img", "create", "-q", "-f", "qcow2", str(tdir / "disk.qcow2"), "32M"], check=True
    )
    qemu_io(tdir / "disk.qcow2", "write -P 0x11 0 1M")
    return p


def make_machine(p: Paths, sid: str, *, ram_mib: int = 8, fill: int = 0x42) -> Path:
    """A sandbox dir as a hibernated machine looks: sparse RAM, state, machine.json, overlay."""
    d = p.sandboxes / sid
    d.mkdir(parents=True)
    with open(d / "ram", "wb") as f:
        f.truncate(ram_mib << 20)
        f.seek(1 << 20)
        f.write(bytes([fill]) * (256 << 10))
        f.seek(3 << 20)
        f.write(os.urandom(64 << 10))
    (d / "state").write_bytes(os.urandom(5000))
    (d / "machine.json").write_text(json.dumps({"disks": ["disk.qcow2"]}))
    (d / "console.log").write_text("boot noise")
    tdisk = p.templates / "python" / "snapshot" / "disk.qcow2"
    subprocess.run(
        [
            "qemu-img",
            "create",
            "-q",
            "-f",
            "qcow2",
            "-b",
            str(tdisk),
            "-F",
            "qcow2",
            str(d / "disk.qcow2"),
        ],
        check=True,
    )
    qemu_io(d / "disk.qcow2", f"write -P {fill} 2M 64k")
    return d
