"""``torpor serve`` as a real process (real SandboxManager, no VMs): signals, TCP, tokens, CLI."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from torpor.client import Runtime, Sandbox
from torpor.client._local import is_alive
from torpor.errors import AccessDenied, InvalidArgument, InvalidName, TorporError
from torpor.server.auth import TokenStore, add_token, new_token
from torpor.server.daemon import server_pid


def _serve(home: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "torpor.cli", "serve", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "TORPOR_HOME": str(home)},
    )


def _wait(check: object, proc: subprocess.Popen[str], seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not check():  # type: ignore[operator]
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        assert time.monotonic() < deadline, "server did not come up"
        time.sleep(0.1)


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "h"
    pid = server_pid(tmp_path / "h")
    if pid is not None:
        os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_stops_cleanly(home: Path, sig: signal.Signals) -> None:
    proc = _serve(home)
    _wait(lambda: is_alive(home / "server.sock"), proc)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "torpor server stopped" in out  # the lifespan closed the manager
    assert not (home / "server.sock").exists()
    assert server_pid(home) is None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_tcp_with_tokens(home: Path, tmp_path: Path) -> None:
    token_file = tmp_path / "tokens.json"
    made = subprocess.run(
        [
            sys.executable,
            "-m",
            "torpor.cli",
            "server",
            "token",
            "acme",
            "--token-file",
            str(token_file),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    token = made.stdout.strip()
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert json.loads(token_file.read_text()) == {"tokens": {token: "acme"}}
    port = _free_port()
    proc = _serve(home, "--host", "127.0.0.1", "--port", str(port), "--token-file", str(token_file))
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return bool(Runtime(url=url, token=token).health()["tenant"] == "acme")
        except TorporError:  # not listening yet
            return False

    try:
        _wait(up, proc)
        assert Sandbox.list(runtime=Runtime(url=url, token=token)) == []
        with pytest.raises(AccessDenied):
            Sandbox.list(runtime=Runtime(url=url, token=new_token()))
        with pytest.raises(AccessDenied):
            Sandbox.list(runtime=Runtime(url=url))
    finally:
        proc.terminate()
        proc.communicate(timeout=120)


def _cli(home: Path, *args: str) -> str:
    env = {**os.environ, "TORPOR_HOME": str(home)}
    env.pop("TORPOR_URL", None)
    env.pop("TORPOR_TOKEN", None)
    done = subprocess.run(
        [sys.executable, "-m", "torpor.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_tcp_with_store_tokens_live(home: Path) -> None:
    """No token file: the owner makes tokens over the local socket, TCP callers use them, and
    a revoke is effective on the next request (no restart)."""
    port = _free_port()
    proc = _serve(home, "--host", "127.0.0.1", "--port", str(port))
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return bool(Runtime(home=home, autostart=False).health()["ok"])
        except TorporError:
            return False

    try:
        _wait(up, proc)
        with pytest.raises(AccessDenied):  # TCP without a token
            Runtime(url=url).health()
        token = _cli(home, "token", "create", "--tenant", "acme", "--all-sandboxes").strip()
        rt = Runtime(url=url, token=token)
        assert rt.health()["tenant"] == "acme"
        assert Sandbox.list(runtime=rt) == []
        [row] = json.loads(_cli(home, "token", "ls", "--tenant", "acme", "--json"))
        assert row["tenant"] == "acme" and row["sandboxes"] == {} and not row["revoked"]
        assert token not in json.dumps(row)  # never the secret
        _cli(home, "token", "revoke", row["id"], "--tenant", "acme")
        with pytest.raises(AccessDenied):
            rt.health()
        with pytest.raises(AccessDenied):
            Sandbox.list(runtime=Runtime(url=url, token=new_token()))
    finally:
        proc.terminate()
        proc.communicate(timeout=120)


@pytest.mark.parametrize(
    "content",
    [
        pytest.param("not json", id="not-json"),
        pytest.param('{"tokens": {}}', id="empty"),
        pytest.param('{"tokens": {"short": "acme"}}', id="short-token"),
        pytest.param('{"tokens": {"%s": "Bad Tenant"}}' % ("x" * 32), id="bad-tenant"),
    ],
)
def test_bad_token_files(tmp_path: Path, content: str) -> None:
    path = tmp_path / "tokens.json"
    path.write_text(content)
    with pytest.raises(InvalidArgument):
        TokenStore.load(path)


def test_add_token_keeps_existing_ones(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    first = add_token(path, "acme")
    second = add_token(path, "globex")
    store = TokenStore.load(path)
    assert store.tenants() == {first: "acme", second: "globex"}
    with pytest.raises(InvalidName):
        add_token(path, "Not A Tenant")


def test_server_status_and_stop_commands(home: Path) -> None:
    env = {**os.environ, "TORPOR_HOME": str(home), "COLUMNS": "200"}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "torpor.cli", *args],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            check=False,
        )

    assert cli("server", "status").returncode == 1
    pid = Runtime(home=home).health()["pid"]  # auto-start
    status = cli("server", "status")
    assert status.returncode == 0 and str(pid) in status.stdout
    stop = cli("server", "stop")
    assert stop.returncode == 0 and f"stopped server pid {pid}" in stop.stdout
    assert server_pid(home) is None
