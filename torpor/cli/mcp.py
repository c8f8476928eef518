"""``torpor mcp``: torpor's MCP tools on stdio, for desktop clients (Claude Desktop, Cursor ...).

The client starts ``torpor mcp`` and speaks MCP over its stdin/stdout. Memory is the embedded
store of ``$TORPOR_HOME`` (tenant ``default``); sandboxes go through the local server, started
on demand. With ``$TORPOR_URL`` and ``$TORPOR_TOKEN`` set, everything goes to that server as
that token's tenant instead (memory through ``Runtime.memory``, the remote memory client).
The tools are those of the server's ``/mcp`` (:mod:`torpor.server.mcp.tools`).
"""

from __future__ import annotations

import logging
import sys
from typing import Annotated, Any

import typer

__all__ = ["mcp", "register"]


class _NoMemory:
    """Stands for a remote server's memory when this SDK has no client for it."""

    def __init__(self, url: str) -> None:
        self.url = url

    def scope(self, **levels: Any) -> Any:
        from torpor.errors import InvalidArgument

        raise InvalidArgument(f"this SDK cannot reach the memory of {self.url} (no Runtime.memory)")

    def close(self) -> None:
        pass


def mcp(
    lexical: Annotated[
        bool, typer.Option("--lexical", help="recall without the embedding model (faster start)")
    ] = False,
    sandboxes: Annotated[
        bool, typer.Option("--sandboxes/--no-sandboxes", help="offer the sandbox tools too")
    ] = True,
    reranker: Annotated[
        str | None,
        typer.Option(
            envvar="TORPOR_RERANKER",
            help="recall's cross-encoder: none (default), default (the torpor rerank extra) "
            "or a model folder (local memory only: a server uses its own)",
        ),
    ] = None,
) -> None:
    """Serve torpor's MCP tools (memory and sandboxes) on stdin/stdout.

    Example (a client's config): {"command": "torpor", "args": ["mcp"]}
    """
    import anyio

    from torpor.client import Runtime
    from torpor.server.mcp.sdk import RuntimeOps
    from torpor.server.mcp.tools import ToolContext, build_server

    # stdout carries the protocol: every log line goes to stderr
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    runtime = Runtime()
    memory: Any
    if runtime.url is None:
        from torpor.memory import Memory

        memory = Memory(embedder=None if lexical else "default", reranker=reranker)
    else:
        memory = getattr(runtime, "memory", None) or _NoMemory(runtime.url)
    context = ToolContext(
        tenant=getattr(memory, "tenant", "default"),
        memory=memory,
        sandboxes=RuntimeOps(runtime) if sandboxes else None,
    )

    async def get_context(ctx: Any) -> ToolContext:
        return context

    server = build_server(get_context, sandbox_tools=sandboxes)
    try:
        anyio.run(server.run_stdio_async)
    finally:
        memory.close()
        runtime.close()


def register(app: typer.Typer) -> None:
    """Add ``mcp`` to the ``torpor`` command."""
    app.command("mcp")(mcp)
