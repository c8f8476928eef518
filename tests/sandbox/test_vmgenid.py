"""The VM generation id: kept across the wakes of one machine, new for every clone."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path

import pytest

from torpor.sandbox.vm.machine_dir import (
    build_command,
    clone_machine_dir,
    ensure_generation_id,
    read_machine_json,
)

GUID = "6f1a9a52-6a3d-4c8e-9f0e-3a4b5c6d7e8f"


def _config(**extra: object) -> dict[str, object]:
    return {
        "version": 1,
        "machine": "pc-i440fx-7.2",
        "accel": "tcg",
        "vcpus": 1,
        "memory_mib": 256,
        "kernel": "k",
        "initrd": "i",
        "append": "a",
        "devices": [],
        **extra,
    }


def _vmgenid(cmd: list[str]) -> str:
    return next(a for a in cmd if a.startswith("vmgenid,"))


def test_the_command_line_carries_the_saved_id() -> None:
    assert (
        _vmgenid(build_command(_config(vmgenid=GUID), incoming=True))
        == f"vmgenid,guid={GUID},id=vmgenid0"
    )
    assert _vmgenid(build_command(_config(), incoming=True)) == "vmgenid,guid=auto,id=vmgenid0"


def test_a_clone_gets_a_new_id_that_then_stays(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    with open(src / "ram", "wb") as f:
        f.truncate(1 << 20)
    (src / "state").write_bytes(b"device state")
    (src / "machine.json").write_text(json.dumps(_config(vmgenid=GUID)))
    subprocess.run(
        ["qemu-img", "create", "-q", "-f", "qcow2", str(src / "disk.qcow2"), "8M"], check=True
    )
    clone_machine_dir(src, dst)
    config = read_machine_json(dst)
    first = config["vmgenid"]  # chosen by the clone: its first wake writes nothing
    assert first not in (GUID, None)
    assert {k: v for k, v in read_machine_json(src).items() if k != "vmgenid"} == {
        k: v for k, v in config.items() if k != "vmgenid"
    }
    clone_machine_dir(src, tmp_path / "other")  # another clone, another generation
    assert read_machine_json(tmp_path / "other")["vmgenid"] not in (GUID, first)
    ensure_generation_id(dst, config)  # its wakes keep it
    assert read_machine_json(dst)["vmgenid"] == first
    del config["vmgenid"]  # a machine from before ids were kept gets one at its wake
    ensure_generation_id(dst, config)
    assert config["vmgenid"] not in (None, first) and read_machine_json(dst) == config


@pytest.mark.qemu
def test_wakes_keep_the_id_and_clones_change_it(qemu_home: Path) -> None:
    from torpor.sandbox import template as templates
    from torpor.sandbox.vm.machine import MachineSpec, QemuMachine

    info = templates.get("python")
    directory = qemu_home / "sandboxes" / "gen"
    clone_machine_dir(info.snapshot_dir, directory)
    machine = QemuMachine(
        directory, info, MachineSpec(vcpus=info.vcpus, memory_mib=info.memory_mib)
    )

    async def guid() -> str:
        return str(
            await machine.qmp(
                "qom-get", {"path": "/machine/peripheral/vmgenid0", "property": "guid"}
            )
        )

    async def scenario() -> list[str]:
        seen = []
        await machine.wake()
        try:
            seen.append(await guid())
            await machine.hibernate()
            await machine.wake()
            seen.append(await guid())
        finally:
            await machine.kill()
        return seen

    one, two = asyncio.run(scenario())
    assert one == two == read_machine_json(directory)["vmgenid"]
    template_id = read_machine_json(Path(info.snapshot_dir)).get("vmgenid")
    assert template_id != one
    assert os.path.exists(directory / "ram")
