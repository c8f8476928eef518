"""``torpor nodes`` on the embedded default (no cluster): one row, this machine, over a real
server and manager (fake engine); ``torpor node drain`` there is one clean error line. The
cluster side is in tests/server/test_cluster_proxy.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.client.conftest import _run
from tests.sandbox.fakes import FakeEngine
from torpor.cli import main
from torpor.client import Runtime, set_default_runtime
from torpor.config import paths
from torpor.sandbox.manager import SandboxManager
from torpor.server.app import create_app
from torpor.server.daemon import bind_unix_socket


@pytest.fixture
def runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Runtime]:
    h = tmp_path / "h"
    monkeypatch.setenv("TORPOR_HOME", str(h))
    monkeypatch.delenv("TORPOR_URL", raising=False)
    app = create_app(SandboxManager(paths(h), engine=FakeEngine()), supervise=False)
    for _ in _run(app, bind_unix_socket(paths(h).socket)):
        rt = Runtime(home=h, autostart=False)
        set_default_runtime(rt)
        yield rt
        set_default_runtime(None)
        rt.close()


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        main(list(args))
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    got = capsys.readouterr()
    return code, got.out, got.err


def test_one_machine_lists_itself(runtime: Runtime, capsys: pytest.CaptureFixture[str]) -> None:
    runtime.sandboxes.create(name="a")
    code, out, err = _cli(capsys, "--json", "nodes")
    assert code == 0, err
    [row] = json.loads(out)
    assert row["name"] == "local" and row["this"] and row["alive"] and not row["draining"]
    assert row["sandboxes"] == 1 and row["memory_mib"] == 512
    assert row["heartbeat_age_seconds"] is None and row["capacity_mib"] > 0 and row["vcpus"] > 0
    code, out, err = _cli(capsys, "nodes")
    assert code == 0 and "local" in out and "1 sandboxes" in out
    code, out, err = _cli(capsys, "node", "drain", "local")
    assert code == 1 and "cluster mode" in err and "Traceback" not in err
