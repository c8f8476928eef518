"""Guest templates: a Debian image with Python and the torpor agent, booted once and hibernated.

A template is built in four steps, each cached or idempotent::

    1. rootfs    debootstrap + the user's apt/pip packages  (cache/rootfs/<key>, minutes)
    2. image     the rootfs + guest files -> base.qcow2      (cache/images/<key>, seconds)
    3. boot      a cold boot of that image; wait until the agent answers a ping
    4. snapshot  hibernate the booted machine into the build's snapshot/ directory

Layout of ``templates/<name>/``::

    template.json             written last, atomically: it is what makes the template exist
    builds/<build-id>/        base.qcow2, vmlinuz, initrd.img, snapshot/ (ram, state, disk.qcow2)
    snapshot -> builds/<build-id>/snapshot

Every sandbox is a clone of ``snapshot/`` (see :func:`torpor.sandbox.vm.machine.clone_machine_dir`),
and its disk overlay chains to that build's disk. A rebuild therefore makes a *new* build and
leaves older ones in place, so sandboxes made from them keep working; :func:`remove` deletes all.
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import fcntl
import json
import logging
import os
import shutil
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from torpor._tail import log_tail
from torpor.config import check_name, paths
from torpor.errors import (
    CorruptData,
    EngineError,
    GuestError,
    StorageError,
    TemplateNotFound,
    TorporError,
)
from torpor.sandbox.template import rootfs as _rootfs
from torpor.sandbox.template.rootfs import Progress
from torpor.sandbox.vm.machine_dir import KERNEL_APPEND

__all__ = [
    "AGENT_TIMEOUT",
    "GUEST_DIR",
    "TemplateInfo",
    "build",
    "get",
    "list_templates",
    "recipe",
    "remove",
    "stale_reason",
]

log = logging.getLogger(__name__)

#: The guest files shipped in the package (agent, protocol, init.sh).
GUEST_DIR = Path(__file__).parent.parent / "guest"
#: Seconds a cold boot gets until the agent answers (TCG boots take 10-30 s on 2 busy cores).
AGENT_TIMEOUT = 300.0


#: What a template.json field of each declared type may hold.
_FIELD_TYPES: dict[str, Callable[[Any], bool]] = {
    "str": lambda v: isinstance(v, str),
    "Path": lambda v: isinstance(v, str) and v != "",
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "list[str]": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
}


@dataclass(frozen=True)
class TemplateInfo:
    """A built template: where its kernel, base disk and booted snapshot are."""

    name: str
    directory: Path
    build_id: str
    kernel: Path
    initrd: Path
    base_image: Path
    snapshot_dir: Path
    vcpus: int = 1
    memory_mib: int = 512
    accel: str = "tcg"
    apt: list[str] = field(default_factory=list)
    pip: list[str] = field(default_factory=list)
    guest_hash: str = ""
    rootfs_key: str = ""
    created_at: str = ""
    boot_seconds: float = 0.0
    #: the guest kernel's command line its snapshot booted with ("" : built before it was kept)
    kernel_append: str = ""

    def to_json(self) -> dict[str, Any]:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self).items()}

    @classmethod
    def from_json(cls, data: Any) -> TemplateInfo:
        """The template ``data`` (a template.json) describes; unknown keys are ignored.
        Raises CorruptData when it is not one (not an object, a field missing or of
        another type)."""
        if not isinstance(data, dict):
            raise CorruptData(f"a template record is an object, not {type(data).__name__}")
        known: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in data:
                if f.default is MISSING and f.default_factory is MISSING:
                    raise CorruptData(f"a template record without {f.name!r}", field=f.name)
                continue
            value = data[f.name]
            if not _FIELD_TYPES[str(f.type)](value):
                raise CorruptData(
                    f"a template record's {f.name!r} is not a {f.type}: {value!r}"[:300],
                    field=f.name,
                )
            known[f.name] = Path(value) if f.type == "Path" else value
        return cls(**known)

    def moved_to(self, directory: Path) -> TemplateInfo:
        """This template with every path under its old directory moved under ``directory``."""
        moved: dict[str, Any] = {
            k: directory / v.relative_to(self.directory)
            for k, v in vars(self).items()
            if isinstance(v, Path) and v.is_relative_to(self.directory)
        }
        return replace(self, **moved)


def stale_reason(info: TemplateInfo, guest_hash: str | None = None) -> str | None:
    """Why ``info`` is not what a build would make now (None: it is): the guest files
    differ from ``guest_hash`` (default: the packaged ones'), or its snapshot booted with
    another kernel command line. A stale template keeps working (its sandboxes and clones
    keep the command line their machine.json records); a build replaces it."""
    if guest_hash is None:
        guest_hash = _rootfs.guest_hash(_rootfs.guest_files(GUEST_DIR))
    if info.guest_hash != guest_hash:
        return "the guest agent changed"
    if info.kernel_append != KERNEL_APPEND:
        return "the guest kernel's command line changed"
    return None


def _template_dir(name: str) -> Path:
    return paths().templates / check_name(name, "template name")


def get(name: str) -> TemplateInfo:
    """The built template ``name``. Raises InvalidName, TemplateNotFound, StorageError (its
    template.json cannot be read; CorruptData: it is not a template record)."""
    tj = _template_dir(name) / "template.json"
    try:
        data = json.loads(tj.read_text())
    except FileNotFoundError as exc:
        raise TemplateNotFound(
            f"no template named {name!r}{_did_you_mean(name)}", kind="template", name=name
        ) from exc
    except (OSError, ValueError) as exc:
        raise StorageError(f"cannot read {tj}: {exc}", exc=exc) from exc
    try:
        info = TemplateInfo.from_json(data)
    except CorruptData as exc:
        raise CorruptData(f"{tj}: {exc.message}", path=str(tj), exc=exc) from exc
    if info.directory.resolve() != tj.parent.resolve():
        # A copied or moved home (before the manager relocates it, see
        # torpor.sandbox.storage.relocate): the template's files are the ones beside this
        # template.json, never the original's.
        info = info.moved_to(tj.parent)
    return info


def _did_you_mean(name: str) -> str:
    """``"; did you mean 'python'?"`` for a typo of a built template's name, else how to
    build ``name``."""
    root = paths().templates
    built = sorted(p.parent.name for p in root.glob("*/template.json")) if root.is_dir() else []
    close = difflib.get_close_matches(name, built, n=1, cutoff=0.6)
    if close:
        return f"; did you mean {close[0]!r}? (built: {', '.join(built)})"
    return f" (build it: torpor template build {name})"


def list_templates() -> list[TemplateInfo]:
    """Every built template, by name."""
    found = []
    root = paths().templates
    for tj in sorted(root.glob("*/template.json")) if root.is_dir() else []:
        with contextlib.suppress(TorporError):
            found.append(get(tj.parent.name))
    return found


def remove(name: str) -> None:
    """Delete template ``name`` and all its builds (sandboxes cloned from it stop working).
    Raises InvalidName, TemplateNotFound, StorageError."""
    d = _template_dir(name)
    if not d.is_dir():
        raise TemplateNotFound(f"no template named {name!r}", kind="template", name=name)
    with _lock(name):
        try:
            # template.json first: a half-deleted template must not look built.
            with contextlib.suppress(FileNotFoundError):
                (d / "template.json").unlink()
            shutil.rmtree(d)
        except OSError as exc:
            raise StorageError(f"cannot remove template {name!r}: {exc}", exc=exc) from exc


@contextlib.contextmanager
def _lock(name: str) -> Iterator[None]:
    """One builder per template name at a time (an flock on templates/.<name>.lock)."""
    root = paths().templates
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "w") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def recipe(
    name: str,
    apt: Sequence[str] | None,
    pip: Sequence[str] | None,
    vcpus: int | None,
    memory_mib: int | None,
) -> tuple[list[str], list[str], int, int]:
    """What a build of ``name`` makes: each of ``apt``, ``pip``, ``vcpus``, ``memory_mib``
    as given, or, when None, as the built template of that name has it (its recipe), else
    the defaults (no extra packages, 1 vCPU, 512 MiB). So rebuilding a template without
    options reproduces it instead of dropping the packages it was built with. Raises
    InvalidArgument for a bad package name."""
    try:
        cur: TemplateInfo | None = get(name)
    except TemplateNotFound:
        cur = None
    return (
        _rootfs.check_packages(apt if apt is not None else (cur.apt if cur else ()), "apt"),
        _rootfs.check_packages(pip if pip is not None else (cur.pip if cur else ()), "pip"),
        vcpus if vcpus is not None else (cur.vcpus if cur else 1),
        memory_mib if memory_mib is not None else (cur.memory_mib if cur else 512),
    )


def build(
    name: str = "python",
    *,
    apt: Sequence[str] | None = None,
    pip: Sequence[str] | None = None,
    force: bool = False,
    progress: Progress | None = None,
    vcpus: int | None = None,
    memory_mib: int | None = None,
    guest_dir: Path | None = None,
) -> TemplateInfo:
    """Build template ``name`` (or return it unchanged if it is already up to date).

    ``apt``/``pip``: extra packages installed in the guest; ``vcpus``/``memory_mib``: its
    machine. Each left None keeps what the template was built with (see :func:`recipe`), so a
    rebuild reproduces it; another ``name`` is another template. ``force``: rebuild every layer.
    ``progress(step, detail)`` is called as the build goes. ``guest_dir`` replaces the
    packaged guest files (for tests). Raises InvalidName, InvalidArgument (a bad package
    name), EngineError (debootstrap, QEMU or the boot failed), GuestError (the agent never
    answered).
    """
    check_name(name, "template name")
    apt_l, pip_l, vcpus, memory_mib = recipe(name, apt, pip, vcpus, memory_mib)
    say = progress or (lambda step, detail: None)
    p = paths().ensure()
    files = _rootfs.guest_files(guest_dir or GUEST_DIR)
    ghash = _rootfs.guest_hash(files)
    rkey = _rootfs.rootfs_key(apt_l, pip_l)
    with _lock(name):
        if not force:
            with contextlib.suppress(TemplateNotFound):
                cur = get(name)
                if (
                    (cur.rootfs_key, cur.vcpus, cur.memory_mib) == (rkey, vcpus, memory_mib)
                    and stale_reason(cur, ghash) is None
                    and (cur.snapshot_dir / "state").exists()
                ):
                    say("done", f"template {name!r} is up to date")
                    return cur
        try:
            rootfs = _rootfs.ensure_rootfs(p.cache, apt_l, pip_l, force=force, progress=say)
            # another build's prune waits until this one has linked the image's files
            with _rootfs.images_in_use(p.cache):
                image = _rootfs.ensure_image(p.cache, rootfs, files, force=force, progress=say)
                info = _new_build(name, image, rkey, ghash, apt_l, pip_l, vcpus, memory_mib)
        except OSError as exc:
            raise EngineError(f"building the image failed: {exc}", exc=exc) from exc
        try:
            _rootfs.prune_images(p.cache, keep_also=image)  # after the build linked its files
        except OSError as exc:
            log.warning("cannot prune the cached images: %s", exc)
        say("boot", "cold boot of the guest (TCG: up to a minute)")
        t0 = time.monotonic()
        try:
            # A guest without protocol.py is a throwaway test agent speaking JSON lines.
            accel = asyncio.run(_boot_and_snapshot(info, say, lines="protocol.py" not in files))
        except BaseException:
            shutil.rmtree(info.directory / "builds" / info.build_id, ignore_errors=True)
            raise
        info = TemplateInfo.from_json(
            {**info.to_json(), "accel": accel, "boot_seconds": round(time.monotonic() - t0, 2)}
        )
        try:
            _publish(info)
        except StorageError:
            try:  # published, and only its last sync failed: the build is in use
                published = get(name).build_id == info.build_id
            except TorporError:
                published = False
            if not published:
                shutil.rmtree(info.directory / "builds" / info.build_id, ignore_errors=True)
            raise
        say("done", f"template {name!r} built ({info.build_id})")
        return info


def _new_build(
    name: str,
    image: Path,
    rkey: str,
    ghash: str,
    apt: list[str],
    pip: list[str],
    vcpus: int,
    memory_mib: int,
) -> TemplateInfo:
    """Make builds/<id>/ with hard links to the cached image files (copies where they
    cannot be linked). Raises StorageError, leaving no builds/<id>/."""
    d = _template_dir(name)
    build_id = f"{datetime.now(UTC).strftime('%Y%m%dT%H%M%S')}-{rkey[:6]}-{ghash[:6]}"
    bdir = d / "builds" / build_id
    try:
        shutil.rmtree(bdir, ignore_errors=True)
        (bdir / "snapshot").mkdir(parents=True)
        for fname in ("base.qcow2", "vmlinuz", "initrd.img"):
            try:
                os.link(image / fname, bdir / fname)
            except OSError:
                shutil.copyfile(image / fname, bdir / fname)
    except OSError as exc:
        shutil.rmtree(bdir, ignore_errors=True)  # what it had copied: nothing will use it
        raise StorageError(f"cannot prepare {bdir}: {exc}", exc=exc) from exc
    return TemplateInfo(
        name=name,
        directory=d,
        build_id=build_id,
        kernel=bdir / "vmlinuz",
        initrd=bdir / "initrd.img",
        base_image=bdir / "base.qcow2",
        snapshot_dir=bdir / "snapshot",
        vcpus=vcpus,
        memory_mib=memory_mib,
        apt=apt,
        pip=pip,
        guest_hash=ghash,
        rootfs_key=rkey,
        kernel_append=KERNEL_APPEND,
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
    )


async def _boot_and_snapshot(info: TemplateInfo, say: Progress, *, lines: bool) -> str:
    """Cold-boot the build's image, wait for the agent, hibernate; return the accel used."""
    from torpor.sandbox.vm.accel import probe
    from torpor.sandbox.vm.exits import settle_exit
    from torpor.sandbox.vm.machine import MachineSpec, QemuMachine

    report = await asyncio.to_thread(probe, kernel=info.kernel, initrd=info.initrd)
    say("accel", f"{report.accel}: {report.reason}")
    machine = QemuMachine(
        info.snapshot_dir,
        info,
        MachineSpec(vcpus=info.vcpus, memory_mib=info.memory_mib, accel=report.accel),
    )
    await machine.boot()
    try:
        say("agent", "waiting for the guest agent")
        waited = await wait_for_agent(
            machine.agent_socket,
            machine.is_running,
            AGENT_TIMEOUT,
            console=machine.console_log,
            lines=lines,
        )
        if not lines:
            say("warm-up", f"agent answered after {waited:.1f}s; starting the interpreter")
            await _warm_up(machine.agent_socket)
        say("snapshot", "hibernating the booted guest")
        await machine.hibernate()
        await settle_exit(machine.directory)  # a built template has no QEMU left
    except BaseException:
        await machine.kill()
        raise
    return report.accel


async def _warm_up(sock: Path) -> None:
    """Run a first bit of code so the snapshot holds a started interpreter (every sandbox's
    first ``run_code`` then skips Python's start-up), and flush the guest's file systems."""
    from torpor.sandbox.vm.channel import GuestChannel

    async with await GuestChannel.connect(sock, timeout=60) as channel:
        execution = await channel.run_code("None", timeout=AGENT_TIMEOUT)
        if execution.error is not None:
            raise GuestError(
                f"the guest interpreter failed to start: {execution.error.value}",
                traceback=execution.error.traceback,
            )
        await channel.sync()


async def wait_for_agent(
    sock: Path, alive: Any, timeout: float, *, console: Path | None = None, lines: bool = False
) -> float:
    """Wait until the guest agent behind ``sock`` answers a ping; return the seconds waited.

    Uses :class:`torpor.sandbox.vm.channel.GuestChannel` (one connection that pings until the
    agent answers), or with ``lines`` a newline-JSON ping (the protocol of a throwaway test
    agent). Raises GuestError on timeout, EngineError if ``alive()`` turns False (QEMU died);
    both with the console tail in the message.
    """
    t0 = time.monotonic()
    deadline = t0 + timeout
    task = asyncio.ensure_future(_ping_task(sock, deadline, lines))
    try:
        while True:
            done, _ = await asyncio.wait([task], timeout=0.5)
            if done:
                if task.result():
                    return time.monotonic() - t0
                raise GuestError(
                    f"the guest agent did not answer within {timeout:.0f}s\n"
                    + _console_tail(console),
                    seconds=timeout,
                )
            if not alive():
                raise EngineError("QEMU exited during boot\n" + _console_tail(console))
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


async def _ping_task(sock: Path, deadline: float, lines: bool) -> bool:
    if lines:
        while time.monotonic() < deadline:
            if await asyncio.to_thread(_ping_lines, sock):
                return True
            await asyncio.sleep(0.5)
        return False
    try:
        from torpor.sandbox.vm.channel import GuestChannel
    except ImportError as exc:
        raise EngineError(
            "torpor.sandbox.vm.channel is missing: cannot talk to the agent", exc=exc
        ) from exc
    left = deadline - time.monotonic()
    try:
        channel = await GuestChannel.connect(sock, timeout=max(left, 1.0))
    except TorporError as exc:
        log.warning("agent did not answer: %s", exc)
        return False
    with contextlib.suppress(Exception):
        await channel.close()
    return True


def _ping_lines(sock: Path) -> bool:
    """The throwaway test agent's protocol: one JSON object per line."""
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(1.0)
            s.connect(str(sock))
            s.sendall(b'{"op": "ping", "id": 0}\n')
            return b'"ok": true' in s.recv(4096)
    except OSError:
        return False


def _console_tail(console: Path | None, lines: int = 25) -> str:
    if console is None:
        return ""
    return "--- console.log ---\n" + log_tail(console, lines)


def _publish(info: TemplateInfo) -> None:
    """Write template.json (atomically, last) and point ``snapshot`` at the new build. On
    failure the template stays as it was: its ``snapshot`` link and template.json name the
    same build (a wake or restore checks the one and backs its disk on the other). Raises
    StorageError."""
    d = info.directory
    link, link_tmp, tmp = d / "snapshot", d / "snapshot.tmp", d / "template.json.tmp"
    try:
        old = os.readlink(link) if link.is_symlink() else None
        with open(tmp, "w") as f:  # first: what a full disk refuses, before anything moves
            json.dump(info.to_json(), f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        _point(link, link_tmp, Path("builds") / info.build_id / "snapshot")
        try:
            os.replace(tmp, d / "template.json")
        except OSError:
            with contextlib.suppress(OSError):
                if old is None:
                    link.unlink()
                else:
                    _point(link, link_tmp, Path(old))
            raise
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise StorageError(f"cannot publish template {info.name!r}: {exc}", exc=exc) from exc
    try:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise StorageError(f"cannot publish template {info.name!r}: {exc}", exc=exc) from exc


def _point(link: Path, link_tmp: Path, target: Path) -> None:
    """Make the symlink ``link`` name ``target`` (by a rename of ``link_tmp``). Raises
    OSError."""
    with contextlib.suppress(FileNotFoundError):
        link_tmp.unlink()
    link_tmp.symlink_to(target)
    if link.is_dir() and not link.is_symlink():
        shutil.rmtree(link)  # (a template from before builds/: its snapshot was a directory)
    os.replace(link_tmp, link)
