"""Background processes as handles: start, list, wait, send stdin, kill (``sbx.commands``).

::

    p = sbx.commands.start("python3 -u worker.py")        # returns at once
    p.send_stdin("job 1\\n")
    sbx.commands.list()                                    # [ProcessInfo(pid=..., cmd=...)]
    p.wait(timeout=60).stdout                              # its output and exit code
    p.kill()

They are built on plain shell commands in the guest, with no agent support needed: a started
process runs in a session of its own (``setsid``, so a host call that ends does not take it
along) with its stdin a FIFO, its stdout and stderr files and its exit code written when it
ends, all in ``/tmp/torpor-procs/<pid>/`` (a link to the directory made before the pid was
known). That directory lives in the guest's RAM and disk,
so a handle survives a pause and wake (the process keeps running when woken) and is copied by
a fork. Its output is kept whole in the guest until the directory is removed (``p.forget()``).

An :class:`~torpor.client.aio_sandbox.AsyncSandbox` 's ``commands.start`` answers an
:class:`AsyncProcessHandle`: the same methods, awaited, running the same guest scripts
(:func:`start_script`, :class:`_Scripts`): only the sending differs.
"""

from __future__ import annotations

import base64
import binascii
import shlex
from typing import Protocol

from torpor.errors import GuestError, InvalidArgument, NotFound, OperationTimeout
from torpor.sandbox.models import CommandResult, ProcessInfo


class _Commands(Protocol):
    def run(self, cmd: str, *, timeout: float | None = ...) -> CommandResult: ...


class _Files(Protocol):
    def exists(self, path: str) -> bool: ...

    def read(self, path: str) -> bytes: ...


class Sandbox(Protocol):
    """What a handle uses of a :class:`torpor.Sandbox` (its commands and files)."""

    @property
    def commands(self) -> _Commands: ...

    @property
    def files(self) -> _Files: ...


class _AsyncCommands(Protocol):
    async def run(self, cmd: str, *, timeout: float | None = ...) -> CommandResult: ...


class _AsyncFiles(Protocol):
    async def exists(self, path: str) -> bool: ...

    async def read(self, path: str) -> bytes: ...


class AsyncSandbox(Protocol):
    """What an async handle uses of a :class:`torpor.AsyncSandbox`."""

    @property
    def commands(self) -> _AsyncCommands: ...

    @property
    def files(self) -> _AsyncFiles: ...


__all__ = [
    "PROCS_DIR",
    "AsyncProcessHandle",
    "ProcessHandle",
    "list_processes",
    "list_processes_async",
    "start",
    "start_async",
]

#: where each started process keeps its stdin FIFO, output, pid and exit code (in the guest)
PROCS_DIR = "/tmp/torpor-procs"

#: seconds a quick bookkeeping command may take (waking the sandbox is the server's slack)
_QUICK = 30.0

_START = r"""set -e
mkdir -p {root}
d=$(mktemp -d {root}/run.XXXXXX)
mkfifo "$d/stdin"
printf %s {cmd} | base64 -d > "$d/cmd"
cat > "$d/run" <<'END'
exec 3<>"$1/stdin"
sh "$1/cmd" <&3 >"$1/stdout" 2>"$1/stderr"
echo $? > "$1/exit.tmp"
mv "$1/exit.tmp" "$1/exit"
END
setsid sh "$d/run" "$d" </dev/null >/dev/null 2>&1 &
pid=$!
ln -s "$d" {root}/$pid
echo $pid
"""

_LIST = r"""for d in {root}/[0-9]*; do
  [ -d "$d" ] || continue
  pid=${{d##*/}}
  code=$(cat "$d/exit" 2>/dev/null || echo -)
  printf '%s %s %s\n' "$pid" "$code" "$(base64 -w0 < "$d/cmd")"
done
"""


def _checked(result: CommandResult) -> CommandResult:
    if result.exit_code != 0:
        raise InvalidArgument(
            f"the guest could not manage the process: {result.stderr.strip() or result.stdout}"
        )
    return result


def _run(sbx: Sandbox, script: str, *, timeout: float | None = _QUICK) -> CommandResult:
    return _checked(sbx.commands.run(script, timeout=timeout))


# -- the scripts and how their answers are read (shared by the sync and the async handles) ----


def start_script(cmd: str, cwd: str | None) -> str:
    """The guest script that starts ``cmd`` and prints its pid. Raises InvalidArgument for an
    empty command."""
    if not cmd.strip():
        raise InvalidArgument("an empty command", field="cmd")
    body = cmd if cwd is None else f"cd {shlex.quote(cwd)} && {cmd}"
    encoded = shlex.quote(base64.b64encode(body.encode()).decode())
    return _START.format(root=PROCS_DIR, cmd=encoded)


def list_script() -> str:
    """The guest script that lists the started processes (read by :func:`parse_list`)."""
    return _LIST.format(root=PROCS_DIR)


def parse_list(out: str, include_exited: bool) -> list[ProcessInfo]:
    """The processes :func:`list_script` printed, oldest pid first. A line that is not one
    of theirs (a directory another guest process made there) is skipped."""
    found: list[ProcessInfo] = []
    for line in out.splitlines():
        pid, code, cmd = [*line.split(" ", 2), "", ""][:3]
        if not _is_number(pid):
            continue
        if code != "-" and not include_exited:
            continue
        try:
            text = base64.b64decode(cmd, validate=True).decode(errors="replace")
        except binascii.Error:
            continue
        found.append(ProcessInfo(pid=int(pid), cmd=text))
    return sorted(found, key=lambda p: p.pid)


def _is_number(text: str) -> bool:
    return text.isascii() and text.isdigit()


def _chunk(text: str) -> bytes:
    """What :meth:`_Scripts.read_bytes_from` printed (base64) as bytes. Raises GuestError if
    it is not base64."""
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except binascii.Error:
        raise GuestError(f"the guest gave {text.strip()[:80]!r} for a chunk of output") from None


def _number(text: str, what: str) -> int:
    """``text`` (what a guest script printed) as an int. Raises GuestError if it is none."""
    if not _is_number(text.strip()):
        raise GuestError(f"the guest gave {text.strip()[:80]!r} for {what}")
    return int(text)


class _Scripts:
    """The guest scripts of one started process (its directory is ``PROCS_DIR/<pid>``)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.dir = f"{PROCS_DIR}/{pid}"

    def missing(self) -> NotFound:
        return NotFound(
            f"no process {self.pid} started by torpor", kind="process", name=str(self.pid)
        )

    def exit_code(self) -> str:
        return f"cat {self.dir}/exit 2>/dev/null || true"

    @staticmethod
    def parse_exit_code(result: CommandResult) -> int | None:
        text = result.stdout.strip()
        return _number(text, "an exit code") if text else None

    def wait(self) -> str:
        return f"while [ ! -e {self.dir}/exit ]; do sleep 0.1; done"

    def still_runs(self, timeout: float | None) -> OperationTimeout:
        return OperationTimeout(f"process {self.pid} still runs after {timeout} s", pid=self.pid)

    def send_stdin(self, data: str | bytes) -> str:
        raw = data.encode() if isinstance(data, str) else bytes(data)
        encoded = shlex.quote(base64.b64encode(raw).decode())
        return f"printf %s {encoded} | base64 -d > {self.dir}/stdin"

    def kill(self) -> str:
        # the wrapper that would write the exit code dies too: write it (128 + SIGKILL)
        return (
            f"[ -e {self.dir}/exit ] && exit 3; kill -s KILL -- -{self.pid} && "
            f"echo 137 > {self.dir}/exit"
        )

    def read_from(self, offset: int) -> str:
        return f"tail -c +{int(offset) + 1} {self.dir}/stdout"

    def read_bytes_from(self, offset: int, limit: int) -> str:
        return f"tail -c +{int(offset) + 1} {self.dir}/stdout | head -c {int(limit)} | base64"

    def forget(self) -> str:
        return f'rm -rf "$(readlink -f {self.dir})" {self.dir}'

    def output(self, code: int | None, stdout: bytes, stderr: bytes) -> CommandResult:
        """The result of the files' bytes (a program prints any bytes: what is not UTF-8
        reads as U+FFFD, as in a command's output)."""
        return CommandResult(
            exit_code=-1 if code is None else code,
            stdout=stdout.decode("utf-8", "replace"),
            stderr=stderr.decode("utf-8", "replace"),
            pid=self.pid,
        )


# -- the sync handle ---------------------------------------------------------------------------


def start(sbx: Sandbox, cmd: str, *, cwd: str | None = None) -> ProcessHandle:
    """Start ``cmd`` (``/bin/sh``) in the background and return its handle. Raises
    InvalidArgument (an empty command, or the guest refused), GuestError (it printed no
    pid)."""
    out = _run(sbx, start_script(cmd, cwd)).stdout
    return ProcessHandle(sbx, _number(out, "a pid"), cmd)


def list_processes(sbx: Sandbox, *, include_exited: bool = False) -> list[ProcessInfo]:
    """The processes started with :func:`start` (running ones, or all with
    ``include_exited``), oldest pid first."""
    return parse_list(_run(sbx, list_script()).stdout, include_exited)


class ProcessHandle:
    """One background process in a sandbox (see the module docstring)."""

    def __init__(self, sandbox: Sandbox, pid: int, cmd: str = "") -> None:
        self._sbx = sandbox
        self._scripts = _Scripts(pid)
        self.pid = pid
        self.cmd = cmd

    def __repr__(self) -> str:
        return f"<ProcessHandle {self.pid} {self.cmd!r}>"

    def _check(self) -> None:
        if not self._sbx.files.exists(self._scripts.dir):
            raise self._scripts.missing()

    def exit_code(self) -> int | None:
        """Its exit code, or None while it runs. Raises NotFound, GuestError (its exit
        file holds no number)."""
        self._check()
        got = self._sbx.commands.run(self._scripts.exit_code(), timeout=_QUICK)
        return self._scripts.parse_exit_code(got)

    def output(self) -> CommandResult:
        """What it wrote so far (stdout, stderr) and its exit code (-1 while it runs)."""
        self._check()
        code = self.exit_code()
        files, d = self._sbx.files, self._scripts.dir
        return self._scripts.output(code, files.read(f"{d}/stdout"), files.read(f"{d}/stderr"))

    def wait(self, timeout: float | None = 60.0) -> CommandResult:
        """Wait until it exits; its whole output and exit code. Raises OperationTimeout after
        ``timeout`` seconds (it keeps running), NotFound."""
        self._check()
        try:
            self._sbx.commands.run(self._scripts.wait(), timeout=timeout)
        except OperationTimeout:
            raise self._scripts.still_runs(timeout) from None
        return self.output()

    def send_stdin(self, data: str | bytes) -> None:
        """Write ``data`` to its stdin. Raises NotFound."""
        self._check()
        _run(self._sbx, self._scripts.send_stdin(data))

    def kill(self) -> bool:
        """Kill it and what it started (its whole session); False if it had exited."""
        self._check()
        return self._sbx.commands.run(self._scripts.kill(), timeout=_QUICK).exit_code == 0

    def read_from(self, offset: int) -> str:
        """What it wrote to stdout from byte ``offset`` on (for following its output)."""
        return self._sbx.commands.run(self._scripts.read_from(offset), timeout=_QUICK).stdout

    def read_bytes_from(self, offset: int, limit: int = 1 << 20) -> bytes:
        """At most ``limit`` bytes of its stdout from byte ``offset`` on, as written: to follow
        output that may not be UTF-8 (:meth:`read_from` decodes it, so its length in bytes
        says nothing of the offset to read from next). Raises GuestError."""
        script = self._scripts.read_bytes_from(offset, limit)
        return _chunk(self._sbx.commands.run(script, timeout=_QUICK).stdout)

    def forget(self) -> None:
        """Remove its files from the guest (kill it first if it should stop)."""
        self._sbx.commands.run(self._scripts.forget(), timeout=_QUICK)


# -- the async handle --------------------------------------------------------------------------


async def start_async(sbx: AsyncSandbox, cmd: str, *, cwd: str | None = None) -> AsyncProcessHandle:
    """:func:`start` for an :class:`~torpor.client.aio_sandbox.AsyncSandbox`."""
    out = _checked(await sbx.commands.run(start_script(cmd, cwd), timeout=_QUICK)).stdout
    return AsyncProcessHandle(sbx, _number(out, "a pid"), cmd)


async def list_processes_async(
    sbx: AsyncSandbox, *, include_exited: bool = False
) -> list[ProcessInfo]:
    """:func:`list_processes` for an :class:`~torpor.client.aio_sandbox.AsyncSandbox`."""
    out = _checked(await sbx.commands.run(list_script(), timeout=_QUICK)).stdout
    return parse_list(out, include_exited)


class AsyncProcessHandle:
    """:class:`ProcessHandle`, awaited: one background process in an async sandbox."""

    def __init__(self, sandbox: AsyncSandbox, pid: int, cmd: str = "") -> None:
        self._sbx = sandbox
        self._scripts = _Scripts(pid)
        self.pid = pid
        self.cmd = cmd

    def __repr__(self) -> str:
        return f"<AsyncProcessHandle {self.pid} {self.cmd!r}>"

    async def _check(self) -> None:
        if not await self._sbx.files.exists(self._scripts.dir):
            raise self._scripts.missing()

    async def exit_code(self) -> int | None:
        """As :meth:`ProcessHandle.exit_code`."""
        await self._check()
        got = await self._sbx.commands.run(self._scripts.exit_code(), timeout=_QUICK)
        return self._scripts.parse_exit_code(got)

    async def output(self) -> CommandResult:
        """As :meth:`ProcessHandle.output`."""
        await self._check()
        code = await self.exit_code()
        files, d = self._sbx.files, self._scripts.dir
        return self._scripts.output(
            code, await files.read(f"{d}/stdout"), await files.read(f"{d}/stderr")
        )

    async def wait(self, timeout: float | None = 60.0) -> CommandResult:
        """As :meth:`ProcessHandle.wait`."""
        await self._check()
        try:
            await self._sbx.commands.run(self._scripts.wait(), timeout=timeout)
        except OperationTimeout:
            raise self._scripts.still_runs(timeout) from None
        return await self.output()

    async def send_stdin(self, data: str | bytes) -> None:
        """As :meth:`ProcessHandle.send_stdin`."""
        await self._check()
        _checked(await self._sbx.commands.run(self._scripts.send_stdin(data), timeout=_QUICK))

    async def kill(self) -> bool:
        """As :meth:`ProcessHandle.kill`."""
        await self._check()
        got = await self._sbx.commands.run(self._scripts.kill(), timeout=_QUICK)
        return got.exit_code == 0

    async def read_from(self, offset: int) -> str:
        """As :meth:`ProcessHandle.read_from`."""
        return (
            await self._sbx.commands.run(self._scripts.read_from(offset), timeout=_QUICK)
        ).stdout

    async def read_bytes_from(self, offset: int, limit: int = 1 << 20) -> bytes:
        """As :meth:`ProcessHandle.read_bytes_from`."""
        script = self._scripts.read_bytes_from(offset, limit)
        return _chunk((await self._sbx.commands.run(script, timeout=_QUICK)).stdout)

    async def forget(self) -> None:
        """As :meth:`ProcessHandle.forget`."""
        await self._sbx.commands.run(self._scripts.forget(), timeout=_QUICK)
