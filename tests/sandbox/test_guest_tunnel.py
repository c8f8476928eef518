"""Tunnels to a port in the guest (``tunnel`` requests), served by the real guest agent run on
the host as a process and driven through GuestChannel; the "guest's server" is a socket
server in this test. The whole path (sbx.get_host) runs on QEMU in tests/client/test_ports.py.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator

import pytest

from tests.sandbox.test_guest_agent import AgentProcess, agent, run
from torpor.errors import NotFound
from torpor.sandbox.vm.channel import GuestChannel

__all__ = ["agent"]  # the fixture, imported for its name


@pytest.fixture
def upper_server() -> Iterator[int]:
    """A server on 127.0.0.1 that answers each connection with its input upper-cased, once
    the client has shut its write side."""
    srv = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                data = b""
                while chunk := conn.recv(65536):
                    data += chunk
                conn.sendall(data.upper())

    threading.Thread(target=serve, daemon=True).start()
    yield int(srv.getsockname()[1])
    srv.close()


def test_bytes_go_both_ways_in_order(agent: AgentProcess, upper_server: int) -> None:
    async def body(ch: GuestChannel) -> None:
        got = bytearray()
        done = await ch.tunnel_open("tun-1", upper_server, got.extend)
        big = b"abc" * 100_000  # several frames, in order
        for at in range(0, len(big), 7000):
            await ch.tunnel_send("tun-1", big[at : at + 7000])
        await ch.tunnel_close("tun-1")
        assert await asyncio.wait_for(done, 30) == len(big)
        assert bytes(got) == big.upper()
        with pytest.raises(NotFound):
            await ch.tunnel_send("tun-1", b"late")

    run(agent, body)


def test_a_closed_port_is_not_found(agent: AgentProcess) -> None:
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()

    async def body(ch: GuestChannel) -> None:
        with pytest.raises(NotFound, match=f"port {port}"):
            await ch.tunnel_open("tun-2", port, lambda b: None)

    run(agent, body)
