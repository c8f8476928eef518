"""The end of a log file, bounded and safe to quote in an error message.

A guest writes its serial console; QEMU and the server write their logs. An error message
quotes the last lines of one of them, so what is read is bounded (the last 16 KiB, whatever the
file's size: a console can grow by gigabytes) and what is quoted is sanitized (control and
escape characters a guest may print become ``?``; tabs and newlines stay).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from torpor._files import open_regular

__all__ = ["LOG_LIMIT", "log_tail", "trim_log"]

#: how much of the end of a file is read (a bounded read of a file of any size)
TAIL_BYTES = 16 * 1024
#: a log past this size is cut down to its last LOG_KEEP bytes (see :func:`trim_log`)
LOG_LIMIT = 8 * 1024 * 1024
LOG_KEEP = 256 * 1024
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def log_tail(path: Path, lines: int = 30, *, max_bytes: int = TAIL_BYTES) -> str:
    """The last ``lines`` lines of ``path`` within its last ``max_bytes`` bytes, control
    characters replaced; empty when the file cannot be read."""
    try:
        with os.fdopen(open_regular(path, os.O_RDONLY), "rb") as f:  # not through a link
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - max_bytes))
            data = f.read(max_bytes)
    except OSError:
        return ""
    text = data.decode("utf-8", errors="replace")
    if len(data) == max_bytes and size > max_bytes:
        text = text.split("\n", 1)[-1]  # drop the partial first line
    return "\n".join(_CONTROL.sub("?", line) for line in text.splitlines()[-lines:])


def trim_log(path: Path, *, limit: int = LOG_LIMIT, keep: int = LOG_KEEP) -> bool:
    """Cut ``path`` down to its last ``keep`` bytes once it is over ``limit``; True if it was.

    Safe while a writer appends to it (QEMU opens its console file ``append=on``, O_APPEND:
    after the cut its next write lands at the new end). A line written during the cut may be
    lost; the file's size stays bounded whatever a guest prints. Raises OSError."""
    try:
        if os.lstat(path).st_size <= limit:
            return False
    except FileNotFoundError:
        return False
    with os.fdopen(open_regular(path, os.O_RDWR), "r+b") as f:  # not through a link
        size = f.seek(0, os.SEEK_END)
        f.seek(max(0, size - keep))
        tail = f.read(keep)
        f.seek(0)
        f.write(tail)
        f.truncate(len(tail))
    return True
