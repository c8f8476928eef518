"""Writing an export's lines to a file whole or not at all (the library's and the SDK's
``export(path)``): this module imports nothing of the store, so the SDK can use it."""

from __future__ import annotations

import contextlib
import os
import stat
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import IO

from torpor.errors import InvalidArgument

__all__ = ["write_lines"]


def write_lines(lines: Iterable[str], dest: str | Path | IO[str]) -> int:
    """Write ``lines`` (an export's) to a text stream, or to a file at a path whole or not at
    all: a temporary file beside it (beside a link's target), renamed over it at the end with
    the old file's mode, so an export that fails half-way (a refused token, a server gone)
    leaves an existing file as it was; a path that is no regular file (a pipe) is written
    as it is. Returns the lines written. Raises :class:`InvalidArgument` (the path cannot be
    written) and what ``lines`` raises."""
    if not isinstance(dest, (str, Path)):
        return sum(1 for line in lines if dest.write(line + "\n"))
    path = Path(dest).resolve()  # a link's target is the file written, the link stays
    try:
        st: os.stat_result | None = path.stat()
    except OSError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):  # a pipe, /dev/stdout: written as is
        try:
            with open(path, "w", encoding="utf-8") as fh:
                return sum(1 for line in lines if fh.write(line + "\n"))
        except OSError as exc:
            raise InvalidArgument(f"cannot write {dest}: {exc}", exc=exc) from exc
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        try:
            # an existing file keeps its mode (a private backup stays private)
            mode = 0o666 if st is None else stat.S_IMODE(st.st_mode)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
            with open(fd, "w", encoding="utf-8") as fh:
                if st is not None:
                    os.fchmod(fd, mode)
                n = sum(1 for line in lines if fh.write(line + "\n"))
            os.replace(tmp, path)
        except OSError as exc:
            raise InvalidArgument(f"cannot write {dest}: {exc}", exc=exc) from exc
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    return n
