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
