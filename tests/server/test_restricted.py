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
def test_a_users_token_reaches_its_snapshots_and_not_the_shared_storage(
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

    # the tenant's shared (unlabelled) volume and drive are out of reach: none of it, any way
    for method, url, body, error in [
        ("GET", f"/v1/volumes/{volume['id']}", None, "VolumeNotFound"),
        ("GET", f"/v1/volumes/{volume['name']}", None, "VolumeNotFound"),
        ("DELETE", f"/v1/volumes/{volume['id']}", None, "VolumeNotFound"),
        ("GET", f"/v1/volumes/{volume['id']}/files?path=/", None, "VolumeNotFound"),
        ("GET", f"/v1/drives/{drive['id']}", None, "DriveNotFound"),
        ("DELETE", f"/v1/drives/{drive['name']}", None, "DriveNotFound"),
        (
            "POST",
            f"/v1/sandboxes/{own_box['id']}/volumes",
            {"volume": volume["id"], "path": "/v"},
            "VolumeNotFound",
        ),
        (
            "POST",
            f"/v1/sandboxes/{own_box['id']}/drives",
            {"drive": drive["id"], "path": "/d"},
            "DriveNotFound",
        ),
        (
            "POST",
            "/v1/sandboxes",
            {"volumes": [{"volume": volume["id"], "path": "/v"}]},
            "VolumeNotFound",
        ),
        (
            "POST",
            "/v1/sandboxes",
            {"drives": [{"drive": drive["id"], "path": "/d"}]},
            "DriveNotFound",
        ),
    ]:
        r = me.request(method, url, json=body)
        assert (r.status_code, r.json()["error"]["type"]) == (404, error), (url, r.text)
    assert me.get("/v1/volumes").json() == [] and me.get("/v1/drives").json() == []

    # nothing of the other user's (or the tenant's) changed
    kept = admin.get(f"/v1/snapshots/{their_snap['id']}").json()
    assert kept["retention_days"] == their_snap["retention_days"]
    assert admin.get(f"/v1/volumes/{volume['id']}").json()["attachments"] == []
    assert admin.get(f"/v1/drives/{drive['id']}").json()["attachments"] == []
    assert len(admin.get("/v1/sandboxes").json()) == sandboxes  # no restore, no mount made one
    for c in (admin, me):
        c.close()


def _denials(live: Live) -> int:
    return sum(not e.allowed for e in live.app.state.memory_backend.audit_log("acme", 10_000))


@settings(
    max_examples=8,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(mine=USERS, theirs=USERS)
def test_a_users_token_reaches_only_volumes_and_drives_with_its_labels(
    live: Live, mine: str, theirs: str
) -> None:
    assume(mine != theirs)
    n = next(_names)
    admin = live.client(live.token(None))
    me = live.client(live.token(mine))
    labelled = {"user": theirs}
    their_vol = admin.post(
        "/v1/volumes", json={"name": f"tv-{n}", "size_mib": 16, "labels": labelled}
    ).json()
    their_drv = admin.post("/v1/drives", json={"name": f"td-{n}", "labels": labelled}).json()
    assert their_vol["labels"] == their_drv["labels"] == labelled
    own_box = me.put(f"/v1/sandboxes/by-name/box-{n}", json={}).json()

    # what the token makes carries its label; it cannot label one as another user's
    own_vol = me.post("/v1/volumes", json={"name": f"mv-{n}", "size_mib": 16}).json()
    assert own_vol["labels"] == {"user": mine}
    own_drv = me.post("/v1/drives", json={"name": f"md-{n}", "labels": {"team": "x"}}).json()
    assert own_drv["labels"] == {"team": "x", "user": mine}
    for route in ("/v1/volumes", "/v1/drives"):
        r = me.post(route, json={"name": f"x-{n}", "labels": {"user": theirs}})
        assert (r.status_code, r.json()["error"]["type"]) == (403, "AccessDenied"), r.text
        assert admin.get(f"{route}/x-{n}").status_code == 404  # nothing made

    # lists: only its own (earlier examples may have left more of this user's); a label
    # filter narrows them (the admin's too)
    for route, own, their in (
        ("/v1/volumes", own_vol, their_vol),
        ("/v1/drives", own_drv, their_drv),
    ):
        listed = me.get(route).json()
        assert own["id"] in {i["id"] for i in listed}
        assert all(i["labels"].get("user") == mine for i in listed), listed
        assert me.get(route, params={"label": f"user={theirs}"}).json() == []
        theirs_listed = admin.get(route, params={"label": f"user={theirs}"}).json()
        assert their["id"] in {i["id"] for i in theirs_listed}
        assert all(i["labels"].get("user") == theirs for i in theirs_listed)
    teamed = me.get("/v1/drives", params={"label": "team=x"}).json()
    assert own_drv["id"] in {d["id"] for d in teamed}
    assert all(d["labels"]["team"] == "x" for d in teamed)

    # its own are there
    assert me.get(f"/v1/volumes/{own_vol['name']}").json()["id"] == own_vol["id"]
    r = me.get(f"/v1/volumes/{own_vol['id']}/files", params={"path": "/none"})
    assert r.json()["error"]["type"] == "PathNotFound"
    assert me.get(f"/v1/drives/{own_drv['id']}").status_code == 200

    # the other user's are not there at all, and every refusal is audited
    before = _denials(live)
    refused = [
        ("GET", f"/v1/volumes/{their_vol['id']}", None, "VolumeNotFound"),
        ("GET", f"/v1/volumes/{their_vol['name']}", None, "VolumeNotFound"),
        ("GET", f"/v1/volumes/{their_vol['id']}/files?path=/", None, "VolumeNotFound"),
        ("DELETE", f"/v1/volumes/{their_vol['id']}", None, "VolumeNotFound"),
        ("GET", f"/v1/drives/{their_drv['name']}", None, "DriveNotFound"),
        ("DELETE", f"/v1/drives/{their_drv['id']}", None, "DriveNotFound"),
        (
            "POST",
            f"/v1/sandboxes/{own_box['id']}/volumes",
            {"volume": their_vol["id"], "path": "/v"},
            "VolumeNotFound",
        ),
        (
            "POST",
            f"/v1/sandboxes/{own_box['id']}/drives",
            {"drive": their_drv["name"], "path": "/d"},
            "DriveNotFound",
        ),
        (
            "POST",
            "/v1/sandboxes",
            {"volumes": [{"volume": their_vol["id"], "path": "/v"}]},
            "VolumeNotFound",
        ),
        (
            "POST",
            "/v1/sandboxes",
            {"drives": [{"drive": their_drv["id"], "path": "/d"}]},
            "DriveNotFound",
        ),
    ]
    for method, url, body, error in refused:
        r = me.request(method, url, json=body)
        assert (r.status_code, r.json()["error"]["type"]) == (404, error), (url, r.text)
    assert _denials(live) - before >= len(refused)
    assert admin.get(f"/v1/volumes/{their_vol['id']}").json()["labels"] == labelled
    assert admin.get(f"/v1/drives/{their_drv['id']}").json()["attachments"] == []

    # and it deletes its own
    assert me.delete(f"/v1/volumes/{own_vol['id']}").status_code == 204
    assert me.delete(f"/v1/drives/{own_drv['id']}").status_code == 204
    for c in (admin, me):
        c.close()
