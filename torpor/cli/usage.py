"""``torpor usage`` and the retention commands: what sandboxes cost, and how long pauses last.

::

    torpor usage --by label:user --since 2026-11-01 [--until ...] [--json | --csv]
    torpor sandbox retention agent-u-42 90      # keep its pause 90 days from when it paused
    torpor snapshot retention before-import 30  # keep the snapshot 30 days from when taken

Thin commands over the SDK (:meth:`torpor.Runtime.usage`, ``Sandbox.set_retention``,
``Snapshot.set_retention``): parse, one call, render.
"""

from __future__ import annotations

import csv
import sys
from typing import Annotated, TextIO

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from torpor.client import Sandbox, Snapshot
from torpor.client.runtime import default_runtime
from torpor.sandbox.registry.usage import UsageLine, UsageReport

__all__ = ["register", "write_csv"]

console = Console()

#: the columns of ``--csv``, one row per group and a last row ``total``
CSV_COLUMNS = [
    "key",
    "name",
    "sandboxes",
    "snapshots",
    "volumes",
    "vcpu_hours",
    "cpu_hours",
    "ram_gib_hours",
    "paused_gb_months",
    "snapshot_gb_months",
    "volume_gib_hours",
    "cost_cpu",
    "cost_memory",
    "cost_paused",
    "cost_snapshots",
    "cost_volumes",
    "cost_total",
]


def _csv_row(line: UsageLine, key: str) -> list[str]:
    c = line.cost
    return [
        key,
        line.name or "",
        str(line.sandboxes),
        str(line.snapshots),
        str(line.volumes),
        *(
            repr(float(v))  # full precision: a spreadsheet rounds, a script should not have to
            for v in (
                line.vcpu_hours,
                line.cpu_hours,
                line.ram_gib_hours,
                line.paused_gb_months,
                line.snapshot_gb_months,
                line.volume_gib_hours,
                c.cpu,
                c.memory,
                c.paused,
                c.snapshots,
                c.volumes,
                c.total,
            )
        ),
    ]


def write_csv(report: UsageReport, out: TextIO) -> None:
    """Write ``report`` as CSV (:data:`CSV_COLUMNS`) to ``out``: one row per group (an empty
    key for things without the grouping label), then ``total``."""
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for line in report.lines:
        writer.writerow(_csv_row(line, line.key or ""))
    writer.writerow(_csv_row(report.total, "total"))


def _money(value: float, currency: str) -> str:
    return f"{value:,.2f} {currency}"


def _render(report: UsageReport) -> None:
    cur = report.rates.currency
    title = (
        f"usage by {report.by}, {report.since:%Y-%m-%d %H:%M} to {report.until:%Y-%m-%d %H:%M} UTC"
        f" (CPU billed on {report.rates.cpu_basis} vCPU-hours)"
    )
    table = Table(
        report.by,
        "sandboxes",
        "vCPU-h used / alloc.",
        "RAM GiB-h",
        "paused GB-mo",
        "snap. GB-mo",
        "volume GiB-h",
        "cost",
        title=escape(title),
    )
    for line in [*report.lines, report.total]:
        key = "TOTAL" if line is report.total else (line.key or "-")
        if line.name and line.name != key:
            key = f"{key} ({line.name})"
        table.add_row(
            Text(key),
            str(line.sandboxes),
            f"{line.cpu_hours:,.2f} / {line.vcpu_hours:,.2f}",
            f"{line.ram_gib_hours:,.2f}",
            f"{line.paused_gb_months:,.4f}",
            f"{line.snapshot_gb_months:,.4f}",
            f"{line.volume_gib_hours:,.2f}",
            _money(line.cost.total, cur),
            end_section=line is report.lines[-1] if report.lines else False,
        )
    console.print(table)
    c = report.total.cost
    console.print(
        f"CPU {_money(c.cpu, cur)} + memory {_money(c.memory, cur)} + paused "
        f"{_money(c.paused, cur)} + snapshots {_money(c.snapshots, cur)} + volumes "
        f"{_money(c.volumes, cur)} = {_money(c.total, cur)}"
    )
    if report.retention:
        kept = Table(
            "kind",
            "name",
            "GB",
            "kept (days)",
            "expires",
            "per day",
            "until expiry",
            title="what each retention still costs",
        )
        for item in report.retention:
            kept.add_row(
                Text(item.kind),
                Text(item.name),
                f"{item.bytes / 1e9:,.3f}",
                str(item.retention_days),
                f"{item.expires_at:%Y-%m-%d %H:%M}",
                _money(item.cost_per_day, cur),
                _money(item.projected_cost, cur),
            )
        console.print(kept)


def usage(
    by: Annotated[
        str, typer.Option(help="group by: tenant, sandbox or label:KEY (e.g. label:user)")
    ] = "tenant",
    since: Annotated[
        str | None, typer.Option(help="start, ISO 8601 (default: the 1st of this month, UTC)")
    ] = None,
    until: Annotated[str | None, typer.Option(help="end, ISO 8601 (default: now)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
    as_csv: Annotated[bool, typer.Option("--csv", help="print the report as CSV")] = False,
) -> None:
    """What your sandboxes, snapshots and volumes used, and what it costs.

    Example: torpor usage --by label:user --since 2026-11-01
    """
    if as_json and as_csv:
        raise typer.BadParameter("--json and --csv: choose one")
    report = default_runtime().usage(by=by, since=since, until=until)
    if as_json:
        sys.stdout.write(report.model_dump_json(indent=2) + "\n")
    elif as_csv:
        write_csv(report, sys.stdout)
    else:
        _render(report)


def sandbox_retention(
    name: Annotated[str, typer.Argument(help="sandbox id or name")],
    days: Annotated[int, typer.Argument(help="keep its pause N days (1-365) from when paused")],
) -> None:
    """Change how long a sandbox's pause is kept before GC deletes it.

    Example: torpor sandbox retention agent-u-42 90
    """
    info = Sandbox.get(name).set_retention(days)
    when = "its next pause" if info.expires_at is None else f"{info.expires_at:%Y-%m-%d %H:%M} UTC"
    console.print(
        escape(f"{info.id} ({info.name}): pause kept {days} days; deleted at {when} unless woken")
    )


def snapshot_retention(
    snapshot: Annotated[str, typer.Argument(help="snapshot id or name")],
    days: Annotated[int, typer.Argument(help="keep it N days (1-365) from when it was taken")],
) -> None:
    """Change how long a snapshot is kept before GC deletes it.

    Example: torpor snapshot retention before-import 30
    """
    info = Snapshot.get(snapshot).set_retention(days)
    console.print(
        escape(
            f"{info.id} ({info.name}): kept {days} days; "
            f"expires {info.expires_at:%Y-%m-%d %H:%M} UTC"
        )
    )


def register(app: typer.Typer) -> None:
    """Add ``usage`` to the ``torpor`` command, and ``retention`` to its ``sandbox`` and
    ``snapshot`` groups (registered before this module in :data:`torpor.cli.GROUPS`)."""
    from torpor.cli.sandbox import sandbox_app
    from torpor.cli.storage import snapshot_app

    app.command("usage")(usage)
    sandbox_app.command("retention")(sandbox_retention)
    snapshot_app.command("retention")(snapshot_retention)
