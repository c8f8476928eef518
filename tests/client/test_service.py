"""The issue's example end to end: a TCP server, two tenants, three users, one token each;
memory and sandboxes through one Runtime per user; nothing of one user reaches another; each
tenant's admin reads its usage per user label. On the embedded SQLite store and on PostgreSQL
(the real sandbox manager and registry with the manager's fake engine, no VMs: the routes, the
identity, the memory store and the usage meters are real)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from tests.pg import (  # noqa: F401 (fixtures)
    _pg_memory_database,
    pg_cluster,
    pg_memory_dsn,
)
from tests.sandbox.fakes import FakeEngine
from torpor.client import Runtime, Sandbox
from torpor.config import paths
from torpor.errors import AccessDenied, SandboxNotFound
from torpor.memory.backends import open_backend
from torpor.sandbox.manager import SandboxManager
from torpor.server.app import create_app

USERS = [("acme", "u-42"), ("acme", "u-43"), ("globex", "u-42")]


@pytest.fixture(
    params=[
        pytest.param("sqlite", id="sqlite"),
        pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
    ]
)
def url_and_app(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, Any]]:
    spec = "sqlite" if request.param == "sqlite" else request.getfixturevalue("pg_memory_dsn")
    backend = open_backend(spec, tmp_path / "memory")
    manager = SandboxManager(paths(tmp_path / "home"), engine=FakeEngine())
    app = create_app(
        manager, supervise=False, require_token=True, memory=backend, memory_embedder=None
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    server = uvicorn.Server(uvicorn.Config(app, lifespan="on", log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive()
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", app
    server.should_exit = True
    thread.join(30)
    sock.close()
    backend.close()


def test_issue_example_two_tenants_three_users(url_and_app: tuple[str, Any]) -> None:
    url, app = url_and_app
    tokens = app.state.identity.tokens
    runtimes: dict[tuple[str, str], Runtime] = {}
    for tenant, user in USERS:
        tok = tokens.issue(
            tenant, [("write", f"app/support/user/{user}")], sandboxes={"user": user}
        )
        runtimes[tenant, user] = Runtime(url=url, token=tok)

    for (tenant, user), rt in runtimes.items():
        u = rt.memory.scope(app="support", user=user)
        u.remember(f"{tenant} {user} prefers daily summaries", key="summary_cadence")
        ctx = u.context("write Jordan a short update about summaries", budget_tokens=300)
        assert f"{tenant} {user} prefers daily summaries" in ctx.text and ctx.tokens <= 300
        sbx = Sandbox.get_or_create(f"agent-{user}", labels={"user": user}, runtime=rt)
        assert sbx.info.labels == {"user": user} and sbx.info.tenant == tenant
        assert sbx.commands.run("echo hi").stdout == "hi\n"

    # each one sees its own memory and sandbox only
    for (tenant, user), rt in runtimes.items():
        hits = rt.memory.scope(app="support", user=user).recall("daily summaries", k=10)
        assert [h.text for h in hits] == [f"{tenant} {user} prefers daily summaries"]
        assert [i.name for i in Sandbox.list(runtime=rt)] == [f"agent-{user}"]
        assert rt.health()["tenant"] == tenant
    a42, a43 = runtimes["acme", "u-42"], runtimes["acme", "u-43"]
    with pytest.raises(AccessDenied):
        a43.memory.scope(app="support", user="u-42")
    their = Sandbox.list(runtime=a42)[0]
    for attempt in (
        lambda: Sandbox.get(their.id, runtime=a43),
        lambda: a43.request("DELETE", f"/v1/sandboxes/{their.id}"),
        lambda: a43.request("POST", f"/v1/sandboxes/{their.id}/pause"),
    ):
        with pytest.raises(SandboxNotFound):
            attempt()
    with pytest.raises(AccessDenied):  # the name is another user's
        Sandbox.get_or_create("agent-u-42", runtime=a43)
    g42 = runtimes["globex", "u-42"]
    with pytest.raises(SandboxNotFound):  # same user name, other tenant: another world
        Sandbox.get(their.id, runtime=g42)
    assert Sandbox.get(their.id, runtime=a42).info.state == "running"

    # usage: a tenant-wide report, for a token with every sandbox's rights (the tenant's admin)
    since = (datetime.now(UTC) - timedelta(days=1)).date().isoformat()
    for tenant in ("acme", "globex"):
        admin = Runtime(url=url, token=tokens.issue(tenant, [], sandboxes={}))
        report = admin.usage(by="label:user", since=since)
        assert report.tenant == tenant
        users = sorted(u for t, u in USERS if t == tenant)
        assert sorted(line.key for line in report.lines if line.key) == users
        assert all(line.sandboxes == 1 and line.vcpu_hours > 0 for line in report.lines)
        assert report.total.cost.total > 0
        admin.close()
    with pytest.raises(AccessDenied):  # a user's token reaches no tenant-wide report
        a42.usage(by="label:user", since=since)
    for rt in runtimes.values():
        rt.close()
