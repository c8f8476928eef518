"""The KVM/TCG probe: its cache, the cache key, the override and the fallback."""

from __future__ import annotations

from pathlib import Path

import pytest

from torpor.errors import AccelerationUnavailable, InvalidArgument
from torpor.sandbox.vm import accel
from torpor.sandbox.vm.accel import AccelReport


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TORPOR_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("TORPOR_ACCEL", raising=False)
    return tmp_path / "home"


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[Path | None]:
    seen: list[Path | None] = []

    def fake(kernel: Path | None, initrd: Path | None) -> AccelReport:
        seen.append(kernel)
        return AccelReport("tcg", "fake probe")

    monkeypatch.setattr(accel, "_probe_now", fake)
    return seen


def test_the_answer_is_cached_per_kernel(
    home: Path, tmp_path: Path, calls: list[Path | None]
) -> None:
    kernel = tmp_path / "vmlinuz"
    kernel.write_bytes(b"kernel one")
    first = accel.probe(kernel=kernel)
    second = accel.probe(kernel=kernel)
    assert (first.accel, second.accel) == ("tcg", "tcg")
    assert len(calls) == 1 and "(cached)" in second.reason
    assert (home / "cache" / "accel.json").exists()
    copy = tmp_path / "other" / "vmlinuz"  # same kernel elsewhere: same answer
    copy.parent.mkdir()
    copy.write_bytes(b"kernel one")
    accel.probe(kernel=copy)
    assert len(calls) == 1
    kernel.write_bytes(b"kernel two")  # a changed kernel probes again
    accel.probe(kernel=kernel)
    assert len(calls) == 2
    accel.probe(kernel=kernel, force=True)
    assert len(calls) == 3


def test_without_a_kernel_the_answer_is_not_cached(home: Path, calls: list[Path | None]) -> None:
    accel.probe()
    accel.probe()
    assert calls == [None, None]
    assert not (home / "cache" / "accel.json").exists()


def test_environment_override(
    home: Path, calls: list[Path | None], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORPOR_ACCEL", "kvm")
    assert accel.probe().accel == "kvm"
    assert calls == []


def test_requiring_kvm_where_it_does_not_work_raises(home: Path, calls: list[Path | None]) -> None:
    with pytest.raises(AccelerationUnavailable):
        accel.probe(require="kvm")
    with pytest.raises(InvalidArgument):
        accel.probe(require="hvf")


def test_kvm_usable_gives_a_reason() -> None:
    ok, why = accel.kvm_usable()
    assert isinstance(ok, bool) and why


def test_no_kernel_means_tcg(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(accel, "kvm_usable", lambda: (True, "pretend"))
    report = accel._probe_now(None, None)
    assert report.accel == "tcg" and "kernel" in report.reason


def test_a_kernel_that_does_not_boot_means_tcg(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(accel, "kvm_usable", lambda: (True, "pretend"))
    bogus = tmp_path / "vmlinuz"
    bogus.write_bytes(b"not a kernel")
    report = accel._probe_now(bogus, None)
    assert report.accel == "tcg"


def test_a_cached_kvm_answer_is_dropped_once_kvm_is_unusable(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cache key is the kernel and the QEMU binary, not the host: a "kvm" cached while
    /dev/kvm worked (before a reboot without the module, a permission change, a home moved
    to another host) made every boot fail on KVM instead of falling back to TCG."""
    kernel = tmp_path / "vmlinuz"
    kernel.write_bytes(b"kernel")
    monkeypatch.setattr(accel, "kvm_usable", lambda: (True, "/dev/kvm is usable"))
    monkeypatch.setattr(accel, "_boot_kvm", lambda k, i, d: (True, "a guest kernel booted"))
    assert accel.probe(kernel=kernel).accel == "kvm"
    monkeypatch.setattr(accel, "kvm_usable", lambda: (False, "/dev/kvm cannot be opened"))
    report = accel.probe(kernel=kernel)
    assert report.accel == "tcg" and "/dev/kvm cannot be opened" in report.reason
    with pytest.raises(AccelerationUnavailable):
        accel.probe(kernel=kernel, require="kvm")
