"""The host's end of the channel facing a hostile or broken guest: whatever bytes the guest
writes, the host neither crashes nor hangs nor allocates without bound, and raises typed
errors. The guest here is a fake, speaking the protocol (or not) over a socket pair."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import pytest

from torpor.config import Limits
from torpor.errors import GuestError, OperationTimeout, PathNotFound, PayloadTooLarge, TorporError
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


def _answered(
    call: Callable[[GuestChannel], Coroutine[Any, Any, object]], result: object
) -> object:
    """What ``call`` returns (or raises) when the guest answers its request with ``result``."""

    async def body(ch: GuestChannel, guest: FakeGuest) -> object:
        task = asyncio.create_task(call(ch))
        req = await guest.next_frame()
        await guest.reply(req.id, ok=True, result=result)
        try:
            return await task
        finally:
            assert not ch.closed

    return with_guest(body)


@pytest.mark.parametrize(
    ("call", "result"),
    [
        (lambda ch: ch.run_code("1"), {"results": [1]}),
        (lambda ch: ch.run_code("1"), {"results": "ab"}),
        (lambda ch: ch.run_code("1"), {"results": [{"data": 1}]}),
        (lambda ch: ch.run_code("1"), {"error": [1]}),
        (lambda ch: ch.run_code("1"), {"error": {"name": 1}}),
        (lambda ch: ch.run_command("true"), {"exit_code": "x"}),
        (lambda ch: ch.run_command("true"), {"exit_code": [1]}),
        (lambda ch: ch.run_command("true"), {"exit_code": float("inf")}),
        (lambda ch: ch.run_command("true"), {"exit_code": 0, "pid": "x"}),
        (lambda ch: ch.list_dir("/"), {"entries": [1]}),
        (lambda ch: ch.list_dir("/"), {"entries": 5}),
        (lambda ch: ch.list_dir("/"), {"entries": [{"name": "a"}]}),
    ],
)
def test_a_malformed_result_is_a_guest_error(
    call: Callable[[GuestChannel], Coroutine[Any, Any, object]], result: object
) -> None:
    # The host built its models from the guest's JSON unchecked: a result of the wrong shape
    # escaped as a raw TypeError / ValueError / pydantic ValidationError (a 500 over HTTP).
    with pytest.raises(GuestError, match="malformed"):
        _answered(call, result)


def test_well_formed_results_still_parse() -> None:
    execution = _answered(
        lambda ch: ch.run_code("1"),
        {
            "results": [{"data": {"text/plain": "1"}, "extra": True}],
            "error": {"name": "E", "value": "v", "traceback": "t"},
        },
    )
    assert execution.text == "1" and execution.error.name == "E"  # type: ignore[attr-defined]
    result = _answered(lambda ch: ch.run_command("true"), {"exit_code": None, "pid": 7})
    assert (result.exit_code, result.pid) == (-1, 7)  # type: ignore[attr-defined]
    entries = _answered(
        lambda ch: ch.list_dir("/"),
        {"entries": [{"name": "a", "path": "/a", "type": "file", "size": 1}]},
    )
    assert [e.name for e in entries] == ["a"]  # type: ignore[attr-defined]


def test_a_terminal_whose_pid_is_no_number_fails_to_open_and_is_cancelled() -> None:
    # int(pid) raised in the event handler (logged), and pty_open waited for the guest to end.
    async def body(ch: GuestChannel, guest: FakeGuest) -> None:
        opened = asyncio.create_task(ch.pty_open("p1", "bash", lambda b: None))
        req = await guest.next_frame()
        await guest.send(
            proto.encode_frame({"i": req.id, "t": proto.EVENT, "s": "started"}, b"\xffabc")
        )
        with pytest.raises(GuestError, match="malformed"):
            await opened
        assert (await guest.next_frame()).header == {"i": req.id, "t": proto.CANCEL}

    with_guest(body)


@pytest.mark.parametrize("code", ["x", [1], 1.5])
def test_a_terminal_whose_exit_code_is_no_number_ends_with_a_guest_error(code: object) -> None:
    # int(exit_code) raised a raw ValueError / TypeError out of the session's done task.
    async def body(ch: GuestChannel, guest: FakeGuest) -> None:
        opened = asyncio.create_task(ch.pty_open("p1", "bash", lambda b: None))
        req = await guest.next_frame()
        await guest.send(proto.encode_frame({"i": req.id, "t": proto.EVENT, "s": "started"}, b"7"))
        pid, done = await opened
        assert pid == 7
        await guest.reply(req.id, ok=True, result={"exit_code": code})
        with pytest.raises(GuestError, match="malformed"):
            await done

    with_guest(body)


@pytest.mark.parametrize("how", ["close", "hang_up"])
def test_a_guest_call_being_answered_ends_with_its_channel(how: str) -> None:
    # close() and a hang-up failed the host's requests but left the guest's calls running:
    # a slow memory call went on for a guest that could never get its answer (past a pause,
    # a kill, the manager's close) and was never awaited.
    started = asyncio.Event()
    ended: list[str] = []

    async def on_call(
        method: str, path: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, dict[str, str], bytes]:
        started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            ended.append("cancelled")
            raise
        return 200, {}, b"ok"

    async def body(ch: GuestChannel, guest: FakeGuest) -> None:
        await guest.send(proto.encode_frame({"i": 1, "t": proto.CALL, "method": "POST"}))
        await started.wait()
        if how == "close":
            await ch.close()
        else:
            guest.writer.close()
            while not ch.closed:
                await asyncio.sleep(0.01)
        for _ in range(100):
            if ended:
                break
            await asyncio.sleep(0.01)
        assert ended == ["cancelled"]

    with_guest(body, on_call=on_call)


def test_output_under_names_of_the_guests_choosing_is_not_kept() -> None:
    # An event's stream name came from the guest's header and became a key of the request's
    # decoders and streams; an empty payload counted nothing against the output limit, so a
    # guest could keep up to 1 MiB of name per frame, without bound, while a command ran.
    async def body(ch: GuestChannel, guest: FakeGuest) -> None:
        task = asyncio.create_task(ch.run_command("true"))
        req = await guest.next_frame()
        (pending,) = ch._pending.values()
        for n in range(64):
            name = f"{n}".ljust(256 * 1024, "x")
            await guest.send(proto.encode_frame({"i": req.id, "t": proto.EVENT, "s": name}))
        await guest.send(proto.encode_frame({"i": req.id, "t": proto.EVENT, "s": "x"}, b"hi"))
        await guest.send(proto.encode_frame({"i": req.id, "t": proto.EVENT, "s": "stdout"}, b"out"))
        await asyncio.sleep(0.05)
        assert set(pending.decoders) | set(pending.streams) <= {"stdout", "stderr"}
        await guest.reply(req.id, ok=True, result={"exit_code": 0})
        result = await task
        assert (result.stdout, result.stderr) == ("out", "")

    with_guest(body)


def test_close_does_not_wait_for_a_guest_that_stopped_reading() -> None:
    # close() waited for the host's unsent bytes to reach the guest: a guest that stopped
    # reading its port held a pause or a kill (which closes the channel before QEMU goes)
    # for ever.
    async def body(ch: GuestChannel, guest: FakeGuest) -> None:
        with pytest.raises(OperationTimeout):
            await ch.write_file("/x", b"a" * (8 << 20))  # the guest reads none of it
        try:
            await asyncio.wait_for(ch.close(), 5)
        finally:
            guest.writer.close()  # (what ended the old close)

    with_guest(body, op_timeout=0.5)


def _unread(ch: GuestChannel) -> int:
    """Bytes the host has written for the guest that the guest has not read yet."""
    transport = ch._writer.transport
    return int(transport.get_write_buffer_size())


def test_answers_a_guest_does_not_read_do_not_pile_up_on_the_host() -> None:
    # Each call was answered and forgotten at once: a guest that sent calls (a few bytes
    # each) without reading the answers (up to 1 MiB each) made the host buffer them all.
    answer = b"r" * (64 * 1024)

    async def on_call(
        method: str, path: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, dict[str, str], bytes]:
        return 200, {}, answer

    async def body(ch: GuestChannel, guest: FakeGuest) -> None:
        for cid in range(400):  # 25 MiB of answers
            await guest.send(proto.encode_frame({"i": cid, "t": proto.CALL, "method": "POST"}))
            await asyncio.sleep(0)
        await asyncio.sleep(0.2)
        assert _unread(ch) <= MAX_CALLS * len(answer) + (4 << 20)
        statuses = set()
        while ch._calls:  # the guest reads at last: the held calls get their answers
            statuses.add((await guest.next_frame()).header["status"])
        assert 200 in statuses and statuses <= {200, 429}

    with_guest(body, on_call=on_call)


def test_refusals_a_guest_does_not_read_do_not_pile_up_on_the_host() -> None:
    # Past MAX_CALLS each call frame (34 bytes) got a 429 answer of some 200 bytes written
    # whether or not the guest read any: a guest that does not read grew host memory.
    release = asyncio.Event()

    async def on_call(
        method: str, path: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, dict[str, str], bytes]:
        await release.wait()
        return 200, {}, b"ok"

    async def body(ch: GuestChannel, guest: FakeGuest) -> None:
        frames = b"".join(
            proto.encode_frame({"i": cid, "t": proto.CALL}) for cid in range(40_000)
        )  # 1.3 MiB of calls, 9 MiB of refusals
        for at in range(0, len(frames), 1 << 16):
            await guest.send(frames[at : at + (1 << 16)])
        await asyncio.sleep(0.2)
        assert _unread(ch) <= 6 << 20
        release.set()

    with_guest(body, on_call=on_call)
