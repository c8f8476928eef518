"""The MCP tools, written once: memory (remember, recall, ...) and sandboxes (exec, fork, ...).

:func:`build_server` registers the tools on an :class:`mcp.server.mcpserver.MCPServer`. A tool
never decides who is calling: it asks the server's ``get_context(ctx)`` for a
:class:`ToolContext` (the tenant, a memory of that tenant, the sandbox operations, and the
memory scope the caller is bound to), so the same tools serve

* the HTTP server's ``/mcp`` (:mod:`torpor.server.mcp.http`: the context comes from the bearer
  token, over the app's own manager),
* ``torpor mcp`` on stdio (:mod:`torpor.cli.mcp`: the embedded memory and the SDK), and
* the agent inside a sandbox (``localhost:7777``, relayed: the sandbox's tenant and scope).

Tool arguments are checked by their JSON schema first, then by the same request models the
HTTP API uses (:mod:`torpor.sandbox.requests`), so the bounds are the same everywhere. Every
:class:`~torpor.errors.TorporError` reaches the client as a tool error (``is_error``) whose text
starts with the error's class name (``"SandboxNotFound: no sandbox 'x'"``); anything else is
logged here and reported without its details.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Protocol

import anyio.to_thread
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations
from pydantic import Field

from torpor._version import __version__
from torpor.config import LIMITS
from torpor.errors import AccessDenied, InvalidArgument, TorporError
from torpor.sandbox.models import CommandResult, Execution, SandboxInfo
from torpor.sandbox.requests import CodeSpec, CommandSpec, ForkSpec, SandboxOptions, SnapshotSpec

__all__ = [
    "LEVELS",
    "MEMORY_TOOLS",
    "SANDBOX_TOOLS",
    "ContextGetter",
    "SandboxOps",
    "ToolContext",
    "build_server",
]

log = logging.getLogger(__name__)

#: the memory scope levels below the tenant, outermost first
LEVELS = ("app", "user", "agent", "session")

MEMORY_TOOLS = (
    "remember",
    "recall",
    "context",
    "history",
    "forget",
    "profile_get",
    "profile_set",
)
SANDBOX_TOOLS = (
    "sandbox_get_or_create",
    "sandbox_exec",
    "sandbox_run_code",
    "sandbox_read_file",
    "sandbox_write_file",
    "sandbox_pause",
    "sandbox_snapshot",
    "sandbox_fork",
)

INSTRUCTIONS = """\
torpor: memory for this agent. Knowledge tools (remember, recall, context, history, forget,
profile_get, profile_set) keep facts, preferences and a profile per scope (app > user > agent >
session); recall and context rank the most specific scope first. Sandbox tools (when offered)
give the agent a persistent machine: a named sandbox keeps its RAM, processes and files across
pauses, and any call wakes it."""


class SandboxOps(Protocol):
    """What the sandbox tools need, for one tenant: the server's manager or the SDK."""

    async def get_or_create(self, name: str, options: SandboxOptions) -> SandboxInfo: ...
    async def run_command(self, sandbox: str, spec: CommandSpec) -> CommandResult: ...
    async def run_code(self, sandbox: str, spec: CodeSpec) -> Execution: ...
    async def read_file(self, sandbox: str, path: str) -> bytes: ...
    async def write_file(self, sandbox: str, path: str, data: bytes) -> None: ...
    async def pause(self, sandbox: str) -> SandboxInfo: ...
    async def snapshot(self, sandbox: str, spec: SnapshotSpec) -> Mapping[str, Any]: ...
    async def fork(self, sandbox: str, spec: ForkSpec) -> list[SandboxInfo]: ...


@dataclass
class ToolContext:
    """Who a tool call acts for, and with what.

    ``memory``: a :class:`torpor.Memory` of ``tenant`` (or a client with its API);
    ``sandboxes``: None where sandbox tools are not offered (inside a sandbox);
    ``scope``: levels the caller is bound to (a sandbox's ``memory_scope``): a call may add
    levels below them but never name others; ``read_only``: writes are refused.
    ``deny``: ``deny(action, scope, message)`` writes the audit entry of a refusal decided
    here and returns the :class:`AccessDenied` to raise (None: refusals are not audited, as
    for ``torpor mcp`` on the caller's own store).
    """

    tenant: str
    memory: Any
    sandboxes: SandboxOps | None = None
    scope: dict[str, str] = field(default_factory=dict)
    read_only: bool = False
    deny: Callable[[str, str, str], AccessDenied] | None = None

    def refuse(self, action: str, scope: str, message: str) -> AccessDenied:
        """The :class:`AccessDenied` of a refusal (audited through :attr:`deny`)."""
        if self.deny is not None:
            return self.deny(action, scope, message)
        return AccessDenied(message, tenant=self.tenant, scope=scope)

    def levels(self, given: Mapping[str, str | None], action: str = "mcp") -> dict[str, str]:
        """The scope levels of a call: ``given`` within :attr:`scope`.

        Raises :class:`AccessDenied` (audited, see :attr:`deny`) when ``given`` names a level
        the caller is bound to with another value, or adds a level above the deepest one it
        is bound to (bound to a session, a call naming an app would reach
        ``app/<x>/session/<s>`` and, through recall's ancestors, that app's own records).
        """
        out = dict(self.scope)
        deepest = max((LEVELS.index(lv) for lv in self.scope), default=-1)
        for level in LEVELS:
            value = given.get(level)
            if value is None:
                continue
            bound = self.scope.get(level)
            if bound is not None and bound != value:
                raise self.refuse(
                    action, level, f"this caller is bound to {level} {bound!r}, not {value!r}"
                )
            if bound is None and LEVELS.index(level) < deepest:
                raise self.refuse(
                    action,
                    level,
                    f"this caller is bound to {LEVELS[deepest]} {self.scope[LEVELS[deepest]]!r}"
                    f" and may only name levels below it, not {level}",
                )
            out[level] = value
        return out

    def writable(self, action: str = "mcp") -> None:
        """Raises :class:`AccessDenied` (audited, see :attr:`deny`) if this caller may only
        read."""
        if self.read_only:
            raise self.refuse(action, "", "this caller's memory is read-only")


#: how the tools learn who is calling (one function per transport, see the module docstring)
ContextGetter = Callable[[Context], Awaitable[ToolContext]]

# -- argument types (their descriptions become the JSON schema) --------------------------------

App = Annotated[str | None, Field(description="memory scope: the application, e.g. 'support'")]
User = Annotated[str | None, Field(description="memory scope: the end user, e.g. 'u-42'")]
Agent = Annotated[str | None, Field(description="memory scope: the agent, below the user")]
Session = Annotated[str | None, Field(description="memory scope: one conversation")]
SandboxRef = Annotated[str, Field(min_length=1, description="the sandbox's name or id")]
GuestPath = Annotated[str, Field(min_length=1, description="a path inside the sandbox")]

_READ = ToolAnnotations(read_only_hint=True, open_world_hint=False)
_WRITE = ToolAnnotations(read_only_hint=False, destructive_hint=False, open_world_hint=False)
_ERASE = ToolAnnotations(read_only_hint=False, destructive_hint=True, open_world_hint=False)


def _lv(
    app: str | None, user: str | None, agent: str | None, session: str | None
) -> dict[str, str | None]:
    return {"app": app, "user": user, "agent": agent, "session": session}


def _json(model: Any) -> dict[str, Any]:
    dumped: dict[str, Any] = model.model_dump(mode="json")
    return dumped


async def _call(what: str, fn: Callable[[], Awaitable[Any]]) -> Any:
    """Run one tool body: typed errors become tool errors the model can read."""
    try:
        return await fn()
    except TorporError as exc:
        raise ToolError(f"{type(exc).__name__}: {exc}") from exc
    except ToolError:
        raise
    except Exception as exc:  # a bug below us: the log has it, the caller gets its kind
        log.exception("MCP tool %s failed", what)
        raise ToolError(f"TorporError: internal error in {what}: {type(exc).__name__}") from exc


def build_server(
    get_context: ContextGetter,
    *,
    sandbox_tools: bool = True,
    name: str = "torpor",
) -> MCPServer:
    """An MCP server with torpor's tools; ``get_context`` says who each call acts for.

    ``sandbox_tools``: offer the sandbox tools too (not inside a sandbox).
    """
    server: MCPServer = MCPServer(
        name, version=__version__, instructions=INSTRUCTIONS, log_level="WARNING"
    )

    async def scoped(
        ctx: Context,
        tool: str,
        write: bool,
        levels: dict[str, str | None],
        op: Callable[[Any], Any],
    ) -> Any:
        """``op(scope)`` on the caller's scope, in one worker thread (the store is sync);
        ``tool`` names the call in the audit entry of a refusal."""
        tc = await get_context(ctx)
        action = f"mcp {tool}"
        if write:
            tc.writable(action)
        lv = tc.levels(levels, action)
        return await anyio.to_thread.run_sync(lambda: op(tc.memory.scope(**lv)))

    async def sandboxes(ctx: Context, tool: str) -> SandboxOps:
        tc = await get_context(ctx)
        if tc.sandboxes is None:
            raise tc.refuse(f"mcp {tool}", "", "sandbox tools are not offered here")
        return tc.sandboxes

    # -- memory ---------------------------------------------------------------------------

    @server.tool(annotations=_WRITE)
    async def remember(
        ctx: Context,
        text: Annotated[str, Field(min_length=1, description="the fact, in one sentence")],
        key: Annotated[
            str | None,
            Field(description="a stable name; a new fact with the same key supersedes the old"),
        ] = None,
        metadata: Annotated[
            dict[str, Any] | None, Field(description="small JSON object kept with the fact")
        ] = None,
        app: App = None,
        user: User = None,
        agent: Agent = None,
        session: Session = None,
    ) -> dict[str, Any]:
        """Store a fact in memory (a preference, a decision, something learned).

        With `key`, it replaces the current fact with that key in the same scope; the old one
        stays in `history`. Returns the stored fact with its id."""

        async def run() -> dict[str, Any]:
            fact = await scoped(
                ctx,
                "remember",
                True,
                _lv(app, user, agent, session),
                lambda sm: sm.remember(text, key=key, metadata=metadata),
            )
            return _json(fact)

        result: dict[str, Any] = await _call("remember", run)
        return result

    @server.tool(annotations=_READ)
    async def recall(
        ctx: Context,
        query: Annotated[str, Field(min_length=1, description="what to look for")],
        k: Annotated[int, Field(ge=1, le=100, description="how many results")] = 5,
        kind: Annotated[
            Literal["fact", "episode"] | None, Field(description="only facts or only episodes")
        ] = None,
        app: App = None,
        user: User = None,
        agent: Agent = None,
        session: Session = None,
    ) -> dict[str, Any]:
        """Search memory: the best records for `query` from this scope and the scopes above it,
        the most specific scope first, then relevance, then recency."""

        async def run() -> dict[str, Any]:
            hits = await scoped(
                ctx,
                "recall",
                False,
                _lv(app, user, agent, session),
                lambda sm: sm.recall(query, k, kind=kind),
            )
            return {"hits": [_json(h) for h in hits]}

        result: dict[str, Any] = await _call("recall", run)
        return result

    @server.tool(annotations=_READ)
    async def context(
        ctx: Context,
        query: Annotated[str, Field(min_length=1, description="the task at hand")],
        budget_tokens: Annotated[
            int, Field(ge=1, le=100_000, description="the block's size limit")
        ] = 500,
        app: App = None,
        user: User = None,
        agent: Agent = None,
        session: Session = None,
    ) -> dict[str, Any]:
        """A prompt-ready block of what memory knows for a task: the profile, current facts
        (relevant first) and relevant episodes, never over `budget_tokens`."""

        async def run() -> dict[str, Any]:
            block = await scoped(
                ctx,
                "context",
                False,
                _lv(app, user, agent, session),
                lambda sm: sm.context(query, budget_tokens),
            )
            return {"text": block.text, "tokens": block.tokens, "ids": list(block.ids)}

        result: dict[str, Any] = await _call("context", run)
        return result

    @server.tool(annotations=_READ)
    async def history(
        ctx: Context,
        key: Annotated[str, Field(min_length=1, description="the fact's key")],
        app: App = None,
        user: User = None,
        agent: Agent = None,
        session: Session = None,
    ) -> dict[str, Any]:
        """Every fact ever stored under `key` in this scope, oldest first, with the time each
        was valid (`valid_from`, `valid_to`)."""

        async def run() -> dict[str, Any]:
            facts = await scoped(
                ctx, "history", False, _lv(app, user, agent, session), lambda sm: sm.history(key)
            )
            return {"facts": [_json(f) for f in facts]}

        result: dict[str, Any] = await _call("history", run)
        return result

    @server.tool(annotations=_ERASE)
    async def forget(
        ctx: Context,
        record_id: Annotated[str, Field(min_length=1, description="the record's id")],
        app: App = None,
        user: User = None,
        agent: Agent = None,
        session: Session = None,
    ) -> dict[str, Any]:
        """Erase one record (a fact or an episode) of this scope or below it, for good."""

        async def run() -> dict[str, Any]:
            n = await scoped(
                ctx, "forget", True, _lv(app, user, agent, session), lambda sm: sm.forget(record_id)
            )
            return {"erased": n}

        result: dict[str, Any] = await _call("forget", run)
        return result

    @server.tool(annotations=_READ)
    async def profile_get(
        ctx: Context,
        app: App = None,
        user: User = None,
        agent: Agent = None,
        session: Session = None,
    ) -> dict[str, Any]:
        """The scope's profile: a small JSON document of working memory (name, plan, ...);
        `{}` when none is set."""

        async def run() -> dict[str, Any]:
            levels = _lv(app, user, agent, session)
            return {
                "profile": await scoped(
                    ctx, "profile_get", False, levels, lambda sm: sm.get_profile()
                )
            }

        result: dict[str, Any] = await _call("profile_get", run)
        return result

    @server.tool(annotations=_WRITE)
    async def profile_set(
        ctx: Context,
        data: Annotated[dict[str, Any], Field(description="the profile fields")],
        merge: Annotated[
            bool, Field(description="update these fields only (false: replace the profile)")
        ] = True,
        app: App = None,
        user: User = None,
        agent: Agent = None,
        session: Session = None,
    ) -> dict[str, Any]:
        """Set the scope's profile (checked against its stored schema, if it has one)."""

        async def run() -> dict[str, Any]:
            doc = await scoped(
                ctx,
                "profile_set",
                True,
                _lv(app, user, agent, session),
                lambda sm: sm.set_profile(data, merge=merge),
            )
            return {"profile": dict(doc.data), "version": doc.version}

        result: dict[str, Any] = await _call("profile_set", run)
        return result

    if sandbox_tools:
        _sandbox_tools(server, sandboxes)
    return server


def _sandbox_tools(
    server: MCPServer, sandboxes: Callable[[Context, str], Awaitable[SandboxOps]]
) -> None:
    @server.tool(annotations=_WRITE)
    async def sandbox_get_or_create(
        ctx: Context,
        name: Annotated[
            str, Field(min_length=1, description="the sandbox's name, e.g. agent-u-42")
        ],
        labels: Annotated[
            dict[str, str] | None, Field(description="labels for a new sandbox")
        ] = None,
        template: Annotated[str | None, Field(description="template (default: python)")] = None,
        idle_pause_seconds: Annotated[
            int | None, Field(description="hibernate after this many idle seconds")
        ] = None,
    ) -> dict[str, Any]:
        """The agent's persistent machine: the sandbox called `name`, woken if it was paused
        (`reused` is true), or a new one. Its RAM, processes and files survive pauses."""

        async def run() -> dict[str, Any]:
            options = SandboxOptions.of(
                labels=labels, template=template, idle_pause_seconds=idle_pause_seconds
            )
            return _json(
                await (await sandboxes(ctx, "sandbox_get_or_create")).get_or_create(name, options)
            )

        result: dict[str, Any] = await _call("sandbox_get_or_create", run)
        return result

    @server.tool(annotations=_WRITE)
    async def sandbox_exec(
        ctx: Context,
        sandbox: SandboxRef,
        cmd: Annotated[str, Field(min_length=1, description="a shell command line")],
        cwd: Annotated[str | None, Field(description="working directory")] = None,
        timeout: Annotated[
            float | None, Field(gt=0, description="seconds before it is killed")
        ] = 60.0,
    ) -> dict[str, Any]:
        """Run a shell command in the sandbox (waking it if paused); returns exit_code, stdout
        and stderr."""

        async def run() -> dict[str, Any]:
            spec = CommandSpec.of(cmd=cmd, cwd=cwd, timeout=timeout)
            return _json(await (await sandboxes(ctx, "sandbox_exec")).run_command(sandbox, spec))

        result: dict[str, Any] = await _call("sandbox_exec", run)
        return result

    @server.tool(annotations=_WRITE)
    async def sandbox_run_code(
        ctx: Context,
        sandbox: SandboxRef,
        code: Annotated[str, Field(min_length=1, description="Python source")],
        timeout: Annotated[float | None, Field(gt=0, description="seconds")] = None,
    ) -> dict[str, Any]:
        """Run Python in the sandbox's long-lived interpreter: variables persist between calls
        and across pauses. Returns stdout, stderr, results (MIME bundles) and any error."""

        async def run() -> dict[str, Any]:
            spec = CodeSpec.of(code=code, timeout=timeout)
            return _json(await (await sandboxes(ctx, "sandbox_run_code")).run_code(sandbox, spec))

        result: dict[str, Any] = await _call("sandbox_run_code", run)
        return result

    @server.tool(annotations=_READ)
    async def sandbox_read_file(
        ctx: Context, sandbox: SandboxRef, path: GuestPath
    ) -> dict[str, Any]:
        """A text file's content from the sandbox (UTF-8; undecodable bytes are replaced)."""

        async def run() -> dict[str, Any]:
            data = await (await sandboxes(ctx, "sandbox_read_file")).read_file(sandbox, path)
            return {"path": path, "size": len(data), "content": data.decode("utf-8", "replace")}

        result: dict[str, Any] = await _call("sandbox_read_file", run)
        return result

    @server.tool(annotations=_WRITE)
    async def sandbox_write_file(
        ctx: Context,
        sandbox: SandboxRef,
        path: GuestPath,
        content: Annotated[str, Field(description="the text to write (UTF-8)")],
    ) -> dict[str, Any]:
        """Write a text file in the sandbox (parents created, replaced atomically)."""

        async def run() -> dict[str, Any]:
            data = content.encode("utf-8")
            await (await sandboxes(ctx, "sandbox_write_file")).write_file(sandbox, path, data)
            return {"path": path, "size": len(data)}

        result: dict[str, Any] = await _call("sandbox_write_file", run)
        return result

    @server.tool(annotations=_WRITE)
    async def sandbox_pause(ctx: Context, sandbox: SandboxRef) -> dict[str, Any]:
        """Hibernate the sandbox to disk (RAM, processes and all); the next call wakes it."""

        async def run() -> dict[str, Any]:
            return _json(await (await sandboxes(ctx, "sandbox_pause")).pause(sandbox))

        result: dict[str, Any] = await _call("sandbox_pause", run)
        return result

    @server.tool(annotations=_WRITE)
    async def sandbox_snapshot(
        ctx: Context,
        sandbox: SandboxRef,
        name: Annotated[str | None, Field(description="the snapshot's name")] = None,
        retention_days: Annotated[int | None, Field(ge=1, le=365, description="keep it")] = None,
    ) -> dict[str, Any]:
        """An immutable checkpoint of the whole machine (RAM + disk) to restore or fork later."""

        async def run() -> dict[str, Any]:
            spec = SnapshotSpec.of(name=name, retention_days=retention_days)
            return dict(await (await sandboxes(ctx, "sandbox_snapshot")).snapshot(sandbox, spec))

        result: dict[str, Any] = await _call("sandbox_snapshot", run)
        return result

    @server.tool(annotations=_WRITE)
    async def sandbox_fork(
        ctx: Context,
        sandbox: SandboxRef,
        count: Annotated[
            int, Field(ge=1, le=LIMITS.max_fork_count, description="how many copies")
        ] = 1,
    ) -> dict[str, Any]:
        """Branch the running machine: `count` new sandboxes, each a copy of this one's RAM,
        processes and files (to try several approaches at once)."""

        async def run() -> dict[str, Any]:
            children = await (await sandboxes(ctx, "sandbox_fork")).fork(
                sandbox, ForkSpec.of(count=count)
            )
            return {"sandboxes": [_json(c) for c in children]}

        result: dict[str, Any] = await _call("sandbox_fork", run)
        return result


def check_levels(levels: Mapping[str, Any]) -> dict[str, str]:
    """``levels`` as a scope binding: only :data:`LEVELS`, non-empty strings.

    Raises :class:`InvalidArgument`.
    """
    unknown = set(levels) - set(LEVELS)
    if unknown:
        raise InvalidArgument(f"unknown memory scope levels {sorted(unknown)}")
    out = {}
    for level, value in levels.items():
        if value is None:
            continue
        if not isinstance(value, str) or not value:
            raise InvalidArgument(f"memory scope {level} must be a non-empty string")
        out[level] = value
    return out
