"""The server, the SDK and real QEMU microVMs, across OS processes.

Each test gets a fresh home (``qemu_home``) sharing the built ``python`` template; the server
is the real daemon, started by the SDK's auto-start as a user's first call would.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.served import stop_server_and_vms
from torpor.client import Runtime, Sandbox
from torpor.server.daemon import server_pid, stop_server

pytestmark = pytest.mark.qemu

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def home(qemu_home: Path) -> Iterator[Path]:
    """``qemu_home``, and no server or VM left behind afterwards."""
    yield qemu_home
    stop_server_and_vms(qemu_home)


def _python(code: str, home: Path) -> str:
    """Run ``code`` in a new Python process against ``home``; return its stdout."""
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
        env={**os.environ, "TORPOR_HOME": str(home)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_demo_scenario_across_two_processes(home: Path) -> None:
    """examples/demo.py: auto-start, create, state, pause; a second process wakes it intact."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "demo.py")],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, "TORPOR_HOME": str(home)},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "reused:   True" in proc.stdout
    assert "notes:    ['prefers weekly summaries']" in proc.stdout
    assert "http:     200" in proc.stdout
    assert "(source verified: True)" in proc.stdout  # memory fact citing the sandbox's file
    assert "usage:    user=u-42:" in proc.stdout  # metered from its transitions
    assert server_pid(home) is not None  # the auto-started server keeps running
    info = Sandbox.get("agent-u-42", runtime=Runtime(home=home, autostart=False)).info
    assert info.state.value == "paused"


def test_sigkilled_server_restarts_and_sandboxes_keep_ram(home: Path) -> None:
    """SIGKILL the server with one sandbox paused and one running; the next call starts a new
    server, and both answer with the interpreter state they had."""
    rt = Runtime(home=home)
    paused = Sandbox.create(name="p", runtime=rt)
    paused.interpreter.run("secret = 'kept-while-paused'")
    paused.pause()
    running = Sandbox.create(name="r", runtime=rt)
    running.interpreter.run("secret = 'kept-while-running'")
    old = rt.health()["pid"]

    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while server_pid(home) is not None:
        assert time.monotonic() < deadline, "the killed server still holds its lock"
        time.sleep(0.05)

    rt2 = Runtime(home=home)  # auto-starts a new server, which reconciles the registry
    p = Sandbox.get_or_create("p", runtime=rt2)
    assert rt2.health()["pid"] != old
    assert p.id == paused.id and p.info.reused
    assert p.interpreter.run("secret").text == "'kept-while-paused'"
    r = Sandbox.get_or_create("r", runtime=rt2)
    assert r.id == running.id
    assert r.interpreter.run("secret").text == "'kept-while-running'"

    # A clean stop (SIGTERM) pauses what runs, so no QEMU outlives the server.
    assert stop_server(home, timeout=120) is not None
    states = {i.name: i.state.value for i in Sandbox.list(runtime=Runtime(home=home))}
    assert states == {"p": "paused", "r": "paused"}


def test_concurrent_get_or_create_from_processes(home: Path) -> None:
    """Four processes ask for the same name at once (the first also starts the server): one
    sandbox, created once, reused three times; left alone, the server's idle supervisor
    pauses it."""
    code = (
        "from torpor.client import Sandbox\n"
        "s = Sandbox.get_or_create('shared', idle_pause_seconds=3)\n"
        "print(s.id, s.info.reused)\n"
    )
    env = {**os.environ, "TORPOR_HOME": str(home)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(4)
    ]
    answers = []
    for proc in procs:
        out, err = proc.communicate(timeout=400)
        assert proc.returncode == 0, err[-3000:]
        sid, reused = out.split()
        answers.append((sid, reused == "True"))
    assert len({sid for sid, _ in answers}) == 1
    assert sorted(reused for _, reused in answers) == [False, True, True, True]
    listed = Sandbox.list(runtime=Runtime(home=home, autostart=False))
    assert [i.name for i in listed] == ["shared"]
    # Files written by one process are seen by another.
    _python(
        "from torpor.client import Sandbox\n"
        "Sandbox.get('shared').files.write('/workspace/x', 'from-a')\n",
        home,
    )
    assert (
        _python(
            "from torpor.client import Sandbox\n"
            "print(Sandbox.get('shared').files.read_text('/workspace/x'))\n",
            home,
        ).strip()
        == "from-a"
    )
    rt = Runtime(home=home, autostart=False)
    deadline = time.monotonic() + 120
    while Sandbox.get("shared", runtime=rt).info.state.value != "paused":
        assert time.monotonic() < deadline, "the idle supervisor did not pause the sandbox"
        time.sleep(0.5)
