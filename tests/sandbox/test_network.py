"""The network policy of a sandbox (``internet=``): the host's switch, the refusal, the QEMU
command line; and on real QEMU (marked qemu) what the guest sees with the internet off and on.

There is no internet on the test machine, so "on" is shown by what user-mode networking does
reach: the host's loopback, as 10.0.2.2 (which is also why it is off unless the operator
allows it); "off" by that same connection failing with no route, and no network device.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from torpor.config import internet_allowed, paths
from torpor.errors import Conflict, InvalidArgument
from torpor.sandbox.manager import SandboxManager
from torpor.sandbox.manager.sandboxes import _internet_policy
from torpor.sandbox.requests import SandboxOptions
from torpor.sandbox.vm.machine_dir import add_nic, build_command, has_nic

_CONFIG = {
    "version": 1,
    "machine": "pc",
    "accel": "tcg",
    "vcpus": 1,
    "memory_mib": 512,
    "kernel": "vmlinuz",
    "initrd": "initrd.img",
    "append": "",
    "devices": [],
}


@pytest.mark.parametrize(
    ("env", "wanted", "expected"),
    [
        pytest.param(None, None, False, id="default-off"),
        pytest.param(None, False, False, id="off-asked-off"),
        pytest.param("1", None, True, id="allowed-default-on"),
        pytest.param("yes", False, False, id="allowed-asked-off"),
        pytest.param("true", True, True, id="allowed-asked-on"),
        pytest.param("0", None, False, id="explicitly-not-allowed"),
    ],
)
def test_policy(
    env: str | None, wanted: bool | None, expected: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if env is None:
        monkeypatch.delenv("TORPOR_ALLOW_INTERNET", raising=False)
    else:
        monkeypatch.setenv("TORPOR_ALLOW_INTERNET", env)
    assert _internet_policy(wanted) is expected


def test_asking_for_what_the_host_forbids_is_refused_before_anything_is_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.sandbox.fakes import FakeEngine

    monkeypatch.delenv("TORPOR_ALLOW_INTERNET", raising=False)
    assert not internet_allowed()

    async def main() -> None:
        m = SandboxManager(paths(tmp_path), engine=FakeEngine())
        await m.start(supervise=False)
        with pytest.raises(InvalidArgument, match="TORPOR_ALLOW_INTERNET=1"):
            await m.create(name="net", internet=True)
        assert await m.list() == []
        await m.close()

    asyncio.run(main())
    assert SandboxOptions.of(internet=False).internet is False


def test_the_command_line_has_a_user_network_only_with_a_card() -> None:
    config = {**_CONFIG, "devices": []}
    assert not has_nic(config)
    assert not any("netdev" in a or "virtio-net" in a for a in build_command(config, incoming=True))
    add_nic(config)
    assert has_nic(config)
    cmd = build_command(config, incoming=True)
    assert cmd[cmd.index("-netdev") + 1] == "user,id=net-nic0"
    assert any(a.startswith("virtio-net-pci,id=nic0,netdev=net-nic0") for a in cmd)
    with pytest.raises(InvalidArgument):
        add_nic(config)  # one card at most


@pytest.fixture
def host_server() -> Iterator[int]:
    """A TCP server on the host's 127.0.0.1 that says "host" to whoever connects."""
    srv = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                conn.sendall(b"host\n")

    threading.Thread(target=serve, daemon=True).start()
    yield int(srv.getsockname()[1])
    srv.close()


_DIAL = (
    'python3 -c "import socket,sys\n'
    "try:\n"
    "    s = socket.create_connection(('10.0.2.2', {port}), timeout=10)\n"
    "    print(s.recv(10).decode().strip())\n"
    "except OSError as e:\n"
    "    print('failed', e.errno)\""
)


@pytest.mark.qemu
def test_internet_off_and_on_in_the_guest(
    qemu_home: Path, host_server: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    monkeypatch.setenv("TORPOR_ALLOW_INTERNET", "1")

    async def main() -> None:
        m = SandboxManager(paths(qemu_home))
        await m.start(supervise=False)
        try:
            off = await m.create(name="offline", internet=False)
            assert off.internet is False and (await m.get(off.id)).internet is False
            links = await m.run_command(off.id, "ls /sys/class/net")
            assert links.stdout.split() == ["lo"]
            dial = await m.run_command(off.id, _DIAL.format(port=host_server))
            assert dial.stdout.strip() == f"failed {errno.ENETUNREACH}"
            on = await m.create(name="online")  # the host allows it: on by default
            assert on.internet is True and (await m.get(on.id)).internet is True
            route = await m.run_command(on.id, "ip route show default")
            assert "via 10.0.2.2" in route.stdout
            assert (await m.run_command(on.id, _DIAL.format(port=host_server))).stdout == "host\n"
            # the card is on the command line of every wake, and the guest keeps its setup
            await m.pause(on.id)
            again = await m.run_command(on.id, _DIAL.format(port=host_server))
            assert again.stdout == "host\n"
            with pytest.raises(Conflict, match="internet"):
                await m.get_or_create("online", internet=False)
        finally:
            for info in await m.list():
                await m.kill(info.id)
            await m.close(pause=False)

    asyncio.run(main())
