"""The local server starts on demand, once, and owns its home alone (real processes, no VMs)."""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from torpor.client import AsyncRuntime, AsyncSandbox, Runtime, Sandbox
from torpor.errors import SandboxNotFound, ServerUnavailable
from torpor.sandbox.models import SandboxInfo
from torpor.server.daemon import server_pid, stop_server

PROBE = (
    "import sys; from torpor.client import Runtime; "
    "print(Runtime(home=sys.argv[1]).health()['pid'])"
)


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    home = tmp_path / "h"
    yield home
    pid = server_pid(home)
    if pid is not None:  # never leave a server behind, even when a test failed
        try:
            stop_server(home, timeout=30)
        except ServerUnavailable:
            os.kill(pid, signal.SIGKILL)


def _probe(home: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", PROBE, str(home)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_concurrent_clients_start_exactly_one_server(home: Path) -> None:
    procs = [_probe(home) for _ in range(4)]
    pids = set()
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
        pids.add(int(out.strip()))
    assert len(pids) == 1
    (pid,) = pids
    assert server_pid(home) == pid
    assert stat.S_IMODE((home / "server.sock").stat().st_mode) == 0o600

    second = subprocess.run(
        [sys.executable, "-m", "torpor.cli", "serve"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TORPOR_HOME": str(home)},
    )
    assert second.returncode == 1
    assert "Conflict" in second.stderr and str(pid) in second.stderr
    assert Runtime(home=home, autostart=False).health()["pid"] == pid  # still serving

    assert stop_server(home, timeout=60) == pid
    assert server_pid(home) is None and not (home / "server.sock").exists()


def test_a_killed_server_is_replaced_on_the_next_call(home: Path) -> None:
    first = Runtime(home=home).health()["pid"]
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while server_pid(home) is not None:  # the lock dies with the process
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert (home / "server.sock").exists()  # stale socket left behind
    second = Runtime(home=home).health()["pid"]
    assert second != first and server_pid(home) == second


def test_a_streamed_first_call_starts_the_server(home: Path) -> None:
    rt = Runtime(home=home)
    info = SandboxInfo.model_validate(
        {
            "id": "ghost",
            "name": "ghost",
            "template": "python",
            "state": "running",
            "created_at": 0,
            "last_active_at": 0,
        }
    )
    with pytest.raises(SandboxNotFound):
        Sandbox(info, rt).commands.run("echo hi", on_stdout=print)
    assert server_pid(home) == rt.health()["pid"]


def test_an_async_streamed_first_call_starts_the_server(home: Path) -> None:
    """The sync client started the server for a streamed call; the async one raised
    ServerUnavailable."""
    info = SandboxInfo.model_validate(
        {
            "id": "ghost",
            "name": "ghost",
            "template": "python",
            "state": "running",
            "created_at": 0,
            "last_active_at": 0,
        }
    )

    async def main() -> None:
        async with AsyncRuntime(home=home) as rt:
            with pytest.raises(SandboxNotFound):
                await AsyncSandbox(info, rt).commands.run("echo hi", on_stdout=print)
            assert server_pid(home) == (await rt.health())["pid"]

    asyncio.run(main())


def test_the_started_server_runs_this_processs_torpor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From a source tree, the child's PYTHONPATH leads with that tree: the server imports
    the code its starter runs, not another installed copy (or none)."""
    import torpor
    from torpor.client import _local
    from torpor.config import Paths

    started: list[dict[str, str]] = []

    class Exited:
        returncode = 1

        def poll(self) -> int:
            return 1

    def popen(args: list[str], **kw: object) -> Exited:
        started.append(kw["env"])  # type: ignore[arg-type]
        return Exited()

    monkeypatch.setattr("torpor.client._local.subprocess.Popen", popen)
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    with pytest.raises(ServerUnavailable):
        _local.ensure_local_server(Paths(tmp_path / "h"), timeout=5)
    tree = Path(torpor.__file__).resolve().parents[1]
    assert tree.name not in ("site-packages", "dist-packages")  # the tests run a checkout
    assert started[0]["PYTHONPATH"].split(os.pathsep) == [str(tree), "/elsewhere"]
