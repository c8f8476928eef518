"""Reaching a port in a real sandbox from the host (marked qemu): ``sbx.get_host(8000)``,
through the local server and the guest channel, across a pause and wake; and the network
policy (``internet=``) as the VM and the guest see it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import torpor
from torpor.sandbox.models import SandboxState

pytestmark = pytest.mark.qemu


@pytest.fixture
def served_home(qemu_home: Path) -> Iterator[Path]:
    """``qemu_home`` with the real local server (auto-started by the SDK); stopped after."""
    from tests.served import stop_server_and_vms

    yield qemu_home
    stop_server_and_vms(qemu_home)


def _get(url: str, timeout: float = 60.0) -> httpx.Response:
    """GET ``url``, retrying while the guest's server is still starting."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return httpx.get(url, timeout=30)
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_get_host_reaches_a_server_in_the_sandbox(served_home: Path) -> None:
    rt = torpor.Runtime(home=served_home)
    sbx = torpor.Sandbox.create(name="web", runtime=rt)
    try:
        sbx.files.write("/workspace/site/index.html", "hello from the sandbox\n")
        sbx.commands.start("cd /workspace/site && python3 -m http.server 8000")
        host = sbx.get_host(8000)
        assert host.startswith("127.0.0.1:") and host != "127.0.0.1:8000"
        assert _get(f"http://{host}/index.html").text == "hello from the sandbox\n"
        assert sbx.get_host(8000) == host  # one listener per port
        # a pause keeps the address; the next connection wakes the sandbox
        assert sbx.pause().state is SandboxState.PAUSED
        assert _get(f"http://{host}/index.html").text == "hello from the sandbox\n"
        assert sbx.info.state is SandboxState.RUNNING
        # a port nobody listens on: the connection is closed, nothing else breaks
        closed = sbx.get_host(8001)
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://{closed}/", timeout=30)
    finally:
        sbx.kill()
    with pytest.raises(httpx.ConnectError):  # killing the sandbox closed its listeners
        httpx.get(f"http://{host}/", timeout=10)
