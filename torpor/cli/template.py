"""``torpor template build|ls|rm``: guest templates from the shell.

Each command makes one :mod:`torpor.sandbox.template` call and renders its answer (``rm``
first looks for what rests on the template).
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from torpor.cli.output import AsJson, Quiet, emit
from torpor.errors import Conflict
from torpor.sandbox import template as templates

__all__ = ["register"]

console = Console()

template_app = typer.Typer(
    help="Build, list and remove guest templates (the images sandboxes are cloned from).",
    no_args_is_help=True,
)


@template_app.command("build")
def build(
    name: Annotated[str, typer.Argument(help="template name")] = "python",
    apt: Annotated[
        list[str] | None, typer.Option("--apt", help="extra Debian package, repeatable")
    ] = None,
    pip: Annotated[
        list[str] | None, typer.Option("--pip", help="extra PyPI package, repeatable")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="rebuild every layer")] = False,
) -> None:
    """Build a template: a Debian rootfs with Python and the torpor agent, booted once.

    Cached: a second run with the same packages returns at once, and a change to the
    guest agent only remakes the disk image and the booted snapshot.

    Example:

        torpor template build data --apt git --pip numpy --pip pandas
    """
    with Progress(
        SpinnerColumn(),
        TextColumn("[bold]{task.fields[step]:>10}[/] {task.description}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as bar:
        task = bar.add_task("starting", step="build")

        def progress(step: str, detail: str) -> None:
            bar.update(task, description=escape(detail), step=escape(step))
            bar.console.log(Text(f"{step}: {detail}"))

        # no --apt/--pip: the template's own recipe (a rebuild keeps what it was built with)
        info = templates.build(name, apt=apt, pip=pip, force=force, progress=progress)
        bar.update(task, description=escape(f"ready ({info.build_id})"), step="done")
    console.print(
        f"template [bold]{escape(info.name)}[/] ready: accel {escape(info.accel)}, "
        f"{info.memory_mib} MiB, snapshot {escape(str(info.snapshot_dir))}"
    )


@template_app.command("ls")
def ls(as_json: AsJson = False, quiet: Quiet = False) -> None:
    """List built templates.

    Example:

        torpor template ls
    """
    found = templates.list_templates()
    if as_json or quiet:
        emit(
            [t.to_json() for t in found],
            as_json=as_json,
            quiet=quiet,
            ids=lambda xs: [x["name"] for x in xs],
        )
        return
    table = Table("name", "build", "accel", "memory", "apt", "pip", "created")
    for info in found:
        table.add_row(
            *(
                Text(cell)
                for cell in (
                    info.name,
                    info.build_id,
                    info.accel,
                    f"{info.memory_mib} MiB",
                    " ".join(info.apt),
                    " ".join(info.pip),
                    info.created_at,
                )
            )
        )
    console.print(table)


def _users(name: str) -> list[str]:
    """What rests on template ``name`` in this home: the sandboxes and frozen snapshot dirs
    whose disks are overlays on one of its builds, and the snapshots taken on it."""
    from torpor.config import paths
    from torpor.sandbox.storage.backing import resting_on
    from torpor.sandbox.storage.snapshots import SnapshotStore

    home = paths()
    disks = resting_on(home.templates / name, [home.sandboxes, home.snapshots])
    users = [str(d.parent.relative_to(home.home)) for d in disks]
    users += [
        f"snapshot {info.id} ({info.name}, tenant {info.tenant})"
        for info, _ in SnapshotStore(home).manifests()
        if info.template == name
    ]
    return users


@template_app.command("rm")
def rm(
    name: Annotated[str, typer.Argument(help="template name")],
    force: Annotated[
        bool,
        typer.Option("--force", help="remove it even though sandboxes or snapshots rest on it"),
    ] = False,
) -> None:
    """Remove a template and all its builds. Refused while sandboxes or snapshots of this
    home rest on it (their disks are overlays on its builds: they would stop working),
    unless --force.

    Example:

        torpor template rm data
    """
    users = [] if force else _users(name)
    if users:
        shown = ", ".join(users[:5]) + (f" and {len(users) - 5} more" if len(users) > 5 else "")
        raise Conflict(
            f"template {name!r} is in use by {shown}: kill or delete them first, or pass "
            "--force (they stop working)",
            kind="template",
            name=name,
            users=len(users),
        )
    templates.remove(name)
    console.print(f"removed template [bold]{escape(name)}[/]")


def register(app: typer.Typer) -> None:
    """Add the ``template`` group to the ``torpor`` app."""
    app.add_typer(template_app, name="template")
