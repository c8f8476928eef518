"""``torpor sandbox ...``, ``torpor run`` and ``torpor events``: sandboxes from the shell.

Each command parses its arguments, makes one SDK call (which talks to the local server,
starting it if needed, or to ``$TORPOR_URL``) and renders the answer: a table, ``--json`` (the
SDK's model as JSON) or ``-q`` (ids only). The JSON shapes are listed in ``docs/cli.md``.
"""

from __future__ import annotations

import codecs
import contextlib
import json
import shlex
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Annotated, Any

import typer

from torpor.cli.output import AsJson, Quiet, emit, human_bytes, table, to_json
from torpor.cli.terminal import raw_session
from torpor.client import Runtime, Sandbox, default_runtime
from torpor.client.processes import start as start_process
from torpor.errors import InvalidArgument, OperationTimeout, TorporError
from torpor.sandbox.models import SandboxEvent, SandboxInfo, parse_labels

__all__ = ["register"]

sandbox_app = typer.Typer(
    help="Create, list, change, pause, wake, fork, kill sandboxes and run commands in them.",
    no_args_is_help=True,
)

Labels = Annotated[list[str] | None, typer.Option("--label", "-l", help="KEY=VALUE, repeatable")]
Name = Annotated[str, typer.Argument(help="id or name")]

#: the exit code of a command that ran out of time, as timeout(1) has it
TIMEOUT_EXIT = 124

_FMT = "%Y-%m-%d %H:%M:%S"

#: the most output :func:`shell_session` reads in one call
_FOLLOW_CHUNK = 1 << 20


def _labels(info: SandboxInfo) -> str:
    return ", ".join(f"{k}={v}" for k, v in info.labels.items())


def _idle(info: SandboxInfo) -> str:
    return f"{info.idle_pause_seconds} s" if info.idle_pause_seconds else "never"


def _detail(info: SandboxInfo) -> Any:
    rows = [
        ("id", info.id),
        ("name", info.name),
        ("state", info.state.value),
        ("template", info.template),
        ("reused", str(info.reused)),
        ("labels", _labels(info)),
        ("vcpus / memory", f"{info.vcpus} / {info.memory_mib} MiB"),
        ("idle pause", _idle(info)),
        ("created", info.created_at.strftime(_FMT)),
        ("last active", info.last_active_at.strftime(_FMT)),
        ("pause kept", f"{info.pause_retention_days} days"),
    ]
    if info.owned_bytes is not None:
        rows.append(("disk owned", human_bytes(info.owned_bytes)))
    if info.internet is not None:
        rows.append(("internet", "on" if info.internet else "off"))
    if info.expires_at is not None:
        rows.append(("deleted at", info.expires_at.strftime(_FMT) + " unless woken"))
    if info.durable is not None:  # cluster mode: the pause is stored off this node
        rows.append(("durable", info.durable.strftime(_FMT) + " (wakes on any node)"))
    if info.upload_error:
        rows.append(("upload error", info.upload_error + " (retrying; not durable yet)"))
    if info.error:
        rows.append(("error", info.error))
    return table([], rows)


def _show(info: SandboxInfo, as_json: bool = False, quiet: bool = False) -> None:
    emit(info, as_json=as_json, quiet=quiet, ids=lambda i: [i.id], render=_detail)


def _listing(infos: list[SandboxInfo]) -> Any:
    columns = ["id", "name", "state", "labels", "idle pause", "disk", "last active", "deleted at"]
    rows = [
        [
            i.id,
            i.name,
            i.state.value,
            _labels(i),
            _idle(i),
            human_bytes(i.owned_bytes),
            i.last_active_at.strftime("%Y-%m-%d %H:%M"),
            "" if i.expires_at is None else i.expires_at.strftime("%Y-%m-%d %H:%M"),
        ]
        for i in infos
    ]
    return table(columns, rows, ids=["id", "name", "state"])


def _many(infos: list[SandboxInfo], as_json: bool, quiet: bool) -> None:
    emit(infos, as_json=as_json, quiet=quiet, ids=lambda xs: [i.id for i in xs], render=_listing)


def _pairs(
    items: list[str] | None, what: str, example: str, modes: tuple[str, ...] = ()
) -> list[list[str]]:
    """``["vol:/data:ro"]`` -> ``[["vol", "/data", "ro"]]``: a name, a path and, where
    ``modes`` are allowed, one of them. Anything else (``:readonly``, a fourth part) is an
    InvalidArgument, never read as the default."""
    out = []
    for item in items or []:
        parts = item.split(":")
        if (
            len(parts) not in ((2, 3) if modes else (2,))
            or not parts[0]
            or not parts[1]
            or (len(parts) == 3 and parts[2] not in modes)
        ):
            raise InvalidArgument(f"{what} {item!r} is not {example}", option=what)
        out.append(parts)
    return out


@sandbox_app.command("create")
def create(
    name: Annotated[str | None, typer.Argument(help="a name (default: the id)")] = None,
    template: Annotated[str | None, typer.Option(help="guest template (default python)")] = None,
    label: Labels = None,
    idle_pause: Annotated[int | None, typer.Option(help="pause after N idle seconds")] = None,
    vcpus: Annotated[int | None, typer.Option()] = None,
    memory: Annotated[int | None, typer.Option(help="MiB of RAM")] = None,
    retention_days: Annotated[
        int | None, typer.Option(help="keep a pause N days (1-365; default 30), then delete it")
    ] = None,
    get_or_create: Annotated[
        bool,
        typer.Option("--get-or-create", help="the live sandbox NAME if there is one (woken)"),
    ] = False,
    snapshot: Annotated[str | None, typer.Option(help="restore this snapshot (id or name)")] = None,
    volume: Annotated[
        list[str] | None, typer.Option(help="VOLUME:/path[:ro], mount a volume, repeatable")
    ] = None,
    drive: Annotated[
        list[str] | None, typer.Option(help="DRIVE:/path, mount a shared drive, repeatable")
    ] = None,
    env: Annotated[
        list[str] | None,
        typer.Option("--env", "-e", help="KEY=VALUE for every command (kept secret), repeatable"),
    ] = None,
    internet: Annotated[
        bool | None,
        typer.Option(
            "--internet/--no-internet",
            help="a network card to the internet (default: on if the host allows it, "
            "TORPOR_ALLOW_INTERNET=1 for the server)",
        ),
    ] = None,
    as_json: AsJson = False,
    quiet: Quiet = False,
) -> None:
    """Create a running sandbox (or, with --get-or-create, reuse the one called NAME).

    Examples:

        torpor sandbox create agent-u-42 --label user=u-42 --idle-pause 600

        torpor sandbox create agent-u-42 --get-or-create -q     # the same id every day

        torpor sandbox create --snapshot before-import --volume data:/data
    """
    labels = parse_labels(label)
    envs = parse_labels(env, what="--env")
    if get_or_create:
        if name is None:
            raise InvalidArgument("--get-or-create needs a NAME", option="--get-or-create")
        if snapshot or volume or drive:
            raise InvalidArgument(
                "--get-or-create takes no --snapshot, --volume or --drive (create the sandbox "
                "once with them, then reuse it by name)",
                option="--get-or-create",
            )
        sbx = Sandbox.get_or_create(
            name,
            template=template,
            labels=labels,
            idle_pause_seconds=idle_pause,
            vcpus=vcpus,
            memory_mib=memory,
            pause_retention_days=retention_days,
            envs=envs,
            internet=internet,
        )
        _show(sbx.info, as_json, quiet)
        return
    volumes: list[Any] = [
        {"volume": v[0], "path": v[1], "read_only": v[2:] == ["ro"]}
        for v in _pairs(volume, "--volume", "VOLUME:/path[:ro|:rw]", modes=("ro", "rw"))
    ]
    drives: list[Any] = [
        {"drive": d[0], "path": d[1]} for d in _pairs(drive, "--drive", "DRIVE:/path")
    ]
    sbx = Sandbox.create(
        template,
        name=name,
        labels=labels,
        idle_pause_seconds=idle_pause,
        vcpus=vcpus,
        memory_mib=memory,
        pause_retention_days=retention_days,
        snapshot=snapshot,
        volumes=volumes or None,
        drives=drives or None,
        envs=envs,
        internet=internet,
    )
    _show(sbx.info, as_json, quiet)


@sandbox_app.command("ls")
def ls(
    label: Labels = None,
    all_: Annotated[bool, typer.Option("--all", "-a", help="killed ones too")] = False,
    as_json: AsJson = False,
    quiet: Quiet = False,
) -> None:
    """List sandboxes: state, labels, idle pause, the disk each owns, when a pause expires.

    Example: torpor sandbox ls --label user=u-42
    """
    _many(Sandbox.list(labels=parse_labels(label), include_stopped=all_), as_json, quiet)


@sandbox_app.command("get")
def get(name: Name, as_json: AsJson = False, quiet: Quiet = False) -> None:
    """Show one sandbox.

    Example: torpor sandbox get agent-u-42 --json
    """
    _show(Sandbox.get(name).info, as_json, quiet)


@sandbox_app.command("set")
def set_(
    name: Name,
    label: Annotated[
        list[str] | None, typer.Option("--label", "-l", help="KEY=VALUE to add or change")
    ] = None,
    unlabel: Annotated[list[str] | None, typer.Option(help="KEY to remove, repeatable")] = None,
    idle_pause: Annotated[
        int | None, typer.Option(help="pause after N idle seconds (0: never)")
    ] = None,
    as_json: AsJson = False,
    quiet: Quiet = False,
) -> None:
    """Change a sandbox's labels or idle pause (a paused sandbox stays paused).

    Example: torpor sandbox set agent-u-42 --label tier=pro --idle-pause 600
    """
    sbx = Sandbox.get(name)
    labels = None
    if label or unlabel:
        labels = {**sbx.info.labels, **(parse_labels(label) or {})}
        for key in unlabel or []:
            labels.pop(key, None)
    _show(sbx.set(labels=labels, idle_pause_seconds=idle_pause), as_json, quiet)


@sandbox_app.command("pause")
def pause(name: Name, as_json: AsJson = False, quiet: Quiet = False) -> None:
    """Hibernate a sandbox (RAM and processes to disk).

    Example: torpor sandbox pause agent-u-42
    """
    _show(Sandbox.get(name).pause(), as_json, quiet)


@sandbox_app.command("resume")
def resume(name: Name, as_json: AsJson = False, quiet: Quiet = False) -> None:
    """Wake a paused sandbox.

    Example: torpor sandbox resume agent-u-42
    """
    _show(Sandbox.get(name).resume(), as_json, quiet)


@sandbox_app.command("kill")
def kill(name: Name, as_json: AsJson = False, quiet: Quiet = False) -> None:
    """Stop a sandbox for good and delete its machine.

    Example: torpor sandbox kill agent-u-42
    """
    sbx = Sandbox.get(name)
    sbx.kill()
    emit(
        {"id": sbx.id, "name": sbx.name, "state": "stopped"},
        as_json=as_json,
        quiet=quiet,
        ids=lambda d: [d["id"]],
        render=lambda d: f"killed {d['name']} ({d['id']})",
    )


@sandbox_app.command("fork")
def fork(
    name: Name,
    count: Annotated[int, typer.Option("--count", "-n", help="how many copies")] = 1,
    label: Labels = None,
    as_json: AsJson = False,
    quiet: Quiet = False,
) -> None:
    """Copy a sandbox, RAM and all, into COUNT new running ones (it keeps running).

    Example: torpor sandbox fork agent-u-42 --count 3 -q
    """
    kids = Sandbox.get(name).fork(count, labels=parse_labels(label))
    _many([k.info for k in kids], as_json, quiet)


@sandbox_app.command("logs")
def logs(
    name: Name,
    lines: Annotated[int, typer.Option("--lines", "-n", help="the last N lines")] = 100,
) -> None:
    """Print the end of a sandbox's guest console (does not wake a paused sandbox).

    Example: torpor sandbox logs agent-u-42 -n 20
    """
    text = Sandbox.get(name).logs(lines)
    if text:
        typer.echo(text.rstrip("\n"))


@sandbox_app.command("port")
def port(
    name: Name,
    guest_port: Annotated[int, typer.Argument(help="the port in the sandbox", min=1, max=65535)],
    as_json: AsJson = False,
) -> None:
    """Print the host address (127.0.0.1:NNNNN, on the server's host) that reaches a port in
    the sandbox; the same one every time, until the sandbox is killed.

    Example: curl http://$(torpor sandbox port agent-u-42 8000)/
    """
    host = Sandbox.get(name).get_host(guest_port)
    emit({"port": guest_port, "host": host}, as_json=as_json, render=lambda d: d["host"])


def shell_session(
    sbx: Any, lines: Iterable[str], write: Callable[[str], object], *, poll: float = 0.2
) -> int:
    """Run ``sh -i`` in ``sbx`` as a background process: each of ``lines`` goes to its stdin,
    its output (stdout and stderr together) to ``write`` as it comes (what is not UTF-8 as
    U+FFFD). At the end of ``lines`` the shell gets ``exit``; returns its exit code."""
    proc = start_process(sbx, "exec sh -i 2>&1")
    stop = threading.Event()

    def follow() -> None:
        seen = 0  # bytes read: the offset of the next read
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        while True:
            done = stop.is_set()
            while True:
                chunk = proc.read_bytes_from(seen, _FOLLOW_CHUNK)
                seen += len(chunk)
                text = decoder.decode(chunk)
                if text:
                    write(text)
                if len(chunk) < _FOLLOW_CHUNK:
                    break
            if done:
                rest = decoder.decode(b"", final=True)
                if rest:
                    write(rest)
                return
            stop.wait(poll)

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    try:
        for line in lines:
            proc.send_stdin(line if line.endswith("\n") else line + "\n")
        proc.send_stdin("exit\n")
        code = proc.wait(timeout=None).exit_code
    finally:
        stop.set()
        reader.join(30)
        with contextlib.suppress(TorporError):
            proc.kill()
        with contextlib.suppress(TorporError):
            proc.forget()
    return code


@sandbox_app.command("shell")
def shell(
    name: Name,
    cmd: Annotated[str, typer.Option("--cmd", help="the program to run")] = "bash",
) -> None:
    """An interactive shell in a sandbox (waking it), on a real terminal (PTY): full-screen
    programs, Ctrl-C, window resizes; `exit` or Ctrl-D ends it. This terminal is put back as
    it was however the session ends. When stdin is not a terminal (a pipe, a script), it runs
    `sh -i` line by line instead.

    Example: torpor sandbox shell agent-u-42
    """
    sbx = Sandbox.get(name)
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        code = shell_session(sbx, sys.stdin, _out(sys.stdout))
        raise typer.Exit(code)
    out = sys.stdout.buffer

    def write(chunk: bytes) -> None:
        out.write(chunk)
        out.flush()

    typer.secho(f"shell in {sbx.name} ({sbx.id}); `exit` to leave", err=True)
    code = raw_session(
        lambda cols, rows: sbx.pty.create(cmd, cols=cols, rows=rows, on_data=write),
        stdin_fd=sys.stdin.fileno(),
        size_fd=sys.stdout.fileno(),
    )
    raise typer.Exit(code)


def _out(stream: Any) -> Any:
    return lambda s: (stream.write(s), stream.flush())


@sandbox_app.command("exec")
def exec_(
    name: Name,
    cmd: Annotated[list[str], typer.Argument(help="the command, after --")],
    timeout: Annotated[
        float, typer.Option(help="seconds; then it is killed and the exit code is 124")
    ] = 60.0,
    cwd: Annotated[str | None, typer.Option()] = None,
    as_json: AsJson = False,
) -> None:
    """Run a command in a sandbox (waking it), streaming its output; exits with its code
    (124 when it ran out of time, as timeout(1)).

    Example: torpor sandbox exec agent-u-42 --timeout 10 -- ls -la /workspace
    """
    command = cmd[0] if len(cmd) == 1 else shlex.join(cmd)
    stream: dict[str, Any] = (
        {} if as_json else {"on_stdout": _out(sys.stdout), "on_stderr": _out(sys.stderr)}
    )
    try:
        result = Sandbox.get(name).commands.run(command, cwd=cwd, timeout=timeout, **stream)
    except OperationTimeout as exc:
        if as_json:
            emit({"exit_code": TIMEOUT_EXIT, "timed_out": True, "error": str(exc)}, as_json=True)
        else:
            typer.secho(f"timed out after {timeout:g} s: {exc}", err=True, fg="red")
        raise typer.Exit(TIMEOUT_EXIT) from None
    if as_json:
        emit(result, as_json=True)
    raise typer.Exit(result.exit_code)


def run(
    name: Name,
    code: Annotated[str | None, typer.Argument(help="Python code; '-' reads it from stdin")] = None,
    file: Annotated[
        Path | None,
        typer.Option(
            "--file", "-f", help="run this file's code", exists=True, dir_okay=False, readable=True
        ),
    ] = None,
    timeout: Annotated[float | None, typer.Option(help="seconds")] = None,
    as_json: AsJson = False,
) -> None:
    """Run Python in a sandbox's interpreter (variables persist between runs).

    Examples:

        torpor run agent-u-42 "notes"

        torpor run agent-u-42 --file analysis.py

        echo 'x = 1' | torpor run agent-u-42 -
    """
    if (code is None) == (file is None):
        raise InvalidArgument("give the code, '-' (stdin) or --file PATH (one of them)")
    try:
        source = file.read_text() if file is not None else sys.stdin.read() if code == "-" else code
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"cannot read {file}: {exc}", option="--file") from exc
    assert source is not None
    execution = Sandbox.get(name).interpreter.run(source, timeout=timeout)
    if as_json:
        emit(execution, as_json=True)
        raise typer.Exit(1 if execution.error is not None else 0)
    sys.stdout.write(execution.stdout)
    sys.stderr.write(execution.stderr)
    if execution.text is not None:
        typer.echo(execution.text)
    if execution.error is not None:
        sys.stderr.write(
            execution.error.traceback or f"{execution.error.name}: {execution.error.value}\n"
        )
        raise typer.Exit(1)


def _event_line(event: SandboxEvent) -> str:
    why = f"  ({event.reason})" if event.reason else ""
    return (
        f"{event.at.strftime(_FMT)}  {event.seq:>6}  {event.kind:<12} "
        f"{event.name} {event.sandbox_id}{why}"
    )


def events(
    sandbox: Annotated[str | None, typer.Argument(help="only this sandbox's (id or name)")] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="wait for new events")] = False,
    after: Annotated[int, typer.Option(help="only events after this seq")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="one JSON object a line")] = False,
) -> None:
    """Show sandbox lifecycle events: create, pause, wake, kill, expire, error (kept by the
    server across restarts); with --follow, wait for new ones until Ctrl-C.

    Examples:

        torpor events --follow

        torpor events agent-u-42 --json
    """
    rt: Runtime = default_runtime()
    try:
        for event in rt.events(after=after, sandbox=sandbox, follow=follow):
            if as_json:
                typer.echo(json.dumps(to_json(event), ensure_ascii=False))
            else:
                typer.echo(_event_line(event))
            sys.stdout.flush()
    except KeyboardInterrupt:
        raise typer.Exit(0) from None


def register(app: typer.Typer) -> None:
    """Add the ``sandbox`` group, ``run`` and ``events`` to the ``torpor`` command."""
    app.add_typer(sandbox_app, name="sandbox")
    app.command("run")(run)
    app.command("events")(events)
