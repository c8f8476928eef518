"""The MCP tools, through the official SDK's own client, over both transports.

Streamable HTTP: a real uvicorn server on TCP with two tenants' tokens, the real
SandboxManager over the manager's fake engine (no VMs) and the server's own memory, on the
embedded SQLite store and on PostgreSQL (every test taking ``url`` runs on both).
stdio: ``python3 -m torpor.cli mcp`` as a desktop client would start it.
Bad input: malformed MCP messages, unknown tools, bad arguments, wrong tokens.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import httpx
import httpx2
import pytest
import uvicorn
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp.types import CallToolResult

from tests.pg import MEMORY_BACKENDS, memory_spec
from tests.sandbox.fakes import FakeEngine
from tests.served import stop_server_and_vms
from torpor.config import paths
from torpor.errors import AccessDenied, InvalidArgument, Unauthenticated
from torpor.memory import Memory
from torpor.sandbox.manager import SandboxManager
from torpor.sandbox.requests import CommandSpec, SandboxOptions
from torpor.server.app import create_app
from torpor.server.auth import TokenStore
from torpor.server.mcp.tools import MEMORY_TOOLS, SANDBOX_TOOLS, ToolContext

ACME, GLOBEX = "a" * 32, "g" * 32
#: JSON-RPC error codes: a parse error; an invalid request or invalid params (the SDK answers
#: a message that is not a valid request with either)
PARSE_ERROR, INVALID = (-32700,), (-32600, -32602)
MCP_HEADERS = {"Accept": "application/json, text/event-stream"}


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def tcp_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    return sock


#: tokens of two users of acme, each granted only its own memory scope and sandboxes
USER_TOKENS: dict[str, str] = {}


@pytest.fixture(params=MEMORY_BACKENDS)
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """``http://127.0.0.1:PORT/mcp`` of a real server with tenants acme and globex, and
    :data:`USER_TOKENS` of acme's users u-1 and u-2."""
    manager = SandboxManager(paths(tmp_path), engine=FakeEngine())
    app = create_app(
        manager,
        tokens=TokenStore({ACME: "acme", GLOBEX: "globex"}),
        supervise=False,
        memory=memory_spec(request),
        memory_embedder=None,
    )
    for user in ("u-1", "u-2"):
        USER_TOKENS[user] = app.state.identity.tokens.issue(
            "acme", [("write", f"app/support/user/{user}")], sandboxes={"user": user}
        )
    sock = tcp_socket()
    server = uvicorn.Server(uvicorn.Config(app, lifespan="on", log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/mcp"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def with_client(url: str, token: str, body: Callable[[Client], Awaitable[Any]]) -> Any:
    """Run ``body(client)`` with an SDK client connected to ``url`` as ``token``."""

    async def main() -> Any:
        async with (
            httpx2.AsyncClient(headers=auth(token), timeout=60) as http,
            Client(streamable_http_client(url, http_client=http)) as client,
        ):
            return await body(client)

    return asyncio.run(main())


def data(result: CallToolResult) -> dict[str, Any]:
    assert not result.is_error, result.content
    assert isinstance(result.structured_content, dict)
    return dict(result.structured_content)


def error_text(result: CallToolResult) -> str:
    assert result.is_error
    text = result.content[0]
    assert text.type == "text"
    return text.text


# -- streamable HTTP -------------------------------------------------------------------------


def test_tools_are_listed_with_descriptions_and_schemas(url: str) -> None:
    async def body(c: Client) -> Any:
        return (await c.list_tools()).tools

    tools = {t.name: t for t in with_client(url, ACME, body)}
    assert set(tools) == set(MEMORY_TOOLS) | set(SANDBOX_TOOLS)
    for tool in tools.values():
        assert tool.description and len(tool.description) > 30, tool.name
        assert tool.input_schema["type"] == "object"
        assert "ctx" not in tool.input_schema["properties"]  # the SDK's context is not an argument
    recall = tools["recall"].input_schema
    assert recall["required"] == ["query"]
    assert recall["properties"]["k"]["maximum"] == 100
    assert "description" in recall["properties"]["user"]
    assert tools["recall"].annotations is not None and tools["recall"].annotations.read_only_hint


def test_memory_round_trip_and_supersede(url: str) -> None:
    async def body(c: Client) -> Any:
        u = {"app": "support", "user": "u-42"}
        first = data(
            await c.call_tool(
                "remember", {"text": "prefers weekly summaries", "key": "cadence", **u}
            )
        )
        data(
            await c.call_tool(
                "remember", {"text": "prefers daily summaries", "key": "cadence", **u}
            )
        )
        hits = data(await c.call_tool("recall", {"query": "summaries", "k": 3, **u}))["hits"]
        block = data(
            await c.call_tool("context", {"query": "write an update", "budget_tokens": 200, **u})
        )
        history = data(await c.call_tool("history", {"key": "cadence", **u}))["facts"]
        data(await c.call_tool("profile_set", {"data": {"plan": "pro"}, **u}))
        data(await c.call_tool("profile_set", {"data": {"name": "Jordan"}, **u}))  # merged
        profile = data(await c.call_tool("profile_get", u))["profile"]
        erased = data(await c.call_tool("forget", {"record_id": first["id"], **u}))
        after = data(await c.call_tool("history", {"key": "cadence", **u}))["facts"]
        return hits, block, history, profile, erased, after

    hits, block, history, profile, erased, after = with_client(url, ACME, body)
    assert [h["record"]["text"] for h in hits] == ["prefers daily summaries"]
    assert "prefers daily summaries" in block["text"] and block["tokens"] <= 200
    assert [f["text"] for f in history] == ["prefers weekly summaries", "prefers daily summaries"]
    assert history[0]["valid_to"] is not None and history[1]["valid_to"] is None
    assert profile == {"plan": "pro", "name": "Jordan"}
    assert erased == {"erased": 1}
    assert [f["text"] for f in after] == ["prefers daily summaries"]


def test_the_token_decides_the_tenant(url: str) -> None:
    async def remember(c: Client) -> Any:
        return data(await c.call_tool("remember", {"text": "acme secret plan", "user": "u-1"}))

    async def recall(c: Client) -> Any:
        hits = data(await c.call_tool("recall", {"query": "secret plan", "user": "u-1"}))["hits"]
        made = data(await c.call_tool("sandbox_get_or_create", {"name": "agent-u-1"}))
        return hits, made

    fact = with_client(url, ACME, remember)
    hits, made = with_client(url, GLOBEX, recall)
    assert hits == []  # globex never sees acme's memory, whatever scope it names
    assert made["tenant"] == "globex"

    async def forget(c: Client) -> Any:
        return await c.call_tool("forget", {"record_id": fact["id"], "user": "u-1"})

    assert "RecordNotFound" in error_text(with_client(url, GLOBEX, forget))


def test_sandbox_tools(url: str) -> None:
    async def body(c: Client) -> Any:
        made = data(
            await c.call_tool(
                "sandbox_get_or_create", {"name": "agent-u-42", "labels": {"user": "u-42"}}
            )
        )
        ran = data(await c.call_tool("sandbox_exec", {"sandbox": "agent-u-42", "cmd": "echo hi"}))
        code = data(
            await c.call_tool("sandbox_run_code", {"sandbox": "agent-u-42", "code": "1 + 1"})
        )
        data(
            await c.call_tool(
                "sandbox_write_file",
                {"sandbox": "agent-u-42", "path": "/workspace/m.md", "content": "héllo"},
            )
        )
        read = data(
            await c.call_tool(
                "sandbox_read_file", {"sandbox": "agent-u-42", "path": "/workspace/m.md"}
            )
        )
        paused = data(await c.call_tool("sandbox_pause", {"sandbox": "agent-u-42"}))
        again = data(await c.call_tool("sandbox_get_or_create", {"name": "agent-u-42"}))
        return made, ran, code, read, paused, again

    made, ran, code, read, paused, again = with_client(url, ACME, body)
    assert made["tenant"] == "acme" and made["labels"] == {"user": "u-42"}
    assert ran["exit_code"] == 0 and ran["stdout"] == "hi\n"
    assert "results" in code
    assert read["content"] == "héllo" and read["size"] == len("héllo".encode())
    assert paused["state"] == "paused"
    assert again["reused"] is True and again["id"] == made["id"]


# -- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tool", "args", "expected"),
    [
        pytest.param("recall", {"query": ""}, "validation error", id="empty-query"),
        pytest.param("recall", {"query": "x", "k": 0}, "validation error", id="k-out-of-range"),
        pytest.param("recall", {}, "validation error", id="missing-argument"),
        pytest.param("remember", {"text": "x", "user": "a/b"}, "InvalidArgument", id="bad-scope"),
        pytest.param("remember", {"text": "x" * 200_000}, "PayloadTooLarge", id="oversized"),
        pytest.param("history", {"key": "never"}, "RecordNotFound", id="unknown-key"),
        pytest.param(
            "sandbox_exec", {"sandbox": "nosuch", "cmd": "true"}, "SandboxNotFound", id="no-sandbox"
        ),
        pytest.param(
            "sandbox_snapshot",
            {"sandbox": "x", "retention_days": 999},
            "validation error",
            id="bad-retention",
        ),
        pytest.param("no_such_tool", {}, "Unknown tool", id="unknown-tool"),
    ],
)
def test_bad_calls_are_tool_errors(
    url: str, tool: str, args: dict[str, Any], expected: str
) -> None:
    async def body(c: Client) -> Any:
        bad = await c.call_tool(tool, args)
        fine = await c.call_tool("profile_get", {})  # the connection is still good
        return bad, fine

    bad, fine = with_client(url, ACME, body)
    assert expected in error_text(bad)
    assert not fine.is_error


@pytest.mark.parametrize(
    "headers",
    [
        pytest.param({}, id="no-token"),
        pytest.param({"Authorization": "Bearer " + "z" * 32}, id="unknown-token"),
        pytest.param({"Authorization": "Basic " + ACME}, id="not-bearer"),
    ],
)
def test_a_refused_token_gets_the_typed_error(url: str, headers: dict[str, str]) -> None:
    message = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
    r = httpx.post(url, json=message, headers={**MCP_HEADERS, **headers})
    assert r.status_code == Unauthenticated.http_status == 401
    assert r.json()["error"]["type"] == "Unauthenticated"


def test_the_sdk_client_with_a_wrong_token_fails_cleanly(url: str) -> None:
    async def body(c: Client) -> Any:
        return await c.list_tools()

    with pytest.raises(BaseException) as info:  # the SDK raises its own error (in a group)
        with_client(url, "w" * 32, body)
    assert (
        "401" in repr(info.value)
        or "Unauthenticated" in repr(info.value)
        or info.group_contains(MCPError)
    )


@pytest.mark.parametrize(
    ("body", "codes"),
    [
        pytest.param(b"{not json", PARSE_ERROR, id="not-json"),
        pytest.param(b'{"jsonrpc": "2.0", "id": 1}', INVALID, id="no-method"),
        pytest.param(
            b'{"jsonrpc": "1.0", "id": 1, "method": "tools/list"}', INVALID, id="bad-version"
        ),
        pytest.param(b"[1, 2, 3]", INVALID, id="not-a-message"),
        pytest.param(
            b'{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": 5}}',
            INVALID,
            id="bad-params",
        ),
        pytest.param(
            b'{"jsonrpc": "2.0", "id": 1, "method": "no/such"}', (-32601,), id="no-such-method"
        ),
    ],
)
def test_malformed_messages_get_json_rpc_errors(
    url: str, body: bytes, codes: tuple[int, ...]
) -> None:
    headers = {**MCP_HEADERS, "Content-Type": "application/json", **auth(ACME)}
    r = httpx.post(url, content=body, headers=headers)
    assert r.status_code < 500, r.text
    assert r.json()["error"]["code"] in codes, r.text


def test_other_methods_and_oversized_bodies_are_refused(url: str) -> None:
    auth = {"Authorization": f"Bearer {ACME}"}
    assert httpx.put(url, headers=auth).status_code == 405
    big = (
        b'{"jsonrpc": "2.0", "id": 1, "method": "tools/list", "pad": "' + b"x" * (64 << 20) + b'"}'
    )
    r = httpx.post(
        url, content=big, headers={**MCP_HEADERS, **auth, "Content-Type": "application/json"}
    )
    assert r.status_code == 413


def test_a_get_opens_no_stream_that_never_ends(url: str) -> None:
    # the endpoint is stateless and answers each POST whole: a GET's event stream carried
    # nothing and never ended, holding a server task per connection for as long as the
    # client kept it open (past its token's revocation); MCP lets a server answer 405
    r = httpx.get(url, headers={**MCP_HEADERS, **auth(ACME)}, timeout=10)
    assert r.status_code == 405


# -- stdio -----------------------------------------------------------------------------------


def test_stdio_server_of_the_cli(tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = {**os.environ, "TORPOR_HOME": str(home), "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("TORPOR_URL", None)
    params = StdioServerParameters(
        command=sys.executable, args=["-m", "torpor.cli", "mcp", "--lexical"], env=env
    )

    async def main() -> Any:
        async with Client(params) as c:
            names = [t.name for t in (await c.list_tools()).tools]
            data(await c.call_tool("remember", {"text": "likes green tea", "user": "u-1"}))
            hits = data(await c.call_tool("recall", {"query": "tea", "user": "u-1"}))["hits"]
            bad = await c.call_tool("recall", {"query": "tea", "k": "many"})
            missing = await c.call_tool("sandbox_exec", {"sandbox": "nosuch", "cmd": "true"})
            return names, hits, bad, missing

    try:
        names, hits, bad, missing = asyncio.run(main())
    finally:
        stop_server_and_vms(home)  # the sandbox call started the local server
    assert set(names) == set(MEMORY_TOOLS) | set(SANDBOX_TOOLS)
    assert [h["record"]["text"] for h in hits] == ["likes green tea"]
    assert "validation error" in error_text(bad)
    assert "SandboxNotFound" in error_text(missing)
    # the memory is the embedded store of that home, as torpor.Memory() sees it
    with Memory(home, embedder=None) as mem:
        assert [h.record.text for h in mem.scope(user="u-1").recall("tea")] == ["likes green tea"]


class _Recorder:
    """Stands for a Runtime: answers every request ``{}`` and notes the path sent."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        self.sent.append(
            httpx.Client(base_url="http://torpor").build_request(method, path).url.path
        )
        return httpx.Response(200, content=b"{}")

    def json(self, method: str, path: str, **kwargs: Any) -> Any:
        self.request(method, path)
        return {}


@pytest.mark.parametrize("ref", ["", ".", ".."])
def test_the_stdio_sandbox_tools_send_no_ref_that_names_another_path(ref: str) -> None:
    # "." was "/v1/sandboxes/./files", sent as "/v1/sandboxes/files": sandbox_read_file
    # answered the record of a sandbox called "files" as the file's content
    from torpor.server.mcp.sdk import RuntimeOps

    runtime = _Recorder()
    ops = RuntimeOps(runtime)  # type: ignore[arg-type]
    calls: list[Callable[[], Coroutine[Any, Any, Any]]] = [
        lambda: ops.read_file(ref, "/etc/hostname"),
        lambda: ops.write_file(ref, "/tmp/x", b"x"),
        lambda: ops.run_command(ref, CommandSpec.of(cmd="true")),
        lambda: ops.pause(ref),
        lambda: ops.get_or_create(ref, SandboxOptions.of()),
    ]
    for call in calls:
        with pytest.raises(InvalidArgument):
            asyncio.run(call())
    assert runtime.sent == []


# -- the caller's binding --------------------------------------------------------------------


def test_a_bound_caller_may_narrow_but_not_leave_its_scope() -> None:
    tc = ToolContext(tenant="acme", memory=None, scope={"app": "support", "user": "u-42"})
    assert tc.levels({"agent": "a1"}) == {"app": "support", "user": "u-42", "agent": "a1"}
    assert tc.levels({"user": "u-42"}) == {"app": "support", "user": "u-42"}
    with pytest.raises(AccessDenied):
        tc.levels({"user": "u-43"})
    with pytest.raises(AccessDenied):
        ToolContext(tenant="acme", memory=None, read_only=True).writable()


def test_a_users_token_reaches_only_that_users_memory_and_sandboxes(url: str) -> None:
    """One identity: a token granted one user's scope and sandboxes (label user=u-1) cannot
    read the other user's memory or reach the other user's sandbox through MCP either."""
    u1 = {"app": "support", "user": "u-1"}
    u2 = {"app": "support", "user": "u-2"}

    async def first(c: Client) -> Any:
        fact = data(await c.call_tool("remember", {"text": "u-1 likes tea", **u1}))
        made = data(await c.call_tool("sandbox_get_or_create", {"name": "agent-u-1"}))
        own = data(await c.call_tool("sandbox_exec", {"sandbox": "agent-u-1", "cmd": "echo ok"}))
        return fact, made, own

    fact, made, own = with_client(url, USER_TOKENS["u-1"], first)
    assert made["labels"] == {"user": "u-1"}  # the token's selector labels what it makes
    assert own["stdout"] == "ok\n"

    async def second(c: Client) -> Any:
        return (
            await c.call_tool("recall", {"query": "tea", **u1}),
            await c.call_tool("forget", {"record_id": fact["id"], **u1}),
            await c.call_tool("sandbox_exec", {"sandbox": "agent-u-1", "cmd": "echo hi"}),
            await c.call_tool("sandbox_get_or_create", {"name": "agent-u-1"}),
            await c.call_tool(
                "sandbox_get_or_create", {"name": "agent-x", "labels": {"user": "u-1"}}
            ),
            await c.call_tool("sandbox_snapshot", {"sandbox": "agent-u-1"}),
            data(await c.call_tool("recall", {"query": "tea", **u2}))["hits"],
        )

    recall, forget, exec_, take, mislabel, snap, own_hits = with_client(
        url, USER_TOKENS["u-2"], second
    )
    assert ": AccessDenied: " in error_text(recall)
    assert ": AccessDenied: " in error_text(forget)
    assert ": SandboxNotFound: " in error_text(exec_)  # as over HTTP: nothing leaks
    assert ": AccessDenied: " in error_text(take)
    assert ": AccessDenied: " in error_text(mislabel)
    assert ": SandboxNotFound: " in error_text(snap)  # another's sandbox, as for exec
    assert own_hits == []
