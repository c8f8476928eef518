"""Writing an export's lines to a file whole or not at all (the library's and the SDK's
``export(path)``): this module imports nothing of the store, so the SDK can use it."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import IO

from torpor.errors import InvalidArgument

__all__ = ["write_lines"]


def write_lines(lines: Iterable[str], dest: str | Path | IO[str]) -> int:
    """Write ``lines`` (an export's) to a text stream, or to a file at a path whole or not at
    all: a temporary file beside it, renamed over it at the end, so an export that fails
    half-way (a refused token, a server gone) leaves an existing file as it was. Returns the
    lines written. Raises :class:`InvalidArgument` (the path cannot be written) and what
    ``lines`` raises."""
    if not isinstance(dest, (str, Path)):
        return sum(1 for line in lines if dest.write(line + "\n"))
    path = Path(dest)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        try:
            with open(tmp, "w", encoding="utf-8") as fh:
                n = sum(1 for line in lines if fh.write(line + "\n"))
            os.replace(tmp, path)
        except OSError as exc:
            raise InvalidArgument(f"cannot write {dest}: {exc}", exc=exc) from exc
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    return n
