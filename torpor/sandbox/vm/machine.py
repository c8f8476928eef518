"""The QEMU machine of one sandbox directory: cold boot, hibernate, wake, kill, hot-plug.

A sandbox directory holds everything its machine is: its guest RAM file ``ram``, the saved
device state ``state``, its disk, ``machine.json`` and sockets (the layout, the machine type and
the command line are :mod:`torpor.sandbox.vm.machine_dir`'s).

Hibernate = ``stop`` + migrate device state only (capability ``x-ignore-shared``: the RAM stays
in ``ram``) to ``state.tmp``, fsync, rename to ``state``, quit (QEMU's exit is not waited
for: :mod:`torpor.sandbox.vm.exits`). Wake = a new QEMU on the same
``ram`` with ``-incoming defer``, load ``state``, delete it, ``cont``. No RAM is copied either
way, so both cost tens of milliseconds whatever the RAM size.

With a linger window (``QemuMachine(linger=...)``, from the engine) a hibernate keeps its
stopped QEMU a few seconds instead of telling it to quit, and a wake that finds it, unchanged,
only resumes it: :mod:`torpor.sandbox.vm.linger` (the machine's side of it:
:mod:`torpor.sandbox.vm.kept`).

Crash safety: ``state`` only ever appears whole (tmp + fsync + rename), and a wake deletes it
*before* ``cont``, so a QEMU killed at any point leaves either a loadable (ram, state) pair or
no state file — never a state older than the RAM file.

Disks (virtio-blk) and shares (virtio-9p) are hot-plugged into the running guest (the methods
are :mod:`torpor.sandbox.vm.hotplug`'s, mixed into :class:`QemuMachine`). QEMU has no
QMP command to create a 9p backend, so :meth:`QemuMachine.attach_share` hibernates and wakes
once with the backend on the command line, then hot-plugs the device. Note that QEMU refuses to
migrate while a 9p share is *mounted* in the guest: unmount before hibernate.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from qemu.qmp import QMPClient, QMPError

from torpor._tail import log_tail
from torpor.config import Linger
from torpor.errors import EngineError, InvalidState
from torpor.sandbox.vm import linger as lingering
from torpor.sandbox.vm.disk import copy_sparse, fsync_dir, new_overlay
from torpor.sandbox.vm.exits import hand_off, settle_exit, settle_foreign_exit
from torpor.sandbox.vm.hotplug import HotPlug
from torpor.sandbox.vm.jail import popen_args, prepare, prepare_path
from torpor.sandbox.vm.kept import Kept
from torpor.sandbox.vm.machine_dir import (
    MACHINE_TYPE,
    MIGRATE_TIMEOUT,
    QEMU_BINARY,
    QMP_TIMEOUT,
    BootImage,
    DirInfo,
    DiskSpec,
    MachineSpec,
    ShareSpec,
    build_command,
    clone_machine_dir,
    discard_state,
    ensure_generation_id,
    inspect_dir,
    new_machine_config,
    qemu_pid,
    read_machine_json,
    socket_path,
    write_machine_json,
)

__all__ = [
    "MACHINE_TYPE",
    "QEMU_BINARY",
    "DirInfo",
    "DiskSpec",
    "MachineSpec",
    "QemuMachine",
    "ShareSpec",
    "build_command",
    "clone_machine_dir",
    "discard_state",
    "inspect_dir",
    "read_machine_json",
    "socket_path",
]

log = logging.getLogger(__name__)

#: the file :meth:`QemuMachine.prestart` (and a lingering pause: :mod:`.linger`) leaves in a
#: directory whose QEMU waits, guest stopped, for the ``cont`` of its wake
PRESTARTED = lingering.MARKER


class QemuMachine(HotPlug, Kept):
    """One QEMU process on one directory. Not safe for concurrent use: one caller at a time
    (the sandbox manager serialises operations per sandbox).

    Every method raises :class:`~torpor.errors.EngineError` when QEMU or QMP fails, and
    :class:`~torpor.errors.InvalidState` when called in the wrong state (``boot`` on a
    running machine, ``hibernate`` on a stopped one ...).
    """

    def __init__(
        self,
        directory: Path,
        template: BootImage,
        spec: MachineSpec,
        *,
        linger: Linger | None = None,
    ) -> None:
        self.directory = Path(directory).resolve()
        self.template = template
        self.spec = spec
        #: whether (and how long) a hibernate keeps its stopped QEMU for a warm wake
        #: (:mod:`torpor.sandbox.vm.linger`); None: never
        self.linger = linger
        self.agent_socket = socket_path(self.directory / "agent.sock")
        self.console_log = self.directory / "console.log"
        self._qmp: QMPClient | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._pid: int | None = None
        #: milliseconds of each part of the last :meth:`capture`'s stop (for the benchmarks)
        self.last_capture: dict[str, float] = {}
        #: ``time.monotonic()`` when the last wake's ``cont`` returned (for the benchmarks:
        #: :func:`~torpor.sandbox.vm.channel.wake_split`)
        self.resumed_at: float | None = None

    def __repr__(self) -> str:
        return f"QemuMachine({str(self.directory)!r}, running={self.is_running()})"

    # -- state ---------------------------------------------------------------------------------

    def is_running(self) -> bool:
        """True while a QEMU process of this machine is alive."""
        if self._proc is not None:
            return self._proc.poll() is None
        if self._pid is not None:
            return qemu_pid(self.directory) == self._pid
        return False

    @property
    def pid(self) -> int | None:
        """The QEMU process id, while running."""
        return self._pid if self.is_running() else None

    def console_tail(self, lines: int = 30) -> str:
        """The last lines of the guest's serial console (for error messages)."""
        return log_tail(self.console_log, lines)

    def _require_stopped(self, op: str) -> None:
        if self.is_running() or qemu_pid(self.directory) is not None:
            raise InvalidState(
                f"cannot {op}: a QEMU is already running on {self.directory}",
                state="running",
                required="stopped",
            )

    def _require_running(self, op: str) -> None:
        if not self.is_running() or self._qmp is None:
            raise InvalidState(
                f"cannot {op}: the machine of {self.directory} is not running",
                state="stopped",
                required="running",
            )

    # -- process + QMP -------------------------------------------------------------------------

    async def _start(
        self,
        config: dict[str, Any],
        *,
        incoming: bool,
        pending_shares: list[dict[str, Any]] | None = None,
    ) -> None:
        """Start QEMU on the directory and connect QMP. Raises EngineError if it dies."""
        await lingering.settle(self.directory)
        for name in ("qmp.sock", "agent.sock", "qemu.pid"):
            with contextlib.suppress(FileNotFoundError):
                (self.directory / name).unlink()
        with contextlib.suppress(OSError):
            drop_layer_aliases(self.directory)  # names only the QEMU that opened them used
        cmd = build_command(config, incoming=incoming, pending_shares=pending_shares)
        jail = self.spec.jail
        if jail is not None:  # QEMU runs as the tenant's uid: let it reach what it opens
            await asyncio.to_thread(prepare, self.directory, jail, config)
            for rec in pending_shares or []:
                await asyncio.to_thread(
                    prepare_path, self.directory / rec["path"], jail, write=True
                )
        log.debug("starting %s", " ".join(cmd))
        try:
            with open(self.directory / "qemu.log", "ab") as errlog:  # noqa: ASYNC230
                self._proc = subprocess.Popen(  # noqa: ASYNC220
                    cmd,
                    cwd=self.directory,
                    stdin=subprocess.DEVNULL,
                    stdout=errlog,
                    stderr=errlog,
                    start_new_session=True,
                    **popen_args(jail),
                )
        except OSError as exc:
            raise EngineError(f"cannot start {QEMU_BINARY}: {exc}", exc=exc) from exc
        self._pid = self._proc.pid
        try:
            await self._connect()
        except BaseException:
            await self._reap(force=True)
            raise

    async def _connect(self) -> None:
        """Connect QMP to ``qmp.sock`` (waiting for QEMU to create it)."""
        sock = self.directory / "qmp.sock"
        address = str(sock)
        holder: int | None = None
        if len(address) > 100:  # AF_UNIX paths are limited to 108 bytes: go via /proc
            holder = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
            address = f"/proc/self/fd/{holder}/qmp.sock"
        deadline = time.monotonic() + QMP_TIMEOUT
        try:
            while True:
                if not self.is_running():
                    raise EngineError(self._died_message("QEMU exited at start"))
                if sock.exists():
                    client = QMPClient(self.directory.name)
                    try:
                        # QEMU serves one QMP client at a time: while another holds it (a
                        # process that kept its connection), a connect is accepted but never
                        # greeted, so it needs a deadline of its own
                        left = max(0.1, deadline - time.monotonic())
                        await asyncio.wait_for(client.connect(address), left)
                        self._qmp = client
                        return
                    except TimeoutError as exc:
                        with contextlib.suppress(Exception):
                            await client.disconnect()
                        raise EngineError(
                            f"QMP of {self.directory} did not answer within {QMP_TIMEOUT}s "
                            "(is another process connected to it?)",
                            exc=exc,
                        ) from exc
                    except (QMPError, OSError) as exc:
                        if time.monotonic() > deadline:
                            raise EngineError(f"cannot connect QMP: {exc}", exc=exc) from exc
                if time.monotonic() > deadline:
                    raise EngineError(f"QEMU did not open {sock} within {QMP_TIMEOUT}s")
                await asyncio.sleep(0.005)
        finally:
            if holder is not None:
                os.close(holder)

    def _died_message(self, what: str) -> str:
        code = self._proc.poll() if self._proc is not None else None
        return (
            f"{what} (exit status {code})\n--- qemu.log ---\n"
            f"{log_tail(self.directory / 'qemu.log', 15)}\n--- console.log ---\n"
            f"{self.console_tail()}"
        )

    async def _qmp_exec(
        self, cmd: str, args: dict[str, Any] | None = None, timeout: float = QMP_TIMEOUT
    ) -> Any:
        """Run one QMP command; translate QMP failures into EngineError."""
        if self._qmp is None:
            raise EngineError(f"QMP not connected ({cmd})")
        try:
            return await asyncio.wait_for(self._qmp.execute(cmd, args), timeout)
        except (TimeoutError, QMPError, OSError, EOFError) as exc:
            detail = str(exc) or type(exc).__name__
            if not self.is_running():
                raise EngineError(self._died_message(f"QEMU died during {cmd}"), exc=exc) from exc
            raise EngineError(f"QMP {cmd} failed: {detail}", exc=exc) from exc

    async def _pass_fd(self, fd: int) -> None:
        """Hand QEMU the state file's descriptor ``fd`` as ``state``; a QEMU that dies
        meanwhile (the QMP client then refuses to send) is an EngineError, as in
        :meth:`_qmp_exec`."""
        if self._qmp is None:
            raise EngineError("QMP not connected (getfd)")
        try:
            self._qmp.send_fd_scm(fd)
        except (QMPError, OSError) as exc:
            if not self.is_running():
                raise EngineError(self._died_message("QEMU died during getfd"), exc=exc) from exc
            raise EngineError(f"QMP could not pass the state file: {exc}", exc=exc) from exc
        await self._qmp_exec("getfd", {"fdname": "state"})

    async def _disconnect(self) -> None:
        if self._qmp is not None:
            client, self._qmp = self._qmp, None
            with contextlib.suppress(Exception):
                await client.disconnect()

    async def _reap(self, *, force: bool = False, timeout: float = 10.0) -> None:
        """Wait for QEMU to exit (SIGKILL it if ``force`` or after ``timeout``)."""
        await self._disconnect()
        pid = self._pid
        if pid is not None and force and self.is_running():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        while self.is_running():
            if time.monotonic() > deadline:
                if pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                deadline = time.monotonic() + timeout
            await asyncio.sleep(0.005)
        if self._proc is not None:
            self._proc.wait()
        self._proc = None
        self._pid = None

    async def _set_ignore_shared(self) -> None:
        await self._qmp_exec(
            "migrate-set-capabilities",
            {"capabilities": [{"capability": "x-ignore-shared", "state": True}]},
        )

    async def _wait_migration(self, what: str) -> None:
        deadline = time.monotonic() + MIGRATE_TIMEOUT
        while True:
            info = await self._qmp_exec("query-migrate")
            status = info.get("status") if isinstance(info, dict) else None
            if status == "completed":
                return
            if status in ("failed", "cancelled"):
                raise EngineError(f"{what} failed: {info.get('error-desc', status)}", status=status)
            if time.monotonic() > deadline:
                raise EngineError(f"{what} did not finish within {MIGRATE_TIMEOUT}s")
            await asyncio.sleep(0.002)

    # -- lifecycle -----------------------------------------------------------------------------

    async def boot(self) -> None:
        """Cold-boot the template's kernel on this directory (a template's first boot).

        Creates ``ram``, ``disk.qcow2`` (an overlay on the template's base image) and
        ``machine.json``; removes any stale ``state``. Returns once QEMU runs the guest (the
        agent comes up later: wait for it on the channel). Raises EngineError, InvalidState.
        """
        from torpor.sandbox.vm.accel import probe

        await settle_exit(self.directory)
        self._require_stopped("boot")
        accel = (
            self.spec.accel
            or (await asyncio.to_thread(probe, kernel=Path(self.template.kernel))).accel
        )
        config = new_machine_config(self.template, self.spec, accel)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            discard_state(self.directory)
            disk = self.directory / "disk.qcow2"
            if not disk.exists():
                new_overlay(Path(self.template.base_image), disk)
            with open(self.directory / "ram", "wb") as f:  # noqa: ASYNC230 (a sparse RAM file)
                f.truncate(config["memory_mib"] * 1024 * 1024)
            write_machine_json(self.directory, config)
        except OSError as exc:
            raise EngineError(f"cannot prepare {self.directory}: {exc}", exc=exc) from exc
        await self._start(config, incoming=False)
        log.info("booted %s (%s)", self.directory, accel)

    async def hibernate(
        self, *, ready: Awaitable[object] | None = None, linger: bool = True
    ) -> None:
        """Stop the guest, save its device state to ``state`` and tell QEMU to quit.

        The RAM stays in ``ram``. Returns once ``state`` is durable; QEMU exits on its own
        time (:mod:`torpor.sandbox.vm.exits`: the next start on this directory waits for it).
        With a linger window (:attr:`linger`; ``linger=False`` says never for this one),
        QEMU is instead kept stopped for a warm wake (:mod:`torpor.sandbox.vm.linger`).
        ``ready`` is awaited just before the guest is stopped, once the save is set up (the
        caller's last words with the guest, its flush, overlap those QMP round trips). If
        saving fails (or ``ready`` raises), the guest is resumed and EngineError is raised
        (the machine is still running, no ``state`` was written).
        """
        self._require_running("hibernate")
        t0 = time.monotonic()
        tmp = self.directory / "state.tmp"
        with contextlib.suppress(OSError):  # (one that stays: its open below fails)
            tmp.unlink()
        try:
            await self._set_ignore_shared()
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                await self._pass_fd(fd)
                if ready is not None:
                    await ready
                await self._qmp_exec("stop")
                await self._qmp_exec("migrate", {"uri": "fd:state"})
                await self._wait_migration("saving the device state")
                os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            if self.is_running():
                with contextlib.suppress(Exception):
                    await self._qmp_exec("cont")
            if isinstance(exc, OSError):  # the state file: opened, written by QEMU, synced
                raise EngineError(
                    f"cannot save the state of {self.directory}: {exc}", exc=exc
                ) from exc
            raise
        try:
            os.replace(tmp, self.directory / "state")
            fsync_dir(self.directory)
        except OSError as exc:
            raise EngineError(f"cannot write the state file: {exc}", exc=exc) from exc
        # Saved: the guest is stopped and the migration's end inactivated the disks (flushed,
        # unlocked). QEMU's own exit is not waited for (exits.settle_exit).
        if linger and self._keep_lingering():
            await self._disconnect()
            self._proc, self._pid = None, None
            log.info("hibernated %s in %.3fs; lingering", self.directory, time.monotonic() - t0)
            return
        if self._qmp is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._qmp.execute("quit"), 5)
        await self._disconnect()
        hand_off(self.directory, self._proc, self._pid)
        self._proc, self._pid = None, None
        with contextlib.suppress(OSError):
            drop_layer_aliases(self.directory)
        log.info("hibernated %s in %.3fs", self.directory, time.monotonic() - t0)

    async def capture(
        self,
        *,
        overlay: Path,
        state: Path,
        ram: Path,
        stopped: Callable[[str], None] | None = None,
        fill_ram: bool = False,
        precopy: bool = False,
    ) -> float:
        """Copy the running machine without hibernating it; returns its downtime (seconds).

        ``overlay`` (in this directory, named ``.disk-<id>.qcow2``) is a new, empty qcow2 whose
        backing file is a hard link of the root disk's current top layer (the caller made
        both). While the guest is stopped (``stop`` drains and flushes the disks): the root
        disk switches to ``overlay`` (``blockdev-snapshot``: the old top layer is written no
        more and becomes the frozen layer), ``disk.qcow2`` is made a second name of
        ``overlay`` (so it always names the layer QEMU writes), the device state is saved to
        ``state`` (``x-ignore-shared``: the RAM is the shared file) and the RAM file is copied
        to ``ram`` (reflink where the file system can, sparse otherwise; the copy starts as
        soon as ``stop`` returns and runs beside the switch and the save, which need QMP round
        trips: the capability and the state's descriptor are handed over before the stop);
        then ``cont``. The channel, the QMP connection and the QEMU process stay as they were.

        ``fill_ram``: ``ram`` exists already, at the RAM's size and all holes (a fork's child
        QEMU may have it mapped, waiting for it): it is filled in place, and on failure left
        (its maker removes it). ``precopy``: copy the RAM once before the stop too, while the
        guest runs (a copy of no one instant), so that the copy in the stop writes over page
        cache and disk blocks that exist already (``copy_sparse(in_place=True)``: measured
        1.5-2.5 x faster than a new copy on ext4): a shorter stop for a longer call.

        ``overlay`` keeps its name while QEMU runs: the next capture makes this layer read-only
        and QEMU reopens it by the name it was opened with. A hibernate removes it.
        ``stopped(step)`` is called at ``"capture:switched"``, ``"capture:swapped"`` and
        ``"capture:saved"`` (tests crash there; a restart adopts a switched overlay:
        :meth:`adopt_top_layer`). On failure before the switch nothing changed; after it the
        machine runs on the overlay (the same guest-visible disk). Either way the guest is resumed,
        ``state`` and ``ram`` are removed, and EngineError / InvalidState is raised.
        """
        self._require_running("capture")
        top, alias = await self._top_layer()
        node = f"top-{overlay.name.strip('.').split('.')[0]}"
        await self._qmp_exec(
            "blockdev-add",
            {
                "driver": "qcow2",
                "node-name": node,
                "file": {"driver": "file", "filename": overlay.name},
                "backing": None,
            },
        )
        switched = False
        copy: asyncio.Future[None] | None = None
        fd = -1
        marks: list[float] = []
        source = self.directory / "ram"
        try:
            if precopy:
                await asyncio.to_thread(copy_sparse, source, ram, in_place=fill_ram)
            # what needs no stop comes first: the capability (a setting QEMU keeps) and the
            # state file's descriptor
            await self._set_ignore_shared()
            fd = os.open(state, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            await self._pass_fd(fd)
            marks.append(time.monotonic())
            await self._qmp_exec("stop")  # returns once in-flight I/O is done: RAM is still
            marks.append(time.monotonic())
            # the RAM copy (the long part) runs beside the disk switch and the state's save
            copy = asyncio.ensure_future(
                asyncio.to_thread(copy_sparse, source, ram, in_place=fill_ram or precopy)
            )
            await self._qmp_exec("blockdev-snapshot", {"node": top, "overlay": node})
            switched = True
            if stopped is not None:
                stopped("capture:switched")  # QEMU writes the overlay; the name follows next
            _link_as(overlay, self.directory / "disk.qcow2")
            if alias is not None:  # the old top was reopened read-only by this name: done
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.directory / alias)
            marks.append(time.monotonic())
            if stopped is not None:
                stopped("capture:swapped")
            await self._qmp_exec("migrate", {"uri": "fd:state"})
            await self._wait_migration("saving the device state")
            marks.append(time.monotonic())
            await asyncio.wait([copy])
            copy.result()
            marks.append(time.monotonic())
            if stopped is not None:
                stopped("capture:saved")
        except BaseException as exc:
            if not isinstance(exc, Exception | asyncio.CancelledError):
                raise  # the process is going down (a crash point in tests): leave all as is
            if copy is not None:  # never leave a thread writing a file being removed
                await asyncio.wait([copy])
            for f in (state,) if fill_ram else (state, ram):
                with contextlib.suppress(OSError):
                    f.unlink()
            if not switched:
                with contextlib.suppress(Exception):
                    await self._qmp_exec("blockdev-del", {"node-name": node})
                with contextlib.suppress(OSError):
                    os.unlink(overlay)
            else:  # the name must follow what QEMU writes
                with contextlib.suppress(OSError):
                    _link_as(overlay, self.directory / "disk.qcow2")
            if self.is_running():
                with contextlib.suppress(Exception):
                    await self._qmp_exec("cont")
            if isinstance(exc, OSError):
                raise EngineError(f"cannot capture {self.directory}: {exc}", exc=exc) from exc
            raise
        finally:
            if fd >= 0:
                os.close(fd)
        await self._qmp_exec("cont")
        marks.append(time.monotonic())
        # the rename is made durable after the guest runs again (on ext4 any flush the guest
        # asks for commits it too; a power loss takes the RAM of a running machine anyway)
        try:
            fsync_dir(self.directory)
        except OSError as exc:
            raise EngineError(f"cannot sync {self.directory}: {exc}", exc=exc) from exc
        self.last_capture = {
            name: round((b - a) * 1000, 2)
            for name, a, b in zip(
                ("stop", "switch", "state", "ram_after_state", "cont"),
                marks,
                marks[1:],
                strict=False,
            )
        }
        downtime = marks[-1] - marks[0]
        log.info(
            "captured %s live; stood still %.3fs %s", self.directory, downtime, self.last_capture
        )
        return downtime

    async def _top_layer(self) -> tuple[str, str | None]:
        """The node name of the root disk's top layer (``root`` until a first capture), and
        the overlay name it was opened by when that is not ``disk.qcow2``."""
        for dev in await self._qmp_exec("query-block"):
            inserted = dev.get("inserted") or {}
            if dev.get("qdev") in ("vda", "/machine/peripheral/vda/virtio-backend"):
                name = Path(str(inserted.get("file", ""))).name
                return str(inserted.get("node-name") or "root"), (
                    name if name.startswith(".disk-") else None
                )
        return "root", None

    async def adopt_top_layer(self) -> None:
        """After a manager died in the middle of :meth:`capture`: make ``disk.qcow2`` name the
        overlay QEMU writes if it does not yet. Raises EngineError."""
        _node, alias = await self._top_layer()
        if alias is not None:
            try:
                await asyncio.to_thread(_adopt, self.directory, alias)
            except OSError as exc:
                raise EngineError(f"cannot adopt {alias}: {exc}", exc=exc) from exc

    async def wake(self, *, ram_ready: Awaitable[object] | None = None) -> None:
        """Start QEMU on the saved RAM file and device state, and resume the guest.

        ``ram_ready``: the RAM file (at its full size already) is still being filled; QEMU
        starts meanwhile (it only maps the file) and the state, whose devices read guest
        memory as they load, is loaded once it is done (``state`` may appear only by then: a
        fork's child starts while its source's state is saved). The consumed ``state`` is deleted
        before the guest runs. Raises InvalidState if there is no state to load, EngineError
        if QEMU refuses it (then ``state`` is kept), what ``ram_ready`` raises (QEMU stopped).
        """
        await self._wake(ram_ready=ram_ready)

    async def prestart(self, exercise: Callable[[], Awaitable[object]] | None = None) -> None:
        """Do the first half of a wake ahead of time: start QEMU on the saved RAM file and
        device state and load the state, but leave the guest stopped and let go of QMP (so
        the waker can take it). The next :meth:`wake` of this directory, by any
        :class:`QemuMachine`, then only resumes it: see :data:`PRESTARTED`.

        Without ``exercise``, ``state`` is kept until that wake, so if this QEMU dies first
        the wake loads it as usual. With it, the guest runs first (``state`` is consumed),
        ``exercise()`` is awaited (it talks to the guest: under TCG the code it runs is then
        translated already when the waker's guest runs it), and the guest is stopped again:
        if this QEMU dies, the directory cannot be woken. Raises InvalidState (no state, or
        a QEMU runs already), EngineError (QEMU stopped), what ``exercise`` raises."""
        await settle_exit(self.directory)
        self._require_stopped("prestart")
        state = self.directory / "state"
        if not state.is_file():
            raise InvalidState(
                f"nothing to prestart: no saved state in {self.directory}",
                state="no-state",
                required="hibernated",
            )
        config = read_machine_json(self.directory)
        ensure_generation_id(self.directory, config)
        await self._start(config, incoming=True)
        try:
            await self._load_state(state)
            if exercise is not None:
                discard_state(self.directory)  # the guest is about to change ``ram``
                await self._qmp_exec("cont")
                await exercise()
                await self._qmp_exec("stop")
            assert self._pid is not None
            lingering.write_marker(
                self.directory,
                lingering.Marker(kind="prestart", pid=self._pid, owner=lingering.me()),
            )
        except BaseException:
            await self._reap(force=True)
            raise
        await self._disconnect()
        self._proc = None  # reaped by whoever kills it (subprocess collects the zombie)
        self._pid = None
        log.info("prestarted %s", self.directory)

    async def _load_state(self, state: Path, *, capability_set: bool = False) -> None:
        """Load the saved device state ``state`` into the QEMU started with -incoming
        (``capability_set``: its ``x-ignore-shared`` is set already)."""
        if not capability_set:
            await self._set_ignore_shared()
        fd = os.open(state, os.O_RDONLY)
        try:
            await self._pass_fd(fd)
            await self._qmp_exec("migrate-incoming", {"uri": "fd:state"})
            await self._wait_incoming()
        finally:
            os.close(fd)

    async def _wake(
        self,
        pending_shares: list[dict[str, Any]] | None = None,
        *,
        ram_ready: Awaitable[object] | None = None,
    ) -> None:
        resume = pending_shares is None and ram_ready is None
        if await self._take_kept(resume=resume):
            log.info("resumed the stopped QEMU of %s", self.directory)
            return
        await lingering.settle(self.directory)  # the QEMU of the last hibernate, still exiting
        if not self.is_running():
            await settle_foreign_exit(self.directory)  # another process's, told to quit
        self._require_stopped("wake")
        state = self.directory / "state"
        if ram_ready is None:
            self._require_state(state)
        t0 = time.monotonic()
        config = read_machine_json(self.directory)
        ensure_generation_id(self.directory, config)
        if (config["vcpus"], config["memory_mib"]) != (self.spec.vcpus, self.spec.memory_mib):
            # A saved machine keeps its shape: the RAM file and CPU state fix both.
            log.warning(
                "%s was saved with %s vCPU / %s MiB; waking it as such (asked: %s / %s)",
                self.directory,
                config["vcpus"],
                config["memory_mib"],
                self.spec.vcpus,
                self.spec.memory_mib,
            )
        await self._start(config, incoming=True, pending_shares=pending_shares)
        try:
            if ram_ready is not None:
                await self._set_ignore_shared()  # a setting: made while the RAM is filled
                await ram_ready
                self._require_state(state)
            await self._load_state(state, capability_set=ram_ready is not None)
            # The guest is about to run on and change ``ram``: the state no longer matches it.
            discard_state(self.directory)
            await self._qmp_exec("cont")
            self.resumed_at = time.monotonic()
        except BaseException:
            await self._reap(force=True)
            raise
        log.info("woke %s in %.3fs", self.directory, time.monotonic() - t0)

    def _require_state(self, state: Path) -> None:
        if not state.is_file():
            raise InvalidState(
                f"nothing to wake: no saved state in {self.directory}",
                state="no-state",
                required="hibernated",
            )

    async def _wait_incoming(self) -> None:
        deadline = time.monotonic() + MIGRATE_TIMEOUT
        while True:
            if not self.is_running():
                raise EngineError(self._died_message("QEMU could not load the saved state"))
            status = await self._qmp_exec("query-status")
            migrate = await self._qmp_exec("query-migrate")
            if migrate.get("status") == "completed" or status.get("status") == "paused":
                return
            if migrate.get("status") == "failed":
                raise EngineError(f"loading the state failed: {migrate.get('error-desc')}")
            if time.monotonic() > deadline:
                raise EngineError(f"loading the state took over {MIGRATE_TIMEOUT}s")
            await asyncio.sleep(0.002)

    async def release(self) -> None:
        """Disconnect from QEMU's QMP, leaving QEMU running: QEMU serves one QMP client at a
        time, so a manager that closes without pausing must let go for the next to attach."""
        await self._disconnect()

    async def kill(self) -> None:
        """Kill QEMU at once (no state saved), a lingering one too. Files are kept. A no-op
        when none runs."""
        lingering.drop(self.directory)
        if self._pid is None:
            self._pid = qemu_pid(self.directory)
        await self._reap(force=True)
        await settle_exit(self.directory)
        with contextlib.suppress(OSError):
            (self.directory / PRESTARTED).unlink(missing_ok=True)

    @classmethod
    async def attach(cls, directory: Path, template: BootImage, spec: MachineSpec) -> QemuMachine:
        """Take over the QEMU still running on ``directory`` (left by a process that died),
        leaving its guest running. Raises EngineError if there is none or QMP will not answer."""
        machine = cls(directory, template, spec)
        pid = qemu_pid(machine.directory)
        if pid is None:
            raise EngineError(f"no QEMU is running on {machine.directory}")
        machine._pid = pid
        await machine._connect()
        return machine

    async def qmp(self, cmd: str, args: dict[str, Any] | None = None) -> Any:
        """Run a raw QMP command on the running machine (for tests and diagnostics)."""
        self._require_running(cmd)
        return await self._qmp_exec(cmd, args)


def _link_as(src: Path, dst: Path) -> None:
    """Make ``dst`` another name of ``src`` atomically (link to a tmp name, rename)."""
    tmp = dst.with_name(f".{dst.name}.link")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    os.link(src, tmp)
    os.replace(tmp, dst)


def _adopt(directory: Path, alias: str) -> None:
    if (directory / alias).is_file() and not os.path.samefile(
        directory / alias, directory / "disk.qcow2"
    ):
        _link_as(directory / alias, directory / "disk.qcow2")
        fsync_dir(directory)
        log.warning("%s: adopted the overlay of an interrupted capture", directory)


def drop_layer_aliases(directory: Path) -> None:
    """Remove the overlay names a live capture leaves beside ``disk.qcow2`` (they only
    matter while the QEMU that opened them runs). Raises OSError."""
    for alias in directory.glob(".disk-*.qcow2"):
        alias.unlink(missing_ok=True)


def machine_config(directory: Path) -> dict[str, Any]:
    """machine.json of ``directory`` as a dict (alias of :func:`read_machine_json`)."""
    return read_machine_json(directory)
