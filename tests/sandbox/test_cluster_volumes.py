"""Volumes and drives in cluster mode without VMs: their records in the real PostgreSQL
registry (every node lists, gets and deletes every one), volume images pushed to a real S3
store (SeaweedFS) with a pause and rebuilt on the node that wakes the sandbox, and drives that
pin their sandboxes to the drive's node.

The first test runs one scenario over both record media (the local JSON files and the
registry's tables), so the two keep the same interface.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from torpor.config import Paths, paths
from torpor.errors import Conflict, DriveNotFound, VolumeNotFound
from torpor.sandbox.manager.cluster import RegistryRecords
from torpor.sandbox.registry.postgres import PostgresRegistry
from torpor.sandbox.storage.drives import DriveStore
from torpor.sandbox.storage.volumes import VolumeStore

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


def test_every_node_sees_every_volume_and_where_it_is(tmp_path: Path, dsn: str) -> None:
    reg = PostgresRegistry(dsn)
    try:
        p1, p2 = paths(tmp_path / "n1").ensure(), paths(tmp_path / "n2").ensure()
        v1 = VolumeStore(p1, RegistryRecords(reg, "volume", "n1"))
        v2 = VolumeStore(p2, RegistryRecords(reg, "volume", "n2"))
        d1 = DriveStore(p1, RegistryRecords(reg, "drive", "n1"))
        d2 = DriveStore(p2, RegistryRecords(reg, "drive", "n2"))
        made = v1.create("data", size_mib=16, labels={"app": "a"})
        drive = d1.create("scratch")
        assert made.node == "n1" and drive.node == "n1"
        # n2 lists, gets and filters n1's volume and drive though their data is on n1
        assert [(v.id, v.node, v.labels) for v in v2.list()] == [(made.id, "n1", {"app": "a"})]
        assert v2.get("data").size_mib == 16
        assert [d.id for d in d2.list()] == [drive.id]
        with pytest.raises(Conflict):  # the name is taken cluster-wide, within the tenant
            v2.create("data", size_mib=16)
        v2.attach("data", "sbx-1", "/data")  # n1 sees n2's attach at once
        with pytest.raises(Conflict):
            v1.attach("data", "sbx-2", "/data")
        assert reg.record_written_at("volume", made.id) is not None
        v2.detach("data", "sbx-1")
        assert v2.delete("data").id == made.id  # deleted from a node its image is not on
        assert v1.list() == [] and v2.list() == []
        # a record whose node is this one but whose data is gone here is not listed
        gone = v2.create("gone", size_mib=16)
        v2.image(gone.id).unlink()
        assert [v.name for v in v2.list()] == []
        assert [v.name for v in v1.list()] == ["gone"]  # n1 cannot tell: n2 has its image
    finally:
        reg.close()
