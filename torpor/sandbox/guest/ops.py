"""What the guest agent can do: commands, files, the interpreter and machine upkeep (stdlib only).

Each operation is ``op_<name>(req, payload) -> dict`` and runs on the request's own thread.
It streams with ``req.event(stream, bytes)`` / ``req.data(bytes)`` and fails by raising
:class:`Failure`, whose ``type`` names the :mod:`torpor.errors` class the host raises.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import selectors
import shutil
import signal
import stat
import struct
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

if __package__:
    from . import protocol as proto
    from .interpreter import KernelClient
    from .spawn import Process, spawn_shell
    from .terminal import Terminals
    from .tunnel import Tunnels
else:
    import protocol as proto  # type: ignore[no-redef]
    from interpreter import KernelClient  # type: ignore[no-redef]
    from spawn import Process, spawn_shell  # type: ignore[no-redef]
    from terminal import Terminals  # type: ignore[no-redef]
    from tunnel import Tunnels  # type: ignore[no-redef]

log = logging.getLogger("torpor.agent.ops")

DEFAULT_OUTPUT_LIMIT = 128 * 1024 * 1024
DEFAULT_FILE_LIMIT = 256 * 1024 * 1024
#: RNDADDENTROPY = _IOW('R', 0x03, int[2]) from <linux/random.h>
RNDADDENTROPY = 0x40085203
_BOOT_ID = "/proc/sys/kernel/random/boot_id"
_BY_ID = "/dev/disk/by-id/virtio-"


class Failure(Exception):
    """An error to send to the host as ``{type, message, data}``."""

    def __init__(self, type_name: str, message: str, **data: Any) -> None:
        super().__init__(message)
        self.type_name = type_name
        self.message = message
        self.data = data

    def wire(self) -> dict[str, Any]:
        return proto.error_dict(self.type_name, self.message, **self.data)


def os_failure(exc: OSError, path: str) -> Failure:
    """Translate an OSError about ``path`` into the error the host should raise."""
    if isinstance(exc, FileNotFoundError):
        return Failure("PathNotFound", f"no such file or directory: {path}", kind="path", name=path)
    if isinstance(exc, (NotADirectoryError, IsADirectoryError, FileExistsError)):
        return Failure("InvalidArgument", f"{exc.strerror}: {path}", path=path)
    return Failure("GuestError", f"{exc.strerror or exc}: {path}", path=path, errno=exc.errno)


def unencodable(exc: UnicodeEncodeError, path: str) -> Failure:
    """The error for a string no file name can be: a lone surrogate that is not one of the
    bytes Python decodes a name that is not UTF-8 to (surrogateescape)."""
    return Failure("InvalidArgument", f"{path!r} is no file name: {exc.reason}", path=path)


class Upload:
    """The payload of a request arriving in chunks: into a temporary file (``write``) or into
    memory, refusing more than ``limit`` bytes."""

    def __init__(self, tmp_path: str | None, limit: int, *, target: str = "") -> None:
        self.tmp_path, self.limit, self.target = tmp_path, limit, target
        self.size = 0
        self.failure: Failure | None = None
        self.buffer = bytearray()
        self.fd = -1
        if tmp_path is not None:
            try:
                os.makedirs(os.path.dirname(tmp_path), exist_ok=True)
                self.fd = os.open(
                    tmp_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644
                )
            except OSError as exc:
                self.failure = os_failure(exc, target)
            except UnicodeEncodeError as exc:  # a lone surrogate no file name can be
                self.failure = unencodable(exc, target)

    def add(self, chunk: bytes) -> None:
        if self.failure is not None:
            return
        self.size += len(chunk)
        if self.size > self.limit:
            self.failure = Failure(
                "PayloadTooLarge",
                f"upload over {self.limit} bytes",
                size=self.size,
                limit=self.limit,
            )
            self.abort()
            return
        if self.fd < 0:
            self.buffer += chunk
            return
        try:
            view = memoryview(chunk)
            while view:
                view = view[os.write(self.fd, view) :]
        except OSError as exc:
            self.failure = os_failure(exc, self.target)
            self.abort()

    def bytes(self) -> bytes:
        return bytes(self.buffer)

    def abort(self) -> None:
        """Close and delete the temporary file (a failed or abandoned upload leaves nothing)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.tmp_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.tmp_path)

    def commit(self) -> None:
        """Move the finished file into place atomically. Raises :class:`Failure`."""
        if self.failure is not None:
            raise self.failure
        assert self.tmp_path is not None
        os.close(self.fd)
        self.fd = -1
        try:
            with contextlib.suppress(FileNotFoundError):
                os.chmod(self.tmp_path, stat.S_IMODE(os.stat(self.target).st_mode))
            os.replace(self.tmp_path, self.target)
        except OSError as exc:
            self.abort()
            raise os_failure(exc, self.target) from exc


def _entry_type(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISDIR(mode):
        return "dir"
    return "file" if stat.S_ISREG(mode) else "other"


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


class Operations:
    """The handlers, by op name. ``set_clock=False`` keeps ``refresh`` off the system clock."""

    def __init__(self, kernel: KernelClient, *, set_clock: bool = True) -> None:
        self.kernel = kernel
        self.set_clock = set_clock
        self.started = time.time()
        self._boot: str | None = None
        self._refresh_lock = threading.Lock()
        self._ping_refresh: tuple[bytes | None, dict[str, Any]] | None = None
        self._urandom: int | None = None
        self.terminals = Terminals(Failure)
        self.tunnels = Tunnels(Failure)

    def handler(self, op: str) -> Callable[[Any, Any], dict[str, Any]]:
        """The function serving ``op``. Raises :class:`Failure` for an unknown op."""
        fn = getattr(self, f"op_{op}", None)
        if fn is None:
            raise Failure("InvalidArgument", f"unknown guest operation {op!r}", op=op)
        return fn  # type: ignore[no-any-return]

    # -- machine -------------------------------------------------------------------------

    def op_ping(self, req: Any, payload: bytes) -> dict[str, Any]:
        """``{pid, boot_id, uptime, time, version, marks}``; with ``args.refresh``
        (``{unix_time}``, entropy as payload) it refreshes too, once per entropy, and adds
        ``refresh``. ``{unix_time, key, reseed: false}`` with no payload (a plain wake: the
        guest's random state was never copied) only sets the clock, once per ``key``.
        ``marks``: how this connection reached the agent in the guest's CLOCK_MONOTONIC (the
        agent's ``wake_marks``, plus ``data``: the read that brought this ping returned,
        ``served``: its handling began, ``answered``: its answer is ready, refresh included)."""
        served = time.monotonic()
        info: dict[str, Any] = {
            "pid": os.getpid(),
            "boot_id": self._boot_id(),
            "uptime": _uptime(),
            "time": time.time(),
            "version": proto.PROTOCOL_VERSION,
        }
        wanted = req.args.get("refresh")
        if isinstance(wanted, dict):
            # The host sends a ping every few ms until one is answered, all with the same
            # fresh entropy: only the first of them refreshes (a wake must not queue a refresh
            # per lost ping). Keyed by the entropy, not by the connection: a guest snapshotted
            # before it saw its host hang up still counts the old connection as current.
            key = payload or wanted.get("key") or None
            reseed = wanted.get("reseed") is not False
            with self._refresh_lock:
                if key is None or self._ping_refresh is None or self._ping_refresh[0] != key:
                    # a new host connection (every one starts so): the terminals and tunnels
                    # of an earlier one have nobody reading them, even if this guest was
                    # frozen before it saw that host hang up
                    self.terminals.hang_up()
                    self.tunnels.hang_up()
                    done = self._refresh(payload, wanted.get("unix_time"), reseed=reseed)
                    self._ping_refresh = (key, done)
                info["refresh"] = self._ping_refresh[1]
        agent = getattr(req, "agent", None)
        marks = dict(getattr(agent, "wake_marks", None) or {})
        marks.update(data=getattr(agent, "read_at", served), served=served)
        marks["answered"] = time.monotonic()
        info["marks"] = marks
        return info

    def _boot_id(self) -> str:
        # Read once: a process never sees its boot change (a clone's guest keeps its boot).
        if self._boot is None:
            try:
                with open(_BOOT_ID) as f:
                    self._boot = f.read().strip()
            except OSError:
                self._boot = ""
        return self._boot

    def op_refresh(self, req: Any, payload: bytes) -> dict[str, Any]:
        """Mix host entropy into the kernel pool, set the clock, reseed the interpreter."""
        return self._refresh(payload, req.args.get("unix_time"))

    def _refresh(self, payload: bytes, unix_time: Any, *, reseed: bool = True) -> dict[str, Any]:
        """Mix ``payload`` into the kernel pool, set the clock to ``unix_time`` and, with
        ``reseed``, have the interpreter reseed before its next run."""
        credited = False
        if payload:
            if self._urandom is None:  # kept open: an open() is a path walk, slow after a wake
                self._urandom = os.open("/dev/urandom", os.O_WRONLY | os.O_CLOEXEC)
            try:  # mixes the bytes in and credits them; needs CAP_SYS_ADMIN
                info = struct.pack("ii", len(payload) * 8, len(payload)) + payload
                fcntl.ioctl(self._urandom, RNDADDENTROPY, info)
                credited = True
            except OSError:  # without the capability: mixed in, not credited
                os.write(self._urandom, payload)
        clock_set = False
        if unix_time is not None and self.set_clock:
            try:
                time.clock_settime(time.CLOCK_REALTIME, float(unix_time))
                clock_set = True
            except OSError as exc:
                log.warning("cannot set the clock: %s", exc)
        # A seed from host entropy *and* the (now mixed) pool: clones must diverge even if
        # the host sent the same bytes twice. (random.seed hashes bytes itself.)
        reseeded = False
        if reseed:
            reseeded = self._defer_reseed(payload + os.urandom(32))
        return {
            "entropy_bytes": len(payload),
            "credited": credited,
            "clock_set": clock_set,
            "interpreter_reseeded": reseeded,
            "time": time.time(),
        }

    def _defer_reseed(self, seed: bytes) -> bool:
        """Hand ``seed`` to the interpreter, which takes it before its next run. Not sent now:
        right after a wake the guest's CPU is busy re-translating code, and waking the
        interpreter process for it would slow the refresh and the host's next request.
        False when no interpreter runs (a new one seeds itself from the refreshed pool)."""
        proc = self.kernel.proc
        if proc is None or proc.poll() is not None:
            return False
        self.kernel.pending_seed = seed  # KernelClient.run flushes it before the code
        return True

    def op_sync(self, req: Any, payload: bytes) -> dict[str, Any]:
        os.sync()
        return {}

    def _tool(self, argv: list[str]) -> None:
        proc = subprocess.run(
            argv, check=False, stdin=subprocess.DEVNULL, capture_output=True, timeout=120
        )
        if proc.returncode != 0:
            raise Failure(
                "GuestError",
                f"{' '.join(argv)} failed: {proc.stderr.decode(errors='replace').strip()}",
                exit_code=proc.returncode,
            )

    def op_mount(self, req: Any, payload: bytes) -> dict[str, Any]:
        """``mount``; a ``/dev/disk/by-id/virtio-<serial>`` source is found by its serial
        (the guest has no udev to make that link), waiting a little for a hot-plugged disk."""
        a = req.args
        source = str(a["source"])
        if source.startswith(_BY_ID):
            source = _disk_by_serial(source[len(_BY_ID) :], float(a.get("wait", 10.0)))
        os.makedirs(a["target"], exist_ok=True)
        argv = ["mount"]
        if a.get("fstype"):
            argv += ["-t", a["fstype"]]
        if a.get("options"):
            argv += ["-o", a["options"]]
        self._tool([*argv, source, a["target"]])
        return {"source": source}

    def op_umount(self, req: Any, payload: bytes) -> dict[str, Any]:
        self._tool(["umount", req.args["target"]])
        return {}

    # -- commands ------------------------------------------------------------------------

    def op_run(self, req: Any, payload: bytes) -> dict[str, Any]:
        """Run ``cmd`` through /bin/sh in its own process group, streaming its output."""
        a = req.args
        cmd, cwd, timeout = str(a["cmd"]), a.get("cwd"), a.get("timeout")
        env = dict(os.environ)
        env.update({str(k): str(v) for k, v in (a.get("env") or {}).items()})
        if cwd is not None and not os.path.isdir(cwd):
            raise Failure(
                "PathNotFound", f"working directory {cwd} does not exist", kind="path", name=cwd
            )
        if a.get("background"):
            proc = spawn_shell(cmd, cwd=cwd, env=env, capture=False)
            self._keep(proc)
            return {"pid": proc.pid, "exit_code": None}
        limit = int(a.get("max_output") or DEFAULT_OUTPUT_LIMIT)
        proc = spawn_shell(cmd, cwd=cwd, env=env, capture=True)
        req.cancel_hook = lambda: _killpg(proc)
        try:
            self._pump(req, proc, limit, timeout)
        except BaseException:
            _killpg(proc)
            proc.wait()  # no zombie left behind by a timeout, a cancel or too much output
            raise
        finally:
            req.cancel_hook = None
        return {"pid": proc.pid, "exit_code": _exit_code(proc.wait())}

    def _pump(self, req: Any, proc: Process, limit: int, timeout: float | None) -> None:
        sel = selectors.DefaultSelector()
        assert proc.stdout is not None and proc.stderr is not None
        sel.register(proc.stdout, selectors.EVENT_READ, "stdout")
        sel.register(proc.stderr, selectors.EVENT_READ, "stderr")
        deadline = None if timeout is None else time.monotonic() + float(timeout)
        total = 0
        exited_at: float | None = None
        try:
            while sel.get_map():
                if exited_at is None and proc.poll() is not None:
                    exited_at = time.monotonic()
                exited = exited_at is not None
                # After the shell exits, take what is already in the pipes and stop: a
                # background grandchild (`cmd &`) may hold them open for ever.
                got = False
                for key, _ in sel.select(0 if exited else 0.05):
                    chunk = os.read(key.fd, 1 << 16)
                    if not chunk:
                        sel.unregister(key.fileobj)
                        key.fileobj.close()  # type: ignore[union-attr]
                        continue
                    got = True
                    total += len(chunk)
                    if total > limit:
                        _killpg(proc)
                        raise Failure(
                            "PayloadTooLarge",
                            f"command output over {limit} bytes",
                            size=total,
                            limit=limit,
                        )
                    req.event(key.data, chunk)
                if req.cancelled:
                    raise Failure(
                        "OperationTimeout", "command cancelled by the host", seconds=timeout
                    )
                if deadline is not None and time.monotonic() > deadline:
                    raise Failure(
                        "OperationTimeout", f"command timed out after {timeout} s", seconds=timeout
                    )
                # Stop once the pipes are empty, or soon after the exit if a grandchild
                # keeps writing (`yes &`).
                if exited_at is not None and (not got or time.monotonic() - exited_at > 0.2):
                    break
        finally:
            left = [key.fileobj for key in sel.get_map().values()]
            sel.close()
            if left:  # keep draining for the grandchild so its writes never block or fail
                threading.Thread(target=_drain, args=(left,), daemon=True).start()

    def _keep(self, proc: Process) -> None:
        # Reap the shell when it exits so it does not stay a zombie.
        threading.Thread(target=proc.wait, daemon=True, name=f"reap-{proc.pid}").start()

    # -- terminals (see terminal.py) -----------------------------------------------------

    def op_pty(self, req: Any, payload: bytes) -> dict[str, Any]:
        """Run ``cmd`` on a new pty until it exits (``id``, ``cols``, ``rows``, ``env``,
        ``cwd``): a ``started`` event, ``pty`` events with its output, its exit code."""
        return self.terminals.run(req)

    def op_pty_input(self, req: Any, payload: bytes) -> dict[str, Any]:
        return self.terminals.input(req, payload)

    def op_pty_resize(self, req: Any, payload: bytes) -> dict[str, Any]:
        return self.terminals.resize(req)

    def op_pty_kill(self, req: Any, payload: bytes) -> dict[str, Any]:
        return self.terminals.kill(req)

    # -- tunnels to guest ports (see tunnel.py) -------------------------------------------

    def op_tunnel(self, req: Any, payload: bytes) -> dict[str, Any]:
        """Connect to ``127.0.0.1:port`` (``id``, ``port``) until the guest's side closes: a
        ``started`` event, ``data`` events with what it sends."""
        return self.tunnels.run(req)

    def op_tunnel_send(self, req: Any, payload: bytes) -> dict[str, Any]:
        return self.tunnels.send(req, payload)

    def op_tunnel_close(self, req: Any, payload: bytes) -> dict[str, Any]:
        return self.tunnels.close(req)

    # -- files ---------------------------------------------------------------------------

    def op_read(self, req: Any, payload: bytes) -> dict[str, Any]:
        path = str(req.args["path"])
        limit = int(req.args.get("max_bytes") or DEFAULT_FILE_LIMIT)
        # O_NONBLOCK: opening a named pipe would wait for a writer, for ever (no cancel
        # reaches a thread blocked in open)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise Failure("InvalidArgument", f"{path} is a directory", path=path)
            if stat.S_ISFIFO(st.st_mode):
                raise Failure("InvalidArgument", f"{path} is a named pipe, not a file", path=path)
            os.set_blocking(fd, True)
            if st.st_size > limit:
                raise Failure(
                    "PayloadTooLarge",
                    f"{path} is {st.st_size} bytes, over {limit}",
                    size=st.st_size,
                    limit=limit,
                    path=path,
                )
            total = 0
            while chunk := os.read(fd, proto.CHUNK):
                if req.cancelled:
                    raise Failure("OperationTimeout", f"reading {path} was cancelled", path=path)
                total += len(chunk)
                if total > limit:
                    raise Failure(
                        "PayloadTooLarge",
                        f"{path} grew over {limit} bytes",
                        size=total,
                        limit=limit,
                        path=path,
                    )
                req.data(chunk)
        finally:
            os.close(fd)
        return {"size": total}

    def start_upload(self, req_id: int, args: dict[str, Any]) -> Upload:
        target = os.path.abspath(str(args.get("path", "")))
        head, tail = os.path.split(target)
        limit = int(args.get("max_bytes") or DEFAULT_FILE_LIMIT)
        return Upload(os.path.join(head, f".{tail}.torpor-{req_id}.tmp"), limit, target=target)

    def op_write(self, req: Any, upload: Upload) -> dict[str, Any]:
        upload.commit()
        return {"size": upload.size}

    def op_list(self, req: Any, payload: bytes) -> dict[str, Any]:
        path = str(req.args["path"])
        entries: list[dict[str, Any]] = []
        with os.scandir(path) as it:
            for entry in it:
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue  # removed while we listed
                entries.append(
                    {
                        "name": entry.name,
                        "path": os.path.join(path, entry.name),
                        "type": _entry_type(st.st_mode),
                        "size": st.st_size,
                    }
                )
        entries.sort(key=lambda e: str(e["name"]))
        return {"entries": entries}

    def op_exists(self, req: Any, payload: bytes) -> dict[str, Any]:
        return {"exists": os.path.lexists(str(req.args["path"]))}

    def op_remove(self, req: Any, payload: bytes) -> dict[str, Any]:
        path = str(req.args["path"])
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path)
        else:
            os.unlink(path)
        return {}

    def op_make_dir(self, req: Any, payload: bytes) -> dict[str, Any]:
        path = str(req.args["path"])
        if os.path.isdir(path):
            return {"created": False}
        os.makedirs(path)
        return {"created": True}

    # -- interpreter ---------------------------------------------------------------------

    def op_run_code(self, req: Any, payload: bytes) -> dict[str, Any]:
        code = payload.decode("utf-8") if payload else str(req.args.get("code", ""))
        limit = int(req.args.get("max_output") or DEFAULT_OUTPUT_LIMIT)
        outcome = self.kernel.run(
            code,
            req.args.get("timeout"),
            req.event,
            limit,
            lambda hook: setattr(req, "cancel_hook", hook),
        )
        if outcome.get("timed_out"):
            raise Failure(
                "OperationTimeout",
                f"code timed out after {req.args.get('timeout')} s",
                seconds=req.args.get("timeout"),
                kernel_alive=outcome["kernel_alive"],
            )
        if outcome.get("too_large"):
            raise Failure(
                "PayloadTooLarge",
                f"output over {limit} bytes",
                size=outcome["size"],
                limit=limit,
                kernel_alive=outcome["kernel_alive"],
            )
        return dict(outcome["reply"])

    def op_restart_interpreter(self, req: Any, payload: bytes) -> dict[str, Any]:
        self.kernel.stop()
        return {}


def _uptime() -> float:
    """Seconds since boot (``/proc/uptime`` without opening a file)."""
    try:
        return time.clock_gettime(time.CLOCK_BOOTTIME)
    except (AttributeError, OSError):
        return time.monotonic()


def _disk_by_serial(serial: str, wait: float) -> str:
    """The /dev node of the virtio disk with ``serial`` (virtio-blk keeps 20 characters).
    Raises :class:`Failure` (PathNotFound) if none appears within ``wait`` seconds."""
    deadline = time.monotonic() + wait
    while True:
        if os.path.exists(_BY_ID + serial):
            return _BY_ID + serial
        for name in sorted(os.listdir("/sys/block")) if os.path.isdir("/sys/block") else []:
            try:
                with open(f"/sys/block/{name}/serial") as f:
                    found = f.read().strip()
            except OSError:
                continue
            if found and found == serial[:20]:
                return f"/dev/{name}"
        if time.monotonic() > deadline:
            raise Failure(
                "PathNotFound",
                f"no disk with serial {serial!r} in the guest",
                kind="disk",
                name=serial,
            )
        time.sleep(0.1)


def _killpg(proc: Process) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _drain(files: list[Any]) -> None:
    sel = selectors.DefaultSelector()
    for f in files:
        sel.register(f, selectors.EVENT_READ)
    while sel.get_map():
        for key, _ in sel.select():
            if not os.read(key.fd, 1 << 16):
                sel.unregister(key.fileobj)
                key.fileobj.close()  # type: ignore[union-attr]
    sel.close()
