"""The guest's memory relay (``localhost:7777`` inside the VM), run as a real agent process
on the host (``agent.py --socket --relay-port``): an HTTP request to the relay becomes a
``call`` frame that the host's GuestChannel answers with its ``on_call`` handler."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.sandbox.test_guest_agent import AgentProcess
from torpor.sandbox.guest import relay
from torpor.sandbox.vm.channel import GuestChannel


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def wait_for_relay(url: str) -> None:
    async with httpx.AsyncClient() as http:
        for _ in range(200):
            try:
                await http.get(url)
                return
            except httpx.TransportError:
                await asyncio.sleep(0.05)
    raise AssertionError("the relay did not listen")


def test_a_request_to_the_relay_is_answered_by_the_host(tmp_path: Path) -> None:
    port = free_port()
    agent = AgentProcess(tmp_path, "--relay-port", str(port))
    seen: list[tuple[str, str, dict[str, str], bytes]] = []

    async def on_call(
        method: str, path: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, dict[str, str], bytes]:
        seen.append((method, path, headers, body))
        return 201, {"content-type": "application/json", "x-torpor": "yes"}, b'{"ok": true}'

    async def main() -> Any:
        channel = await GuestChannel.connect(agent.socket, timeout=20, on_call=on_call)
        try:
            url = f"http://127.0.0.1:{port}"
            await wait_for_relay(url + "/ready")
            async with httpx.AsyncClient() as http:
                r = await http.post(
                    url + "/v1/memory/recall?x=1",
                    json={"query": "tea"},
                    headers={"Authorization": "Bearer nope", "Accept": "application/json"},
                )
                big = await http.post(url + "/x", content=b"x" * (relay.MAX_BODY + 1))
            return r, big
        finally:
            await channel.close()

    try:
        r, big = asyncio.run(main())
    finally:
        agent.stop()
    assert r.status_code == 201 and r.json() == {"ok": True} and r.headers["x-torpor"] == "yes"
    method, path, headers, body = seen[-1]
    assert (method, path) == ("POST", "/v1/memory/recall?x=1")
    assert json.loads(body) == {"query": "tea"}
    assert "authorization" not in headers  # nothing but the content headers leaves the guest
    assert headers["accept"] == "application/json"
    assert big.status_code == 413 and big.json()["error"]["type"] == "PayloadTooLarge"


@pytest.mark.parametrize("handler", [False, True], ids=["no-handler", "host-hung-up"])
def test_without_a_host_answer_the_relay_says_so(tmp_path: Path, handler: bool) -> None:
    port = free_port()
    agent = AgentProcess(tmp_path, "--relay-port", str(port))

    async def main() -> httpx.Response:
        url = f"http://127.0.0.1:{port}"
        if not handler:  # connected, but this host answers no calls
            channel = await GuestChannel.connect(agent.socket, timeout=20)
            try:
                await wait_for_relay(url + "/ready")
                async with httpx.AsyncClient() as http:
                    return await http.get(url + "/mcp")
            finally:
                await channel.close()
        channel = await GuestChannel.connect(agent.socket, timeout=20)
        await channel.close()  # no host connected at all
        await wait_for_relay(url + "/ready")
        async with httpx.AsyncClient() as http:
            return await http.get(url + "/mcp")

    try:
        r = asyncio.run(main())
    finally:
        agent.stop()
    assert r.status_code == 503
    assert r.json()["error"]["type"] in ("TorporError", "ServerUnavailable")
