"""The ``torpor`` command: thin commands over the library.

Each sub-module owns one group (``template``, ``sandbox``, ``memory`` ...) and registers a typer
app in :data:`GROUPS`; every command parses its arguments, makes one library call and renders.

:func:`main` first moves each option to the command that defines it (:mod:`torpor.cli.argv`:
``--json`` and group options work in any position), and turns every error into one line on
stderr and exit code 1: a :class:`~torpor.errors.TorporError` as ``error: Kind: message``,
anything unexpected likewise (``TORPOR_DEBUG=1`` shows its traceback).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Collection, Sequence
from typing import Annotated

import typer

from torpor._version import __version__
from torpor.errors import TorporError

app = typer.Typer(
    name="torpor",
    help="Memory for AI agents: sandboxes that hibernate with their RAM, and a knowledge store."
    "\n\n--json (print JSON) and -q (ids only) work anywhere on the line. TORPOR_URL and "
    "TORPOR_TOKEN pick a remote server; without them the local one is used (started on "
    "demand). Details: docs/cli.md",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"torpor {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", "-V", callback=_version, is_eager=True, help="print the version and exit"
        ),
    ] = False,
) -> None:
    """The root options (the help shown is the app's)."""


#: module -> how it plugs in: a sub-module defines either ``app`` (a group) or ``register(app)``.
GROUPS = [
    "torpor.cli.template",
    "torpor.cli.doctor",
    "torpor.cli.sandbox",
    "torpor.cli.serve",
    "torpor.cli.memory",
    "torpor.cli.storage",
    "torpor.cli.usage",
    "torpor.cli.token",
    "torpor.cli.mcp",
    "torpor.cli.node",
]


#: command -> the GROUPS modules that define it and its sub-commands (``usage`` adds
#: ``retention`` to the ``sandbox`` and ``snapshot`` groups); a test checks it against what the
#: modules register. :func:`main` loads only these for a command line that names one, so a
#: command does not pay for the imports of the others (``torpor serve`` skips the whole client).
COMMANDS: dict[str, tuple[str, ...]] = {
    "template": ("torpor.cli.template",),
    "doctor": ("torpor.cli.doctor",),
    "sandbox": ("torpor.cli.sandbox", "torpor.cli.usage"),
    "run": ("torpor.cli.sandbox",),
    "events": ("torpor.cli.sandbox",),
    "serve": ("torpor.cli.serve",),
    "server": ("torpor.cli.serve",),
    "memory": ("torpor.cli.memory",),
    "gc": ("torpor.cli.storage",),
    "storage": ("torpor.cli.storage",),
    "snapshot": ("torpor.cli.storage", "torpor.cli.usage"),
    "volume": ("torpor.cli.storage",),
    "drive": ("torpor.cli.storage",),
    "usage": ("torpor.cli.usage",),
    "token": ("torpor.cli.token",),
    "mcp": ("torpor.cli.mcp",),
    "nodes": ("torpor.cli.node",),
    "node": ("torpor.cli.node",),
}

_registered: set[str] = set()


def _load(modules: Collection[str] | None = None) -> None:
    """Register the groups of ``modules`` (default: all of :data:`GROUPS`) on :data:`app`,
    each once, in GROUPS order."""
    for name in GROUPS:
        if (modules is not None and name not in modules) or name in _registered:
            continue
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:  # a group not written yet
            if exc.name == name:
                continue
            raise
        module.register(app)
        _registered.add(name)


def _groups_for(args: Sequence[str]) -> set[str] | None:
    """The GROUPS modules a command line needs: those of every word on it that names a
    command (an argument may name one too; one group more is only a few imports more), or
    None (all of them) when no word does: the root help lists every group, and an unknown
    command gets click's own answer."""
    found = {module for arg in args for module in COMMANDS.get(arg, ())}
    return found or None


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``torpor`` console script (``args``: default ``sys.argv[1:]``)."""
    from torpor.cli.argv import normalize

    args = sys.argv[1:] if args is None else args
    _load(_groups_for(args))
    command = typer.main.get_command(app)
    try:
        argv = normalize(command, args)
        code = command.main(args=argv, prog_name="torpor", standalone_mode=False)
        if isinstance(code, int) and code:  # click returns a typer.Exit's code here
            sys.exit(code)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        typer.secho("aborted", err=True)
        sys.exit(130)
    except TorporError as exc:
        typer.secho(f"error: {type(exc).__name__}: {exc}", err=True, fg="red")
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as exc:
        if hasattr(exc, "show") and hasattr(exc, "exit_code"):  # click's usage errors
            exc.show()
            sys.exit(exc.exit_code)
        if os.environ.get("TORPOR_DEBUG"):
            raise
        typer.secho(
            f"error: {type(exc).__name__}: {exc} (TORPOR_DEBUG=1 shows the traceback)",
            err=True,
            fg="red",
        )
        sys.exit(1)


if __name__ == "__main__":
    main()
