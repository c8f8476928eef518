"""The async stored-resource and process handles: ``AsyncSnapshot``, ``AsyncVolume``,
``AsyncDrive`` and ``AsyncProcessHandle``.

Snapshots, volumes and drives go through a real uvicorn server over the real SandboxManager
with the manager's fake engine (no VMs); restoring and forking a snapshot wake a machine
from it, which tests/client/test_aio_sandbox.py does in a real VM. The process handle runs its guest
scripts with this machine's /bin/sh through an async stand-in sandbox (as
tests/client/test_processes.py does for the sync one); tests/client/test_aio_sandbox.py runs
it in a real VM.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import uvicorn

import torpor
from tests.sandbox.fakes import FakeEngine
from tests.sandbox.storage_helpers import make_home
from torpor.client import processes
from torpor.client.aio_sandbox import AsyncSnapshot
from torpor.client.aio_storage import AsyncDrive, AsyncVolume, collect_garbage
from torpor.client.processes import AsyncProcessHandle, ProcessHandle
from torpor.client.sandbox import Snapshot
from torpor.client.storage import Drive, Volume
from torpor.config import Paths
from torpor.errors import (
    DriveNotFound,
    InvalidArgument,
    NotFound,
    OperationTimeout,
    PathNotFound,
    SnapshotNotFound,
    VolumeNotFound,
)
from torpor.sandbox.manager import SandboxManager
from torpor.sandbox.models import CommandResult
from torpor.server.app import create_app
from torpor.server.daemon import bind_unix_socket


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Paths]:
    """A real server (real manager, fake engine) on the home's unix socket."""
    p = make_home(tmp_path)
    manager = SandboxManager(p, engine=FakeEngine())
    app = create_app(manager, supervise=False, memory_embedder=None)
    sock = bind_unix_socket(p.socket)
    server = uvicorn.Server(uvicorn.Config(app, lifespan="on", log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    try:
        yield p
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def test_the_async_handles_have_the_sync_handles_shape() -> None:
    pairs = [
        (AsyncVolume, Volume),
        (AsyncDrive, Drive),
        (AsyncSnapshot, Snapshot),
        (AsyncProcessHandle, ProcessHandle),
    ]
    for mine, theirs in pairs:
        public = {n for n in dir(theirs) if not n.startswith("_")}
        assert public <= set(dir(mine)), (mine, public - set(dir(mine)))
        for name in public:
            sync = getattr(theirs, name)
            if not callable(sync) or isinstance(inspect.getattr_static(theirs, name), property):
                continue
            made = getattr(mine, name)
            assert inspect.iscoroutinefunction(made), (mine, name)
            wanted = [p for p in inspect.signature(sync).parameters if p not in ("self", "cls")]
            got = [p for p in inspect.signature(made).parameters if p not in ("self", "cls")]
            assert got == wanted, (mine, name)


def test_volumes_and_drives_through_a_server(home: Paths) -> None:
    async def main() -> None:
        async with torpor.AsyncRuntime(home=home.home, autostart=False) as rt:
            vol = await torpor.AsyncVolume.create("memory-u-42", size_mib=16, runtime=rt)
            assert isinstance(vol, AsyncVolume) and vol.info.size_mib == 16
            assert [v.id for v in await AsyncVolume.list(runtime=rt)] == [vol.id]
            assert (await AsyncVolume.get("memory-u-42", runtime=rt)).id == vol.id
            with pytest.raises(PathNotFound):
                await vol.read_file("/nothing-here")
            with pytest.raises(InvalidArgument):  # a directory
                await vol.read_file("/")
            with pytest.raises(InvalidArgument):  # refused before anything is sent
                await AsyncVolume.create("memory-u-43", size_mib=0, runtime=rt)
            await vol.delete()
            with pytest.raises(VolumeNotFound):
                await AsyncVolume.get(vol.id, runtime=rt)

            drive = await torpor.AsyncDrive.create("research", runtime=rt)
            assert [d.name for d in await AsyncDrive.list(runtime=rt)] == ["research"]
            # labels given at create, and lists filtered by them
            mine = await AsyncVolume.create(
                "v-42", size_mib=16, labels={"user": "u-42"}, runtime=rt
            )
            await AsyncDrive.create("d-42", labels={"user": "u-42", "team": "a"}, runtime=rt)
            assert mine.info.labels == {"user": "u-42"}
            assert [v.id for v in await AsyncVolume.list({"user": "u-42"}, runtime=rt)] == [mine.id]
            assert await AsyncVolume.list({"user": "u-7"}, runtime=rt) == []
            assert [d.name for d in await AsyncDrive.list({"team": "a"}, runtime=rt)] == ["d-42"]
            await mine.delete()
            await (await AsyncDrive.get("d-42", runtime=rt)).delete()
            assert (await AsyncDrive.get(drive.id, runtime=rt)).name == "research"
            await drive.delete()
            with pytest.raises(DriveNotFound):
                await AsyncDrive.get("research", runtime=rt)

    asyncio.run(main())


def test_snapshots_through_a_server(home: Paths) -> None:
    async def main() -> None:
        async with torpor.AsyncRuntime(home=home.home, autostart=False) as rt:
            sbx = await rt.sandboxes.create(name="src", labels={"user": "u-42"})
            snap = await sbx.snapshot("before-upgrade", retention_days=3)
            assert isinstance(snap, AsyncSnapshot) and snap.name == "before-upgrade"
            assert [s.id for s in await AsyncSnapshot.list(runtime=rt)] == [snap.id]
            assert (await AsyncSnapshot.get("before-upgrade", runtime=rt)).id == snap.id
            info = await snap.set_retention(30)
            assert info.retention_days == 30 and snap.info.retention_days == 30
            with pytest.raises(InvalidArgument):
                await snap.set_retention(0)
            # (restore and fork wake machines: the fake engine cannot, the qemu test does)
            await snap.delete()
            with pytest.raises(SnapshotNotFound):
                await AsyncSnapshot.get(snap.id, runtime=rt)
            report = await collect_garbage(dry_run=True, runtime=rt)
            assert isinstance(report, dict)

    asyncio.run(main())


# -- processes, on this machine's shell ----------------------------------------------------------


class _Commands:
    async def run(self, cmd: str, *, timeout: float | None = None) -> CommandResult:
        proc = await asyncio.create_subprocess_exec(
            "sh", "-c", cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise OperationTimeout(f"timed out after {timeout} s") from None
        assert proc.returncode is not None
        return CommandResult(exit_code=proc.returncode, stdout=out.decode(), stderr=err.decode())


class _Files:
    async def exists(self, path: str) -> bool:
        return os.path.exists(path)

    async def read(self, path: str) -> bytes:
        return Path(path).read_bytes()


class LocalAsyncSandbox:
    """What AsyncProcessHandle uses of an AsyncSandbox, on this machine."""

    def __init__(self) -> None:
        self.commands = _Commands()
        self.files = _Files()


def test_async_process_handle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(processes, "PROCS_DIR", str(tmp_path / "procs"))
    sbx = cast(Any, LocalAsyncSandbox())

    async def main() -> None:
        p = await processes.start_async(sbx, 'read line; echo "got $line"; echo oops >&2; exit 7')
        listed = await processes.list_processes_async(sbx)
        assert [(i.pid, i.cmd) for i in listed] == [(p.pid, p.cmd)]
        assert await p.exit_code() is None
        await p.send_stdin("hello $HOME\n")
        result = await p.wait(timeout=10)
        assert (result.exit_code, result.stdout, result.stderr) == (
            7,
            "got hello $HOME\n",
            "oops\n",
        )
        assert await processes.list_processes_async(sbx) == []
        assert [i.pid for i in await processes.list_processes_async(sbx, include_exited=True)] == [
            p.pid
        ]
        assert await p.read_from(4) == "hello $HOME\n"
        assert await p.read_bytes_from(4, 5) == b"hello"

        slow = await processes.start_async(sbx, "sleep 300")
        with pytest.raises(OperationTimeout):
            await slow.wait(timeout=0.5)
        again = AsyncProcessHandle(sbx, slow.pid)  # a handle from another session
        assert await again.kill() is True
        assert (await again.wait(timeout=10)).exit_code == 137
        assert await again.kill() is False

        await p.forget()
        with pytest.raises(NotFound):
            await p.output()
        with pytest.raises(InvalidArgument):
            await processes.start_async(sbx, "  ")

    asyncio.run(main())
