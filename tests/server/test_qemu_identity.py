"""One identity on a real VM: a user's token reaches its own sandbox and not another's, across
a real server process (the sandbox half of tests/server/test_identity.py, without fakes)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.served import stop_server_and_vms
from torpor.client import Runtime, Sandbox
from torpor.errors import AccessDenied, SandboxNotFound

pytestmark = pytest.mark.qemu


@pytest.fixture
def home(qemu_home: Path) -> Iterator[Path]:
    yield qemu_home
    stop_server_and_vms(qemu_home)


def test_a_users_token_reaches_its_own_vm_only(home: Path) -> None:
    owner = Runtime(home=home)  # the local socket: the home's owner, auto-started server
    mine = owner.tokens.create(sandboxes={"user": "u-42"}, grants=[("write", "app/a/user/u-42")])
    theirs = owner.tokens.create(sandboxes={"user": "u-43"})
    me = Runtime(home=home, token=mine.token, autostart=False)
    them = Runtime(home=home, token=theirs.token, autostart=False)

    sbx = Sandbox.create(name="agent-u-42", runtime=me)
    assert sbx.info.labels == {"user": "u-42"}
    sbx.interpreter.run("notes = ['prefers weekly summaries']")
    me.memory.scope(app="a", user="u-42").remember("prefers weekly summaries")

    assert Sandbox.list(runtime=them) == []
    for attempt in (
        lambda: Sandbox.get("agent-u-42", runtime=them),
        lambda: them.request("POST", f"/v1/sandboxes/{sbx.id}/pause"),
        lambda: them.request("DELETE", f"/v1/sandboxes/{sbx.id}"),
        lambda: them.request("POST", f"/v1/sandboxes/{sbx.id}/commands", json={"cmd": "id"}),
    ):
        with pytest.raises(SandboxNotFound):
            attempt()
    # nor can its owner hand a copy to the other user by labelling a fork
    with pytest.raises(AccessDenied):
        me.request("POST", f"/v1/sandboxes/{sbx.id}/fork", json={"labels": {"user": "u-43"}})
    # untouched: still running, RAM intact, and its owner can pause and wake it
    again = Sandbox.get("agent-u-42", runtime=me)
    assert again.info.state.value == "running"
    again.pause()
    woke = Sandbox.get_or_create("agent-u-42", runtime=me)
    assert woke.interpreter.run("notes").results[0].data["text/plain"] == (
        "['prefers weekly summaries']"
    )
    denied = [e for e in owner.memory.audit_log(limit=100) if not e.allowed]
    assert len(denied) >= 5
    woke.kill()
