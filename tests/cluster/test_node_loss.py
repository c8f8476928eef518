"""Issue 9's example end to end: two real ``torpor serve --cluster`` node processes, each with a
home of its own, one real PostgreSQL (tests/pg.py) and one real S3 server (SeaweedFS,
tests/s3.py). A sandbox paused on n1 and made durable wakes on n2 after n1 is SIGKILLed and its
directory deleted, with its interpreter's variables intact.

Run alone::

    TORPOR_HOME=/root/.torpor PYTHONPATH=. python3 -m pytest -q -p no:cacheprovider \\
        tests/cluster/test_node_loss.py
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import torpor
from tests.nodes import Node, kill_node, start_node, stop_node
from tests.pg import PgCluster
from tests.s3 import S3Server, free_ports

pytestmark = [pytest.mark.qemu, pytest.mark.postgres, pytest.mark.s3]


def _nodes(
    template_home: Path,
    pg_cluster: PgCluster,
    pg_database: str,
    s3_server: S3Server,
    s3_bucket: str,
    **extra: str,
) -> Iterator[tuple[Node, Node]]:
    env = {**os.environ, **s3_server.env(), "TORPOR_EMBEDDER": "none", **extra}
    env["TORPOR_LEASE_SECONDS"] = "6"
    env.pop("TORPOR_URL", None)
    env.pop("TORPOR_TOKEN", None)
    dsn = pg_cluster.admin_dsn(pg_database)
    store = f"s3://{s3_bucket}/cluster"
    templates = (template_home / "templates").resolve()
    p1, p2 = free_ports(2)
    started: list[Node] = []
    try:
        started.append(start_node("n1", p1, dsn, store, templates, env))
        started.append(start_node("n2", p2, dsn, store, templates, env))
        yield started[0], started[1]
    finally:
        for node in started:
            stop_node(node)


@pytest.fixture
def nodes(
    template_home: Path,
    pg_cluster: PgCluster,
    pg_database: str,
    s3_server: S3Server,
    s3_bucket: str,
) -> Iterator[tuple[Node, Node]]:
    yield from _nodes(template_home, pg_cluster, pg_database, s3_server, s3_bucket)


@pytest.fixture
def compacting_nodes(
    template_home: Path,
    pg_cluster: PgCluster,
    pg_database: str,
    s3_server: S3Server,
    s3_bucket: str,
) -> Iterator[tuple[Node, Node]]:
    """Two nodes that compact every durable paused sandbox at once (its files dropped)."""
    yield from _nodes(
        template_home,
        pg_cluster,
        pg_database,
        s3_server,
        s3_bucket,
        TORPOR_COMPACT_AFTER_SECONDS="0",
    )


def test_paused_sandbox_wakes_on_another_node_after_its_node_dies(
    nodes: tuple[Node, Node],
) -> None:
    n1, n2 = nodes
    with torpor.Runtime(home=n1.home, autostart=False) as owner:  # the trusted local socket
        tok = owner.tokens.create(sandboxes={}, admin=True).token

    rt = torpor.Runtime(url=n1.url, token=tok)
    sbx = rt.sandboxes.get_or_create("agent-u-42")
    sbx.interpreter.run("notes = [1, 2]")
    rt2 = torpor.Runtime(url=n2.url, token=tok)
    via_n2 = rt2.sandboxes.get("agent-u-42")  # n1 runs it: n2 proxies the call there
    assert via_n2.interpreter.run("notes").results[0].data["text/plain"] == "[1, 2]"
    sbx.pause()
    paused = time.monotonic()
    deadline = paused + 120
    info = sbx.info
    while info.durable is None:  # pushed to the store in the background
        assert time.monotonic() < deadline, f"never durable: {info}\n{n1.log_tail()}"
        time.sleep(0.5)
        info = sbx.info
    assert info.upload_error is None and info.state.value == "paused"
    print(f"durable {time.monotonic() - paused:.2f} s after the pause returned")

    kill_node(n1)  # n1 dies, and its disk with it
    shutil.rmtree(n1.home / "sandboxes")

    started = time.monotonic()
    woken = rt2.sandboxes.get_or_create("agent-u-42")
    print(f"woken on n2 in {time.monotonic() - started:.2f} s (fetch + rebuild + wake)")
    print("\n".join(line for line in n2.log_tail(200).splitlines() if "pause" in line))
    try:
        assert woken.interpreter.run("notes").results[0].data["text/plain"] == "[1, 2]"
    except AssertionError:
        print(n2.log_tail())
        raise
    assert woken.info.state.value == "running" and woken.id == sbx.id


def test_snapshot_restores_on_another_node_after_its_node_dies(
    nodes: tuple[Node, Node],
) -> None:
    """A snapshot is pushed to the store in the background (``durable``); once it is, it
    restores on n2 after n1 is SIGKILLed and its whole home deleted (its chunks and its
    path to the template with it: n2 restores on its own copy of the template build)."""
    n1, n2 = nodes
    with torpor.Runtime(home=n1.home, autostart=False) as owner:
        tok = owner.tokens.create(sandboxes={}, admin=True).token
    rt = torpor.Runtime(url=n1.url, token=tok)
    sbx = rt.sandboxes.get_or_create("agent-snap")
    sbx.interpreter.run("notes = [3, 4]")
    snap = sbx.snapshot("agent-snap-before")
    taken = time.monotonic()
    info = torpor.Snapshot.get(snap.id, runtime=rt).info
    while info.durable is None:
        assert time.monotonic() < taken + 120, f"never durable: {info}\n{n1.log_tail()}"
        time.sleep(0.5)
        info = torpor.Snapshot.get(snap.id, runtime=rt).info
    assert info.upload_error is None and info.node == "n1"
    print(f"snapshot durable {time.monotonic() - taken:.2f} s after it was taken")

    kill_node(n1)
    shutil.rmtree(n1.home)

    rt2 = torpor.Runtime(url=n2.url, token=tok)
    started = time.monotonic()
    restored = torpor.Snapshot.get("agent-snap-before", runtime=rt2).restore(name="agent-snap-2")
    print(f"restored on n2 in {time.monotonic() - started:.2f} s (fetch + rebuild + wake)")
    try:
        assert restored.interpreter.run("notes").results[0].data["text/plain"] == "[3, 4]"
    except AssertionError:
        print(n2.log_tail())
        raise


def _until_durable(sbx: torpor.Sandbox, node: Node, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    info = sbx.info
    while info.durable is None:
        assert time.monotonic() < deadline, f"never durable: {info}\n{node.log_tail()}"
        time.sleep(0.5)
        info = sbx.info
    assert info.upload_error is None and info.state.value == "paused"


def test_a_volume_travels_with_its_pause_and_a_compacted_pause_wakes(
    compacting_nodes: tuple[Node, Node],
) -> None:
    """A sandbox with a volume attached is paused on n1 (the volume's image is pushed with
    the pause: ``volumes`` of its manifest) and, n1 dead and its home deleted, woken on n2
    with the volume's files and its variables intact. Paused again on n2, its pause durable,
    n2 compacts it (its local directory dropped) and wakes it from its cache and the store."""
    n1, n2 = compacting_nodes
    with torpor.Runtime(home=n1.home, autostart=False) as owner:
        tok = owner.tokens.create(sandboxes={}, admin=True).token
    rt = torpor.Runtime(url=n1.url, token=tok)
    vol = torpor.Volume.create("memory-u-7", size_mib=64, runtime=rt)
    sbx = rt.sandboxes.create(name="agent-vol", volumes=[{"volume": vol.id, "path": "/memory"}])
    sbx.commands.run("echo '- prefers tea' >> /memory/facts.md && sync")
    sbx.interpreter.run("x = 41")
    sbx.pause()
    _until_durable(sbx, n1)

    kill_node(n1)
    shutil.rmtree(n1.home)  # its sandboxes and its volume images with it

    rt2 = torpor.Runtime(url=n2.url, token=tok)
    woken = rt2.sandboxes.get("agent-vol")
    try:
        assert woken.files.read_text("/memory/facts.md") == "- prefers tea\n"
        assert woken.interpreter.run("x").results[0].data["text/plain"] == "41"
    except AssertionError:
        print(n2.log_tail())
        raise
    assert torpor.Volume.get(vol.id, runtime=rt2).info.node == "n2"
    woken.commands.run("echo '- and biscuits' >> /memory/facts.md && sync")

    woken.pause()
    _until_durable(woken, n2)
    directory = n2.home / "sandboxes" / woken.id
    deadline = time.monotonic() + 60
    while directory.exists():  # n2's supervisor compacts it (looks every 10 s)
        assert time.monotonic() < deadline, f"never compacted\n{n2.log_tail()}"
        time.sleep(0.5)
    assert woken.info.state.value == "paused" and woken.info.owned_bytes == 0
    again = rt2.sandboxes.get("agent-vol")
    try:
        assert again.files.read_text("/memory/facts.md") == "- prefers tea\n- and biscuits\n"
        assert again.interpreter.run("x").results[0].data["text/plain"] == "41"
    except AssertionError:
        print(n2.log_tail())
        raise
    assert directory.is_dir()
