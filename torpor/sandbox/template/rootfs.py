"""Building a guest root file system and its disk image (the slow, cached half of a template).

Two cache levels live under ``paths().cache``::

    rootfs/<key>/rootfs/     a Debian tree from debootstrap (+ the user's apt/pip packages);
                             <key> hashes (suite, apt, pip, BASE_VERSION). Minutes to build.
    images/<key>-<guest>/    base.qcow2, vmlinuz, initrd.img made from that tree plus the guest
                             files (agent, init.sh); <guest> hashes those files. Seconds to build.

Every step writes into ``<dir>.tmp`` and renames it into place when it is complete, so a crash
leaves either nothing or a whole result, and running a step again is a no-op.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from torpor.errors import EngineError, InvalidArgument

log = logging.getLogger(__name__)

__all__ = [
    "BASE_PACKAGES",
    "BASE_VERSION",
    "SUITE",
    "Progress",
    "ensure_image",
    "ensure_rootfs",
    "guest_files",
    "guest_hash",
    "host_mirror",
    "images_in_use",
    "prune_images",
    "rootfs_key",
]

#: Bump to invalidate every cached rootfs (when the package set or the recipe changes).
BASE_VERSION = 1
SUITE = "bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
#: What every guest gets. The kernel comes from the guest's own linux-image-amd64 package.
BASE_PACKAGES = (
    "python3",
    "tini",
    "iproute2",
    "procps",
    "ca-certificates",
    "kmod",
    "linux-image-amd64",
    "initramfs-tools",
    "zstd",
)
#: Modules the initramfs must hold to mount a virtio-blk ext4 root (MODULES=list keeps it
#: small, which matters: under TCG every MiB of initrd costs boot time).
INITRAMFS_MODULES = ("virtio_pci", "virtio_blk", "virtio_console", "ext4", "crc32c_generic")
#: Bump when the image recipe changes (what :func:`_slim` drops, mkfs options ...).
IMAGE_VERSION = 2
#: What a VM guest never loads: hardware drivers (sound, GPUs, Wi-Fi, NICs other than
#: virtio, USB ...) and documentation. Halves the image (~300 MB of the ~650 MB).
_SLIM_PATHS = (
    "usr/share/doc",
    "usr/share/man",
    "usr/share/info",
    "usr/share/locale",
    "kernel/sound",
    "kernel/drivers/gpu",
    "kernel/drivers/media",
    "kernel/drivers/net/wireless",
    "kernel/drivers/net/ethernet",
    "kernel/drivers/infiniband",
    "kernel/drivers/usb",
    "kernel/drivers/iio",
    "kernel/drivers/comedi",
    "kernel/drivers/staging",
    "kernel/drivers/hwmon",
    "kernel/drivers/bluetooth",
    "kernel/drivers/isdn",
    "kernel/drivers/net/can",
    "kernel/drivers/input/touchscreen",
    "kernel/net/bluetooth",
    "kernel/net/wireless",
    "kernel/net/mac80211",
)
#: Size of the guest's root disk (a sparse file: unused space costs nothing on the host).
DISK_SIZE_MIB = 4096
_PKG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.+_:=<>~!\[\],-]*$")

#: progress(step, detail): called at the start of each build step.
Progress = Callable[[str, str], None]


def _run(cmd: Sequence[str], what: str, *, env: dict[str, str] | None = None) -> str:
    """Run a host tool; raise :class:`EngineError` with its output tail if it fails."""
    log.debug("run: %s", " ".join(cmd))
    try:
        proc = subprocess.run(
            list(cmd),
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
    except OSError as exc:
        raise EngineError(f"{what}: cannot run {cmd[0]}: {exc}", exc=exc) from exc
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip()[-2000:]
        raise EngineError(
            f"{what} failed (exit {proc.returncode}): {tail}", returncode=proc.returncode
        )
    return proc.stdout


def host_mirror(
    deb822: Path = Path("/etc/apt/sources.list.d/debian.sources"),
    legacy: Path = Path("/etc/apt/sources.list"),
) -> str:
    """The Debian mirror the host's own apt uses (deb822 or one-line format), else
    deb.debian.org."""
    try:
        if deb822.exists():
            for stanza in deb822.read_text().split("\n\n"):
                fields = dict(
                    line.split(":", 1)
                    for line in stanza.splitlines()
                    if ":" in line and not line.startswith("#")
                )
                uris = fields.get("URIs", "").split()
                suites = fields.get("Suites", "")
                if uris and "security" not in suites and "security" not in uris[0]:
                    return uris[0].strip()
        if legacy.exists():
            for line in legacy.read_text().splitlines():
                parts = line.split()
                if len(parts) >= 3 and parts[0] == "deb" and "security" not in line:
                    uri = parts[1] if not parts[1].startswith("[") else parts[2]
                    return uri
    except OSError as exc:
        log.warning("cannot read the host's apt sources (%s); using %s", exc, DEFAULT_MIRROR)
    return DEFAULT_MIRROR


def check_packages(names: Sequence[str], what: str) -> list[str]:
    """Return the package names sorted and de-duplicated; raise InvalidArgument on a bad one."""
    for n in names:
        if not isinstance(n, str) or not _PKG_RE.match(n):
            raise InvalidArgument(f"invalid {what} package name {n!r}", name=str(n))
    return sorted(set(names))


def rootfs_key(apt: Sequence[str], pip: Sequence[str]) -> str:
    """The cache key of a rootfs with these extra packages."""
    blob = json.dumps(
        {"suite": SUITE, "base": BASE_VERSION, "apt": sorted(apt), "pip": sorted(pip)},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _copy_tree(src: Path, dst: Path) -> None:
    # cp keeps owners, modes, xattrs, hard links and device nodes; reflinks where it can.
    _run(["cp", "-a", "--reflink=auto", str(src), str(dst)], "copying the rootfs")


def _chroot(root: Path, cmd: Sequence[str], what: str) -> None:
    """Run ``cmd`` inside ``root`` with /proc, /sys and /dev mounted (unmounted after)."""
    shutil.copyfile("/etc/resolv.conf", root / "etc" / "resolv.conf")
    mounts = [
        ("proc", root / "proc", ["-t", "proc", "proc"]),
        ("sys", root / "sys", ["-t", "sysfs", "sysfs"]),
        ("dev", root / "dev", ["--bind", "/dev"]),
    ]
    done: list[Path] = []
    try:
        for _, target, args in mounts:
            target.mkdir(exist_ok=True)
            _run(["mount", *args, str(target)], f"mounting {target.name} in the chroot")
            done.append(target)
        env = {
            "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
            "DEBIAN_FRONTEND": "noninteractive",
            "LANG": "C.UTF-8",
            "HOME": "/root",
        }
        _run(["chroot", str(root), *cmd], what, env=env)
    finally:
        for target in reversed(done):
            subprocess.run(["umount", "-l", str(target)], check=False, capture_output=True)


def _remove_tree(path: Path) -> None:
    """Delete a half-built tree, first unmounting anything a killed build left mounted in it
    (its /dev is a bind mount of the host's: rmtree must never walk into that)."""
    prefix = str(path.resolve()) + "/"
    try:
        with open("/proc/mounts") as f:
            targets = [line.split()[1] for line in f if line.split()[1].startswith(prefix)]
    except OSError:
        targets = []
    for target in sorted(targets, key=len, reverse=True):
        subprocess.run(["umount", "-l", target], check=False, capture_output=True)
    with open("/proc/mounts") as f:
        if any(line.split()[1].startswith(prefix) for line in f):
            raise EngineError(f"cannot unmount everything under {path}; remove it by hand")
    shutil.rmtree(path, ignore_errors=True)


def _configure_base(root: Path) -> None:
    """Make the debootstrapped tree bootable as a torpor guest (initramfs, fstab, hostname)."""
    conf = root / "etc" / "initramfs-tools"
    (conf / "conf.d").mkdir(parents=True, exist_ok=True)
    (conf / "conf.d" / "torpor.conf").write_text("MODULES=list\nCOMPRESS=zstd\n")
    (conf / "modules").write_text("\n".join(INITRAMFS_MODULES) + "\n")
    (root / "etc" / "hostname").write_text("torpor\n")
    (root / "etc" / "hosts").write_text("127.0.0.1 localhost\n127.0.1.1 torpor\n")
    (root / "etc" / "fstab").write_text("/dev/vda / ext4 rw,relatime 0 1\n")
    _chroot(root, ["update-initramfs", "-u", "-k", "all"], "update-initramfs")


def _clean(root: Path) -> None:
    """Drop what a guest never needs (apt lists and archives) to keep the image small."""
    for sub in ("var/cache/apt/archives", "var/lib/apt/lists"):
        d = root / sub
        if d.is_dir():
            for p in d.glob("*.deb"):
                p.unlink()
            for p in d.glob("*_Packages"):
                p.unlink()


def ensure_rootfs(
    cache: Path,
    apt: Sequence[str],
    pip: Sequence[str],
    *,
    force: bool = False,
    progress: Progress | None = None,
) -> Path:
    """Return the cached rootfs tree for (suite, apt, pip), building it if absent.

    The plain base tree is built first (debootstrap) and reused by every package set: a
    template with extra packages copies it and installs them in a chroot.
    Raises :class:`EngineError` if debootstrap, apt or pip fails (leaving no half-made tree).
    """
    say = progress or (lambda step, detail: None)
    key = rootfs_key(apt, pip)
    final = cache / "rootfs" / key
    if final.joinpath("rootfs", "usr", "bin", "python3").exists() and not force:
        return final / "rootfs"
    if os.geteuid() != 0:
        raise EngineError(
            "building a guest rootfs needs root (debootstrap, chroot, mount): "
            "run `sudo torpor template build ...` once; later builds reuse it"
        )
    final.parent.mkdir(parents=True, exist_ok=True)
    # One builder per rootfs: two templates may need the same base at the same time.
    with open(final.parent / f".{key}.lock", "w") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        if final.joinpath("rootfs", "usr", "bin", "python3").exists() and not force:
            return final / "rootfs"
        return _build_rootfs(cache, key, list(apt), list(pip), say, progress)


def _build_rootfs(
    cache: Path, key: str, apt: list[str], pip: list[str], say: Progress, progress: Progress | None
) -> Path:
    final = cache / "rootfs" / key
    base_key = rootfs_key((), ())
    tmp = final.with_name(key + ".tmp")
    _remove_tree(tmp)
    tmp.mkdir()
    try:
        if key != base_key:
            base = ensure_rootfs(cache, (), (), progress=progress)
            say("rootfs", "copying the base rootfs")
            _copy_tree(base, tmp / "rootfs")
        else:
            mirror = host_mirror()
            say("debootstrap", f"debootstrap {SUITE} from {mirror} (a few minutes)")
            _run(
                [
                    "debootstrap",
                    "--variant=minbase",
                    "--include=" + ",".join(BASE_PACKAGES),
                    SUITE,
                    str(tmp / "rootfs"),
                    mirror,
                ],
                "debootstrap",
            )
            say("rootfs", "configuring the initramfs")
            _configure_base(tmp / "rootfs")
        root = tmp / "rootfs"
        if apt:
            say("apt", "installing " + " ".join(apt))
            _chroot(root, ["apt-get", "update", "-q"], "apt-get update")
            _chroot(
                root,
                ["apt-get", "install", "-y", "-q", "--no-install-recommends", *apt],
                "apt-get install",
            )
        if pip:
            say("pip", "installing " + " ".join(pip))
            _chroot(root, ["apt-get", "update", "-q"], "apt-get update")
            _chroot(
                root,
                ["apt-get", "install", "-y", "-q", "--no-install-recommends", "python3-pip"],
                "apt-get install python3-pip",
            )
            # Trust what the host trusts while downloading (a TLS-inspecting egress proxy's CA,
            # say), without adding it to the guest's own store.
            cert: list[str] = []
            host_ca = Path("/etc/ssl/certs/ca-certificates.crt")
            if host_ca.is_file():
                shutil.copyfile(host_ca, root / "tmp" / "torpor-host-ca.crt")
                cert = ["--cert", "/tmp/torpor-host-ca.crt"]
            try:
                _chroot(
                    root,
                    [
                        "python3",
                        "-m",
                        "pip",
                        "install",
                        "--no-cache-dir",
                        "--break-system-packages",
                        *cert,
                        *pip,
                    ],
                    "pip install",
                )
            finally:
                (root / "tmp" / "torpor-host-ca.crt").unlink(missing_ok=True)
        _clean(root)
        (tmp / "rootfs.json").write_text(
            json.dumps({"suite": SUITE, "base": BASE_VERSION, "apt": list(apt), "pip": list(pip)})
        )
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        # a package that would not install (a typo) is asked for again under another key:
        # nothing else would remove this copy of the whole tree
        with contextlib.suppress(EngineError, OSError):
            _remove_tree(tmp)
        raise
    return final / "rootfs"


def guest_files(guest_dir: Path) -> dict[str, Path]:
    """The files copied into the guest's /opt/torpor: every ``*.py`` and ``init.sh``."""
    files = {p.name: p for p in sorted(guest_dir.glob("*.py")) if p.name != "__init__.py"}
    init = guest_dir / "init.sh"
    if not init.exists():
        raise EngineError(f"guest boot script missing: {init}")
    files["init.sh"] = init
    return files


def guest_hash(files: dict[str, Path]) -> str:
    """A hash of the guest files' names and contents (and of the image recipe's version)."""
    h = hashlib.sha256(f"image-v{IMAGE_VERSION}\0".encode())
    for name in sorted(files):
        h.update(name.encode() + b"\0" + files[name].read_bytes() + b"\0")
    return h.hexdigest()[:12]


def _slim(root: Path) -> None:
    """Delete :data:`_SLIM_PATHS` from the tree (idempotent) and refresh the module index."""
    removed = False
    for rel in _SLIM_PATHS:
        if rel.startswith("kernel/"):
            targets = list((root / "usr" / "lib" / "modules").glob(f"*/{rel}"))
        else:
            targets = [root / rel]
        for t in targets:
            if t.exists():
                shutil.rmtree(t)
                removed = True
    if removed:
        for kdir in (root / "usr" / "lib" / "modules").glob("*"):
            _chroot(root, ["depmod", "-a", kdir.name], "depmod")


def _kernel_files(root: Path) -> tuple[Path, Path]:
    boot = root / "boot"
    kernels = sorted(boot.glob("vmlinuz-*"))
    initrds = sorted(boot.glob("initrd.img-*"))
    if not kernels or not initrds:
        raise EngineError(f"no kernel/initrd in {boot}: the rootfs is incomplete")
    return kernels[-1], initrds[-1]


def ensure_image(
    cache: Path,
    rootfs: Path,
    files: dict[str, Path],
    *,
    force: bool = False,
    progress: Progress | None = None,
) -> Path:
    """Return a directory holding base.qcow2, vmlinuz and initrd.img, building it if absent.

    The guest files go to /opt/torpor (init.sh executable). The disk is an ext4 file system
    made straight from the tree (``mkfs.ext4 -d``) in a sparse file, converted to qcow2.
    Raises :class:`EngineError` if a host tool fails.
    """
    say = progress or (lambda step, detail: None)
    key = f"{rootfs.parent.name}-{guest_hash(files)}"
    final = cache / "images" / key
    if (final / "base.qcow2").exists() and not force:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    # One image maker per rootfs, from clearing ``<key>.tmp`` to its rename: this step owns
    # /opt/torpor of the cached tree, and two builds of templates with the same packages
    # (``python``, ``python-2g``) make the same image in the same tmp dir.
    with open(rootfs.parent / ".image.lock", "w") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        if (final / "base.qcow2").exists() and not force:
            return final  # the other build made it meanwhile
        say("image", "making the disk image")
        tmp = final.with_name(key + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            _make_image(tmp, rootfs, files)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # the raw file system: the whole rootfs
            raise
    return final


def _make_image(tmp: Path, rootfs: Path, files: dict[str, Path]) -> None:
    """Write base.qcow2, vmlinuz, initrd.img and image.json into ``tmp`` (see
    :func:`ensure_image`). Raises EngineError, OSError."""
    _slim(rootfs)
    opt = rootfs / "opt" / "torpor"
    shutil.rmtree(opt, ignore_errors=True)
    opt.mkdir(parents=True)
    for name, src in files.items():
        shutil.copyfile(src, opt / name)
        (opt / name).chmod(0o755 if name.endswith(".sh") else 0o644)
    kernel, initrd = _kernel_files(rootfs)
    shutil.copyfile(kernel, tmp / "vmlinuz")
    shutil.copyfile(initrd, tmp / "initrd.img")
    raw = tmp / "root.raw"
    with open(raw, "wb") as f:
        f.truncate(DISK_SIZE_MIB * 1024 * 1024)
    _run(["mkfs.ext4", "-q", "-F", "-L", "torpor-root", "-d", str(rootfs), str(raw)], "mkfs.ext4")
    _run(
        ["qemu-img", "convert", "-f", "raw", "-O", "qcow2", str(raw), str(tmp / "base.qcow2")],
        "qemu-img convert",
    )
    raw.unlink()
    (tmp / "image.json").write_text(
        json.dumps(
            {
                "rootfs": str(rootfs),
                "kernel": kernel.name,
                "initrd": initrd.name,
                "guest_files": sorted(files),
            }
        )
    )


@contextlib.contextmanager
def images_in_use(cache: Path) -> Iterator[None]:
    """Hold the cached images from :func:`prune_images` (a shared flock on the cache's
    ``.images.lock``): a build takes it from :func:`ensure_image` until its own build links
    the image's files, since the image it found may be the oldest. Raises OSError."""
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".images.lock", "w") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_SH)
        yield


def prune_images(cache: Path, keep: int = 2, keep_also: Path | None = None) -> None:
    """Drop all but the ``keep`` newest cached images. Safe: template builds hold hard links
    to their image files, an image a build is about to link is held by
    :func:`images_in_use` (this waits for it), and an image is rebuilt from its rootfs in
    seconds. Raises OSError when the images' lock cannot be taken."""
    if not (cache / "images").is_dir():
        return
    with open(cache / ".images.lock", "w") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        images: list[tuple[float, Path]] = []
        for d in (cache / "images").glob("*"):
            with contextlib.suppress(FileNotFoundError):
                if d.is_dir() and not d.name.endswith(".tmp"):
                    images.append((d.stat().st_mtime, d))
        images.sort(reverse=True)
        for _, old in images[keep:]:
            if keep_also is None or old.resolve() != keep_also.resolve():
                shutil.rmtree(old, ignore_errors=True)
