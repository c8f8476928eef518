"""What a restricted token may bind its sandboxes to: labels within its selector (on create
and on relabel), and a memory scope within its memory grants (the guest is answered there at
``localhost:7777`` with the tenant's memory). The real manager on the fake engine, over the
app's routes; the guest's calls through the relay as in tests/server/test_mcp_relay.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.sandbox.fakes import FakeEngine
from torpor.config import paths
from torpor.memory import Memory
from torpor.memory.models import SCOPE_LEVELS
from torpor.sandbox import requests
from torpor.sandbox.manager import SandboxManager
from torpor.server.app import create_app

U42 = {"app": "support", "user": "u-42"}
U43 = {"app": "support", "user": "u-43"}


@pytest.fixture
def real(tmp_path: Path) -> Iterator[tuple[Any, TestClient]]:
    manager = SandboxManager(paths(tmp_path), engine=FakeEngine())
    app = create_app(manager, supervise=False, require_token=True, memory_embedder=None)
    with TestClient(app) as c:
        yield app, c


def _token(app: Any, **kw: Any) -> dict[str, str]:
    secret = app.state.identity.tokens.issue("acme", kw.pop("grants", []), **kw)
    return {"Authorization": f"Bearer {secret}"}


def _guest_recall(app: Any, c: TestClient, sandbox_id: str, query: str) -> list[str]:
    raw = json.dumps({"query": query}).encode()
    assert c.portal is not None
    status, _, answer = c.portal.call(
        app.state.guest_relay, sandbox_id, "POST", "/v1/memory/recall",
        {"content-type": "application/json"}, raw,
    )  # fmt: skip
    assert status == 200, answer
    return [h["record"]["text"] for h in json.loads(answer)["hits"]]


def test_a_sandbox_binds_only_memory_its_token_may_use(real: tuple[Any, TestClient]) -> None:
    app, c = real
    Memory.attach(app.state.memory_backend, "acme", embedder=None).scope(**U43).remember(
        "u-43's card ends in 4242"
    )
    tok = _token(app, grants=[("write", "app/support/user/u-42")], sandboxes={"user": "u-42"})
    direct = c.post("/v1/memory/recall", params={"scope": "app/support/user/u-43"},
                    json={"query": "card"}, headers=tok)  # fmt: skip
    assert direct.status_code == 403
    for method, path, body in (
        ("post", "/v1/sandboxes", {"memory_scope": U43}),
        ("put", "/v1/sandboxes/by-name/b1", {"memory_scope": {"app": "support"}}),
        ("post", "/v1/sandboxes", {"memory_scope": {**U43, "read_only": True}}),
    ):
        r = getattr(c, method)(path, json=body, headers=tok)
        assert (r.status_code, r.json()["error"]["type"]) == (403, "AccessDenied"), body
    mine = c.post("/v1/sandboxes", json={"memory_scope": U42}, headers=tok)
    assert mine.status_code == 201, mine.text
    assert _guest_recall(app, c, mine.json()["id"], "card") == []
    r = c.post(f"/v1/sandboxes/{mine.json()['id']}/fork", json={"memory_scope": U43}, headers=tok)
    assert r.status_code == 403
    reader = _token(app, grants=[("read", "app/support")], sandboxes={"user": "u-42"})
    r = c.post("/v1/sandboxes", json={"memory_scope": U43}, headers=reader)
    assert r.status_code == 403  # read only: it may bind read-only
    r = c.post("/v1/sandboxes", json={"memory_scope": {**U43, "read_only": True}}, headers=reader)
    assert r.status_code == 201, r.text
    assert _guest_recall(app, c, r.json()["id"], "card") == ["u-43's card ends in 4242"]
    audit = Memory.attach(app.state.memory_backend, "acme", embedder=None).audit_log()
    assert any(not e.allowed and "memory scope" in str(e.detail) for e in audit)


def test_a_restricted_token_cannot_relabel_its_sandbox_away(real: tuple[Any, TestClient]) -> None:
    app, c = real
    u42 = _token(app, sandboxes={"user": "u-42"})
    u43 = _token(app, sandboxes={"user": "u-43"})
    sid = c.post("/v1/sandboxes", json={"name": "box", "labels": {"team": "a"}}, headers=u42)
    sid = sid.json()["id"]
    for labels in ({"user": "u-43"}, {"user": "u-43", "team": "a"}):
        r = c.patch(f"/v1/sandboxes/{sid}", json={"labels": labels}, headers=u42)
        assert (r.status_code, r.json()["error"]["type"]) == (403, "AccessDenied")
    assert c.get(f"/v1/sandboxes/{sid}", headers=u43).status_code == 404
    r = c.patch(f"/v1/sandboxes/{sid}", json={"labels": {}}, headers=u42)  # keeps its selector
    assert r.status_code == 200 and r.json()["labels"] == {"user": "u-42"}
    r = c.patch(f"/v1/sandboxes/{sid}", json={"idle_pause_seconds": 60}, headers=u42)
    assert r.status_code == 200 and r.json()["labels"] == {"user": "u-42"}


@pytest.mark.parametrize("edge", ["0001-01-01T00:00:00+01:00", "9999-12-31T23:59:59-01:00"])
def test_a_usage_window_past_the_calendar_is_invalid(
    real: tuple[Any, TestClient], edge: str
) -> None:
    app, c = real
    tok = _token(app, sandboxes={})
    for params in ({"since": edge}, {"until": edge}):
        r = c.get("/v1/usage", params=params, headers=tok)
        assert (r.status_code, r.json()["error"]["type"]) == (400, "InvalidArgument"), r.text


def _guest_remember(app: Any, c: TestClient, sandbox_id: str, text: str) -> int:
    assert c.portal is not None
    status, _, _ = c.portal.call(
        app.state.guest_relay, sandbox_id, "POST", "/v1/memory/remember",
        {"content-type": "application/json"}, json.dumps({"text": text}).encode(),
    )  # fmt: skip
    return int(status)


def test_a_guest_reads_no_ancestor_its_binder_could_not(real: tuple[Any, TestClient]) -> None:
    # recall at app/support/user/u-42 also reads app/support and the tenant's root: a token
    # that may only use u-42's scope must not reach those through its guest
    app, c = real
    owner = Memory.attach(app.state.memory_backend, "acme", embedder=None)
    owner.scope(app="support").remember("the support team's discount code is 7731")
    owner.scope(**U42).remember("u-42's discount code is 1234")
    tok = _token(app, grants=[("write", "app/support/user/u-42")], sandboxes={"user": "u-42"})
    r = c.post("/v1/sandboxes", json={"memory_scope": U42}, headers=tok)
    assert r.status_code == 201, r.text
    info = r.json()
    assert _guest_recall(app, c, info["id"], "discount code") == ["u-42's discount code is 1234"]
    assert info["memory_scope"]["grants"] == [{"mode": "write", "prefix": "app/support/user/u-42"}]
    assert _guest_remember(app, c, info["id"], "u-42 prefers email") == 200
    again = c.put("/v1/sandboxes/by-name/" + info["name"], json={"memory_scope": U42}, headers=tok)
    assert again.status_code == 200, again.text  # the same binding, the same grants
    # a token that may read the app's scope too: its guest reads it as well
    wider = _token(
        app,
        grants=[("read", "app/support"), ("write", "app/support/user/u-42")],
        sandboxes={"user": "u-42"},
    )
    r = c.post("/v1/sandboxes", json={"memory_scope": U42}, headers=wider)
    assert r.status_code == 201, r.text
    assert sorted(_guest_recall(app, c, r.json()["id"], "discount code")) == [
        "the support team's discount code is 7731",
        "u-42's discount code is 1234",
    ]


def test_a_binding_names_grants_within_its_binders(real: tuple[Any, TestClient]) -> None:
    app, c = real
    Memory.attach(app.state.memory_backend, "acme", embedder=None).scope(**U42).remember(
        "u-42 likes tea"
    )
    tok = _token(app, grants=[("write", "app/support/user/u-42")], sandboxes={"user": "u-42"})
    wide = {**U42, "grants": [{"mode": "read", "prefix": "app/support"}]}
    r = c.post("/v1/sandboxes", json={"memory_scope": wide}, headers=tok)
    assert (r.status_code, r.json()["error"]["type"]) == (403, "AccessDenied")
    narrow = {**U42, "grants": [{"mode": "read", "prefix": "app/support/user/u-42"}]}
    r = c.post("/v1/sandboxes", json={"memory_scope": narrow}, headers=tok)
    assert r.status_code == 201, r.text
    assert _guest_recall(app, c, r.json()["id"], "tea") == ["u-42 likes tea"]
    assert _guest_remember(app, c, r.json()["id"], "u-42 likes coffee") == 403  # read only
    for prefix in ("app//u-42", "user/u-42/app/support", "app/support/user", "team/x", 7):
        bad = {**U42, "grants": [{"mode": "read", "prefix": prefix}]}
        r = c.post("/v1/sandboxes", json={"memory_scope": bad}, headers=tok)
        assert (r.status_code, r.json()["error"]["type"]) == (400, "InvalidArgument"), prefix
    assert requests.SCOPE_LEVELS == SCOPE_LEVELS


def test_get_or_create_reuses_a_binding_made_with_other_grants(
    real: tuple[Any, TestClient],
) -> None:
    # the grants a token's binding keeps are the server's, not the caller's: a get-or-create
    # naming the same scope reuses the sandbox whoever bound it (the owner, a rotated token)
    app, c = real
    full = _token(app, grants=[("write", "")], sandboxes={})
    body = {"memory_scope": U42, "labels": {"user": "u-42"}}
    made = c.put("/v1/sandboxes/by-name/box", json=body, headers=full)
    assert made.status_code in (200, 201), made.text
    tok = _token(app, grants=[("write", "app/support/user/u-42")], sandboxes={"user": "u-42"})
    again = c.put("/v1/sandboxes/by-name/box", json={"memory_scope": U42}, headers=tok)
    assert again.status_code == 200, again.text
    assert again.json()["id"] == made.json()["id"]
    mine = c.put("/v1/sandboxes/by-name/mine", json={"memory_scope": U42}, headers=tok)
    assert mine.status_code in (200, 201), mine.text
    rotated = _token(
        app,
        grants=[("write", "app/support/user/u-42"), ("read", "app/faq")],
        sandboxes={"user": "u-42"},
    )
    again = c.put("/v1/sandboxes/by-name/mine", json={"memory_scope": U42}, headers=rotated)
    assert again.status_code == 200, again.text
    assert again.json()["id"] == mine.json()["id"]
