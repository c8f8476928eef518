"""The guest agent, run as a real process on the host (``agent.py --socket``), driven through
GuestChannel. The same code serves the virtio port in a VM; ``test_agent_in_a_real_vm`` checks
that path."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from torpor.config import Limits
from torpor.errors import (
    GuestError,
    InvalidArgument,
    OperationTimeout,
    PathNotFound,
    PayloadTooLarge,
)
from torpor.sandbox.channel import GuestChannel

AGENT = Path(__file__).parents[2] / "torpor" / "sandbox" / "guest" / "agent.py"
T = TypeVar("T")


class AgentProcess:
    """One agent subprocess listening on ``socket``."""

    def __init__(self, tmp: Path) -> None:
        self.socket = tmp / "agent.sock"
        self.proc = subprocess.Popen(
            [sys.executable, str(AGENT), "--socket", str(self.socket), "--no-clock",
             "--log-level", "WARNING"], cwd=tmp)
        self.pids: list[int] = []  # background processes to clean up

    async def channel(self, **kw: Any) -> GuestChannel:
        return await GuestChannel.connect(self.socket, timeout=20, **kw)

    def stop(self) -> None:
        for pid in self.pids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[AgentProcess]:
    proc = AgentProcess(tmp_path)
    yield proc
    proc.stop()


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper does not count)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def run(agent: AgentProcess, body: Callable[[GuestChannel], Awaitable[T]], **kw: Any) -> T:
    """Connect, run ``body(channel)``, close."""
    async def main() -> T:
        channel = await agent.channel(**kw)
        try:
            return await body(channel)
        finally:
            await channel.close()
    return asyncio.run(main())


# -- basics and commands -------------------------------------------------------------------

def test_ping_reports_the_agent_process(agent: AgentProcess) -> None:
    info = run(agent, lambda ch: ch.ping())
    assert info["pid"] == agent.proc.pid
    assert {"boot_id", "uptime", "time", "version"} <= set(info)


@pytest.mark.parametrize(("cmd", "code", "out", "err"), [
    pytest.param("echo hi", 0, "hi\n", "", id="ok"),
    pytest.param("echo oops >&2; exit 3", 3, "", "oops\n", id="exit-3"),
    pytest.param("kill -9 $$", 137, "", "", id="killed"),
    pytest.param("printf 'h\\303\\251'", 0, "hé", "", id="utf8"),
])
def test_command_exit_code_and_output(agent: AgentProcess, cmd: str, code: int, out: str,
                                      err: str) -> None:
    result = run(agent, lambda ch: ch.run_command(cmd))
    assert (result.exit_code, result.stdout, result.stderr) == (code, out, err)


def test_command_cwd_and_env(agent: AgentProcess, tmp_path: Path) -> None:
    (tmp_path / "work").mkdir()
    result = run(agent, lambda ch: ch.run_command(
        "pwd; echo $GREETING", cwd=str(tmp_path / "work"), env={"GREETING": "hello there"}))
    assert result.stdout == f"{tmp_path / 'work'}\nhello there\n"


def test_command_missing_cwd_is_path_not_found(agent: AgentProcess, tmp_path: Path) -> None:
    with pytest.raises(PathNotFound):
        run(agent, lambda ch: ch.run_command("true", cwd=str(tmp_path / "nope")))


def test_command_output_streams_before_it_ends(agent: AgentProcess, tmp_path: Path) -> None:
    # The command waits for a file that only the stdout callback creates: it can only finish
    # if its first line reached the host while it was still running.
    flag = tmp_path / "flag"
    seen: list[str] = []

    def on_stdout(text: str) -> None:
        seen.append(text)
        flag.touch()

    result = run(agent, lambda ch: ch.run_command(
        f"echo first; while [ ! -e {flag} ]; do sleep 0.01; done; echo second",
        timeout=30, on_stdout=on_stdout))
    assert result.stdout == "first\nsecond\n"
    assert seen[0] == "first\n"


def test_command_timeout_kills_the_process_group(agent: AgentProcess, tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"

    async def body(ch: GuestChannel) -> None:
        with pytest.raises(OperationTimeout) as info:
            await ch.run_command(f"sleep 300 & echo $! > {pidfile}; wait", timeout=0.5)
        assert info.value.data["seconds"] == 0.5
        # The agent still serves requests afterwards.
        assert (await ch.run_command("echo alive")).stdout == "alive\n"

    run(agent, body)
    assert not alive(int(pidfile.read_text()))


def test_command_output_over_the_limit(agent: AgentProcess) -> None:
    async def body(ch: GuestChannel) -> None:
        with pytest.raises(PayloadTooLarge) as info:
            await ch.run_command("head -c 3000000 /dev/zero", timeout=30)
        assert info.value.data["limit"] == 1_000_000

    run(agent, body, limits=Limits(max_output_bytes=1_000_000))


# -- files ---------------------------------------------------------------------------------

def test_files_round_trip(agent: AgentProcess, tmp_path: Path) -> None:
    base = tmp_path / "files"

    async def body(ch: GuestChannel) -> None:
        await ch.write_file(f"{base}/a/b/text.txt", "héllo")
        await ch.write_file(f"{base}/a/bin", bytes(range(256)))
        assert await ch.read_file(f"{base}/a/b/text.txt") == "héllo".encode()
        assert await ch.read_file(f"{base}/a/bin") == bytes(range(256))
        entries = await ch.list_dir(f"{base}/a")
        assert [(e.name, e.type, e.size) for e in entries] == [("b", "dir", entries[0].size),
                                                               ("bin", "file", 256)]
        assert entries[1].path == f"{base}/a/bin"
        assert await ch.exists(f"{base}/a/bin")
        await ch.make_dir(f"{base}/c/d")
        await ch.make_dir(f"{base}/c/d")  # already there: fine
        assert await ch.exists(f"{base}/c/d")
        await ch.remove(f"{base}/a")
        assert not await ch.exists(f"{base}/a")
        await ch.remove(f"{base}/c/d")
        assert [e.name for e in await ch.list_dir(f"{base}/c")] == []

    run(agent, body)
    # Atomic writes leave no temporary files behind.
    assert sorted(p.name for p in base.rglob("*")) == ["c"]


@pytest.mark.parametrize("op", ["read_file", "list_dir", "remove"])
def test_missing_path_is_path_not_found(agent: AgentProcess, tmp_path: Path, op: str) -> None:
    missing = str(tmp_path / "missing")
    with pytest.raises(PathNotFound) as info:
        run(agent, lambda ch: getattr(ch, op)(missing))
    assert info.value.data["name"] == missing


def test_read_a_directory_is_invalid(agent: AgentProcess, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument):
        run(agent, lambda ch: ch.read_file(str(tmp_path)))


def test_fifty_megabytes_both_ways(agent: AgentProcess, tmp_path: Path) -> None:
    data = os.urandom(50 * 1024 * 1024)
    target = tmp_path / "big.bin"

    async def body(ch: GuestChannel) -> bytes:
        await ch.write_file(str(target), data)
        return await ch.read_file(str(target))

    assert run(agent, body) == data
    assert target.read_bytes() == data


def test_file_over_the_limit(agent: AgentProcess, tmp_path: Path) -> None:
    big = tmp_path / "big"
    big.write_bytes(b"x" * 5000)

    async def body(ch: GuestChannel) -> None:
        with pytest.raises(PayloadTooLarge):
            await ch.write_file(str(tmp_path / "new"), b"y" * 5000)
        with pytest.raises(PayloadTooLarge):
            await ch.read_file(str(big))
        assert not await ch.exists(str(tmp_path / "new"))

    run(agent, body, limits=Limits(max_file_bytes=4096))


def test_agent_refuses_an_upload_over_its_limit(agent: AgentProcess, tmp_path: Path) -> None:
    # The host checks first, but the guest enforces the limit it is given on its own too.
    async def body(ch: GuestChannel) -> None:
        with pytest.raises(PayloadTooLarge):
            await ch._request("write", {"path": str(tmp_path / "f"), "max_bytes": 10}, b"z" * 11)
        with pytest.raises(InvalidArgument):
            await ch._request("no_such_op", {})

    run(agent, body)
    assert os.listdir(tmp_path) == ["agent.sock"]
