"""A hostile guest against the host, through what it shares with it (marked qemu).

Guest root owns its machine, not the host: nothing a guest writes into a drive (virtio-9p) may
become host ownership, a setuid or exec bit, a symlink or a device node on the host.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
from pathlib import Path

import pytest

from torpor.config import paths
from torpor.sandbox.checkpoints import Checkpoints
from torpor.sandbox.manager import SandboxManager

pytestmark = pytest.mark.qemu

# What a guest root would do to leave a root shell for any host user to run.
PLANT = """
set -e
cp /bin/bash /shared/rootsh
chown 0:0 /shared/rootsh
chmod 4755 /shared/rootsh
mkdir /shared/bin && chmod 6777 /shared/bin
ln -s /etc/shadow /shared/shadow-link
mknod /shared/disk b 254 0
chmod 4755 /shared/disk
stat -c '%a %u %F' /shared/rootsh /shared/disk
"""


def test_a_guest_cannot_plant_setuid_or_devices_on_the_host(qemu_home: Path) -> None:
    async def main() -> tuple[str, Path]:
        manager = SandboxManager(paths(qemu_home))
        await manager.start(supervise=False)
        cp = Checkpoints(manager)
        try:
            drive = cp.drives.create("shared")
            sbx = await cp.create(drives=[{"drive": drive.id, "path": "/shared"}])
            result = await manager.run_command(sbx.id, PLANT, timeout=60)
            assert result.exit_code == 0, result.stderr
            return result.stdout, cp.drives.directory(drive.id)
        finally:
            for info in await manager.list():
                await manager.kill(info.id)
            await manager.close(pause=False)

    guest_view, host_dir = asyncio.run(main())
    # QEMU's user: the tenant's own uid when the server is root (torpor.sandbox.vm.jail)
    uids = qemu_home / "uids.json"
    qemu_uid = json.loads(uids.read_text())["default"] if uids.exists() else os.getuid()
    # inside the guest the files look as the guest made them (mapped in xattrs) ...
    assert guest_view.split("\n")[:2] == ["4755 0 regular file", "4755 0 block special file"]
    # ... while on the host nothing the guest wrote is privileged, executable or special
    assert stat.S_IMODE(host_dir.stat().st_mode) == 0o700
    for entry in host_dir.iterdir():
        st = entry.lstat()
        assert st.st_uid == qemu_uid, entry  # QEMU's user, never the guest's chown
        assert not st.st_mode & (stat.S_ISUID | stat.S_ISGID), entry
        assert not stat.S_ISLNK(st.st_mode) and not stat.S_ISBLK(st.st_mode), entry
        if entry.is_dir():
            assert stat.S_IMODE(st.st_mode) == 0o700, entry
        else:
            assert stat.S_IMODE(st.st_mode) & 0o777 == 0o600, entry
    assert (host_dir / "shadow-link").read_text() == "/etc/shadow"  # a file holding the target
