"""``/v1/nodes`` needs an admin token: nodes are the deployment's, and a drain pauses every
tenant's sandboxes. The real app with tokens required over a real manager (fake engine, the
embedded default); the cluster side is tests/server/test_cluster_proxy.py."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient

from tests.sandbox.fakes import FakeEngine
from torpor.config import paths
from torpor.sandbox.manager import SandboxManager
from torpor.server.app import create_app
from torpor.server.auth import Identity


def test_nodes_need_an_admin_token(tmp_path: Path) -> None:
    manager = SandboxManager(paths(tmp_path / "h"), engine=FakeEngine())
    app = create_app(manager, supervise=False, require_token=True, memory_embedder=None)
    identity: Identity = app.state.identity
    plain = identity.tokens.issue("default", [("write", "")], sandboxes={})
    admin = identity.tokens.issue("default", [("write", "")], sandboxes={}, admin=True)
    with TestClient(app) as client:
        for token, status in ((plain, 403), (admin, 200)):
            auth = {"Authorization": f"Bearer {token}"}
            listed = client.get("/v1/nodes", headers=auth)
            assert listed.status_code == status, listed.text
            drained = client.post("/v1/nodes/local/drain", headers=auth)
            assert drained.status_code == (403 if status == 403 else 400), drained.text
        assert client.get("/v1/nodes").status_code == 401
        assert [n["name"] for n in listed.json()] == ["local"]
        assert drained.json()["error"]["type"] == "InvalidArgument"
