"""The HTTP API over the real SandboxManager (with the manager's fake engine: no VMs).

This pins the server to the manager's actual signatures and behaviour — tenant scoping, reuse,
wake-on-request, typed errors — where test_routes.py pins the HTTP layer itself.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.sandbox.fakes import FakeEngine
from torpor.config import paths
from torpor.errors import from_wire
from torpor.sandbox.manager import SandboxManager
from torpor.server.app import create_app
from torpor.server.auth import TokenStore

A = {"Authorization": "Bearer " + "a" * 32}
B = {"Authorization": "Bearer " + "b" * 32}


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    manager = SandboxManager(paths(tmp_path), engine=FakeEngine())
    tokens = TokenStore({"a" * 32: "acme", "b" * 32: "globex"})
    with TestClient(create_app(manager, tokens=tokens, supervise=False)) as c:
        yield c


def test_scenario_over_http(client: TestClient) -> None:
    r = client.put("/v1/sandboxes/by-name/agent-u-42", json={"labels": {"user": "u-42"}}, headers=A)
    assert r.status_code == 200, r.text
    sid = r.json()["id"]
    base = f"/v1/sandboxes/{sid}"
    run = client.post(f"{base}/interpreter", json={"code": "notes = ['weekly']"}, headers=A)
    assert run.status_code == 200, run.text
    assert (
        client.put(
            f"{base}/files", params={"path": "/workspace/memory.md"}, content=b"hi", headers=A
        ).status_code
        == 204
    )
    assert client.post(f"{base}/pause", headers=A).json()["state"] == "paused"

    again = client.put("/v1/sandboxes/by-name/agent-u-42", json={}, headers=A).json()
    assert again["id"] == sid and again["reused"] is True and again["state"] == "running"
    out = client.post(f"{base}/interpreter", json={"code": "notes"}, headers=A).json()
    assert out["results"][0]["data"]["text/plain"] == "['weekly']"
    assert (
        client.get(f"{base}/files", params={"path": "/workspace/memory.md"}, headers=A).content
        == b"hi"
    )
    cmd = client.post(f"{base}/commands", json={"cmd": "echo hi"}, headers=A).json()
    assert cmd["stdout"] == "hi\n"
    assert client.get("/v1/sandboxes?label=user=u-42", headers=A).json()[0]["id"] == sid

    assert client.delete(base, headers=A).status_code == 204
    r = client.post(f"{base}/commands", json={"cmd": "echo hi"}, headers=A)
    assert r.status_code == 409 and r.json()["error"]["type"] == "SandboxClosed"


def test_real_manager_keeps_tenants_apart(client: TestClient) -> None:
    sid = client.post("/v1/sandboxes", json={"name": "agent-x"}, headers=A).json()["id"]
    for method, url in [
        ("GET", f"/v1/sandboxes/{sid}"),
        ("GET", "/v1/sandboxes/agent-x"),
        ("POST", f"/v1/sandboxes/{sid}/pause"),
        ("DELETE", f"/v1/sandboxes/{sid}"),
    ]:
        assert client.request(method, url, headers=B).status_code == 404, url
    r = client.post(f"/v1/sandboxes/{sid}/commands", json={"cmd": "echo x"}, headers=B)
    assert r.status_code == 404
    assert client.get("/v1/sandboxes", headers=B).json() == []
    assert client.get(f"/v1/sandboxes/{sid}", headers=A).json()["state"] == "running"


def test_real_manager_errors(client: TestClient) -> None:
    r = client.post("/v1/sandboxes", json={"template": "ruby"}, headers=A)
    assert r.status_code == 404 and r.json()["error"]["type"] == "TemplateNotFound"
    client.post("/v1/sandboxes", json={"name": "taken"}, headers=A)
    r = client.post("/v1/sandboxes", json={"name": "taken"}, headers=A)
    assert r.status_code == 409 and r.json()["error"]["type"] == "Conflict"
    sid = client.get("/v1/sandboxes/taken", headers=A).json()["id"]
    client.delete(f"/v1/sandboxes/{sid}", headers=A)
    r = client.post(f"/v1/sandboxes/{sid}/pause", headers=A)
    assert r.status_code == 409 and r.json()["error"]["type"] == "SandboxClosed"


def test_gc_is_for_the_homes_owner_only(client: TestClient, tmp_path: Path) -> None:
    """GC acts on every tenant's data: a token holder of one tenant may not run it."""
    r = client.post("/v1/gc", json={"dry_run": True}, headers=A)
    assert r.status_code == 403
    assert from_wire(r.json()["error"]).data["scope"] == "gc"
    owner = SandboxManager(paths(tmp_path / "owner"), engine=FakeEngine())
    with TestClient(create_app(owner, supervise=False)) as local:  # the local socket: no tokens
        r = local.post("/v1/gc", json={"dry_run": True})
        assert r.status_code == 200 and "removed_chunks" in r.json()


@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", "/v1/volumes"), ("POST", "/v1/drives"), ("DELETE", "/v1/volumes/memory")],
)
def test_a_request_waiting_for_the_volumes_lock_leaves_other_requests_free(
    client: TestClient, method: str, path: str
) -> None:
    """A volume file read holds the store's lock for as long as debugfs takes; a volume or
    drive create (mkfs too) or delete waited for it on the server's event loop, so every
    other request stood still. Here another thread holds the lock until another request
    was answered."""
    import threading

    assert client.post("/v1/volumes", json={"name": "memory", "size_mib": 16}, headers=A)
    assert client.get("/v1/sandboxes", headers=A).status_code == 200  # made the checkpoints
    cp = client.app.state.checkpoints  # type: ignore[attr-defined]
    store = cp.drives if "drives" in path else cp.volumes
    held, answered = threading.Event(), threading.Event()

    def hold() -> None:
        with store.records.lock():
            held.set()
            answered.wait(10)  # let go once the other request was answered, or after 10 s

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(10)
    body = {"name": "other", "size_mib": 16} if method == "POST" else None
    if path == "/v1/drives":
        body = {"name": "other"}
    statuses: list[int] = []
    waiting = threading.Thread(
        target=lambda: statuses.append(
            client.request(method, path, json=body, headers=A).status_code
        )
    )
    waiting.start()
    time.sleep(0.2)  # it waits for the lock
    assert client.get("/v1/sandboxes", headers=A).status_code == 200
    answered_while_held = holder.is_alive()
    answered.set()
    waiting.join(10)
    holder.join(10)
    assert answered_while_held
    assert statuses == [204 if method == "DELETE" else 201]
