"""Cluster mode over HTTP: any node accepts any request, and one for a sandbox another node
runs is proxied there (torpor.server.proxy). Two real HTTP servers, each a node with its own
home and a fake engine (no VMs), on one real PostgreSQL and one real S3 server."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn

import torpor
from tests.pg import PgCluster
from tests.s3 import S3Server
from tests.sandbox.fakes import FakeEngine
from torpor.cli import main
from torpor.client import set_default_runtime
from torpor.config import paths
from torpor.errors import Conflict
from torpor.sandbox.manager import SandboxManager
from torpor.sandbox.manager.cluster import ClusterConfig
from torpor.server.app import create_app

pytestmark = [pytest.mark.postgres, pytest.mark.s3]


def _serve(manager: SandboxManager, sock: socket.socket) -> tuple[uvicorn.Server, threading.Thread]:
    app = create_app(manager, supervise=False, require_token=False, memory_embedder=None)
    server = uvicorn.Server(uvicorn.Config(app, lifespan="on", log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive()
        time.sleep(0.01)
    return server, thread


@pytest.fixture
def two_nodes(
    tmp_path: Path,
    pg_cluster: PgCluster,
    pg_database: str,
    s3_server: S3Server,
    s3_bucket: str,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[str, str]]:
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    servers, urls = [], []
    for name in ("n1", "n2"):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = ClusterConfig(
            dsn=pg_cluster.admin_dsn(pg_database),
            store=f"s3://{s3_bucket}/c",
            node=name,
            url=url,
            lease_seconds=10,
            heartbeat_seconds=1,
        )
        manager = SandboxManager(paths(tmp_path / name), engine=FakeEngine(), cluster=config)
        servers.append((*_serve(manager, sock), sock))
        urls.append(url)
    yield urls[0], urls[1]
    for server, _, _ in servers:
        server.should_exit = True
    for _, thread, sock in servers:
        thread.join(60)  # the node closes its manager: pauses pushed before it goes
        sock.close()


def test_a_request_to_any_node_reaches_the_owner(two_nodes: tuple[str, str]) -> None:
    n1, n2 = two_nodes
    with torpor.Runtime(url=n1) as rt1, torpor.Runtime(url=n2) as rt2:
        sbx = rt1.sandboxes.create(name="agent")
        sbx.interpreter.run("x = 7")
        via_n2 = rt2.sandboxes.get("agent")  # a read: any node answers from the registry
        assert via_n2.interpreter.run("x").results[0].data["text/plain"] == "7"  # proxied
        out = via_n2.commands.run("echo hi")
        assert out.stdout == "hi\n"
        # the proxy is one hop: a request already proxied gets the Conflict itself
        with pytest.raises(Conflict) as conflict:
            rt2.request(
                "POST", f"/v1/sandboxes/{sbx.id}/pause", headers={"X-Torpor-Proxied-By": "n1"}
            )
        assert conflict.value.data["owner_node"] == "n1"
        assert conflict.value.data["owner_url"] == n1
        assert rt2.sandboxes.get("agent").pause().state.value == "paused"  # proxied pause


def _cli_json(capsys: pytest.CaptureFixture[str], *args: str) -> object:
    capsys.readouterr()
    try:
        main(list(args))
    except SystemExit as exc:
        assert not exc.code, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_nodes_and_drain_over_http(
    two_nodes: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    n1, n2 = two_nodes
    with torpor.Runtime(url=n1) as rt1, torpor.Runtime(url=n2) as rt2:
        sbx = rt1.sandboxes.create(name="agent")
        sbx.interpreter.run("x = 7")
        set_default_runtime(rt2)
        try:
            listed = _cli_json(capsys, "nodes", "--json")
        finally:
            set_default_runtime(None)
        assert isinstance(listed, list) and [n["name"] for n in listed] == ["n1", "n2"]
        keys = {
            "name", "url", "alive", "draining", "heartbeat_age_seconds", "accelerator",
            "cpu_model", "capacity_mib", "vcpus", "sandboxes", "memory_mib", "this",
        }  # fmt: skip
        assert all(set(n) == keys for n in listed)
        one, two = listed
        assert one["url"] == n1 and one["sandboxes"] == 1 and one["memory_mib"] == 512
        assert two["this"] and not one["this"] and one["alive"] and two["alive"]
        report = rt2.drain_node("n1", timeout=60)  # sent to n2: proxied to n1, which drains
        assert report.node == "n1" and [s.name for s in report.moved] == ["agent"]
        assert report.moved[0].durable is not None and report.failed == []
        assert [n.draining for n in rt1.nodes()] == [True, False]
        # n1 takes nothing new: the wake and a create sent to it happen on n2 (proxied)
        assert rt1.sandboxes.get("agent").interpreter.run("x").results[0].data["text/plain"] == "7"
        assert rt2.nodes()[1].sandboxes == 1  # it runs on n2
        made = rt1.sandboxes.create(name="new")
        assert {n.name: n.sandboxes for n in rt1.nodes()} == {"n1": 0, "n2": 2}
        made.kill()


def test_a_wake_whose_chosen_node_is_unreachable_happens_here(
    tmp_path: Path,
    pg_cluster: PgCluster,
    pg_database: str,
    s3_server: S3Server,
    s3_bucket: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The origin node stops (its heartbeat still fresh: placement still picks it): the node
    that got the request cannot proxy there and wakes the sandbox itself."""
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    nodes = []
    for name in ("n1", "n2"):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = ClusterConfig(
            dsn=pg_cluster.admin_dsn(pg_database),
            store=f"s3://{s3_bucket}/u",
            node=name,
            url=url,
            lease_seconds=30,
            heartbeat_seconds=1,
        )
        manager = SandboxManager(paths(tmp_path / name), engine=FakeEngine(), cluster=config)
        nodes.append((url, manager, *_serve(manager, sock), sock))
    (u1, _, s1, t1, k1), (u2, m2, s2, t2, k2) = nodes
    try:
        with torpor.Runtime(url=u1) as rt1, torpor.Runtime(url=u2) as rt2:
            sbx = rt1.sandboxes.create(name="agent")
            sbx.interpreter.run("x = 5")
            sbx.pause()
            deadline = time.monotonic() + 30
            while rt1.sandboxes.get("agent").info.durable is None:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            s1.should_exit = True  # n1 goes; its row stays alive for up to 30 s
            t1.join(60)
            k1.close()
            assert [n.alive for n in rt2.nodes()] == [True, True]
            assert m2.cluster is not None
            assert m2.cluster.place(sbx.id)[0] is not None  # placement still says n1
            out = rt2.sandboxes.get("agent").interpreter.run("x")
            assert out.results[0].data["text/plain"] == "5"
            assert m2.cluster.registry.owner(sbx.id) == "n2"
    finally:
        s1.should_exit = s2.should_exit = True
        t1.join(60)
        t2.join(60)
        k1.close()
        k2.close()


def test_a_streamed_call_to_any_node_reaches_the_owner(two_nodes: tuple[str, str]) -> None:
    """A streamed command or code run sent to a node that does not hold the sandbox is
    proxied to its owner like any other call, not answered with the owner's Conflict in
    the stream."""
    n1, n2 = two_nodes
    with torpor.Runtime(url=n1) as rt1, torpor.Runtime(url=n2) as rt2:
        rt1.sandboxes.create(name="agent").interpreter.run("x = 7")
        via_n2 = rt2.sandboxes.get("agent")
        out: list[str] = []
        assert via_n2.commands.run("echo hi", on_stdout=out.append).stdout == "hi\n"
        run = via_n2.interpreter.run("x", on_stdout=out.append)
        assert run.results[0].data["text/plain"] == "7"
        # a terminal too: opened, typed on and killed through n2, it runs on n1
        term = via_n2.pty.create(cmd="sh")
        term.send_stdin("typed on n2")
        assert term.wait_for("typed on n2", timeout=10)
        term.resize(100, 30)
        assert term.kill()
        assert term.wait(10) == 137
