"""$TORPOR_SERVER_TIMING (torpor.server.timing): one line per request, with the time inside the
engine's operations apart from the rest; nothing without the variable. Fake engine, no VMs."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.sandbox.fakes import FakeEngine
from torpor.config import paths
from torpor.sandbox.manager import SandboxManager
from torpor.server.app import create_app
from torpor.server.timing import ENV


def _manager(tmp_path: Path) -> SandboxManager:
    return SandboxManager(paths(tmp_path / "home"), engine=FakeEngine())


def test_each_request_is_timed_with_the_engine_part_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "timing.jsonl"
    monkeypatch.setenv(ENV, str(out))
    manager = _manager(tmp_path)
    slow = manager.pause

    async def pause(*args: Any, **kwargs: Any) -> Any:  # the engine's part takes 150 ms
        await asyncio.sleep(0.15)
        return await slow(*args, **kwargs)

    manager.pause = pause  # type: ignore[method-assign]
    with TestClient(create_app(manager, supervise=False)) as client:
        sid = client.post("/v1/sandboxes", json={}).json()["id"]
        assert client.post(f"/v1/sandboxes/{sid}/pause").json()["state"] == "paused"
        assert client.get("/v1/health").status_code == 200
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(x["method"], x["path"]) for x in lines] == [
        ("POST", "/v1/sandboxes"),
        ("POST", f"/v1/sandboxes/{sid}/pause"),
        ("GET", "/v1/health"),
    ]
    create, paused, health = lines
    assert 0 < create["engine_ms"] <= create["app_ms"]
    assert 150 <= paused["engine_ms"] <= paused["app_ms"]  # the wrapper's sleep is inside it
    assert health["engine_ms"] == 0 < health["app_ms"]


def test_nothing_is_written_without_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV, raising=False)
    manager = _manager(tmp_path)
    with TestClient(create_app(manager, supervise=False)) as client:
        assert client.post("/v1/sandboxes", json={}).status_code == 201
    assert not hasattr(manager.create, "__wrapped__")
    assert list(tmp_path.glob("*.jsonl")) == []
