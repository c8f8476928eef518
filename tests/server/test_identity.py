"""One identity for both layers: tokens with memory grants and sandbox label rights, created,
listed and revoked live through ``/v1/tokens``, every refusal audited.

The property test drives the real app (real token store, real memory store, the HTTP layer)
over the fake sandbox manager; tests/server/test_qemu_identity.py repeats the sandbox part on
a real VM.
"""

from __future__ import annotations

import string
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.fake_manager import FakeManager
from torpor.memory.access import hash_token
from torpor.memory.models import TokenInfo, from_us, now_us
from torpor.server.app import create_app
from torpor.server.auth import Identity, TokenStore


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def served() -> Iterator[tuple[FakeManager, Any, TestClient]]:
    """A TCP-style app (tokens required) over the fake manager."""
    manager = FakeManager()
    app = create_app(manager, supervise=False, require_token=True, memory_embedder=None)
    with TestClient(app) as client:
        yield manager, app, client


def _issue(app: Any, tenant: str = "default", **kw: Any) -> str:
    identity: Identity = app.state.identity
    token: str = identity.tokens.issue(tenant, kw.pop("grants", []), **kw)
    return token


def _denials(app: Any, tenant: str = "default") -> int:
    return sum(not e.allowed for e in app.state.memory_backend.audit_log(tenant, 10_000))


_NAME = st.text(alphabet=string.ascii_lowercase + string.digits, min_size=1, max_size=12).map(
    lambda s: "u" + s
)


@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    app_name=_NAME,
    users=st.lists(_NAME, min_size=2, max_size=2, unique=True),
    key=st.sampled_from(["user", "owner", "u", "team-x"]),
    secret=st.text(alphabet=string.ascii_letters + " ", min_size=3, max_size=30).filter(
        lambda s: s.strip() and any(c.isalpha() for c in s)
    ),
)
def test_a_token_of_one_user_reaches_nothing_of_another(
    served: tuple[FakeManager, Any, TestClient],
    app_name: str,
    users: list[str],
    key: str,
    secret: str,
) -> None:
    manager, app, c = served
    mine, theirs = users
    admin = _auth(_issue(app, grants=[("write", "")], sandboxes={}))
    # the other user's memory and sandbox, made by the tenant's admin
    their_scope = f"app/{app_name}/user/{theirs}"
    rec = c.post(
        "/v1/memory/remember",
        params={"scope": their_scope},
        json={"text": f"{secret} word", "key": "k"},
        headers=admin,
    )
    assert rec.status_code == 200, rec.text
    rec_id = rec.json()["id"]
    their_box = c.post("/v1/sandboxes", json={"labels": {key: theirs}}, headers=admin).json()
    token = _auth(
        _issue(app, grants=[("write", f"app/{app_name}/user/{mine}")], sandboxes={key: mine})
    )
    before = _denials(app)
    q = {"scope": their_scope}
    refused = [
        c.get("/v1/memory/scope", params=q, headers=token),
        c.post("/v1/memory/recall", params=q, json={"query": secret}, headers=token),
        c.post("/v1/memory/context", params=q, json={"query": secret}, headers=token),
        c.get("/v1/memory/history", params={**q, "key": "k"}, headers=token),
        c.get("/v1/memory/profile", params=q, headers=token),
        c.get("/v1/memory/export", params=q, headers=token),
        c.post("/v1/memory/remember", params=q, json={"text": "x"}, headers=token),
        c.delete("/v1/memory/scope", params=q, headers=token),
        c.delete(f"/v1/memory/records/{rec_id}", headers=token),
        c.post("/v1/memory/recall", params={"scope": ""}, json={"query": secret}, headers=token),
        c.post(
            "/v1/memory/import",
            params=q,
            content=b'{"type": "torpor-memory", "version": 1}\n',
            headers=token,
        ),
        c.get("/v1/memory/audit", headers=token),
    ]
    for r in refused:
        assert r.status_code == 403 and r.json()["error"]["type"] == "AccessDenied", r.text
    # from its own scope a record of the other user is not there at all
    mine_q = {"scope": f"app/{app_name}/user/{mine}"}
    assert c.get(f"/v1/memory/records/{rec_id}", params=mine_q, headers=token).status_code == 404
    hits = c.post("/v1/memory/recall", params=mine_q, json={"query": secret}, headers=token)
    assert hits.status_code == 200 and hits.json() == []
    # sandboxes: the other user's is invisible and untouchable
    assert c.get("/v1/sandboxes", headers=token).json() == []
    assert c.get("/v1/sandboxes", params={"label": f"{key}={theirs}"}, headers=token).json() == []
    sid = their_box["id"]
    for method, url, body in [
        ("GET", f"/v1/sandboxes/{sid}", None),
        ("POST", f"/v1/sandboxes/{sid}/resume", None),
        ("POST", f"/v1/sandboxes/{sid}/pause", None),
        ("POST", f"/v1/sandboxes/{sid}/commands", {"cmd": "echo hi"}),
        ("POST", f"/v1/sandboxes/{sid}/interpreter", {"code": "1"}),
        ("GET", f"/v1/sandboxes/{sid}/files?path=/etc/hostname", None),
        ("DELETE", f"/v1/sandboxes/{sid}", None),
    ]:
        r = c.request(method, url, json=body, headers=token)
        assert r.status_code == 404 and r.json()["error"]["type"] == "SandboxNotFound", (
            url,
            r.text,
        )
    # nor by taking its name, nor by labelling a new one as the other user's
    assert (
        c.put(f"/v1/sandboxes/by-name/{their_box['name']}", json={}, headers=token).status_code
        == 403
    )
    assert c.post("/v1/sandboxes", json={"labels": {key: theirs}}, headers=token).status_code == 403
    assert c.get("/v1/usage", headers=token).status_code == 403  # tenant-wide
    # nothing changed, and every refusal is in the audit log
    assert manager.infos[sid].state.value == "running"
    assert c.get(f"/v1/sandboxes/{sid}", headers=admin).status_code == 200
    assert c.get("/v1/memory/records/" + rec_id, params=q, headers=admin).status_code == 200
    assert _denials(app) - before >= len(refused) + 7 + 3
    # and the token does reach its own: a sandbox it makes carries its label
    own = c.post("/v1/sandboxes", json={}, headers=token).json()
    assert own["labels"] == {key: mine}
    assert [i["id"] for i in c.get("/v1/sandboxes", headers=token).json()] == [own["id"]]
    assert c.delete(f"/v1/sandboxes/{own['id']}", headers=token).status_code == 204


def test_tokens_created_listed_revoked_live(served: tuple[FakeManager, Any, TestClient]) -> None:
    _, app, c = served
    admin = _auth(_issue(app, "acme", grants=[("write", "")], sandboxes={}, admin=True))
    made = c.post(
        "/v1/tokens",
        json={"name": "agent", "grants": [{"mode": "read", "prefix": "app/a"}], "sandboxes": None},
        headers=admin,
    )
    assert made.status_code == 201, made.text
    new, info = made.json()["token"], made.json()["info"]
    assert info["tenant"] == "acme" and info["grants"] == [{"mode": "read", "prefix": "app/a"}]
    assert c.get("/v1/health", headers=_auth(new)).json()["tenant"] == "acme"
    listed = c.get("/v1/tokens", headers=admin).json()
    assert info["id"] in [t["id"] for t in listed]
    assert new not in str(listed) and hash_token(new) not in str(listed)
    # the new token has no sandbox rights and is no admin
    assert c.get("/v1/sandboxes", headers=_auth(new)).status_code == 403
    assert c.get("/v1/tokens", headers=_auth(new)).status_code == 403
    # an admin token stays inside its tenant
    assert c.post("/v1/tokens", json={"tenant": "globex"}, headers=admin).status_code == 403
    assert c.get("/v1/tokens", params={"tenant": "globex"}, headers=admin).status_code == 403
    # revoked: refused from the next request on, no restart (401: no usable credential)
    assert c.delete(f"/v1/tokens/{info['id']}", headers=admin).status_code == 204
    assert c.get("/v1/health", headers=_auth(new)).status_code == 401
    assert c.delete(f"/v1/tokens/{info['id'][:4]}", headers=admin).status_code == 404
    assert [
        t["revoked"] for t in c.get("/v1/tokens", headers=admin).json() if t["id"] == info["id"]
    ] == [True]
    log = app.state.memory_backend.audit_log("acme", 100)
    assert {"token.issue", "token.revoke"} <= {e.action for e in log}


def test_a_token_makes_no_token_that_holds_more_than_it_does(
    served: tuple[FakeManager, Any, TestClient],
) -> None:
    """An admin token of one user's memory and sandboxes, that expires in an hour, could mint
    a full-rights token that never expires."""
    _, app, c = served
    hour = from_us(now_us()) + timedelta(hours=1)
    narrow = _auth(
        _issue(
            app,
            "acme",
            grants=[("write", "app/a/user/u-42")],
            sandboxes={"user": "u-42"},
            admin=True,
            expires_at=hour,
        )
    )
    before = _denials(app, "acme")
    asks: list[dict[str, Any]] = [
        {"grants": [{"mode": "write", "prefix": ""}]},
        {"grants": [{"mode": "read", "prefix": "app/a"}]},
        {"sandboxes": {}},
        {"sandboxes": {"user": "u-43"}},
        {"grants": [{"mode": "read", "prefix": "app/a/user/u-42"}], "expires_in_seconds": 7200},
    ]
    for body in asks:
        r = c.post("/v1/tokens", json=body, headers=narrow)
        assert (r.status_code, r.json()["error"]["type"]) == (403, "AccessDenied"), body
    assert _denials(app, "acme") == before + 5
    ok = {
        "grants": [{"mode": "read", "prefix": "app/a/user/u-42/session/s1"}],
        "sandboxes": {"user": "u-42", "team": "x"},
    }
    made = c.post("/v1/tokens", json=ok, headers=narrow)
    assert made.status_code == 201, made.text
    expires = datetime.fromisoformat(made.json()["info"]["expires_at"])
    assert abs((expires - hour).total_seconds()) < 1  # the maker's own expiry
    # the home's owner (and a full admin) still make any token
    full = _auth(_issue(app, "acme", grants=[("write", "")], sandboxes={}, admin=True))
    assert c.post("/v1/tokens", json={"sandboxes": {}}, headers=full).status_code == 201


def test_a_token_lists_and_revokes_only_tokens_it_could_have_made(
    served: tuple[FakeManager, Any, TestClient],
) -> None:
    """An admin token of one user's memory and sandboxes listed every token of its tenant
    (other users' grants and selectors) and revoked any of them, the tenant's full-rights
    tokens too: it manages only tokens that hold no more than it does."""
    _, app, c = served
    full = _auth(_issue(app, "acme", grants=[("write", "")], sandboxes={}, admin=True))
    narrow = _auth(
        _issue(
            app,
            "acme",
            grants=[("write", "app/a/user/u-42")],
            sandboxes={"user": "u-42"},
            admin=True,
        )
    )
    other = c.post(
        "/v1/tokens", json={"grants": [{"mode": "read", "prefix": "app/a/user/u-43"}]}, headers=full
    ).json()["info"]["id"]
    mine = c.post(
        "/v1/tokens",
        json={"grants": [{"mode": "read", "prefix": "app/a/user/u-42"}]},
        headers=narrow,
    ).json()["info"]["id"]
    everyone = {t["id"] for t in c.get("/v1/tokens", headers=full).json()}
    seen = {t["id"] for t in c.get("/v1/tokens", headers=narrow).json()}
    assert mine in seen and other not in seen and len(everyone) == 4 and len(seen) == 2
    before = _denials(app, "acme")
    for target in everyone - seen:
        r = c.delete(f"/v1/tokens/{target}", headers=narrow)
        assert (r.status_code, r.json()["error"]["type"]) == (403, "AccessDenied")
    assert _denials(app, "acme") == before + 2
    assert c.get("/v1/sandboxes", headers=full).status_code == 200  # still valid
    assert c.delete(f"/v1/tokens/{mine}", headers=narrow).status_code == 204
    assert c.delete(f"/v1/tokens/{other}", headers=full).status_code == 204  # a full admin may


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b'{"sandboxes": {"user": "\\ud800"}}', id="surrogate-value"),
        pytest.param(b'{"sandboxes": {"\\udfff": "u-42"}}', id="surrogate-key"),
        pytest.param(b'{"sandboxes": {"user": "u\\u0000"}}', id="nul"),
    ],
)
def test_a_selector_no_store_can_keep_is_refused_before_a_token_is_made(
    served: tuple[FakeManager, Any, TestClient], body: bytes
) -> None:
    # a lone surrogate was stored on SQLite, the answer was a 500 (the secret lost) and every
    # later GET /v1/tokens of the tenant a 500 too
    _, app, c = served
    full = _issue(app, "acme", grants=[("write", "")], sandboxes={}, admin=True)
    admin = {**_auth(full), "content-type": "application/json"}
    made = c.post("/v1/tokens", content=body, headers=admin)
    assert made.status_code == 400 and made.json()["error"]["type"] == "InvalidArgument"
    listed = c.get("/v1/tokens", headers=admin)
    assert listed.status_code == 200 and len(listed.json()) == 1  # the admin's own only


@pytest.mark.parametrize(
    "header",
    [
        pytest.param(None, id="missing"),
        pytest.param("Bearer tpr_" + "c" * 32, id="unknown"),
        pytest.param("Basic abc", id="wrong-scheme"),
        pytest.param("Bearer", id="empty"),
    ],
)
def test_bad_tokens_are_refused_and_audited(
    served: tuple[FakeManager, Any, TestClient], header: str | None
) -> None:
    _, app, c = served
    before = _denials(app, "")
    r = c.get("/v1/memory/scope", headers={"Authorization": header} if header else {})
    # 401, not 403: the caller has no usable credential (a valid token lacking a right is 403)
    assert r.status_code == 401 and r.json()["error"]["type"] == "Unauthenticated"
    assert _denials(app, "") == before + 1


def test_expired_token_is_refused(served: tuple[FakeManager, Any, TestClient]) -> None:
    _, app, c = served
    soon = _issue(app, grants=[("read", "")], expires_at=from_us(now_us() + 10**9))
    past = _issue(app, grants=[("read", "")], expires_at=datetime.now(UTC) - timedelta(seconds=1))
    assert c.get("/v1/memory/scope", headers=_auth(soon)).status_code == 200
    assert c.get("/v1/memory/scope", headers=_auth(past)).status_code == 401
    bad = c.post(
        "/v1/tokens", json={"expires_in_seconds": -5}, headers=_auth(_issue(app, admin=True))
    )
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "InvalidArgument"


def test_local_owner_makes_any_tenants_tokens() -> None:
    """Without require_token (the unix socket), a tokenless caller is the owner: it may make
    tokens for any tenant, which is how a tenant's first token comes to be."""
    app = create_app(FakeManager(), supervise=False, memory_embedder=None)
    with TestClient(app) as c:
        made = c.post("/v1/tokens", json={"tenant": "globex", "sandboxes": {}, "admin": True})
        assert made.status_code == 201
        tok = made.json()["token"]
        assert c.get("/v1/health", headers=_auth(tok)).json()["tenant"] == "globex"
        assert c.get("/v1/tokens", params={"tenant": "globex"}).json()[0]["admin"] is True
        # a token on the socket narrows the caller to the token
        assert (
            c.get("/v1/tokens", params={"tenant": "default"}, headers=_auth(tok)).status_code == 403
        )


def test_token_file_is_imported_hashed_and_revocation_sticks() -> None:
    legacy = TokenStore({"a" * 32: "acme"})
    manager = FakeManager()
    app = create_app(manager, tokens=legacy, supervise=False, memory_embedder=None)
    backend = app.state.memory_backend
    stored = backend.get_token(hash_token("a" * 32))
    assert isinstance(stored, TokenInfo) and stored.admin and stored.sandboxes == {}
    assert "a" * 32 not in str(backend.list_tokens("acme"))
    identity: Identity = app.state.identity
    assert identity.tokens.revoke_id("acme", stored.id)
    assert identity.adopt(legacy) == 0  # a restart re-reads the file: still revoked
    assert backend.get_token(hash_token("a" * 32)).revoked
    backend.close()


def test_selector_cannot_be_widened_by_filters(served: tuple[FakeManager, Any, TestClient]) -> None:
    _, app, c = served
    admin = _auth(_issue(app, sandboxes={}))
    c.post("/v1/sandboxes", json={"labels": {"user": "a", "tier": "pro"}}, headers=admin)
    b = c.post("/v1/sandboxes", json={"labels": {"user": "b", "tier": "pro"}}, headers=admin).json()
    tok = _auth(_issue(app, sandboxes={"user": "a"}))
    assert [
        i["labels"]["user"]
        for i in c.get("/v1/sandboxes", params={"label": "tier=pro"}, headers=tok).json()
    ] == ["a"]
    assert c.get("/v1/sandboxes", params={"label": "user=b"}, headers=tok).json() == []
    assert c.get(f"/v1/sandboxes/{b['name']}", headers=tok).status_code == 404
