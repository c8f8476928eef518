"""Reading a file out of a volume image without a VM: debugfs on images made by ``mkfs.ext4 -d``."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from torpor.config import paths
from torpor.errors import (
    EngineError,
    InvalidArgument,
    PathNotFound,
    PayloadTooLarge,
    VolumeNotFound,
)
from torpor.sandbox.storage.volume_files import needs_recovery, read_image_file, read_volume_file
from torpor.sandbox.storage.volumes import VolumeStore

ODD_NAMES = {
    "/work dir/ledger 2026.csv": b"date,event\n2026-03-03,upgraded to Pro\n",
    "/q\"uote/it's.txt": b"quoted\n",
    "/\u00fcber.txt": "\u00fcber\n".encode(),
    "/new\nline": b"newline in the name\n",
    "/empty": b"",
    "/bin.dat": bytes(range(256)) * 300,  # binary, several blocks
}


def _tree(root: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        target = root / name.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)


def _mkfs(image: Path, tree: Path, size_mib: int = 16) -> None:
    """An ext4 image holding ``tree`` (as the volume store makes them: sparse, no reserve)."""
    with open(image, "wb") as f:
        f.truncate(size_mib << 20)
    subprocess.run(
        ["mkfs.ext4", "-q", "-F", "-m", "0", "-d", str(tree), str(image)],
        check=True,
        capture_output=True,
    )


@pytest.fixture
def image(tmp_path: Path) -> Path:
    tree = tmp_path / "tree"
    _tree(tree, ODD_NAMES)
    (tree / "work dir" / "sub").mkdir()
    os.symlink("ledger 2026.csv", tree / "work dir" / "link")
    os.mkfifo(tree / "fifo")
    img = tmp_path / "vol.img"
    _mkfs(img, tree)
    return img


@pytest.mark.parametrize("path", [pytest.param(p, id=repr(p)) for p in ODD_NAMES])
def test_reads_files_with_any_name(image: Path, path: str) -> None:
    assert read_image_file(image, path) == ODD_NAMES[path]


def test_paths_are_normalized_inside_the_volume(image: Path) -> None:
    want = ODD_NAMES["/work dir/ledger 2026.csv"]
    assert read_image_file(image, "/work dir/sub/../ledger 2026.csv") == want
    assert read_image_file(image, "//work dir/./ledger 2026.csv") == want


@pytest.mark.parametrize(
    "path, error",
    [
        pytest.param("/nope.txt", PathNotFound, id="missing"),
        pytest.param("/work dir/nope", PathNotFound, id="missing-in-dir"),
        pytest.param("/nodir/x", PathNotFound, id="missing-dir"),
        pytest.param("/empty/x", PathNotFound, id="file-as-dir"),
        pytest.param("/work dir", InvalidArgument, id="directory"),
        pytest.param("/", InvalidArgument, id="root"),
        pytest.param("/work dir/link", InvalidArgument, id="symlink"),
        pytest.param("/fifo", InvalidArgument, id="fifo"),
        pytest.param("work dir/ledger 2026.csv", InvalidArgument, id="relative"),
        pytest.param("/a\0b", InvalidArgument, id="nul"),
    ],
)
def test_typed_errors(image: Path, path: str, error: type[Exception]) -> None:
    with pytest.raises(error):
        read_image_file(image, path)


def test_size_limit(image: Path) -> None:
    assert len(read_image_file(image, "/bin.dat", max_bytes=256 * 300)) == 256 * 300
    with pytest.raises(PayloadTooLarge) as info:
        read_image_file(image, "/bin.dat", max_bytes=256 * 300 - 1)
    assert info.value.data["size"] == 256 * 300


def test_not_an_image(tmp_path: Path) -> None:
    junk = tmp_path / "junk.img"
    junk.write_bytes(b"\xff" * 65536)
    with pytest.raises(EngineError, match="cannot open"):
        read_image_file(junk, "/x")
    with pytest.raises(EngineError, match="missing"):
        read_image_file(tmp_path / "gone.img", "/x")


@pytest.fixture
def store(tmp_path: Path) -> VolumeStore:
    return VolumeStore(paths(tmp_path / "home").ensure())


def _fill(store: VolumeStore, volume_id: str, tmp: Path, files: dict[str, bytes]) -> None:
    """Put ``files`` into a store-made volume (what a sandbox would have written)."""
    tree = tmp / f"tree-{volume_id}"
    _tree(tree, files)
    _mkfs(store.image(volume_id), tree)


def test_read_volume_file_by_name_and_tenant(store: VolumeStore, tmp_path: Path) -> None:
    vol = store.create("memory-u-42", size_mib=16, tenant="acme")
    _fill(store, vol.id, tmp_path, {"/facts.md": b"- prefers weekly summaries\n"})
    for ref in (vol.id, "memory-u-42"):
        assert (
            read_volume_file(store, ref, "/facts.md", tenant="acme")
            == b"- prefers weekly summaries\n"
        )
    with pytest.raises(VolumeNotFound):
        read_volume_file(store, "memory-u-42", "/facts.md", tenant="globex")
    with pytest.raises(PathNotFound):
        read_volume_file(store, "memory-u-42", "/other.md", tenant="acme")


def _set_recover_flag(image: Path) -> None:
    """Mark the image as needing journal recovery, as a guest killed mid-mount leaves it
    (debugfs keeps the superblock checksum right)."""
    subprocess.run(
        ["debugfs", "-w", "-R", "feature needs_recovery", str(image)],
        check=True,
        capture_output=True,
    )
    assert needs_recovery(image)


def test_journal_replayed_only_when_nobody_has_the_volume(
    store: VolumeStore, tmp_path: Path
) -> None:
    vol = store.create("v", size_mib=16)
    _fill(store, vol.id, tmp_path, {"/a.txt": b"a\n"})
    image = store.image(vol.id)
    assert not needs_recovery(image)
    store.attach(vol.id, "sbx-live", "/memory")
    _set_recover_flag(image)
    # attached to a live sandbox: read in place, the image is left alone
    assert read_volume_file(store, vol.id, "/a.txt", live={"sbx-live"}) == b"a\n"
    assert needs_recovery(image)
    # the sandbox is gone (killed): its stale attachment does not count, the journal is replayed
    assert read_volume_file(store, vol.id, "/a.txt", live=set()) == b"a\n"
    assert not needs_recovery(image)


def test_a_read_holds_the_lock_the_records_are_kept_under(tmp_path: Path) -> None:
    """The read took the volumes directory's own lock, not its records' (in a cluster: the
    registry's lock every node's attach, detach and delete takes): a sandbox could attach
    the volume while the read replayed its journal."""
    import contextlib
    import threading
    from collections.abc import Iterator

    from torpor.sandbox.storage.records import LocalRecords

    class Medium(LocalRecords):
        """Records whose lock is not the directory's flock (as the registry's)."""

        mutex = threading.Lock()

        def lock(self) -> contextlib.AbstractContextManager[None]:
            @contextlib.contextmanager
            def held() -> Iterator[None]:
                with self.mutex:
                    yield

            return held()

    p = paths(tmp_path / "home").ensure()
    store = VolumeStore(p, Medium(p.volumes, "vol"))
    vol = store.create("v", size_mib=16)
    _fill(store, vol.id, tmp_path, {"/a.txt": b"a\n"})
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(read_volume_file(store, "v", "/a.txt")))
    with store.records.lock():  # an attach in progress on another node
        reader.start()
        reader.join(timeout=1)
        assert reader.is_alive() and not got  # the read waits for it
    reader.join()
    assert got == [b"a\n"]


def _long_journal(image: Path, size_mib: int, journal_mib: int) -> None:
    """Make ``image`` what a hostile guest can leave on its volume's device: a journal of
    ``journal_mib`` full of committed transactions, each a descriptor of 510 blocks (holes:
    nothing to store) bound for one block, so its replay writes that block ~256 times per
    MiB of journal while the guest wrote 8 KiB per MiB."""
    import re
    import struct

    with open(image, "wb") as f:
        f.truncate(size_mib << 20)
    mkfs = ["mkfs.ext4", "-q", "-F", "-J", f"size={journal_mib}", "-E", "lazy_journal_init=1"]
    subprocess.run(
        [*mkfs, str(image)],
        check=True,
        capture_output=True,
    )
    stat = subprocess.run(
        ["debugfs", "-R", "stat <8>", str(image)], check=True, capture_output=True, text=True
    ).stdout
    where: list[int] = []  # the journal's blocks in order
    for first, last, phys in re.findall(r"\((\d+)-(\d+)\):(\d+)-\d+", stat):
        where += range(int(phys), int(phys) + int(last) - int(first) + 1)
    bs, magic, per = 4096, 0xC03B3998, (4096 - 12) // 8
    target = (size_mib << 8) - 10
    with open(image, "r+b") as f:
        f.seek(where[0] * bs + 24)
        f.write(struct.pack(">II", 1, 1))  # s_sequence 1, s_start 1: a journal to replay
        block, seq = 1, 1
        while block + per + 1 < len(where):
            desc = bytearray(bs)
            struct.pack_into(">III", desc, 0, magic, 1, seq)
            for i in range(per):  # same UUID, the last tag marked last
                struct.pack_into(">IHH", desc, 12 + 8 * i, target, 0, 2 | (8 * (i == per - 1)))
            f.seek(where[block] * bs)
            f.write(desc)
            f.seek(where[block + per + 1] * bs)
            f.write(struct.pack(">III", magic, 2, seq))
            block, seq = block + per + 2, seq + 1
    _set_recover_flag(image)


def test_a_journal_replay_is_bounded_in_time(
    store: VolumeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A guest sizes and fills its volume's journal: the host's replay (e2fsck, under the
    volumes' lock every create, attach, detach and delete waits for) took as long as the
    journal made it (~2.5 s per GiB here; a 1 TiB volume, most of an hour). Past the bound
    the attach is refused, nothing recorded, the journal left to replay."""
    import time

    from torpor.errors import OperationTimeout
    from torpor.sandbox.storage import volumes

    vol = store.create("v", size_mib=16)
    image = store.image(vol.id)
    _long_journal(image, size_mib=4096, journal_mib=1024)
    monkeypatch.setattr(volumes, "REPLAY_TIMEOUT", 0.2)
    t0 = time.monotonic()
    with pytest.raises(OperationTimeout):
        store.attach(vol.id, "sbx-1", "/data")
    assert time.monotonic() - t0 < 2
    assert needs_recovery(image)  # still to replay (a replay is restartable)
    assert store.get(vol.id).attachments == []
    with pytest.raises(OperationTimeout):
        read_volume_file(store, vol.id, "/x", live=set())
