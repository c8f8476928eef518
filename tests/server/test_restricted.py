"""Tokens restricted to one user's sandboxes (a label selector), against a live server.

A real uvicorn server on TCP over the real SandboxManager with the manager's fake engine (no
VMs): the routes, the identity and the manager's name lock are real. Two users' tokens race
get-or-create on one name; a user's token is held away from another user's snapshots,
volumes and drives.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from tests.sandbox.fakes import FakeEngine
from torpor.config import paths
from torpor.sandbox.manager import SandboxManager
from torpor.server.app import create_app


@dataclass
class Live:
    url: str
    app: Any

    def token(self, user: str | None, tenant: str = "acme") -> str:
        """A token of ``tenant`` for ``user`` 's sandboxes (None: every sandbox)."""
        selector = {} if user is None else {"user": user}
        secret: str = self.app.state.identity.tokens.issue(tenant, [], sandboxes=selector)
        return secret

    def client(self, token: str) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=60
        )


class SlowLookups(SandboxManager):
    """The real manager whose lookups answer late (as a loaded registry would): what a
    caller learns from ``get`` may be stale by the time it acts on it."""

    async def get(self, id_or_name: str, *, tenant: str = "default") -> Any:
        try:
            return await super().get(id_or_name, tenant=tenant)
        finally:
            await asyncio.sleep(0.05)


@pytest.fixture
def live(tmp_path: Path) -> Iterator[Live]:
    yield from _serve(SandboxManager(paths(tmp_path), engine=FakeEngine()))


@pytest.fixture
def slow_live(tmp_path: Path) -> Iterator[Live]:
    yield from _serve(SlowLookups(paths(tmp_path), engine=FakeEngine()))


def _serve(manager: SandboxManager) -> Iterator[Live]:
    app = create_app(manager, supervise=False, require_token=True, memory_embedder=None)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    server = uvicorn.Server(uvicorn.Config(app, lifespan="on", log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    try:
        yield Live(f"http://127.0.0.1:{sock.getsockname()[1]}", app)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


# -- the get-or-create race ------------------------------------------------------------------


def _race(clients: dict[str, httpx.Client], name: str) -> dict[str, httpx.Response]:
    """Each user's get-or-create of ``name`` with its own labels, all let go at once."""
    answers: dict[str, httpx.Response] = {}
    start = threading.Barrier(len(clients))

    def claim(user: str) -> None:
        start.wait()
        answers[user] = clients[user].put(
            f"/v1/sandboxes/by-name/{name}", json={"labels": {"user": user}}
        )

    threads = [threading.Thread(target=claim, args=(u,)) for u in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return answers


def test_racing_get_or_create_never_gives_one_users_sandbox_to_another(slow_live: Live) -> None:
    live = slow_live
    users = ("u-1", "u-2")
    clients = {u: live.client(live.token(u)) for u in users}
    admin = live.client(live.token(None))
    for round_ in range(12):
        name = f"shared-{round_}"
        answers = _race(clients, name)
        statuses = {u: r.status_code for u, r in answers.items()}
        winners = [u for u, code in statuses.items() if code == 200]
        assert len(winners) == 1, (name, statuses)
        [loser] = set(users) - set(winners)
        assert answers[loser].status_code == 403, answers[loser].text
        assert answers[loser].json()["error"]["type"] == "AccessDenied"
        held = admin.get(f"/v1/sandboxes/{name}").json()
        assert held["labels"] == {"user": winners[0]}, (name, held["labels"])
        # the loser sees nothing of it afterwards either
        assert clients[loser].get(f"/v1/sandboxes/{name}").status_code == 404
