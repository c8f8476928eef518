"""The hot memory routes' fast path (torpor.server.fastpath) answers exactly as FastAPI's
routes do: the same statuses and bodies for good requests and for every kind of bad one
(bodies, queries, content types, tokens, tenants, sizes), and it is really the one answering."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.server.fake_manager import FakeManager
from torpor.server import fastpath
from torpor.server.app import create_app
from torpor.server.fastpath import ROUTES
from torpor.server.limits import MAX_JSON_BODY

Q = {"scope": "app/a/user/u"}


def _pair() -> Iterator[tuple[TestClient, TestClient]]:
    fast, slow = (
        create_app(FakeManager(), supervise=False, memory_embedder=None, fast_memory=on)
        for on in (True, False)
    )
    with TestClient(fast) as f, TestClient(slow) as s:
        yield f, s


@pytest.fixture
def pair() -> Iterator[tuple[TestClient, TestClient]]:
    yield from _pair()


def _same(a: Any, b: Any) -> None:
    """Equal but for what differs between two stores (ids, times, the time in scores)."""

    def strip(x: Any) -> Any:
        if isinstance(x, dict):
            return {
                k: strip(v)
                for k, v in x.items()
                if k
                not in {"id", "ids", "created_at", "valid_from", "valid_to", "superseded_by", "at"}
            }
        if isinstance(x, list):
            return [strip(v) for v in x]
        if isinstance(x, float):  # scores: recency moves between the two calls
            return round(x, 4)
        return x

    assert strip(a) == strip(b)


def _both(pair: tuple[TestClient, TestClient], path: str, **kw: Any) -> tuple[Any, Any]:
    fast, slow = pair
    a, b = fast.post(path, **kw), slow.post(path, **kw)
    assert a.status_code == b.status_code, (path, kw, a.text, b.text)
    assert a.headers["content-type"] == b.headers["content-type"]
    _same(a.json(), b.json())
    return a, b


def test_good_requests_answer_alike(pair: tuple[TestClient, TestClient]) -> None:
    for c in pair:
        c.post("/v1/memory/remember_many", params=Q, json={"items": ["coffee in lisbon"] * 3})
    cases: list[tuple[str, dict[str, Any]]] = [
        ("/v1/memory/remember", {"text": "prefers daily summaries", "key": "cadence"}),
        ("/v1/memory/remember", {"text": "weekly now", "key": "cadence", "metadata": {"a": 1}}),
        ("/v1/memory/log", {"role": "user", "text": "hello", "session": "s1"}),
        ("/v1/memory/log", {"role": "user", "text": "at a time", "at": "2026-01-01T00:00:00Z"}),
        ("/v1/memory/recall", {"query": "coffee lisbon", "k": 2}),
        ("/v1/memory/recall", {"query": "summaries", "kind": "fact", "include_history": True}),
        ("/v1/memory/recall", {"query": "hello", "session": "s1", "since": "2025-01-01"}),
        ("/v1/memory/context", {"query": "update", "budget_tokens": 50}),
    ]
    for path, body in cases:
        a, _ = _both(pair, path, params=Q, json=body)
        assert a.status_code == 200, a.text
    # a charset and the +json form are JSON too; the tenant's own name is accepted
    for headers in ({"content-type": "application/json; charset=utf-8"},):
        _both(
            pair,
            "/v1/memory/recall",
            params={**Q, "tenant": "default"},
            content=b'{"query": "coffee"}',
            headers=headers,
        )


@pytest.mark.parametrize(
    ("path", "kw"),
    [
        ("/v1/memory/recall", {"content": b"{not json"}),
        ("/v1/memory/recall", {"content": b"[]"}),
        ("/v1/memory/recall", {"content": b""}),
        ("/v1/memory/recall", {"json": {"query": "x", "colour": 1}}),
        ("/v1/memory/recall", {"json": {"query": "x", "k": "many"}}),
        ("/v1/memory/recall", {"json": {"query": 5}}),
        ("/v1/memory/recall", {"json": {"query": "x", "since": "yesterday"}}),
        ("/v1/memory/recall", {"json": {"query": "x", "min_similarity": "high"}}),
        (
            "/v1/memory/recall",
            {"content": b'{"query": "x"}', "headers": {"content-type": "text/plain"}},
        ),
        ("/v1/memory/recall", {"content": b'{"query": "x"}', "headers": {"content-type": ""}}),
        ("/v1/memory/remember", {"json": {"text": ""}}),
        ("/v1/memory/remember", {"json": {"text": "x", "ttl": -1}}),
        ("/v1/memory/remember", {"json": {"text": "x" * 40_000}}),
        ("/v1/memory/log", {"json": {"role": 5, "text": "x"}}),
        ("/v1/memory/context", {"json": {"query": "x", "budget_tokens": "many"}}),
    ],
)
def test_bad_bodies_answer_alike(
    pair: tuple[TestClient, TestClient], path: str, kw: dict[str, Any]
) -> None:
    a, _ = _both(pair, path, params=Q, **kw)
    assert a.status_code in (400, 413, 415, 422), a.text
    assert "error" in a.json()


@pytest.mark.parametrize(
    "params",
    [
        {"scope": "app"},
        {"scope": "app/a/user/u", "tenant": "other"},
        {"scope": "x" * 2001},
        {"scope": "app/a/user/u", "tenant": "t" * 201},
        [("scope", "app/a/user/u"), ("scope", "app/b/user/v")],
        {"scope": "app/a/user/u", "unknown": "1"},
    ],
)
def test_bad_queries_answer_alike(pair: tuple[TestClient, TestClient], params: Any) -> None:
    _both(pair, "/v1/memory/recall", params=params, json={"query": "x"})


def test_tokens_are_checked_and_refusals_audited(pair: tuple[TestClient, TestClient]) -> None:
    tokens = []
    for c in pair:
        r = c.post(
            "/v1/tokens", json={"grants": [{"mode": "read", "prefix": "app/a/user/u"}], "name": "t"}
        )
        assert r.status_code == 201, r.text
        tokens.append(r.json()["token"])
    for i, c in enumerate(pair):  # a read-only token: recall yes, remember no
        h = {"authorization": f"Bearer {tokens[i]}"}
        assert (
            c.post("/v1/memory/recall", params=Q, json={"query": "x"}, headers=h).status_code == 200
        )
        other = c.post(
            "/v1/memory/recall", params={"scope": "app/a/user/v"}, json={"query": "x"}, headers=h
        )
        assert other.status_code == 403, other.text
    for headers in (
        {"authorization": "Bearer nope"},
        {"authorization": "Basic abc"},
    ):
        a, _ = _both(pair, "/v1/memory/recall", params=Q, json={"query": "x"}, headers=headers)
        assert a.status_code == 401
    wrote = [
        c.post(
            "/v1/memory/remember",
            params=Q,
            json={"text": "x"},
            headers={"authorization": f"Bearer {t}"},
        )
        for c, t in zip(pair, tokens, strict=True)
    ]
    assert wrote[0].status_code == wrote[1].status_code == 403
    _same(wrote[0].json(), wrote[1].json())
    audits = [c.get("/v1/memory/audit").json() for c in pair]
    refused = [[(e["action"], e["scope"]) for e in a if not e["allowed"]] for a in audits]
    assert refused[0] == refused[1] and len(refused[0]) >= 2, refused
    # a revoke holds on the next request
    for c, t in zip(pair, tokens, strict=True):
        token_id = c.get("/v1/tokens").json()[0]["id"]
        assert c.delete(f"/v1/tokens/{token_id}").status_code == 204
        r = c.post(
            "/v1/memory/recall",
            params=Q,
            json={"query": "x"},
            headers={"authorization": f"Bearer {t}"},
        )
        assert r.status_code == 401, r.text


def test_oversized_body_is_refused_before_the_fast_path(
    pair: tuple[TestClient, TestClient],
) -> None:
    big = json.dumps({"query": "x" * (MAX_JSON_BODY + 10)}).encode()
    a, _ = _both(pair, "/v1/memory/recall", params=Q, content=big)
    assert a.status_code == 413


def test_the_fast_path_is_the_one_answering(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its four routes are answered by the fast path in the app that has it, never in the
    other; a request it leaves to FastAPI (a bad body) never reaches it."""
    answered: list[str] = []
    real = fastpath._answer

    def spy(request: Any, *args: Any) -> Any:
        answered.append(request.url.path)
        return real(request, *args)

    monkeypatch.setattr(fastpath, "_answer", spy)
    for fast, slow in _pair():
        for path in ROUTES:
            body = {"text": "x"} if path.endswith(("remember", "log")) else {"query": "x"}
            if path.endswith("log"):
                body["role"] = "user"
            assert slow.post(path, params=Q, json=body).status_code == 200, path
            assert answered == []
            assert fast.post(path, params=Q, json=body).status_code == 200, path
            assert answered == [path]
            answered.clear()
            assert fast.post(path, params=Q, json={**body, "colour": 1}).status_code == 400
            assert answered == []
