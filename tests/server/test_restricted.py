"""Tokens restricted to one user's sandboxes (a label selector), against a live server.

A real uvicorn server on TCP over the real SandboxManager with the manager's fake engine (no
VMs): the routes, the identity and the manager's name lock are real. Two users' tokens race
get-or-create on one name; a user's token is held away from another user's snapshots,
volumes and drives.
"""

from __future__ import annotations

import asyncio
import itertools
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
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tests.sandbox.fakes import FakeEngine
from tests.sandbox.storage_helpers import make_home, make_machine
from torpor.config import paths
from torpor.sandbox.manager import SandboxManager
from torpor.sandbox.storage.snapshots import CarriedSettings, SnapshotStore, freeze
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
    # a home with a template disk, where stored snapshots can be made without a VM
    yield from _serve(SandboxManager(make_home(tmp_path), engine=FakeEngine()))


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


# -- snapshots, volumes and drives -----------------------------------------------------------

_names = itertools.count()
#: a user id as a label value
USERS = st.from_regex(r"[a-z0-9][a-z0-9._-]{0,30}", fullmatch=True)


def _stored_snapshot(live: Live, user: str) -> dict[str, Any]:
    """A snapshot in the server's store whose source sandbox was labelled ``user`` (made
    from a hibernated machine's files: the fake engine makes none)."""
    home = live.app.state.manager.paths
    store = SnapshotStore(home)
    n = next(_names)
    machine = make_machine(home, f"sbx-src{n:09d}")
    info = store.save(
        freeze(machine, store.frozen_root),
        name=f"snap-{n}",
        tenant="acme",
        carried=CarriedSettings(labels={"user": user}),
    )
    return info.model_dump(mode="json")


@settings(
    max_examples=8,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(mine=USERS, theirs=USERS)
def test_a_users_token_reaches_its_snapshots_and_no_shared_storage(
    live: Live, mine: str, theirs: str
) -> None:
    assume(mine != theirs)
    n = next(_names)
    admin = live.client(live.token(None))
    me = live.client(live.token(mine))
    own_snap, their_snap = _stored_snapshot(live, mine), _stored_snapshot(live, theirs)
    volume = admin.post("/v1/volumes", json={"name": f"vol-{n}", "size_mib": 16}).json()
    drive = admin.post("/v1/drives", json={"name": f"drv-{n}"}).json()
    own_box = me.put(f"/v1/sandboxes/by-name/box-{n}", json={}).json()
    assert own_box["labels"] == {"user": mine}
    sandboxes = len(admin.get("/v1/sandboxes").json())

    # its own snapshot is listed and reachable; the other user's is not there at all
    listed = {s["id"] for s in me.get("/v1/snapshots").json()}
    assert own_snap["id"] in listed and their_snap["id"] not in listed
    assert me.get(f"/v1/snapshots/{own_snap['id']}").status_code == 200
    r = me.post(f"/v1/snapshots/{own_snap['id']}/retention", json={"days": 9})
    assert r.status_code == 200 and r.json()["retention_days"] == 9
    for ref in (their_snap["id"], their_snap["name"]):
        for method, url, body in [
            ("GET", f"/v1/snapshots/{ref}", None),
            ("DELETE", f"/v1/snapshots/{ref}", None),
            ("POST", f"/v1/snapshots/{ref}/restore", {}),
            ("POST", f"/v1/snapshots/{ref}/fork", {"count": 1}),
            ("POST", f"/v1/snapshots/{ref}/retention", {"days": 30}),
            ("POST", "/v1/sandboxes", {"snapshot": ref}),
        ]:
            r = me.request(method, url, json=body)
            assert (r.status_code, r.json()["error"]["type"]) == (404, "SnapshotNotFound"), (
                method,
                url,
                r.text,
            )
    # nor can it label what it restores as another user's
    r = me.post(f"/v1/snapshots/{own_snap['id']}/restore", json={"labels": {"user": theirs}})
    assert r.status_code == 403

    # volumes and drives are the tenant's shared storage: none of it, in any way
    for method, url, body in [
        ("GET", "/v1/volumes", None),
        ("POST", "/v1/volumes", {"name": f"mine-{n}", "size_mib": 16}),
        ("GET", f"/v1/volumes/{volume['id']}", None),
        ("DELETE", f"/v1/volumes/{volume['id']}", None),
        ("GET", f"/v1/volumes/{volume['id']}/files?path=/", None),
        ("GET", "/v1/drives", None),
        ("POST", "/v1/drives", {"name": f"mine-{n}"}),
        ("GET", f"/v1/drives/{drive['id']}", None),
        ("DELETE", f"/v1/drives/{drive['id']}", None),
        ("POST", f"/v1/sandboxes/{own_box['id']}/volumes", {"volume": volume["id"], "path": "/v"}),
        ("POST", f"/v1/sandboxes/{own_box['id']}/drives", {"drive": drive["id"], "path": "/d"}),
        ("POST", "/v1/sandboxes", {"volumes": [{"volume": volume["id"], "path": "/v"}]}),
        ("POST", "/v1/sandboxes", {"drives": [{"drive": drive["id"], "path": "/d"}]}),
    ]:
        r = me.request(method, url, json=body)
        assert (r.status_code, r.json()["error"]["type"]) == (403, "AccessDenied"), (url, r.text)

    # nothing of the other user's (or the tenant's) changed
    kept = admin.get(f"/v1/snapshots/{their_snap['id']}").json()
    assert kept["retention_days"] == their_snap["retention_days"]
    assert admin.get(f"/v1/volumes/{volume['id']}").json()["attachments"] == []
    assert admin.get(f"/v1/drives/{drive['id']}").json()["attachments"] == []
    assert len(admin.get("/v1/sandboxes").json()) == sandboxes  # no restore, no mount made one
    for c in (admin, me):
        c.close()
