"""Defence in depth behind the guest: with a root server, QEMU runs as an unprivileged uid of
its tenant (torpor.sandbox.vm.jail), so a guest that escaped into QEMU reads nothing else.

The stand-in for an escaped guest is a process with exactly the QEMU's credentials (its uid,
its gid, no other groups, read from /proc), trying to read what it must not.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from torpor.config import QEMU_GID, QEMU_UID_BASE, make_private, paths
from torpor.sandbox.checkpoints import Checkpoints
from torpor.sandbox.manager import SandboxManager
from torpor.sandbox.vm import jail as jail_mod
from torpor.sandbox.vm.jail import Jail, can_reach, jail_for

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root + setpriv"
)


def _ids(pid: int) -> tuple[list[int], list[int], list[int]]:
    """Real/effective/saved/fs uids, gids and supplementary groups of ``pid``."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return (
        [int(x) for x in fields["Uid"].split()],
        [int(x) for x in fields["Gid"].split()],
        [int(x) for x in fields["Groups"].split()],
    )


def _as(uid: int, gid: int, *cmd: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", *cmd],
        capture_output=True,
        check=False,
    )


# -- without QEMU -------------------------------------------------------------------------------


@pytest.fixture
def open_home() -> Iterator[Path]:
    """A home QEMU can walk to (pytest's tmp_path sits below a 0700 directory)."""
    home = Path(tempfile.mkdtemp(prefix="torpor-jail-"))
    assert can_reach(home, Jail(QEMU_UID_BASE + 1)) is None
    yield home
    shutil.rmtree(home, ignore_errors=True)


@needs_root
def test_each_tenant_gets_its_own_stable_uid(open_home: Path) -> None:
    home = open_home
    a, b = jail_for(home, "acme"), jail_for(home, "globex")
    assert a is not None and b is not None
    assert a.uid != b.uid and 0 not in (a.uid, b.uid)
    assert a.gid == b.gid == QEMU_GID
    assert jail_for(home, "acme") == a  # the same uid on every start
    table = json.loads((home / "uids.json").read_text())
    assert table == {"acme": a.uid, "globex": b.uid}


@needs_root
def test_a_home_qemu_cannot_reach_runs_qemu_as_root_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o700)
    (closed / "home").mkdir()
    jail_mod._said.clear()
    with caplog.at_level(logging.WARNING, logger="torpor.sandbox.vm.jail"):
        assert jail_for(closed / "home", "acme") is None
    assert any("QEMU runs as root" in r.getMessage() for r in caplog.records)


def test_a_server_that_is_not_root_keeps_its_user(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    jail_mod._said.clear()
    with caplog.at_level(logging.INFO, logger="torpor.sandbox.vm.jail"):
        assert jail_for(tmp_path, "acme") is None
    assert any("not root" in r.getMessage() for r in caplog.records)
    assert not (tmp_path / "uids.json").exists()


@needs_root
def test_a_home_open_to_the_qemu_group_only_stays_so(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    os.chown(home, 0, QEMU_GID)
    home.chmod(0o710)
    make_private(home)
    assert stat.S_IMODE(home.stat().st_mode) == 0o710  # QEMU may walk through, no one else
    os.chown(home, 0, 0)
    make_private(home)
    assert stat.S_IMODE(home.stat().st_mode) == 0o700  # group x for any other group: closed


# -- with QEMU ----------------------------------------------------------------------------------


def _stand_in(uid: int, home: Path, own: Path, other: Path) -> None:
    """What a guest that escaped into the QEMU of ``own`` (uid ``uid``) can read."""
    gid = QEMU_GID
    # it reads its own RAM (so the refusals below are real refusals) ...
    assert _as(uid, gid, "head", "-c1", str(own / "ram")).returncode == 0
    # ... but not another tenant's sandbox, the registry or the uid table ...
    for target in (other / "ram", other / "disk.qcow2", home / "registry.db", home / "uids.json"):
        proc = _as(uid, gid, "head", "-c1", str(target))
        assert proc.returncode != 0 and b"Permission denied" in proc.stderr, target
    # ... and lists no directory of the home: not its sandboxes, not the memory store
    for listing in (home, home / "sandboxes", other, home / "memory", home / "snapshots"):
        assert _as(uid, gid, "ls", str(listing)).returncode != 0, listing
    # no local user outside the QEMU group gets into the home at all
    assert _as(65534, 65534, "ls", str(home / "sandboxes")).returncode != 0
    assert stat.S_IMODE(home.stat().st_mode) == 0o710 and home.stat().st_gid == QEMU_GID


@pytest.mark.qemu
@needs_root
def test_an_escaped_guest_reads_nothing_it_does_not_own(qemu_home: Path) -> None:
    async def main() -> dict[str, Any]:
        manager = SandboxManager(paths(qemu_home))
        await manager.start(supervise=False)
        cp = Checkpoints(manager)

        def ids(sandbox_id: str) -> tuple[list[int], list[int], list[int]]:
            pid = manager.engine.inspect(manager.directory(sandbox_id)).qemu_pid
            assert pid is not None
            return _ids(pid)

        try:
            drive = cp.drives.create("shared", tenant="acme")
            a = await cp.create(tenant="acme", drives=[{"drive": drive.id, "path": "/shared"}])
            b = await manager.create(tenant="globex")
            out = await manager.run_command(a.id, "echo from-a > /shared/note", tenant="acme")
            assert out.exit_code == 0, out.stderr
            got: dict[str, Any] = {"a": ids(a.id), "b": ids(b.id)}
            _stand_in(got["a"][0][0], qemu_home, manager.directory(a.id), manager.directory(b.id))
            # pause, wake, a snapshot and its restore still work under the jail
            await manager.pause(a.id, tenant="acme")
            await manager.resume(a.id, tenant="acme")
            snap = await cp.snapshot(a.id, tenant="acme")
            c = await cp.restore(snap.id, tenant="acme")
            got["c"] = ids(c.id)
            got["restored"] = await manager.read_file(c.id, "/etc/hostname", tenant="acme")
            got["drive"] = cp.drives.directory(drive.id)
            return got
        finally:
            for info in await manager.list(tenant="acme") + await manager.list(tenant="globex"):
                await manager.kill(info.id, tenant=info.tenant)
            await manager.close(pause=False)

    got = asyncio.run(main())
    (uids_a, gids_a, groups_a), (uids_b, _, _) = got["a"], got["b"]
    assert 0 not in uids_a and len(set(uids_a)) == 1  # real, effective, saved, fs: all dropped
    assert set(gids_a) == {QEMU_GID} and groups_a == []
    assert uids_a[0] != uids_b[0]  # another tenant, another uid
    assert got["c"][0] == uids_a  # the tenant's restored sandbox: the tenant's uid
    assert got["restored"]
    # what QEMU wrote into the drive belongs to the tenant's uid (its other sandboxes read it)
    assert (got["drive"] / "note").stat().st_uid == uids_a[0]
