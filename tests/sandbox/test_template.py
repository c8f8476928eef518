"""Templates: names, lookups, cache keys, the host mirror; the built 'python' template and a
fresh build from the cached rootfs (marked ``qemu``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from torpor.config import paths
from torpor.errors import InvalidArgument, InvalidName, StorageError, TemplateNotFound
from torpor.sandbox import template as templates
from torpor.sandbox.template import rootfs as _rootfs


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TORPOR_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_an_unknown_template_is_not_found(home: Path) -> None:
    with pytest.raises(TemplateNotFound) as err:
        templates.get("nope")
    assert err.value.data["name"] == "nope"
    with pytest.raises(TemplateNotFound):
        templates.remove("nope")
    assert templates.list_templates() == []


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("Python", id="upper"),
        pytest.param("", id="empty"),
        pytest.param("../etc", id="traversal"),
        pytest.param("a b", id="space"),
        pytest.param("x" * 64, id="too-long"),
    ],
)
def test_invalid_template_names_are_refused(home: Path, name: str) -> None:
    with pytest.raises(InvalidName):
        templates.get(name)
    with pytest.raises(InvalidName):
        templates.build(name)
    assert not (home / "templates").exists() or not any((home / "templates").iterdir())


@pytest.mark.parametrize(
    "apt, pip",
    [
        pytest.param(["git; rm -rf /"], [], id="apt-shell"),
        pytest.param([], ["--index-url=http://evil"], id="pip-option"),
        pytest.param([""], [], id="empty"),
    ],
)
def test_bad_package_names_are_refused_before_any_work(
    home: Path, apt: list[str], pip: list[str]
) -> None:
    with pytest.raises(InvalidArgument):
        templates.build("data", apt=apt, pip=pip)
    assert not (home / "cache" / "rootfs").exists()


def test_rootfs_key_ignores_order_and_duplicates() -> None:
    a = _rootfs.rootfs_key(_rootfs.check_packages(["git", "curl", "git"], "apt"), ["numpy"])
    b = _rootfs.rootfs_key(_rootfs.check_packages(["curl", "git"], "apt"), ["numpy"])
    assert a == b
    assert a != _rootfs.rootfs_key(["curl", "git"], [])
    assert _rootfs.rootfs_key([], []) != a


def test_guest_hash_follows_the_guest_files(tmp_path: Path) -> None:
    (tmp_path / "init.sh").write_text("#!/bin/sh\n")
    (tmp_path / "agent.py").write_text("print(1)\n")
    (tmp_path / "__init__.py").write_text("")
    files = _rootfs.guest_files(tmp_path)
    assert sorted(files) == ["agent.py", "init.sh"]
    before = _rootfs.guest_hash(files)
    (tmp_path / "agent.py").write_text("print(2)\n")
    assert _rootfs.guest_hash(files) != before


def test_packaged_guest_files_include_the_boot_script() -> None:
    files = _rootfs.guest_files(templates.GUEST_DIR)
    assert "init.sh" in files and "agent.py" in files
    assert "/opt/torpor/agent.py --port" in files["init.sh"].read_text()
    # the modules the agent imports go into the image too (a rebuild picks up new ones:
    # they change the guest hash)
    assert {"terminal.py", "tunnel.py", "ops.py", "protocol.py"} <= set(files)


def test_host_mirror_reads_deb822_then_one_line_sources(tmp_path: Path) -> None:
    deb822 = tmp_path / "debian.sources"
    legacy = tmp_path / "sources.list"
    deb822.write_text(
        "Types: deb\nURIs: http://mirror.example/debian\nSuites: bookworm\n\n"
        "Types: deb\nURIs: http://security.example/debian-security\n"
        "Suites: bookworm-security\n"
    )
    assert _rootfs.host_mirror(deb822, legacy) == "http://mirror.example/debian"
    legacy.write_text("# comment\ndeb [arch=amd64] http://old.example/debian bookworm main\n")
    assert _rootfs.host_mirror(tmp_path / "missing", legacy) == "http://old.example/debian"
    assert _rootfs.host_mirror(tmp_path / "x", tmp_path / "y") == _rootfs.DEFAULT_MIRROR


def _info(tmp_path: Path, **fields: Any) -> templates.TemplateInfo:
    return templates.TemplateInfo(
        name="t",
        directory=tmp_path,
        build_id="b",
        kernel=tmp_path / "k",
        initrd=tmp_path / "i",
        base_image=tmp_path / "d",
        snapshot_dir=tmp_path / "s",
        **fields,
    )


def test_template_info_round_trips_through_json(tmp_path: Path) -> None:
    info = _info(tmp_path, apt=["git"])
    again = templates.TemplateInfo.from_json(json.loads(json.dumps(info.to_json())))
    assert again == info


def test_a_template_booted_with_another_kernel_command_line_is_stale(tmp_path: Path) -> None:
    from torpor.sandbox.vm.machine_dir import KERNEL_APPEND

    ghash = _rootfs.guest_hash(_rootfs.guest_files(templates.GUEST_DIR))
    info = _info(tmp_path, guest_hash=ghash, kernel_append=KERNEL_APPEND)
    assert templates.stale_reason(info) is None
    # a template.json from before the command line was kept has none: rebuilt once
    legacy = {k: v for k, v in info.to_json().items() if k != "kernel_append"}
    older = templates.TemplateInfo.from_json(legacy)
    assert "command line" in (templates.stale_reason(older) or "")
    other = templates.TemplateInfo.from_json({**info.to_json(), "kernel_append": "quiet"})
    assert "command line" in (templates.stale_reason(other) or "")
    agent = templates.TemplateInfo.from_json({**info.to_json(), "guest_hash": "0" * 12})
    assert "agent" in (templates.stale_reason(agent) or "")


@pytest.mark.qemu
def test_the_python_template_is_built_and_booted(qemu_home: Path) -> None:
    info = templates.get("python")
    assert [t.name for t in templates.list_templates()] == ["python"] or "python" in [
        t.name for t in templates.list_templates()
    ]
    assert info.kernel.is_file() and info.initrd.is_file() and info.base_image.is_file()
    snap = info.snapshot_dir
    assert (snap / "state").is_file() and (snap / "ram").is_file()
    assert (snap / "disk.qcow2").is_file()
    machine = json.loads((snap / "machine.json").read_text())
    assert machine["kernel"] == str(info.kernel) and machine["accel"] == info.accel
    assert machine["append"] == info.kernel_append  # what the snapshot booted with
    assert (info.directory / "snapshot").resolve() == snap.resolve()


@pytest.mark.qemu
def test_a_build_from_the_cached_rootfs_boots_and_snapshots(
    qemu_home: Path, template_home: Path, tmp_path: Path
) -> None:
    """The cheap half of a build (image + cold boot + hibernate) in a fresh home that shares
    only the slow rootfs cache; then a second build is a no-op and remove() deletes it."""
    rootfs_dir = template_home / "cache" / "rootfs" / _rootfs.rootfs_key((), ())
    if not rootfs_dir.is_dir():
        pytest.fail(f"no cached base rootfs at {rootfs_dir}: run scripts/setup first")
    (qemu_home / "templates").unlink()  # a home of our own for this one
    (qemu_home / "cache" / "rootfs").mkdir(parents=True)
    (qemu_home / "cache" / "rootfs" / rootfs_dir.name).symlink_to(rootfs_dir)
    guest = tmp_path / "guest"
    shutil.copytree(templates.GUEST_DIR, guest, ignore=shutil.ignore_patterns("__pycache__"))
    # A guest change the image cache has never seen: forces a new image (seconds, not minutes).
    (guest / "init.sh").write_text((guest / "init.sh").read_text() + f"\n# {tmp_path}\n")
    steps: list[str] = []
    info = templates.build("mini", guest_dir=guest, progress=lambda s, d: steps.append(s))
    assert "debootstrap" not in steps and "image" in steps and "boot" in steps
    assert paths().templates == qemu_home / "templates"
    assert templates.get("mini") == info
    assert (info.snapshot_dir / "state").is_file()
    steps.clear()
    assert templates.build("mini", guest_dir=guest, progress=lambda s, d: steps.append(s)) == info
    assert steps == ["done"]
    templates.remove("mini")
    with pytest.raises(TemplateNotFound):
        templates.get("mini")


def test_prune_images_keeps_the_newest_and_the_one_in_use(tmp_path: Path) -> None:
    import os

    images = tmp_path / "images"
    for i, name in enumerate(["old", "in-use", "newer", "newest"]):
        d = images / name
        d.mkdir(parents=True)
        os.utime(d, (1000 + i, 1000 + i))
    os.utime(images / "in-use", (999, 999))
    _rootfs.prune_images(tmp_path, keep=2, keep_also=images / "in-use")
    assert sorted(p.name for p in images.iterdir()) == ["in-use", "newer", "newest"]


def test_a_half_built_tree_is_removed_without_walking_into_its_mounts(tmp_path: Path) -> None:
    import os
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("needs root to bind-mount (template builds run as root too)")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep me")
    tree = tmp_path / "rootfs.tmp"
    (tree / "rootfs" / "dev").mkdir(parents=True)
    subprocess.run(["mount", "--bind", str(outside), str(tree / "rootfs" / "dev")], check=True)
    _rootfs._remove_tree(tree)
    assert not tree.exists()
    assert (outside / "precious").read_text() == "keep me"


def test_cli_template_commands(home: Path) -> None:
    import typer
    from typer.testing import CliRunner

    from torpor.cli import doctor as doctor_cli
    from torpor.cli import template as template_cli

    app = typer.Typer()
    template_cli.register(app)
    doctor_cli.register(app)
    runner = CliRunner()
    result = runner.invoke(app, ["template", "build", "--help"])
    assert result.exit_code == 0 and "torpor template build data --apt git" in result.output
    result = runner.invoke(app, ["template", "ls"])
    assert result.exit_code == 0 and "python" not in result.output
    result = runner.invoke(app, ["template", "rm", "nope"])
    assert isinstance(result.exception, TemplateNotFound)
    result = runner.invoke(app, ["template", "build", "Not Valid"])
    assert isinstance(result.exception, InvalidName)
    result = runner.invoke(app, ["doctor"], env={"TORPOR_ACCEL": "tcg"})
    assert result.exit_code == 0 and "set by TORPOR_ACCEL" in result.output
    assert "torpor template build python" in result.output  # no templates in this home


def test_cli_template_rm_refuses_a_template_sandboxes_rest_on(home: Path) -> None:
    """`torpor template rm` deleted every build, the ones paused sandboxes' disks are
    overlays on too: their disks stopped working, with no word of warning. It is refused
    while anything of the home rests on the template, unless --force."""
    import subprocess

    import typer
    from typer.testing import CliRunner

    from torpor.cli import template as template_cli
    from torpor.errors import Conflict

    build = paths().templates / "data" / "builds" / "b1" / "snapshot"
    build.mkdir(parents=True)
    base = build / "disk.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(base), "8M"], check=True)
    (paths().templates / "data" / "snapshot").symlink_to(Path("builds") / "b1" / "snapshot")
    (paths().templates / "data" / "template.json").write_text("{}")
    sandbox = paths().sandboxes / "sbx-0123456789ab"
    sandbox.mkdir(parents=True)
    overlay = ["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(base), "-F", "qcow2"]
    subprocess.run([*overlay, str(sandbox / "disk.qcow2")], check=True)
    app = typer.Typer()
    template_cli.register(app)
    runner = CliRunner()
    result = runner.invoke(app, ["template", "rm", "data"])
    assert isinstance(result.exception, Conflict)
    assert "sandboxes/sbx-0123456789ab" in str(result.exception)
    assert base.is_file()  # nothing removed
    result = runner.invoke(app, ["template", "rm", "data", "--force"])
    assert result.exit_code == 0, result.output
    assert not (paths().templates / "data").exists()


def test_a_rebuild_without_options_keeps_the_templates_recipe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`torpor template build python` again (or scripts/setup) must not drop the packages and
    machine size the template was built with; options given replace them; another name is
    another template."""
    monkeypatch.setenv("TORPOR_HOME", str(tmp_path / "home"))
    d = tmp_path / "home" / "templates" / "python"
    d.mkdir(parents=True)
    built = templates.TemplateInfo(
        name="python",
        directory=d,
        build_id="b",
        kernel=d / "k",
        initrd=d / "i",
        base_image=d / "b.qcow2",
        snapshot_dir=d / "s",
        vcpus=2,
        memory_mib=1024,
        apt=["git"],
        pip=["numpy"],
    )
    (d / "template.json").write_text(json.dumps(built.to_json()))
    assert templates.recipe("python", None, None, None, None) == (["git"], ["numpy"], 2, 1024)
    assert templates.recipe("python", ["jq"], [], None, 512) == (["jq"], [], 2, 512)
    assert templates.recipe("data", None, None, None, None) == ([], [], 1, 512)


def test_two_builds_sharing_an_image_each_get_it_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two templates of one package set (``python`` and ``python-2g``) built at once need the
    same cached image: neither may clear or convert the other's half-made files (a cached
    image converted from a half-made file system is reused by every later build)."""
    import threading
    import time

    root = tmp_path / "rootfs-key" / "rootfs"
    (root / "boot").mkdir(parents=True)
    (root / "boot" / "vmlinuz-6").write_bytes(b"kernel")
    (root / "boot" / "initrd.img-6").write_bytes(b"initrd")
    guest = tmp_path / "guest"
    guest.mkdir()
    (guest / "init.sh").write_text("#!/bin/sh\n")
    whole = b"ext4" * 4096

    def run(cmd: list[str], what: str, **_: Any) -> str:
        if cmd[0] == "mkfs.ext4":  # writes the file system a piece at a time
            with open(cmd[-1], "r+b") as f:
                for i in range(0, len(whole), 2048):
                    f.seek(i)
                    f.write(whole[i : i + 2048])
                    time.sleep(0.005)
        elif cmd[0] == "qemu-img":
            time.sleep(0.02)
            shutil.copyfile(cmd[-2], cmd[-1])
        return ""

    monkeypatch.setattr(_rootfs, "_run", run)
    monkeypatch.setattr(_rootfs, "_slim", lambda root: None)
    monkeypatch.setattr(_rootfs, "DISK_SIZE_MIB", 1)
    files = _rootfs.guest_files(guest)
    cache = tmp_path / "cache"
    start = threading.Barrier(2)
    got: list[Any] = []

    def build() -> None:
        start.wait()
        try:
            got.append(_rootfs.ensure_image(cache, root, files))
        except Exception as exc:
            got.append(exc)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(isinstance(g, Path) for g in got), got
    for image in got:
        assert (image / "base.qcow2").read_bytes()[: len(whole)] == whole
        assert (image / "vmlinuz").read_bytes() == b"kernel"


@pytest.mark.parametrize("failing", ["fsync", "replace"])
def test_a_publish_that_fails_leaves_the_template_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    """A rebuild whose template.json cannot be written (the disk full) must not leave the
    template's ``snapshot`` link on the new build while template.json names the old one: a
    wake or restore rebuilt on this node checks template.json's build and backs its disk on
    the link's. The new build's files go too."""
    import errno
    import os

    monkeypatch.setenv("TORPOR_HOME", str(tmp_path / "home"))
    image = tmp_path / "image"
    image.mkdir()
    for name in ("base.qcow2", "vmlinuz", "initrd.img"):
        (image / name).write_bytes(name.encode())
    monkeypatch.setattr(_rootfs, "ensure_rootfs", lambda *a, **kw: tmp_path / "rootfs")
    monkeypatch.setattr(_rootfs, "ensure_image", lambda *a, **kw: image)
    monkeypatch.setattr(_rootfs, "prune_images", lambda *a, **kw: None)

    async def boot(info: templates.TemplateInfo, say: Any, *, lines: bool) -> str:
        (info.snapshot_dir / "state").write_text("saved")
        return "tcg"

    monkeypatch.setattr(templates.templates, "_boot_and_snapshot", boot)
    first = templates.build("python", apt=["git"])
    link = first.directory / "snapshot"
    assert link.resolve() == first.snapshot_dir.resolve()

    real_replace = os.replace

    def full(*args: Any) -> None:
        if failing == "fsync" or Path(args[1]).name == "template.json":
            raise OSError(errno.ENOSPC, "No space left on device")
        real_replace(*args)

    monkeypatch.setattr(os, failing, full)
    with pytest.raises(StorageError):
        templates.build("python", apt=["jq"])
    monkeypatch.undo()
    monkeypatch.setenv("TORPOR_HOME", str(tmp_path / "home"))
    now = templates.get("python")
    assert now.build_id == first.build_id
    assert link.resolve() == now.snapshot_dir.resolve()
    assert [b.name for b in (first.directory / "builds").iterdir()] == [first.build_id]


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(("raw", []), id="a-list"),
        pytest.param(("raw", None), id="null"),
        pytest.param(("raw", {}), id="empty"),
        pytest.param(("raw", {"build_id": "b"}), id="fields-missing"),
        pytest.param({"directory": 5}, id="path-a-number"),
        pytest.param({"vcpus": "2"}, id="vcpus-a-string"),
        pytest.param({"apt": "git"}, id="apt-a-string"),
        pytest.param({"pip": [1]}, id="pip-not-strings"),
        pytest.param({"memory_mib": True}, id="memory-a-bool"),
    ],
)
def test_a_template_json_of_another_shape_is_a_typed_error(home: Path, body: Any) -> None:
    """template.json of another shape (hand-edited, another version's) raised raw
    AttributeError / TypeError from get() (every create and wake of the template: a 500),
    from list_templates() (`torpor template ls`, `torpor doctor`) and from a rebuild."""
    from dataclasses import replace

    for name in ("good", "bad"):
        (home / "templates" / name).mkdir(parents=True)
    good = replace(_info(home / "templates" / "good"), name="good")
    (good.directory / "template.json").write_text(json.dumps(good.to_json()))
    whole = replace(_info(home / "templates" / "bad"), name="bad").to_json()
    data = body[1] if isinstance(body, tuple) else {**whole, **body}  # raw, or fields changed
    (home / "templates" / "bad" / "template.json").write_text(json.dumps(data))
    with pytest.raises(StorageError):
        templates.get("bad")
    assert templates.list_templates() == [good]
    with pytest.raises(StorageError):
        templates.recipe("bad", None, None, None, None)


def test_a_prune_by_another_build_leaves_the_image_a_build_is_about_to_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two builds of different templates at once (no lock in common): one found its cached
    image (old: its mtime is when it was made) and, before it linked the image's files into
    its build, the other's prune kept the two newest images and deleted that one. The
    build failed (StorageError, "cannot prepare") and left its half-made build directory."""
    import os
    import threading

    monkeypatch.setenv("TORPOR_HOME", str(tmp_path / "home"))
    cache = paths().ensure().cache
    for i, key in enumerate(["mine", "other-1", "other-2", "theirs"]):
        image = cache / "images" / key
        image.mkdir(parents=True)
        for name in ("base.qcow2", "vmlinuz", "initrd.img"):
            (image / name).write_bytes(name.encode())
        os.utime(image, (1000 + i, 1000 + i))
    mine = cache / "images" / "mine"
    pruners: list[threading.Thread] = []

    def ensure_image(*a: Any, **kw: Any) -> Path:
        # the other build (template "b") prunes meanwhile, keeping its own image
        other = threading.Thread(
            target=_rootfs.prune_images, args=(cache,), kwargs={"keep_also": mine.parent / "theirs"}
        )
        other.start()
        other.join(timeout=1)
        pruners.append(other)
        return mine

    monkeypatch.setattr(_rootfs, "ensure_rootfs", lambda *a, **kw: tmp_path / "rootfs")
    monkeypatch.setattr(_rootfs, "ensure_image", ensure_image)

    async def boot(info: templates.TemplateInfo, say: Any, *, lines: bool) -> str:
        (info.snapshot_dir / "state").write_text("saved")
        return "tcg"

    monkeypatch.setattr(templates.templates, "_boot_and_snapshot", boot)
    info = templates.build("a")
    for t in pruners:
        t.join()
    assert info.base_image.read_bytes() == b"base.qcow2"
    assert templates.get("a") == info


def test_a_build_whose_files_cannot_be_placed_leaves_no_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cache on another file system than the templates (no hard link) and a disk too
    full for the copy: the build failed with StorageError but left builds/<id>/ with what
    it had copied (a base image of up to gigabytes), never used nor removed."""
    import errno
    import os

    monkeypatch.setenv("TORPOR_HOME", str(tmp_path / "home"))
    image = tmp_path / "image"
    image.mkdir()
    for name in ("base.qcow2", "vmlinuz", "initrd.img"):
        (image / name).write_bytes(name.encode())
    monkeypatch.setattr(_rootfs, "ensure_rootfs", lambda *a, **kw: tmp_path / "rootfs")
    monkeypatch.setattr(_rootfs, "ensure_image", lambda *a, **kw: image)

    def cross_device(*a: Any, **kw: Any) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    real_copy = shutil.copyfile

    def full(src: Any, dst: Any, **kw: Any) -> Any:
        if Path(src).name == "vmlinuz":  # base.qcow2 was copied
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_copy(src, dst, **kw)

    monkeypatch.setattr(os, "link", cross_device)
    monkeypatch.setattr(shutil, "copyfile", full)
    with pytest.raises(StorageError):
        templates.build("python")
    builds = tmp_path / "home" / "templates" / "python" / "builds"
    assert not builds.exists() or list(builds.iterdir()) == []


def test_an_image_that_fails_leaves_no_half_made_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A conversion that fails (the disk full) left ``images/<key>.tmp`` with the raw file
    system mkfs had filled (the whole rootfs); prune skips ``.tmp`` and another guest's
    build makes another key, so nothing ever removed it."""
    from torpor.errors import EngineError

    root = tmp_path / "rootfs-key" / "rootfs"
    (root / "boot").mkdir(parents=True)
    (root / "boot" / "vmlinuz-6").write_bytes(b"kernel")
    (root / "boot" / "initrd.img-6").write_bytes(b"initrd")
    guest = tmp_path / "guest"
    guest.mkdir()
    (guest / "init.sh").write_text("#!/bin/sh\n")

    def run(cmd: list[str], what: str, **_: Any) -> str:
        if cmd[0] == "mkfs.ext4":
            Path(cmd[-1]).write_bytes(b"ext4" * 4096)
            return ""
        raise EngineError(f"{what} failed (exit 1): No space left on device")

    monkeypatch.setattr(_rootfs, "_run", run)
    monkeypatch.setattr(_rootfs, "_slim", lambda root: None)
    monkeypatch.setattr(_rootfs, "DISK_SIZE_MIB", 1)
    cache = tmp_path / "cache"
    with pytest.raises(EngineError):
        _rootfs.ensure_image(cache, root, _rootfs.guest_files(guest))
    assert list((cache / "images").iterdir()) == []


def test_a_rootfs_whose_packages_fail_leaves_no_half_made_tree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A package apt or pip cannot install (a typo) left ``rootfs/<key>.tmp``: a copy of
    the whole base tree. The build asked again with the right name has another key, so
    nothing ever removed it."""
    import os

    from torpor.errors import EngineError

    cache = tmp_path / "cache"
    base = cache / "rootfs" / _rootfs.rootfs_key((), ()) / "rootfs"
    (base / "usr" / "bin").mkdir(parents=True)
    (base / "usr" / "bin" / "python3").write_text("")

    def chroot(root: Path, cmd: list[str], what: str) -> None:
        if "install" in cmd:
            raise EngineError(f"{what} failed (exit 100): E: Unable to locate package gti")

    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(_rootfs, "_copy_tree", lambda src, dst: shutil.copytree(src, dst))
    monkeypatch.setattr(_rootfs, "_chroot", chroot)
    with pytest.raises(EngineError, match="gti"):
        _rootfs.ensure_rootfs(cache, ["gti"], [])
    left = sorted(p.name for p in (cache / "rootfs").iterdir() if not p.name.startswith("."))
    assert left == [_rootfs.rootfs_key((), ())]
