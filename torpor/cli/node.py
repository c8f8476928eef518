"""``torpor nodes`` and ``torpor node drain``: the nodes of a cluster.

::

    torpor nodes [--json]                 every node: URL, health, accelerator, capacity, load
    torpor node drain NAME [--timeout S]  pause its sandboxes, make them durable, release them

Thin commands over the SDK (:meth:`torpor.Runtime.nodes`, :meth:`torpor.Runtime.drain_node`):
parse, one call, render. Both need an admin token. Without a cluster ``torpor nodes`` shows one
row, ``local``: this machine.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from torpor.client.runtime import default_runtime

__all__ = ["node_app", "register"]

console = Console()

node_app = typer.Typer(help="One node of a cluster: drain it.", no_args_is_help=True)


def nodes(
    as_json: Annotated[bool, typer.Option("--json", help="print the nodes as JSON")] = False,
) -> None:
    """The nodes of the cluster with their health and load (one row without a cluster).

    Example: torpor nodes --json
    """
    found = default_runtime().nodes()
    if as_json:
        sys.stdout.write(json.dumps([n.model_dump(mode="json") for n in found], indent=2) + "\n")
        return
    table = Table("node", "url", "health", "accel", "CPU", "capacity", "load")
    for n in found:
        age = "" if n.heartbeat_age_seconds is None else f" ({n.heartbeat_age_seconds:.1f} s)"
        health = ("alive" if n.alive else "stale") + age + (", draining" if n.draining else "")
        cells = (
            n.name + (" *" if n.this else ""),
            n.url or "-",
            health,
            n.accelerator,
            n.cpu_model,
            f"{n.capacity_mib / 1024:.1f} GiB, {n.vcpus} vCPUs",
            f"{n.sandboxes} sandboxes, {n.memory_mib} MiB",
        )
        table.add_row(*(Text(cell) for cell in cells))
    console.print(table)


@node_app.command("drain")
def drain(
    name: Annotated[str, typer.Argument(help="the node's name (torpor nodes)")],
    timeout: Annotated[
        float, typer.Option(help="seconds to wait for the pauses to be durable")
    ] = 300.0,
    as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
) -> None:
    """Stop a node taking sandboxes and move what it runs off it (pause, durable, release),
    so it can be taken down. A restart of the node makes it take sandboxes again.

    Example: torpor node drain n1
    """
    report = default_runtime().drain_node(name, timeout=timeout)
    if as_json:
        sys.stdout.write(report.model_dump_json(indent=2) + "\n")
    else:
        for s in report.moved:
            console.print(
                escape(f"moved {s.id} ({s.name}, tenant {s.tenant}): paused, durable {s.durable}")
            )
        for s in report.failed:
            why = f" [drive {', '.join(s.drives)}]" if s.drives else ""
            console.print(escape(f"kept {s.id} ({s.name}){why}: {s.error}"), style="red")
        moved, failed = len(report.moved), len(report.failed)
        console.print(escape(f"node {report.node} drained: {moved} moved, {failed} not"))
    if report.failed:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add ``nodes`` and the ``node`` group to the ``torpor`` command."""
    app.command("nodes")(nodes)
    app.add_typer(node_app, name="node")
