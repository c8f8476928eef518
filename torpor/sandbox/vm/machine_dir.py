"""The files of a QEMU machine: specs, machine.json, the command line, directory inspection,
clones and socket paths.

No QEMU process here: used by :mod:`torpor.sandbox.vm.machine` and unit-tested alone.

A sandbox directory holds everything its machine is::

    ram            guest RAM (memory-backend-file, share=on): the RAM *is* this file
    state          the saved device state (only while hibernated; appears whole or not at all)
    disk.qcow2     the root disk: an overlay on the template's (or a snapshot's) frozen disk
    machine.json   the machine's shape: accel, CPU, RAM size, kernel, every device with its id
                   and PCI address (a wake must rebuild exactly this device set)
    qmp.sock       QMP (QEMU's control socket), agent.sock (the guest agent's virtio-serial port)
    console.log    the guest's serial console;  qemu.log  QEMU's own stderr;  qemu.pid

How hibernate and wake use ``ram`` and ``state`` (no RAM is copied either way) is
:mod:`torpor.sandbox.vm.machine`'s.

The machine type is ``pc-i440fx-7.2`` (pinned: a migration stream needs the same machine type on
both sides). Its root PCI bus takes ACPI hot-plug in every slot, so disks (virtio-blk) and shares
(virtio-9p) can be added to a running guest and then put on the next wake's command line at the
same address. Fixed devices use slots 3-4; hot-plugged ones get the first free slot from 8.

Every QEMU file argument is relative (QEMU runs with the directory as its cwd), so a cloned
directory's command line is the same and socket paths never hit the 108-byte limit.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from torpor.config import check_name
from torpor.errors import EngineError, InvalidArgument, InvalidState
from torpor.sandbox.requests import MAX_MEMORY_MIB, MAX_VCPUS, MIN_MEMORY_MIB
from torpor.sandbox.vm.disk import copy_sparse, fsync_dir, is_qcow2, new_overlay, write_atomic
from torpor.sandbox.vm.jail import Jail

__all__ = [
    "MACHINE_TYPE",
    "QEMU_BINARY",
    "BootImage",
    "DirInfo",
    "DiskSpec",
    "MachineSpec",
    "ShareSpec",
    "build_command",
    "clone_machine_dir",
    "clone_pending",
    "discard_state",
    "ensure_generation_id",
    "fill_pending",
    "inspect_dir",
    "link_state",
    "new_machine_config",
    "read_machine_json",
    "socket_path",
]

log = logging.getLogger(__name__)

QEMU_BINARY = "qemu-system-x86_64"
MACHINE_TYPE = "pc-i440fx-7.2"
#: The guest's kernel command line. ``panic=-1`` + ``-no-reboot``: a guest panic ends QEMU.
#: ``init_on_alloc=0``: Debian's kernel zeroes every page and slab object it allocates (a
#: hardening against reading stale kernel memory); under TCG each zeroing is emulated, and
#: allocation-heavy guest work (a ``stat`` allocates a page for the path) took 20-35 % more
#: QEMU CPU with it (bench/README, issue 13). The guest kernel protects no tenant from another:
#: a sandbox's VM has one, and QEMU is the boundary. A template records the command line its
#: snapshot booted with (``TemplateInfo.kernel_append``): a build replaces one booted with another.
KERNEL_APPEND = (
    "console=ttyS0 root=/dev/vda rw init=/opt/torpor/init.sh panic=-1 quiet "
    "i8042.noaux i8042.nokbd i8042.nopnp tsc=reliable init_on_alloc=0"
)
_SLOT_SERIAL = 3
_SLOT_ROOT = 4
_FIRST_HOTPLUG_SLOT = 8
_LAST_SLOT = 31
#: QEMU's own seccomp filter, as libvirt sets it: no obsolete syscalls, no set*uid/gid, no
#: fork/exec, no scheduler or resource changes. A guest that escapes into QEMU still cannot
#: spawn a shell or gain privileges.
SECCOMP_SANDBOX = (
    "-sandbox",
    "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
)
QMP_TIMEOUT = 30.0
MIGRATE_TIMEOUT = 120.0


class BootImage(Protocol):
    """What a machine boots from: a template's kernel, initrd and base disk (a
    :class:`~torpor.sandbox.template.TemplateInfo` is one; the VM layer knows no templates)."""

    @property
    def name(self) -> str: ...

    @property
    def kernel(self) -> Path: ...

    @property
    def initrd(self) -> Path: ...

    @property
    def base_image(self) -> Path: ...


@dataclass(frozen=True)
class DiskSpec:
    """An extra virtio-blk disk: ``id`` names the device, ``path`` is a qcow2 or raw image."""

    id: str
    path: Path
    read_only: bool = False
    format: str = "qcow2"
    serial: str | None = None  # shown in the guest as /dev/disk/by-id/virtio-<serial>


@dataclass(frozen=True)
class ShareSpec:
    """A host directory shared into the guest with virtio-9p under mount tag ``tag``.
    ``guest_path``: where the guest mounts it (kept in machine.json, not used by QEMU: what a
    restart needs to restore a drive's attachment that a crash kept from being recorded)."""

    id: str
    path: Path
    tag: str
    read_only: bool = False
    guest_path: str | None = None


@dataclass
class MachineSpec:
    """The shape of a machine. ``accel`` None means: what :func:`torpor.sandbox.vm.accel.probe`
    says. ``disks``/``shares`` are extra devices present from the first boot."""

    vcpus: int = 1
    memory_mib: int = 512
    accel: str | None = None
    disks: list[DiskSpec] = field(default_factory=list)
    shares: list[ShareSpec] = field(default_factory=list)
    #: who QEMU runs as (:mod:`torpor.sandbox.vm.jail`); None: the server's own user
    jail: Jail | None = None


@dataclass(frozen=True)
class DirInfo:
    """What a machine directory holds: a whole saved state, and/or a QEMU still running on it."""

    has_state: bool
    qemu_pid: int | None


# --------------------------------------------------------------------------------------------
# machine.json and the command line (pure functions: unit-tested without a VM)


def _device_record(dev: DiskSpec | ShareSpec, slot: int) -> dict[str, Any]:
    kind = "disk" if isinstance(dev, DiskSpec) else "share"
    rec = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(dev).items()}
    rec.update(kind=kind, slot=slot)
    return rec


def new_machine_config(template: BootImage, spec: MachineSpec, accel: str) -> dict[str, Any]:
    """The machine.json content of a machine about to cold-boot."""
    if not 1 <= spec.vcpus <= MAX_VCPUS:
        raise InvalidArgument(f"vcpus must be 1-{MAX_VCPUS}, not {spec.vcpus}", vcpus=spec.vcpus)
    if not MIN_MEMORY_MIB <= spec.memory_mib <= MAX_MEMORY_MIB:
        raise InvalidArgument(
            f"memory_mib must be {MIN_MEMORY_MIB}-{MAX_MEMORY_MIB}, not {spec.memory_mib}",
            memory_mib=spec.memory_mib,
        )
    if accel not in ("kvm", "tcg"):
        raise InvalidArgument(f"accel must be 'kvm' or 'tcg', not {accel!r}", accel=accel)
    config: dict[str, Any] = {
        "version": 1,
        "machine": MACHINE_TYPE,
        "accel": accel,
        "vcpus": spec.vcpus,
        "memory_mib": spec.memory_mib,
        "kernel": str(template.kernel),
        "initrd": str(template.initrd),
        "append": KERNEL_APPEND,
        "template": template.name,
        "vmgenid": str(uuid.uuid4()),
        "devices": [],
    }
    devices: list[DiskSpec | ShareSpec] = [*spec.disks, *spec.shares]
    for dev in devices:
        add_device(config, dev)
    return config


def add_device(config: dict[str, Any], dev: DiskSpec | ShareSpec) -> dict[str, Any]:
    """Add ``dev`` to ``config`` at the first free hot-plug slot; return its record.
    Raises InvalidName / InvalidArgument (id taken, bad format, no free slot)."""
    check_name(dev.id, "device id")
    if any(d["id"] == dev.id for d in config["devices"]):
        raise InvalidArgument(f"device id {dev.id!r} already in use", id=dev.id)
    if isinstance(dev, DiskSpec) and dev.format not in ("qcow2", "raw"):
        raise InvalidArgument(f"disk format must be qcow2 or raw, not {dev.format!r}")
    used = {d["slot"] for d in config["devices"]}
    free = [s for s in range(_FIRST_HOTPLUG_SLOT, _LAST_SLOT + 1) if s not in used]
    if not free:
        raise InvalidArgument("no free PCI slot for another device")
    rec = _device_record(dev, free[0])
    config["devices"].append(rec)
    return rec


#: the id of a machine's network card (one at most) in machine.json's devices
NIC_ID = "nic0"


def add_nic(config: dict[str, Any]) -> dict[str, Any]:
    """Add a virtio network card on QEMU's user-mode network (NAT to the host's, no
    inbound connections) to ``config`` at the first free slot; return its record. Raises
    InvalidArgument (it has one already, no free slot)."""
    if any(d["id"] == NIC_ID for d in config["devices"]):
        raise InvalidArgument("this machine has a network card already", id=NIC_ID)
    used = {d["slot"] for d in config["devices"]}
    free = [s for s in range(_FIRST_HOTPLUG_SLOT, _LAST_SLOT + 1) if s not in used]
    if not free:
        raise InvalidArgument("no free PCI slot for another device")
    rec = {"kind": "nic", "id": NIC_ID, "slot": free[0]}
    config["devices"].append(rec)
    return rec


def has_nic(config: dict[str, Any]) -> bool:
    """Whether the machine of ``config`` (machine.json) has a network card."""
    return any(d.get("kind") == "nic" for d in config.get("devices", []))


def nic_args(rec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``-netdev`` backend and ``-device`` of a network card record (also QMP arguments).
    The backend is user-mode networking: the guest reaches out through the host (as
    10.0.2.15, gateway 10.0.2.2, DNS 10.0.2.3); nothing reaches in."""
    netdev = {"type": "user", "id": f"net-{rec['id']}"}
    dev = {
        "driver": "virtio-net-pci",
        "id": rec["id"],
        "netdev": f"net-{rec['id']}",
        "bus": "pci.0",
        "addr": hex(rec["slot"]),
    }
    return netdev, dev


def disk_args(rec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``-blockdev`` node and ``-device`` of a disk record (also QMP arguments)."""
    node = {
        "driver": rec["format"],
        "node-name": f"blk-{rec['id']}",
        "read-only": bool(rec["read_only"]),
        "file": {"driver": "file", "filename": rec["path"]},
    }
    dev: dict[str, Any] = {
        "driver": "virtio-blk-pci",
        "id": rec["id"],
        "drive": f"blk-{rec['id']}",
        "bus": "pci.0",
        "addr": hex(rec["slot"]),
    }
    if rec.get("serial"):
        dev["serial"] = rec["serial"]
    return node, dev


def share_args(rec: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The ``-fsdev`` option and ``-device`` of a 9p share record."""
    # mapped-xattr: the guest's owner, mode and file type live in user.virtfs.* xattrs, and QEMU
    # creates every host file 0600 (directories 0700) as itself. A guest's chown/chmod 4755 or
    # mknod never becomes host ownership, a setuid bit, an exec bit or a device node; a guest
    # symlink is a regular file on the host. (``none`` passed guest ownership and modes through:
    # guest root could plant a setuid-root binary on the host.)
    fsdev = f"local,id=fs-{rec['id']},path={rec['path']},security_model=mapped-xattr" + (
        ",readonly=on" if rec["read_only"] else ""
    )
    dev = {
        "driver": "virtio-9p-pci",
        "id": rec["id"],
        "fsdev": f"fs-{rec['id']}",
        "mount_tag": rec["tag"],
        "bus": "pci.0",
        "addr": hex(rec["slot"]),
    }
    return fsdev, dev


def _opts(d: dict[str, Any]) -> str:
    return ",".join([d["driver"]] + [f"{k}={v}" for k, v in d.items() if k != "driver"])


def build_command(
    config: dict[str, Any], *, incoming: bool, pending_shares: list[dict[str, Any]] | None = None
) -> list[str]:
    """The QEMU command line for a machine.json ``config`` (file arguments relative to the
    machine directory). ``incoming``: wait for a migration stream (a wake) instead of booting.
    ``pending_shares``: 9p backends to create without their device (hot-plugged after)."""
    mem = f"{int(config['memory_mib'])}M"
    if config["accel"] == "kvm":
        accel = ["-accel", "kvm", "-cpu", "host"]
    else:
        accel = ["-accel", "tcg,thread=multi", "-cpu", "max"]
    cmd = [
        QEMU_BINARY,
        "-nodefaults",
        "-nographic",
        "-no-user-config",
        "-no-reboot",
        "-name",
        "torpor",
        "-machine",
        f"{config['machine']},memory-backend=ram",
        *accel,
        "-smp",
        str(int(config["vcpus"])),
        "-m",
        mem,
        "-object",
        f"memory-backend-file,id=ram,size={mem},mem-path=ram,share=on",
        "-kernel",
        config["kernel"],
        "-initrd",
        config["initrd"],
        "-append",
        config["append"],
        "-blockdev",
        "driver=qcow2,node-name=root,file.driver=file,file.filename=disk.qcow2",
        "-device",
        f"virtio-blk-pci,drive=root,id=vda,bus=pci.0,addr={hex(_SLOT_ROOT)}",
        "-device",
        f"virtio-serial-pci,id=vser,bus=pci.0,addr={hex(_SLOT_SERIAL)}",
        "-chardev",
        "socket,id=agent,path=agent.sock,server=on,wait=off",
        "-device",
        "virtserialport,bus=vser.0,chardev=agent,name=org.torpor.agent,id=agentport",
        # The guest's VM generation id: the same on every wake of one machine (a new one makes
        # the guest run ACPI code and reseed at once, ~30 ms of a TCG wake); a clone gets a
        # new one (clone_machine_dir). "auto" (a new one per start) for an older machine.json.
        "-device",
        f"vmgenid,guid={config.get('vmgenid', 'auto')},id=vmgenid0",
        "-chardev",
        "file,id=console,path=console.log,append=on",
        "-serial",
        "chardev:console",
        "-chardev",
        "socket,id=qmp,path=qmp.sock,server=on,wait=off",
        "-mon",
        "chardev=qmp,mode=control",
        "-pidfile",
        "qemu.pid",
        *SECCOMP_SANDBOX,
    ]
    for rec in config["devices"]:
        if rec["kind"] == "disk":
            node, dev = disk_args(rec)
            cmd += ["-blockdev", json.dumps(node), "-device", _opts(dev)]
        elif rec["kind"] == "nic":
            netdev, dev = nic_args(rec)
            cmd += ["-netdev", f"user,id={netdev['id']}", "-device", _opts(dev)]
        else:
            fsdev, dev = share_args(rec)
            cmd += ["-fsdev", fsdev, "-device", _opts(dev)]
    for rec in pending_shares or []:
        cmd += ["-fsdev", share_args(rec)[0]]
    if incoming:
        cmd += ["-S", "-incoming", "defer"]
    return cmd


def ensure_generation_id(directory: Path, config: dict[str, Any]) -> None:
    """Give ``config`` (the machine.json of ``directory``) a VM generation id if it has none
    (a clone, or a machine from before ids were kept), and save it. Raises EngineError."""
    if config.get("vmgenid"):
        return
    config["vmgenid"] = str(uuid.uuid4())
    try:
        write_machine_json(directory, config)
    except OSError as exc:
        raise EngineError(f"cannot write {directory / 'machine.json'}: {exc}", exc=exc) from exc


def read_machine_json(directory: Path) -> dict[str, Any]:
    """The machine.json of ``directory``; raises EngineError if it is missing or unreadable."""
    try:
        data: dict[str, Any] = json.loads((directory / "machine.json").read_text())
    except (OSError, ValueError) as exc:
        raise EngineError(f"cannot read {directory / 'machine.json'}: {exc}", exc=exc) from exc
    return data


def write_machine_json(directory: Path, config: dict[str, Any]) -> None:
    """Save ``config`` as the directory's machine.json, atomically. Raises OSError."""
    write_atomic(directory / "machine.json", json.dumps(config, indent=2).encode())


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child is not running
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][:1] != "Z"
    except OSError:
        return False


def qemu_pid(directory: Path) -> int | None:
    """The pid of a QEMU still running on ``directory`` (from qemu.pid, checked in /proc)."""
    try:
        pid = int((directory / "qemu.pid").read_text().strip())
    except (OSError, ValueError):
        return None
    if not _pid_alive(pid):
        return None
    try:
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return pid  # cannot check (another user): trust the pid file
    return pid if Path(cwd) == directory.resolve() else None


def process_cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user + system, every thread) the process ``pid`` has used since it started,
    from ``/proc/<pid>/stat``; None when it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(") ", 1)[1].split()
        # after "pid (comm) ": state is field 3, so utime (14) and stime (15) are 11 and 12 here
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def inspect_dir(directory: Path) -> DirInfo:
    """What ``directory`` can back: a whole saved state (``state`` next to ``ram``), a live QEMU."""
    has_state = (directory / "state").is_file() and (directory / "ram").is_file()
    return DirInfo(has_state=has_state, qemu_pid=qemu_pid(directory))


#: the first bytes of a QEMU migration stream
_STATE_MAGIC = b"QEVM"
_VM_EOF, _VM_DESCRIPTION = b"\x01", b"\x06"  # the stream's end, and the description after it
_STATE_TAIL = 4 << 20  # where the end is looked for (the description is tens of KiB)


def find_damage(directory: Path) -> str | None:
    """What makes the hibernated machine in ``directory`` unwakeable for good, or None: an
    unreadable machine.json, a RAM file not of the machine's size, a truncated or foreign state
    file, a missing or bad disk. A wake that failed for one of these fails the same way every
    time (a retry cannot help); one that failed for none of them may succeed later."""
    try:
        config = json.loads((directory / "machine.json").read_text())
        memory = int(config["memory_mib"]) << 20
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"machine.json is unreadable ({exc})"
    checks: list[tuple[str, Callable[[Path], bool], str]] = [
        ("ram", lambda f: f.stat().st_size == memory, f"is not {memory >> 20} MiB"),
        ("state", _whole_state, "is not a whole saved state"),
        ("disk.qcow2", is_qcow2, "is not a qcow2 disk"),
    ]
    for name, ok, what in checks:
        path = directory / name
        try:
            if not path.is_file():
                return f"{name} is missing"
            if not ok(path):
                return f"{name} {what}"
        except OSError as exc:
            return f"{name} cannot be read ({exc})"
    return None


def _whole_state(path: Path) -> bool:
    """True if ``path`` reads as a whole migration stream: QEMU's magic first, and last the
    device description QEMU appends (``QEMU_VM_VMDESCRIPTION``, a 32-bit length, exactly that
    many bytes of JSON to the end), or the end marker (``QEMU_VM_EOF``) when there is none."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        if f.read(len(_STATE_MAGIC)) != _STATE_MAGIC:
            return False
        f.seek(max(0, size - _STATE_TAIL))
        tail = f.read()
    # the description is JSON (no 0x06 byte in it): its marker is the file's last 0x06, or,
    # when its 32-bit length has 0x06 bytes, one of the (up to 4) 0x06 bytes before those
    described, end = False, len(tail)
    for _ in range(5):
        at = tail.rfind(_VM_DESCRIPTION, 0, end)
        if at < 0:
            break
        if len(tail) - at >= 5:
            described = True
            if at + 5 + int.from_bytes(tail[at + 1 : at + 5], "big") == len(tail):
                return True
        end = at
    return not described and tail.endswith(_VM_EOF)


def discard_state(directory: Path) -> None:
    """Remove a saved state that no longer matches the RAM file. Raises EngineError on I/O."""
    try:
        for name in ("state", "state.tmp"):
            with contextlib.suppress(FileNotFoundError):
                (directory / name).unlink()
        fsync_dir(directory)
    except OSError as exc:
        raise EngineError(f"cannot remove the state of {directory}: {exc}", exc=exc) from exc


def socket_path(path: Path) -> Path:
    """A path to connect to the unix socket ``path`` by: itself when short enough, else a
    short symlink to it (AF_UNIX paths stop at 108 bytes; ``connect`` follows symlinks)."""
    if len(str(path)) < 100:
        return path
    runtime = Path(os.environ.get("XDG_RUNTIME_DIR") or "/tmp") / f"torpor-{os.getuid()}"
    link = runtime / (hashlib.sha256(str(path).encode()).hexdigest()[:20] + ".sock")
    try:
        runtime.mkdir(mode=0o700, exist_ok=True)
        if not link.is_symlink() or os.readlink(link) != str(path):
            tmp = link.with_name(link.name + f".{os.getpid()}")
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            _prune_links(runtime)
            tmp.symlink_to(path)
            os.replace(tmp, link)
    except OSError as exc:
        raise EngineError(f"cannot make a short socket path for {path}: {exc}", exc=exc) from exc
    return link


def _prune_links(runtime: Path) -> None:
    """Remove the short links of machine directories that are gone (a deleted sandbox's). A link
    whose directory exists stays, socket or not: a paused machine's socket comes back."""
    for entry in runtime.glob("*.sock"):
        with contextlib.suppress(OSError):
            if not Path(os.readlink(entry)).parent.is_dir():
                entry.unlink()


def _write_clone_config(src: Path, dst: Path) -> None:
    """Give the clone ``dst`` the machine.json of ``src`` with a VM generation id of its own
    (a clone is a new generation), chosen now rather than at its first wake, whose
    :func:`ensure_generation_id` then writes (and syncs) nothing. Not synced here: a clone's
    ``state``, written after, is what makes it wakeable. Raises OSError, EngineError."""
    config = read_machine_json(src)
    config["vmgenid"] = str(uuid.uuid4())
    (dst / "machine.json").write_text(json.dumps(config, indent=2))


def clone_pending(src: Path, dst: Path, *, size: int, own_ram: bool = False) -> None:
    """Make ``dst`` a clone of the machine in the frozen dir ``src`` whose RAM is not whole yet
    (a child started before its RAM is written, so its QEMU's start overlaps the writing):
    ``machine.json`` is ``src``'s with a new VM generation id, and ``disk.qcow2`` a new
    overlay on ``src/disk.qcow2`` of ``size`` bytes, made without opening it (a live source
    may write that layer until its stop). ``ram`` is a hard link of ``src/ram.tmp`` (empty
    yet: a live source's stop fills it in place), or with ``own_ram`` a new file of its own at
    the RAM's size, all holes, that :func:`fill_pending` fills. It has no ``state`` until
    :func:`link_state` or :func:`fill_pending`, so it cannot be woken before. Raises
    EngineError."""
    src, dst = Path(src).resolve(), Path(dst).resolve()
    try:
        if dst.exists():  # (a new child's is not: nothing to clear, no directory sync)
            discard_state(dst)
            for name in ("disk.qcow2", "ram"):
                with contextlib.suppress(FileNotFoundError):
                    (dst / name).unlink()
        dst.mkdir(parents=True, exist_ok=True)
        if own_ram:
            ram = src / "ram.tmp" if (src / "ram.tmp").exists() else src / "ram"
            with open(dst / "ram", "xb") as f:
                f.truncate(ram.stat().st_size)
        else:
            os.link(src / "ram.tmp", dst / "ram")
        (dst / "ram").chmod(0o600)
        _write_clone_config(src, dst)
        new_overlay(src / "disk.qcow2", dst / "disk.qcow2", size=size)
    except OSError as exc:
        raise EngineError(f"cannot clone {src} to {dst}: {exc}", exc=exc) from exc


def fill_pending(ram: Path, dst: Path, state: Path | None = None) -> None:
    """Fill the RAM file of the clone :func:`clone_pending` made in ``dst`` (``own_ram``) with
    ``ram``'s data, in place (its QEMU may have it mapped, waiting); with ``state``, then give
    it a copy of that device state, last and by a rename (a clone whose RAM is half-filled has
    no state; no fsync: a clone that was never woken is removed after a crash). Raises
    EngineError."""
    try:
        copy_sparse(ram, dst / "ram", in_place=True)
        if state is not None:
            shutil.copyfile(state, dst / "state.tmp")
            os.replace(dst / "state.tmp", dst / "state")
    except OSError as exc:
        raise EngineError(f"cannot fill the clone {dst} from {ram}: {exc}", exc=exc) from exc


def link_state(state: Path, dst: Path) -> None:
    """Give the clone :func:`clone_pending` made in ``dst`` the device state saved in the
    file ``state`` (a hard link: the clone's wake consumes it at once, and the frozen dir
    drops its own name). Raises EngineError."""
    try:
        os.link(state, dst / "state")
    except OSError as exc:
        raise EngineError(f"cannot give {dst} the state {state}: {exc}", exc=exc) from exc


def clone_machine_dir(src: Path, dst: Path, *, take_ram: bool = False) -> None:
    """Make ``dst`` a hibernated copy of the hibernated machine in ``src``.

    ``take_ram``: hard-link ``src/ram`` instead of copying it: only for a caller that removes
    ``src/ram`` before the clone runs and copies from it no more (the last child of a fork or
    restore whose frozen RAM is its own: one RAM copy saved).

    Copies ``ram`` (reflink or sparse copy), ``machine.json`` and ``state`` (last, atomically:
    a clone interrupted half-way has no state and cannot be woken), and makes ``disk.qcow2``
    a new overlay whose backing file is ``src/disk.qcow2`` — so ``src`` must never run again
    (a template snapshot or a stored snapshot). Raises InvalidState if ``src`` holds no saved
    state, EngineError on I/O failure.
    """
    src, dst = Path(src).resolve(), Path(dst).resolve()
    if not (src / "state").is_file() or not (src / "ram").is_file():
        raise InvalidState(
            f"{src} holds no hibernated machine to clone", state="no-state", required="hibernated"
        )
    try:
        dst.mkdir(parents=True, exist_ok=True)
        discard_state(dst)
        for name in ("disk.qcow2", "ram"):
            with contextlib.suppress(FileNotFoundError):
                (dst / name).unlink()
        if take_ram:
            os.link(src / "ram", dst / "ram")
            (dst / "ram").chmod(0o600)
        else:
            copy_sparse(src / "ram", dst / "ram")
        _write_clone_config(src, dst)
        new_overlay(src / "disk.qcow2", dst / "disk.qcow2")
        shutil.copyfile(src / "state", dst / "state.tmp")
        with open(dst / "state.tmp", "rb") as f:
            os.fsync(f.fileno())
        os.replace(dst / "state.tmp", dst / "state")
        fsync_dir(dst)
    except OSError as exc:
        raise EngineError(f"cannot clone {src} to {dst}: {exc}", exc=exc) from exc
    log.info("cloned %s -> %s", src, dst)
