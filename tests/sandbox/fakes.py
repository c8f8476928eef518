"""An in-memory engine for fast unit tests of the manager's state logic (no QEMU).

It keeps the contract of the real engine where the manager depends on it: a sandbox directory
holds ``ram`` (here: the interpreter's variables as JSON) and, while hibernated, a whole
``state`` file; wake loads both and deletes ``state`` before the guest runs; files written in
the guest live in ``<dir>/disk/`` and survive a lost RAM. "QEMU processes" live in a
:class:`FakeWorld` shared between engines, so a second manager on the same home can find the
machines the first one left running (a manager restart). ``faults`` injects crashes at the same
points the real crash tests hit with SIGKILL.
"""

from __future__ import annotations

import ast
import asyncio
import itertools
import json
import os
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torpor.config import check_name
from torpor.errors import (
    EngineError,
    GuestError,
    NotFound,
    OperationTimeout,
    PathNotFound,
    TemplateNotFound,
)
from torpor.sandbox.engine import DirStatus, MachineConfig
from torpor.sandbox.models import CommandResult, EntryInfo, Execution, Result
from torpor.sandbox.requests import CodeSpec, CommandSpec

_pids = itertools.count(90000)


@dataclass
class FakeProcess:
    """A running fake QEMU: its pid and the guest's live RAM (interpreter variables)."""

    pid: int
    ram: dict[str, Any]
    refreshes: list[tuple[bytes | None, float | None]] = field(default_factory=list)


@dataclass
class FakeWorld:
    """Process table shared by engines: directory -> running fake QEMU."""

    processes: dict[Path, FakeProcess] = field(default_factory=dict)
    trimmed: list[Path] = field(default_factory=list)  # directories whose logs were trimmed


class FakeEngine:
    """The :class:`~torpor.sandbox.engine.Engine` protocol without VMs.

    ``faults`` maps a point to the number of times it fires:
    ``wake`` (QEMU dies before ``cont``: state kept), ``wake:after-cont`` (dies after the state
    was consumed), ``hibernate:before-save`` (dies before the state is written),
    ``hibernate:after-save`` (dies after the state is whole, before quitting cleanly),
    ``hibernate:refused`` (the save fails, QEMU and the guest keep running),
    ``connect`` (the guest does not answer), ``clone``.
    """

    def __init__(self, world: FakeWorld | None = None, templates: tuple[str, ...] = ("python",)):
        self.world = world or FakeWorld()
        self.templates = set(templates)
        self.faults: dict[str, int] = {}
        self.calls: list[str] = []

    def _fault(self, point: str) -> bool:
        left = self.faults.get(point, 0)
        if left:
            self.faults[point] = left - 1
            return True
        return False

    def check_template(self, template: str, config: MachineConfig | None = None) -> None:
        check_name(template, "template name")
        if template not in self.templates:
            raise TemplateNotFound(f"no template {template!r}", kind="template", name=template)

    async def clone(self, template: str, directory: Path, config: MachineConfig) -> None:
        self.calls.append("clone")
        if self._fault("clone"):
            raise EngineError("clone failed (injected)")
        (directory / "disk").mkdir(parents=True)
        (directory / "ram").write_text(json.dumps({"template": template}))
        (directory / "state").write_text("booted template")
        (directory / "machine.json").write_text('{"devices": []}')  # what a restore reads

    def machine(self, directory: Path, config: MachineConfig) -> FakeMachine:
        return FakeMachine(self, directory)

    async def connect(
        self, machine: Any, directory: Path, *, reseed: bool = True, cold: bool = False
    ) -> FakeChannel:
        self.calls.append("connect")
        if self._fault("connect") or directory not in self.world.processes:
            raise GuestError("the guest agent does not answer (injected)")
        channel = FakeChannel(self, directory)
        if not reseed:  # the clock only, in the first ping
            self.world.processes[directory].refreshes.append((None, time.time()))
        return channel

    def inspect(self, directory: Path) -> DirStatus:
        proc = self.world.processes.get(directory)
        return DirStatus(
            exists=directory.is_dir(),
            has_state=(directory / "state").is_file() and (directory / "ram").is_file(),
            qemu_pid=proc.pid if proc else None,
        )

    async def attach(self, directory: Path, config: MachineConfig) -> FakeMachine:
        self.calls.append("attach")
        if directory not in self.world.processes:
            raise EngineError("no QEMU to attach to")
        return FakeMachine(self, directory)

    def terminate(self, directory: Path) -> None:
        self.world.processes.pop(directory, None)

    def trim_logs(self, directory: Path) -> None:
        self.world.trimmed.append(directory)

    def crash(self, directory: Path) -> None:
        """SIGKILL the fake QEMU of ``directory``: RAM gone, files kept."""
        self.world.processes.pop(directory, None)


class DiskEngine(FakeEngine):
    """A fake engine whose machines also have a real (empty) qcow2 ``disk.qcow2``: what a
    snapshot, fork or restore freezes and clones (``qemu-img`` only, no VM)."""

    async def clone(self, template: str, directory: Path, config: MachineConfig) -> None:
        await super().clone(template, directory, config)
        disk = directory / "disk.qcow2"
        args = ["qemu-img", "create", "-q", "-f", "qcow2", str(disk), "32M"]
        await asyncio.to_thread(subprocess.run, args, check=True)


class FakeMachine:
    """A fake QEMU on one directory."""

    def __init__(self, engine: FakeEngine, directory: Path) -> None:
        self.engine = engine
        self.directory = directory

    async def wake(self, *, ram_ready: Awaitable[object] | None = None) -> None:
        self.engine.calls.append("wake")
        await asyncio.sleep(0)
        if ram_ready is not None:  # the RAM file is being rebuilt: wait before reading it
            await ram_ready
        state, ram = self.directory / "state", self.directory / "ram"
        if not state.is_file():
            raise EngineError(f"no saved state in {self.directory}")
        if self.engine._fault("wake"):
            raise EngineError("QEMU died while loading the state (injected)")
        values = json.loads(ram.read_text())
        state.unlink()  # consumed before the guest runs, as the real engine does
        if self.engine._fault("wake:after-cont"):
            raise EngineError("QEMU died right after cont (injected)")
        self.engine.world.processes[self.directory] = FakeProcess(next(_pids), values)

    async def hibernate(self, *, ready: Awaitable[object] | None = None) -> None:
        self.engine.calls.append("hibernate")
        await asyncio.sleep(0)
        proc = self.engine.world.processes.get(self.directory)
        if proc is None:
            raise EngineError("QEMU is not running")
        if ready is not None:
            await ready
        if self.engine._fault("hibernate:refused"):  # e.g. a migration error: guest resumed
            raise EngineError("saving the device state failed (injected)")
        if self.engine._fault("hibernate:before-save"):
            self.engine.crash(self.directory)
            raise EngineError("QEMU died before the state was saved (injected)")
        (self.directory / "ram").write_text(json.dumps(proc.ram))
        tmp = self.directory / "state.tmp"
        tmp.write_text("device state")
        os.replace(tmp, self.directory / "state")
        self.engine.crash(self.directory)
        if self.engine._fault("hibernate:after-save"):
            raise EngineError("QEMU died after the state was saved (injected)")

    async def kill(self) -> None:
        self.engine.crash(self.directory)

    async def release(self) -> None:
        return None

    def is_running(self) -> bool:
        return self.directory in self.engine.world.processes


class FakeChannel:
    """A fake guest agent: ``echo``/``sleep``/``exit N`` commands, files under ``disk/``,
    an interpreter whose variables live in the fake RAM."""

    def __init__(self, engine: FakeEngine, directory: Path) -> None:
        self.engine = engine
        self.directory = directory
        self.closed = False
        self._closing = asyncio.Event()  # close() fails in-flight calls, as the real one does
        #: open terminals: id -> (their on_data, the future of their exit code)
        self.terminals: dict[str, tuple[Callable[[bytes], None], asyncio.Future[int]]] = {}

    def _proc(self) -> FakeProcess:
        proc = self.engine.world.processes.get(self.directory)
        if self.closed or proc is None:
            raise GuestError("the channel to the guest is closed")
        return proc

    def _path(self, path: str) -> Path:
        return self.directory / "disk" / path.lstrip("/")

    async def run_command(
        self, command: CommandSpec, /, *, on_stdout: Any = None, on_stderr: Any = None
    ) -> CommandResult:
        self._proc()
        word, _, rest = command.cmd.partition(" ")
        if word == "sleep":
            wanted = float(rest)
            limit = wanted if command.timeout is None else min(wanted, command.timeout)
            try:
                await asyncio.wait_for(self._closing.wait(), limit)
            except TimeoutError:
                if limit < wanted:  # as the guest: killed at the timeout
                    raise OperationTimeout(
                        f"command timed out after {command.timeout} s", timeout=command.timeout
                    ) from None
        self._proc()  # the machine may have died meanwhile
        if word == "echo":
            return CommandResult(exit_code=0, stdout=rest + "\n")
        if word == "printenv":  # the environment the command got
            out = (command.env or {}).get(rest, "") + "\n"
            if on_stdout is not None:  # streamed, as the guest does
                on_stdout(out)
            return CommandResult(exit_code=0, stdout=out)
        if word == "exit":
            return CommandResult(exit_code=int(rest))
        return CommandResult(exit_code=0)

    async def read_file(self, path: str) -> bytes:
        self._proc()
        try:
            return self._path(path).read_bytes()
        except FileNotFoundError:
            raise PathNotFound(f"no such file: {path}", kind="path", name=path) from None

    async def write_file(self, path: str, data: bytes | str) -> None:
        self._proc()
        target = self._path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data.encode() if isinstance(data, str) else data)

    async def list_dir(self, path: str) -> list[EntryInfo]:
        self._proc()
        base = self._path(path)
        if not base.is_dir():
            raise PathNotFound(f"no such directory: {path}", kind="path", name=path)
        return [
            EntryInfo(
                name=p.name,
                path=f"{path.rstrip('/')}/{p.name}",
                type="dir" if p.is_dir() else "file",
                size=p.stat().st_size,
            )
            for p in sorted(base.iterdir())
        ]

    async def exists(self, path: str) -> bool:
        self._proc()
        return self._path(path).exists()

    async def remove(self, path: str) -> None:
        self._proc()
        target = self._path(path)
        if not target.exists():
            raise PathNotFound(f"no such path: {path}", kind="path", name=path)
        target.unlink()

    async def make_dir(self, path: str) -> None:
        self._proc()
        self._path(path).mkdir(parents=True, exist_ok=True)

    async def run_code(
        self, code: CodeSpec, /, *, on_stdout: Any = None, on_stderr: Any = None
    ) -> Execution:
        ns = self._proc().ram
        tree = ast.parse(code.code)
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        assert last is None or isinstance(last, ast.Expr)
        exec(compile(tree, "<cell>", "exec"), {}, ns)
        if last is None:
            return Execution()
        value = eval(compile(ast.Expression(last.value), "<cell>", "eval"), {}, ns)
        return Execution(results=[Result(data={"text/plain": repr(value)})])

    async def refresh(
        self, *, entropy: bytes | None = None, unix_time: float | None = None
    ) -> None:
        self._proc().refreshes.append((entropy, unix_time))

    async def sync(self) -> None:
        self._proc()

    async def pty_open(
        self,
        pty_id: str,
        cmd: str,
        on_data: Callable[[bytes], None],
        *,
        cols: int = 80,
        rows: int = 24,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
    ) -> tuple[int, asyncio.Task[int]]:
        """A terminal that echoes what is typed on it until it is killed (exit 137) or the
        channel closes (GuestError)."""
        self._proc()
        ended: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.terminals[pty_id] = (on_data, ended)

        async def done() -> int:
            try:
                closing: asyncio.Future[Any] = asyncio.ensure_future(self._closing.wait())
                await asyncio.wait({ended, closing}, return_when=asyncio.FIRST_COMPLETED)
                closing.cancel()
                if not ended.done():
                    raise GuestError("the channel to the guest is closed")
                return ended.result()
            finally:
                self.terminals.pop(pty_id, None)

        return next(_pids), asyncio.ensure_future(done())

    def _terminal(self, pty_id: str) -> tuple[Callable[[bytes], None], asyncio.Future[int]]:
        self._proc()
        found = self.terminals.get(pty_id)
        if found is None:
            raise NotFound(f"no open terminal {pty_id!r}", kind="pty", name=pty_id)
        return found

    async def pty_input(self, pty_id: str, data: bytes) -> None:
        self._terminal(pty_id)[0](data)

    async def pty_resize(self, pty_id: str, cols: int, rows: int) -> None:
        self._terminal(pty_id)

    async def pty_kill(self, pty_id: str) -> None:
        ended = self._terminal(pty_id)[1]
        if not ended.done():
            ended.set_result(137)

    async def close(self) -> None:
        self.closed = True
        self._closing.set()
