"""The local side of ``torpor sandbox shell``: this terminal, in raw mode, joined to a terminal
in the sandbox (:mod:`torpor.client.pty`).

Raw mode hands every key to the sandbox as typed (Ctrl-C included: it interrupts the program
there, not this CLI); the terminal's settings are put back however the session ends, an error
included. Window size changes (SIGWINCH) are passed on. When stdin is not a terminal the CLI
uses its line mode instead (see :func:`torpor.cli.sandbox.shell_session`).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import termios
import tty
from collections.abc import Callable
from types import FrameType
from typing import Any, Protocol

from torpor.errors import NotFound

__all__ = ["Remote", "raw_session"]


class Remote(Protocol):
    """What :func:`raw_session` uses of a :class:`torpor.client.pty.PtyHandle`."""

    @property
    def ended(self) -> bool: ...

    def send_stdin(self, data: str | bytes) -> None: ...

    def resize(self, cols: int, rows: int) -> None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> bool: ...


def terminal_size(fd: int) -> tuple[int, int]:
    """(cols, rows) of the terminal ``fd``, 80x24 if it has none."""
    try:
        size = os.get_terminal_size(fd)
        return size.columns or 80, size.lines or 24
    except OSError:
        return 80, 24


def raw_session(
    open_remote: Callable[[int, int], Remote], *, stdin_fd: int = 0, size_fd: int | None = None
) -> int:
    """Put the terminal ``stdin_fd`` in raw mode and pass its keys to the remote terminal that
    ``open_remote(cols, rows)`` starts (its output is the caller's to write, from
    ``on_data``) until the remote program ends; its exit code. The terminal's settings are
    restored on every way out. Raises what ``open_remote`` raises."""
    size_fd = stdin_fd if size_fd is None else size_fd
    remote = open_remote(*terminal_size(size_fd))
    resized = [False]

    def on_winch(signum: int, frame: FrameType | None) -> None:
        resized[0] = True

    saved = termios.tcgetattr(stdin_fd)
    old_handler: Any = signal.signal(signal.SIGWINCH, on_winch)
    try:
        tty.setraw(stdin_fd)
        while not remote.ended:
            if resized[0]:
                resized[0] = False
                with contextlib.suppress(NotFound):
                    remote.resize(*terminal_size(size_fd))
            try:
                ready, _, _ = select.select([stdin_fd], [], [], 0.1)
            except InterruptedError:  # a SIGWINCH
                continue
            if not ready:
                continue
            data = os.read(stdin_fd, 4096)
            if not data:  # our stdin closed: end the remote program too
                remote.kill()
                break
            try:
                remote.send_stdin(data)
            except NotFound:  # it ended between two keys
                break
        return remote.wait(30)
    finally:
        termios.tcsetattr(stdin_fd, termios.TCSADRAIN, saved)
        signal.signal(signal.SIGWINCH, old_handler)
        if not remote.ended:
            remote.kill()
