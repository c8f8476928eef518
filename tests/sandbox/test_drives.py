"""Drives without a VM: records, many writers, deletion rules."""

from __future__ import annotations

from pathlib import Path

import pytest

from torpor.config import paths
from torpor.errors import Conflict, DriveNotFound, InvalidArgument
from torpor.sandbox.storage.drives import DriveStore


@pytest.fixture
def store(tmp_path: Path) -> DriveStore:
    return DriveStore(paths(tmp_path / "home").ensure())


def test_many_sandboxes_mount_one_drive(store: DriveStore) -> None:
    d = store.create("research")
    assert store.directory(d.id).is_dir()
    assert len(d.mount_tag) <= 31
    store.attach("research", "sb-a", "/shared")
    store.attach("research", "sb-b", "/shared")
    with pytest.raises(Conflict):
        store.attach("research", "sb-a", "/other")
    with pytest.raises(InvalidArgument):
        store.attach("research", "sb-c", "/etc/shared")
    assert [x.sandbox_id for x in store.get(d.id).attachments] == ["sb-a", "sb-b"]
    assert [x[0].id for x in store.attached_to("sb-b")] == [d.id]


def test_delete_rules(store: DriveStore) -> None:
    d = store.create("research")
    (store.directory(d.id) / "notes.md").write_text("kept")
    store.attach(d.id, "sb-a", "/shared")
    with pytest.raises(Conflict):
        store.delete(d.id)
    store.release({"sb-a"})
    assert (store.directory(d.id) / "notes.md").read_text() == "kept"
    store.delete(d.id)
    assert not store.directory(d.id).exists()
    with pytest.raises(DriveNotFound):
        store.get("research")


def test_names_unique(store: DriveStore) -> None:
    store.create("x")
    with pytest.raises(Conflict):
        store.create("x")
