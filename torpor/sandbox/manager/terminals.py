"""Programs on terminals in a sandbox (``sbx.pty``, ``torpor sandbox shell``): the manager's side.

:meth:`SandboxManager.open_pty` wakes the sandbox, starts the program on a new pty in the guest (see
:mod:`torpor.sandbox.guest.terminal`) and returns a :class:`TerminalSession` once it runs; its
output goes to the caller's ``on_data`` as it comes. Input, resizes and kills name the session
by its id, which is checked against the sandbox and so against the caller's tenant.

A terminal does not count as a call in flight once it runs, so a pause does not wait for a
shell someone left open: the pause ends it (the guest kills the program when its host hangs
up), and the session's ``done`` task fails with GuestError. Typing keeps the sandbox's idle
clock going, as does output (at most every :data:`TOUCH_EVERY` seconds).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from torpor.errors import GuestError, InvalidArgument, NotFound, TorporError
from torpor.sandbox.registry import AnyRegistry
from torpor.sandbox.requests import PtySize, PtySpec


class _Manager(Protocol):
    """What the terminals use of the :class:`SandboxManager` that holds them."""

    @property
    def registry(self) -> AnyRegistry: ...


__all__ = ["TOUCH_EVERY", "TerminalSession", "Terminals"]

log = logging.getLogger(__name__)

#: seconds between two touches of the idle clock by a terminal's output
TOUCH_EVERY = 10.0


class _TerminalChannel(Protocol):
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
    ) -> tuple[int, asyncio.Task[int]]: ...

    async def pty_input(self, pty_id: str, data: bytes) -> None: ...

    async def pty_resize(self, pty_id: str, cols: int, rows: int) -> None: ...

    async def pty_kill(self, pty_id: str) -> None: ...


@dataclass
class TerminalSession:
    """One open terminal: its id, sandbox, program's pid, and a task ending with its exit
    code (cancel it to kill the program)."""

    id: str
    sandbox_id: str
    tenant: str
    pid: int
    done: asyncio.Task[int]
    channel: Any = field(repr=False)


class Terminals:
    """The open terminals of one manager (``manager.terminals``)."""

    def __init__(self, manager: _Manager) -> None:
        self.manager = manager
        self._open: dict[str, TerminalSession] = {}

    async def start(
        self,
        channel: Any,
        sandbox_id: str,
        tenant: str,
        spec: PtySpec,
        env: dict[str, str],
        on_data: Callable[[bytes], None] | None,
    ) -> TerminalSession:
        """Start ``spec`` on a new terminal over ``channel`` (the manager's
        :meth:`~torpor.sandbox.manager.SandboxManager.open_pty` holds the sandbox awake
        meanwhile). Raises InvalidArgument (an engine without terminals), PathNotFound,
        GuestError."""
        if not hasattr(channel, "pty_open"):
            raise InvalidArgument("this sandbox engine has no terminals")
        tch = cast(_TerminalChannel, channel)
        tid = "pty-" + secrets.token_hex(6)
        registry = self.manager.registry
        last_touch = [time.monotonic()]

        def output(chunk: bytes) -> None:
            now = time.monotonic()
            if now - last_touch[0] > TOUCH_EVERY:
                last_touch[0] = now
                with contextlib.suppress(TorporError):
                    registry.touch(sandbox_id)
            if on_data is not None:
                on_data(chunk)

        pid, done = await tch.pty_open(
            tid, spec.cmd, output, cols=spec.cols, rows=spec.rows, env=env, cwd=spec.cwd
        )
        session = TerminalSession(tid, sandbox_id, tenant, pid, done, tch)
        self._open[tid] = session
        done.add_done_callback(lambda _: self._open.pop(tid, None))
        log.info("terminal %s (pid %d) open in %s", tid, pid, sandbox_id)
        return session

    def get(self, id_or_name: str, pty_id: str, *, tenant: str = "default") -> TerminalSession:
        """The open terminal ``pty_id`` of the sandbox. Raises SandboxNotFound, NotFound (no
        such terminal open in it: another sandbox's or tenant's is not found either)."""
        rec = self.manager.registry.find(tenant, id_or_name)
        session = self._open.get(pty_id)
        if session is None or session.sandbox_id != rec.id or session.tenant != tenant:
            raise NotFound(
                f"no open terminal {pty_id!r} in sandbox {id_or_name!r}", kind="pty", name=pty_id
            )
        return session

    async def _call(self, session: TerminalSession, what: str, *args: Any) -> None:
        try:
            await getattr(session.channel, what)(session.id, *args)
        except GuestError as exc:  # the connection went with a pause: so did the terminal
            raise NotFound(
                f"terminal {session.id} has ended ({exc.message})", kind="pty", name=session.id
            ) from exc
        self.manager.registry.touch(session.sandbox_id)

    async def send_input(
        self, id_or_name: str, pty_id: str, data: bytes, *, tenant: str = "default"
    ) -> None:
        """Type ``data`` on the terminal. Raises NotFound, SandboxNotFound."""
        await self._call(self.get(id_or_name, pty_id, tenant=tenant), "pty_input", data)

    async def resize(
        self, id_or_name: str, pty_id: str, size: PtySize, *, tenant: str = "default"
    ) -> None:
        """Set the terminal's window size. Raises NotFound, SandboxNotFound."""
        session = self.get(id_or_name, pty_id, tenant=tenant)
        await self._call(session, "pty_resize", size.cols, size.rows)

    async def kill(self, id_or_name: str, pty_id: str, *, tenant: str = "default") -> int:
        """Kill the terminal's program (and what it started); its exit code. Raises NotFound,
        SandboxNotFound."""
        session = self.get(id_or_name, pty_id, tenant=tenant)
        await self._call(session, "pty_kill")
        try:
            return await asyncio.wait_for(asyncio.shield(session.done), 30)
        except (TimeoutError, TorporError):
            return 137
