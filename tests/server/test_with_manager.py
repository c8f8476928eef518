"""The HTTP API over the real SandboxManager (with the manager's fake engine: no VMs).

This pins the server to the manager's actual signatures and behaviour — tenant scoping, reuse,
wake-on-request, typed errors — where test_routes.py pins the HTTP layer itself.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
    assert client.post("/v1/volumes", json={"name": "memory", "size_mib": 16}, headers=A)
    assert client.get("/v1/sandboxes", headers=A).status_code == 200  # made the checkpoints
    cp = client.app.state.checkpoints  # type: ignore[attr-defined]
    store = cp.drives if "drives" in path else cp.volumes
    body = {"name": "other", "size_mib": 16} if method == "POST" else None
    if path == "/v1/drives":
        body = {"name": "other"}
    answered_while_held, statuses = _held_while_answered(
        client, store.records.lock, method, path, body
    )
    assert answered_while_held
    assert statuses == [204 if method == "DELETE" else 201]


def _held_while_answered(
    client: TestClient, hold: Any, method: str, path: str, body: Any = None
) -> tuple[bool, list[int]]:
    """Run ``method path`` while another thread holds ``hold()`` (a context manager) until
    another request was answered; return whether that request was answered while the lock
    was still held, and the first request's status."""
    import threading

    held, answered = threading.Event(), threading.Event()

    def holder_run() -> None:
        with hold():
            held.set()
            answered.wait(10)

    holder = threading.Thread(target=holder_run)
    holder.start()
    held.wait(10)
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
    return answered_while_held, statuses


@pytest.fixture
def snap_client(tmp_path: Path) -> Iterator[TestClient]:
    """A client over the fake engine whose machines have a real disk (qemu-img only, no
    VM): what a snapshot, fork or restore needs."""
    from tests.sandbox.fakes import DiskEngine

    manager = SandboxManager(paths(tmp_path), engine=DiskEngine())
    tokens = TokenStore({"a" * 32: "acme"})
    with TestClient(create_app(manager, tokens=tokens, supervise=False)) as c:
        yield c


def _stored_snapshot(client: TestClient, name: str) -> str:
    """The id of a stored snapshot ``name`` of a new sandbox."""
    sid = client.post("/v1/sandboxes", json={"name": f"src-{name}"}, headers=A).json()["id"]
    r = client.post(f"/v1/sandboxes/{sid}/snapshots", json={"name": name, "wait": True}, headers=A)
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def test_a_snapshot_delete_waiting_for_the_names_lock_leaves_other_requests_free(
    snap_client: TestClient,
) -> None:
    """A snapshot delete waits for the store's ``names`` lock, which a capture holds while
    it checks every chunk and writes its manifest; it waited on the server's event loop, so
    every other request stood still."""
    sid = _stored_snapshot(snap_client, "snap-1")
    store = snap_client.app.state.checkpoints.snapshots  # type: ignore[attr-defined]
    free, statuses = _held_while_answered(
        snap_client,
        lambda: store.lock(exclusive=True, name="names"),
        "DELETE",
        f"/v1/snapshots/{sid}",
    )
    assert free
    assert statuses == [204]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/snapshots/{snap}/restore", {}),
        ("/v1/snapshots/{snap}/fork", {"count": 1}),
        ("/v1/sandboxes/src-snap-1/snapshots", {"name": "snap-2"}),
        ("/v1/sandboxes/src-snap-1/fork", {"count": 1}),
    ],
    ids=["restore", "fork-snapshot", "snapshot", "fork-sandbox"],
)
def test_a_restore_waiting_for_gc_leaves_other_requests_free(
    snap_client: TestClient, path: str, body: dict[str, Any]
) -> None:
    """GC holds the snapshot store's lock exclusively for its whole sweep; a restore, fork or
    snapshot waited for it on the server's event loop, so every other request stood still
    until the sweep ended."""
    snap = _stored_snapshot(snap_client, "snap-1")
    store = snap_client.app.state.checkpoints.snapshots  # type: ignore[attr-defined]
    free, statuses = _held_while_answered(
        snap_client, lambda: store.lock(exclusive=True), "POST", path.format(snap=snap), body
    )
    assert free
    assert statuses == [201]


@pytest.mark.parametrize("path", ["interpreter", "interpreter/stream"])
def test_code_with_a_lone_surrogate_is_refused_not_a_500(client: TestClient, path: str) -> None:
    """JSON can carry "\\ud800", which has no UTF-8 form: the code reached the guest channel,
    whose encode raised a raw UnicodeEncodeError (a 500)."""
    client.post("/v1/sandboxes", json={"name": "box"}, headers=A)
    r = client.post(
        f"/v1/sandboxes/box/{path}",
        content=b'{"code": "x = \'\\ud800\'"}',
        headers={**A, "content-type": "application/json"},
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "InvalidArgument"


@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    [
        ("GET", "/v1/snapshots", None, 200),
        ("GET", "/v1/snapshots/snap-1", None, 200),
        ("POST", "/v1/snapshots/snap-1/restore", {}, 201),
        ("POST", "/v1/snapshots/snap-1/fork", {"count": 1}, 201),
        ("POST", "/v1/sandboxes", {"snapshot": "snap-1"}, 201),
        ("POST", "/v1/sandboxes/src-snap-1/snapshots", {"name": "snap-2"}, 201),
    ],
)
def test_a_request_reading_the_snapshot_manifests_leaves_other_requests_free(
    snap_client: TestClient, method: str, path: str, body: Any, status: int
) -> None:
    """A snapshot's list, its look-up by name, a restore's and a new snapshot's checks read
    (and hash) every manifest of the home: with a hundred snapshots of gigabytes each, a
    second or more, during which every other request stood still. Here the manifests are
    read only once another request was answered."""
    import threading

    _stored_snapshot(snap_client, "snap-1")
    catalog = snap_client.app.state.checkpoints.snapshots.catalog  # type: ignore[attr-defined]
    entries, answered = catalog.entries, threading.Event()
    waited: list[bool] = []

    def slow_entries(snapshot_id: str | None = None) -> Any:
        if snapshot_id is None and not waited:  # the first full read waits for the other
            waited.append(answered.wait(5))
        return entries(snapshot_id)

    catalog.entries = slow_entries
    statuses: list[int] = []
    waiting = threading.Thread(
        target=lambda: statuses.append(
            snap_client.request(method, path, json=body, headers=A).status_code
        )
    )
    waiting.start()
    time.sleep(0.2)  # it reads the manifests
    assert snap_client.get("/v1/sandboxes", headers=A).status_code == 200
    answered.set()
    waiting.join(10)
    assert waited == [True]
    assert statuses == [status]


def test_a_file_name_that_is_not_utf8_is_listed(client: TestClient) -> None:
    """The guest sends a file name that is not UTF-8 as Python reads it (a lone surrogate per
    bad byte). The listing's JSON failed to encode it: a 500. JSON carries it as a \\u
    escape, which the SDK reads back as the same name."""
    import json
    import os

    sid = client.post("/v1/sandboxes", json={}, headers=A).json()["id"]
    manager = client.app.state.manager  # type: ignore[attr-defined]
    disk = manager.directory(sid) / "disk" / "workspace"
    disk.mkdir(parents=True, exist_ok=True)
    (disk / os.fsdecode(b"caf\xe9.txt")).write_bytes(b"x")
    r = client.get(f"/v1/sandboxes/{sid}/files/list", params={"path": "/workspace"}, headers=A)
    assert r.status_code == 200, r.text
    assert [e["name"] for e in json.loads(r.content)] == ["caf\udce9.txt"]


def test_a_result_holding_a_lone_surrogate_is_answered(client: TestClient) -> None:
    """A result's text may hold a lone surrogate (user code's own repr, a file name that is
    not UTF-8 in a message): FastAPI's JSON encoding refused it, a 500 for a run that
    worked. JSON carries it as a \\u escape."""
    import json

    sid = client.post("/v1/sandboxes", json={}, headers=A).json()["id"]
    code = "type('X', (), {'__repr__': lambda self: 'caf' + chr(0xDCE9)})()"
    r = client.post(f"/v1/sandboxes/{sid}/interpreter", json={"code": code}, headers=A)
    assert r.status_code == 200, r.text
    assert json.loads(r.content)["results"][0]["data"]["text/plain"] == "caf\udce9"
