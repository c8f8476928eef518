"""``torpor serve`` and ``torpor server status|stop``: the process that owns engine state.

The SDK starts the local server by itself when it is not running, so ``torpor serve`` is for
running it in the foreground (a service manager, a remote host with ``--host`` and tokens).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

__all__ = ["register"]

console = Console()

server_app = typer.Typer(help="The local torpor server: status, stop.", no_args_is_help=True)


def serve(
    socket: Annotated[
        Path | None, typer.Option(help="unix socket (default: <home>/server.sock)")
    ] = None,
    host: Annotated[
        str | None,
        typer.Option(help="also listen on TCP (bearer tokens from 'torpor token create')"),
    ] = None,
    port: Annotated[int, typer.Option(help="TCP port, with --host")] = 8765,
    token_file: Annotated[
        Path | None,
        typer.Option(help='deprecated: a JSON {"tokens": {TOKEN: TENANT}} file, imported'),
    ] = None,
    memory: Annotated[
        str | None,
        typer.Option(
            envvar="TORPOR_MEMORY_BACKEND", help="memory store: sqlite (default) or a postgres DSN"
        ),
    ] = None,
    embedder: Annotated[
        str | None,
        typer.Option(
            envvar="TORPOR_EMBEDDER", help="memory embedder: default, none (lexical) or a model"
        ),
    ] = None,
    reranker: Annotated[
        str | None,
        typer.Option(
            envvar="TORPOR_RERANKER",
            help="memory recall's cross-encoder reranker: none (default), default "
            "(the torpor rerank extra) or a model folder",
        ),
    ] = None,
    log_level: Annotated[str, typer.Option(help="debug, info, warning, error")] = "info",
    cluster: Annotated[
        str | None,
        typer.Option(
            envvar="TORPOR_CLUSTER",
            help="join a cluster: the PostgreSQL DSN of the shared registry (and memory)",
        ),
    ] = None,
    store: Annotated[
        str | None,
        typer.Option(
            envvar="TORPOR_STORE", help="with --cluster: the shared chunk store, s3://bucket/prefix"
        ),
    ] = None,
    node: Annotated[
        str | None,
        typer.Option(envvar="TORPOR_NODE", help="with --cluster: this node's name (default: host)"),
    ] = None,
    url: Annotated[
        str | None,
        typer.Option(
            envvar="TORPOR_NODE_URL",
            help="with --cluster: the URL this node is reached at (default http://HOST:PORT)",
        ),
    ] = None,
) -> None:
    """Run the torpor server in the foreground until SIGTERM or Ctrl-C.

    Example: torpor serve --host 0.0.0.0 --port 8765   (then: torpor token create --tenant acme)

    A cluster node: torpor serve --cluster postgresql://db/torpor --store s3://torpor-chunks
    --node n1 --host 0.0.0.0 --port 8765 (the S3 endpoint: $TORPOR_STORE_ENDPOINT)
    """
    from torpor.server.daemon import serve as run

    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    run(
        socket_path=socket,
        host=host,
        port=port,
        token_file=token_file,
        memory=memory,
        embedder=embedder,
        reranker=reranker,
        log_level=log_level.lower(),
        cluster=cluster,
        store=store,
        node=node,
        url=url,
    )


@server_app.command("status")
def status(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Show whether the local server runs, its pid, home and sandboxes (the server of
    $TORPOR_HOME, whatever $TORPOR_URL says).

    Example: torpor server status
    """
    from torpor.client import Runtime, Sandbox
    from torpor.config import paths, server_pid

    pid = server_pid()
    if pid is None:
        console.print(escape(f"no torpor server owns {paths().home}"))
        raise typer.Exit(1)
    rt = Runtime(home=paths().home, autostart=False)  # a home: not $TORPOR_URL's server
    ctx.call_on_close(rt.close)
    health = rt.health()
    if as_json:
        from torpor.cli.output import emit

        count = len(Sandbox.list(runtime=rt))
        emit({**health, "socket": str(paths().socket), "sandboxes": count}, as_json=True)
        return
    table = Table(show_header=False)
    table.add_row("pid", str(health["pid"]))
    table.add_row("home", escape(str(health["home"])))
    table.add_row("socket", escape(str(paths().socket)))
    table.add_row("version", str(health["version"]))
    table.add_row("sandboxes", str(len(Sandbox.list(runtime=rt))))
    console.print(table)


@server_app.command("stop")
def stop(timeout: Annotated[float, typer.Option(help="seconds to wait")] = 60.0) -> None:
    """Stop the local server (running sandboxes are paused first, nothing is lost).

    Example: torpor server stop
    """
    from torpor.server.daemon import stop_server

    pid = stop_server(timeout=timeout)
    console.print("no server was running" if pid is None else f"stopped server pid {pid}")


@server_app.command("token")
def token(
    tenant: Annotated[str, typer.Argument(help="the tenant the token acts for")],
    token_file: Annotated[Path, typer.Option(help="the token file to add it to")],
) -> None:
    """Deprecated (use 'torpor token create'): add a token for TENANT to a token file.

    The server imports the file at start (restart it). Example:
    torpor server token acme --token-file /etc/torpor/tokens.json
    """
    from torpor.server.auth import add_token

    typer.echo(add_token(token_file, tenant))


def register(app: typer.Typer) -> None:
    """Add ``serve`` and the ``server`` group to the ``torpor`` command."""
    app.command("serve")(serve)
    app.add_typer(server_app, name="server")
