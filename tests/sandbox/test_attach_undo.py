"""Undoing what failed half-way, and limits that merges could pass: a volume or drive attach
that fails after its device was plugged, a pause with a network card, unnamed snapshots of
a long-named sandbox, labels merged over a sandbox's. On the fake engine, whose machine here
hot-plugs into machine.json as the QEMU one does."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from tests.sandbox.fakes import FakeChannel, FakeEngine, FakeMachine
from torpor.config import paths
from torpor.errors import DriveNotFound, GuestError
from torpor.sandbox.checkpoints import Checkpoints
from torpor.sandbox.manager import SandboxManager
from torpor.sandbox.vm.machine_dir import add_device, read_machine_json, write_machine_json


class PlugMachine(FakeMachine):
    """A fake machine that hot-plugs disks as the QEMU one does: into machine.json."""

    async def attach_disk(self, disk: Any) -> None:
        config = read_machine_json(self.directory)
        add_device(config, disk)
        write_machine_json(self.directory, config)

    #: run while a share is being plugged (what another client does meanwhile)
    during_plug: Any = None

    async def attach_share(self, share: Any) -> None:
        config = read_machine_json(self.directory)
        add_device(config, share)
        if PlugMachine.during_plug is not None:  # the plug hibernates and wakes: ~a second
            await asyncio.to_thread(PlugMachine.during_plug)
        write_machine_json(self.directory, config)

    async def detach(self, device_id: str) -> None:
        config = read_machine_json(self.directory)
        config["devices"] = [d for d in config["devices"] if d["id"] != device_id]
        write_machine_json(self.directory, config)


class PlugEngine(FakeEngine):
    def machine(self, directory: Path, config: Any) -> PlugMachine:
        return PlugMachine(self, directory)

    async def attach(self, directory: Path, config: Any) -> PlugMachine:
        await super().attach(directory, config)
        return PlugMachine(self, directory)


def test_a_failed_volume_mount_unplugs_the_disk_before_dropping_its_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guest never saw the disk: the undo dropped the record but left the disk plugged,
    so the volume counted as attached nowhere (a second writer could attach it)."""
    import torpor.sandbox.checkpoints.attach as attach_mod

    async def no_disk(channel: Any, serial: str, timeout: float = 20.0) -> str:
        raise GuestError(f"the guest did not see disk {serial} within {timeout} s")

    monkeypatch.setattr(attach_mod, "find_guest_disk", no_disk)

    async def main() -> None:
        m = SandboxManager(paths(tmp_path / "home"), engine=PlugEngine())
        cp = Checkpoints(m)
        try:
            vol = cp.volumes.create("memory", size_mib=16)
            a = await m.create(name="a")
            with pytest.raises(GuestError):
                await cp.attachments.attach_volume(a.id, volume=vol.id, path="/memory")
            assert read_machine_json(m.directory(a.id))["devices"] == []
            assert cp.volumes.get(vol.id).attachments == []
        finally:
            await m.close(pause=False)

    asyncio.run(main())


def test_a_drive_deleted_while_it_is_plugged_is_unplugged_again(tmp_path: Path) -> None:
    async def main() -> None:
        m = SandboxManager(paths(tmp_path / "home"), engine=PlugEngine())
        cp = Checkpoints(m)
        try:
            drive = cp.drives.create("handoff")
            a = await m.create(name="a")
            PlugMachine.during_plug = lambda: cp.drives.delete(drive.id)  # another client
            try:
                with pytest.raises(DriveNotFound):
                    await cp.attachments.attach_drive(a.id, drive=drive.id, path="/shared")
            finally:
                PlugMachine.during_plug = None
            # a share of a missing directory would fail every later wake of the sandbox
            assert read_machine_json(m.directory(a.id))["devices"] == []
        finally:
            await m.close(pause=False)

    asyncio.run(main())


def test_a_pause_with_a_network_card_is_pushed(tmp_path: Path) -> None:
    """A nic is no drive: a sandbox with internet could never make its pause durable."""
    from torpor.sandbox.storage.chunks import ChunkStore
    from torpor.sandbox.storage.pauses import push_pause
    from torpor.sandbox.vm.machine_dir import add_nic

    sandbox = tmp_path / "sandboxes" / "sbx-1"
    sandbox.mkdir(parents=True)
    (sandbox / "ram").write_bytes(b"\x01" * 4096)
    (sandbox / "state").write_bytes(b"device state")
    config: dict[str, Any] = {"devices": []}
    add_nic(config)
    (sandbox / "machine.json").write_text(json.dumps(config))
    manifest = push_pause(sandbox, ChunkStore(tmp_path / "chunks"), None, sandbox_id="sbx-1")
    assert sorted(manifest["files"]) == ["machine.json", "ram", "state"]


def test_unnamed_snapshots_of_a_long_named_sandbox_get_free_names(tmp_path: Path) -> None:
    """The default name was cut after the sandbox's name, through the time, and had one
    second's resolution: a second unnamed snapshot was a Conflict."""

    async def main() -> None:
        m = SandboxManager(paths(tmp_path / "home"), engine=FakeEngine())
        cp = Checkpoints(m)
        try:
            a = await m.create(name="a" * 60)
            first = await cp.snapshot(a.id)
            second = await cp.snapshot(a.id)  # the same second
            assert first.name != second.name
            assert first.name.startswith("a" * 30) and len(first.name) <= 63
        finally:
            await cp.settle()
            await m.close(pause=False)

    asyncio.run(main())


def test_labels_merged_past_the_limit_are_invalid(tmp_path: Path) -> None:
    from torpor.errors import InvalidArgument
    from torpor.sandbox.requests import MAX_LABELS

    async def main() -> None:
        m = SandboxManager(paths(tmp_path / "home"), engine=FakeEngine())
        try:
            await m.create(name="a", labels={f"k{i}": "v" for i in range(MAX_LABELS)})
            with pytest.raises(InvalidArgument):
                await m.get_or_create("a", labels={f"j{i}": "v" for i in range(MAX_LABELS)})
            assert len((await m.get("a")).labels) == MAX_LABELS  # unchanged
        finally:
            await m.close(pause=False)

    asyncio.run(main())


def test_a_volume_attached_while_a_snapshot_waits_for_its_lease_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The volume check ran before the sandbox's lease (cluster mode: a registry round trip)
    and its lock: a volume attached meanwhile was frozen into the snapshot, whose restores
    then plugged the volume's image as a second writer."""
    import torpor.sandbox.checkpoints.attach as attach_mod
    from tests.sandbox.fakes import DiskEngine, FakeChannel
    from torpor.errors import Conflict

    class Engine(DiskEngine):
        def machine(self, directory: Path, config: Any) -> PlugMachine:
            return PlugMachine(self, directory)

    async def disk(channel: Any, serial: str, timeout: float = 20.0) -> str:
        return "/dev/vdb"

    async def mount(self: Any, device: str, path: str, **kw: Any) -> None:
        return None

    monkeypatch.setattr(attach_mod, "find_guest_disk", disk)
    monkeypatch.setattr(FakeChannel, "mount", mount, raising=False)

    async def main() -> None:
        m = SandboxManager(paths(tmp_path / "home"), engine=Engine())
        cp = Checkpoints(m)
        leasing, leased = asyncio.Event(), asyncio.Event()

        async def take(sandbox_id: str, *, place: bool = True) -> None:
            leasing.set()
            await leased.wait()  # the cluster's lease, taken on a thread

        try:
            vol = cp.volumes.create("memory", size_mib=16)
            a = await m.create(name="a")
            monkeypatch.setattr(m, "take", take)
            snapshot = asyncio.ensure_future(cp.snapshot(a.id, name="s"))
            await leasing.wait()
            await cp.attachments.attach_volume(a.id, volume=vol.id, path="/memory")
            leased.set()
            with pytest.raises(Conflict):
                await snapshot
            assert cp.list_snapshots() == []
        finally:
            await cp.settle()
            await m.close(pause=False)

    asyncio.run(main())


def test_an_attach_waiting_for_the_volumes_lock_leaves_the_event_loop_free(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A volume file read holds the volumes' lock for as long as debugfs takes (minutes for
    a big file), and an attach's journal replay runs e2fsck under it. The attach waited for
    that lock, and replayed, on the server's event loop: every other request stood still.
    Here another thread holds the lock until the loop has run something else."""
    import threading

    import torpor.sandbox.checkpoints.attach as attach_mod

    async def disk_seen(channel: Any, serial: str, timeout: float = 20.0) -> str:
        return "/dev/vdb"

    async def mounted(self: Any, device: str, path: str, **kw: Any) -> None:
        pass

    monkeypatch.setattr(attach_mod, "find_guest_disk", disk_seen)
    monkeypatch.setattr(FakeChannel, "mount", mounted, raising=False)

    async def main() -> None:
        m = SandboxManager(paths(tmp_path / "home"), engine=PlugEngine())
        cp = Checkpoints(m)
        try:
            vol = cp.volumes.create("memory", size_mib=16)
            a = await m.create(name="a")
            held, loop_ran = threading.Event(), threading.Event()

            def hold() -> None:
                with cp.volumes.records.lock():
                    held.set()
                    loop_ran.wait(10)  # let go once the loop ran, or after 10 s

            holder = threading.Thread(target=hold)
            holder.start()
            held.wait(10)
            attach = asyncio.ensure_future(
                cp.attachments.attach_volume(a.id, volume=vol.id, path="/memory")
            )
            await asyncio.sleep(0.2)  # the attach is waiting for the lock
            ran_while_held = holder.is_alive()
            loop_ran.set()
            await attach
            holder.join(10)
            assert ran_while_held
            assert [x.sandbox_id for x in cp.volumes.get(vol.id).attachments] == [a.id]
        finally:
            await m.close(pause=False)

    asyncio.run(main())


def test_a_failed_create_with_a_volume_drops_its_attachments_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A create whose volume fails to mount kills the new sandbox and drops its
    attachments; that drop waited for the volumes' lock (which a volume file read holds for
    as long as debugfs takes) on the server's event loop, so every other request stood
    still. Here another thread takes the lock as the kill ends and holds it until the loop
    has run something else."""
    import threading

    import torpor.sandbox.checkpoints.attach as attach_mod

    async def no_disk(channel: Any, serial: str, timeout: float = 20.0) -> str:
        raise GuestError(f"the guest did not see disk {serial} within {timeout} s")

    monkeypatch.setattr(attach_mod, "find_guest_disk", no_disk)

    async def main() -> None:
        m = SandboxManager(paths(tmp_path / "home"), engine=PlugEngine())
        cp = Checkpoints(m)
        held, loop_ran = threading.Event(), threading.Event()

        def hold() -> None:
            with cp.volumes.records.lock():
                held.set()
                loop_ran.wait(10)  # let go once the loop ran, or after 10 s

        holder = threading.Thread(target=hold)
        kill = m.kill

        async def kill_then_hold(*args: Any, **kwargs: Any) -> Any:
            info = await kill(*args, **kwargs)
            holder.start()
            await asyncio.to_thread(held.wait, 10)
            return info

        monkeypatch.setattr(m, "kill", kill_then_hold)
        try:
            vol = cp.volumes.create("memory", size_mib=16)
            create = asyncio.ensure_future(
                cp.create(name="a", volumes=[{"volume": vol.id, "path": "/memory"}])
            )
            while not held.is_set():  # the create failed, and is dropping its attachments
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)
            ran_while_held = holder.is_alive()
            loop_ran.set()
            with pytest.raises(GuestError):
                await create
            holder.join(10)
            assert ran_while_held
            assert cp.volumes.get(vol.id).attachments == []
        finally:
            loop_ran.set()
            await m.close(pause=False)

    asyncio.run(main())
