"""``torpor sandbox shell``'s local side: raw mode on a real terminal (a pty pair made here),
keys passed on, window sizes passed on, the terminal's settings restored on every way out.
The remote terminal is a stand-in (the layer below is tested on QEMU in test_pty.py)."""

from __future__ import annotations

import os
import signal
import termios
import threading
import time
from collections.abc import Iterator

import pytest

from torpor.cli.terminal import raw_session, terminal_size
from torpor.errors import GuestError


class FakeRemote:
    def __init__(self, fail_on: bytes | None = None) -> None:
        self.typed = bytearray()
        self.sizes: list[tuple[int, int]] = []
        self.killed = False
        self.fail_on = fail_on
        self._ended = threading.Event()
        self.seen_lflag: int | None = None

    @property
    def ended(self) -> bool:
        return self._ended.is_set()

    def send_stdin(self, data: str | bytes) -> None:
        raw = data.encode() if isinstance(data, str) else data
        if self.fail_on is not None and self.fail_on in raw:
            raise GuestError("the connection to the guest agent broke")
        self.typed += raw
        if b"\x04" in raw:  # Ctrl-D: the remote shell exits
            self._ended.set()

    def resize(self, cols: int, rows: int) -> None:
        self.sizes.append((cols, rows))

    def wait(self, timeout: float | None = None) -> int:
        return 7

    def kill(self) -> bool:
        self.killed = True
        self._ended.set()
        return True


@pytest.fixture
def tty_pair() -> Iterator[tuple[int, int]]:
    master, slave = os.openpty()
    yield master, slave
    os.close(master)
    os.close(slave)


def test_keys_go_through_raw_and_the_terminal_is_restored(tty_pair: tuple[int, int]) -> None:
    master, slave = tty_pair
    before = termios.tcgetattr(slave)
    assert before[3] & termios.ICANON  # cooked to begin with
    remote = FakeRemote()
    opened: list[tuple[int, int]] = []

    def open_remote(cols: int, rows: int) -> FakeRemote:
        opened.append((cols, rows))
        return remote

    def typist() -> None:
        time.sleep(0.3)
        remote.seen_lflag = termios.tcgetattr(slave)[3]
        os.write(master, b"ls\x03")  # Ctrl-C is a key like any other in raw mode
        time.sleep(0.3)
        os.write(master, b"\x04")

    t = threading.Thread(target=typist)
    t.start()
    code = raw_session(open_remote, stdin_fd=slave)
    t.join()
    assert code == 7
    assert opened == [terminal_size(slave)]
    assert bytes(remote.typed) == b"ls\x03\x04"
    assert remote.seen_lflag is not None and not remote.seen_lflag & termios.ICANON
    assert termios.tcgetattr(slave) == before


def test_window_size_changes_are_passed_on(tty_pair: tuple[int, int]) -> None:
    master, slave = tty_pair
    remote = FakeRemote()

    def resize_then_quit() -> None:
        time.sleep(0.3)
        import fcntl
        import struct

        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 132, 0, 0))
        os.kill(os.getpid(), signal.SIGWINCH)
        time.sleep(0.4)
        os.write(master, b"\x04")

    t = threading.Thread(target=resize_then_quit)
    t.start()
    raw_session(lambda c, r: remote, stdin_fd=slave)
    t.join()
    assert (132, 50) in remote.sizes


def test_an_error_restores_the_terminal_and_kills_the_remote(tty_pair: tuple[int, int]) -> None:
    master, slave = tty_pair
    before = termios.tcgetattr(slave)
    remote = FakeRemote(fail_on=b"boom")
    threading.Timer(0.3, lambda: os.write(master, b"boom")).start()
    with pytest.raises(GuestError):
        raw_session(lambda c, r: remote, stdin_fd=slave)
    assert termios.tcgetattr(slave) == before
    assert remote.killed
