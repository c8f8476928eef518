"""How the CLI prints data: a table for people, ``--json`` for programs, ``-q`` for ids.

Every command that prints data takes ``--json`` (the library's own model as JSON: one object,
or a list for a listing) and, where it lists or makes things, ``-q`` (one id per line). Both
may be given anywhere on the command line (see :mod:`torpor.cli.argv`).

Tables never cut an id: id columns keep their full width and the other columns wrap on a
narrow terminal; in a pipe or a file a table is as wide as its content (nothing wraps). A
cell is printed as written, never read as rich markup (``[/]`` in a label would end the
command, ``[x]`` would vanish); so is the data a command puts in a line of its own
(:func:`rich.markup.escape`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from typing import Annotated, Any

import typer
from pydantic import BaseModel
from rich.console import Console
from rich.table import Table
from rich.text import Text

__all__ = ["AsJson", "Quiet", "console", "emit", "human_bytes", "table", "to_json"]

console = Console()

#: the width tables get when printed to a pipe or a file (wide enough never to fold)
_PIPE_WIDTH = 1000

AsJson = Annotated[bool, typer.Option("--json", help="print JSON (see docs/cli.md)")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="print ids only, one a line")]


def to_json(data: Any) -> Any:
    """``data`` (models, lists of them, plain values) as JSON-ready values."""
    if isinstance(data, BaseModel):
        return data.model_dump(mode="json")
    if isinstance(data, dict):
        return {k: to_json(v) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [to_json(v) for v in data]
    return data


def table(
    columns: Sequence[str], rows: Iterable[Sequence[str]], *, ids: Sequence[str] = ()
) -> Table:
    """A table whose ``ids`` columns are never cut or wrapped (the others fold); a cell is
    plain text (no markup)."""
    rows = [list(r) for r in rows]
    out = Table(*[], show_header=bool(columns))
    for i, name in enumerate(columns):
        if name in ids:
            width = max([len(name)] + [len(r[i]) for r in rows])
            out.add_column(name, no_wrap=True, min_width=width)
        else:
            out.add_column(name, overflow="fold")
    for row in rows:
        out.add_row(*(Text(cell) for cell in row))
    return out


def emit(
    data: Any,
    *,
    as_json: bool = False,
    quiet: bool = False,
    ids: Callable[[Any], Iterable[str]] | None = None,
    render: Callable[[Any], Any] | None = None,
) -> None:
    """Print ``data``: JSON with ``as_json``; its ``ids`` one a line with ``quiet``; else what
    ``render`` makes of it (a rich renderable or a string)."""
    if as_json:
        typer.echo(json.dumps(to_json(data), indent=2, ensure_ascii=False))
    elif quiet and ids is not None:
        for item in ids(data):
            typer.echo(item)
    elif render is not None:
        shown = render(data)
        if isinstance(shown, str):
            typer.echo(shown)
        elif console.is_terminal:
            console.print(shown)
        else:  # a pipe: no terminal width to fit, so never fold a cell
            Console(width=_PIPE_WIDTH).print(shown)
    else:
        typer.echo(json.dumps(to_json(data), indent=2, ensure_ascii=False))


def human_bytes(n: int | None) -> str:
    """``1536`` -> ``"1.5 KiB"``; ``None`` -> ``""``."""
    if n is None:
        return ""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover - the loop always returns
