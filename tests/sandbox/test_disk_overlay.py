"""The qcow2 overlays torpor writes itself (:func:`torpor.sandbox.vm.disk.new_overlay`): the
same image ``qemu-img create`` makes, checked by qemu-img and written to through qemu-io."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from torpor.errors import EngineError
from torpor.sandbox.vm.disk import new_overlay, virtual_size, write_overlay


def _run(*args: str) -> str:
    return subprocess.run(args, capture_output=True, text=True, check=True).stdout


def _info(path: Path) -> dict[str, Any]:
    info = json.loads(_run("qemu-img", "info", "--output=json", str(path)))
    for volatile in ("filename", "actual-size", "dirty-flag"):
        info.pop(volatile, None)
    return dict(info)


@pytest.fixture
def base(tmp_path: Path) -> Path:
    """A 3 GiB qcow2 with data at 0 (1 MiB of 0x5a) and at 2 GiB (64 KiB of 0x33)."""
    path = tmp_path / "base.qcow2"
    _run("qemu-img", "create", "-q", "-f", "qcow2", str(path), "3G")
    _run("qemu-io", "-c", "write -P 0x5a 0 1M", "-c", "write -P 0x33 2G 64k", str(path))
    return path


@pytest.mark.parametrize(
    "sized", [pytest.param(False, id="size-read"), pytest.param(True, id="-u")]
)
def test_overlay_is_what_qemu_img_makes(tmp_path: Path, base: Path, sized: bool) -> None:
    mine, theirs = tmp_path / "mine.qcow2", tmp_path / "theirs.qcow2"
    new_overlay(base, mine, size=virtual_size(base) if sized else None)
    _run("qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", str(base), str(theirs))
    assert _info(mine) == _info(theirs)
    assert _info(mine)["backing-filename"] == str(base)
    assert mine.stat().st_size == theirs.stat().st_size
    assert "No errors" in _run("qemu-img", "check", str(mine))
    assert "identical" in _run("qemu-img", "compare", str(mine), str(base))


def test_overlay_takes_writes_and_reads_through(tmp_path: Path, base: Path) -> None:
    top = tmp_path / "top.qcow2"
    new_overlay(base, top)
    out = _run(
        "qemu-io",
        "-c",
        "write -P 0x77 1M 128k",
        "-c",
        "read -P 0x5a 0 1M",
        "-c",
        "read -P 0x77 1M 128k",
        "-c",
        "read -P 0x33 2G 64k",
        str(top),
    )
    assert "Pattern verification failed" not in out
    assert "No errors" in _run("qemu-img", "check", str(top))
    # the base is untouched, and an overlay on the overlay reads the same as it
    assert (
        "identical"
        not in subprocess.run(
            ["qemu-img", "compare", str(top), str(base)], capture_output=True, text=True
        ).stdout
    )
    upper = tmp_path / "upper.qcow2"
    new_overlay(top, upper)
    assert "identical" in _run("qemu-img", "compare", str(upper), str(top))


def test_overlay_on_a_layer_not_there_yet_with_its_size(tmp_path: Path) -> None:
    later = tmp_path / "later.qcow2"
    top = tmp_path / "top.qcow2"
    new_overlay(later, top, size=8 << 30)  # -u: the backing is not opened
    _run("qemu-img", "create", "-q", "-f", "qcow2", str(later), "8G")
    assert _info(top)["virtual-size"] == 8 << 30
    assert "No errors" in _run("qemu-img", "check", str(top))


@pytest.mark.parametrize(
    "backing",
    [
        pytest.param("missing", id="missing"),
        pytest.param("raw", id="not-qcow2"),
    ],
)
def test_bad_backing_is_engine_error(tmp_path: Path, backing: str) -> None:
    path = tmp_path / backing
    if backing == "raw":
        path.write_bytes(bytes(4096))
    with pytest.raises(EngineError):
        new_overlay(path, tmp_path / "top.qcow2")


@pytest.mark.parametrize(
    ("name", "size"),
    [
        pytest.param(b"base.qcow2", 0, id="empty"),
        pytest.param(b"base.qcow2", 5 << 40, id="over-4TiB"),
        pytest.param(b"x" * 1024, 1 << 30, id="long-name"),
        pytest.param(b"", 1 << 30, id="no-name"),
    ],
)
def test_what_it_does_not_write_is_refused(tmp_path: Path, name: bytes, size: int) -> None:
    with pytest.raises(OSError):
        write_overlay(tmp_path / "top.qcow2", name, size)
    assert not (tmp_path / "top.qcow2").exists()  # refused before anything is written
    if name:  # through new_overlay: its error type
        with pytest.raises(EngineError):
            new_overlay(Path(name.decode()), tmp_path / "top2.qcow2", size=size)
