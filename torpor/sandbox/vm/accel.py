"""Which accelerator QEMU should use here: KVM when a guest really boots on it, else TCG.

``/dev/kvm`` existing is not enough: on some hosts (a nested, paravirtualised host) it opens
and accepts ioctls, yet a stock guest kernel never finishes booting. So :func:`probe` boots the
guest kernel under KVM with a deadline and looks for the kernel's last boot message on the
serial console. The answer is cached in ``paths().cache / "accel.json"``, keyed by the kernel
and the QEMU binary (a change to either probes again; a cached "kvm" also once /dev/kvm stops
working). ``TORPOR_ACCEL=kvm|tcg`` overrides it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from torpor.config import paths
from torpor.errors import AccelerationUnavailable, InvalidArgument

__all__ = ["PROBE_DEADLINE", "AccelReport", "kvm_usable", "probe"]

log = logging.getLogger(__name__)

#: Seconds a KVM guest gets to reach the end of kernel boot.
PROBE_DEADLINE = 20.0
#: Printed by the kernel just before it runs init: the guest kernel has fully booted.
_BOOTED_MARKERS = (b"Freeing unused kernel", b"Run /init as init process")
_KVM_GET_API_VERSION = 0xAE00


@dataclass(frozen=True)
class AccelReport:
    """The accelerator in use (``"kvm"`` or ``"tcg"``) and why."""

    accel: str
    reason: str


def kvm_usable() -> tuple[bool, str]:
    """Whether /dev/kvm opens read-write and answers KVM_GET_API_VERSION; and why not."""
    try:
        fd = os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        return False, f"/dev/kvm cannot be opened ({exc.strerror})"
    try:
        version = fcntl.ioctl(fd, _KVM_GET_API_VERSION)
    except OSError as exc:
        return False, f"/dev/kvm does not answer ({exc.strerror})"
    finally:
        os.close(fd)
    if version != 12:
        return False, f"/dev/kvm reports API version {version}, not 12"
    return True, "/dev/kvm is usable"


def _fingerprint(path: Path) -> str:
    try:
        st = path.stat()
    except OSError:
        return "missing"
    return f"{path}:{st.st_size}:{int(st.st_mtime)}"


def _content_hash(path: Path) -> str:
    # By content, not path: every template build has its own copy of the same kernel.
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return "missing"


def _cache_key(kernel: Path | None) -> str:
    qemu = shutil.which("qemu-system-x86_64") or "qemu-system-x86_64"
    blob = _fingerprint(Path(qemu)) + "|" + (_content_hash(kernel) if kernel else "no-kernel")
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _default_kernel() -> Path | None:
    """The kernel of any built template (the probe needs a guest kernel to boot)."""
    for tj in sorted(paths().templates.glob("*/template.json")):
        with contextlib.suppress(OSError, ValueError, KeyError):
            kernel = Path(json.loads(tj.read_text())["kernel"])
            if kernel.exists():
                return kernel
    return None


def _boot_kvm(kernel: Path, initrd: Path | None, deadline: float) -> tuple[bool, str]:
    """Boot ``kernel`` under KVM with no disk; True if it reached init within ``deadline``."""
    with tempfile.TemporaryDirectory(prefix="torpor-probe-") as tmp:
        console = Path(tmp) / "console.log"
        cmd = [
            "qemu-system-x86_64",
            "-nodefaults",
            "-nographic",
            "-no-reboot",
            "-machine",
            "pc",
            "-accel",
            "kvm",
            "-cpu",
            "host",
            "-m",
            "256M",
            "-kernel",
            str(kernel),
            "-append",
            "console=ttyS0 panic=-1 root=/dev/nonexistent",
            "-serial",
            f"file:{console}",
        ]
        if initrd is not None and initrd.exists():
            cmd += ["-initrd", str(initrd)]
        try:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
            )
        except OSError as exc:
            return False, f"cannot start QEMU ({exc})"
        try:
            end = time.monotonic() + deadline
            while time.monotonic() < end:
                with contextlib.suppress(OSError):
                    out = console.read_bytes()
                    if any(m in out for m in _BOOTED_MARKERS):
                        return True, "a guest kernel booted under KVM"
                if proc.poll() is not None:
                    err = (proc.stderr.read() if proc.stderr else b"").decode(errors="replace")
                    lines = [
                        ln.split("error: ", 1)[-1].strip() for ln in err.splitlines() if ln.strip()
                    ]
                    return False, f"QEMU with KVM exited early: {(lines or ['?'])[0][:200]}"
                time.sleep(0.1)
            return False, (
                f"/dev/kvm works but a guest kernel did not boot on it within "
                f"{deadline:.0f}s (a nested host?)"
            )
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def probe(
    force: bool = False,
    *,
    kernel: Path | None = None,
    initrd: Path | None = None,
    require: str | None = None,
) -> AccelReport:
    """Decide between KVM and TCG (cached in ``paths().cache/accel.json``).

    ``kernel``/``initrd``: the guest kernel to try under KVM (default: a built template's).
    ``force``: probe again even if cached. ``require="kvm"`` raises
    :class:`AccelerationUnavailable` instead of falling back to TCG.
    """
    if require not in (None, "kvm", "tcg"):
        raise InvalidArgument(f"unknown accelerator {require!r}", accel=str(require))
    override = os.environ.get("TORPOR_ACCEL")
    if override in ("kvm", "tcg"):
        return AccelReport(override, "set by TORPOR_ACCEL")
    kernel = kernel or _default_kernel()
    if initrd is None and kernel is not None:
        sibling = kernel.with_name("initrd.img")
        initrd = sibling if sibling.exists() else None
    cache_file = paths().cache / "accel.json"
    key = _cache_key(kernel)
    report: AccelReport | None = None
    if not force:
        with contextlib.suppress(OSError, ValueError, KeyError):
            cached = json.loads(cache_file.read_text())
            # (the key names no host: a "kvm" is trusted only while /dev/kvm still works)
            if cached["key"] == key and (cached["accel"] != "kvm" or kvm_usable()[0]):
                report = AccelReport(cached["accel"], cached["reason"] + " (cached)")
    if report is None:
        report = _probe_now(kernel, initrd)
        if kernel is not None:  # without a kernel the answer is provisional: do not cache it
            with contextlib.suppress(OSError):
                cache_file.parent.mkdir(parents=True, exist_ok=True)
                tmp = cache_file.with_name("accel.json.tmp")
                tmp.write_text(
                    json.dumps(
                        {
                            "key": key,
                            "accel": report.accel,
                            "reason": report.reason,
                            "kernel": str(kernel),
                        }
                    )
                )
                os.replace(tmp, cache_file)
    log.info("accelerator: %s (%s)", report.accel, report.reason)
    if require == "kvm" and report.accel != "kvm":
        raise AccelerationUnavailable(
            f"KVM required but unusable: {report.reason}", reason=report.reason
        )
    return report


def _probe_now(kernel: Path | None, initrd: Path | None) -> AccelReport:
    ok, why = kvm_usable()
    if not ok:
        return AccelReport("tcg", why)
    if kernel is None:
        return AccelReport("tcg", "no guest kernel to test KVM with yet")
    booted, why = _boot_kvm(kernel, initrd, PROBE_DEADLINE)
    return AccelReport("kvm" if booted else "tcg", why)
