"""The bookkeeping of lingering QEMUs (torpor.sandbox.vm.linger) without a VM: plain
processes whose cwd is the directory and whose pid is in its ``qemu.pid`` stand in for QEMU
(as in test_exits.py). The real thing is tests/sandbox/test_linger.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torpor.config import Linger
from torpor.sandbox.vm import linger
from torpor.sandbox.vm.exits import settle_exits


def _stand_in(directory: Path) -> subprocess.Popen[bytes]:
    """A process that looks like the QEMU of ``directory``: cwd there, pid in qemu.pid."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in linger.FINGERPRINTED:
        (directory / name).write_bytes(name.encode())
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], cwd=directory)
    (directory / "qemu.pid").write_text(f"{proc.pid}\n")
    return proc


def _lingering(directory: Path, seconds: float = 60, max_count: int = 4) -> subprocess.Popen[bytes]:
    proc = _stand_in(directory)
    marker = linger.Marker(
        kind="linger",
        pid=proc.pid,
        owner=linger.me(),
        expires=time.time() + seconds,
        fingerprint=linger.fingerprint(directory),
    )
    linger.write_marker(directory, marker)
    linger.keep(directory.resolve(), proc, proc.pid, seconds, max_count)
    return proc


def _gone(proc: subprocess.Popen[bytes], seconds: float = 10) -> bool:
    try:
        proc.wait(seconds)
    except subprocess.TimeoutExpired:
        return False
    return True


@pytest.fixture(autouse=True)
def _nothing_left() -> object:
    yield
    linger.drop_all()
    import asyncio

    asyncio.run(settle_exits())


def test_a_marker_is_claimed_once(tmp_path: Path) -> None:
    proc = _lingering(tmp_path)
    marker = linger.read_marker(tmp_path / linger.MARKER)
    assert marker is not None and marker.pid == proc.pid and marker.kind == "linger"
    first = linger.claim(tmp_path)
    assert first is not None and first.exists()
    assert linger.claim(tmp_path) is None  # a second claimer gets nothing
    assert linger.read_marker(first) == marker


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        pytest.param(None, None, id="unchanged"),
        pytest.param(lambda d: os.utime(d / "ram"), "ram changed", id="ram-written"),
        pytest.param(lambda d: (d / "state").write_bytes(b"other"), "state changed", id="state"),
        pytest.param(
            lambda d: os.replace(d / "disk.qcow2.new", d / "disk.qcow2"),
            "disk.qcow2 changed",
            id="disk-switched",
        ),
        pytest.param(lambda d: (d / "ram").unlink(), "a file is gone", id="ram-gone"),
        pytest.param(lambda d: (d / "qemu.pid").write_text("1\n"), "QEMU is gone", id="qemu"),
    ],
)
def test_a_marker_is_stale_when_its_files_or_qemu_changed(
    tmp_path: Path, change: object, reason: str | None
) -> None:
    _lingering(tmp_path)
    marker = linger.read_marker(tmp_path / linger.MARKER)
    assert marker is not None
    (tmp_path / "disk.qcow2.new").write_bytes(b"disk.qcow2")  # same bytes, another inode
    if callable(change):
        time.sleep(0.01)  # (a coarse clock must tick for a time to differ)
        change(tmp_path)
    got = linger.stale_reason(marker, tmp_path)
    if reason is None:
        assert got is None
    else:
        assert got is not None and reason in got


def test_a_marker_past_its_window_is_stale(tmp_path: Path) -> None:
    _lingering(tmp_path)
    marker = linger.read_marker(tmp_path / linger.MARKER)
    assert marker is not None and marker.expires is not None
    assert linger.stale_reason(marker, tmp_path, now=marker.expires - 1) is None
    reason = linger.stale_reason(marker, tmp_path, now=marker.expires + 1)
    assert reason is not None and "window" in reason


def test_the_window_ends_with_a_kill(tmp_path: Path) -> None:
    proc = _lingering(tmp_path, seconds=0.3)
    assert linger.kept() == [tmp_path.resolve()]
    assert _gone(proc)
    assert proc.returncode is not None and proc.returncode < 0  # SIGKILLed
    assert linger.kept() == [] and not (tmp_path / linger.MARKER).exists()


def test_over_the_count_the_oldest_goes(tmp_path: Path) -> None:
    first = _lingering(tmp_path / "a", max_count=2)
    second = _lingering(tmp_path / "b", max_count=2)
    third = _lingering(tmp_path / "c", max_count=2)
    assert _gone(first)
    assert second.poll() is None and third.poll() is None
    assert linger.kept() == [(tmp_path / d).resolve() for d in ("b", "c")]


def test_a_released_qemu_is_not_expired(tmp_path: Path) -> None:
    proc = _lingering(tmp_path, seconds=0.2)
    claimed = linger.claim(tmp_path)  # a wake takes it ...
    assert claimed is not None
    assert linger.release(tmp_path.resolve()) is proc  # ... and its process, to reap later
    time.sleep(0.5)
    assert proc.poll() is None  # its window timer no longer applies
    proc.kill()
    proc.wait()


def test_one_claimed_by_another_process_is_left_running(tmp_path: Path) -> None:
    proc = _lingering(tmp_path)
    assert linger.claim(tmp_path) is not None  # (as another process's wake would)
    linger.drop(tmp_path.resolve())
    time.sleep(0.2)
    assert proc.poll() is None  # it runs for whoever claimed it
    proc.kill()
    proc.wait()


def test_the_sweep_kills_what_a_dead_process_left(tmp_path: Path) -> None:
    mine = _stand_in(tmp_path / "mine")
    orphan = _stand_in(tmp_path / "orphan")
    for d, proc, owner in (
        (tmp_path / "mine", mine, linger.me()),
        (tmp_path / "orphan", orphan, "1:0"),  # a keeper long gone
    ):
        linger.write_marker(
            d, linger.Marker(kind="linger", pid=proc.pid, owner=owner, expires=time.time() + 60)
        )
    assert linger.sweep(tmp_path) == [tmp_path / "orphan"]
    assert _gone(orphan) and mine.poll() is None
    mine.kill()
    mine.wait()


def test_the_process_s_exit_kills_what_it_keeps_without_waiting(tmp_path: Path) -> None:
    script = (
        "import pathlib, subprocess, sys, time\n"
        "from torpor.sandbox.vm import linger\n"
        f"d = pathlib.Path({str(tmp_path)!r}).resolve()\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], cwd=d)\n"
        "(d / 'qemu.pid').write_text(str(p.pid))\n"
        "for n in linger.FINGERPRINTED: (d / n).write_bytes(b'x')\n"
        "linger.write_marker(d, linger.Marker(kind='linger', pid=p.pid, owner=linger.me(),\n"
        "    expires=time.time() + 600, fingerprint=linger.fingerprint(d)))\n"
        "linger.keep(d, p, p.pid, 600, 4)\n"
        "print(p.pid, flush=True)\n"
    )
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    assert time.monotonic() - t0 < 60  # (not the 600 s window)
    pid = int(out.stdout.split()[0])
    for _ in range(500):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(") ", 1)[1][:1] == "Z":
                    break
        except OSError:
            break
        time.sleep(0.01)
    else:
        raise AssertionError("the kept process outlived its keeper")
    assert not (tmp_path / linger.MARKER).exists()


def test_linger_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORPOR_LINGER_SECONDS", raising=False)
    monkeypatch.delenv("TORPOR_LINGER_MAX", raising=False)
    assert Linger.from_env() == Linger(0.0, 4) and not Linger.from_env().enabled
    monkeypatch.setenv("TORPOR_LINGER_SECONDS", "2.5")
    monkeypatch.setenv("TORPOR_LINGER_MAX", "2")
    assert Linger.from_env() == Linger(2.5, 2) and Linger.from_env().enabled
    monkeypatch.setenv("TORPOR_LINGER_SECONDS", "forever")
    monkeypatch.setenv("TORPOR_LINGER_MAX", "-1")
    assert Linger.from_env() == Linger(0.0, 4)
    monkeypatch.setenv("TORPOR_LINGER_SECONDS", "30")
    monkeypatch.setenv("TORPOR_LINGER_MAX", "0")
    assert not Linger.from_env().enabled
    monkeypatch.setenv("TORPOR_LINGER_MAX", "³")  # a digit to str.isdigit, not to int()
    assert Linger.from_env() == Linger(30.0, 4)


def test_one_whose_directory_is_gone_is_killed(tmp_path: Path) -> None:
    proc = _lingering(tmp_path / "sbx")
    shutil.rmtree(tmp_path / "sbx")  # (its sandbox deleted by another way than a kill)
    linger.drop((tmp_path / "sbx").resolve())
    assert _gone(proc)


def _claimed_by(directory: Path, owner: str) -> Path:
    """The marker of ``directory`` renamed aside as ``owner``'s claim would name it."""
    claimed = directory / f"{linger.CLAIMED}{owner}"
    os.rename(directory / linger.MARKER, claimed)
    return claimed


def test_what_a_dead_claimer_left_stopped_is_killed(tmp_path: Path) -> None:
    proc = _lingering(tmp_path)
    claimed = _claimed_by(tmp_path, "1:0")  # a claimer long gone, before its resume or kill
    assert linger.recover(tmp_path) == [proc.pid]
    assert _gone(proc) and not claimed.exists()
    assert linger.recover(tmp_path) == []  # nothing left to do


def test_a_live_claimer_s_claim_is_left_alone(tmp_path: Path) -> None:
    proc = _lingering(tmp_path)
    claimed = _claimed_by(tmp_path, linger.me())  # this process: resuming it right now
    assert linger.recover(tmp_path) == []
    assert claimed.exists() and proc.poll() is None
    claimed.unlink()


def test_a_dead_claimer_s_resumed_qemu_is_left_running(tmp_path: Path) -> None:
    proc = _lingering(tmp_path)
    claimed = _claimed_by(tmp_path, "1:0")
    (tmp_path / "state").unlink()  # a resume deletes the state before its ``cont``
    assert linger.recover(tmp_path) == []
    assert not claimed.exists()  # the stale claim goes ...
    time.sleep(0.2)
    assert proc.poll() is None  # ... and the guest that runs on is kept
    linger.release(tmp_path.resolve())
    proc.kill()
    proc.wait()


def test_the_sweep_recovers_a_dead_claimer_s_qemu(tmp_path: Path) -> None:
    orphan = _lingering(tmp_path / "orphan")
    _claimed_by(tmp_path / "orphan", "1:0")
    assert linger.sweep(tmp_path) == [tmp_path / "orphan"]
    assert _gone(orphan)
