"""The guest agent, run as a real process on the host (``agent.py --socket``), driven through
GuestChannel. The same code serves the virtio port in a VM; ``test_agent_in_a_real_vm`` checks
that path."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
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
from torpor.sandbox.guest import protocol as proto
from torpor.sandbox.vm.channel import GuestChannel

AGENT = Path(__file__).parents[2] / "torpor" / "sandbox" / "guest" / "agent.py"
T = TypeVar("T")


class AgentProcess:
    """One agent subprocess listening on ``socket``."""

    def __init__(self, tmp: Path, *extra: str) -> None:
        self.socket = tmp / "agent.sock"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(AGENT),
                "--socket",
                str(self.socket),
                "--no-clock",
                "--log-level",
                "WARNING",
                *extra,
            ],
            cwd=tmp,
        )
        self.pids: list[int] = []  # background processes to clean up

    async def channel(self, **kw: Any) -> GuestChannel:
        return await GuestChannel.connect(self.socket, timeout=20, **kw)

    def stop(self) -> None:
        for pid in self.pids:  # a group leader takes its group along; `cmd &` children do not
            for kill in (os.killpg, os.kill):
                with contextlib.suppress(ProcessLookupError):
                    kill(pid, signal.SIGKILL)
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


@pytest.mark.parametrize(
    ("cmd", "code", "out", "err"),
    [
        pytest.param("echo hi", 0, "hi\n", "", id="ok"),
        pytest.param("echo oops >&2; exit 3", 3, "", "oops\n", id="exit-3"),
        pytest.param("kill -9 $$", 137, "", "", id="killed"),
        pytest.param("printf 'h\\303\\251'", 0, "hé", "", id="utf8"),
    ],
)
def test_command_exit_code_and_output(
    agent: AgentProcess, cmd: str, code: int, out: str, err: str
) -> None:
    result = run(agent, lambda ch: ch.run_command(cmd))
    assert (result.exit_code, result.stdout, result.stderr) == (code, out, err)


def test_command_cwd_and_env(agent: AgentProcess, tmp_path: Path) -> None:
    (tmp_path / "work").mkdir()
    result = run(
        agent,
        lambda ch: ch.run_command(
            "pwd; echo $GREETING", cwd=str(tmp_path / "work"), env={"GREETING": "hello there"}
        ),
    )
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

    result = run(
        agent,
        lambda ch: ch.run_command(
            f"echo first; while [ ! -e {flag} ]; do sleep 0.01; done; echo second",
            timeout=30,
            on_stdout=on_stdout,
        ),
    )
    assert result.stdout == "first\nsecond\n"
    assert seen[0] == "first\n"


def test_command_timeout_kills_the_process_group(agent: AgentProcess, tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"

    async def body(ch: GuestChannel) -> None:
        with pytest.raises(OperationTimeout) as info:
            await ch.run_command(f"echo started; sleep 300 & echo $! > {pidfile}; wait", timeout=2)
        assert info.value.data["seconds"] == 2
        assert info.value.data["stdout"] == "started\n"
        # The agent still serves requests afterwards.
        assert (await ch.run_command("echo alive")).stdout == "alive\n"

    run(agent, body)
    # SIGKILL is delivered when the process next runs: on a loaded machine, a moment later
    pid, deadline = int(pidfile.read_text()), time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid)


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
        assert [(e.name, e.type, e.size) for e in entries] == [
            ("b", "dir", entries[0].size),
            ("bin", "file", 256),
        ]
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


def test_file_names_that_are_not_utf8(agent: AgentProcess, tmp_path: Path) -> None:
    # Python names such a file with a lone surrogate (surrogateescape), which the frame
    # header's UTF-8 could not carry: the listing failed as PayloadTooLarge ("header is not
    # JSON-serialisable"), and so did a read, a write or a code error naming the file.
    (tmp_path / "d").mkdir()
    raw = os.fsencode(tmp_path / "d") + b"/caf\xe9.txt"
    Path(os.fsdecode(raw)).write_bytes(b"latin-1 named")
    name = os.fsdecode(b"caf\xe9.txt")

    async def body(ch: GuestChannel) -> None:
        assert [e.name for e in await ch.list_dir(str(tmp_path / "d"))] == [name]
        assert await ch.read_file(os.fsdecode(raw)) == b"latin-1 named"
        await ch.write_file(os.fsdecode(raw), b"rewritten")
        ex = await ch.run_code(f"raise ValueError({name!r})")
        assert ex.error is not None and ex.error.value == name

        for call in (ch.read_file, ch.list_dir, lambda p: ch.write_file(p, b"x")):
            with pytest.raises(InvalidArgument):  # no bytes decode to a lone \ud800
                await call(str(tmp_path / "\ud800"))

    run(agent, body)
    assert Path(os.fsdecode(raw)).read_bytes() == b"rewritten"


def test_read_a_directory_is_invalid(agent: AgentProcess, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument):
        run(agent, lambda ch: ch.read_file(str(tmp_path)))


def test_reading_a_named_pipe_is_invalid(agent: AgentProcess, tmp_path: Path) -> None:
    # Its open waited for a writer: never answered, and the request's thread stayed blocked
    # in open() after the host gave up (a cancel cannot reach it).
    os.mkfifo(tmp_path / "pipe")

    async def body(ch: GuestChannel) -> None:
        with pytest.raises(InvalidArgument, match="named pipe"):
            await ch.read_file(str(tmp_path / "pipe"))
        assert await ch.read_file(str(AGENT)) == AGENT.read_bytes()  # files read as before

    run(agent, body, op_timeout=10)


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


# -- background processes, reconnects, concurrency ----------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def http_get(port: int) -> bytes:
    """GET / on ``port``, retrying while the server starts (bounded)."""
    for _ in range(200):
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.05)
            continue
        writer.write(b"GET / HTTP/1.0\r\n\r\n")
        body = await reader.read()
        writer.close()
        return body
    raise AssertionError(f"nothing serves port {port}")


def test_nohup_background_server_outlives_its_command(agent: AgentProcess, tmp_path: Path) -> None:
    port = free_port()
    (tmp_path / "index.html").write_text("served by the sandbox")

    async def body(ch: GuestChannel) -> None:
        result = await ch.run_command(
            f"nohup {sys.executable} -m http.server {port} --bind 127.0.0.1 & echo $!",
            cwd=str(tmp_path),
            timeout=30,
        )
        agent.pids.append(int(result.stdout))
        assert result.exit_code == 0
        assert b"served by the sandbox" in await http_get(port)

    run(agent, body)
    # A new connection (what a wake looks like to the agent): the server still runs.
    run(agent, lambda ch: http_get(port))
    assert alive(agent.pids[0])


def test_background_true_returns_the_pid_at_once(agent: AgentProcess, tmp_path: Path) -> None:
    marker, go = tmp_path / "marker", tmp_path / "go"

    async def body(ch: GuestChannel) -> None:
        result = await ch.run_command(
            f"while [ ! -e {go} ]; do sleep 0.01; done; touch {marker}; sleep 300", background=True
        )
        assert result.pid is not None and result.exit_code == -1
        agent.pids.append(result.pid)
        assert not marker.exists()
        go.touch()
        for _ in range(200):
            if marker.exists():
                break
            await asyncio.sleep(0.05)

    run(agent, body)
    assert marker.exists() and alive(agent.pids[0])


def test_reconnect_keeps_processes_and_variables(agent: AgentProcess) -> None:
    first = run(agent, lambda ch: asyncio.gather(ch.ping(), ch.run_code("kept = [1, 2, 3]")))
    second = run(agent, lambda ch: asyncio.gather(ch.ping(), ch.run_code("kept")))
    assert first[0]["pid"] == second[0]["pid"]
    assert second[1].text == "[1, 2, 3]"


def test_half_sent_frame_then_hang_up_is_dropped(agent: AgentProcess) -> None:
    # The host hangs up in the middle of a frame (a hibernate during an upload): the next
    # connection must not see any trace of it.
    async def half() -> None:
        channel = await agent.channel()
        frame = b"".join(
            proto.encode_request(1, "write", {"path": "/nonexistent/x"}, b"q" * 100_000)
        )
        channel._writer.write(frame[: len(frame) // 2])
        await channel._writer.drain()
        await channel.close()

    asyncio.run(half())
    assert run(agent, lambda ch: ch.run_command("echo ok")).stdout == "ok\n"


@pytest.mark.parametrize(
    ("op", "args"),
    [
        pytest.param("ls", "not an object", id="args-not-an-object"),
        pytest.param("write", {"path": "/tmp/x\x00y"}, id="write-path-with-nul"),
        pytest.param("write", {"path": "/tmp/x", "max_bytes": "lots"}, id="write-bad-number"),
    ],
)
def test_a_request_the_agent_cannot_take_is_answered(
    agent: AgentProcess, op: str, args: Any
) -> None:
    """The agent logged such a request's error and sent nothing: the host waited out its
    timeout (120 s by default) for each one."""

    async def body(ch: GuestChannel) -> None:
        with pytest.raises(GuestError, match="cannot take"):
            await ch._request(op, args)
        assert (await ch.ping())["pid"] == agent.proc.pid  # and it serves on

    run(agent, body, op_timeout=30)


def test_agent_death_fails_in_flight_requests(agent: AgentProcess, tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"

    async def body(ch: GuestChannel) -> None:
        task = asyncio.ensure_future(
            ch.run_command(
                f"echo $$ > {pidfile}.tmp; mv {pidfile}.tmp {pidfile}; sleep 300", timeout=None
            )
        )
        while not pidfile.exists():
            await asyncio.sleep(0.02)
        agent.pids.append(int(pidfile.read_text()))  # the shell leads the command's group
        agent.proc.kill()
        with pytest.raises(GuestError):
            await task
        with pytest.raises(GuestError):
            await ch.ping()

    run(agent, body)


def test_silent_agent_times_out(agent: AgentProcess) -> None:
    async def body(ch: GuestChannel) -> None:
        agent.proc.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(OperationTimeout):
                await ch.ping()
        finally:
            agent.proc.send_signal(signal.SIGCONT)
        ch.op_timeout = 60  # a loaded machine may take a while to catch up
        assert (await ch.ping())["pid"] == agent.proc.pid

    run(agent, body, op_timeout=0.5)


def test_connect_times_out_without_an_agent(tmp_path: Path) -> None:
    with pytest.raises(OperationTimeout):
        asyncio.run(GuestChannel.connect(tmp_path / "nobody.sock", timeout=0.3))


def test_concurrent_requests(agent: AgentProcess, tmp_path: Path) -> None:
    async def body(ch: GuestChannel) -> None:
        flag = tmp_path / "go"
        slow = asyncio.ensure_future(
            ch.run_command(f"while [ ! -e {flag} ]; do sleep 0.01; done; echo slow", timeout=60)
        )
        # Requests sent after the slow one are answered while it still runs.
        await ch.ping()
        await ch.write_file(str(tmp_path / "f"), b"data")
        assert not slow.done()
        outs = await asyncio.gather(*(ch.run_command(f"echo {n}") for n in range(10)))
        reads = await asyncio.gather(*(ch.read_file(str(tmp_path / "f")) for _ in range(5)))
        assert [o.stdout for o in outs] == [f"{n}\n" for n in range(10)]
        assert reads == [b"data"] * 5
        assert not slow.done()
        flag.touch()
        assert (await slow).stdout == "slow\n"

    run(agent, body)


def test_cancelling_a_command_kills_it(agent: AgentProcess, tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"

    async def body(ch: GuestChannel) -> None:
        task = asyncio.ensure_future(
            ch.run_command(f"sleep 300 & echo $! > {pidfile}; wait", timeout=None)
        )
        while not pidfile.exists() or not pidfile.read_text().strip():
            await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            if not alive(int(pidfile.read_text())):
                return
            await asyncio.sleep(0.05)
        raise AssertionError("the cancelled command still runs")

    run(agent, body)


# -- the interpreter -----------------------------------------------------------------------


def test_interpreter_keeps_variables_and_streams(agent: AgentProcess) -> None:
    chunks: list[str] = []

    async def body(ch: GuestChannel) -> None:
        await ch.run_code("import os\nx = 40")
        ex = await ch.run_code(
            "print('out'); import sys; print('err', file=sys.stderr); x + 2",
            on_stdout=chunks.append,
        )
        assert (ex.text, ex.stdout, ex.stderr, ex.error) == ("42", "out\n", "err\n", None)
        ex = await ch.run_code("os.system('echo from a subprocess')\nNone")
        assert ex.stdout == "from a subprocess\n" and ex.results == []

    run(agent, body)
    assert chunks == ["out\n"]


def test_interpreter_mime_bundles(agent: AgentProcess) -> None:
    code = """
class Rich:
    def __repr__(self): return "Rich()"
    def _repr_html_(self): return "<b>rich</b>"
    def _repr_png_(self): return b"\\x89PNG fake"
    def _repr_json_(self): return {"a": 1}
    def _repr_markdown_(self): return "**rich**"
display(1, "two")
Rich()
"""
    ex = run(agent, lambda ch: ch.run_code(code))
    assert ex.error is None
    assert [r.data for r in ex.results[:2]] == [{"text/plain": "1"}, {"text/plain": "'two'"}]
    assert [r.is_main_result for r in ex.results] == [False, False, True]
    assert ex.results[2].data == {
        "text/plain": "Rich()",
        "text/html": "<b>rich</b>",
        "image/png": "iVBORyBmYWtl",
        "application/json": {"a": 1},
        "text/markdown": "**rich**",
    }


def test_interpreter_error_with_traceback(agent: AgentProcess) -> None:
    async def body(ch: GuestChannel) -> None:
        ex = await ch.run_code("def f():\n    raise ValueError('bad value')\nf()")
        assert ex.error is not None
        assert (ex.error.name, ex.error.value) == ("ValueError", "bad value")
        assert "line 2, in f" in ex.error.traceback
        assert "raise ValueError('bad value')" in ex.error.traceback
        assert "interpreter.py" not in ex.error.traceback
        ex = await ch.run_code("1 +")
        assert ex.error is not None and ex.error.name == "SyntaxError"
        ex = await ch.run_code("import sys; y = 1; sys.exit(3)")
        assert ex.error is not None and ex.error.name == "SystemExit"
        assert (await ch.run_code("y")).text == "1"

    run(agent, body)


def test_interpreter_timeout_interrupts_and_keeps_variables(agent: AgentProcess) -> None:
    async def body(ch: GuestChannel) -> None:
        await ch.run_code("n = 0")
        with pytest.raises(OperationTimeout) as info:
            await ch.run_code(
                "import time\nwhile True:\n    n += 1\n    time.sleep(0.01)", timeout=1.0
            )
        assert info.value.data["kernel_alive"] is True
        ex = await ch.run_code("n > 0")
        assert ex.text == "True"

    run(agent, body)


def test_interpreter_that_ignores_sigint_is_killed_on_timeout(agent: AgentProcess) -> None:
    async def body(ch: GuestChannel) -> None:
        await ch.run_code(
            "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nv = 1"
        )
        with pytest.raises(OperationTimeout) as info:
            await ch.run_code("time.sleep(60)", timeout=0.3)
        assert info.value.data["kernel_alive"] is False
        ex = await ch.run_code("'v' in globals()")
        assert ex.text == "False"

    run(agent, body)


def test_interpreter_crash_recovers(agent: AgentProcess) -> None:
    async def body(ch: GuestChannel) -> None:
        await ch.run_code("z = 1")
        ex = await ch.run_code("import os; os._exit(7)")
        assert ex.error is not None and ex.error.name == "KernelDied"
        assert "code 7" in ex.error.value
        assert (await ch.ping())["pid"] == agent.proc.pid  # the agent lives on
        ex = await ch.run_code("'z' in globals(), 1 + 1")
        assert ex.text == "(False, 2)"
        await ch.run_code("w = 5")
        await ch.restart_interpreter()
        assert (await ch.run_code("'w' in globals()")).text == "False"

    run(agent, body)


def test_a_child_forked_by_user_code_does_not_serve_later_cells(agent: AgentProcess) -> None:
    # The usual `if os.fork() == 0: ...; sys.exit(0)`: the child's SystemExit came back to
    # the kernel's loop, so two kernels read the next cells in turn, each with its own
    # variables.
    async def body(ch: GuestChannel) -> None:
        ex = await ch.run_code(
            "import os, sys\npid = os.fork()\nif pid == 0:\n    sys.exit(0)\npid"
        )
        assert ex.error is None and ex.text is not None  # the parent's answer, not the child's
        child = int(ex.text)
        for _ in range(200):
            if not alive(child):
                break
            await asyncio.sleep(0.05)
        assert not alive(child), "the forked child still runs"
        kernel = (await ch.run_code("os.getpid()")).text
        for n in range(10):
            ex = await ch.run_code(
                f"v{n} = {n}\nos.getpid(), sum(globals()['v%d' % m] for m in range({n + 1}))"
            )
            assert ex.text == f"({kernel}, {n * (n + 1) // 2})"

    run(agent, body)


def test_a_kernel_that_dies_leaving_children_is_seen_to_die(agent: AgentProcess) -> None:
    # A command user code started (os.system's `cmd &`, exec'd with the kernel's pipes) or a
    # worker it forked held the kernel's reply pipe open, so the agent never saw the kernel
    # exit: the run waited out its timeout (for ever with none) holding the interpreter.
    async def body(ch: GuestChannel) -> None:
        for start in (
            "import os\nos.system('sleep 60 &')",
            "import os, time\nif os.fork() == 0:\n    time.sleep(60)\n    os._exit(0)",
        ):
            await ch.run_code(start)
            ex = await asyncio.wait_for(ch.run_code("os._exit(3)"), 20)
            assert ex.error is not None and ex.error.name == "KernelDied"
            assert (await ch.run_code("1 + 1")).text == "2"

    run(agent, body)


def test_code_that_closes_its_output_does_not_spin_the_agent(agent: AgentProcess) -> None:
    # With the kernel's fd 1 and 2 closed, their pipes read EOF: select found them ready at
    # once, so the agent spun a CPU for as long as each later run lasted.
    def cpu_seconds() -> float:
        fields = Path(f"/proc/{agent.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    async def body(ch: GuestChannel) -> None:
        await ch.run_code("import os, time\nos.close(1)\nos.close(2)")
        before = cpu_seconds()
        assert (await ch.run_code("time.sleep(3)\n5")).text == "5"
        assert cpu_seconds() - before < 0.3

    run(agent, body)


def test_interpreter_output_over_the_limit(agent: AgentProcess) -> None:
    async def body(ch: GuestChannel) -> None:
        with pytest.raises(PayloadTooLarge):
            await ch.run_code("print('x' * 3_000_000)", timeout=30)
        with pytest.raises(PayloadTooLarge):
            await ch.run_code("#" * 2_000_001)
        assert (await ch.run_code("1")).text == "1"

    run(agent, body, limits=Limits(max_output_bytes=1_000_000, max_code_bytes=2_000_000))


def test_a_run_cut_for_its_output_ends_before_the_next(agent: AgentProcess) -> None:
    # The agent answered PayloadTooLarge and left the run going: its last lines came out
    # in the next run's stdout, and a run that ignored SIGINT printed on for ever, so every
    # later run failed as PayloadTooLarge at once. It is stopped (or killed) first now.
    async def body(ch: GuestChannel) -> None:
        await ch.run_code("kept = 1")
        for _ in range(5):
            with pytest.raises(PayloadTooLarge) as info:
                await ch.run_code("for i in range(10**6): print('x' * 100)", timeout=30)
            assert info.value.data["kernel_alive"] is True
            assert (await ch.run_code("print('ok'); kept")).stdout == "ok\n"
        with pytest.raises(PayloadTooLarge) as info:
            await ch.run_code(
                "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                "while True: print('y' * 100)",
                timeout=30,
            )
        assert info.value.data["kernel_alive"] is False
        ex = await ch.run_code("print('ok'); 'kept' in globals()", timeout=10)
        assert (ex.stdout, ex.text) == ("ok\n", "False")

    run(agent, body, limits=Limits(max_output_bytes=1_000_000))


def test_long_code_is_chunked(agent: AgentProcess) -> None:
    code = "s = 0\n" + "s += 1\n" * 40_000 + "s"
    assert run(agent, lambda ch: ch.run_code(code)).text == "40000"


# -- refresh -------------------------------------------------------------------------------


def test_refresh_reseeds_random(tmp_path: Path) -> None:
    # Two agents whose interpreters share a random state, as clones of one snapshot do.
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    agents = [AgentProcess(tmp_path / "a"), AgentProcess(tmp_path / "b")]
    seed = "import random, numpy\nrandom.seed(1); numpy.random.seed(1)"
    draw = "random.random(), float(numpy.random.random())"
    try:

        async def body(ch: GuestChannel, entropy: bytes) -> tuple[str | None, ...]:
            await ch.run_code(seed)
            same = (await ch.run_code(draw)).text
            await ch.run_code(seed)
            result = await ch.refresh(entropy=entropy, unix_time=1.0)
            assert result["interpreter_reseeded"] and result["entropy_bytes"] == 32
            assert result["clock_set"] is False  # --no-clock: never the host's clock
            return same, (await ch.run_code(draw)).text

        a = run(agents[0], lambda ch: body(ch, b"a" * 32))
        b = run(agents[1], lambda ch: body(ch, b"b" * 32))
        assert a[0] == b[0]
        assert a[1] != b[1]
        assert a[1] is not None and b[1] is not None
        assert a[1].split(",")[1] != b[1].split(",")[1]  # numpy.random too
    finally:
        for each in agents:
            each.stop()


def test_sync_and_failing_mount(agent: AgentProcess, tmp_path: Path) -> None:
    async def body(ch: GuestChannel) -> None:
        await ch.sync()
        with pytest.raises(GuestError):
            await ch.mount("/dev/nonexistent-disk", str(tmp_path / "mnt"), fstype="ext4")
        with pytest.raises(GuestError):
            await ch.umount(str(tmp_path / "not-mounted"))

    run(agent, body)


def test_mount_finds_a_disk_by_serial_or_says_it_is_missing(
    agent: AgentProcess, tmp_path: Path
) -> None:
    async def body(ch: GuestChannel) -> None:
        with pytest.raises(PathNotFound) as info:
            await ch._request(
                "mount",
                {
                    "source": "/dev/disk/by-id/virtio-no-such-serial",
                    "target": str(tmp_path / "m"),
                    "wait": 0.2,
                },
            )
        assert info.value.data == {"kind": "disk", "name": "no-such-serial"}

    run(agent, body)


# -- in a real VM --------------------------------------------------------------------------


@pytest.mark.qemu
def test_agent_in_a_real_vm(qemu_home: Path) -> None:
    """The agent on the virtio port: commands, files, interpreter, refresh, and a hibernate
    and wake in the middle (a new QEMU, a new connection) that keep processes and variables."""
    from torpor.sandbox import template as templates
    from torpor.sandbox.vm.machine import MachineSpec, QemuMachine, clone_machine_dir

    info = templates.get("python")
    directory = qemu_home / "sandboxes" / "agent-test"
    clone_machine_dir(info.snapshot_dir, directory)
    machine = QemuMachine(directory, info, MachineSpec())
    data = os.urandom(50 * 1024 * 1024 + 17)  # 50 MB both ways over the virtio port
    first: dict[str, Any] = {}  # what session one saw, for session two

    async def session_one() -> dict[str, Any]:
        async with await GuestChannel.connect(machine.agent_socket, timeout=120) as ch:
            ping = await ch.ping()
            refreshed = await ch.refresh(unix_time=2_000_000_000.0)
            assert refreshed["clock_set"] and refreshed["credited"]
            now = await ch.run_command("date +%s")
            assert 2_000_000_000 <= int(now.stdout) < 2_000_000_600
            await ch.refresh()  # back to the host's time
            lines: list[str] = []
            result = await ch.run_command("echo out; echo err >&2; exit 4", on_stdout=lines.append)
            assert (result.exit_code, result.stdout, result.stderr) == (4, "out\n", "err\n")
            assert lines == ["out\n"]
            with pytest.raises(OperationTimeout):
                await ch.run_command("sleep 30", timeout=1)
            await ch.write_file("/root/work/blob.bin", data)
            assert await ch.read_file("/root/work/blob.bin") == data
            assert [(e.name, e.size) for e in await ch.list_dir("/root/work")] == [
                ("blob.bin", len(data))
            ]
            with pytest.raises(PathNotFound):
                await ch.read_file("/root/missing")
            bg = await ch.run_command("sleep 100000", background=True)
            assert (await ch.run_command("pwd")).stdout == "/workspace\n"  # the default
            await ch.run_code("import random\nkept = 'across hibernate'")
            ex = await ch.run_code("print('hi'); {'k': 1}")
            assert (ex.stdout, ex.text) == ("hi\n", "{'k': 1}")
            await ch.sync()
            return {"ping": ping, "bg": bg.pid}

    async def session_two() -> dict[str, Any]:
        async with await GuestChannel.connect(machine.agent_socket, timeout=120) as ch:
            ping = await ch.ping()
            await ch.refresh()
            alive_ = await ch.run_command(f"kill -0 {first['bg']} && echo alive")
            kept = await ch.run_code("kept")
            return {"ping": ping, "alive": alive_.stdout, "kept": kept.text}

    async def scenario() -> tuple[dict[str, Any], dict[str, Any]]:
        await machine.wake()
        try:
            first.update(await session_one())
            await machine.hibernate()
            await machine.wake()
            return first, await session_two()
        finally:
            await machine.kill()

    one, two = asyncio.run(scenario())
    assert two["ping"]["pid"] == one["ping"]["pid"]
    assert two["ping"]["boot_id"] == one["ping"]["boot_id"]
    assert two["alive"] == "alive\n"
    assert two["kept"] == "'across hibernate'"


def test_big_results_travel_as_data(agent: AgentProcess, tmp_path: Path) -> None:
    # Results over the header bound: a 3 MB repr and a listing of 4000 entries.
    many = tmp_path / "many"
    many.mkdir()
    for n in range(4000):
        (many / f"file-{n:05d}-{'x' * 40}").touch()

    async def body(ch: GuestChannel) -> None:
        ex = await ch.run_code("'y' * 3_000_000")
        assert ex.text == repr("y" * 3_000_000)
        entries = await ch.list_dir(str(many))
        assert len(entries) == 4000 and entries[0].name.startswith("file-00000-")

    run(agent, body)


def test_agent_refuses_chunked_code_over_its_limit(agent: AgentProcess) -> None:
    async def body(ch: GuestChannel) -> None:
        with pytest.raises(PayloadTooLarge):
            await ch._request("run_code", {"max_bytes": 300_000}, b"#" * 600_000)
        assert (await ch.run_code("2 * 21")).text == "42"

    run(agent, body)


def test_interpreter_imports_from_its_working_directory(
    agent: AgentProcess, tmp_path: Path
) -> None:
    (tmp_path / "mymod.py").write_text("VALUE = 'mine'\n")
    ex = run(
        agent,
        lambda ch: ch.run_code(
            "import sys, mymod\nmymod.VALUE, any(p.endswith('guest') for p in sys.path)"
        ),
    )
    assert ex.text == "('mine', False)"


def test_workdir_is_where_commands_files_and_code_start(tmp_path: Path) -> None:
    (tmp_path / "work").mkdir()
    agent = AgentProcess(tmp_path, "--workdir", str(tmp_path / "work"))
    try:

        async def body(ch: GuestChannel) -> tuple[str, str | None]:
            await ch.write_file("relative.txt", "here")
            return (await ch.run_command("pwd; cat relative.txt")).stdout, (
                await ch.run_code("import os; os.getcwd()")
            ).text

        out, cwd = run(agent, body)
        assert out == f"{tmp_path / 'work'}\nhere"
        assert cwd == repr(str(tmp_path / "work"))
    finally:
        agent.stop()


def test_a_cancelled_upload_leaves_no_file(agent: AgentProcess, tmp_path: Path) -> None:
    target = tmp_path / "up" / "file.bin"

    async def body(ch: GuestChannel) -> None:
        frames = list(proto.encode_request(99, "write", {"path": str(target)}, b"u" * 600_000))
        ch._writer.write(frames[0])  # the first chunk only, then the host gives up
        ch._send_cancel(99)
        await ch.ping()  # frames are handled in order: the cancel has been seen
        # (checked while still connected: a hang-up would clean up too)
        assert list(target.parent.iterdir()) == []

    run(agent, body)


def test_an_agent_of_another_protocol_version_is_refused(tmp_path: Path) -> None:
    # A fake agent that answers pings as version 0 (a template built by an older torpor).
    sock = tmp_path / "old.sock"

    async def main() -> None:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            decoder = proto.FrameDecoder()
            while data := await reader.read(65536):
                for frame in decoder.feed(data):
                    writer.write(
                        proto.encode_frame(
                            {
                                "i": frame.id,
                                "t": proto.REPLY,
                                "ok": True,
                                "result": {"pid": 1, "version": 0},
                            }
                        )
                    )

        server = await asyncio.start_unix_server(serve, str(sock))
        async with server:
            with pytest.raises(GuestError) as info:
                await GuestChannel.connect(sock, timeout=10)
            assert info.value.data == {"version": 0}

    asyncio.run(main())


def test_arguments_that_cannot_be_framed_are_typed_errors(agent: AgentProcess) -> None:
    async def body(ch: GuestChannel) -> None:
        with pytest.raises(PayloadTooLarge):
            await ch.run_command("true", env={"BIG": "x" * (2 << 20)})
        with pytest.raises(InvalidArgument):
            await ch._request("exists", {"path": object()})
        assert await ch.exists("/")

    run(agent, body)


def test_a_chatty_background_child_does_not_hold_the_command(
    agent: AgentProcess, tmp_path: Path
) -> None:
    async def body(ch: GuestChannel) -> None:
        result = await ch.run_command("yes > /dev/stdout & echo $!; echo done >&2", timeout=60)
        agent.pids.append(int(result.stdout.splitlines()[0]))
        assert result.exit_code == 0 and result.stderr == "done\n"
        assert (await ch.ping())["pid"] == agent.proc.pid

    run(agent, body)


def kernel_children(pid: int) -> list[int]:
    out = subprocess.run(
        ["pgrep", "-P", str(pid), "-f", "interpreter.py --kernel"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    return [int(p) for p in out.split()]


def test_the_interpreter_starts_with_the_agent(agent: AgentProcess, tmp_path: Path) -> None:
    # Warm at boot, so a template's snapshot holds a ready interpreter.
    run(agent, lambda ch: ch.ping())
    for _ in range(400):
        if kernel_children(agent.proc.pid):
            break
        time.sleep(0.05)
    kernels = kernel_children(agent.proc.pid)
    assert len(kernels) == 1
    assert run(agent, lambda ch: ch.run_code("import os; os.getpid()")).text == str(kernels[0])

    (tmp_path / "cold").mkdir()
    cold = AgentProcess(tmp_path / "cold", "--cold-interpreter")
    try:
        run(cold, lambda ch: ch.ping())
        assert kernel_children(cold.proc.pid) == []
        run(cold, lambda ch: ch.run_code("1"))
        assert len(kernel_children(cold.proc.pid)) == 1
    finally:
        cold.stop()


def test_the_first_ping_says_how_the_connection_reached_the_agent(agent: AgentProcess) -> None:
    """The answer to connect()'s ping carries the agent's own stamps (its CLOCK_MONOTONIC,
    the host's here): the read that brought it, when it was served and answered, and, on a
    connection after a hang-up, the agent's idle turns in between."""

    def marks_of(ch: GuestChannel) -> dict[str, Any]:
        marks = dict(ch.guest_marks)
        assert marks["data"] <= marks["served"] <= marks["answered"]
        assert marks["answered"] <= marks["answered_at"]  # one clock on a single host
        return marks

    first = run(agent, lambda ch: asyncio.sleep(0, marks_of(ch)))
    second = run(agent, lambda ch: asyncio.sleep(0, marks_of(ch)))
    assert second["turns"], "the agent waited for the host between the two connections"
    assert first["answered"] <= second["turns"][0] <= second["turns"][-1] <= second["data"]


def test_wake_split_places_the_guest_stamps_after_cont() -> None:
    from torpor.sandbox.vm.channel import wake_split

    # the guest's clock stood still while stopped: its idle turn at 3.99 came before the
    # stop, the one at 4.01 after the cont; the answer was ready at 4.1 (guest), received at
    # 100.1 (host) where cont returned at 100.0
    marks = {
        "turns": [3.99, 4.01],
        "host_seen": 4.03,
        "data": 4.05,
        "served": 4.07,
        "answered": 4.1,
        "answered_at": 100.1,
    }
    split = wake_split(marks, 100.0)
    assert split == pytest.approx(
        {
            "first_turn": 10.0,
            "host_seen": 30.0,
            "data": 50.0,
            "served": 70.0,
            "answered": 100.0,
            "received": 100.0,
        }
    )
    assert wake_split({}, 100.0) == {}  # an older agent sends no stamps
