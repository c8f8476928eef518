"""One request schema across the layers: the SDK, the routes and the manager refuse the same bad
value with the same error, and the SDK sends the request model itself.

The whole stack runs in this process: the SDK's :class:`Runtime` talks to the app through
Starlette's TestClient (an httpx client), and the app serves the real SandboxManager on the fake
engine (no VMs), so each layer here is the real one.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from tests.sandbox.fakes import FakeEngine
from torpor.client import Runtime, Sandbox
from torpor.config import paths
from torpor.errors import InvalidArgument, VolumeNotFound, from_wire
from torpor.sandbox.manager import SandboxManager
from torpor.sandbox.requests import (
    MAX_LABEL_VALUE,
    MAX_LABELS,
    MAX_MEMORY_MIB,
    MIN_MEMORY_MIB,
    CommandSpec,
    SandboxOptions,
    SandboxSpec,
)
from torpor.server.app import create_app

# the SDK passes its own timeouts; the TestClient standing in for its connection frowns on it
pytestmark = pytest.mark.filterwarnings("ignore:You should not use the 'timeout' argument")


@dataclass
class Stack:
    client: TestClient
    runtime: Runtime
    manager: SandboxManager
    sent: list[tuple[str, str, Any]] = field(default_factory=list)

    def call(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        """Run a manager coroutine on the app's event loop."""
        return self.client.portal.call(functools.partial(method, *args, **kwargs))  # type: ignore[union-attr]

    def sandboxes(self) -> list[Any]:
        return list(self.client.get("/v1/sandboxes", params={"all": "true"}).json())


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    manager = SandboxManager(paths(tmp_path), engine=FakeEngine())
    with TestClient(create_app(manager, supervise=False), base_url="http://torpor") as client:
        runtime = Runtime(url="http://torpor", autostart=False)
        runtime._http.close()
        runtime._http = client  # type: ignore[assignment]  # the SDK talks to the app in-process
        s = Stack(client, runtime, manager)

        def record(request: httpx.Request) -> None:
            body = json.loads(request.content) if request.content else None
            s.sent.append((request.method, request.url.path, body))

        client.event_hooks["request"] = [record]
        yield s


# -- the same bad value, the same error, everywhere ------------------------------------------

BAD_OPTIONS = [
    pytest.param({"memory_mib": MAX_MEMORY_MIB + 1}, "memory_mib", id="memory-too-high"),
    pytest.param({"memory_mib": MIN_MEMORY_MIB - 1}, "memory_mib", id="memory-too-low"),
    pytest.param({"vcpus": 65}, "vcpus", id="too-many-vcpus"),
    pytest.param(
        {"labels": {f"k{i}": "v" for i in range(MAX_LABELS + 1)}}, "labels", id="too-many-labels"
    ),
    pytest.param(
        {"labels": {"user": "x" * (MAX_LABEL_VALUE + 1)}}, "labels", id="label-value-too-long"
    ),
    pytest.param({"labels": {"k" * 64: "v"}}, "labels", id="label-key-too-long"),
    pytest.param({"labels": {"a=b": "c"}}, "labels", id="label-key-with-equals"),
    pytest.param({"idle_pause_seconds": 10**19}, "idle_pause_seconds", id="idle-pause-overflow"),
    pytest.param({"pause_retention_days": 366}, "pause_retention_days", id="retention-too-long"),
]


def _refused_over_http(response: Any, field: str) -> None:  # the TestClient's response
    assert response.status_code == 400, response.text
    err = from_wire(response.json()["error"])
    assert type(err) is InvalidArgument
    assert f"body.{field}" in err.message


@pytest.mark.parametrize(("bad", "field"), BAD_OPTIONS)
def test_bad_sandbox_options_are_refused_alike(
    stack: Stack, bad: dict[str, Any], field: str
) -> None:
    with pytest.raises(InvalidArgument) as sdk:  # before anything is sent
        Sandbox.create(runtime=stack.runtime, **bad)
    with pytest.raises(InvalidArgument) as sdk_by_name:
        Sandbox.get_or_create("agent", runtime=stack.runtime, **bad)
    assert stack.sent == []
    _refused_over_http(stack.client.post("/v1/sandboxes", json=bad), field)
    _refused_over_http(stack.client.put("/v1/sandboxes/by-name/agent", json=bad), field)
    with pytest.raises(InvalidArgument) as lib:
        stack.call(stack.manager.create, **bad)
    with pytest.raises(InvalidArgument) as lib_by_name:
        stack.call(stack.manager.get_or_create, "agent", **bad)
    errors = [sdk.value, sdk_by_name.value, lib.value, lib_by_name.value]
    assert {type(e) for e in errors} == {InvalidArgument}
    for err in errors:
        assert field in str(err)
    assert stack.sandboxes() == []


BAD_COMMANDS = [
    pytest.param({"timeout": 0}, "timeout", id="timeout-zero"),
    pytest.param({"env": {"A=B": "1"}}, "env", id="env-key-with-equals"),
    pytest.param({"env": {f"V{i}": "" for i in range(1025)}}, "env", id="too-many-env-vars"),
    pytest.param({"cwd": "/" + "d" * 4095}, "cwd", id="cwd-too-long"),
]


@pytest.mark.parametrize(("bad", "field"), BAD_COMMANDS)
def test_bad_commands_are_refused_alike(stack: Stack, bad: dict[str, Any], field: str) -> None:
    sbx = Sandbox.create(runtime=stack.runtime)
    stack.sent.clear()
    with pytest.raises(InvalidArgument) as sdk:
        sbx.commands.run("echo hi", **bad)
    assert stack.sent == []
    route = f"/v1/sandboxes/{sbx.id}/commands"
    _refused_over_http(stack.client.post(route, json={"cmd": "echo hi", **bad}), field)
    _refused_over_http(stack.client.post(route + "/stream", json={"cmd": "echo hi", **bad}), field)
    with pytest.raises(InvalidArgument) as lib:
        stack.call(stack.manager.run_command, sbx.id, "echo hi", **bad)
    assert type(sdk.value) is type(lib.value) is InvalidArgument
    assert sbx.commands.run("echo hi").stdout == "hi\n"  # the sandbox is fine


# -- the SDK sends the model -----------------------------------------------------------------


def test_the_sdk_sends_the_request_models(stack: Stack) -> None:
    sbx = Sandbox.create(name="agent", labels={"user": "u-42"}, runtime=stack.runtime)
    sbx.commands.run("echo hi", env={"A": "1"})
    Sandbox.get_or_create("agent", idle_pause_seconds=600, runtime=stack.runtime)
    assert stack.sent == [
        ("POST", "/v1/sandboxes", {"name": "agent", "labels": {"user": "u-42"}}),
        (
            "POST",
            f"/v1/sandboxes/{sbx.id}/commands",
            CommandSpec.of(
                cmd="echo hi", env={"A": "1"}, timeout=60.0, background=False
            ).model_dump(mode="json", exclude_unset=True),
        ),
        ("PUT", "/v1/sandboxes/by-name/agent", {"idle_pause_seconds": 600}),
    ]
    assert stack.sent[0][2] == SandboxSpec(name="agent", labels={"user": "u-42"}).model_dump(
        mode="json", exclude_unset=True
    )
    assert stack.sent[2][2] == SandboxOptions(idle_pause_seconds=600).model_dump(
        mode="json", exclude_unset=True
    )


def test_one_create_endpoint_for_mounts_and_snapshots(stack: Stack) -> None:
    """A create with volumes (or drives, or a snapshot) goes to the same endpoint as any other;
    the server hands it to the checkpoint layer, which finds no such volume."""
    mount = {"volume": "memory-u-42", "path": "/memory/"}
    with pytest.raises(VolumeNotFound):
        Sandbox.create(name="agent", volumes=[mount], runtime=stack.runtime)
    assert stack.sent == [
        (
            "POST",
            "/v1/sandboxes",
            {"name": "agent", "volumes": [{"volume": "memory-u-42", "path": "/memory"}]},
        )
    ]
    assert stack.sandboxes() == []  # refused before anything was made
    r = stack.client.post("/v1/checkpoints/sandboxes", json={"volumes": [mount]})
    assert r.status_code == 404  # the old second endpoint is gone
