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

__all__ = ["ExportFile", "write_lines"]


class ExportFile:
    """The file an export at a path writes, whole or not at all: a temporary file beside it
    (beside a link's target: the link stays), renamed over it by :meth:`commit` with the old
    file's mode (a private backup stays private), so an export that fails half-way (a refused
    token, a server gone) leaves an existing file as it was. A path that is no regular file
    (a pipe, ``/dev/stdout``) is written as it is. Every method raises
    :class:`InvalidArgument` when the file cannot be written."""

    def __init__(self, dest: str | Path) -> None:
        self.dest = dest
        self.path = Path(dest).resolve()
        try:
            self._st: os.stat_result | None = self.path.stat()
        except OSError:
            self._st = None
        direct = self._st is not None and not stat.S_ISREG(self._st.st_mode)
        self._tmp = (
            None
            if direct
            else self.path.with_name(f".{self.path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        )
        self._fh: IO[str] | None = None

    def failure(self, exc: OSError) -> InvalidArgument:
        """The error of ``exc`` while writing this file."""
        return InvalidArgument(f"cannot write {self.dest}: {exc}", exc=exc)

    def open(self) -> IO[str]:
        """The text stream to write the lines to."""
        try:
            if self._tmp is None:
                self._fh = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 - closed in commit
                return self._fh
            mode = 0o666 if self._st is None else stat.S_IMODE(self._st.st_mode)
            fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
            if self._st is not None:
                os.fchmod(fd, mode)  # not narrowed by the umask: the old file's own
            self._fh = open(fd, "w", encoding="utf-8")  # noqa: SIM115 - closed in commit
            return self._fh
        except OSError as exc:
            self.discard()
            raise self.failure(exc) from exc

    def commit(self) -> None:
        """Close the stream and put the file in place."""
        try:
            if self._fh is not None:
                self._fh.close()
            if self._tmp is not None:
                os.replace(self._tmp, self.path)
        except OSError as exc:
            self.discard()
            raise self.failure(exc) from exc

    def discard(self) -> None:
        """Close the stream and remove the temporary file (the old file stays as it was)."""
        with contextlib.suppress(OSError):
            if self._fh is not None:
                self._fh.close()
        if self._tmp is not None:
            with contextlib.suppress(OSError):
                self._tmp.unlink()


def write_lines(lines: Iterable[str], dest: str | Path | IO[str]) -> int:
    """Write ``lines`` (an export's) to a text stream, or to the file at a path whole or not
    at all (:class:`ExportFile`). Returns the lines written. Raises :class:`InvalidArgument`
    (the path cannot be written) and what ``lines`` raises."""
    if not isinstance(dest, (str, Path)):
        return sum(1 for line in lines if dest.write(line + "\n"))
    target = ExportFile(dest)
    fh = target.open()
    try:
        n = sum(1 for line in lines if fh.write(line + "\n"))
    except OSError as exc:
        target.discard()
        raise target.failure(exc) from exc
    except BaseException:
        target.discard()
        raise
    target.commit()
    return n
