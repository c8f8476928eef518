"""The host listeners for ports in a sandbox (:mod:`torpor.sandbox.manager.forwards`), with a
fake guest behind a real GuestChannel: what the guest's side sends cannot pile up on the host
without bound. The whole path runs on QEMU in tests/client/test_ports.py."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Any

import pytest

from tests.sandbox.test_channel_hostile import FakeGuest
from torpor.sandbox.guest import protocol as proto
from torpor.sandbox.manager import forwards as forwards_module
from torpor.sandbox.manager.forwards import Forwards
from torpor.sandbox.vm.channel import GuestChannel


class _Manager:
    """Opens every tunnel over one channel to a fake guest."""

    def __init__(self, channel: GuestChannel) -> None:
        self.channel = channel
        self.writers: list[Any] = []

    async def open_tunnel(
        self,
        id_or_name: str,
        port: int,
        tunnel_id: str,
        on_data: Callable[[bytes], object],
        *,
        tenant: str = "default",
    ) -> tuple[Any, asyncio.Task[int]]:
        self.writers.append(getattr(on_data, "__self__", None))
        return self.channel, await self.channel.tunnel_open(tunnel_id, port, on_data)  # type: ignore[arg-type]


def test_a_guest_sending_faster_than_the_client_reads_is_cut_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every byte the guest's side sent was written to the host's client at once: a client
    # that does not read (or reads slowly) let a guest pile up host memory without bound.
    limit = 1 << 20
    monkeypatch.setattr(forwards_module, "MAX_BACKLOG", limit)

    async def main() -> None:
        host_sock, guest_sock = socket.socketpair()
        reader, writer = await asyncio.open_unix_connection(sock=host_sock)
        channel = GuestChannel(reader, writer)
        guest = FakeGuest(*await asyncio.open_unix_connection(sock=guest_sock))
        manager = _Manager(channel)
        forwards = Forwards(manager)
        try:
            fwd = await forwards.expose("sbx", "default", 8000)
            client = socket.create_connection(("127.0.0.1", fwd.host_port))
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # and never read
            req = await asyncio.wait_for(guest.next_frame(), 10)
            assert req.header["op"] == "tunnel"
            await guest.send(
                proto.encode_frame({"i": req.id, "t": proto.EVENT, "s": "started"}, b"")
            )
            chunk = proto.encode_frame(
                {"i": req.id, "t": proto.EVENT, "s": "data"}, b"x" * proto.CHUNK
            )
            most = 0
            for _ in range(128):  # 32 MiB
                await guest.send(chunk)
                await asyncio.sleep(0)
                for w in manager.writers:
                    if w is not None and w.transport is not None:
                        most = max(most, w.transport.get_write_buffer_size())
            assert most <= 2 * limit, f"{most} bytes wait on the host for the client"
            # the tunnel is dropped: the guest is told to stop sending
            frame = await asyncio.wait_for(guest.next_frame(), 10)
            while frame.header.get("op") == "tunnel_close":  # the client's side went first
                frame = await asyncio.wait_for(guest.next_frame(), 10)
            assert frame.header == {"i": req.id, "t": proto.CANCEL}
            client.close()
        finally:
            await forwards.close_all()
            await channel.close()
            guest.writer.close()

    asyncio.run(main())


def test_a_client_that_reads_gets_every_byte_then_eof() -> None:
    async def main() -> None:
        host_sock, guest_sock = socket.socketpair()
        reader, writer = await asyncio.open_unix_connection(sock=host_sock)
        channel = GuestChannel(reader, writer)
        guest = FakeGuest(*await asyncio.open_unix_connection(sock=guest_sock))
        forwards = Forwards(_Manager(channel))
        try:
            fwd = await forwards.expose("sbx", "default", 8000)
            c_reader, c_writer = await asyncio.open_connection("127.0.0.1", fwd.host_port)
            received = asyncio.create_task(c_reader.read())
            req = await asyncio.wait_for(guest.next_frame(), 10)
            await guest.send(
                proto.encode_frame({"i": req.id, "t": proto.EVENT, "s": "started"}, b"")
            )
            sent = 0
            for n in range(32):  # 8 MiB
                data = bytes([n]) * proto.CHUNK
                sent += len(data)
                await guest.send(
                    proto.encode_frame({"i": req.id, "t": proto.EVENT, "s": "data"}, data)
                )
            await guest.reply(req.id, ok=True, result={"bytes": 0})
            got = await asyncio.wait_for(received, 10)
            assert len(got) == sent and got[-1] == 31
            c_writer.close()
        finally:
            await forwards.close_all()
            await channel.close()
            guest.writer.close()

    asyncio.run(main())
