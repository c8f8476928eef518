"""Volumes without a VM: images, the sharing rule, mount paths, deletion."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from torpor.config import paths
from torpor.errors import Conflict, InvalidArgument, InvalidName, VolumeNotFound
from torpor.sandbox.storage.volumes import VolumeStore, check_mount_path


@pytest.fixture
def store(tmp_path: Path) -> VolumeStore:
    return VolumeStore(paths(tmp_path / "home").ensure())


def test_create_makes_a_sparse_ext4_image(store: VolumeStore) -> None:
    vol = store.create("memory-u-42", size_mib=64)
    image = store.image(vol.id)
    assert image.stat().st_size == 64 << 20
    assert image.stat().st_blocks * 512 < 16 << 20  # sparse
    out = subprocess.run(
        ["dumpe2fs", "-h", str(image)], check=True, capture_output=True, text=True
    ).stdout
    assert "memory-u-42" in out
    assert [v.id for v in store.list()] == [vol.id]
    assert store.get("memory-u-42").id == vol.id


def test_one_writer_or_many_readers(store: VolumeStore) -> None:
    vol = store.create("v", size_mib=16)
    store.attach(vol.id, "sb-a", "/memory")
    with pytest.raises(Conflict, match="read-write to sandbox sb-a"):
        store.attach(vol.id, "sb-b", "/memory")
    with pytest.raises(Conflict):
        store.attach(vol.id, "sb-b", "/memory", read_only=True)
    store.detach(vol.id, "sb-a")
    store.attach(vol.id, "sb-b", "/m", read_only=True)
    store.attach(vol.id, "sb-c", "/m", read_only=True)
    with pytest.raises(Conflict, match="read-only to 2"):
        store.attach(vol.id, "sb-d", "/m")
    assert {a.sandbox_id for a in store.get("v").attachments} == {"sb-b", "sb-c"}


def test_data_survives_release_and_delete_needs_detach(store: VolumeStore) -> None:
    vol = store.create("v", size_mib=16)
    store.attach(vol.id, "sb-a", "/memory")
    with pytest.raises(Conflict):
        store.delete(vol.id)
    assert store.release({"sb-a"}) == 1
    assert store.image(vol.id).exists()
    store.delete("v")
    assert not store.image(vol.id).exists()
    with pytest.raises(VolumeNotFound):
        store.get(vol.id)


def test_release_keeps_live_sandboxes(store: VolumeStore) -> None:
    a, b = store.create("a", size_mib=16), store.create("b", size_mib=16)
    store.attach(a.id, "sb-live", "/a")
    store.attach(b.id, "sb-gone", "/b")
    assert store.release(keep={"sb-live"}) == 1
    assert store.attached_to("sb-live")[0][0].id == a.id
    assert store.attached_to("sb-gone") == []


@pytest.mark.parametrize(
    "kw, err",
    [
        pytest.param({"name": "BAD"}, InvalidName, id="name"),
        pytest.param({"name": "v", "size_mib": 0}, InvalidArgument, id="size-0"),
        pytest.param({"name": "v", "size_mib": True}, InvalidArgument, id="size-bool"),
    ],
)
def test_bad_create_leaves_nothing(
    store: VolumeStore, kw: dict[str, object], err: type[Exception]
) -> None:
    with pytest.raises(err):
        store.create(**kw)  # type: ignore[arg-type]
    assert list(store.root.glob("vol-*")) == []


def test_names_unique_per_tenant(store: VolumeStore) -> None:
    store.create("v", size_mib=16)
    with pytest.raises(Conflict):
        store.create("v", size_mib=16)
    store.create("v", size_mib=16, tenant="acme")
    assert len(store.list(tenant="acme")) == 1


@pytest.mark.parametrize(
    "path", ["/", "/etc", "/usr/lib/x", "/proc", "relative", "/a/../etc", "/opt/torpor", "/tmp"]
)
def test_system_paths_refused(path: str) -> None:
    with pytest.raises(InvalidArgument):
        check_mount_path(path)


@pytest.mark.parametrize(
    "path, norm",
    [
        ("/memory", "/memory"),
        ("/mnt/x/", "/mnt/x"),
        ("/workspace/data", "/workspace/data"),
        ("/etcetera", "/etcetera"),
    ],
)
def test_user_paths_accepted(path: str, norm: str) -> None:
    assert check_mount_path(path) == norm


def test_http_routes_map_errors(tmp_path: Path) -> None:
    """The checkpoint routes over the real manager (fake engine): typed errors cross HTTP."""
    from fastapi.testclient import TestClient

    from tests.sandbox.fakes import FakeEngine
    from torpor.errors import from_wire
    from torpor.sandbox.manager import SandboxManager
    from torpor.server.app import create_app

    manager = SandboxManager(paths(tmp_path / "home"), engine=FakeEngine())
    with TestClient(create_app(manager, supervise=False)) as client:
        made = client.post("/v1/volumes", json={"name": "memory-u-42", "size_mib": 16})
        assert made.status_code == 201
        vol = made.json()
        again = client.post("/v1/volumes", json={"name": "memory-u-42", "size_mib": 16})
        assert again.status_code == 409
        assert type(from_wire(again.json()["error"])).__name__ == "Conflict"
        assert [v["id"] for v in client.get("/v1/volumes").json()] == [vol["id"]]
        assert client.post("/v1/drives", json={"name": "research"}).status_code == 201
        assert client.get("/v1/drives/research").json()["name"] == "research"
        missing = client.get("/v1/snapshots/nope")
        assert missing.status_code == 404
        assert from_wire(missing.json()["error"]).__class__.__name__ == "SnapshotNotFound"
        sbx = client.post("/v1/sandboxes", json={"name": "a"}).json()
        bad = client.post(f"/v1/sandboxes/{sbx['id']}/fork", json={"count": 0})
        assert bad.status_code == 400
        bad_path = client.post(
            f"/v1/sandboxes/{sbx['id']}/volumes", json={"volume": vol["id"], "path": "/etc"}
        )
        assert bad_path.status_code == 400
        assert client.post("/v1/snapshots/nope/restore", json={}).status_code == 404
        assert client.post("/v1/gc", json={"dry_run": True}).json()["dry_run"] is True
        assert client.delete(f"/v1/volumes/{vol['id']}").status_code == 204
        assert client.get("/v1/volumes").json() == []
