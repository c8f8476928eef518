"""Real ``torpor serve --cluster`` node processes on this machine, for the cluster tests and
benchmarks (tests/cluster/test_node_loss.py, bench/cluster.py).

Each node is a server process of its own with a home of its own (its ``templates`` a symlink
to a built template home's, so no node builds one), on the one PostgreSQL and S3 store the
caller started (tests/pg.py, tests/s3.py). :func:`start_node` returns once the node answers
on its local socket; :func:`stop_node` stops it (SIGTERM, then SIGKILL), kills any QEMU left
in its home and deletes the home.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torpor
from torpor.errors import TorporError

__all__ = ["Node", "start_node", "stop_node"]

START_TIMEOUT = 120.0


@dataclass
class Node:
    """A running node: its name, home, URL (HTTP on 127.0.0.1), process and log file."""

    name: str
    home: Path
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def log_tail(self, lines: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text().splitlines()[-lines:])
        return "(no log)"


def start_node(
    name: str,
    port: int,
    dsn: str,
    store: str,
    templates: Path,
    env: dict[str, str],
    *,
    base: Path | None = None,
) -> Node:
    """Start ``torpor serve --cluster dsn --store store --node name`` on 127.0.0.1:``port``
    with a fresh home (under ``base``, default the system temp dir) and ``env`` (the S3
    credentials and endpoint among it); return once it answers. Raises RuntimeError with
    the node's log when it exits or does not answer in time."""
    home = Path(tempfile.mkdtemp(prefix=f"torpor-{name}-", dir=base))
    (home / "templates").symlink_to(templates)
    log = home.parent / f"{home.name}.log"
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "torpor.cli", "serve", "--host", "127.0.0.1"]
    command += ["--port", str(port), "--cluster", dsn, "--store", store, "--node", name]
    with open(log, "wb") as out:
        process = subprocess.Popen(
            command,
            env={**env, "TORPOR_HOME": str(home)},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    node = Node(name, home, url, process, log)
    deadline = time.monotonic() + START_TIMEOUT
    while not (home / "server.sock").exists() or not _answers(node):
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"node {name} did not start:\n{node.log_tail()}")
        time.sleep(0.2)
    return node


def _answers(node: Node) -> bool:
    try:
        with torpor.Runtime(home=node.home, autostart=False, timeout=5) as rt:
            rt.health()
        return True
    except TorporError:
        return False


def stop_node(node: Node, *, keep_log: bool = False) -> None:
    """Stop the node (SIGTERM: it pauses what it runs; SIGKILL after 150 s), kill any QEMU
    left on its sandboxes and delete its home (and its log unless ``keep_log``)."""
    if node.process.poll() is None:
        node.process.send_signal(signal.SIGTERM)
        try:
            node.process.wait(timeout=150)
        except subprocess.TimeoutExpired:
            node.process.kill()
            node.process.wait()
    _kill_machines(node)
    shutil.rmtree(node.home, ignore_errors=True)
    if not keep_log:
        node.log.unlink(missing_ok=True)


def kill_node(node: Node) -> None:
    """The node's host dies: SIGKILL the node process and every QEMU it ran (a dead host takes
    its VMs with it; left running, they would outlive the test, spinning under TCG)."""
    node.process.send_signal(signal.SIGKILL)
    node.process.wait()
    _kill_machines(node)


def _kill_machines(node: Node) -> None:
    for pidfile in node.home.glob("sandboxes/*/qemu.pid"):
        text = pidfile.read_text().strip()
        if text.isdigit():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(text), signal.SIGKILL)
