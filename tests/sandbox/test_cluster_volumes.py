"""Volumes and drives in cluster mode without VMs: their records in the real PostgreSQL
registry (every node lists, gets and deletes every one), volume images pushed to a real S3
store (SeaweedFS) with a pause and rebuilt on the node that wakes the sandbox, and drives that
pin their sandboxes to the drive's node.

The first test runs one scenario over both record media (the local JSON files and the
registry's tables), so the two keep the same interface.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from torpor.config import Paths, paths
from torpor.errors import (
    Conflict,
    DriveNotFound,
    NoNodeAvailable,
    StorageError,
    VolumeNotFound,
)
from torpor.sandbox.manager import SandboxManager
from torpor.sandbox.manager.cluster import ClusterConfig, ClusterNode, RegistryRecords
from torpor.sandbox.models import SandboxState as S
from torpor.sandbox.registry import SandboxRecord
from torpor.sandbox.registry.postgres import PostgresRegistry
from torpor.sandbox.storage.drives import DriveStore
from torpor.sandbox.storage.volumes import VolumeStore

try:  # plain pytest puts this directory on sys.path; a package layout needs the relative form
    from tests.sandbox.test_cluster import die, run, sent_here, until
    from tests.sandbox.test_cluster import node as cnode
except ImportError:  # pragma: no cover
    from .test_cluster import die, run, sent_here, until
    from .test_cluster import node as cnode

pytestmark = [pytest.mark.postgres]


@pytest.fixture(params=["local", "postgres"])
def media(request: pytest.FixtureRequest) -> Iterator[Callable[[Paths, str], Any]]:
    """Make a home's record medium for a kind: its own files (local; one home), or the
    registry's tables (two homes then see the same records)."""
    if request.param == "local":
        yield lambda p, kind: None
        return
    dsn: str = request.getfixturevalue("dsn")
    reg = PostgresRegistry(dsn)
    yield lambda p, kind: RegistryRecords(reg, kind, p.home.name)
    reg.close()


def test_one_record_interface_over_both_media(
    tmp_path: Path, media: Callable[[Paths, str], Any]
) -> None:
    p = paths(tmp_path / "n1").ensure()
    vols = VolumeStore(p, media(p, "volume"))
    drvs = DriveStore(p, media(p, "drive"))
    a = vols.create("data", size_mib=16, labels={"team": "x"})
    b = vols.create("data", size_mib=16, tenant="t2")
    d = drvs.create("shared")
    assert [v.id for v in vols.list()] == [a.id]
    assert [v.id for v in vols.list(tenant="t2")] == [b.id]
    assert [v.id for v in vols.list(labels={"team": "x"})] == [a.id]
    assert vols.list(labels={"team": "y"}) == []
    assert vols.get("data").id == vols.get(a.id).id == a.id
    with pytest.raises(VolumeNotFound):
        vols.get(a.id, tenant="t2")  # tenants do not see each other's volumes
    with pytest.raises(Conflict):
        vols.create("data", size_mib=16)
    assert [v.name for v in vols.list()] == ["data"]  # the refused one is not recorded
    vols.attach("data", "sbx-1", "/data")
    with pytest.raises(Conflict) as twice:
        vols.attach("data", "sbx-2", "/data")  # one writer at a time
    assert twice.value.data["holder"] == "sbx-1"
    assert [(v.id, att.sandbox_id) for v, att in vols.attached_to("sbx-1")] == [(a.id, "sbx-1")]
    with pytest.raises(Conflict):
        vols.delete("data")  # attached
    vols.detach("data", "sbx-1")
    assert vols.delete("data").id == a.id
    with pytest.raises(VolumeNotFound):
        vols.get("data")
    assert not vols.image(a.id).exists()
    drvs.attach("shared", "sbx-1", "/shared")
    drvs.attach("shared", "sbx-2", "/shared")  # any number of sandboxes share a drive
    assert drvs.release({"sbx-1", "sbx-2"}) == 2
    assert drvs.delete(d.id).id == d.id
    with pytest.raises(DriveNotFound):
        drvs.get("shared")


def _node(tmp_path: Path, dsn: str, store: str, name: str) -> ClusterNode:
    config = ClusterConfig(dsn=dsn, store=store, node=name, url=f"http://{name}.test:8765")
    n = ClusterNode(config, paths(tmp_path / name).ensure())
    n.beat()
    return n


@pytest.mark.s3
def test_every_node_sees_every_volume_and_attaches_it(tmp_path: Path, dsn: str, store: str) -> None:
    n1, n2 = _node(tmp_path, dsn, store, "n1"), _node(tmp_path, dsn, store, "n2")
    try:
        v1, v2 = n1.volume_store(), n2.volume_store()
        d1, d2 = n1.drive_store(), n2.drive_store()
        made = v1.create("data", size_mib=16, labels={"app": "a"})
        drive = d1.create("scratch")
        assert made.node == "n1" and drive.node == "n1"
        assert n1.registry.volume_image(made.id) is not None  # pushed at create
        # n2 lists, gets and filters n1's volume and drive though their data is on n1
        assert [(v.id, v.node, v.labels) for v in v2.list()] == [(made.id, "n1", {"app": "a"})]
        assert v2.get("data").size_mib == 16
        assert [d.id for d in d2.list()] == [drive.id]
        with pytest.raises(Conflict):  # the name is taken cluster-wide, within the tenant
            v2.create("data", size_mib=16)
        # n1 writes into the image, as a guest would, then a detach there pushes it
        v1.attach("data", "sbx-1", "/data")
        with open(v1.image(made.id), "r+b") as f:
            f.seek(8 << 20)
            f.write(b"written on n1")
        with pytest.raises(Conflict) as held:  # held read-write by a sandbox n1 holds
            n1.registry.insert(_rec("sbx-1"))
            n1.acquire("sbx-1", place=False)
            v2.attach("data", "sbx-2", "/data")
        assert held.value.data["node"] == "n1" and "n1" in held.value.message
        v1.detach("data", "sbx-1")
        # not attached anywhere: n2 attaches it, pulling its latest image from the store
        assert not v2.image(made.id).exists()
        got = v2.attach("data", "sbx-2", "/data")
        assert got.node == "n2" and v1.get("data").node == "n2"
        with open(v2.image(made.id), "rb") as f:
            f.seek(8 << 20)
            assert f.read(13) == b"written on n1"
        assert reg_written(n1, made.id)
        # only changed chunks go up: the same image again sends nothing, one write one chunk
        assert n2.push_volume(made.id).new_bytes == 0
        _write_at(v2.image(made.id), 12 << 20, b"written on n2")
        assert 0 < n2.push_volume(made.id).new_bytes <= n2.chunks.chunk_size
        v2.detach("data", "sbx-2")
        # n1's copy is stale now (the latest is n2's): its tidy drops it, n2's keeps n2's
        assert n2.volume_store().tidy() == [] and v2.image(made.id).exists()
        assert n1.volume_store().tidy() == [made.id] and not v1.image(made.id).exists()
        assert v1.delete("data").id == made.id  # deleted from a node its image is not on
        assert v2.image(made.id).exists()
        assert n2.volume_store().tidy() == [made.id]
        assert v1.list() == [] and v2.list() == []
    finally:
        n1.registry.close()
        n2.registry.close()


def reg_written(n: ClusterNode, vid: str) -> bool:
    return n.registry.record_written_at("volume", vid) is not None


def _rec(sid: str) -> SandboxRecord:
    now = time.time()
    return SandboxRecord(
        id=sid,
        name=sid,
        tenant="default",
        template="python",
        state=S.RUNNING,
        created_at=now,
        last_active_at=now,
    )


@pytest.mark.s3
def test_a_volume_whose_push_failed_stays_on_its_node(
    tmp_path: Path, dsn: str, store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    n1, n2 = _node(tmp_path, dsn, store, "n1"), _node(tmp_path, dsn, store, "n2")
    try:
        v1, v2 = n1.volume_store(), n2.volume_store()

        def down(path: Path, **kwargs: Any) -> Any:
            raise StorageError("the store is unreachable")

        monkeypatch.setattr(n1.chunks, "put_file", down)
        made = v1.create("data", size_mib=16)  # made, but only on n1
        assert n1.registry.volume_image(made.id) is None
        with pytest.raises(Conflict) as there:
            v2.attach("data", "sbx-2", "/data")
        assert there.value.data["node"] == "n1"
        assert v2.get("data").attachments == []  # nothing recorded
        assert not v2.image(made.id).exists()
        monkeypatch.undo()
        v1.attach("data", "sbx-1", "/data")  # on its node it attaches
        v1.detach("data", "sbx-1")  # and the push on detach makes it movable
        assert v2.attach("data", "sbx-2", "/data").node == "n2"
    finally:
        n1.registry.close()
        n2.registry.close()


def _write_at(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _read_at(path: Path, offset: int, size: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(size)


def _plug(manager: SandboxManager, sid: str, image: Path) -> None:
    """What attach_volume leaves in machine.json (the fake engine has no hot-plug)."""
    mj = manager.directory(sid) / "machine.json"
    config = json.loads(mj.read_text())
    config["devices"].append(
        {"id": "vol0", "kind": "disk", "path": str(image), "format": "raw", "slot": 5}
    )
    mj.write_text(json.dumps(config))


@pytest.mark.s3
def test_a_paused_sandbox_wakes_elsewhere_with_its_volume(
    tmp_path: Path, dsn: str, store: str
) -> None:
    async def body() -> None:
        n1, n2 = cnode(tmp_path, dsn, store, "n1"), cnode(tmp_path, dsn, store, "n2")
        await n1.start(supervise=False)
        await n2.start(supervise=False)
        assert n1.cluster is not None and n2.cluster is not None
        v1, v2 = n1.cluster.volume_store(), n2.cluster.volume_store()
        info = await n1.get_or_create("agent-u-42")
        vol = v1.create("notes", size_mib=16)
        v1.attach("notes", info.id, "/data")
        _plug(n1, info.id, v1.image(vol.id))
        _write_at(v1.image(vol.id), 4 << 20, b"the agent's notes")  # the guest's, synced
        await n1.run_code("agent-u-42", "notes = [1, 2]")
        await n1.pause("agent-u-42")
        done = await until(lambda: n1.get("agent-u-42"), lambda i: i.durable is not None, 30)
        assert done.upload_error is None
        die(n1, tmp_path / "n1")  # its volume image goes with its home
        with sent_here():
            out = await n2.run_code("agent-u-42", "notes")
        assert out.results[0].data["text/plain"] == "[1, 2]"
        image = v2.image(vol.id)
        assert _read_at(image, 4 << 20, 17) == b"the agent's notes"
        devices = json.loads((n2.directory(info.id) / "machine.json").read_text())["devices"]
        assert [d["path"] for d in devices] == [str(image)]  # pointed at n2's copy
        now = v2.get("notes")
        assert now.node == "n2" and [a.sandbox_id for a in now.attachments] == [info.id]
        await n2.close()

    run(body)


def _share(manager: SandboxManager, sid: str, drive_id: str) -> None:
    """What attach_drive leaves in machine.json (the fake engine has no hot-plug)."""
    mj = manager.directory(sid) / "machine.json"
    config = json.loads(mj.read_text())
    config["devices"].append({"id": drive_id, "kind": "share", "path": "x", "slot": 6})
    mj.write_text(json.dumps(config))


@pytest.mark.s3
def test_a_drive_pins_its_sandbox_to_the_drives_node(tmp_path: Path, dsn: str, store: str) -> None:
    async def body() -> None:
        n1, n2 = cnode(tmp_path, dsn, store, "n1"), cnode(tmp_path, dsn, store, "n2")
        await n1.start(supervise=False)
        await n2.start(supervise=False)
        assert n1.cluster is not None and n2.cluster is not None
        info = await n1.get_or_create("pinned")
        free = await n1.get_or_create("free")
        drive = n1.cluster.drive_store().create("shared")
        n1.cluster.drive_store().attach("shared", info.id, "/shared")
        _share(n1, info.id, drive.id)
        with pytest.raises(Conflict) as elsewhere:  # a drive is attached only on its node
            n2.cluster.drive_store().attach("shared", "sbx-on-n2", "/shared")
        assert elsewhere.value.data["node"] == "n1"
        # the drain pauses it in place and says the drive keeps it there
        report = await n1.drain_node("n1")
        assert [s.id for s in report.moved] == [free.id]
        [kept] = report.failed
        assert (kept.id, kept.state, kept.drives) == (info.id, S.PAUSED, ["shared"])
        assert "drive shared" in (kept.error or "")
        got = await n1.get("pinned")
        assert got.durable is None and "drive" in (got.upload_error or "")
        assert "volume" not in (got.upload_error or "")
        # another node sends the wake to the drive's node
        with pytest.raises(Conflict) as there:
            await n2.run_code("pinned", "1")
        assert there.value.data["owner_node"] == "n1"
        assert there.value.data["owner_url"] == "http://n1.test:8765"
        # the drive's node is gone: a clear error naming it, and nothing taken over
        die(n1, None)
        await asyncio.sleep(3.5)  # n1's lease lapses
        with pytest.raises(NoNodeAvailable) as down, sent_here():
            await n2.run_code("pinned", "1")
        assert down.value.data["node"] == "n1" and "n1" in down.value.message
        assert n2.cluster.recover_lapsed() == []  # the heartbeat does not take it either
        still = await n2.get("pinned")
        assert still.state is S.PAUSED and still.error is None
        assert [r.id for r in n2.cluster.registry.owned_by("n1")] == [info.id]  # waits for n1
        await n2.close()

    run(body)


@pytest.mark.s3
def test_a_pull_does_not_hold_the_cluster_wide_volumes_lock(
    tmp_path: Path, dsn: str, store: str
) -> None:
    """An attach on a node without the volume's latest image pulls it before taking the
    volumes' lock every node shares (a create or attach elsewhere does not wait for the
    transfer), and not again under the lock when the image did not change meanwhile; when
    it did, the lock's pull brings the newer one."""
    from torpor.sandbox.manager.cluster import RECORD_LOCKS

    n1, n2 = _node(tmp_path, dsn, store, "n1"), _node(tmp_path, dsn, store, "n2")
    try:
        v1, v2 = n1.volume_store(), n2.volume_store()
        made = v1.create("data", size_mib=16)
        v1.attach("data", "sbx-1", "/data")
        _write_at(v1.image(made.id), 4 << 20, b"first")
        v1.detach("data", "sbx-1")
        free_during: list[bool] = []
        inner = n2.pull_volume

        def pull(volume_id: str, manifest: dict[str, Any] | None = None) -> None:
            with n2.registry.exclusive(RECORD_LOCKS["volume"]) as free:
                free_during.append(free)
            inner(volume_id, manifest)

        n2.pull_volume = pull  # type: ignore[method-assign]
        v2.attach("data", "sbx-2", "/data", read_only=True)
        assert free_during == [True]  # one pull, with the lock free
        with open(v2.image(made.id), "rb") as f:
            f.seek(4 << 20)
            assert f.read(5) == b"first"
        v2.detach("data", "sbx-2")
        # a newer image pushed by n1 between the pull ahead and the lock: pulled under it
        v1.attach("data", "sbx-1", "/data")
        _write_at(v1.image(made.id), 4 << 20, b"second")
        v1.detach("data", "sbx-1")
        real_ahead = v2._pull_ahead
        v2._pull_ahead = lambda *a: None  # type: ignore[method-assign]
        v2.attach("data", "sbx-2", "/data", read_only=True)
        v2._pull_ahead = real_ahead  # type: ignore[method-assign]
        assert free_during == [True, False]  # pulled under the lock: the image changed
        with open(v2.image(made.id), "rb") as f:
            f.seek(4 << 20)
            assert f.read(6) == b"second"
    finally:
        n1.registry.close()
        n2.registry.close()


@pytest.mark.s3
def test_a_volume_file_is_not_read_from_a_stale_copy(tmp_path: Path, dsn: str, store: str) -> None:
    """A volume's file was read from this node's image whatever node had its latest: a node
    that once pulled it answered with what the volume held then, silently."""
    try:
        from tests.sandbox.test_volume_files import _mkfs, _tree
    except ImportError:  # pragma: no cover
        from .test_volume_files import _mkfs, _tree
    from torpor.sandbox.storage.volume_files import read_volume_file

    def fill(image: Path, text: bytes) -> None:
        tree = tmp_path / f"tree-{len(text)}"
        _tree(tree, {"/facts.md": text})
        _mkfs(image, tree)

    n1, n2 = _node(tmp_path, dsn, store, "n1"), _node(tmp_path, dsn, store, "n2")
    try:
        v1, v2 = n1.volume_store(), n2.volume_store()
        made = v1.create("data", size_mib=16)
        fill(v1.image(made.id), b"old")
        n1.push_volume(made.id)
        v2.attach("data", "sbx-2", "/data")  # n2 pulls it, then lets go (pushed as it was)
        v2.detach("data", "sbx-2")
        assert read_volume_file(v2, "data", "/facts.md") == b"old"
        v1.attach("data", "sbx-1", "/data")  # back on n1, which writes, then lets go
        fill(v1.image(made.id), b"newer")
        v1.detach("data", "sbx-1")
        assert v2.get("data").node == "n1" and v2.image(made.id).exists()  # n2's copy: stale
        assert read_volume_file(v1, "data", "/facts.md") == b"newer"
        with pytest.raises(Conflict) as there:
            read_volume_file(v2, "data", "/facts.md")
        assert there.value.data["node"] == "n1"
        assert there.value.data["owner_url"] == "http://n1.test:8765"  # proxied there
    finally:
        n1.registry.close()
        n2.registry.close()


@pytest.mark.s3
def test_a_volume_push_during_a_sweep_keeps_every_chunk_its_image_names(
    tmp_path: Path, dsn: str, store: str
) -> None:
    """A volume push skipped every chunk the shared store had (a HEAD), old ones no manifest
    named included (left by a volume or pause since replaced). A sweep of the store that read
    its marks before the push recorded the image deleted them after: the image was recorded
    as pushed, but another node's pull of it was CorruptData (the data lost but on n1)."""
    from torpor.errors import CorruptData

    n1, n2 = _node(tmp_path, dsn, store, "n1"), _node(tmp_path, dsn, store, "n2")
    try:
        v1, v2 = n1.volume_store(), n2.volume_store()
        made = v1.create("data", size_mib=16)
        block = bytes(range(256)) * 1024  # one 256 KiB chunk
        n1.chunks.put(block)  # in the store, named by nothing any more (a replaced image)
        time.sleep(2.5)  # older than the sweep's grace below
        marked = n1.registry.referenced_chunks()  # a sweep begins: its marks
        started = time.time()
        _write_at(v1.image(made.id), 1 << 20, block)
        n1.push_volume(made.id)  # meanwhile the image is pushed and recorded
        n1.chunks.sweep(marked, min_age_seconds=1.0, now=started)  # the sweep goes on
        v2.attach("data", "sbx-2", "/data")  # n2 pulls the image
        assert _read_at(v2.image(made.id), 1 << 20, len(block)) == block
    except CorruptData as exc:
        pytest.fail(f"the pushed image lost a chunk to the sweep: {exc}")
    finally:
        n1.registry.close()
        n2.registry.close()
