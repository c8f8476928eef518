"""The QEMU machine: command line and clones without a VM; boot, hibernate, wake, kill,
clone independence and hot-plug with real QEMU (marked ``qemu``)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from torpor.errors import EngineError, InvalidArgument, InvalidName, InvalidState
from torpor.sandbox import template as templates
from torpor.sandbox.template import TemplateInfo
from torpor.sandbox.vm.exits import settle_exit
from torpor.sandbox.vm.machine import (
    DiskSpec,
    MachineSpec,
    QemuMachine,
    ShareSpec,
    build_command,
    clone_machine_dir,
    discard_state,
    inspect_dir,
    read_machine_json,
    socket_path,
)
from torpor.sandbox.vm.machine_dir import add_device, new_machine_config

MiB = 1024 * 1024


def _fake_template(tmp_path: Path) -> TemplateInfo:
    return TemplateInfo(
        name="t",
        directory=tmp_path,
        build_id="b",
        kernel=tmp_path / "vmlinuz",
        initrd=tmp_path / "initrd.img",
        base_image=tmp_path / "base.qcow2",
        snapshot_dir=tmp_path / "snap",
    )


def _arg_after(cmd: list[str], flag: str) -> list[str]:
    return [cmd[i + 1] for i, a in enumerate(cmd) if a == flag]


# -- command line (no VM) ----------------------------------------------------------------------


def test_command_line_puts_ram_in_a_shared_file(tmp_path: Path) -> None:
    config = new_machine_config(
        _fake_template(tmp_path), MachineSpec(vcpus=2, memory_mib=768), "tcg"
    )
    cmd = build_command(config, incoming=False)
    assert "memory-backend-file,id=ram,size=768M,mem-path=ram,share=on" in _arg_after(
        cmd, "-object"
    )
    assert "-nodefaults" in cmd and "-nographic" in cmd
    assert _arg_after(cmd, "-smp") == ["2"]
    assert "tcg,thread=multi" in _arg_after(cmd, "-accel")
    devices = _arg_after(cmd, "-device")
    assert any(d.startswith("vmgenid") for d in devices)
    assert any("name=org.torpor.agent" in d for d in devices)
    assert "-incoming" not in cmd


def test_command_line_for_wake_waits_for_a_migration(tmp_path: Path) -> None:
    config = new_machine_config(_fake_template(tmp_path), MachineSpec(), "kvm")
    cmd = build_command(config, incoming=True)
    assert _arg_after(cmd, "-incoming") == ["defer"] and "-S" in cmd
    assert _arg_after(cmd, "-cpu") == ["host"]


def test_extra_devices_get_stable_slots_and_appear_on_the_command_line(tmp_path: Path) -> None:
    spec = MachineSpec(
        disks=[DiskSpec("vol1", tmp_path / "v.img", format="raw")],
        shares=[ShareSpec("drv1", tmp_path, tag="drv1", read_only=True)],
    )
    config = new_machine_config(_fake_template(tmp_path), spec, "tcg")
    slots = [d["slot"] for d in config["devices"]]
    assert slots == [8, 9]
    rec = add_device(config, DiskSpec("vol2", tmp_path / "w.qcow2"))
    assert rec["slot"] == 10
    cmd = build_command(config, incoming=True)
    devices = _arg_after(cmd, "-device")
    assert "virtio-blk-pci,id=vol1,drive=blk-vol1,bus=pci.0,addr=0x8" in devices
    assert any(d.startswith("virtio-9p-pci,id=drv1") and "addr=0x9" in d for d in devices)
    assert any("readonly=on" in f for f in _arg_after(cmd, "-fsdev"))
    blockdevs = [json.loads(b) for b in _arg_after(cmd, "-blockdev") if b.startswith("{")]
    assert {b["node-name"] for b in blockdevs} == {"blk-vol1", "blk-vol2"}


@pytest.mark.parametrize(
    "spec, accel, error",
    [
        pytest.param(MachineSpec(vcpus=0), "tcg", InvalidArgument, id="no-vcpus"),
        pytest.param(MachineSpec(memory_mib=16), "tcg", InvalidArgument, id="tiny-ram"),
        pytest.param(MachineSpec(), "hvf", InvalidArgument, id="unknown-accel"),
        pytest.param(
            MachineSpec(disks=[DiskSpec("Bad Id", Path("/x"))]),
            "tcg",
            InvalidName,
            id="bad-device-id",
        ),
        pytest.param(
            MachineSpec(disks=[DiskSpec("a", Path("/x")), DiskSpec("a", Path("/y"))]),
            "tcg",
            InvalidArgument,
            id="duplicate-id",
        ),
        pytest.param(
            MachineSpec(disks=[DiskSpec("a", Path("/x"), format="vmdk")]),
            "tcg",
            InvalidArgument,
            id="bad-format",
        ),
    ],
)
def test_bad_machine_specs_are_refused(
    tmp_path: Path, spec: MachineSpec, accel: str, error: type[Exception]
) -> None:
    with pytest.raises(error):
        new_machine_config(_fake_template(tmp_path), spec, accel)


# -- clone (no VM) -----------------------------------------------------------------------------


def _fake_hibernated(d: Path) -> None:
    d.mkdir(parents=True)
    with open(d / "ram", "wb") as f:
        f.truncate(64 * MiB)
        f.seek(3 * MiB)
        f.write(b"guest page" * 100)
        f.seek(40 * MiB)
        f.write(b"\xff" * 4096)
    (d / "state").write_bytes(b"device state")
    (d / "machine.json").write_text(json.dumps({"version": 1, "devices": []}))
    subprocess.run(
        ["qemu-img", "create", "-q", "-f", "qcow2", str(d / "disk.qcow2"), "64M"], check=True
    )


def test_clone_copies_ram_sparsely_and_chains_the_disk(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    _fake_hibernated(src)
    clone_machine_dir(src, dst)
    assert (dst / "ram").read_bytes() == (src / "ram").read_bytes()
    assert os.stat(dst / "ram").st_blocks * 512 < 8 * MiB  # holes stayed holes
    assert (dst / "state").read_bytes() == b"device state"
    # the same machine, with a VM generation id of its own (chosen when the clone is made)
    original, cloned = read_machine_json(src), read_machine_json(dst)
    assert cloned.pop("vmgenid") not in (None, original.pop("vmgenid", None))
    assert cloned == original
    info = json.loads(
        subprocess.run(
            ["qemu-img", "info", "--output=json", "-U", str(dst / "disk.qcow2")],
            capture_output=True,
            check=True,
        ).stdout
    )
    assert info["backing-filename"] == str(src / "disk.qcow2")
    assert not (dst / "state.tmp").exists()


def test_clones_are_independent_files(tmp_path: Path) -> None:
    src = tmp_path / "src"
    _fake_hibernated(src)
    clone_machine_dir(src, tmp_path / "a")
    clone_machine_dir(src, tmp_path / "b")
    with open(tmp_path / "a" / "ram", "r+b") as f:
        f.seek(3 * MiB)
        f.write(b"changed!")
    assert (tmp_path / "b" / "ram").read_bytes() == (src / "ram").read_bytes()


def test_clone_of_a_machine_without_state_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "src"
    _fake_hibernated(src)
    (src / "state").unlink()
    with pytest.raises(InvalidState):
        clone_machine_dir(src, tmp_path / "dst")
    assert not (tmp_path / "dst" / "state").exists()


def test_inspect_and_discard_state(tmp_path: Path) -> None:
    d = tmp_path / "m"
    _fake_hibernated(d)
    found = inspect_dir(d)
    assert found.has_state and found.qemu_pid is None
    (d / "state.tmp").write_bytes(b"partial")
    discard_state(d)
    assert not inspect_dir(d).has_state and not (d / "state.tmp").exists()


def test_wake_without_state_is_an_invalid_state(tmp_path: Path) -> None:
    d = tmp_path / "m"
    _fake_hibernated(d)
    (d / "state").unlink()
    machine = QemuMachine(d, _fake_template(tmp_path), MachineSpec())
    with pytest.raises(InvalidState):
        asyncio.run(machine.wake())
    with pytest.raises(InvalidState):
        asyncio.run(machine.hibernate())


class _PlugRecorder:
    """A stand-in for a running QEMU's QMP: what was plugged, and unplugged again."""

    def __init__(self, fail: str | None = None) -> None:
        self.plugged: set[str] = set()
        self.fail = fail

    async def __call__(self, cmd: str, args: Any = None, timeout: float = 0) -> Any:
        if cmd == self.fail:
            raise EngineError(f"QMP {cmd} failed")
        if cmd in ("device_add", "netdev_add"):
            self.plugged.add(args["id"])
        elif cmd == "netdev_del":
            self.plugged.discard(args["id"])
        return {}


@pytest.mark.parametrize("kind", ["disk", "nic"])
def test_a_hot_plug_whose_record_cannot_be_written_leaves_nothing_plugged_unrecorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """A full disk failing machine.json's write after QEMU plugged the device raised a raw
    OSError and left the device in the machine but not in its record (the attach's undo
    then dropped the volume's attachment: a second writer could attach it; the next wake
    lost the card)."""
    import torpor.sandbox.vm.hotplug as hotplug_mod

    d = tmp_path / "m"
    _fake_hibernated(d)
    machine = QemuMachine(d, _fake_template(tmp_path), MachineSpec())
    qmp = _PlugRecorder()
    monkeypatch.setattr(machine, "_require_running", lambda op: None)
    monkeypatch.setattr(machine, "_qmp_exec", qmp)

    def full(directory: Path, config: dict[str, Any]) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(hotplug_mod, "write_machine_json", full)
    image = tmp_path / "vol.img"
    image.write_bytes(b"")
    with pytest.raises(EngineError):
        if kind == "disk":
            asyncio.run(machine.attach_disk(DiskSpec("vol1", image, format="raw")))
        else:
            asyncio.run(machine.attach_nic())
    recorded = {dev["id"] for dev in read_machine_json(d)["devices"]}
    assert qmp.plugged <= recorded


@pytest.mark.parametrize("fail", ["blockdev-add", "device_add"])
def test_a_hot_plug_qemu_refuses_is_not_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail: str
) -> None:
    d = tmp_path / "m"
    _fake_hibernated(d)
    machine = QemuMachine(d, _fake_template(tmp_path), MachineSpec())
    monkeypatch.setattr(machine, "_require_running", lambda op: None)
    monkeypatch.setattr(machine, "_qmp_exec", _PlugRecorder(fail))
    image = tmp_path / "vol.img"
    image.write_bytes(b"")
    with pytest.raises(EngineError):
        asyncio.run(machine.attach_disk(DiskSpec("vol1", image, format="raw")))
    assert read_machine_json(d)["devices"] == []


def test_a_hibernate_whose_state_cannot_be_synced_is_an_engine_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk failing the state file's fsync raised a raw OSError out of hibernate
    (documented: EngineError, the guest resumed, no state written)."""
    d = tmp_path / "m"
    _fake_hibernated(d)
    (d / "state").unlink()
    machine = QemuMachine(d, _fake_template(tmp_path), MachineSpec())
    sent: list[str] = []

    async def qmp(cmd: str, args: Any = None, timeout: float = 0) -> Any:
        sent.append(cmd)
        return {"status": "completed"}

    async def pass_fd(fd: int) -> None:
        pass

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(machine, "_require_running", lambda op: None)
    monkeypatch.setattr(machine, "is_running", lambda: True)
    monkeypatch.setattr(machine, "_qmp_exec", qmp)
    monkeypatch.setattr(machine, "_pass_fd", pass_fd)
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(EngineError):
        asyncio.run(machine.hibernate())
    monkeypatch.undo()
    assert sent[-1] == "cont"
    assert not (d / "state").exists() and not (d / "state.tmp").exists()


# -- real QEMU -----------------------------------------------------------------------------------


async def _run(machine: QemuMachine, code: str) -> str | None:
    from torpor.sandbox.vm.channel import GuestChannel

    async with await GuestChannel.connect(machine.agent_socket, timeout=120) as ch:
        execution = await ch.run_code(code, timeout=120)
        assert execution.error is None, execution.error
        return execution.text


async def _shell(machine: QemuMachine, cmd: str) -> str:
    from torpor.sandbox.vm.channel import GuestChannel

    async with await GuestChannel.connect(machine.agent_socket, timeout=120) as ch:
        result = await ch.run_command(cmd, timeout=120)
        assert result.exit_code == 0, result.stderr
        return result.stdout


def _clone(qemu_home: Path, name: str, source: Path | None = None) -> QemuMachine:
    info = templates.get("python")
    d = qemu_home / "sandboxes" / name
    clone_machine_dir(source or info.snapshot_dir, d)
    return QemuMachine(d, info, MachineSpec())


@pytest.mark.qemu
def test_hibernate_and_wake_keep_the_guest_ram(qemu_home: Path) -> None:
    machine = _clone(qemu_home, "sb1")

    async def scenario() -> None:
        await machine.wake()
        assert machine.is_running() and not (machine.directory / "state").exists()
        assert await _run(machine, "secret = 6 * 7\nsecret") == "42"
        pid = machine.pid
        assert pid is not None
        await machine.hibernate()
        assert not machine.is_running()
        assert inspect_dir(machine.directory).has_state  # durable when hibernate returns
        await settle_exit(machine.directory)  # QEMU, told to quit, exits on its own time
        assert not Path(f"/proc/{pid}").exists()  # QEMU gone: no RAM held by a process
        await machine.wake()
        assert await _run(machine, "secret + 1") == "43"
        await machine.hibernate()
        await machine.wake()  # at once: the start waits for the last QEMU to be gone
        assert await _run(machine, "secret + 2") == "44"
        await machine.kill()
        assert not machine.is_running()
        assert (machine.directory / "ram").exists()  # kill keeps the files

    asyncio.run(scenario())


@pytest.mark.qemu
def test_clones_of_one_machine_run_independently(qemu_home: Path) -> None:
    parent = _clone(qemu_home, "parent")

    async def scenario() -> None:
        await parent.wake()
        await _run(parent, "value = 'parent'")
        await parent.hibernate()
        a = _clone(qemu_home, "a", parent.directory)
        b = _clone(qemu_home, "b", parent.directory)
        await a.wake()
        await b.wake()
        try:
            await _run(a, "value = 'a'")
            await _shell(a, "echo from-a > /root/file && sync")
            assert await _run(b, "value") == "'parent'"
            assert await _shell(b, "cat /root/file 2>/dev/null || echo none") == "none\n"
            assert await _run(a, "value") == "'a'"
        finally:
            await a.kill()
            await b.kill()

    asyncio.run(scenario())


@pytest.mark.qemu
@pytest.mark.parametrize("delay", [0.0, 0.01, 0.03])
def test_a_kill_during_hibernate_leaves_a_whole_state_or_none(
    qemu_home: Path, delay: float
) -> None:
    machine = _clone(qemu_home, f"crash{int(delay * 1000)}")

    async def scenario() -> None:
        await machine.wake()
        await _run(machine, "kept = 'yes'")
        pid = machine.pid
        assert pid is not None

        async def killer() -> None:
            await asyncio.sleep(delay)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

        k = asyncio.create_task(killer())
        with contextlib.suppress(EngineError):
            await machine.hibernate()
        await k
        await machine.kill()
        found = inspect_dir(machine.directory)
        if found.has_state:  # whole: it must load, with the guest's values intact
            await machine.wake()
            assert await _run(machine, "kept") == "'yes'"
            await machine.kill()
        else:
            assert not (machine.directory / "state").exists()

    asyncio.run(scenario())


@pytest.mark.qemu
def test_a_hot_plugged_disk_survives_hibernate_and_wake(qemu_home: Path, tmp_path: Path) -> None:
    machine = _clone(qemu_home, "hot")
    image = tmp_path / "vol.img"
    with open(image, "wb") as f:
        f.truncate(16 * MiB)

    async def scenario() -> None:
        await machine.wake()
        try:
            await machine.attach_disk(DiskSpec("vol1", image, format="raw", serial="vol1"))
            out = await _shell(
                machine,
                "for i in $(seq 50); do [ -e /sys/block/vdb ] && break;"
                " sleep 0.2; done; cat /sys/block/vdb/size",
            )
            assert int(out) == 16 * MiB // 512
            await _shell(machine, "echo on-the-volume | dd of=/dev/vdb conv=fsync 2>/dev/null")
            devices = read_machine_json(machine.directory)["devices"]
            assert [d["id"] for d in devices] == ["vol1"]
            await machine.hibernate()
            await machine.wake()
            assert (await _shell(machine, "head -c 14 /dev/vdb")) == "on-the-volume\n"[:14]
            with pytest.raises(InvalidArgument):
                await machine.attach_disk(DiskSpec("vol1", image, format="raw"))
            await machine.detach("vol1")
            assert read_machine_json(machine.directory)["devices"] == []
            out = await _shell(
                machine,
                "for i in $(seq 50); do [ -e /sys/block/vdb ] || break;"
                " sleep 0.2; done; ls /sys/block",
            )
            assert "vdb" not in out.split()
            await machine.hibernate()  # the next wake's command line has no vol1
            await machine.wake()
            with pytest.raises(InvalidArgument):
                await machine.detach("vol1")
        finally:
            await machine.kill()
        assert image.read_bytes().startswith(b"on-the-volume")

    asyncio.run(scenario())


@pytest.mark.qemu
def test_a_share_is_attached_to_a_running_guest(qemu_home: Path, tmp_path: Path) -> None:
    machine = _clone(qemu_home, "share")
    host_dir = tmp_path / "drive"
    host_dir.mkdir()
    (host_dir / "hello.txt").write_text("from the host")

    async def scenario() -> None:
        await machine.wake()
        try:
            await _run(machine, "mark = 'still here'")
            await machine.attach_share(ShareSpec("drv1", host_dir, tag="drv1"))
            assert await _run(machine, "mark") == "'still here'"
            out = await _shell(
                machine,
                "mkdir -p /mnt/d; for i in $(seq 50); do "
                "mount -t 9p -o trans=virtio,version=9p2000.L drv1 "
                "/mnt/d 2>/dev/null && break; sleep 0.2; done; "
                "cat /mnt/d/hello.txt; echo back > /mnt/d/back.txt; "
                "umount /mnt/d",
            )
            assert out == "from the host"
            assert (host_dir / "back.txt").read_text() == "back\n"
            await machine.hibernate()  # unmounted: migration is allowed again
            assert "-fsdev" in build_command(read_machine_json(machine.directory), incoming=True)
            await machine.wake()
            assert await _run(machine, "mark") == "'still here'"
        finally:
            await machine.kill()

    asyncio.run(scenario())


def test_long_socket_paths_get_a_short_symlink(tmp_path: Path) -> None:
    import socket

    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    real = deep / "agent.sock"
    server = socket.socket(socket.AF_UNIX)
    old = os.getcwd()
    os.chdir(deep)  # bind by a relative name, as QEMU does
    try:
        server.bind("agent.sock")
    finally:
        os.chdir(old)
    server.listen(1)
    short = socket_path(real)
    assert len(str(short)) < 100 and short != real
    with socket.socket(socket.AF_UNIX) as client:
        client.connect(str(short))
    server.close()
    assert socket_path(tmp_path / "a.sock") == tmp_path / "a.sock"


def test_short_links_of_deleted_machines_are_pruned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    (tmp_path / "run").mkdir()
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    gone, paused = deep / "gone", deep / "paused"
    gone.mkdir(parents=True)
    paused.mkdir()
    old = socket_path(gone / "agent.sock")
    kept = socket_path(paused / "agent.sock")  # no socket yet: a paused machine's link stays
    gone.rmdir()  # the sandbox was deleted
    new = socket_path(deep / "new" / "agent.sock")  # making a link prunes the stale ones,
    assert not old.is_symlink()
    assert new.is_symlink()  # not itself (a machine's directory may come after its link)
    assert kept.is_symlink()


@pytest.mark.qemu
@pytest.mark.parametrize("delay", [0.0, 0.02, 0.06])
def test_a_kill_during_wake_leaves_the_state_loadable_or_consumed(
    qemu_home: Path, delay: float
) -> None:
    machine = _clone(qemu_home, f"wakecrash{int(delay * 1000)}")

    async def scenario() -> None:
        await machine.wake()
        await _run(machine, "kept = 'yes'")
        await machine.hibernate()

        async def killer() -> None:
            await asyncio.sleep(delay)
            for _ in range(200):  # wait for the new QEMU to exist, then kill it
                pid = machine.pid
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    return
                await asyncio.sleep(0.001)

        k = asyncio.create_task(killer())
        with contextlib.suppress(EngineError):
            await machine.wake()
        await k
        await machine.kill()
        if inspect_dir(machine.directory).has_state:  # never ran: the pair still loads
            await machine.wake()
            assert await _run(machine, "kept") == "'yes'"
            await machine.kill()
        else:  # the guest ran on: its state was consumed, so a stale one cannot be loaded
            with pytest.raises(InvalidState):
                await machine.wake()

    asyncio.run(scenario())
