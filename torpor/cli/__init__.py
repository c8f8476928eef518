"""The ``torpor`` command: thin commands over the library.

Each sub-module owns one group (``template``, ``sandbox``, ``memory`` ...) and registers a typer
app in :data:`GROUPS`; every command parses its arguments, makes one library call and renders.
"""

from __future__ import annotations

import importlib
import sys

import typer

from torpor.errors import TorporError

app = typer.Typer(
    name="torpor",
    help="Memory for AI agents: sandboxes that hibernate with their RAM, and a knowledge store.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)

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
]


def _load() -> None:
    for name in GROUPS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:  # a group not written yet
            if exc.name == name:
                continue
            raise
        module.register(app)


def main() -> None:
    """Entry point of the ``torpor`` console script."""
    _load()
    try:
        app()
    except TorporError as exc:
        typer.secho(f"error: {type(exc).__name__}: {exc}", err=True, fg="red")
        sys.exit(1)


if __name__ == "__main__":
    main()
