"""``AsyncSandbox`` (``torpor.AsyncRuntime(...).sandboxes``): the sync handle's shape, awaited.

* the shared requests and answers (:mod:`torpor.client.sandbox_calls`), without a server;
* the async handle end to end through a real server on a unix socket over the fake manager;
* one QEMU test: create, run, pause, wake (state intact), kill, through the real daemon.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import torpor
from tests.client.conftest import Served
from tests.served import stop_server_and_vms
from torpor.client import Sandbox
from torpor.client import sandbox_calls as calls
from torpor.client.aio_sandbox import AsyncSandbox, AsyncSandboxes
from torpor.client.calls import Call
from torpor.errors import (
    InvalidArgument,
    OperationTimeout,
    PathNotFound,
    SandboxNotFound,
)
from torpor.sandbox.models import CommandResult, SandboxInfo
from torpor.sandbox.requests import CommandSpec, SandboxOptions, SandboxSpec

INFO = {
    "id": "sbx-0123456789ab",
    "name": "agent u/42",
    "tenant": "acme",
    "state": "running",
    "template": "python",
    "created_at": "2026-11-30T12:00:00Z",
    "last_active_at": "2026-11-30T12:00:00Z",
}


def _answer(call: Call[Any], body: bytes, status: int = 200) -> Any:
    request = httpx.Request(call.method, "http://torpor" + call.path)
    return call.read(httpx.Response(status, content=body, request=request))


# -- the shared calls ------------------------------------------------------------------------


def test_calls_build_the_requests_both_clients_send() -> None:
    c = calls.get_or_create("agent u/42", SandboxOptions.of(labels={"user": "u-42"}))
    assert (c.method, c.path) == ("PUT", "/v1/sandboxes/by-name/agent%20u%2F42")
    kwargs = c.request_kwargs()
    assert json.loads(kwargs["content"]) == {"labels": {"user": "u-42"}}
    assert kwargs["headers"] == {"content-type": "application/json"} and "timeout" not in kwargs

    # a command's HTTP call outlives the command by the slack a wake may take; None: no limit
    run = calls.run_command("s1", CommandSpec.of(cmd="sleep 1", timeout=30))
    assert run.request_kwargs()["timeout"] == 30 + calls.SLACK
    assert calls.stream_path(run) == "/v1/sandboxes/s1/commands/stream"
    assert calls.run_command("s1", CommandSpec.of(cmd="x", timeout=None)).timeout is None

    # a plain create keeps the runtime's timeout, a restore gets the long one
    assert "timeout" not in calls.create(SandboxSpec.of()).request_kwargs()
    assert calls.create(SandboxSpec.of(snapshot="snap-1")).timeout == calls.LONG_TIMEOUT

    put = calls.write_file("s1", "/w/a.txt", "héllo")
    assert put.request_kwargs()["content"] == "héllo".encode()
    assert put.request_kwargs()["headers"] == {"content-type": "application/octet-stream"}
    listed = calls.list_sandboxes({"user": "u-42", "tier": "pro"}, include_stopped=True)
    assert listed.params == [("label", "user=u-42"), ("label", "tier=pro"), ("all", "true")]


def test_calls_read_the_answers() -> None:
    info = _answer(calls.get("x"), json.dumps(INFO).encode())
    assert isinstance(info, SandboxInfo) and info.name == "agent u/42"
    many = _answer(calls.fork("x", _fork_spec()), json.dumps([INFO, INFO]).encode())
    assert [type(i) for i in many] == [SandboxInfo, SandboxInfo]
    assert _answer(calls.read_file("x", "/a"), b"\x00\xffraw") == b"\x00\xffraw"
    assert _answer(calls.logs("x", 5), b"line one\n") == "line one\n"
    assert _answer(calls.kill("x"), b"", status=204) is None
    assert _answer(calls.exists("x", "/a"), b'{"exists": false}') is False


def _fork_spec() -> Any:
    from torpor.sandbox.requests import ForkSpec

    return ForkSpec.of(count=2)


def test_stream_events_are_fed_then_the_result_or_the_typed_error() -> None:
    out: list[str] = []
    err: list[str] = []
    assert (
        calls.feed({"type": "stdout", "data": "a"}, CommandResult, out.append, err.append) is None
    )
    assert (
        calls.feed({"type": "stderr", "data": "b"}, CommandResult, out.append, err.append) is None
    )
    assert calls.feed({"type": "stdout", "data": "c"}, CommandResult, None, None) is None
    result = {"exit_code": 0, "stdout": "ac", "stderr": "b"}
    done = calls.feed({"type": "result", "result": result}, CommandResult, out.append, None)
    assert isinstance(done, CommandResult) and done.stdout == "ac"
    assert (out, err) == (["a"], ["b"])
    wire = OperationTimeout("command timed out", seconds=3).to_wire()
    with pytest.raises(OperationTimeout) as caught:
        calls.feed({"type": "error", "error": wire}, CommandResult, None, None)
    assert caught.value.data["seconds"] == 3


def test_the_async_handle_has_the_sync_handles_shape() -> None:
    assert torpor.AsyncSandbox is AsyncSandbox and "AsyncSandbox" in torpor.__all__
    for name in ("pause", "resume", "kill", "set", "set_retention", "snapshot", "fork", "logs"):
        assert inspect.iscoroutinefunction(getattr(AsyncSandbox, name)), name
        sync = _sync_fork() if name == "fork" else getattr(Sandbox, name)
        mine = list(inspect.signature(getattr(AsyncSandbox, name)).parameters)
        assert mine[1:] == [p for p in inspect.signature(sync).parameters if p != "self"], name
    for name in ("create", "get_or_create", "get", "list"):
        made = set(inspect.signature(getattr(AsyncSandboxes, name)).parameters) - {"self"}
        theirs = set(inspect.signature(getattr(Sandbox, name)).parameters) - {"cls", "runtime"}
        assert made == theirs, name


def _sync_fork() -> Any:
    sbx = Sandbox.__new__(Sandbox)
    return sbx.fork  # the live-fork form of the descriptor


# -- end to end over a real server (fake manager) -------------------------------------------


def test_async_sandbox_through_a_server(served: Served) -> None:
    async def main() -> None:
        async with torpor.AsyncRuntime(home=served.home, autostart=False) as rt:
            sbx = await rt.sandboxes.get_or_create("agent-u-42", labels={"user": "u-42"})
            assert isinstance(sbx, AsyncSandbox) and not sbx.last_info.reused
            again = await rt.sandboxes.get_or_create("agent-u-42")
            assert again.id == sbx.id and again.last_info.reused
            assert (await sbx.commands.run("echo hi")).stdout == "hi\n"
            chunks: list[str] = []
            streamed = await sbx.commands.run("echo one two", on_stdout=chunks.append)
            assert streamed.exit_code == 0 and "".join(chunks) == streamed.stdout
            with pytest.raises(OperationTimeout):
                await sbx.commands.run("sleep 9", timeout=1, on_stdout=chunks.append)
            await sbx.files.write("/w/a.txt", "hello")
            assert await sbx.files.read_text("/w/a.txt") == "hello"
            with pytest.raises(PathNotFound):
                await sbx.files.read("/w/none")
            await sbx.interpreter.run("x = 41")
            assert (await sbx.interpreter.run("x + 1")).text == "42"
            assert (await sbx.pause()).state.value == "paused"
            assert (await sbx.info).state.value == "paused"
            assert (await sbx.resume()).state.value == "running"
            assert [i.id for i in await rt.sandboxes.list({"user": "u-42"})] == [sbx.id]
            assert (await rt.sandboxes.get("agent-u-42")).id == sbx.id
            with pytest.raises(InvalidArgument):  # refused before anything is sent
                await rt.sandboxes.create(vcpus=0)
            async with await rt.sandboxes.create(name="scratch") as tmp:
                assert tmp.name == "scratch"
            gone = await rt.sandboxes.get("scratch")  # left the block: killed
            assert gone.last_info.state.value == "stopped"
            await sbx.kill()
            assert (await sbx.info).state.value == "stopped"
            with pytest.raises(SandboxNotFound):
                await rt.sandboxes.get("no-such-sandbox")

    asyncio.run(main())


# -- a real VM ---------------------------------------------------------------------------------


@pytest.fixture
def qemu_served(qemu_home: Path) -> Iterator[Path]:
    yield qemu_home
    stop_server_and_vms(qemu_home)


@pytest.mark.qemu
def test_async_sandbox_in_a_real_vm(qemu_served: Path) -> None:
    async def main() -> None:
        async with torpor.AsyncRuntime(home=qemu_served) as rt:  # starts the local server
            sbx = await rt.sandboxes.create(name="async-vm")
            ran = await sbx.commands.run("echo $((6 * 7))")
            assert (ran.exit_code, ran.stdout) == (0, "42\n")
            await sbx.interpreter.run("notes = ['kept across pause']")
            assert (await sbx.pause()).state.value == "paused"
            woken = await sbx.interpreter.run("notes")  # wakes it
            assert woken.text == "['kept across pause']"
            assert (await sbx.info).state.value == "running"
            # a background process handle, awaited
            proc = await sbx.commands.start('read line; echo "got $line"')
            assert [i.pid for i in await sbx.commands.list()] == [proc.pid]
            await proc.send_stdin("hello\n")
            assert (await proc.wait(timeout=60)).stdout == "got hello\n"
            # a snapshot handle, restored and forked into async sandboxes
            snap = await sbx.snapshot("async-snap")
            assert isinstance(snap, torpor.AsyncSnapshot)
            restored = await snap.restore(name="async-restored")
            assert (await restored.interpreter.run("notes")).text == "['kept across pause']"
            [forked] = await snap.fork(1)
            assert (await forked.commands.run("echo forked")).stdout == "forked\n"
            for each in (restored, forked):
                await each.kill()
            await snap.delete()
            await sbx.kill()
            assert (await sbx.info).state.value == "stopped"

    asyncio.run(main())
