"""Sparse copies of RAM files (:func:`torpor.sandbox.vm.disk.copy_sparse`): holes stay holes,
and a copy in place over an earlier copy (a live snapshot's stop) ends equal to the source."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from torpor.sandbox.vm.disk import copy_sparse

MIB = 1 << 20


def _sparse(path: Path, size: int, writes: dict[int, bytes]) -> None:
    with open(path, "wb") as f:
        f.truncate(size)
        for off, data in writes.items():
            f.seek(off)
            f.write(data)


def _allocated(path: Path) -> int:
    return os.stat(path).st_blocks * 512


def test_a_copy_keeps_holes(tmp_path: Path) -> None:
    src, dst = tmp_path / "ram", tmp_path / "copy"
    _sparse(src, 64 * MIB, {MIB: b"a" * MIB, 40 * MIB: b"b" * 4096})
    copy_sparse(src, dst)
    assert dst.read_bytes() == src.read_bytes()
    assert _allocated(dst) < 4 * MIB


def test_in_place_over_an_earlier_copy_ends_equal(tmp_path: Path) -> None:
    src, dst = tmp_path / "ram", tmp_path / "copy"
    _sparse(src, 64 * MIB, {MIB: b"a" * MIB, 40 * MIB: b"b" * 4096})
    copy_sparse(src, dst)  # the copy while the guest runs
    with open(src, "r+b") as f:  # the guest writes on: over data, and into a hole
        f.seek(MIB + 100)
        f.write(b"changed")
        f.seek(20 * MIB)
        f.write(b"c" * 8192)
    copy_sparse(src, dst, in_place=True)  # the copy in the stop
    assert dst.read_bytes() == src.read_bytes()
    assert _allocated(dst) < 4 * MIB


def test_in_place_zeroes_data_where_the_source_has_a_hole(tmp_path: Path) -> None:
    src, dst = tmp_path / "ram", tmp_path / "copy"
    _sparse(src, 16 * MIB, {0: b"s" * 4096})
    _sparse(dst, 16 * MIB, {0: b"x" * 4096, 8 * MIB: b"stale" * 1000, 15 * MIB: b"end"})
    copy_sparse(src, dst, in_place=True)
    assert dst.read_bytes() == src.read_bytes()


def test_in_place_into_a_new_empty_file(tmp_path: Path) -> None:
    src, dst = tmp_path / "ram", tmp_path / "child-ram"
    _sparse(src, 32 * MIB, {3 * MIB: b"z" * 12345})
    _sparse(dst, 32 * MIB, {})
    inode = dst.stat().st_ino
    copy_sparse(src, dst, in_place=True)
    assert dst.stat().st_ino == inode  # the same file a QEMU may have mapped
    assert dst.read_bytes() == src.read_bytes()


def test_in_place_refuses_another_size(tmp_path: Path) -> None:
    src, dst = tmp_path / "ram", tmp_path / "copy"
    _sparse(src, 4 * MIB, {0: b"a"})
    _sparse(dst, 2 * MIB, {0: b"keep"})
    with pytest.raises(OSError):
        copy_sparse(src, dst, in_place=True)
    assert dst.read_bytes()[:4] == b"keep"  # untouched


def test_a_copy_allocates_only_the_sources_data(tmp_path: Path) -> None:
    src, dst = tmp_path / "ram", tmp_path / "child-ram"
    _sparse(src, 64 * MIB, {2 * MIB: b"d" * (3 * MIB), 50 * MIB: b"e" * 4096})
    _sparse(dst, 64 * MIB, {})
    copy_sparse(src, dst, in_place=True)
    assert dst.read_bytes() == src.read_bytes()
    assert 3 * MIB <= _allocated(dst) < 4 * MIB  # the extents, preallocated: no hole filled


def test_preallocate_keeps_size_and_data(tmp_path: Path) -> None:
    from torpor.sandbox.vm.disk import preallocate

    path = tmp_path / "f"
    _sparse(path, 8 * MIB, {MIB: b"keep"})
    with open(path, "r+b") as f:
        assert preallocate(f.fileno(), 4 * MIB, MIB)
    assert path.stat().st_size == 8 * MIB
    assert _allocated(path) >= MIB
    data = path.read_bytes()
    assert data[MIB : MIB + 4] == b"keep" and data[4 * MIB : 5 * MIB] == bytes(MIB)


def test_a_copy_where_the_file_system_cannot_preallocate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torpor.sandbox.vm.disk as disk

    calls: list[int] = []

    def cannot(fd: int, start: int, length: int) -> bool:
        calls.append(start)
        return False

    monkeypatch.setattr(disk, "preallocate", cannot)
    src, dst = tmp_path / "ram", tmp_path / "copy"
    _sparse(src, 32 * MIB, {0: b"a" * 4096, 9 * MIB: b"b" * 4096, 20 * MIB: b"c" * 4096})
    copy_sparse(src, dst)
    assert dst.read_bytes() == src.read_bytes()
    assert calls == [0]  # asked once, not once per extent


def test_preallocate_raises_what_is_not_a_missing_feature(tmp_path: Path) -> None:
    from torpor.sandbox.vm.disk import preallocate

    path = tmp_path / "f"
    _sparse(path, MIB, {})
    with open(path, "rb") as f, pytest.raises(OSError):  # not writable: EBADF, not "cannot"
        preallocate(f.fileno(), 0, MIB)
