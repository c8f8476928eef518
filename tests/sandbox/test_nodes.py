"""Nodes of a cluster without VMs: ``nodes()`` (health and load), ``drain_node`` (pause,
durable, release; the node takes nothing new) and placement (origin preferred, a full or
draining origin skipped, the least loaded node, an incompatible accelerator refused). Three
managers (nodes) on one real PostgreSQL registry and one real S3 store (SeaweedFS), each with
its own home and a fake engine, built as in tests/sandbox/test_cluster.py."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.sandbox.test_cluster import die, node, run, until
from torpor.errors import Conflict, NoNodeAvailable
from torpor.sandbox.manager import SandboxManager
from torpor.sandbox.manager.cluster import PROXIED, compatible
from torpor.sandbox.models import SandboxState as S
from torpor.sandbox.registry.postgres import NodeInfo

pytestmark = [pytest.mark.postgres, pytest.mark.s3]


def pretend(manager: SandboxManager, **fields: Any) -> None:
    """Make the node tell the registry other facts about itself (capacity, accelerator...)."""
    cluster = manager.cluster
    assert cluster is not None
    real = cluster.info
    cluster.info = lambda: replace(real(), **fields)  # type: ignore[method-assign]
    cluster.beat()


async def durable(manager: SandboxManager, name: str) -> None:
    await until(lambda: manager.get(name), lambda i: i.durable is not None, timeout=30)


def test_compatibility_rule() -> None:
    kvm = NodeInfo(id="a", accelerator="kvm", cpu_model="EPYC 9654", capacity_mib=1)
    tcg = replace(kvm, accelerator="tcg", cpu_model="Xeon")
    assert compatible(kvm, {"accelerator": "kvm", "cpu_model": "EPYC 9654"})
    assert not compatible(kvm, {"accelerator": "kvm", "cpu_model": "Xeon 8480"})  # CPU state
    assert not compatible(kvm, {"accelerator": "tcg", "cpu_model": "EPYC 9654"})
    assert compatible(tcg, {"accelerator": "tcg", "cpu_model": "EPYC 9654"})  # QEMU's own CPU
    assert not compatible(tcg, {"accelerator": "kvm", "cpu_model": "Xeon"})
    assert compatible(tcg, None)  # a pause that does not say where it was made


def test_nodes_show_health_and_load(tmp_path: Path, dsn: str, store: str) -> None:
    async def body() -> None:
        n1, n2 = node(tmp_path, dsn, store, "n1"), node(tmp_path, dsn, store, "n2")
        await n1.start(supervise=False)
        await n2.start(supervise=False)
        await n1.get_or_create("a")
        await n1.create(name="b", memory_mib=256)
        rows = {n.name: n for n in await n2.nodes()}
        assert set(rows) == {"n1", "n2"}
        one, two = rows["n1"], rows["n2"]
        assert one.alive and two.alive and not one.draining
        assert (one.sandboxes, one.memory_mib) == (2, 512 + 256)
        assert (two.sandboxes, two.memory_mib) == (0, 0)
        assert two.this and not one.this and one.url == "http://n1.test:8765"
        assert one.capacity_mib > 0 and one.vcpus > 0 and one.accelerator and one.cpu_model
        assert one.heartbeat_age_seconds is not None and one.heartbeat_age_seconds < 3
        await n1.pause("b")
        assert {n.name: n.sandboxes for n in await n2.nodes()}["n1"] == 1  # b no longer runs
        die(n1, None)
        await asyncio.sleep(3.5)  # the lease (3 s) lapses
        one = {n.name: n for n in await n2.nodes()}["n1"]
        assert not one.alive and one.heartbeat_age_seconds is not None
        assert one.heartbeat_age_seconds > 3
        await n2.close()

    run(body)


def test_one_machine_is_one_node(tmp_path: Path) -> None:
    from tests.sandbox.fakes import FakeEngine
    from torpor.config import paths

    async def body() -> None:
        manager = SandboxManager(paths(tmp_path / "h"), engine=FakeEngine())
        await manager.start(supervise=False)
        await manager.get_or_create("a")
        [row] = await manager.nodes()
        assert row.name == "local" and row.this and row.alive and row.url == ""
        assert (row.sandboxes, row.memory_mib) == (1, 512)
        assert row.heartbeat_age_seconds is None and row.capacity_mib > 0
        with pytest.raises(Exception, match="cluster mode"):
            await manager.drain_node("local")
        await manager.close()

    run(body)


def test_drain_moves_sandboxes_off_the_node(tmp_path: Path, dsn: str, store: str) -> None:
    async def body() -> None:
        n1, n2 = node(tmp_path, dsn, store, "n1"), node(tmp_path, dsn, store, "n2")
        await n1.start(supervise=False)
        await n2.start(supervise=False)
        await n1.get_or_create("a")
        await n1.run_code("a", "x = 41")
        await n1.get_or_create("b")
        await n1.pause("b")  # paused already: made durable and released too
        with pytest.raises(Conflict) as elsewhere:  # only n1 drains n1
            await n2.drain_node("n1")
        assert elsewhere.value.data["owner_url"] == "http://n1.test:8765"
        report = await n1.drain_node("n1")
        assert report.node == "n1" and report.failed == []
        assert sorted(s.name for s in report.moved) == ["a", "b"]
        assert all(s.state is S.PAUSED and s.durable is not None for s in report.moved)
        assert n1.cluster is not None
        for s in report.moved:
            assert n1.cluster.registry.owner(s.id) is None  # released: any node wakes it
        rows = {n.name: n for n in await n2.nodes()}
        assert rows["n1"].draining and rows["n1"].sandboxes == 0 and not rows["n2"].draining
        # the draining node takes nothing new: a create goes to n2, a wake too
        with pytest.raises(Conflict) as create:
            await n1.create(name="c")
        assert create.value.data["owner_node"] == "n2"
        assert [i.name for i in await n1.list()] == ["a", "b"]  # nothing made
        with pytest.raises(Conflict) as wake:
            await n1.run_code("a", "x")
        assert wake.value.data["owner_node"] == "n2"
        out = await n2.run_code("a", "x + 1")  # n2 wakes it (its pause from the store)
        assert out.results[0].data["text/plain"] == "42"
        # a draining node with no other live node to send to says so
        await n2.close()
        await asyncio.sleep(3.5)  # n2's last heartbeat is older than the lease
        with pytest.raises(NoNodeAvailable):
            await n1.create(name="c")
        await n1.close()

    run(body)


def test_placement_prefers_the_origin_then_here_then_the_least_loaded(
    tmp_path: Path, dsn: str, store: str
) -> None:
    async def body() -> None:
        n1, n2, n3 = (node(tmp_path, dsn, store, n, lease=6.0) for n in ("n1", "n2", "n3"))
        for n in (n1, n2, n3):
            await n.start(supervise=False)
        await n1.get_or_create("agent")
        await n1.run_code("agent", "x = 1")
        await n1.pause("agent")
        await durable(n1, "agent")
        # origin alive, not draining, not full: another node sends the wake there
        with pytest.raises(Conflict) as there:
            await n2.run_code("agent", "x")
        assert there.value.data["owner_node"] == "n1"
        assert there.value.data["placed"] == "its origin node"
        # ... unless the request was already sent to it by another node: it wakes here then
        token = PROXIED.set("n1")
        try:
            assert (await n2.run_code("agent", "x")).results[0].data["text/plain"] == "1"
        finally:
            PROXIED.reset(token)
        await n2.pause("agent")
        await durable(n2, "agent")  # its origin is n2 now
        # a full origin is skipped: the node that got the request wakes it
        pretend(n2, capacity_mib=600)
        await n2.create(name="filler")  # 512 of n2's 600 MiB
        out = await n3.run_code("agent", "x")
        assert out.results[0].data["text/plain"] == "1"
        assert (
            n3.cluster is not None and n3.cluster.registry.owner((await n3.get("agent")).id) == "n3"
        )
        await n3.pause("agent")
        await durable(n3, "agent")  # origin n3
        # origin draining, receiving node full: the least loaded other node
        assert n3.cluster is not None
        n3.cluster.draining = True
        n3.cluster.beat()
        await n1.create(name="load-1")  # n1 holds 512 MiB
        with pytest.raises(Conflict) as least:
            await n2.run_code("agent", "x")  # n2 full, n3 draining: n1
        assert least.value.data["owner_node"] == "n1"
        assert least.value.data["placed"] == "the least loaded node"
        for n in (n1, n2, n3):
            await n.close()

    run(body)


def test_an_incompatible_pause_never_wakes(tmp_path: Path, dsn: str, store: str) -> None:
    async def body() -> None:
        n1, n2 = node(tmp_path, dsn, store, "n1"), node(tmp_path, dsn, store, "n2")
        await n1.start(supervise=False)
        await n2.start(supervise=False)
        pretend(n1, accelerator="kvm", cpu_model="EPYC 9654")
        await n1.get_or_create("agent")
        await n1.pause("agent")
        await durable(n1, "agent")
        pretend(n2, accelerator="kvm", cpu_model="Xeon 8480")
        die(n1, tmp_path / "n1")
        await asyncio.sleep(3.5)  # n1's heartbeat is stale: the origin is gone
        with pytest.raises(NoNodeAvailable) as refused:
            await n2.run_code("agent", "1")
        assert refused.value.data["accelerator"] == "kvm"
        assert refused.value.data["cpu_model"] == "EPYC 9654"
        token = PROXIED.set("n9")  # even a request sent here on purpose
        try:
            with pytest.raises(NoNodeAvailable):
                await n2.run_code("agent", "1")
        finally:
            PROXIED.reset(token)
        info = await n2.get("agent")
        assert info.state is S.PAUSED  # nothing changed
        pretend(n2, accelerator="kvm", cpu_model="EPYC 9654")  # a compatible node: it wakes
        assert (await n2.run_code("agent", "6 * 7")).results[0].data["text/plain"] == "42"
        await n2.close()

    run(body)
