"""The SDK against a real HTTP server (in-process, fake manager): calls, errors, streaming."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from torpor.client import AsyncRuntime, AsyncSandbox, Runtime, Sandbox, Snapshot
from torpor.client.calls import Call
from torpor.errors import (
    AccessDenied,
    InvalidArgument,
    InvalidName,
    InvalidState,
    NotFound,
    PathNotFound,
    PayloadTooLarge,
    SandboxClosed,
    SandboxNotFound,
    ServerUnavailable,
    TemplateNotFound,
    TorporError,
)
from torpor.sandbox.models import SandboxInfo

if TYPE_CHECKING:
    from tests.client.conftest import Served


def test_lifecycle(served: Served) -> None:
    rt = served.runtime
    sbx = Sandbox.create(name="agent-1", labels={"user": "u-1"}, idle_pause_seconds=60, runtime=rt)
    assert sbx.name == "agent-1" and sbx.id.startswith("sbx-")
    assert sbx.info.state.value == "running" and sbx.info.labels == {"user": "u-1"}
    Sandbox.create(name="agent-2", labels={"user": "u-2"}, runtime=rt)
    assert [i.name for i in Sandbox.list(labels={"user": "u-2"}, runtime=rt)] == ["agent-2"]
    assert Sandbox.get("agent-1", runtime=rt).id == sbx.id
    assert sbx.pause().state.value == "paused"
    assert sbx.info.state.value == "paused"
    assert sbx.resume().state.value == "running"
    sbx.kill()
    assert str(sbx.info.state.value) == "stopped"
    assert [i.name for i in Sandbox.list(runtime=rt)] == ["agent-2"]
    assert len(Sandbox.list(include_stopped=True, runtime=rt)) == 2


def test_get_or_create_marks_reuse_and_info_keeps_it(served: Served) -> None:
    first = Sandbox.get_or_create("agent-u-42", runtime=served.runtime)
    again = Sandbox.get_or_create("agent-u-42", runtime=served.runtime)
    assert first.info.reused is False
    assert again.id == first.id and again.info.reused is True


def test_context_manager_kills(served: Served) -> None:
    with Sandbox.create(runtime=served.runtime) as sbx:
        sid = sbx.id
        sbx.kill()  # killing inside the block is fine: exit does not fail
    assert served.manager.infos[sid].state.value == "stopped"


def test_errors_are_rebuilt_as_their_classes(served: Served) -> None:
    rt = served.runtime
    with pytest.raises(SandboxNotFound) as info:
        Sandbox.get("ghost", runtime=rt)
    assert info.value.data["name"] == "ghost"
    with pytest.raises(TemplateNotFound):
        Sandbox.create("ruby", runtime=rt)
    with pytest.raises(InvalidName):
        Sandbox.create(name="Not OK", runtime=rt)
    sbx = Sandbox.create(runtime=rt)
    with pytest.raises(InvalidState) as state:
        sbx.resume()
    assert state.value.data["required"] == ["paused"]
    sbx.kill()
    with pytest.raises(SandboxClosed):
        sbx.commands.run("echo hi")


@pytest.mark.parametrize("name", ["", ".", ".."])
def test_an_empty_or_dot_name_is_invalid_on_both_transports(
    tcp_served: tuple[object, str], served: Served, name: str
) -> None:
    """Over TCP httpx drops a "." segment, so the path named the list (and "" drew a
    redirect): the SDK parsed that as one sandbox and raised pydantic's or json's errors."""
    _, url = tcp_served
    for rt in (Runtime(url=url, token="a" * 32), served.runtime):
        with pytest.raises(InvalidArgument):
            Sandbox.get(name, runtime=rt)
        with pytest.raises(InvalidArgument):
            Sandbox.get_or_create(name, runtime=rt)
        with pytest.raises(InvalidArgument):
            Snapshot.get(name, runtime=rt)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"expires_in_seconds": 0},
        {"name": "x" * 201},
        {"grants": [("read", 3)]},
        {"grants": [("read", None)]},
        {"sandboxes": ["user"]},
        {"sandboxes": "user=u-42"},
    ],
)
def test_a_bad_token_spec_is_invalid_argument(served: Served, kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidArgument):
        served.runtime.tokens.create(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("token_id", ["", ".", "..", "../sandboxes/{sid}"])
def test_revoke_sends_the_token_id_as_one_path_segment(
    tcp_served: tuple[object, str], served: Served, token_id: str
) -> None:
    """The id went into the path unquoted: ``revoke("../sandboxes/<id>")`` sent
    ``DELETE /v1/sandboxes/<id>`` and killed that sandbox, and ``revoke("")`` drew a redirect
    that the SDK took for a success."""
    _, url = tcp_served
    for rt in (Runtime(url=url, token="a" * 32), served.runtime):
        sbx = Sandbox.create(runtime=rt)
        with pytest.raises((InvalidArgument, NotFound)):
            rt.tokens.revoke(token_id.format(sid=sbx.id))
        assert sbx.info.state.value == "running"


def test_text_a_url_cannot_carry_is_invalid_argument(
    tcp_served: tuple[object, str], served: Served
) -> None:
    """A lone surrogate in an id, a name, a path or a scope cannot be encoded into a URL:
    both clients raised a raw UnicodeEncodeError (from quote or the query's encoding)."""
    _, url = tcp_served
    for rt in (Runtime(url=url, token="a" * 32), served.runtime):
        sbx = Sandbox.create(runtime=rt)
        with pytest.raises(InvalidArgument):
            Sandbox.get("\ud800", runtime=rt)
        with pytest.raises(InvalidArgument):
            sbx.files.read("/workspace/\ud800")
        with pytest.raises(InvalidArgument):
            rt.memory.scope_from_path("app/\ud800")
        with pytest.raises(InvalidArgument):
            rt.memory.forget("\ud800")
        with pytest.raises(InvalidArgument):  # unquoted, it collapsed into another path
            rt.drain_node("..")

    async def run() -> None:
        for rt in (
            AsyncRuntime(url=url, token="a" * 32),
            AsyncRuntime(home=served.home, autostart=False),
        ):
            async with rt:
                sbx = await rt.sandboxes.create()
                with pytest.raises(InvalidArgument):
                    await rt.sandboxes.get("\ud800")
                with pytest.raises(InvalidArgument):
                    await sbx.files.read("/workspace/\ud800")
                with pytest.raises(InvalidArgument):
                    await rt.memory.scope_from_path("app/\ud800")
                with pytest.raises(InvalidArgument):
                    await rt.memory.forget("\ud800")

    asyncio.run(run())


def test_an_answer_that_is_not_json_is_a_typed_error(
    tcp_served: tuple[object, str], served: Served
) -> None:
    """A 200 that is no torpor answer (a captive portal's page, a cut line) raised json's own
    ``JSONDecodeError``; the server's ``/docs`` page stands in for one."""
    _, url = tcp_served
    for rt in (Runtime(url=url, token="a" * 32), served.runtime):
        with pytest.raises(ServerUnavailable, match="not JSON"):
            rt.json("GET", "/docs")
        with pytest.raises(ServerUnavailable, match="not JSON"):
            rt.do(Call("GET", "/docs"))
        with pytest.raises(ServerUnavailable), rt.stream_events("GET", "/docs") as events:
            list(events)

    async def main() -> None:
        async with AsyncRuntime(url=url, token="a" * 32) as rt:
            with pytest.raises(ServerUnavailable, match="not JSON"):
                await rt.json("GET", "/docs")
            with pytest.raises(ServerUnavailable, match="not JSON"):
                await rt.do(Call("GET", "/docs"))

    asyncio.run(main())
    with pytest.raises(InvalidArgument):  # a URL would collapse ".." into another route
        served.runtime.memory.scope(app="a").get("..")


def test_a_redirect_is_an_error_not_an_answer(
    tcp_served: tuple[object, str], served: Served
) -> None:
    """A 3xx (a slash the router moves, a proxy sending http to https) counted as success:
    ``request`` returned it, and ``json``/``do`` raised json's own error on its empty body."""
    _, url = tcp_served
    for rt in (Runtime(url=url, token="a" * 32), served.runtime):
        with pytest.raises(TorporError) as info:
            rt.request("GET", "/v1/sandboxes/")
        assert info.value.data["status"] == 307
        with pytest.raises(TorporError):
            rt.do(Call("GET", "/v1/sandboxes/"))
        with pytest.raises(TorporError), rt.stream_lines("GET", "/v1/sandboxes/") as lines:
            list(lines)

    async def main() -> None:
        for rt in (
            AsyncRuntime(url=url, token="a" * 32),
            AsyncRuntime(home=served.home, autostart=False),
        ):
            async with rt:
                with pytest.raises(TorporError) as info:
                    await rt.request("GET", "/v1/sandboxes/")
                assert info.value.data["status"] == 307
                with pytest.raises(TorporError):
                    await rt.do(Call("GET", "/v1/sandboxes/"))
                with pytest.raises(TorporError):
                    async with rt.stream_lines("GET", "/v1/sandboxes/") as lines:
                        [line async for line in lines]

    asyncio.run(main())


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf"), "soon"])
def test_a_runtime_timeout_out_of_range_is_invalid_argument(
    tcp_served: tuple[object, str], served: Served, timeout: object
) -> None:
    """Such a timeout was taken, and the first call raised the socket's ValueError or
    OverflowError (0: ServerUnavailable from the sync client, OperationTimeout from the async
    one)."""
    _, url = tcp_served
    for kwargs in ({"home": served.home, "autostart": False}, {"url": url}):
        with pytest.raises(InvalidArgument):
            Runtime(timeout=timeout, **kwargs)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument):
            AsyncRuntime(timeout=timeout, **kwargs)  # type: ignore[arg-type]
    assert Runtime(home=served.home, autostart=False, timeout=None).health()["ok"]


@pytest.fixture
def proxy_413() -> Iterator[str]:
    """A proxy in front of the server that refuses every body as too large, in its own words
    (an HTML page, as nginx's ``client_max_body_size``); yields its base URL."""
    listener = socket.create_server(("127.0.0.1", 0))
    page = b"<html><body><h1>413 Request Entity Too Large</h1></body></html>"
    answer = (
        b"HTTP/1.1 413 Request Entity Too Large\r\nContent-Type: text/html\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(page), page)
    )

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                conn.sendall(answer)

    threading.Thread(target=serve, daemon=True).start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    listener.close()


def test_a_proxys_413_is_payload_too_large(proxy_413: str) -> None:
    """A 413 whose body is not the server's error (a proxy's page) was a plain TorporError:
    ``except PayloadTooLarge`` around ``files.write`` missed it."""
    info = SandboxInfo.model_validate(
        {
            "id": "sbx-1",
            "name": "sbx-1",
            "template": "python",
            "state": "running",
            "created_at": 0,
            "last_active_at": 0,
        }
    )
    with pytest.raises(PayloadTooLarge):
        Sandbox(info, Runtime(url=proxy_413)).files.write("/workspace/big", b"x" * 1000)

    async def main() -> None:
        async with AsyncRuntime(url=proxy_413) as rt:
            with pytest.raises(PayloadTooLarge):
                await AsyncSandbox(info, rt).files.write("/workspace/big", b"x" * 1000)

    asyncio.run(main())


def test_commands(served: Served) -> None:
    sbx = Sandbox.create(runtime=served.runtime)
    result = sbx.commands.run("echo hello", env={"A": "1"}, cwd="/w")
    assert (result.exit_code, result.stdout) == (0, "hello\nA=1\ncwd=/w\n")
    assert sbx.commands.run("fail").exit_code == 3
    assert sbx.commands.run("srv", background=True).pid == 4242


def test_streamed_command_calls_back_in_order(served: Served) -> None:
    sbx = Sandbox.create(runtime=served.runtime)
    out: list[str] = []
    err: list[str] = []
    result = sbx.commands.run("echo a b c", on_stdout=out.append, on_stderr=err.append)
    assert out == ["a\n", "b\n", "c\n"] and err == []
    assert result.stdout == "a\nb\nc\n"
    assert sbx.commands.run("fail", on_stderr=err.append).exit_code == 3
    assert err == ["bad\n"]


def test_streamed_command_raises_the_servers_error(served: Served) -> None:
    sbx = Sandbox.create(runtime=served.runtime)
    sbx.kill()
    with pytest.raises(SandboxClosed):
        sbx.commands.run("echo x", on_stdout=print)


def test_files(served: Served) -> None:
    sbx = Sandbox.create(runtime=served.runtime)
    sbx.files.write("/workspace/memory.md", "# notes\n- weekly ✓\n")
    sbx.files.write("/workspace/blob", bytes(range(256)))
    assert sbx.files.read_text("/workspace/memory.md") == "# notes\n- weekly ✓\n"
    assert sbx.files.read("/workspace/blob") == bytes(range(256))
    assert sbx.files.exists("/workspace/blob")
    assert [e.name for e in sbx.files.list("/workspace")] == ["blob", "memory.md"]
    sbx.files.make_dir("/workspace/d")
    sbx.files.remove("/workspace/blob")
    assert not sbx.files.exists("/workspace/blob")
    with pytest.raises(PathNotFound):
        sbx.files.read("/workspace/blob")


def test_file_over_the_limit(served: Served) -> None:
    sbx = Sandbox.create(runtime=served.runtime)
    with pytest.raises(PayloadTooLarge) as info:
        sbx.files.write("/big", b"x" * 5000)
    assert info.value.data["limit"] == 4096


def test_interpreter(served: Served) -> None:
    sbx = Sandbox.create(runtime=served.runtime)
    sbx.interpreter.run("notes = ['prefers weekly summaries']")
    sbx.pause()  # wakes on the next call
    execution = sbx.interpreter.run("notes")
    assert execution.results[0].data["text/plain"] == "['prefers weekly summaries']"
    assert execution.text == "['prefers weekly summaries']"


def test_interpreter_streams_prints(served: Served) -> None:
    sbx = Sandbox.create(runtime=served.runtime)
    lines: list[str] = []
    execution = sbx.interpreter.run("for i in range(3): print(i)", on_stdout=lines.append)
    assert lines == ["0\n", "1\n", "2\n"] and execution.stdout == "0\n1\n2\n"


def test_dead_server_is_server_unavailable(tmp_path: Path) -> None:
    rt = Runtime(home=tmp_path, autostart=False)
    with pytest.raises(ServerUnavailable):
        Sandbox.list(runtime=rt)
    with pytest.raises(ServerUnavailable):
        Sandbox.get("x", runtime=rt).commands.run("echo", on_stdout=print)


def test_remote_runtime_with_token(tcp_served: tuple[object, str]) -> None:
    _, url = tcp_served
    acme = Runtime(url=url, token="a" * 32)
    globex = Runtime(url=url, token="b" * 32)
    sbx = Sandbox.create(name="agent-x", runtime=acme)
    assert sbx.info.tenant == "acme" and acme.health()["tenant"] == "acme"
    with pytest.raises(SandboxNotFound):
        Sandbox.get(sbx.id, runtime=globex)
    assert Sandbox.list(runtime=globex) == []
    with pytest.raises(AccessDenied):
        Sandbox.list(runtime=Runtime(url=url, token="c" * 32))


def test_environment_selects_a_remote_server(
    tcp_served: tuple[object, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, url = tcp_served
    monkeypatch.setenv("TORPOR_URL", url)
    monkeypatch.setenv("TORPOR_TOKEN", "b" * 32)
    rt = Runtime()
    assert rt.url == url and rt.paths is None and not rt.autostart
    assert rt.health()["tenant"] == "globex"
    # an explicit home means the local server, whatever the environment says
    assert Runtime(home="/nonexistent").url is None


def test_leaving_a_block_pauses_a_named_sandbox_and_kills_a_made_one(served: Served) -> None:
    """A persistent agent's machine reached by name survives ``with``; one made for the block
    does not (issue: leaving a get_or_create block killed the user's sandbox)."""
    rt = served.runtime
    with Sandbox.get_or_create("agent-u-101", runtime=rt) as kept:
        kept.files.write("/workspace/notes.md", "kept")
    assert Sandbox.get("agent-u-101", runtime=rt).info.state.value == "paused"
    again = Sandbox.get_or_create("agent-u-101", runtime=rt)
    assert again.info.reused and again.id == kept.id  # the same machine, not a new one
    with Sandbox.get("agent-u-101", runtime=rt):
        pass
    assert Sandbox.get("agent-u-101", runtime=rt).info.state.value == "paused"
    with Sandbox.get("agent-u-101", runtime=rt):  # leaving a paused one: nothing to do
        pass
    with Sandbox.create(name="scratch", runtime=rt) as scratch:
        pass
    assert Sandbox.get(scratch.id, runtime=rt).info.state.value == "stopped"


def test_a_terminal_that_starts_after_its_caller_gave_up_is_hung_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``sbx.pty.create`` raised OperationTimeout when the program had not started in time,
    but its thread kept the stream open: a program that started later ran on for nobody (no
    handle was returned to kill it). The stream is hung up now, which kills it."""
    import types

    import torpor.client.pty
    from tests.client.conftest import _run as serve
    from tests.server.fake_manager import FakeManager
    from torpor.errors import OperationTimeout
    from torpor.server.app import create_app
    from torpor.server.daemon import bind_unix_socket

    hung_up = threading.Event()

    class SlowTerminals(FakeManager):
        async def open_pty(self, id_or_name: str, spec: object, on_data: object, **_: object):  # type: ignore[no-untyped-def]
            await asyncio.sleep(1.0)  # a wake that takes long
            done = asyncio.get_running_loop().create_future()
            done.add_done_callback(lambda f: hung_up.set() if f.cancelled() else None)
            return types.SimpleNamespace(id="pty-1", pid=7, done=done)

    monkeypatch.setattr(torpor.client.pty, "START_TIMEOUT", 0.3)
    app = create_app(SlowTerminals(), supervise=False)
    for _ in serve(app, bind_unix_socket(tmp_path / "server.sock")):
        with Runtime(home=tmp_path, autostart=False) as rt:
            sbx = Sandbox.create(runtime=rt)
            with pytest.raises(OperationTimeout):
                sbx.pty.create("bash")
            assert hung_up.wait(10), "the terminal's stream was kept open after the timeout"
