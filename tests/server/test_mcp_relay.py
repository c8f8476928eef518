"""The host's side of ``localhost:7777`` (torpor.server.mcp.relay), without a VM: what a
sandbox's guest sends is answered for the sandbox's tenant and ``memory_scope`` only.
On the embedded SQLite store and on PostgreSQL. (tests/server/test_mcp_relay_qemu.py makes the
same calls from inside a real VM.)"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.pg import MEMORY_BACKENDS, memory_spec
from tests.sandbox.fakes import FakeEngine
from torpor.config import paths
from torpor.memory import Memory
from torpor.sandbox.manager import SandboxManager
from torpor.server.app import create_app
from torpor.server.auth import TokenStore

A = {"Authorization": "Bearer " + "a" * 32}
B = {"Authorization": "Bearer " + "b" * 32}
U42 = {"app": "support", "user": "u-42"}
JSON = {"content-type": "application/json"}
MCP = {**JSON, "accept": "application/json, text/event-stream"}


@pytest.fixture(params=MEMORY_BACKENDS)
def client(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TestClient]:
    manager = SandboxManager(paths(tmp_path), engine=FakeEngine())
    app = create_app(
        manager,
        tokens=TokenStore({"a" * 32: "acme", "b" * 32: "globex"}),
        supervise=False,
        memory=memory_spec(request),
        memory_embedder=None,
    )
    with TestClient(app) as c:
        yield c


def make(client: TestClient, name: str, headers: dict[str, str], **body: Any) -> dict[str, Any]:
    r = client.put(f"/v1/sandboxes/by-name/{name}", json=body, headers=headers)
    assert r.status_code == 200, r.text
    info: dict[str, Any] = r.json()
    return info


def guest(
    client: TestClient, sandbox_id: str, path: str, body: Any, headers: dict[str, str] = JSON
) -> tuple[int, Any]:
    """What the relay answers a request made inside ``sandbox_id``."""
    relay = client.app.state.guest_relay  # type: ignore[attr-defined]
    raw = json.dumps(body).encode()
    assert client.portal is not None
    status, _, answer = client.portal.call(relay, sandbox_id, "POST", path, headers, raw)
    return status, json.loads(answer)


def test_the_guest_reaches_its_scope_and_nothing_else(client: TestClient) -> None:
    sbx = make(client, "agent-u-42", A, memory_scope=U42)
    assert sbx["memory_scope"] == U42
    status, fact = guest(client, sbx["id"], "/v1/memory/remember", {"text": "likes green tea"})
    assert status == 200 and fact["scope"] == "app/support/user/u-42"
    status, found = guest(client, sbx["id"], "/v1/memory/recall", {"query": "tea"})
    assert status == 200
    assert [h["record"]["text"] for h in found["hits"]] == ["likes green tea"]
    # a level below its scope is fine; another user, app or a bad argument is refused
    status, _ = guest(client, sbx["id"], "/v1/memory/remember", {"text": "x", "session": "s1"})
    assert status == 200
    for other in ({"user": "u-43"}, {"app": "billing"}):
        status, err = guest(client, sbx["id"], "/v1/memory/recall", {"query": "tea", **other})
        assert (status, err["error"]["type"]) == (403, "AccessDenied")
    status, err = guest(client, sbx["id"], "/v1/memory/recall", {"query": ""})
    assert (status, err["error"]["type"]) == (400, "InvalidArgument")
    status, err = guest(client, sbx["id"], "/v1/memory/no_such_tool", {})
    assert (status, err["error"]["type"]) == (404, "NotFound")
    status, err = guest(client, sbx["id"], "/v1/memory/sandbox_exec", {"sandbox": "x", "cmd": "id"})
    assert status == 404  # no sandbox tools inside a sandbox
    # the memory is the tenant's own: its token sees the fact, another tenant's does not
    backend = client.app.state.memory_backend  # type: ignore[attr-defined]
    acme = Memory.attach(backend, "acme", embedder=None)
    assert [h.record.text for h in acme.scope(**U42).recall("green tea")] == ["likes green tea"]
    assert Memory.attach(backend, "globex", embedder=None).scope(**U42).recall("green tea") == []


def test_a_guest_cannot_name_a_level_above_its_binding(client: TestClient) -> None:
    """Bound to a session, naming an app and user would put the call at
    ``app/billing/user/alice/session/s1``, whose ancestors recall reads: refused."""
    acme = Memory.attach(client.app.state.memory_backend, "acme", embedder=None)  # type: ignore[attr-defined]
    acme.scope(app="billing", user="alice").remember("alice's card ends in 4242")
    sbx = make(client, "agent-s1", A, memory_scope={"session": "s1"})
    above = {"app": "billing", "user": "alice"}
    for path, body in (
        ("/v1/memory/recall", {"query": "card", **above}),
        ("/v1/memory/remember", {"text": "planted", **above}),
        ("/v1/memory/recall", {"query": "card", "user": "alice"}),
    ):
        status, err = guest(client, sbx["id"], path, body)
        assert (status, err["error"]["type"]) == (403, "AccessDenied"), (path, body, err)
    assert acme.scope(**above).get_all().total == 1  # nothing planted
    # between two bound levels is above the deepest one too; below it stays open
    both = make(client, "agent-a-s1", A, memory_scope={"app": "billing", "session": "s1"})
    status, err = guest(client, both["id"], "/v1/memory/recall", {"query": "card", "user": "alice"})
    assert (status, err["error"]["type"]) == (403, "AccessDenied")
    deep = make(client, "agent-u", A, memory_scope={"app": "billing", "user": "alice"})
    status, fact = guest(client, deep["id"], "/v1/memory/remember", {"text": "y", "session": "s2"})
    assert status == 200 and fact["scope"] == "app/billing/user/alice/session/s2"


def _refusals(client: TestClient, tenant: str) -> list[Any]:
    backend = client.app.state.memory_backend  # type: ignore[attr-defined]
    return [e for e in backend.audit_log(tenant, 1000) if not e.allowed]


def test_a_guests_refusals_are_audited(client: TestClient) -> None:
    """A guest naming another user's scope, or writing through a read-only binding, is in the
    tenant's audit log, by the sandbox, as every other refusal is."""
    sbx = make(client, "agent-u-42", A, memory_scope=U42)
    reader = make(client, "reader", A, memory_scope={**U42, "read_only": True})
    before = len(_refusals(client, "acme"))
    status, _ = guest(client, sbx["id"], "/v1/memory/recall", {"query": "x", "user": "u-43"})
    assert status == 403
    status, _ = guest(client, reader["id"], "/v1/memory/remember", {"text": "x"})
    assert status == 403
    refused = _refusals(client, "acme")[: len(_refusals(client, "acme")) - before]
    assert sorted(e.actor for e in refused) == sorted(
        [f"sandbox:{sbx['id']}", f"sandbox:{reader['id']}"]
    )
    assert {e.action for e in refused} == {"mcp recall", "mcp remember"}


def test_a_token_without_sandbox_rights_is_audited_over_mcp(client: TestClient) -> None:
    """/mcp's sandbox tools refuse a token without sandbox rights, audited as the sandbox
    routes refuse it."""
    identity = client.app.state.identity  # type: ignore[attr-defined]
    token = identity.tokens.issue("acme", [("write", "")], sandboxes=None)
    headers = {**MCP, "Authorization": f"Bearer {token}"}
    call = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": "sandbox_exec", "arguments": {"sandbox": "x", "cmd": "id"}},
    }
    before = len(_refusals(client, "acme"))
    answer = client.post("/mcp", json=call, headers=headers).json()
    assert answer["result"]["isError"], answer
    assert "AccessDenied" in answer["result"]["content"][0]["text"]
    refused = _refusals(client, "acme")
    assert len(refused) == before + 1 and refused[0].action == "mcp sandbox_exec"


def test_mcp_inside_the_sandbox(client: TestClient) -> None:
    sbx = make(client, "agent-u-42", A, memory_scope=U42)
    guest(client, sbx["id"], "/v1/memory/remember", {"text": "prefers daily summaries"})
    call = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": "recall", "arguments": {"query": "summaries"}},
    }
    status, answer = guest(client, sbx["id"], "/mcp", call, MCP)
    assert status == 200, answer
    hits = answer["result"]["structuredContent"]["hits"]
    assert [h["record"]["text"] for h in hits] == ["prefers daily summaries"]
    listed = {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}
    status, answer = guest(client, sbx["id"], "/mcp", listed, MCP)
    names = {t["name"] for t in answer["result"]["tools"]}
    assert "recall" in names and not any(n.startswith("sandbox_") for n in names)


def test_a_guest_opens_no_stream_that_never_ends(client: TestClient) -> None:
    # A GET of /mcp opened an event stream the stateless endpoint never writes to nor ends:
    # the host's answer task waited for ever (past a pause or a kill), one more per GET.
    sbx = make(client, "agent-u-42", A, memory_scope=U42)
    relay = client.app.state.guest_relay  # type: ignore[attr-defined]

    async def ask(method: str) -> tuple[int, dict[str, str], bytes]:
        headers = {"accept": "text/event-stream"}
        answer: tuple[int, dict[str, str], bytes] = await asyncio.wait_for(
            relay(sbx["id"], method, "/mcp", headers, b""), 10
        )
        return answer

    assert client.portal is not None
    for method in ("GET", "DELETE"):
        status, _, _ = client.portal.call(ask, method)
        assert status == 405


def test_a_deeply_nested_body_is_an_invalid_argument(client: TestClient) -> None:
    # json.loads raises RecursionError (no ValueError) for it: it escaped the route, and the
    # guest got a 500 while the host logged a traceback for each such call
    sbx = make(client, "agent-u-42", A, memory_scope=U42)
    relay = client.app.state.guest_relay  # type: ignore[attr-defined]
    nested = b"[" * 100_000 + b"]" * 100_000
    assert client.portal is not None
    status, _, answer = client.portal.call(
        relay, sbx["id"], "POST", "/v1/memory/recall", JSON, nested
    )
    assert (status, json.loads(answer)["error"]["type"]) == (400, "InvalidArgument")


def test_refusals(client: TestClient) -> None:
    plain = make(client, "no-scope", A)
    assert plain["memory_scope"] is None
    status, err = guest(client, plain["id"], "/v1/memory/recall", {"query": "x"})
    assert (status, err["error"]["type"]) == (403, "AccessDenied")
    status, err = guest(client, "sbx-000000000000", "/v1/memory/recall", {"query": "x"})
    assert (status, err["error"]["type"]) == (404, "SandboxNotFound")
    reader = make(client, "reader", A, memory_scope={**U42, "read_only": True})
    status, err = guest(client, reader["id"], "/v1/memory/remember", {"text": "x"})
    assert (status, err["error"]["type"]) == (403, "AccessDenied")
    status, _ = guest(client, reader["id"], "/v1/memory/recall", {"query": "x"})
    assert status == 200
    bad = client.put("/v1/sandboxes/by-name/bad", json={"memory_scope": {"user": "a/b"}}, headers=A)
    assert bad.status_code == 400
    bad = client.put("/v1/sandboxes/by-name/bad", json={"memory_scope": {"team": "x"}}, headers=A)
    assert bad.status_code == 400


def test_the_scope_survives_pause_and_wake(client: TestClient) -> None:
    # (forks need real machine files: tests/server/test_mcp_relay_qemu.py forks a real VM)
    sbx = make(client, "agent-u-42", A, memory_scope=U42)
    guest(client, sbx["id"], "/v1/memory/remember", {"text": "likes green tea"})
    assert client.post(f"/v1/sandboxes/{sbx['id']}/pause", headers=A).json()["state"] == "paused"
    woken = make(client, "agent-u-42", A, memory_scope=U42)
    assert woken["reused"] and woken["memory_scope"] == U42
    other = client.put(
        "/v1/sandboxes/by-name/agent-u-42", json={"memory_scope": {"user": "u-9"}}, headers=A
    )
    assert other.status_code == 409 and other.json()["error"]["type"] == "Conflict"
    status, found = guest(client, sbx["id"], "/v1/memory/recall", {"query": "tea"})
    assert status == 200
    assert [h["record"]["text"] for h in found["hits"]] == ["likes green tea"]
