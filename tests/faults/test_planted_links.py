"""What an escaped QEMU could plant in its own sandbox directory, which its uid owns, for the
root server to trip over: a symlink (or a FIFO) where the server reads or writes a file, a
manifest naming a file outside the home as the template's RAM, a disk whose backing file
is a host file. None of them makes the server read, write or chown anything outside.
No VM: the directories are laid out as a hibernated machine leaves them."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.sandbox.fakes import FakeEngine
from tests.sandbox.storage_helpers import make_home, make_machine
from torpor._tail import log_tail, trim_log
from torpor.config import QEMU_UID_BASE, paths
from torpor.errors import EngineError, StorageError
from torpor.sandbox.manager import SandboxManager
from torpor.sandbox.storage.chunks import ChunkStore
from torpor.sandbox.storage.compaction import MARKER, compact, expand
from torpor.sandbox.vm import jail as jail_mod
from torpor.sandbox.vm.disk import write_atomic, write_overlay
from torpor.sandbox.vm.jail import Jail

MIB = 1 << 20


def test_compaction_does_not_follow_a_ram_link(tmp_path: Path) -> None:
    p = make_home(tmp_path)
    d = make_machine(p, "sb1")
    secret = tmp_path / "secret"
    secret.write_bytes(b"host data\n" * 100)
    (d / "ram").unlink()
    (d / "ram").symlink_to(secret)
    with pytest.raises(StorageError):
        compact(d, ChunkStore(p.chunks), None)
    assert secret.read_bytes() == b"host data\n" * 100  # neither read into chunks nor emptied
    (d / "ram").unlink()
    os.mkfifo(d / "ram")  # a FIFO would have held the sandbox's lock forever
    with pytest.raises(StorageError):
        compact(d, ChunkStore(p.chunks), None)


def test_a_wake_does_not_write_through_a_ram_link(tmp_path: Path) -> None:
    p = make_home(tmp_path)
    d = make_machine(p, "sb1")
    store = ChunkStore(p.chunks)
    compact(d, store, None)
    victim = tmp_path / "authorized_keys"
    victim.write_bytes(b"root's own key\n")
    (d / "ram").unlink()
    (d / "ram").symlink_to(victim)  # swapped while paused
    with pytest.raises(StorageError):
        expand(d, store)
    assert victim.read_bytes() == b"root's own key\n"
    assert (d / MARKER).exists()  # the manifest stays: nothing is lost


def test_a_manifest_naming_a_host_file_as_the_template_is_not_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The template's RAM is read at a wake to rebuild from; compacted.json names it, and an
    escaped QEMU could make that any file whose size and times it can see."""
    p = make_home(tmp_path)
    tram = p.templates / "python" / "snapshot" / "ram"
    with open(tram, "wb") as f:
        f.truncate(8 * MIB)
        f.seek(1 * MIB)
        f.write(b"\x42" * (256 << 10))
    d = make_machine(p, "sb1")
    shutil.copyfile(tram, d / "ram")
    original = (d / "ram").read_bytes()
    store = ChunkStore(p.chunks)
    compact(d, store, tram)
    host = tmp_path / "elsewhere" / "templates" / "x" / "snapshot" / "ram"
    host.parent.mkdir(parents=True)
    shutil.copyfile(tram, host)  # the same bytes: only the place is wrong
    marker = json.loads((d / MARKER).read_text())
    st = host.stat()  # what the manifest records of a template: its path, size and mtime
    marker["template"] = {"path": str(host), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    (d / MARKER).write_text(json.dumps(marker))
    opened: list[str] = []
    real_open = os.open

    def watch(path: object, *a: object, **k: object) -> int:
        opened.append(str(path))
        return real_open(path, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", watch)
    expand(d, store)  # every chunk from the store instead
    monkeypatch.undo()
    assert str(host) not in opened
    assert (d / "ram").read_bytes() == original


def test_logs_do_not_follow_a_link(tmp_path: Path) -> None:
    secret = tmp_path / "shadow"
    secret.write_text("root:$6$secret-hash:19000:0:99999:7:::\n")
    log = tmp_path / "console.log"
    log.symlink_to(secret)
    assert log_tail(log) == ""
    with pytest.raises(OSError):
        trim_log(log, limit=1, keep=1)
    assert secret.read_text().startswith("root:$6$secret-hash")

    async def main() -> str:
        mgr = SandboxManager(paths(tmp_path / "home"), engine=FakeEngine())
        try:
            info = await mgr.create()
            await mgr.pause(info.id)
            console = mgr.directory(info.id) / "console.log"
            console.unlink(missing_ok=True)
            console.symlink_to(secret)
            return await mgr.logs(info.id)
        finally:
            await mgr.close(pause=False)

    assert "secret-hash" not in asyncio.run(main())


def test_an_atomic_write_replaces_a_planted_tmp_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    target = tmp_path / "machine.json"
    (tmp_path / ".machine.json.tmp").symlink_to(victim)
    write_atomic(target, b'{"ok": true}')
    assert victim.read_text() == "untouched"
    assert json.loads(target.read_text()) == {"ok": True}
    assert not (tmp_path / ".machine.json.tmp").exists()


@pytest.fixture
def open_home() -> Iterator[Path]:
    home = Path(tempfile.mkdtemp(prefix="torpor-planted-"))
    yield home
    shutil.rmtree(home, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="the jail hands files over only as root")
def test_a_backing_file_outside_the_home_is_never_handed_to_qemu(
    open_home: Path, tmp_path: Path
) -> None:
    """prepare() gives QEMU's uid the files its disk chain names; the overlay's header is
    that uid's to write, so a backing file of "/etc/shadow" would have been chowned to it."""
    p = paths(open_home).ensure()
    d = p.sandboxes / "sb1"
    d.mkdir(parents=True)
    host = tmp_path / "host-secret"
    host.write_text("root only\n")
    host.chmod(0o600)
    write_overlay(d / "disk.qcow2", os.fsencode(str(host)), 1 * MIB)
    with pytest.raises(EngineError, match="outside"):
        jail_mod.prepare(d, Jail(QEMU_UID_BASE + 1), {})
    st = host.stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o600)


@pytest.mark.skipif(os.geteuid() != 0, reason="the jail hands files over only as root")
def test_a_backing_file_in_the_homes_templates_is_handed_over(open_home: Path) -> None:
    """The check keeps what runs: a sandbox, and a clone warming in the pool under the
    home's cache, on a template's disk (here behind a link, as the tests' shared templates)."""
    shared = open_home / "shared-templates"
    disk = shared / "python" / "snapshot" / "disk.qcow2"
    disk.parent.mkdir(parents=True)
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(disk), "1M"], check=True)
    p = paths(open_home / "home").ensure()
    open_home.chmod(0o711)  # mkdtemp made it 0700
    p.templates.rmdir()
    p.templates.symlink_to(shared)
    for d in (p.sandboxes / "sb1", p.home / "cache" / "pool" / "python" / "b1" / "x.tmp"):
        d.mkdir(parents=True)
        write_overlay(
            d / "disk.qcow2", os.fsencode(str(p.templates / "python/snapshot/disk.qcow2")), 1 * MIB
        )
        jail_mod.prepare(d, Jail(QEMU_UID_BASE + 1), {})
        assert (d / "disk.qcow2").stat().st_uid == QEMU_UID_BASE + 1


@pytest.mark.skipif(os.geteuid() != 0, reason="the jail hands files over only as root")
def test_a_backing_file_of_the_homes_own_files_is_never_handed_to_qemu(open_home: Path) -> None:
    """The home holds more than disk layers: its registry, the tenants' memory databases, the
    uid table, other tenants' sandboxes and volumes. A disk header naming one of them is
    refused like a host file, and nothing there (nor a directory above it) changes owner or
    mode."""
    p = paths(open_home).ensure()
    p.registry.write_text("every tenant's sandboxes\n")
    p.registry.chmod(0o600)
    db = p.memory / "other-tenant.db"
    db.write_text("another tenant's memory\n")
    db.chmod(0o600)
    other = p.sandboxes / "sb2"  # another tenant's machine and volume
    other.mkdir(parents=True)
    ram = other / "ram"
    ram.write_text("another tenant's RAM\n")
    ram.chmod(0o600)
    p.volumes.mkdir(parents=True, exist_ok=True)
    volume = p.volumes / "vol-other.img"
    volume.write_text("another tenant's volume\n")
    volume.chmod(0o600)
    d = p.sandboxes / "sb1"
    d.mkdir(parents=True)
    for target in (p.registry, db, ram, volume):
        before = {
            f: (f.stat().st_uid, f.stat().st_gid, f.stat().st_mode)
            for f in {target, target.parent} - {p.home}  # (the home: opened for sb1)
        }
        write_overlay(d / "disk.qcow2", os.fsencode(str(target)), 1 * MIB)
        with pytest.raises(EngineError, match="outside"):
            jail_mod.prepare(d, Jail(QEMU_UID_BASE + 1), {})
        after = {
            f: (f.stat().st_uid, f.stat().st_gid, f.stat().st_mode)
            for f in {target, target.parent} - {p.home}  # (the home: opened for sb1)
        }
        assert after == before


@pytest.mark.skipif(os.geteuid() != 0, reason="the jail hands files over only as root")
def test_a_machine_json_naming_host_files_hands_none_of_them_to_qemu(
    open_home: Path, tmp_path: Path
) -> None:
    """machine.json is in the sandbox directory QEMU's uid owns, so an escaped QEMU can
    rewrite it: a kernel, initrd or device path naming a host file, the home's registry or a
    volume's record had it opened to (or chowned to) that uid at the next start."""
    p = paths(open_home).ensure()
    host = tmp_path / "host-secret"
    host.write_text("root only\n")
    p.registry.write_text("every tenant's sandboxes\n")
    p.volumes.mkdir(parents=True, exist_ok=True)
    record = p.volumes / "vol-mine.json"
    record.write_text('{"attachments": []}\n')
    d = p.sandboxes / "sb1"
    d.mkdir(parents=True)
    subprocess.run(
        ["qemu-img", "create", "-q", "-f", "qcow2", str(d / "disk.qcow2"), "1M"], check=True
    )
    victims = (host, p.registry, record)
    for f in victims:
        f.chmod(0o600)

    def device(kind: str, path: Path, read_only: bool) -> dict[str, object]:
        rec = {"kind": kind, "id": "x", "path": str(path), "read_only": read_only, "slot": 8}
        return rec | ({"format": "raw"} if kind == "disk" else {"tag": "x"})

    for target in victims:
        configs: list[dict[str, object]] = [{"kernel": str(target)}, {"initrd": str(target)}]
        configs += [
            {"devices": [device(kind, target, read_only)]}
            for kind in ("disk", "share")
            for read_only in (False, True)
        ]
        for config in configs:
            with pytest.raises(EngineError):
                jail_mod.prepare(d, Jail(QEMU_UID_BASE + 1), config)
            st = target.stat()
            assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0, 0o600), config
