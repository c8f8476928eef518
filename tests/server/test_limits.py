"""Every request body is bounded before it is parsed (the fields are bounded by the models)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from tests.server.fake_manager import FakeManager
from torpor.errors import PayloadTooLarge, from_wire
from torpor.server.app import create_app
from torpor.server.limits import MAX_JSON_BODY, BodyLimit


@pytest.fixture
def client() -> Iterator[tuple[TestClient, FakeManager]]:
    manager = FakeManager()
    with TestClient(create_app(manager, supervise=False, max_file_bytes=64 << 20)) as c:
        yield c, manager


def _huge_labels() -> bytes:
    # what the probe sent: a create whose labels alone are far over any sane size
    labels = {f"k{i}": "v" * 200 for i in range(MAX_JSON_BODY // 200 + 10)}
    return json.dumps({"name": "agent", "labels": labels}).encode()


def test_an_oversized_body_is_refused_unread_and_nothing_is_made(
    client: tuple[TestClient, FakeManager],
) -> None:
    c, _ = client
    r = c.post(
        "/v1/sandboxes", content=_huge_labels(), headers={"content-type": "application/json"}
    )
    assert r.status_code == 413
    err = from_wire(r.json()["error"])
    assert isinstance(err, PayloadTooLarge) and err.data["limit"] == MAX_JSON_BODY
    assert c.get("/v1/sandboxes").json() == []


def test_a_chunked_body_is_counted_as_it_comes(client: tuple[TestClient, FakeManager]) -> None:
    c, _ = client
    body = _huge_labels()

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted while read
        for i in range(0, len(body), 1 << 20):
            yield body[i : i + (1 << 20)]

    r = c.post("/v1/sandboxes", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert c.get("/v1/sandboxes").json() == []


def test_a_file_upload_keeps_its_own_larger_limit(client: tuple[TestClient, FakeManager]) -> None:
    c, _ = client
    sbx = c.post("/v1/sandboxes", json={"name": "files"}).json()
    data = b"x" * (MAX_JSON_BODY + (1 << 20))
    r = c.put(f"/v1/sandboxes/{sbx['id']}/files", params={"path": "/workspace/big"}, content=data)
    assert r.status_code == 204, r.text


def test_a_small_limit_refuses_by_its_declared_length() -> None:
    seen: list[bytes] = []

    async def app(scope: dict[str, object], receive: object, send: object) -> None:
        seen.append(b"called")

    async def main() -> list[dict[str, object]]:
        sent: list[dict[str, object]] = []

        async def receive() -> dict[str, object]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict[str, object]) -> None:
            sent.append(message)

        scope = {"type": "http", "path": "/v1/sandboxes", "headers": [(b"content-length", b"11")]}
        await BodyLimit(app, limit=10)(scope, receive, send)  # type: ignore[arg-type]
        return sent

    import asyncio

    sent = asyncio.run(main())
    assert sent[0]["status"] == 413 and seen == []  # the app never ran
