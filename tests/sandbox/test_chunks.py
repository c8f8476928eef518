"""The chunk store: round trips, deduplication, zero chunks, integrity checks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torpor.errors import CorruptData, InvalidArgument
from torpor.sandbox.storage.chunks import ChunkStore, FileManifest

CS = 4096


def _store(root: Path) -> ChunkStore:
    return ChunkStore(root / "chunks", chunk_size=CS)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.binary(max_size=5 * CS + 17), zero_pages=st.lists(st.integers(0, 5), max_size=3))
def test_file_round_trip(tmp_path: Path, data: bytes, zero_pages: list[int]) -> None:
    raw = bytearray(data)
    for page in zero_pages:  # make some chunks all-zero, as in a guest's RAM
        raw[page * CS : (page + 1) * CS] = bytes(len(raw[page * CS : (page + 1) * CS]))
    src = tmp_path / "src"
    src.write_bytes(bytes(raw))
    store = _store(tmp_path)
    fm = store.put_file(src)
    assert fm.size == len(raw)
    assert len(fm.chunks) == -(-len(raw) // CS)
    again = FileManifest.from_json(fm.to_json())
    dst = tmp_path / "dst"
    store.restore_file(again, dst)
    assert dst.read_bytes() == bytes(raw)


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.binary(min_size=1, max_size=3 * CS))
def test_same_content_is_stored_once(tmp_path: Path, data: bytes) -> None:
    store = _store(tmp_path)
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(data)
    b.write_bytes(data)
    store.put_file(a)
    before = sorted(store)
    second = store.put_file(b)
    assert sorted(store) == before
    assert second.new_bytes == 0


def test_zero_chunks_and_holes_are_not_stored(tmp_path: Path) -> None:
    store = _store(tmp_path)
    sparse = tmp_path / "ram"
    with open(sparse, "wb") as f:
        f.truncate(64 * CS)
        f.seek(10 * CS)
        f.write(b"x" * 100)
    fm = store.put_file(sparse)
    assert [i for i, c in enumerate(fm.chunks) if c is not None] == [10]
    assert len(list(store)) == 1
    out = tmp_path / "out"
    store.restore_file(fm, out)
    assert out.read_bytes() == sparse.read_bytes()
    assert os.stat(out).st_blocks * 512 < 64 * CS  # restored sparse, not filled with zeros


def test_shared_chunks_across_files(tmp_path: Path) -> None:
    store = _store(tmp_path)
    base = os.urandom(8 * CS)
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(base)
    changed = bytearray(base)
    changed[3 * CS] ^= 0xFF  # one chunk differs
    b.write_bytes(bytes(changed))
    fa, fb = store.put_file(a), store.put_file(b)
    assert len(fa.hashes() & fb.hashes()) == 7
    assert len(list(store)) == 9


def test_flipped_byte_is_corrupt_data(tmp_path: Path) -> None:
    store = _store(tmp_path)
    src = tmp_path / "src"
    src.write_bytes(os.urandom(2 * CS))
    fm = store.put_file(src)
    digest = fm.chunks[1]
    assert digest is not None
    path = store.path_of(digest)
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0x01
    path.write_bytes(bytes(blob))
    dst = tmp_path / "dst"
    with pytest.raises(CorruptData) as err:
        store.restore_file(fm, dst, snapshot_id="snap-x")
    assert err.value.data["snapshot_id"] == "snap-x"
    assert "snap-x" in str(err.value)
    assert not dst.exists()


def test_missing_chunk_is_corrupt_data(tmp_path: Path) -> None:
    store = _store(tmp_path)
    digest, _ = store.put(b"hello")
    store.remove(digest)
    with pytest.raises(CorruptData):
        store.get(digest, snapshot_id="snap-y")


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param({"size": 10, "chunk_size": 4096, "chunks": []}, id="count-mismatch"),
        pytest.param({"size": 10, "chunk_size": 4096, "chunks": ["../etc"]}, id="bad-name"),
        pytest.param({"size": 10}, id="missing-keys"),
    ],
)
def test_malformed_manifest_is_corrupt_data(bad: dict[str, object]) -> None:
    with pytest.raises(CorruptData):
        FileManifest.from_json(bad)


def test_bad_chunk_size_and_name(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument):
        ChunkStore(tmp_path, chunk_size=1000)
    with pytest.raises(InvalidArgument):
        _store(tmp_path).path_of("../../etc/passwd")


def test_a_failed_extent_lookup_stores_data_not_holes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only ENXIO from SEEK_DATA means "no data after here". Any other error (EIO reading the
    extent tree) had the rest of the file recorded as holes: a snapshot of zeros, silently."""
    src = tmp_path / "src"
    with open(src, "wb") as f:
        f.write(b"\x01" * CS)
        f.seek(3 * CS)
        f.write(b"\x02" * CS)  # data after a hole
    real_lseek = os.lseek

    def failing(fd: int, pos: int, how: int) -> int:
        if how == os.SEEK_DATA and pos > 0:
            raise OSError(5, "Input/output error")
        return real_lseek(fd, pos, how)

    monkeypatch.setattr(os, "lseek", failing)
    store = _store(tmp_path)
    fm = store.put_file(src)
    monkeypatch.undo()
    store.restore_file(fm, tmp_path / "dst")
    assert (tmp_path / "dst").read_bytes() == src.read_bytes()


def test_a_bad_copy_in_the_shared_store_is_replaced_by_the_next_push(tmp_path: Path) -> None:
    """Cluster mode: a node's chunks in front of a shared store (here a directory). A chunk
    whose shared copy went bad was judged corrupt, but only the (absent) local copy was
    quarantined: every later push of the same data skipped it ("there already"), so each new
    snapshot holding it was restorable on no other node."""
    from torpor.sandbox.storage.chunk_backends import LocalChunkBackend
    from torpor.sandbox.storage.tiered import TieredChunkBackend

    shared = LocalChunkBackend(tmp_path / "shared")

    def node(name: str) -> ChunkStore:
        tiered = TieredChunkBackend(LocalChunkBackend(tmp_path / name), shared)
        return ChunkStore(backend=tiered, chunk_size=CS)

    a, b = node("a"), node("b")
    data = os.urandom(CS)
    digest, _ = a.put(data)
    assert isinstance(a.backend, TieredChunkBackend)
    a.backend.push(digest, lambda blob: a.check(digest, blob))
    path = shared.path_of(digest)
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0x01
    path.write_bytes(bytes(blob))
    with pytest.raises(CorruptData):
        b.get(digest)  # node b has no copy of its own: the shared one is bad
    a.put(data)  # the same data saved again on node a, and pushed
    a.backend.push(digest, lambda blob: a.check(digest, blob))
    assert b.get(digest) == data


def test_a_scrub_that_finds_the_shared_copy_bad_keeps_the_good_copy_of_the_node(
    tmp_path: Path,
) -> None:
    """Cluster mode: verify() (the scrub) reads the shared store itself; its copy of a chunk
    was bad, but the node's own good copy was the one quarantined (reads take it first), so
    the bad one stayed in the shared store and the only good copy went out of reach: every
    read of the chunk, on this node too, was CorruptData from then on."""
    from torpor.sandbox.storage.chunk_backends import LocalChunkBackend
    from torpor.sandbox.storage.tiered import TieredChunkBackend

    shared = LocalChunkBackend(tmp_path / "shared")
    tiered = TieredChunkBackend(LocalChunkBackend(tmp_path / "node"), shared)
    store = ChunkStore(backend=tiered, chunk_size=CS)
    data = os.urandom(CS)
    digest, _ = store.put(data)
    tiered.push(digest, lambda blob: store.check(digest, blob))
    path = shared.path_of(digest)
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0x01
    path.write_bytes(bytes(blob))
    assert not store.verify(digest)  # the shared copy is bad
    assert store.get(digest) == data  # the node's copy is still read
    assert not shared.exists(digest)  # the bad one is out of the way: a push sends it again
    tiered.push(digest, lambda blob: store.check(digest, blob))
    assert store.verify(digest)


def test_a_bad_copy_on_the_node_read_whole_from_the_shared_store_is_replaced(
    tmp_path: Path,
) -> None:
    """Cluster mode: a read that found the node's own copy of a chunk bad read the shared
    store's instead and left the bad copy in place, though a failed read is what moves a bad
    copy aside. A later capture of the same data took it as stored; once the shared copy
    was swept (its snapshot deleted), that capture's push failed and its chunk was lost."""
    from torpor.sandbox.storage.chunk_backends import LocalChunkBackend
    from torpor.sandbox.storage.tiered import TieredChunkBackend

    shared = LocalChunkBackend(tmp_path / "shared")
    local = LocalChunkBackend(tmp_path / "node")
    tiered = TieredChunkBackend(local, shared)
    store = ChunkStore(backend=tiered, chunk_size=CS)
    data = os.urandom(CS)
    digest, _ = store.put(data)
    tiered.push(digest, lambda blob: store.check(digest, blob))
    path = local.path_of(digest)
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0x01
    path.write_bytes(bytes(blob))
    assert store.get(digest) == data  # read whole from the shared store
    shared.delete(digest)  # swept there: the snapshot naming it was deleted
    store.put(data)  # a new capture of the same data on this node
    tiered.push(digest, lambda blob: store.check(digest, blob))
    assert store.verify(digest)
