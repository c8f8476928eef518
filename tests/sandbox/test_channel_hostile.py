"""The host's end of the channel facing a hostile or broken guest: whatever bytes the guest
writes, the host neither crashes nor hangs nor allocates without bound, and raises typed
errors. The guest here is a fake, speaking the protocol (or not) over a socket pair."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest

from torpor.config import Limits
from torpor.errors import GuestError, PathNotFound, PayloadTooLarge, TorporError
from torpor.sandbox.guest import protocol as proto
from torpor.sandbox.vm.channel import MAX_CALLS, GuestChannel

T = TypeVar("T")


class FakeGuest:
    """The guest's end of a socket pair: reads the host's frames, writes whatever it likes."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.decoder = proto.FrameDecoder()
        self.frames: list[proto.Frame] = []

    async def next_frame(self) -> proto.Frame:
        while not self.frames:
            data = await self.reader.read(1 << 16)
            assert data, "the host hung up"
            self.frames.extend(self.decoder.feed(data))
        return self.frames.pop(0)

    async def send(self, raw: bytes) -> None:
        self.writer.write(raw)
        await self.writer.drain()

    async def reply(self, req_id: int, **fields: object) -> None:
        await self.send(proto.encode_frame({"i": req_id, "t": proto.REPLY, **fields}))


def with_guest(body: Callable[[GuestChannel, FakeGuest], Awaitable[T]], **kw: object) -> T:
    """Run ``body(channel, guest)`` with a channel connected to a fake guest."""

    async def main() -> T:
        host_sock, guest_sock = socket.socketpair()
        reader, writer = await asyncio.open_unix_connection(sock=host_sock)
        channel = GuestChannel(reader, writer, **kw)  # type: ignore[arg-type]
        guest = FakeGuest(*await asyncio.open_unix_connection(sock=guest_sock))
        try:
            return await asyncio.wait_for(body(channel, guest), 10)
        finally:
            await channel.close()
            guest.writer.close()

    return asyncio.run(main())


def raw_frame(header: bytes, payload: bytes = b"") -> bytes:
    """A frame around ``header`` as given (a valid crc, whatever the JSON holds)."""
    crc = proto._crc(len(header), len(payload), header)
    return proto.PREFIX.pack(proto.MAGIC, len(header), len(payload), crc) + header + payload


def test_a_deeply_nested_header_is_skipped_and_the_channel_lives_on() -> None:
    async def body(ch: GuestChannel, guest: FakeGuest) -> None:
        task = asyncio.create_task(ch.exists("/x"))
        req = await guest.next_frame()
        deep = b'{"i":%d,"t":"reply","x":' % req.id + b"[" * 100_000 + b"]" * 100_000 + b"}"
        await guest.send(raw_frame(deep))
        await guest.reply(req.id, ok=True, result={"exists": True})
        assert await task is True

    with_guest(body)


def test_a_deeply_nested_big_result_is_a_guest_error() -> None:
    async def body(ch: GuestChannel, guest: FakeGuest) -> None:
        task = asyncio.create_task(ch.list_dir("/"))
        req = await guest.next_frame()
        await guest.send(proto.encode_frame({"i": req.id, "t": proto.DATA}, b"[" * 100_000))
        await guest.reply(req.id, ok=True, result_in_data=True)
        with pytest.raises(GuestError, match="corrupt"):
            await task
        assert not ch.closed

    with_guest(body)


@pytest.mark.parametrize(
    "data",
    [
        {"message": "clash"},
        {"exc": "not an exception"},
        {"args": 5},
        {"__class__": "x"},
        {"http_status": 200},
        [1, 2],
        "ab",
    ],
)
def test_an_error_with_hostile_data_is_still_a_typed_error(data: object) -> None:
    async def body(ch: GuestChannel, guest: FakeGuest) -> None:
        task = asyncio.create_task(ch.exists("/x"))
        req = await guest.next_frame()
        error = {"type": "PathNotFound", "message": "gone", "data": data}
        await guest.reply(req.id, ok=False, error=error)
        with pytest.raises(TorporError) as info:
            await task
        assert info.value.message == "gone"
        assert isinstance(info.value, PathNotFound | GuestError)
        assert info.value.http_status in (PathNotFound.http_status, GuestError.http_status)

    with_guest(body)


def test_output_past_the_limit_is_refused_by_the_host_too() -> None:
    # The guest enforces max_output; a hostile one does not, and the host kept every chunk
    # (a guest could fill the host's memory through one command's stdout).
    limit = 64 * 1024

    async def body(ch: GuestChannel, guest: FakeGuest) -> None:
        task = asyncio.create_task(ch.run_command("yes"))
        req = await guest.next_frame()
        chunk = proto.encode_frame({"i": req.id, "t": proto.EVENT, "s": "stdout"}, b"y" * limit)
        for _ in range(200):  # 12.5 MiB, far past the limit and any slack
            await guest.send(chunk)
        await guest.reply(req.id, ok=True, result={"exit_code": 0})
        with pytest.raises(PayloadTooLarge):
            await task
        assert (await guest.next_frame()).type == proto.CANCEL

    with_guest(body, limits=Limits(max_output_bytes=limit))


def test_calls_in_flight_at_once_are_bounded() -> None:
    # Each call frame (up to 1 MiB of body) became a task held until answered, with no
    # bound: a guest could queue any number of them behind a slow memory store.
    running = 0
    most = 0
    release = asyncio.Event()

    async def on_call(
        method: str, path: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, dict[str, str], bytes]:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await release.wait()
        running -= 1
        return 200, {}, b"ok"

    async def body(ch: GuestChannel, guest: FakeGuest) -> None:
        calls = MAX_CALLS + 50
        for cid in range(calls):
            await guest.send(
                proto.encode_frame({"i": cid, "t": proto.CALL, "method": "POST", "path": "/"})
            )
        refused = [await guest.next_frame() for _ in range(calls - MAX_CALLS)]
        assert {f.header["status"] for f in refused} == {429}
        assert most == MAX_CALLS
        release.set()
        answered = [await guest.next_frame() for _ in range(MAX_CALLS)]
        assert {f.header["status"] for f in answered} == {200}

    with_guest(body, on_call=on_call)
