"""``torpor token create|ls|revoke``: the server's tokens, one identity for both layers.

Each command is one call on :attr:`Runtime.tokens <torpor.client.Runtime.tokens>`: against the
local server (as the home's owner, who may manage any tenant's tokens, unless ``--token`` or
``$TORPOR_TOKEN`` names an admin token to act as) or, with ``--url`` and ``--token`` (or
``$TORPOR_URL`` / ``$TORPOR_TOKEN``), a remote one with an admin token::

    torpor token create --tenant acme --write app/support/user/u-42 --label user=u-42
    torpor token ls --tenant acme
    torpor token revoke 3f9c0a1b2c3d4e5f --tenant acme
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:
    from torpor.client import Runtime

__all__ = ["app", "register"]

app = typer.Typer(
    name="token", help="Tokens: tenant, memory grants, sandbox rights.", no_args_is_help=True
)
console = Console()

Url = Annotated[
    str | None, typer.Option(envvar="TORPOR_URL", help="a remote server (default: local)")
]
Token = Annotated[str | None, typer.Option(envvar="TORPOR_TOKEN", help="an admin token")]
TenantOpt = Annotated[
    str | None, typer.Option(help="the tenant (default: the caller's; others: owner only)")
]
AsJson = Annotated[bool, typer.Option("--json", help="print JSON")]


def _runtime(url: str | None, token: str | None) -> Runtime:
    """The server at ``url``, else the local one; as ``token`` when one is given (on the
    local server too: the home's owner only without one)."""
    from torpor.client import Runtime

    return Runtime(url=url or None, token=token or None)


@app.command("create")
def create(
    tenant: TenantOpt = None,
    read: Annotated[
        list[str] | None, typer.Option("--read", help="read grant on a scope prefix")
    ] = None,
    write: Annotated[
        list[str] | None, typer.Option("--write", help="write (and read) grant on a prefix")
    ] = None,
    label: Annotated[
        list[str] | None,
        typer.Option("--label", help="sandbox rights: only sandboxes with KEY=VALUE"),
    ] = None,
    all_sandboxes: Annotated[
        bool, typer.Option("--all-sandboxes", help="sandbox rights on every sandbox")
    ] = False,
    admin: Annotated[bool, typer.Option("--admin", help="may manage the tenant's tokens")] = False,
    name: Annotated[str, typer.Option(help="a note for lists")] = "",
    expires_in: Annotated[float | None, typer.Option(help="seconds until it expires")] = None,
    url: Url = None,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Create a token and print its secret (shown this once).

    Example: torpor token create --tenant acme --write app/support/user/u-42 --label user=u-42
    """
    from torpor.sandbox.models import parse_labels

    if all_sandboxes and label:
        raise typer.BadParameter("--label and --all-sandboxes exclude each other")
    sandboxes = {} if all_sandboxes else parse_labels(label, what="--label")
    rt = _runtime(url, token)
    new = rt.tokens.create(
        tenant=tenant,
        grants=[("read", p) for p in read or []] + [("write", p) for p in write or []],
        sandboxes=sandboxes,
        admin=admin,
        name=name,
        expires_in_seconds=expires_in,
    )
    if as_json:
        typer.echo(json.dumps(new.model_dump(mode="json"), indent=2))
    else:
        typer.echo(new.token)


@app.command("ls")
def ls(
    tenant: TenantOpt = None, url: Url = None, token: Token = None, as_json: AsJson = False
) -> None:
    """List a tenant's tokens (ids, rights; never secrets).

    Example: torpor token ls --tenant acme
    """
    rt = _runtime(url, token)
    rows = rt.tokens.list(tenant=tenant)
    if as_json:
        typer.echo(json.dumps([r.model_dump(mode="json") for r in rows], indent=2))
        return
    table = Table("id", "tenant", "name", "memory", "sandboxes", "admin", "state")
    for r in rows:
        grants = ", ".join(f"{g.mode}:{g.prefix or '/'}" for g in r.grants) or "-"
        boxes = (
            "-"
            if r.sandboxes is None
            else ",".join(f"{k}={v}" for k, v in r.sandboxes.items()) or "all"
        )
        state = "revoked" if r.revoked else (f"until {r.expires_at}" if r.expires_at else "live")
        cells = (r.id, r.tenant, r.name, grants, boxes, "yes" if r.admin else "", state)
        table.add_row(*(Text(cell) for cell in cells))
    console.print(table)


@app.command("revoke")
def revoke(
    token_id: Annotated[str, typer.Argument(help="the token's id (from 'torpor token ls')")],
    tenant: TenantOpt = None,
    url: Url = None,
    token: Token = None,
) -> None:
    """Revoke a token; the server refuses it from its next request on.

    Example: torpor token revoke 3f9c0a1b2c3d4e5f --tenant acme
    """
    rt = _runtime(url, token)
    rt.tokens.revoke(token_id, tenant=tenant)
    typer.echo(f"revoked {token_id}")


def register(root: typer.Typer) -> None:
    """Add the ``token`` group to the ``torpor`` app."""
    root.add_typer(app, name="token")
