"""``torpor sandbox ...`` and ``torpor run``: sandboxes from the shell, through the SDK.

Each command parses its arguments, makes one SDK call (which talks to the local server,
starting it if needed) and renders the answer with rich.
"""

from __future__ import annotations

import shlex
import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from torpor.client import Sandbox
from torpor.sandbox.models import SandboxInfo, parse_labels

__all__ = ["register"]

console = Console()

sandbox_app = typer.Typer(
    help="Create, list, pause, wake, kill sandboxes and run commands.", no_args_is_help=True
)

Labels = Annotated[list[str] | None, typer.Option("--label", "-l", help="KEY=VALUE, repeatable")]


def _when(info: SandboxInfo) -> tuple[str, str]:
    fmt = "%Y-%m-%d %H:%M:%S"
    return info.created_at.strftime(fmt), info.last_active_at.strftime(fmt)


def _show(info: SandboxInfo) -> None:
    table = Table(show_header=False)
    created, active = _when(info)
    for key, value in [
        ("id", info.id),
        ("name", info.name),
        ("state", info.state.value),
        ("template", info.template),
        ("reused", str(info.reused)),
        ("labels", ", ".join(f"{k}={v}" for k, v in info.labels.items())),
        ("vcpus / memory", f"{info.vcpus} / {info.memory_mib} MiB"),
        ("idle pause", f"{info.idle_pause_seconds} s" if info.idle_pause_seconds else "never"),
        ("created", created),
        ("last active", active),
        ("pause kept", f"{info.pause_retention_days} days"),
    ]:
        table.add_row(key, value)
    if info.expires_at is not None:
        table.add_row("deleted at", info.expires_at.strftime("%Y-%m-%d %H:%M:%S") + " unless woken")
    if info.error:
        table.add_row("error", info.error)
    console.print(table)


@sandbox_app.command("create")
def create(
    name: Annotated[str | None, typer.Argument(help="a name (default: the id)")] = None,
    template: Annotated[str, typer.Option(help="guest template")] = "python",
    label: Labels = None,
    idle_pause: Annotated[int | None, typer.Option(help="pause after N idle seconds")] = None,
    vcpus: Annotated[int | None, typer.Option()] = None,
    memory: Annotated[int | None, typer.Option(help="MiB of RAM")] = None,
    retention_days: Annotated[
        int | None, typer.Option(help="keep a pause N days (1-365; default 30), then delete it")
    ] = None,
) -> None:
    """Create a running sandbox.

    Example: torpor sandbox create agent-u-42 --label user=u-42 --idle-pause 600
    """
    _show(
        Sandbox.create(
            template,
            name=name,
            labels=parse_labels(label),
            idle_pause_seconds=idle_pause,
            vcpus=vcpus,
            memory_mib=memory,
            pause_retention_days=retention_days,
        ).info
    )


@sandbox_app.command("ls")
def ls(
    label: Labels = None,
    all_: Annotated[bool, typer.Option("--all", "-a", help="killed ones too")] = False,
) -> None:
    """List sandboxes.

    Example: torpor sandbox ls --label user=u-42
    """
    infos = Sandbox.list(labels=parse_labels(label), include_stopped=all_)
    table = Table("id", "name", "state", "template", "labels", "last active", "deleted at")
    for info in infos:
        table.add_row(
            info.id,
            info.name,
            info.state.value,
            info.template,
            ", ".join(f"{k}={v}" for k, v in info.labels.items()),
            _when(info)[1],
            "" if info.expires_at is None else info.expires_at.strftime("%Y-%m-%d %H:%M"),
        )
    console.print(table)


@sandbox_app.command("get")
def get(name: Annotated[str, typer.Argument(help="id or name")]) -> None:
    """Show one sandbox.

    Example: torpor sandbox get agent-u-42
    """
    _show(Sandbox.get(name).info)


@sandbox_app.command("pause")
def pause(name: Annotated[str, typer.Argument(help="id or name")]) -> None:
    """Hibernate a sandbox (RAM and processes to disk).

    Example: torpor sandbox pause agent-u-42
    """
    _show(Sandbox.get(name).pause())


@sandbox_app.command("resume")
def resume(name: Annotated[str, typer.Argument(help="id or name")]) -> None:
    """Wake a paused sandbox.

    Example: torpor sandbox resume agent-u-42
    """
    _show(Sandbox.get(name).resume())


@sandbox_app.command("kill")
def kill(name: Annotated[str, typer.Argument(help="id or name")]) -> None:
    """Stop a sandbox for good and delete its machine.

    Example: torpor sandbox kill agent-u-42
    """
    Sandbox.get(name).kill()
    console.print(f"killed {name}")


@sandbox_app.command("exec")
def exec_(
    name: Annotated[str, typer.Argument(help="id or name")],
    cmd: Annotated[list[str], typer.Argument(help="the command, after --")],
    timeout: Annotated[float, typer.Option(help="seconds")] = 60.0,
    cwd: Annotated[str | None, typer.Option()] = None,
) -> None:
    """Run a command in a sandbox (waking it), streaming its output; exits with its code.

    Example: torpor sandbox exec agent-u-42 -- ls -la /workspace
    """
    command = cmd[0] if len(cmd) == 1 else shlex.join(cmd)
    result = Sandbox.get(name).commands.run(
        command,
        cwd=cwd,
        timeout=timeout,
        on_stdout=lambda s: (sys.stdout.write(s), sys.stdout.flush()),
        on_stderr=lambda s: (sys.stderr.write(s), sys.stderr.flush()),
    )
    raise typer.Exit(result.exit_code)


def run(
    name: Annotated[str, typer.Argument(help="id or name")],
    code: Annotated[str, typer.Argument(help="Python code")],
    timeout: Annotated[float | None, typer.Option(help="seconds")] = None,
) -> None:
    """Run Python in a sandbox's interpreter (variables persist between runs).

    Example: torpor run agent-u-42 "notes"
    """
    execution = Sandbox.get(name).interpreter.run(code, timeout=timeout)
    sys.stdout.write(execution.stdout)
    sys.stderr.write(execution.stderr)
    if execution.text is not None:
        console.print(execution.text, markup=False, highlight=False)
    if execution.error is not None:
        sys.stderr.write(
            execution.error.traceback or f"{execution.error.name}: {execution.error.value}\n"
        )
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add the ``sandbox`` group and ``run`` to the ``torpor`` command."""
    app.add_typer(sandbox_app, name="sandbox")
    app.command("run")(run)
