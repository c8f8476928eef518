"""The memory routes' own bounds: oversized bodies and imports are typed errors that write
nothing; the export streams JSON lines. (Semantics are in tests/memory/test_shared_api.py.)"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from tests.server.fake_manager import FakeManager
from torpor.server.app import create_app
from torpor.server.limits import MAX_JSON_BODY

Q = {"scope": "app/a/user/u"}


@pytest.fixture
def client() -> Iterator[TestClient]:
    app = create_app(
        FakeManager(), supervise=False, memory_embedder=None, max_import_bytes=64 * 1024
    )
    with TestClient(app) as c:
        yield c


def _count(c: TestClient) -> int:
    lines = c.get("/v1/memory/export", params={"scope": ""}).text.splitlines()
    return len(lines) - 1


def test_oversized_bodies_are_refused_before_any_write(client: TestClient) -> None:
    big = ["x" * 1000] * (MAX_JSON_BODY // 1000 + 10)
    r = client.post("/v1/memory/remember_many", params=Q, json={"items": big})
    assert r.status_code == 413 and r.json()["error"]["type"] == "PayloadTooLarge"
    header = json.dumps({"type": "torpor-memory", "version": 1, "scope": "app/a/user/u"})
    body = header + "\n" + "\n".join(["{}"] * 40_000)
    r = client.post("/v1/memory/import", params=Q, content=body.encode())
    assert r.status_code == 413 and r.json()["error"]["data"]["limit"] == 64 * 1024
    r = client.post("/v1/memory/remember", params=Q, json={"text": "y" * 40_000})
    assert r.status_code == 413 and r.json()["error"]["type"] == "PayloadTooLarge"
    assert _count(client) == 0


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"\xff\xfe not utf-8", id="not-utf8"),
        pytest.param(b'{"type": "fact"}\n', id="no-header"),
        pytest.param(b"not json\n", id="not-json"),
    ],
)
def test_bad_imports_are_typed(client: TestClient, body: bytes) -> None:
    r = client.post("/v1/memory/import", params=Q, content=body)
    assert r.status_code == 400 and r.json()["error"]["type"] == "InvalidArgument"
    assert _count(client) == 0


def test_bad_requests_are_typed(client: TestClient) -> None:
    for r in (
        client.post("/v1/memory/recall", params=Q, content=b"{not json"),
        client.post("/v1/memory/remember", params={"scope": "app"}, json={"text": "x"}),
        client.post("/v1/memory/remember", params=Q, json={"text": "x", "colour": 1}),
        client.get("/v1/memory/audit", params={"limit": 0}),
    ):
        assert r.status_code == 400 and r.json()["error"]["type"] == "InvalidArgument", r.text


def test_export_streams_json_lines(client: TestClient) -> None:
    client.post(
        "/v1/memory/remember_many", params=Q, json={"items": [f"n {i}" for i in range(300)]}
    )
    with client.stream("GET", "/v1/memory/export", params=Q) as r:
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert lines[0]["type"] == "torpor-memory" and len(lines) == 301


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("post", "/v1/memory/remember", {"text": "x", "ttl": "abc"}),
        ("post", "/v1/memory/remember", {"text": "x", "ttl": 1e12}),
        ("post", "/v1/memory/log", {"role": "u", "text": "x", "at": "9999-12-31T23:59:59-01:00"}),
        ("post", "/v1/memory/recall", {"query": "x", "as_of": "0001-01-01T00:00:00+01:00"}),
        ("post", "/v1/memory/recall", {"query": "x", "kind": 5}),
        ("put", "/v1/memory/policy", {"retention_seconds": 1e300}),
        ("post", "/v1/memory/remember", b'{"text": "x", "metadata": {"n": NaN}}'),
        ("post", "/v1/memory/get_all", {"page": 10**20}),
    ],
)
def test_values_out_of_range_are_400(
    client: TestClient, method: str, path: str, body: dict[str, object] | bytes
) -> None:
    """Durations past a thousand years, times outside years 1-9999 in UTC, a kind that is
    not a string and NaN (which Python's JSON reader takes) were 500s, or worse."""
    sent = {"content": body, "headers": {"content-type": "application/json"}}
    r = getattr(client, method)(
        path, params=Q, **(sent if isinstance(body, bytes) else {"json": body})
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "InvalidArgument", r.text
    assert _count(client) == 0
    r = client.post("/v1/memory/get_all", params=Q, json={"filters": {"topic": "y"}})
    assert r.status_code == 200, r.text  # a stored NaN had made every filtered listing fail


def test_a_record_id_no_store_can_hold_is_not_found(client: TestClient) -> None:
    """A lone surrogate (JSON can carry one) names no record: it was a 500 from SQLite."""
    r = client.post(
        "/v1/memory/verify",
        params=Q,
        content=b'{"record_id": "\\ud800"}',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 404 and r.json()["error"]["type"] == "RecordNotFound", r.text
