"""Stored things: ``torpor snapshot``, ``torpor volume``, ``torpor drive``, ``torpor gc``.

Thin commands over the SDK (:mod:`torpor.client.checkpoints`): parse, one call, render.
``torpor gc --local`` runs the collector on the home directly (no server), for a host where the
server is stopped.
"""

from __future__ import annotations

import contextlib
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from torpor.cli.output import AsJson, Quiet, emit, table
from torpor.client import Drive, Sandbox, Snapshot, Volume
from torpor.client.storage import collect_garbage
from torpor.sandbox.models import parse_labels

__all__ = ["register"]

console = Console()

snapshot_app = typer.Typer(
    help="Snapshots: immutable copies of a whole sandbox (RAM + disk).", no_args_is_help=True
)
volume_app = typer.Typer(help="Volumes: disks that outlive sandboxes.", no_args_is_help=True)
drive_app = typer.Typer(
    help="Drives: host directories shared into many sandboxes.", no_args_is_help=True
)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _table(columns: list[str], rows: list[list[str]]) -> None:
    emit(rows, render=lambda r: table(columns, r, ids=[c for c in columns if c in ("id", "name")]))


def _quiet() -> contextlib.AbstractContextManager[None]:
    """No progress display (for --json and -q: output a program reads)."""
    return contextlib.nullcontext()


# -- snapshots -------------------------------------------------------------------------------


@snapshot_app.command("create")
def snapshot_create(
    sandbox: Annotated[str, typer.Argument(help="sandbox id or name")],
    name: Annotated[str | None, typer.Option(help="snapshot name (unique)")] = None,
    retention_days: Annotated[int, typer.Option(help="keep for N days (1-365)")] = 7,
    as_json: AsJson = False,
    quiet: Quiet = False,
) -> None:
    """Snapshot a running or paused sandbox; it keeps running (or stays paused).

    Example: torpor snapshot create agent-u-42 --name before-import --retention-days 30
    """
    with console.status("capturing RAM and disk ...") if not (as_json or quiet) else _quiet():
        snap = Sandbox.get(sandbox).snapshot(name, retention_days=retention_days)
    emit(
        snap.info,
        as_json=as_json,
        quiet=quiet,
        ids=lambda i: [i.id],
        render=lambda i: (
            f"{i.id}  {i.name}  {_size(i.size_bytes)} ({_size(i.stored_bytes)} new in the store)"
        ),
    )


@snapshot_app.command("ls")
def snapshot_ls(as_json: AsJson = False, quiet: Quiet = False) -> None:
    """List snapshots. Example: torpor snapshot ls"""
    snaps = Snapshot.list()
    if as_json or quiet:
        emit(
            [s.info for s in snaps], as_json=as_json, quiet=quiet, ids=lambda xs: [x.id for x in xs]
        )
        return
    _table(
        ["id", "name", "sandbox", "created", "expires", "size", "new bytes"],
        [
            [
                s.id,
                s.name,
                s.info.sandbox_id or "",
                f"{s.info.created_at:%Y-%m-%d %H:%M}",
                f"{s.info.expires_at:%Y-%m-%d}",
                _size(s.info.size_bytes),
                _size(s.info.stored_bytes),
            ]
            for s in snaps
        ],
    )


@snapshot_app.command("restore")
def snapshot_restore(
    snapshot: Annotated[str, typer.Argument(help="snapshot id or name")],
    name: Annotated[str | None, typer.Option(help="name of the new sandbox")] = None,
    as_json: AsJson = False,
    quiet: Quiet = False,
) -> None:
    """Restore a snapshot into a new running sandbox.

    Example: torpor snapshot restore before-import --name agent-u-42-undo
    """
    with console.status("restoring ...") if not (as_json or quiet) else _quiet():
        sbx = Snapshot.get(snapshot).restore(name=name)
    emit(
        sbx.info,
        as_json=as_json,
        quiet=quiet,
        ids=lambda i: [i.id],
        render=lambda i: f"{i.id}  {i.name}  {i.state.value}",
    )


@snapshot_app.command("fork")
def snapshot_fork(
    snapshot: Annotated[str, typer.Argument(help="snapshot id or name")],
    count: Annotated[int, typer.Option(help="how many sandboxes")] = 1,
    as_json: AsJson = False,
    quiet: Quiet = False,
) -> None:
    """Start COUNT sandboxes from one snapshot. Example: torpor snapshot fork s1 --count 3"""
    with console.status(f"forking {count} ...") if not (as_json or quiet) else _quiet():
        kids = Snapshot.get(snapshot).fork(count)
    emit(
        [k.info for k in kids],
        as_json=as_json,
        quiet=quiet,
        ids=lambda xs: [x.id for x in xs],
        render=lambda xs: "\n".join(f"{x.id}  {x.state.value}" for x in xs),
    )


@snapshot_app.command("rm")
def snapshot_rm(snapshot: Annotated[str, typer.Argument(help="snapshot id or name")]) -> None:
    """Delete a snapshot (space comes back at the next gc). Example: torpor snapshot rm s1"""
    Snapshot.get(snapshot).delete()
    console.print(escape(f"deleted {snapshot}"))


# -- volumes and drives ----------------------------------------------------------------------

LabelOption = Annotated[
    list[str] | None, typer.Option("--label", "-l", help="KEY=VALUE, repeatable")
]
LabelFilter = Annotated[
    list[str] | None, typer.Option("--label", "-l", help="only those with KEY=VALUE, repeatable")
]


def _labels(labels: dict[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in labels.items())


@volume_app.command("create")
def volume_create(
    name: Annotated[str, typer.Argument(help="volume name")],
    size_mib: Annotated[int, typer.Option(help="size in MiB (sparse)")] = 1024,
    label: LabelOption = None,
    as_json: AsJson = False,
    quiet: Quiet = False,
) -> None:
    """Make an empty volume. Example: torpor volume create memory-u-42 --size-mib 1024
    --label user=u-42"""
    vol = Volume.create(name, size_mib, labels=parse_labels(label))
    emit(
        vol.info,
        as_json=as_json,
        quiet=quiet,
        ids=lambda i: [i.id],
        render=lambda i: f"{i.id}  {i.name}  {i.size_mib} MiB",
    )


@volume_app.command("ls")
def volume_ls(label: LabelFilter = None, as_json: AsJson = False, quiet: Quiet = False) -> None:
    """List volumes and who has them attached. Example: torpor volume ls --label user=u-42"""
    vols = Volume.list(parse_labels(label, what="label filter"))
    if as_json or quiet:
        emit(
            [v.info for v in vols], as_json=as_json, quiet=quiet, ids=lambda xs: [x.id for x in xs]
        )
        return
    _table(
        ["id", "name", "size", "labels", "attached to"],
        [
            [
                v.id,
                v.name,
                f"{v.info.size_mib} MiB",
                _labels(v.info.labels),
                ", ".join(
                    f"{a.sandbox_id}:{a.path}{' (ro)' if a.read_only else ''}"
                    for a in v.info.attachments
                ),
            ]
            for v in vols
        ],
    )


@volume_app.command("rm")
def volume_rm(volume: Annotated[str, typer.Argument(help="volume id or name")]) -> None:
    """Delete a volume and its data. Example: torpor volume rm memory-u-42"""
    Volume.get(volume).delete()
    console.print(escape(f"deleted {volume}"))


@drive_app.command("create")
def drive_create(
    name: Annotated[str, typer.Argument(help="drive name")],
    label: LabelOption = None,
    as_json: AsJson = False,
    quiet: Quiet = False,
) -> None:
    """Make an empty shared drive. Example: torpor drive create research --label team=a"""
    d = Drive.create(name, labels=parse_labels(label))
    emit(
        d.info,
        as_json=as_json,
        quiet=quiet,
        ids=lambda i: [i.id],
        render=lambda i: f"{i.id}  {i.name}",
    )


@drive_app.command("ls")
def drive_ls(label: LabelFilter = None, as_json: AsJson = False, quiet: Quiet = False) -> None:
    """List drives. Example: torpor drive ls --label team=a"""
    drives = Drive.list(parse_labels(label, what="label filter"))
    if as_json or quiet:
        emit(
            [d.info for d in drives],
            as_json=as_json,
            quiet=quiet,
            ids=lambda xs: [x.id for x in xs],
        )
        return
    _table(
        ["id", "name", "labels", "mounted in"],
        [
            [
                d.id,
                d.name,
                _labels(d.info.labels),
                ", ".join(f"{a.sandbox_id}:{a.path}" for a in d.info.attachments),
            ]
            for d in drives
        ],
    )


@drive_app.command("rm")
def drive_rm(drive: Annotated[str, typer.Argument(help="drive id or name")]) -> None:
    """Delete a drive and its files. Example: torpor drive rm research"""
    Drive.get(drive).delete()
    console.print(escape(f"deleted {drive}"))


# -- gc --------------------------------------------------------------------------------------


def gc(
    dry_run: Annotated[bool, typer.Option("--dry-run", help="report, remove nothing")] = False,
    local: Annotated[
        bool, typer.Option("--local", help="collect on the home directly (server stopped)")
    ] = False,
    as_json: AsJson = False,
) -> None:
    """Remove expired snapshots and pauses, and storage nothing references.

    Example: torpor gc --dry-run
    """
    report: dict[str, Any]
    if local:
        from torpor.config import paths
        from torpor.sandbox.storage.retention import collect_garbage as collect_local

        report = collect_local(paths(), dry_run=dry_run).to_json()
    else:
        report = collect_garbage(dry_run=dry_run)
    if as_json:
        emit(report, as_json=True)
        return
    rows = [
        [k, str(len(v)) if isinstance(v, list) else (_size(v) if k == "freed_bytes" else str(v))]
        for k, v in report.items()
    ]
    _table(["what", "count" if not dry_run else "would remove"], rows)


storage_app = typer.Typer(help="The chunk store snapshots live in.", no_args_is_help=True)


@storage_app.command("verify")
def storage_verify(as_json: AsJson = False) -> None:
    """Read back every chunk a snapshot names (a scrub of the home's store); quarantine bad
    ones and list the snapshots they affect. Exits 1 when any chunk is bad.

    Example: torpor storage verify
    """
    from torpor.config import paths
    from torpor.sandbox.storage.snapshots import SnapshotStore

    report = SnapshotStore(paths()).verify()
    if as_json:
        emit(report, as_json=True)
        if report["bad_chunks"]:
            raise typer.Exit(1)
        return
    rows = [[sid, ", ".join(d[:12] for d in chunks)] for sid, chunks in report["affected"].items()]
    typer.echo(f"{report['chunks']} chunks checked, {len(report['bad_chunks'])} bad")
    if rows:
        _table(["snapshot", "bad chunks (quarantined)"], rows)
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add ``gc`` and the ``snapshot``, ``volume``, ``drive``, ``storage`` groups."""
    app.command("gc")(gc)
    app.add_typer(storage_app, name="storage")
    app.add_typer(snapshot_app, name="snapshot")
    app.add_typer(volume_app, name="volume")
    app.add_typer(drive_app, name="drive")
