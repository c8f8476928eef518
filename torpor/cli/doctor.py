"""``torpor doctor``: what this host gives torpor (QEMU, acceleration, templates, home)."""

from __future__ import annotations

import shutil
import subprocess
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from torpor.config import paths
from torpor.sandbox import template as templates
from torpor.sandbox.vm import accel as accel_probe

__all__ = ["register"]

console = Console()


def _qemu_version() -> str:
    binary = shutil.which("qemu-system-x86_64")
    if binary is None:
        return "[red]qemu-system-x86_64 not found[/] (apt-get install qemu-system-x86)"
    try:
        out = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"[red]{escape(f'{binary} does not run: {exc}')}[/]"
    return escape(f"{out.splitlines()[0] if out else '?'} ({binary})")


def doctor(
    reprobe: Annotated[
        bool, typer.Option("--reprobe", help="test KVM again, ignoring the cached answer")
    ] = False,
    repair: Annotated[
        bool,
        typer.Option(
            "--repair",
            help="rebuild registry rows for sandbox directories that have none (run with the "
            "server stopped)",
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Show the QEMU version, the accelerator in use and why, templates and the home path;
    with --repair, give orphaned sandbox directories their registry rows back.

    Example:

        torpor doctor --reprobe
        torpor doctor --repair
    """
    if repair:
        _repair()
        return
    report = accel_probe.probe(force=reprobe)
    if as_json:
        from torpor.cli.output import emit

        emit(
            {
                "home": str(paths().home),
                "qemu": _qemu_version(),
                "accel": report.accel,
                "accel_reason": report.reason,
                "tools": {
                    tool: shutil.which(tool) for tool in ("debootstrap", "mkfs.ext4", "qemu-img")
                },
                "templates": [
                    {**t.to_json(), "stale": templates.stale_reason(t) is not None}
                    for t in templates.list_templates()
                ],
            },
            as_json=True,
        )
        return
    table = Table(show_header=False, box=None)
    table.add_row("home", escape(str(paths().home)))
    table.add_row("qemu", _qemu_version())
    table.add_row("accel", f"[bold]{escape(report.accel)}[/] ({escape(report.reason)})")
    for tool in ("debootstrap", "mkfs.ext4", "qemu-img"):
        found = shutil.which(tool)
        table.add_row(tool, escape(found) if found else "[red]missing[/]")
    built = templates.list_templates()
    rows = []
    for t in built:
        why = templates.stale_reason(t)
        stale = (
            ""
            if why is None
            else f" [yellow]{escape(f'stale: {why}; run `torpor template build {t.name}`')}[/]"
        )
        rows.append(escape(f"{t.name} ({t.build_id}, {t.accel})") + stale)
    table.add_row(
        "templates", "\n".join(rows) or "[yellow]none: run `torpor template build python`[/]"
    )
    console.print(table)


def _repair() -> None:
    from torpor.config import server_pid
    from torpor.sandbox.registry import Registry
    from torpor.sandbox.registry.repair import repair

    if server_pid() is not None:
        typer.secho("the server is running: stop it first (torpor serve stop)", err=True, fg="red")
        raise typer.Exit(1)
    p = paths()
    registry = Registry(p.registry)
    try:
        made = repair(p, registry)
    finally:
        registry.close()
    for rec in made:
        console.print(escape(f"rebuilt {rec.id}: {rec.state.value}"))
    console.print(f"{len(made)} sandbox row(s) rebuilt" if made else "nothing to repair")


def register(app: typer.Typer) -> None:
    """Add the ``doctor`` command to the ``torpor`` app."""
    app.command("doctor")(doctor)
