"""Lingering QEMUs: the stopped QEMU of a pause, kept a few seconds for a warm wake.

Under TCG a wake's first answer waits on translation: a new QEMU starts with an empty
translation cache, and loading a state flushes it anyway, so the guest's kernel and Python
paths are translated again as they first run (``bench/README.md``: 110-150 ms of QEMU's CPU
after ``cont``). Only a QEMU that never exited keeps its cache. Agent platforms pause a
sandbox between turns and wake it seconds later; that case is served by *lingering*: once a
pause's state is durable (``state`` fsynced, as always), its QEMU, stopped in runstate
``postmigrate``, is not told to quit. Its directory gets the marker :data:`MARKER` (the one
a pooled clone's prestarted QEMU has: "a stopped QEMU whose guest equals ``ram`` +
``state``; if it dies, wake from ``state``"), holding a :class:`Marker`: its pid, the
process that kept it, when its window ends, and a :func:`fingerprint` of ``state``, ``ram``
and ``disk.qcow2`` taken right after the save.

A wake within the window (``QemuMachine.wake``, in any process: QMP is a unix socket in the
directory; the machine's side is :mod:`torpor.sandbox.vm.kept`) claims the marker by renaming
it (:func:`claim`: of two processes only one can), checks it (:func:`stale_reason`: the
window, the fingerprint, the pid) and the QEMU's runstate, and only resumes it (``cont``,
which after a migration re-activates the disks).
Anything else — the window over, files changed (a compaction, a snapshot that switched the
disk overlay, a fetched pause, a wake elsewhere), a dead QEMU, an unexpected runstate — kills
it and the wake proceeds cold from ``state``. Durability is unchanged: the state is on disk
before the marker exists, and a lingering QEMU is never resumed unless verified.

This module also keeps the process's own lingering QEMUs (:func:`keep`): a timer per QEMU
expires it (claim, SIGKILL, reap: :mod:`torpor.sandbox.vm.exits`), at most
``Linger.max_count`` are kept (the oldest goes first), :func:`drop` ends one at once (a kill
or delete of its sandbox, a cold start on its directory), and the process's exit kills those
it still owns without waiting for them. What a process that died left lingering is killed by
:func:`sweep` (the engine's start) or by the restarted manager's recovery.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import signal
import subprocess
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from torpor.sandbox.vm.exits import hand_off, settle_exit, settle_exits
from torpor.sandbox.vm.machine_dir import qemu_pid
from torpor.sandbox.vm.pool import process_token

__all__ = [
    "CLAIMED",
    "FINGERPRINTED",
    "MARKER",
    "Marker",
    "claim",
    "drop",
    "drop_all",
    "fingerprint",
    "keep",
    "kept",
    "me",
    "read_marker",
    "recover",
    "release",
    "settle",
    "settle_all",
    "stale_reason",
    "sweep",
    "write_marker",
]

log = logging.getLogger(__name__)

#: the file in a directory whose QEMU waits, stopped with the guest's state loaded or saved,
#: for the ``cont`` of a wake (a :class:`Marker` as JSON; a bare pid from older versions)
MARKER = "prestarted"
#: a claimed marker's name: this prefix, then the claimer (:func:`me`)
CLAIMED = f".{MARKER}.claimed-"
#: the files whose identity and times a lingering QEMU's marker records
FINGERPRINTED = ("state", "ram", "disk.qcow2")
#: the runstates in which a kept QEMU may be resumed: ``paused`` (a prestarted QEMU: its state
#: loaded, or its guest exercised and stopped) and ``postmigrate`` (a pause's, after its save)
RESUMABLE = ("paused", "postmigrate")


@dataclass(frozen=True)
class Marker:
    """What :data:`MARKER` says of the stopped QEMU on its directory."""

    #: ``"prestart"`` (a pooled clone's: no window, no fingerprint) or ``"linger"``
    kind: str
    pid: int
    #: the process that kept it (:func:`~torpor.sandbox.vm.pool.process_token`)
    owner: str | None = None
    #: when its window ends (``time.time()``)
    expires: float | None = None
    #: :func:`fingerprint` of the directory right after the pause's save
    fingerprint: dict[str, list[int]] | None = None


def fingerprint(directory: Path) -> dict[str, list[int]]:
    """(device, inode, size, mtime ns, ctime ns) of each of :data:`FINGERPRINTED` in
    ``directory``: a file replaced (a new inode), written (mtime), linked, renamed or
    chmod-ed (ctime) since changes it. Raises OSError (a file missing)."""
    out = {}
    for name in FINGERPRINTED:
        st = os.stat(directory / name)
        out[name] = [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
    return out


def write_marker(directory: Path, marker: Marker) -> None:
    """Write :data:`MARKER` whole (tmp + rename). Not fsynced: only a host crash could lose
    it, and that takes the QEMU it names too. Raises OSError."""
    tmp = directory / f".{MARKER}.tmp"
    tmp.write_text(json.dumps(asdict(marker)))
    os.replace(tmp, directory / MARKER)


def read_marker(path: Path) -> Marker | None:
    """The marker in the file ``path``; None when it is missing or unreadable."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text.isdecimal():  # a prestarted QEMU's marker before it had fields
        return Marker(kind="prestart", pid=int(text))
    try:
        data: dict[str, Any] = json.loads(text)
        return Marker(
            kind=str(data["kind"]),
            pid=int(data["pid"]),
            owner=data.get("owner"),
            expires=None if data.get("expires") is None else float(data["expires"]),
            fingerprint=data.get("fingerprint"),
        )
    except (ValueError, KeyError, TypeError):
        return None


def claim(directory: Path) -> Path | None:
    """Take the marker of ``directory`` for this process by renaming it aside, so no other
    process acts on its QEMU (a rename succeeds once); the path it now has, or None when
    there is none (or another process took it first). The caller resumes or kills that QEMU,
    then removes the claimed file (a claimer that dies before that: :func:`recover`)."""
    claimed = directory / f"{CLAIMED}{me()}"
    try:
        os.rename(directory / MARKER, claimed)
    except FileNotFoundError:
        return None
    return claimed


def recover(directory: Path) -> list[int]:
    """End what a claimer that died left on ``directory``: between its claim and its resume
    or kill, the marker is renamed aside, so no wake would find the stopped QEMU, and a cold
    wake would wait for it to go and then refuse to start another. Such a QEMU is killed
    only while it is still stopped on the saved state (``state`` is there: a resume deletes
    it before ``cont``); the claim is removed either way. A live claimer's claim, or one
    named by a bare pid (an older torpor's), is left alone. Returns the pids killed."""
    killed = []
    for path in directory.glob(f"{CLAIMED}*"):
        owner = path.name.removeprefix(CLAIMED)
        if ":" not in owner or _alive(owner):
            continue
        marker = read_marker(path)
        if (
            marker is not None
            and (directory / "state").is_file()
            and qemu_pid(directory) == marker.pid
        ):
            _kill(marker.pid, None)
            hand_off(directory, None, marker.pid)
            killed.append(marker.pid)
            log.warning("%s: killed the stopped QEMU a dead claimer left", directory.name)
        path.unlink(missing_ok=True)
    return killed


def stale_reason(marker: Marker, directory: Path, now: float | None = None) -> str | None:
    """Why the QEMU ``marker`` names must not be resumed, or None when it may (its QEMU
    runs on ``directory``; a lingering one's window is not over and its files are exactly
    those its pause left). The runstate is the caller's to check, over QMP."""
    if qemu_pid(directory) != marker.pid:
        return "its QEMU is gone"
    if marker.kind == "prestart":
        return None
    if marker.kind != "linger" or marker.expires is None or marker.fingerprint is None:
        return f"an unknown marker ({marker.kind})"
    if (time.time() if now is None else now) > marker.expires:
        return "its window is over"
    try:
        now_print = fingerprint(directory)
    except OSError as exc:
        return f"a file is gone ({exc})"
    changed = [n for n in FINGERPRINTED if now_print[n] != list(marker.fingerprint.get(n, []))]
    if changed:
        return f"{', '.join(changed)} changed since the pause"
    return None


# -- the lingering QEMUs of this process ----------------------------------------------------


@dataclass
class _Kept:
    directory: Path
    proc: subprocess.Popen[bytes] | None
    pid: int
    timer: threading.Timer


_LOCK = threading.Lock()
#: this process's lingering QEMUs by directory, oldest first
_KEPT: dict[Path, _Kept] = {}
#: QEMUs this process started that another process resumed: reaped once they exit
_ELSEWHERE: list[subprocess.Popen[bytes]] = []


def kept() -> list[Path]:
    """The directories of this process's lingering QEMUs, oldest first."""
    with _LOCK:
        return list(_KEPT)


def keep(
    directory: Path,
    proc: subprocess.Popen[bytes] | None,
    pid: int,
    seconds: float,
    max_count: int,
) -> None:
    """Own the lingering QEMU ``pid`` (``proc`` when it is this process's child) of
    ``directory``, whose marker is written: expire it after ``seconds``, and first drop the
    oldest while ``max_count`` (at least 1) are kept."""
    _reap_elsewhere()
    with _LOCK:
        old = _KEPT.pop(directory, None)
    if old is not None:  # (paused again after a wake in another process)
        old.timer.cancel()
        if old.proc is not None and old.proc is not proc:
            with _LOCK:
                _ELSEWHERE.append(old.proc)
    while True:
        with _LOCK:
            if len(_KEPT) < max(1, max_count):
                timer = threading.Timer(seconds, _expire, args=(directory, pid))
                timer.daemon = True
                timer.name = f"linger-{directory.name}"
                _KEPT[directory] = _Kept(directory, proc, pid, timer)
                timer.start()
                return
            oldest = next(iter(_KEPT))
        log.info("%s: over %d lingering QEMUs; ending the oldest", oldest, max_count)
        drop(oldest)


def release(directory: Path) -> subprocess.Popen[bytes] | None:
    """Stop watching the lingering QEMU of ``directory`` (a wake has claimed it): its window
    timer is cancelled; returns its process when it is this process's child, so the waker
    reaps it when it ends."""
    with _LOCK:
        entry = _KEPT.pop(directory, None)
    if entry is None:
        return None
    entry.timer.cancel()
    return entry.proc


def _expire(directory: Path, pid: int) -> None:
    """The window of the QEMU ``pid`` kept for ``directory`` is over: end it (its timer)."""
    with _LOCK:
        entry = _KEPT.get(directory)
        if entry is None or entry.pid != pid:
            return  # resumed or dropped meanwhile
    log.info("%s: the linger window is over", directory)
    drop(directory)


def drop(directory: Path) -> None:
    """End this process's lingering QEMU of ``directory`` now, if there is one and no other
    process claimed it: claim its marker, SIGKILL it, and let a reaper collect it (the next
    start on the directory waits for that: :func:`~torpor.sandbox.vm.exits.settle_exit`).
    Never blocks on the QEMU."""
    taken = _unkeep(directory)
    if taken is None:
        return
    entry, claimed = taken
    if claimed is None:
        # another process claimed it (it runs there now, or was killed), or its directory
        # went with its sandbox: only a QEMU left on a directory that is gone is ended here
        if not directory.exists() and (entry.proc is not None or _ran_in(entry.pid, directory)):
            _kill(entry.pid, entry.proc)
            hand_off(directory, entry.proc, None if entry.proc else entry.pid)
        elif entry.proc is not None:
            with _LOCK:
                _ELSEWHERE.append(entry.proc)
        return
    try:
        if qemu_pid(directory) == entry.pid:
            _kill(entry.pid, entry.proc)
            hand_off(directory, entry.proc, None if entry.proc else entry.pid)
        elif entry.proc is not None:
            with _LOCK:
                _ELSEWHERE.append(entry.proc)
    finally:
        claimed.unlink(missing_ok=True)
    log.info("%s: dropped its lingering QEMU %d", directory, entry.pid)


def _unkeep(directory: Path) -> tuple[_Kept, Path | None] | None:
    """Stop keeping the lingering QEMU of ``directory``: its entry (None when this process
    keeps none there), its timer cancelled, and its claimed marker when the marker is still
    the one this process wrote (None when another process claimed it)."""
    with _LOCK:
        entry = _KEPT.pop(directory, None)
    if entry is None:
        return None
    entry.timer.cancel()
    return entry, claim(directory) if _mine(directory, entry) else None


def _mine(directory: Path, entry: _Kept) -> bool:
    """Whether the marker of ``directory`` is still the one this process wrote for
    ``entry`` (not another process's, which resumed that QEMU and paused it again)."""
    marker = read_marker(directory / MARKER)
    return marker is not None and marker.pid == entry.pid and marker.owner == me()


def _ran_in(pid: int, directory: Path) -> bool:
    """Whether the process ``pid`` has its cwd in ``directory``, removed since (so a pid
    reused by another process is never killed)."""
    try:
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return False
    return cwd in (str(directory), f"{directory} (deleted)")


def _kill(pid: int, proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGKILL)
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


def _reap_elsewhere() -> None:
    """Collect the QEMUs another process resumed that have exited since (no zombies)."""
    with _LOCK:
        _ELSEWHERE[:] = [p for p in _ELSEWHERE if p.poll() is None]


def drop_all(under: Path | None = None) -> None:
    """:func:`drop` every lingering QEMU of this process (those of directories inside
    ``under`` only, when given)."""
    for directory in kept():
        if under is None or directory.is_relative_to(under):
            drop(directory)


async def settle(directory: Path) -> None:
    """Before a new QEMU starts on ``directory``: drop this process's lingering QEMU there
    and wait until every QEMU this process ended or told to quit on it is gone."""
    drop(directory)
    await settle_exit(directory)


async def settle_all(under: Path | None = None) -> None:
    """A manager that closes: drop this process's lingering QEMUs (of directories inside
    ``under``, when given), and wait until every QEMU this process handed off has exited."""
    drop_all(under)
    await settle_exits()


def sweep(root: Path) -> list[Path]:
    """Kill the lingering QEMUs of the sandbox directories in ``root`` whose keeper has
    exited (a process that died in their window: nothing will expire them), and remove
    their markers, and what a dead claimer left (:func:`recover`); returns their
    directories. Safe from any process: a live keeper's are left alone."""
    swept = []
    for directory in sorted(root.iterdir()) if root.is_dir() else []:
        if recover(directory):
            swept.append(directory)
            continue
        marker = read_marker(directory / MARKER)
        if marker is None or marker.kind != "linger" or _alive(marker.owner):
            continue
        claimed = claim(directory)
        if claimed is None:
            continue
        try:
            if qemu_pid(directory) == marker.pid:
                _kill(marker.pid, None)
                hand_off(directory, None, marker.pid)
        finally:
            claimed.unlink(missing_ok=True)
        log.warning("%s: killed the lingering QEMU a dead process left", directory.name)
        swept.append(directory)
    return swept


def me() -> str:
    """This process, as a marker's ``owner`` (its pid and start time)."""
    return process_token(os.getpid()) or str(os.getpid())


def _alive(owner: str | None) -> bool:
    if not owner or not owner.split(":")[0].isdecimal():
        return False
    return process_token(int(owner.split(":")[0])) == owner


@atexit.register
def _kill_at_exit() -> None:
    """No lingering QEMU outlives the process that kept it: SIGKILL each still owned (its
    state is on disk), without waiting for it to go."""
    for directory in kept():
        entry, claimed = _unkeep(directory) or (None, None)
        if entry is None or claimed is None:
            continue
        if qemu_pid(directory) == entry.pid:
            _kill(entry.pid, entry.proc)
        claimed.unlink(missing_ok=True)
