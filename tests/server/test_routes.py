"""The HTTP routes against a fake manager: shapes, error mapping, streaming, limits, tenants."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, cast

import pytest
from fastapi.testclient import TestClient

from tests.server.fake_manager import FakeManager
from torpor.errors import from_wire
from torpor.server import routes_exec
from torpor.server.app import create_app
from torpor.server.auth import TokenStore

TOKEN_A = "a" * 32
TOKEN_B = "b" * 32


@pytest.fixture
def manager() -> FakeManager:
    return FakeManager()


@pytest.fixture
def client(manager: FakeManager) -> Iterator[TestClient]:
    app = create_app(manager, supervise=False, max_file_bytes=1024)
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def _create(client: TestClient, **body: Any) -> dict[str, Any]:
    r = client.post("/v1/sandboxes", json=body)
    assert r.status_code == 201, r.text
    return dict(r.json())


def test_lifespan_starts_and_closes_the_manager(manager: FakeManager) -> None:
    with TestClient(create_app(manager, supervise=False)):
        assert manager.started and not manager.closed
    assert manager.closed


def test_idle_supervisor_sweeps(manager: FakeManager) -> None:
    import time

    with TestClient(create_app(manager, idle_interval=0.01)):
        deadline = time.monotonic() + 10
        while manager.sweeps < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert manager.sweeps >= 2


def test_create_get_list_pause_resume_kill(client: TestClient) -> None:
    info = _create(client, name="agent-1", labels={"user": "u-1"})
    assert info["name"] == "agent-1" and info["state"] == "running"
    _create(client, name="agent-2", labels={"user": "u-2"})
    assert client.get("/v1/sandboxes/agent-1").json()["id"] == info["id"]
    assert [i["name"] for i in client.get("/v1/sandboxes?label=user=u-2").json()] == ["agent-2"]
    assert len(client.get("/v1/sandboxes").json()) == 2
    assert client.post(f"/v1/sandboxes/{info['id']}/pause").json()["state"] == "paused"
    # resume returns nothing from the manager: the route answers with fresh info
    assert client.post("/v1/sandboxes/agent-1/resume").json()["state"] == "running"
    assert client.delete("/v1/sandboxes/agent-1").status_code == 204
    assert client.get("/v1/sandboxes/agent-1").json()["state"] == "stopped"
    assert [i["name"] for i in client.get("/v1/sandboxes").json()] == ["agent-2"]
    assert len(client.get("/v1/sandboxes?all=true").json()) == 2


def test_get_or_create_by_name_reuses(client: TestClient) -> None:
    first = client.put("/v1/sandboxes/by-name/agent-u-42", json={"labels": {"u": "42"}}).json()
    again = client.put("/v1/sandboxes/by-name/agent-u-42", json={}).json()
    assert first["reused"] is False
    assert again["reused"] is True and again["id"] == first["id"]


@pytest.mark.parametrize(
    ("call", "status", "kind"),
    [
        pytest.param(lambda c: c.get("/v1/sandboxes/nope"), 404, "SandboxNotFound", id="not-found"),
        pytest.param(
            lambda c: c.post("/v1/sandboxes", json={"template": "ruby"}),
            404,
            "TemplateNotFound",
            id="no-template",
        ),
        pytest.param(
            lambda c: c.post("/v1/sandboxes", json={"name": "Bad Name"}),
            400,
            "InvalidName",
            id="bad-name",
        ),
        pytest.param(
            lambda c: c.post("/v1/sandboxes", json={"vcpus": 0}),
            400,
            "InvalidArgument",
            id="validation",
        ),
        pytest.param(
            lambda c: c.post("/v1/sandboxes", json={"color": "red"}),
            400,
            "InvalidArgument",
            id="unknown-field",
        ),
        pytest.param(
            lambda c: c.get("/v1/sandboxes?label=novalue"), 400, "InvalidArgument", id="bad-label"
        ),
        pytest.param(lambda c: c.get("/v1/nothing-here"), 404, "NotFound", id="no-route"),
    ],
)
def test_errors_map_to_status_and_wire(
    client: TestClient, call: Any, status: int, kind: str
) -> None:
    r = call(client)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["type"] == kind and err["message"]
    assert type(from_wire(err)).__name__ == kind


def test_an_error_quoting_a_lone_surrogate_is_typed_not_500(client: TestClient) -> None:
    # JSON may carry "\\ud800" (a lone surrogate, no UTF-8 form); the error quoting it is
    # answered as the typed error, not a 500 from rendering its body
    for body in (b'{"name": "\\ud800"}', b'{"template": "x\\udfff"}'):
        r = client.post("/v1/sandboxes", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "InvalidName"


def test_illegal_transition_is_409_with_data(client: TestClient) -> None:
    info = _create(client)
    r = client.post(f"/v1/sandboxes/{info['id']}/resume")
    assert r.status_code == 409
    err = from_wire(r.json()["error"])
    assert type(err).__name__ == "InvalidState"
    assert err.data["state"] == "running" and err.data["required"] == ["paused"]


def test_killed_sandbox_is_closed(client: TestClient) -> None:
    info = _create(client)
    client.delete(f"/v1/sandboxes/{info['id']}")
    r = client.post(f"/v1/sandboxes/{info['id']}/commands", json={"cmd": "echo hi"})
    assert r.status_code == 409 and r.json()["error"]["type"] == "SandboxClosed"


def test_unexpected_error_is_500_without_traceback(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    info = _create(client)
    r = client.post(f"/v1/sandboxes/{info['id']}/commands", json={"cmd": "boom"})
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "TorporError"
    assert "a bug below" not in r.text  # the detail stays in the log
    assert any("a bug below" in str(rec.exc_info) for rec in caplog.records if rec.exc_info)


def test_run_command(client: TestClient) -> None:
    info = _create(client)
    r = client.post(
        f"/v1/sandboxes/{info['id']}/commands",
        json={"cmd": "echo a b", "env": {"X": "1"}, "cwd": "/tmp"},
    )
    assert r.json() == {
        "exit_code": 0,
        "stdout": "a\nb\nX=1\ncwd=/tmp\n",
        "stderr": "",
        "pid": None,
    }
    bg = client.post(
        f"/v1/sandboxes/{info['id']}/commands", json={"cmd": "serve", "background": True}
    ).json()
    assert bg["pid"] == 4242
    r = client.post(f"/v1/sandboxes/{info['id']}/commands", json={"cmd": "sleep 9"})
    assert r.status_code == 504 and r.json()["error"]["type"] == "OperationTimeout"


def test_streamed_command_sends_chunks_then_result(client: TestClient) -> None:
    info = _create(client)
    with client.stream(
        "POST", f"/v1/sandboxes/{info['id']}/commands/stream", json={"cmd": "echo one two"}
    ) as r:
        assert r.headers["content-type"].startswith("application/x-ndjson")
        events = [json.loads(line) for line in r.iter_lines() if line]
    assert events[:2] == [{"type": "stdout", "data": "one\n"}, {"type": "stdout", "data": "two\n"}]
    assert events[-1]["type"] == "result" and events[-1]["result"]["exit_code"] == 0


def test_streamed_command_reports_errors_last(client: TestClient) -> None:
    sid = _create(client)["id"]
    path = f"/v1/sandboxes/{sid}/commands/stream"
    with client.stream("POST", path, json={"cmd": "sleep 9", "timeout": 1}) as r:
        assert r.status_code == 200
        events = [json.loads(line) for line in r.iter_lines() if line]
    assert events == [{"type": "error", "error": events[0]["error"]}]
    assert events[0]["error"]["type"] == "OperationTimeout"


def test_streamed_command_in_no_sandbox_is_a_plain_404(client: TestClient) -> None:
    r = client.post("/v1/sandboxes/ghost/commands/stream", json={"cmd": "x"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "SandboxNotFound"


def test_files_round_trip(client: TestClient) -> None:
    sid = _create(client)["id"]
    base = f"/v1/sandboxes/{sid}/files"
    blob = bytes(range(256)) * 2
    assert client.put(base, params={"path": "/w/a.bin"}, content=blob).status_code == 204
    assert client.get(base, params={"path": "/w/a.bin"}).content == blob
    assert client.get(f"{base}/exists", params={"path": "/w/a.bin"}).json() == {"exists": True}
    listing = client.get(f"{base}/list", params={"path": "/w"}).json()
    assert listing == [{"name": "a.bin", "path": "/w/a.bin", "type": "file", "size": 512}]
    assert client.post(f"{base}/mkdir", params={"path": "/w/d"}).status_code == 204
    assert client.delete(base, params={"path": "/w/a.bin"}).status_code == 204
    assert client.get(f"{base}/exists", params={"path": "/w/a.bin"}).json() == {"exists": False}
    r = client.get(base, params={"path": "/w/a.bin"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "PathNotFound"
    assert client.get(base).status_code == 400  # path is required


def test_file_over_limit_is_413_and_not_written(client: TestClient, manager: FakeManager) -> None:
    sid = _create(client)["id"]
    r = client.put(f"/v1/sandboxes/{sid}/files", params={"path": "/big"}, content=b"x" * 1025)
    assert r.status_code == 413
    err = r.json()["error"]
    assert err["type"] == "PayloadTooLarge" and err["data"]["limit"] == 1024
    assert manager.files[sid] == {}


def test_chunked_upload_over_limit_is_413(client: TestClient) -> None:
    sid = _create(client)["id"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: the server must count
        for _ in range(5):
            yield b"y" * 300

    r = client.put(f"/v1/sandboxes/{sid}/files", params={"path": "/big"}, content=chunks())
    assert r.status_code == 413


def test_interpreter_keeps_variables(client: TestClient) -> None:
    sid = _create(client)["id"]
    url = f"/v1/sandboxes/{sid}/interpreter"
    assert client.post(url, json={"code": "notes = ['weekly']"}).json()["results"] == []
    out = client.post(url, json={"code": "notes"}).json()
    assert out["results"][0]["data"]["text/plain"] == "['weekly']"


def test_streamed_interpreter(client: TestClient) -> None:
    sid = _create(client)["id"]
    with client.stream(
        "POST",
        f"/v1/sandboxes/{sid}/interpreter/stream",
        json={"code": "for i in range(2): print(i)"},
    ) as r:
        events = [json.loads(line) for line in r.iter_lines() if line]
    assert events[:2] == [{"type": "stdout", "data": "0\n"}, {"type": "stdout", "data": "1\n"}]
    assert events[-1]["type"] == "result" and events[-1]["result"]["stdout"] == "0\n1\n"


def test_paused_sandbox_wakes_on_request(client: TestClient) -> None:
    sid = _create(client)["id"]
    client.post(f"/v1/sandboxes/{sid}/pause")
    assert (
        client.post(f"/v1/sandboxes/{sid}/commands", json={"cmd": "echo up"}).json()["stdout"]
        == "up\n"
    )
    assert client.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"


@pytest.fixture
def tcp_app() -> tuple[FakeManager, Any]:
    manager = FakeManager()
    tokens = TokenStore({TOKEN_A: "acme", TOKEN_B: "globex"})
    return manager, create_app(manager, tokens=tokens, supervise=False)


@pytest.mark.parametrize(
    "header",
    [
        pytest.param(None, id="missing"),
        pytest.param("Bearer " + "c" * 32, id="unknown"),
        pytest.param("Basic " + TOKEN_A, id="wrong-scheme"),
    ],
)
def test_token_required(tcp_app: tuple[FakeManager, Any], header: str | None) -> None:
    app = tcp_app[1]
    headers = {"Authorization": header} if header else {}
    with TestClient(app) as c:
        r = c.get("/v1/sandboxes", headers=headers)
    assert r.status_code == 401 and r.json()["error"]["type"] == "Unauthenticated"


def test_token_maps_to_tenant(tcp_app: tuple[FakeManager, Any]) -> None:
    manager, app = tcp_app
    with TestClient(app, headers={"Authorization": f"Bearer {TOKEN_A}"}) as c:
        info = c.post("/v1/sandboxes", json={"name": "shared-name"}).json()
        assert c.get("/v1/health").json()["tenant"] == "acme"
    assert info["tenant"] == "acme"
    assert ("create", "acme") in manager.calls


def test_tenant_cannot_see_another_tenants_sandbox(tcp_app: tuple[FakeManager, Any]) -> None:
    app = tcp_app[1]
    a = TestClient(app, headers={"Authorization": f"Bearer {TOKEN_A}"})
    b = TestClient(app, headers={"Authorization": f"Bearer {TOKEN_B}"})
    with a, b:
        info = a.post("/v1/sandboxes", json={"name": "agent-x"}).json()
        for url in (f"/v1/sandboxes/{info['id']}", "/v1/sandboxes/agent-x"):
            assert b.get(url).status_code == 404
        assert b.post(f"/v1/sandboxes/{info['id']}/pause").status_code == 404
        assert b.get("/v1/sandboxes").json() == []
        # the same name is free in another tenant
        other = b.put("/v1/sandboxes/by-name/agent-x", json={}).json()
        assert other["id"] != info["id"] and other["reused"] is False


def test_server_fences_tenants_even_if_the_manager_leaks(tcp_app: tuple[FakeManager, Any]) -> None:
    manager, app = tcp_app
    manager.leak_tenants = True
    a = TestClient(app, headers={"Authorization": f"Bearer {TOKEN_A}"})
    b = TestClient(app, headers={"Authorization": f"Bearer {TOKEN_B}"})
    with a, b:
        info = a.post("/v1/sandboxes", json={"name": "agent-y"}).json()
        assert b.get(f"/v1/sandboxes/{info['id']}").status_code == 404
        assert b.get("/v1/sandboxes").json() == []


def test_a_stream_its_caller_does_not_read_stays_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Output the caller does not take as fast as it comes (a terminal running ``yes``, read
    over a slow link) is held only up to a bound: then what runs for the stream is stopped,
    and its last line says why, instead of the server's memory growing for ever."""
    monkeypatch.setattr(routes_exec, "MAX_BACKLOG", 1 << 20)
    chunk = "y\n" * 32_768  # 64 KiB
    emitted = 0
    stopped = asyncio.Event()

    async def work(emit: Callable[[dict[str, Any]], None]) -> None:
        nonlocal emitted
        try:
            while True:
                emit({"type": "output", "data": chunk})
                emitted += 1
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            stopped.set()
            raise

    async def main() -> list[str]:
        response = routes_exec.ndjson_events(work, "test")
        lines = cast(AsyncIterator[str], response.body_iterator)
        got = [await anext(lines)]  # the caller reads one line, then nothing for a while
        await asyncio.wait_for(stopped.wait(), 10)
        got += [line async for line in lines]
        return got

    got = asyncio.run(main())
    assert emitted * len(chunk) < 4 << 20
    error = json.loads(got[-1])
    assert error["type"] == "error" and error["error"]["type"] == "PayloadTooLarge", error
    assert all(json.loads(line)["type"] == "output" for line in got[:-1])
