"""GuestChannel.connect refreshes the guest in its first ping (one round trip on a wake), and
a refresh() right after is answered from it. Runs the real agent on the host (``--socket``)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

from torpor.sandbox.guest import protocol as proto
from torpor.sandbox.vm.channel import GuestChannel

AGENT = Path(__file__).parents[2] / "torpor" / "sandbox" / "guest" / "agent.py"


def _agent(directory: Path) -> subprocess.Popen[bytes]:
    directory.mkdir()
    return subprocess.Popen(
        [
            sys.executable,
            str(AGENT),
            "--socket",
            str(directory / "agent.sock"),
            "--no-clock",
            "--log-level",
            "WARNING",
        ],
        cwd=directory,
    )


def test_connect_reseeds_like_refresh(tmp_path: Path) -> None:
    # Two agents whose interpreters share a random state, as clones of one snapshot do: a new
    # connection alone (no refresh() call) makes them draw differently.
    procs = [_agent(tmp_path / "a"), _agent(tmp_path / "b")]
    seed = "import random\nrandom.seed(7)"

    async def draw(sock: Path) -> tuple[str | None, str | None]:
        async with await GuestChannel.connect(sock, timeout=20, refresh=False) as ch:
            await ch.run_code(seed)
            same = (await ch.run_code("random.random()")).text
            await ch.run_code(seed)
        async with await GuestChannel.connect(sock, timeout=20) as ch:
            return same, (await ch.run_code("random.random()")).text

    try:
        a = asyncio.run(draw(tmp_path / "a" / "agent.sock"))
        b = asyncio.run(draw(tmp_path / "b" / "agent.sock"))
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert a[0] == b[0] and a[0] is not None
    assert a[1] != b[1] and a[1] is not None and b[1] is not None


def test_refresh_after_connect_needs_no_round_trip(tmp_path: Path) -> None:
    proc = _agent(tmp_path / "a")

    async def body() -> None:
        async with await GuestChannel.connect(tmp_path / "a" / "agent.sock", timeout=20) as ch:
            await ch.run_code("0")  # an interpreter to reseed
        async with await GuestChannel.connect(tmp_path / "a" / "agent.sock", timeout=20) as ch:
            first = await ch.refresh()  # answered by the connect's ping
            assert first["entropy_bytes"] == 64 and first["interpreter_reseeded"]
            assert await ch.refresh() == first  # still nothing sent since
            await ch.ping()  # a ping is not a request that spends the freshness
            assert await ch.refresh() == first
            await ch.run_code("1")
            again = await ch.refresh()  # a request went between: a real refresh
            assert again["time"] > first["time"]
            other = await ch.refresh(unix_time=time.time() - 3600.0)  # not "now": sent
            assert other["time"] >= again["time"]
            # pings that repeat one entropy (a connect's retries) refresh once; new bytes,
            # a new refresh (a snapshot may have kept the old connection as current)
            ask = {"refresh": {"unix_time": time.time()}}
            one = await ch._request("ping", ask, b"x" * 8)
            two = await ch._request("ping", ask, b"x" * 8)
            three = await ch._request("ping", ask, b"y" * 8)
            assert one["refresh"] == two["refresh"] != first
            assert three["refresh"]["time"] > one["refresh"]["time"]

    try:
        asyncio.run(body())
    finally:
        proc.kill()
        proc.wait()


def test_connect_without_refresh_leaves_refresh_to_do(tmp_path: Path) -> None:
    proc = _agent(tmp_path / "a")

    async def body() -> None:
        async with await GuestChannel.connect(
            tmp_path / "a" / "agent.sock", timeout=20, refresh=False
        ) as ch:
            info = await ch.ping()
            assert "refresh" not in info
            result = await ch.refresh(entropy=b"z" * 16)
            assert result["entropy_bytes"] == 16

    try:
        asyncio.run(body())
    finally:
        proc.kill()
        proc.wait()


def test_connect_says_how_the_first_ping_went(tmp_path: Path) -> None:
    # connect() records how it reached the agent (benchmarks split a wake with it): the
    # agent starts after the host, so the host waits for the socket, and each reconnection
    # (a wake) is timed afresh.
    async def connect_twice(sock: Path) -> list[dict[str, float]]:
        firsts = []
        for _ in range(2):
            async with await GuestChannel.connect(sock, timeout=20) as ch:
                await ch.ping()
                firsts.append(dict(ch.first_ping))
        return firsts

    async def main(directory: Path) -> list[dict[str, float]]:
        task = asyncio.create_task(connect_twice(directory / "agent.sock"))
        await asyncio.sleep(0.2)
        proc = _agent(directory)
        try:
            return await task
        finally:
            proc.kill()
            proc.wait()

    firsts = asyncio.run(main(tmp_path / "a"))
    assert firsts[0]["socket_s"] >= 0.2  # waited for the agent to listen
    for first in firsts:
        assert set(first) == {"socket_s", "pings", "answered", "answer_s", "round_trip_s"}
        assert 1 <= first["answered"] <= first["pings"]
        assert first["answer_s"] >= first["round_trip_s"] > 0
    assert firsts[1]["socket_s"] < firsts[0]["socket_s"]


def test_spare_pings_are_not_cancelled(tmp_path: Path) -> None:
    # A slow agent (a waking guest) answers the first ping late: connect() pings again
    # meanwhile, and once answered it sends no cancel for the spare pings (the agent serves
    # pings in order and cannot cancel one: each cancel would only be one more frame to read).
    sock = tmp_path / "agent.sock"
    seen: list[tuple[str, str]] = []

    async def agent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        decoder = proto.FrameDecoder()
        first: int | None = None
        loop = asyncio.get_running_loop()
        answer_at = loop.time() + 0.15
        while True:
            try:
                data = await asyncio.wait_for(reader.read(1 << 16), 0.05)
            except TimeoutError:
                data = None
            if data == b"":
                return
            for frame in decoder.feed(data or b""):
                seen.append((frame.type, str(frame.header.get("op", ""))))
                if first is None and frame.type == proto.REQ:
                    first = frame.id
            if first is not None and loop.time() >= answer_at:
                result = {"version": proto.PROTOCOL_VERSION}
                reply = {"i": first, "t": proto.REPLY, "ok": True, "result": result}
                writer.write(proto.encode_frame(reply))
                first, answer_at = None, float("inf")

    async def main() -> dict[str, float]:
        server = await asyncio.start_unix_server(agent, str(sock))
        async with server:
            channel = await GuestChannel.connect(sock, timeout=10, refresh=False)
            await asyncio.sleep(0.2)  # what the host sends after the answer reaches the agent
            first = dict(channel.first_ping)
            await channel.close()
            return first

    first = asyncio.run(main())
    assert first["pings"] >= 3 and first["answered"] == 1
    assert seen.count((proto.REQ, "ping")) == first["pings"]
    assert not [t for t, _ in seen if t == proto.CANCEL]


def test_connect_without_reseed_sets_the_clock_only(tmp_path: Path) -> None:
    # A plain wake: the guest's random state is its own, so the first ping carries the clock
    # and no entropy, the interpreter keeps drawing where it was, and a refresh() after it
    # is a real one (not answered from the clock-only ping).
    proc = _agent(tmp_path / "a")
    sock = tmp_path / "a" / "agent.sock"
    seed = "import random\nrandom.seed(7)"

    async def body() -> None:
        async with await GuestChannel.connect(sock, timeout=20, refresh=False) as ch:
            await ch.run_code(seed)
            expected = (await ch.run_code("random.random()")).text
            await ch.run_code(seed)
        async with await GuestChannel.connect(sock, timeout=20, reseed=False) as ch:
            assert (await ch.run_code("random.random()")).text == expected
            result = await ch.refresh()
            assert result["entropy_bytes"] == 64 and result["interpreter_reseeded"]
            # the retries of one clock-only ping (one key) refresh once; another key, again
            ask = {"refresh": {"unix_time": time.time(), "key": "k1", "reseed": False}}
            one = await ch._request("ping", ask, b"")
            two = await ch._request("ping", ask, b"")
            ask["refresh"]["key"] = "k2"
            three = await ch._request("ping", ask, b"")
            assert one["refresh"] == two["refresh"]
            assert three["refresh"]["time"] > one["refresh"]["time"]
            assert one["refresh"]["entropy_bytes"] == 0
            assert not one["refresh"]["interpreter_reseeded"]

    try:
        asyncio.run(body())
    finally:
        proc.kill()
        proc.wait()
