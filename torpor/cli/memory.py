"""``torpor memory``: remember, recall, context, log, forget, history, export, import,
reindex.

Each command parses its arguments, makes one library call on a :class:`ScopedMemory` and
renders the answer (``--json`` for programs). Group options pick the store and the scope::

    torpor memory --scope app/support/user/u-42 remember "prefers daily summaries" --key cadence
    torpor memory --scope app/support/user/u-42 recall "how often should I send summaries?"

Recall is lexical-only unless ``--embeddings`` is given (loading the model takes seconds).

With ``--url`` and ``--token`` (or ``$TORPOR_URL`` / ``$TORPOR_TOKEN``) every command goes to
that server's memory instead (``rt.memory``; the server's embedder and the token's grants
apply); ``--server`` uses the local server over its socket.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, cast

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from torpor.errors import InvalidArgument
from torpor.memory.models import SourceRef

if TYPE_CHECKING:  # the store (numpy, jsonschema ...) loads when a command opens it
    from torpor.memory import ScopedMemory

__all__ = ["app", "register"]

app = typer.Typer(
    name="memory", help="The knowledge store: facts, episodes, profiles.", no_args_is_help=True
)
console = Console()
err_console = Console(stderr=True)


@dataclass
class _Opts:
    home: str | None
    tenant: str | None
    token: str | None
    scope: str
    embeddings: bool
    as_json: bool
    url: str | None = None
    server: bool = False
    reranker: str | None = None


def _scope(ctx: typer.Context) -> ScopedMemory:
    o: _Opts = ctx.obj
    if o.url or o.server:
        from torpor.client import Runtime

        rt = Runtime(url=o.url, token=o.token) if o.url else Runtime(home=o.home, token=o.token)
        ctx.call_on_close(rt.close)
        remote: Any = rt.memory.scope_from_path(o.scope, tenant=o.tenant)
        return cast("ScopedMemory", remote)  # the same API (torpor.client.memory)
    from torpor.memory import Memory

    mem = Memory(
        o.home,
        token=o.token,
        tenant=o.tenant,
        embedder="default" if o.embeddings else None,
        reranker=o.reranker,
    )
    ctx.call_on_close(mem.close)
    return mem.scope_from_path(o.scope)


def _source(text: str | None) -> SourceRef | None:
    """``--source``'s JSON (checked as JSON before the command runs) as a SourceRef."""
    if not text:
        return None
    data = json.loads(text)
    if not isinstance(data, dict):
        raise InvalidArgument(
            f'--source takes a JSON object such as \'{{"path": "/notes.md"}}\', not {text!r}',
            option="--source",
        )
    return SourceRef(**data)


def _emit(ctx: typer.Context, data: Any, table: Table | str | None = None) -> None:
    if ctx.obj.as_json or table is None:
        typer.echo(json.dumps(data, default=str, indent=2))
    else:
        console.print(table)


@app.callback()
def main(
    ctx: typer.Context,
    scope: Annotated[
        str,
        typer.Option(
            "--scope", "-s", help="scope path, e.g. app/support/user/u-42 ('' = tenant root)"
        ),
    ] = "",
    home: Annotated[str | None, typer.Option(help="torpor home (default $TORPOR_HOME)")] = None,
    tenant: Annotated[
        str | None, typer.Option(help="tenant (default: 'default' or the token's)")
    ] = None,
    token: Annotated[str | None, typer.Option(envvar="TORPOR_TOKEN", help="API token")] = None,
    embeddings: Annotated[
        bool, typer.Option("--embeddings", help="use the local embedding model too")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
    url: Annotated[
        str | None, typer.Option(envvar="TORPOR_URL", help="a torpor server (with --token)")
    ] = None,
    server: Annotated[
        bool, typer.Option("--server", help="the local server's memory (over its socket)")
    ] = False,
    reranker: Annotated[
        str | None,
        typer.Option(
            envvar="TORPOR_RERANKER",
            help="recall's cross-encoder: none (default), default (the torpor rerank extra) "
            "or a model folder; a server (--url, --server) uses its own",
        ),
    ] = None,
) -> None:
    """Options shared by every memory command.

    Example:

        torpor memory --scope app/support/user/u-42 recall "summaries" -k 3
    """
    ctx.obj = _Opts(home, tenant, token, scope, embeddings, as_json, url, server, reranker)


@app.command()
def remember(
    ctx: typer.Context,
    text: str,
    key: Annotated[str | None, typer.Option(help="supersede the fact with this key")] = None,
    meta: Annotated[str | None, typer.Option(help="metadata as a JSON object")] = None,
    source: Annotated[
        str | None,
        typer.Option(help='a SourceRef as JSON, e.g. \'{"path": "/tmp/f.csv", "line": 3}\''),
    ] = None,
    cache: Annotated[bool, typer.Option("--cache", help="a rebuildable cache record")] = False,
    ttl: Annotated[float | None, typer.Option(help="seconds until it expires")] = None,
) -> None:
    """Store a fact.

    Example:

        torpor memory -s app/a/user/u remember "prefers daily summaries" --key cadence
    """
    ref = _source(source)
    f = _scope(ctx).remember(
        text,
        key=key,
        metadata=json.loads(meta) if meta else None,
        source=ref,
        durability="cache" if cache else "persistent",
        ttl=ttl,
    )
    _emit(
        ctx,
        f.model_dump(mode="json"),
        f"[green]{f.id}[/] remembered" + (" (verified)" if f.verified else ""),
    )


@app.command()
def log(
    ctx: typer.Context,
    role: str,
    text: str,
    session: Annotated[str | None, typer.Option(help="session id")] = None,
    at: Annotated[datetime | None, typer.Option(help="back-fill the time (ISO 8601, UTC)")] = None,
) -> None:
    """Append one turn to the episodic log.

    Example:

        torpor memory -s app/a/user/u log user "Can you send me summaries every week?"
    """
    e = _scope(ctx).log(role, text, session=session, at=at)
    _emit(ctx, e.model_dump(mode="json"), f"[green]{e.id}[/] logged")


@app.command()
def recall(
    ctx: typer.Context,
    query: str,
    k: Annotated[int, typer.Option("-k", help="how many hits")] = 5,
    kind: Annotated[str | None, typer.Option(help="fact or episode")] = None,
    history: Annotated[bool, typer.Option("--history", help="include superseded facts")] = False,
    as_of: Annotated[datetime | None, typer.Option(help="what was true then (UTC)")] = None,
) -> None:
    """Search this scope and its ancestors.

    Example:

        torpor memory -s app/a/user/u recall "how often should I send summaries?" -k 3
    """
    hits = _scope(ctx).recall(
        query,
        k,
        kind=kind,  # type: ignore[arg-type]
        include_history=history,
        as_of=as_of,
    )
    table = Table("score", "kind", "scope", "text", "id")
    for h in hits:
        table.add_row(f"{h.score:.3f}", h.kind, Text(h.scope or "/"), Text(h.text), h.id)
    _emit(
        ctx,
        [{"score": h.score, "scores": h.scores, **h.record.model_dump(mode="json")} for h in hits],
        table,
    )


@app.command()
def context(
    ctx: typer.Context,
    query: str,
    budget: Annotated[int, typer.Option("--budget", "-b", help="token budget")] = 500,
) -> None:
    """Print a prompt-ready block that fits the budget.

    Example:

        torpor memory -s app/a/user/u context "write Jordan a short update" -b 300
    """
    c = _scope(ctx).context(query, budget_tokens=budget)
    if ctx.obj.as_json:
        _emit(ctx, {"text": c.text, "tokens": c.tokens, "ids": c.ids})
    else:
        typer.echo(c.text)


@app.command()
def history(ctx: typer.Context, key: str) -> None:
    """Every version of a keyed fact, oldest first.

    Example:

        torpor memory -s app/a/user/u history cadence
    """
    facts = _scope(ctx).history(key)
    table = Table("valid_from", "valid_to", "text", "id")
    for f in facts:
        table.add_row(str(f.valid_from), str(f.valid_to or "current"), Text(f.text), f.id)
    _emit(ctx, [f.model_dump(mode="json") for f in facts], table)


@app.command()
def forget(
    ctx: typer.Context,
    record_id: Annotated[
        str | None, typer.Argument(help="a record id; omit to erase the whole scope")
    ] = None,
    yes: Annotated[bool, typer.Option("--yes", help="confirm erasing a whole scope")] = False,
) -> None:
    """Erase one record, or (with --yes and no id) the whole scope subtree.

    Example:

        torpor memory -s app/a/user/u forget --yes
    """
    if record_id is None and not yes:
        raise typer.BadParameter("erasing a whole scope needs --yes")
    n = _scope(ctx).forget(record_id)
    _emit(ctx, {"erased": n}, f"erased {n} record(s)")


@app.command("export")
def export_(
    ctx: typer.Context,
    dest: Annotated[Path | None, typer.Argument(help="file to write (default stdout)")] = None,
) -> None:
    """Write this scope subtree as JSON lines.

    Example:

        torpor memory -s app/a/user/u export u.jsonl
    """
    s = _scope(ctx)
    n = s.export(dest if dest is not None else sys.stdout)
    if dest is not None:
        err_console.print(f"wrote {n} lines to {escape(str(dest))}")


@app.command("import")
def import_(ctx: typer.Context, src: Path) -> None:
    """Load an export into this scope (re-rooted here; all or nothing).

    Example:

        torpor memory -s app/a/user/u2 import u.jsonl
    """
    n = _scope(ctx).import_(src)
    _emit(ctx, {"imported": n}, f"imported {n} record(s)")


@app.command()
def reindex(
    ctx: typer.Context,
    batch: Annotated[int, typer.Option(help="texts embedded per batch")] = 256,
) -> None:
    """Embed the records that have no vector yet (written without --embeddings), with the
    local embedding model. The whole tenant, whatever --scope says. A local store only: a
    server (--url, --server) has no reindex, and is refused rather than the local home used.

    Example:

        torpor memory reindex
    """
    from torpor.memory import Memory
    from torpor.memory.embeddings import INSTALL_HINT

    o: _Opts = ctx.obj
    if o.url or o.server:
        raise InvalidArgument(
            "reindex works on a store itself, not through a server: run it on the server's "
            "machine with its --home (no --url, --server or $TORPOR_URL)",
            option="--url" if o.url else "--server",
        )
    mem = Memory(o.home, token=o.token, tenant=o.tenant, embedder="default")
    ctx.call_on_close(mem.close)
    if mem.embedder is None:
        raise InvalidArgument(f"no local embedding model: {INSTALL_HINT}")
    n = mem.reindex(batch=batch)
    _emit(ctx, {"reindexed": n}, f"embedded {n} record(s) with {mem.embedder.name}")


def register(root: typer.Typer) -> None:
    """Add the ``memory`` group to the ``torpor`` app."""
    root.add_typer(app, name="memory")
