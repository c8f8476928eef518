"""The agent's memory from inside a real VM: ``curl -s localhost:7777/...`` in the guest,
relayed over the sandbox's channel to the real (auto-started) server, scoped to the sandbox's
tenant and ``memory_scope``; it survives pause/wake, and a fork keeps the scope.

Needs a template whose guest agent has the relay (``torpor template build python``). The
calls are made with ``curl`` when the image has it (``--apt curl``), else with the same
request from ``python3`` (the default image has no curl).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.served import stop_server_and_vms
from torpor.client import Runtime, Sandbox
from torpor.memory import Memory

pytestmark = pytest.mark.qemu

U42 = {"app": "support", "user": "u-42"}


@pytest.fixture
def home(qemu_home: Path) -> Iterator[Path]:
    """``qemu_home``, and no server or VM left behind afterwards."""
    yield qemu_home
    stop_server_and_vms(qemu_home)


#: what stands in for curl in an image without it: POST argv[2] to argv[1] with headers argv[3:]
PY_POST = """
import sys, urllib.error, urllib.request
req = urllib.request.Request(sys.argv[1], data=sys.argv[2].encode(), method="POST")
for h in ["Content-Type: application/json", *sys.argv[3:]]:
    k, _, v = h.partition(": ")
    req.add_header(k, v)
try:
    print(urllib.request.urlopen(req, timeout=300).read().decode())
except urllib.error.HTTPError as e:
    print(e.read().decode())
"""


def curl(sbx: Sandbox, path: str, body: dict[str, Any], *headers: str) -> Any:
    """POST ``body`` to ``localhost:7777<path>`` from inside ``sbx``; the parsed answer."""
    url = f"http://localhost:7777{path}"
    args = ["curl", "-s", "-X", "POST", url]
    args += ["-H", "Content-Type: application/json", "-d", json.dumps(body)]
    for header in headers:
        args += ["-H", header]
    fallback = ["python3", "-c", PY_POST, url, json.dumps(body), *headers]
    cmd = f"if command -v curl >/dev/null; then {shlex.join(args)}; else {shlex.join(fallback)}; fi"
    result = sbx.commands.run(cmd, timeout=300)
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def recall(sbx: Sandbox, query: str) -> list[str]:
    found = curl(sbx, "/v1/memory/recall", {"query": query})
    return [h["record"]["text"] for h in found["hits"]]


def test_memory_from_inside_the_vm(home: Path) -> None:
    rt = Runtime(home=home)
    sbx = Sandbox.create(memory_scope=U42, runtime=rt)
    assert sbx.info.memory_scope == U42
    fact = curl(sbx, "/v1/memory/remember", {"text": "prefers daily summaries", "key": "cadence"})
    assert fact["scope"] == "app/support/user/u-42"
    assert recall(sbx, "summaries") == ["prefers daily summaries"]

    # MCP over the same endpoint
    call = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": "recall", "arguments": {"query": "how often are summaries sent"}},
    }
    answer = curl(sbx, "/mcp", call, "Accept: application/json, text/event-stream")
    hits = answer["result"]["structuredContent"]["hits"]
    assert [h["record"]["text"] for h in hits] == ["prefers daily summaries"]

    # the guest cannot leave its scope, and holds no credential
    refused = curl(sbx, "/v1/memory/recall", {"query": "summaries", "user": "u-43"})
    assert refused["error"]["type"] == "AccessDenied"
    env = sbx.commands.run("env; cat /proc/cmdline", timeout=60).stdout
    assert "TORPOR_TOKEN" not in env and "Bearer" not in env

    # pause and wake: the endpoint is back with the machine
    sbx.pause()
    assert recall(sbx, "summaries") == ["prefers daily summaries"]  # the call wakes it

    # a fork keeps the scope; the fact it writes is the same user's
    (child,) = sbx.fork(count=1)
    assert child.info.memory_scope == U42
    curl(child, "/v1/memory/remember", {"text": "asked about invoices"})
    assert sorted(recall(sbx, "invoices summaries")) == [
        "asked about invoices",
        "prefers daily summaries",
    ]

    # the host sees what the guest wrote: the tenant's own memory, at that scope
    with Memory(home, embedder=None) as mem:
        texts = [h.record.text for h in mem.scope(**U42).recall("summaries invoices", k=5)]
    assert set(texts) == {"prefers daily summaries", "asked about invoices"}

    # a sandbox created without a scope reaches nothing
    plain = Sandbox.create(runtime=rt)
    assert curl(plain, "/v1/memory/recall", {"query": "x"})["error"]["type"] == "AccessDenied"
    for s in (child, plain, sbx):
        s.kill()
