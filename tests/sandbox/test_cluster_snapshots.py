"""Snapshots in cluster mode without VMs: manifests in the real PostgreSQL registry, chunks
saved on the node and pushed to a real S3 store (SeaweedFS) in the background, restored on any
node. Nodes are managers with fake engines (tests/sandbox/fakes.py), as in test_cluster.py; the
same path with real QEMU node processes is tests/cluster/test_node_loss.py.

The first test runs one scenario over both catalogs (the local ``snapshots/`` files and the
registry's table), so the two keep the same interface.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.s3 import S3Server
from torpor.config import Paths
from torpor.errors import (
    Conflict,
    CorruptData,
    NoNodeAvailable,
    SnapshotNotFound,
    StateLost,
    TemplateNotFound,
)
from torpor.sandbox.checkpoints import Checkpoints
from torpor.sandbox.manager import SandboxManager
from torpor.sandbox.manager.cluster import RegistryCatalog
from torpor.sandbox.registry.postgres import PostgresRegistry
from torpor.sandbox.storage.chunks import FileManifest
from torpor.sandbox.storage.snapshots import SnapshotInfo, SnapshotStore, freeze

try:  # plain pytest puts this directory on sys.path; a package layout needs the relative form
    from tests.sandbox.storage_helpers import make_home, make_machine
    from tests.sandbox.test_cluster import die, node, run
except ImportError:  # pragma: no cover
    from .storage_helpers import make_home, make_machine
    from .test_cluster import die, node, run

pytestmark = [pytest.mark.postgres, pytest.mark.s3]


# -- one scenario over both catalogs -------------------------------------------------------------


@pytest.fixture(params=["local", "postgres"])
def stores(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[Paths], Any]]:
    """Make a home's snapshot store: with its own manifests (local), or with the manifests in
    a shared PostgreSQL registry (two homes then see the same snapshots)."""
    if request.param == "local":
        yield lambda p: SnapshotStore(p)
        return
    dsn: str = request.getfixturevalue("dsn")
    reg = PostgresRegistry(dsn)
    yield lambda p: SnapshotStore(p, catalog=RegistryCatalog(reg, p.home.name))
    reg.close()


def test_one_snapshot_interface_over_both_catalogs(
    tmp_path: Path, stores: Callable[[Paths], SnapshotStore]
) -> None:
    p = make_home(tmp_path)
    store = stores(p)
    a = store.save(freeze(make_machine(p, "a"), store.frozen_root), name="a", retention_days=3)
    b = store.save(freeze(make_machine(p, "b"), store.frozen_root), name="b", tenant="t2")
    assert [i.id for i in store.list()] == [a.id]
    assert [i.id for i in store.list(tenant="t2")] == [b.id]
    assert store.get("a").id == store.get(a.id).id == a.id
    with pytest.raises(SnapshotNotFound):
        store.get("a", tenant="t2")  # tenants do not see each other's snapshots
    with pytest.raises(Conflict):
        store.save(freeze(make_machine(p, "c"), store.frozen_root), name="a")
    assert [i.name for i in store.list()] == ["a"]  # the refused one is not listed

    kept = store.set_retention("a", 30)
    assert (
        store.get("a").expires_at
        == kept.expires_at
        == a.created_at + (kept.expires_at - a.created_at)
    )
    assert (kept.expires_at - a.created_at).days == 30
    out = store.materialize("a")
    assert (out / "ram").stat().st_size == 8 << 20
    assert store.referenced_chunks() >= set().union(
        *(
            FileManifest.from_json(fm).hashes()
            for _, body in store.manifests(a.id)
            for fm in body["files"].values()
        )
    )
    assert store.delete("a").id == a.id
    with pytest.raises(SnapshotNotFound):
        store.get(a.id)
    with pytest.raises(SnapshotNotFound):
        store.delete(a.id)
    assert store.forget(b.id) and not store.forget(b.id)
    assert store.list(tenant="t2") == []


def test_a_tampered_manifest_in_the_registry_is_not_listed(tmp_path: Path, dsn: str) -> None:
    reg = PostgresRegistry(dsn)
    p = make_home(tmp_path)
    store = SnapshotStore(p, catalog=RegistryCatalog(reg, "n1"))
    info = store.save(freeze(make_machine(p, "a"), store.frozen_root), name="a")
    body = reg.snapshot_manifest(info.id)
    body["info"]["retention_days"] = 365  # edited behind the store's back: the digest fails
    reg.replace_snapshot(info.id, body)
    assert store.list() == []
    with pytest.raises(SnapshotNotFound):
        store.materialize(info.id)
    reg.close()


# -- nodes -------------------------------------------------------------------------------------


async def until_snapshot(
    what: Callable[[], Awaitable[SnapshotInfo]] | Callable[[], SnapshotInfo],
    ok: Callable[[SnapshotInfo], bool],
    timeout: float,
) -> SnapshotInfo:
    deadline = time.monotonic() + timeout
    while True:
        got = what()
        info = await got if asyncio.iscoroutine(got) else got
        assert isinstance(info, SnapshotInfo)
        if ok(info):
            return info
        assert time.monotonic() < deadline, f"timed out; last: {info}"
        await asyncio.sleep(0.1)


def _qemu_img(*args: str) -> None:
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", *args], check=True)


async def sandbox(m: SandboxManager, name: str) -> str:
    """A running sandbox of the fake engine, with a real qcow2 overlay on its node's template
    disk (as a restore and a durable pause need)."""
    info = await m.get_or_create(name)
    tdisk = m.paths.templates / "python" / "snapshot" / "disk.qcow2"
    _qemu_img("-b", str(tdisk), "-F", "qcow2", str(m.directory(info.id) / "disk.qcow2"))
    return info.id


async def started(*managers: SandboxManager) -> list[Checkpoints]:
    """Start the nodes, each with its own copy of one template build (a small disk)."""
    for m in managers:
        tdir = m.paths.templates / "python"
        (tdir / "snapshot").mkdir(parents=True)
        _qemu_img(str(tdir / "snapshot" / "disk.qcow2"), "4M")
        (tdir / "template.json").write_text(
            json.dumps({"name": "python", "build_id": "b1", "directory": str(tdir)})
        )
        await m.start(supervise=False)
    return [Checkpoints(m) for m in managers]


def test_snapshot_is_pushed_and_restores_on_another_node(
    tmp_path: Path, dsn: str, store: str
) -> None:
    async def body() -> None:
        n1, n2 = node(tmp_path, dsn, store, "n1"), node(tmp_path, dsn, store, "n2")
        c1, c2 = await started(n1, n2)
        await sandbox(n1, "agent")
        await n1.run_code("agent", "notes = [1, 2]")
        snap = await c1.snapshot("agent", name="before")
        assert snap.node == "n1"
        info = await until_snapshot(
            lambda: c1.get_snapshot("before"), lambda i: i.durable is not None, timeout=30
        )
        assert info.upload_error is None and info.durable is not None
        assert info.durable >= info.created_at
        # every node sees it, with the same durability
        assert [s.id for s in c2.list_snapshots()] == [snap.id]
        assert c2.get_snapshot(snap.id).durable == info.durable

        die(n1, tmp_path / "n1")  # n1's chunks are gone with it: n2 pulls from the store
        restored = await c2.restore("before", name="again")
        out = await n2.run_code(restored.id, "notes")
        assert out.results[0].data["text/plain"] == "[1, 2]"
        assert not (tmp_path / "n2" / "chunks").exists() or not any(
            (tmp_path / "n2" / "chunks").rglob("*.zst")
        )  # nothing of it saved locally: read through the store (and its cache)
        children = await c2.fork_snapshot(snap.id, count=2)
        assert len(children) == 2

        c2.delete_snapshot("before")  # gone for every node
        with pytest.raises(SnapshotNotFound):
            c2.get_snapshot(snap.id)
        assert c2.snapshots.catalog.shared and not list(c2.snapshots.catalog.entries())
        await n2.close()

    run(body)


def test_snapshot_upload_failure_is_visible_then_retried(
    tmp_path: Path, dsn: str, s3_server: S3Server, store: str
) -> None:
    missing = "late-snapshots"  # the store is unreachable until this bucket exists

    async def body() -> None:
        n1 = node(tmp_path, dsn, f"s3://{missing}/c", "n1")
        n2 = node(tmp_path, dsn, f"s3://{missing}/c", "n2")
        c1, c2 = await started(n1, n2)
        await sandbox(n1, "agent")
        await n1.run_code("agent", "x = 7")
        snap = await c1.snapshot("agent", name="s")  # taken at once, locally
        assert snap.durable is None
        failing = await until_snapshot(
            lambda: c1.get_snapshot("s"), lambda i: i.upload_error is not None, timeout=30
        )
        assert failing.durable is None and "late-snapshots" in str(failing.upload_error)
        # not durable: another node sends the restore to the node that has it
        with pytest.raises(Conflict) as elsewhere:
            await c2.restore("s")
        assert elsewhere.value.data["owner_node"] == "n1"
        assert elsewhere.value.data["owner_url"] == "http://n1.test:8765"
        # and the node that has it restores it from its own chunks meanwhile
        local = await c1.restore("s", name="local")
        assert (await n1.run_code(local.id, "x")).results[0].data["text/plain"] == "7"

        s3_server.client().create_bucket(Bucket=missing)
        done = await until_snapshot(
            lambda: c1.get_snapshot("s"), lambda i: i.durable is not None, timeout=60
        )
        assert done.upload_error is None
        await n1.close()
        await n2.close()

    run(body)


def test_a_node_gone_before_the_push_loses_only_that_snapshot(
    tmp_path: Path, dsn: str, store: str
) -> None:
    async def body() -> None:
        n1 = node(tmp_path, dsn, "s3://never-there/c", "n1", lease=1.5)
        n2 = node(tmp_path, dsn, store, "n2", lease=1.5)
        c1, c2 = await started(n1, n2)
        await sandbox(n1, "agent")
        snap = await c1.snapshot("agent", name="s")
        die(n1, tmp_path / "n1")
        await asyncio.sleep(2.0)  # its heartbeat lapses
        with pytest.raises(StateLost) as lost:
            await c2.restore(snap.id)
        assert lost.value.data["snapshot_id"] == snap.id and "n1" in str(lost.value)
        await n2.close()

    run(body)


def test_a_corrupt_chunk_in_the_store_names_the_snapshot(
    tmp_path: Path, dsn: str, store: str, s3_server: S3Server, s3_bucket: str
) -> None:
    async def body() -> None:
        n1, n2 = node(tmp_path, dsn, store, "n1"), node(tmp_path, dsn, store, "n2")
        c1, c2 = await started(n1, n2)
        await sandbox(n1, "agent")
        await n1.run_code("agent", "x = 1")
        snap = await c1.snapshot("agent", name="s")
        await until_snapshot(
            lambda: c1.get_snapshot("s"), lambda i: i.durable is not None, timeout=30
        )
        manifest = json.loads(json.dumps(next(c1.snapshots.manifests(snap.id))[1]))
        digest = sorted(FileManifest.from_json(manifest["files"]["ram"]).hashes())[0]
        remote = n1.cluster.chunks.backend if n1.cluster else None
        assert remote is not None
        key = remote.key_of(digest)  # type: ignore[attr-defined]
        s3_server.client().put_object(Bucket=s3_bucket, Key=key, Body=b"bit rot")
        with pytest.raises(CorruptData) as bad:
            await c2.restore(snap.id)
        assert bad.value.data["snapshot_id"] == snap.id and snap.id in str(bad.value)
        assert [i.name for i in n2.registry.list()] == ["agent"]  # no half-made sandbox
        await n1.close()
        await n2.close()

    run(body)


def test_a_snapshot_restores_only_on_its_accelerator(
    tmp_path: Path, dsn: str, store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def body() -> None:
        n1, n2 = node(tmp_path, dsn, store, "n1"), node(tmp_path, dsn, store, "n2")
        c1, c2 = await started(n1, n2)
        assert n1.cluster is not None
        elsewhere = {"node": "n9", "accelerator": "kvm", "cpu_model": "Imaginary CPU"}
        monkeypatch.setattr(n1.cluster, "origin", lambda: elsewhere)
        await sandbox(n1, "agent")
        snap = await c1.snapshot("agent", name="kvm-only")
        await until_snapshot(
            lambda: c1.get_snapshot(snap.id), lambda i: i.durable is not None, timeout=30
        )
        with pytest.raises(NoNodeAvailable) as refused:
            await c2.restore(snap.id)
        assert "kvm" in str(refused.value) and "Imaginary CPU" in str(refused.value)
        assert refused.value.data["snapshot_id"] == snap.id
        await n1.close()
        await n2.close()

    run(body)


def test_another_template_build_is_a_clear_error(tmp_path: Path, dsn: str) -> None:
    """A snapshot taken in one home restores in another (another node) on that home's copy
    of the same template build, and is refused, saying why, on another build."""
    reg = PostgresRegistry(dsn)
    homes = [make_home(tmp_path / n) for n in ("a", "b", "c")]
    for home, build in zip(homes, ("b1", "b1", "b2"), strict=True):
        tdir = home.templates / "python"
        (tdir / "template.json").write_text(
            json.dumps({"name": "python", "build_id": build, "directory": str(tdir)})
        )
    shared_chunks = SnapshotStore(homes[0]).chunks  # one store: what S3 is to a cluster
    a, b, c = (
        SnapshotStore(h, chunks=shared_chunks, catalog=RegistryCatalog(reg, h.home.name))
        for h in homes
    )
    info = a.save(freeze(make_machine(homes[0], "sb"), a.frozen_root), name="s", template="python")
    shutil.rmtree(homes[0].templates)  # node a is gone: b has its own copy of the build
    out = b.materialize(info.id)
    from torpor.sandbox.storage.snapshots import backing_file

    assert (
        backing_file(out / "disk.qcow2")
        == (homes[1].templates / "python" / "snapshot" / "disk.qcow2").resolve()
    )
    with pytest.raises(TemplateNotFound) as other:
        c.materialize(info.id)
    assert "b1" in str(other.value) and "b2" in str(other.value)
    reg.close()


def test_a_durable_snapshots_local_chunks_go_to_the_bounded_cache(
    tmp_path: Path, dsn: str, store: str
) -> None:
    """Once durable, the local copies of a snapshot's chunks leave the node's ``chunks/`` for
    its bounded cache; the snapshot restores on its node from the cache, and from the store
    once the cache let them go."""

    async def body() -> None:
        (n1,) = (node(tmp_path, dsn, store, "n1"),)
        (c1,) = await started(n1)
        await sandbox(n1, "agent")
        await n1.run_code("agent", "notes = [5]")
        snap = await c1.snapshot("agent", name="s")
        local = tmp_path / "n1" / "chunks"
        await until_snapshot(
            lambda: c1.get_snapshot("s"), lambda i: i.durable is not None, timeout=30
        )
        assert n1.cluster is not None
        deadline = time.monotonic() + 30
        while n1.cluster.pushing(f"snapshot:{snap.id}"):  # (evicts right after it is durable)
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        body_ = next(c1.snapshots.manifests(snap.id))[1]
        files = body_["files"].values()
        digests = set().union(*(FileManifest.from_json(f).hashes() for f in files))
        assert digests and not any(local.rglob("*.zst"))
        cache = n1.cluster.chunks.backend.cache  # type: ignore[attr-defined]
        assert digests <= set(cache._sizes)
        one = await c1.restore("s", name="from-cache")
        assert (await n1.run_code(one.id, "notes")).results[0].data["text/plain"] == "[5]"
        for digest in list(cache._sizes):
            cache.drop(digest)
        two = await c1.restore("s", name="from-store")
        assert (await n1.run_code(two.id, "notes")).results[0].data["text/plain"] == "[5]"
        await n1.close()

    run(body)


def test_a_restored_or_forked_child_is_held_by_the_node_that_runs_it(
    tmp_path: Path, dsn: str, store: str
) -> None:
    """A child of a restore or fork runs on the node that made it: the registry must say
    so (its lease), or another node asked for it takes it, finds no machine and marks the
    running child lost."""

    async def body() -> None:
        n1, n2 = node(tmp_path, dsn, store, "n1", lease=30), node(tmp_path, dsn, store, "n2")
        c1, _ = await started(n1, n2)
        await sandbox(n1, "agent")
        await n1.run_code("agent", "notes = [1, 2]")
        snap = await c1.snapshot("agent", name="before")
        restored = await c1.restore(snap.id, name="again")
        forked = await c1.fork("agent", count=1)
        assert n1.cluster is not None
        for child in (restored, *forked):
            assert n1.cluster.registry.owner(child.id) == "n1"
            with pytest.raises(Conflict) as elsewhere:  # n2 sends the caller to n1
                await n2.run_code(child.id, "notes")
            assert elsewhere.value.data["owner_node"] == "n1"
            out = await n1.run_code(child.id, "notes")
            assert out.results[0].data["text/plain"] == "[1, 2]"
        await n1.close()
        await n2.close()

    run(body)


def test_a_draining_node_restores_no_snapshot(tmp_path: Path, dsn: str, store: str) -> None:
    """A draining node takes no new sandbox: a restore or fork of a snapshot asked of it
    goes to another node (a Conflict naming it, which the server proxies), as a create
    does; made there, it would run on the node being emptied, after the drain's report."""

    async def body() -> None:
        n1, n2 = node(tmp_path, dsn, store, "n1"), node(tmp_path, dsn, store, "n2")
        c1, c2 = await started(n1, n2)
        await sandbox(n1, "agent")
        await n1.run_code("agent", "notes = [1, 2]")
        snap = await c1.snapshot("agent", name="before")
        await until_snapshot(
            lambda: c1.get_snapshot("before"), lambda i: i.durable is not None, timeout=30
        )
        report = await n1.drain_node("n1")
        assert [s.name for s in report.moved] == ["agent"]
        with pytest.raises(Conflict) as restore:
            await c1.restore(snap.id, name="again")
        assert restore.value.data["owner_node"] == "n2"
        with pytest.raises(Conflict) as fork:
            await c1.fork_snapshot(snap.id, count=1)
        assert fork.value.data["owner_node"] == "n2"
        assert [i.name for i in await n1.list()] == ["agent"]  # nothing made
        again = await c2.restore(snap.id, name="again")  # where it was sent
        out = await n2.run_code(again.id, "notes")
        assert out.results[0].data["text/plain"] == "[1, 2]"
        await n1.close()
        await n2.close()

    run(body)
