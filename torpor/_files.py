"""Opening a file in a directory that a less trusted process can write.

A sandbox's directory belongs to the unprivileged uid its QEMU runs as
(:mod:`torpor.sandbox.vm.jail`), and the server, as root, reads and writes files there: the
RAM file it compacts and rebuilds, the logs it tails and trims, ``machine.json``. A QEMU
that escaped its guest holds that uid and could put a symlink (to ``/etc/shadow``, to root's
``authorized_keys``) or a FIFO in place of such a file. :func:`open_regular` opens only the
regular file itself: never through a symlink in the last component (``O_NOFOLLOW``), never
blocking on a FIFO (``O_NONBLOCK``), and refusing anything that is not a regular file.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

__all__ = ["open_regular"]


def open_regular(path: Path, flags: int, mode: int = 0o600) -> int:
    """``os.open(path, flags, mode)`` of a regular file, not through a symlink, as a file
    descriptor. Raises OSError (``ELOOP`` for a symlink, ``EINVAL`` for a FIFO, a device or
    a directory)."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd
