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
"""

from __future__ import annotations

import base64
import shlex
from typing import Protocol

from torpor.errors import InvalidArgument, NotFound, OperationTimeout
from torpor.sandbox.models import CommandResult, ProcessInfo


class _Commands(Protocol):
    def run(self, cmd: str, *, timeout: float | None = ...) -> CommandResult: ...


class _Files(Protocol):
    def exists(self, path: str) -> bool: ...

    def read_text(self, path: str) -> str: ...


class Sandbox(Protocol):
    """What a handle uses of a :class:`torpor.Sandbox` (its commands and files)."""

    @property
    def commands(self) -> _Commands: ...

    @property
    def files(self) -> _Files: ...


__all__ = ["PROCS_DIR", "ProcessHandle", "list_processes", "start"]

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


def _run(sbx: Sandbox, script: str, *, timeout: float | None = _QUICK) -> CommandResult:
    result = sbx.commands.run(script, timeout=timeout)
    if result.exit_code != 0:
        raise InvalidArgument(
            f"the guest could not manage the process: {result.stderr.strip() or result.stdout}"
        )
    return result


def start(sbx: Sandbox, cmd: str, *, cwd: str | None = None) -> ProcessHandle:
    """Start ``cmd`` (``/bin/sh``) in the background and return its handle. Raises
    InvalidArgument (an empty command, or the guest refused)."""
    if not cmd.strip():
        raise InvalidArgument("an empty command", field="cmd")
    body = cmd if cwd is None else f"cd {shlex.quote(cwd)} && {cmd}"
    encoded = shlex.quote(base64.b64encode(body.encode()).decode())
    out = _run(sbx, _START.format(root=PROCS_DIR, cmd=encoded)).stdout.strip()
    return ProcessHandle(sbx, int(out), cmd)


def list_processes(sbx: Sandbox, *, include_exited: bool = False) -> list[ProcessInfo]:
    """The processes started with :func:`start` (running ones, or all with
    ``include_exited``), oldest pid first."""
    out = _run(sbx, _LIST.format(root=PROCS_DIR)).stdout
    found: list[ProcessInfo] = []
    for line in out.splitlines():
        pid, code, cmd = [*line.split(" ", 2), "", ""][:3]
        if code != "-" and not include_exited:
            continue
        found.append(ProcessInfo(pid=int(pid), cmd=base64.b64decode(cmd).decode(errors="replace")))
    return sorted(found, key=lambda p: p.pid)


class ProcessHandle:
    """One background process in a sandbox (see the module docstring)."""

    def __init__(self, sandbox: Sandbox, pid: int, cmd: str = "") -> None:
        self._sbx = sandbox
        self.pid = pid
        self.cmd = cmd

    def __repr__(self) -> str:
        return f"<ProcessHandle {self.pid} {self.cmd!r}>"

    @property
    def _dir(self) -> str:
        return f"{PROCS_DIR}/{self.pid}"

    def _check(self) -> None:
        if not self._sbx.files.exists(self._dir):
            raise NotFound(
                f"no process {self.pid} started by torpor", kind="process", name=str(self.pid)
            )

    def exit_code(self) -> int | None:
        """Its exit code, or None while it runs. Raises NotFound."""
        self._check()
        got = self._sbx.commands.run(f"cat {self._dir}/exit 2>/dev/null || true", timeout=_QUICK)
        text = got.stdout.strip()
        return int(text) if text else None

    def output(self) -> CommandResult:
        """What it wrote so far (stdout, stderr) and its exit code (-1 while it runs)."""
        self._check()
        code = self.exit_code()
        return CommandResult(
            exit_code=-1 if code is None else code,
            stdout=self._sbx.files.read_text(f"{self._dir}/stdout"),
            stderr=self._sbx.files.read_text(f"{self._dir}/stderr"),
            pid=self.pid,
        )

    def wait(self, timeout: float | None = 60.0) -> CommandResult:
        """Wait until it exits; its whole output and exit code. Raises OperationTimeout after
        ``timeout`` seconds (it keeps running), NotFound."""
        self._check()
        script = f"while [ ! -e {self._dir}/exit ]; do sleep 0.1; done"
        try:
            self._sbx.commands.run(script, timeout=timeout)
        except OperationTimeout:
            raise OperationTimeout(
                f"process {self.pid} still runs after {timeout} s", pid=self.pid
            ) from None
        return self.output()

    def send_stdin(self, data: str | bytes) -> None:
        """Write ``data`` to its stdin. Raises NotFound."""
        self._check()
        raw = data.encode() if isinstance(data, str) else bytes(data)
        encoded = shlex.quote(base64.b64encode(raw).decode())
        _run(self._sbx, f"printf %s {encoded} | base64 -d > {self._dir}/stdin")

    def kill(self) -> bool:
        """Kill it and what it started (its whole session); False if it had exited."""
        self._check()
        # the wrapper that would write the exit code dies too: write it (128 + SIGKILL)
        got = self._sbx.commands.run(
            f"[ -e {self._dir}/exit ] && exit 3; kill -s KILL -- -{self.pid} && "
            f"echo 137 > {self._dir}/exit",
            timeout=_QUICK,
        )
        return got.exit_code == 0

    def read_from(self, offset: int) -> str:
        """What it wrote to stdout from byte ``offset`` on (for following its output)."""
        got = self._sbx.commands.run(
            f"tail -c +{int(offset) + 1} {self._dir}/stdout", timeout=_QUICK
        )
        return got.stdout

    def forget(self) -> None:
        """Remove its files from the guest (kill it first if it should stop)."""
        self._sbx.commands.run(f'rm -rf "$(readlink -f {self._dir})" {self._dir}', timeout=_QUICK)
