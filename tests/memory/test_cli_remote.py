"""``torpor memory`` against a remote server (``--url``/``--token`` or the environment)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from typer.testing import CliRunner

from tests.server.fake_manager import FakeManager
from torpor.cli import _load, app
from torpor.errors import AccessDenied, InvalidArgument
from torpor.server.app import create_app

_load()
runner = CliRunner()


@pytest.fixture
def server() -> Iterator[tuple[str, Any]]:
    """A TCP server (tokens required) in a thread; yields (url, app)."""
    web = create_app(FakeManager(), supervise=False, require_token=True, memory_embedder=None)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    srv = uvicorn.Server(uvicorn.Config(web, lifespan="on", log_level="warning"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not srv.started:
        assert thread.is_alive()
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", web
    srv.should_exit = True
    thread.join(30)
    sock.close()


def test_memory_cli_against_a_remote_server(
    server: tuple[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, web = server
    token = web.state.identity.tokens.issue("acme", [("write", "app/a/user/u")])
    monkeypatch.setenv("TORPOR_HOME", str(tmp_path / "nowhere"))  # nothing embedded is used

    def run(*args: str, scope: str = "app/a/user/u", env: bool = False) -> Any:
        opts = [] if env else ["--url", url, "--token", token]
        if env:
            monkeypatch.setenv("TORPOR_URL", url)
            monkeypatch.setenv("TORPOR_TOKEN", token)
        return runner.invoke(app, ["memory", *opts, "--scope", scope, *args])

    done = run("--json", "remember", "prefers daily summaries", "--key", "cadence")
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout)["scope"] == "app/a/user/u"
    assert run("log", "user", "send me summaries").exit_code == 0
    hits = json.loads(run("--json", "recall", "summaries", "-k", "3", env=True).stdout)
    assert "prefers daily summaries" in [h["text"] for h in hits]
    assert "prefers daily summaries" in run("context", "write an update").stdout
    export = tmp_path / "u.jsonl"
    assert run("export", str(export)).exit_code == 0
    assert len(export.read_text().splitlines()) == 3
    moved = run("--json", "import", str(export))
    assert json.loads(moved.stdout) == {"imported": 0}  # same scope, same ids
    assert not (tmp_path / "nowhere").exists()
    refused = run("recall", "summaries", scope="app/a/user/v")
    assert refused.exit_code != 0 and isinstance(refused.exception, AccessDenied)
    erased = run("--json", "forget", "--yes")
    assert json.loads(erased.stdout) == {"erased": 2}


def test_reindex_against_a_server_is_refused_not_run_on_the_local_store(
    server: tuple[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``reindex`` has no route: with ``--url`` it opened the local home's store instead (a
    stranger's token: "unknown or revoked token"; no token: the local store reindexed and its
    count reported as the server's)."""
    url, web = server
    token = web.state.identity.tokens.issue("acme", [("write", "")])
    monkeypatch.setenv("TORPOR_HOME", str(tmp_path / "nowhere"))
    for opts in (["--url", url, "--token", token], ["--url", url], ["--server"]):
        done = runner.invoke(app, ["memory", *opts, "reindex"])
        assert done.exit_code != 0 and isinstance(done.exception, InvalidArgument), opts
        assert "server" in str(done.exception)
    assert not (tmp_path / "nowhere").exists()  # nothing local opened
