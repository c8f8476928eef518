"""Faults of a cluster (issue 9, "Bad input and faults"): a node process SIGKILLed in the middle
of a pause, of its upload and of a wake; the S3 store down for a while; PostgreSQL restarted
under load. Real PostgreSQL (tests/pg.py) and real S3 (SeaweedFS, tests/s3.py); machines are
the fake engine's (tests/sandbox/fakes.py: RAM is a file of the interpreter's variables), so
what is checked is the cluster's bookkeeping, in seconds (the same path on QEMU with real
``torpor serve`` nodes: tests/cluster/test_node_loss.py).

* **SIGKILL.** Node n1 runs in a child process (``WORKER``) that SIGKILLs itself at a step:
  after the hibernate but before the registry says paused (``pause:saved``), after the first
  chunk of the pause's upload reached the store (``upload``), and at both steps of a wake
  (``wake:begin``, ``wake:woken``). n1 prints each pause the registry reported durable, with
  the interpreter's value then. Afterwards node n2 (this process) recovers the sandbox once
  n1's lease lapses and wakes it from the last pause n1 reported durable: that value, no
  older one (nothing reported durable is lost), and no newer (nothing else was durable).
* **The store down.** The SeaweedFS server is stopped: a pause still succeeds at once
  (``durable`` None), the failed upload shows as ``upload_error``; the server starts again
  on the same ports and data, and the retry makes the pause durable; it then wakes on
  another node.
* **PostgreSQL restarted under load.** Calls run in a loop on a node (wake by a call, pause,
  run) while PostgreSQL stops for a few seconds: each call either succeeds or raises a typed
  error (TorporError), none waits past a bound, and afterwards every call succeeds again
  without any restart of the node (its heartbeat and its registry reconnect on their own).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.pg import PgCluster, start_cluster
from tests.s3 import S3Server, start_seaweedfs
from tests.sandbox.fakes import FakeEngine
from torpor.config import paths
from torpor.errors import TorporError
from torpor.sandbox.manager import SandboxManager
from torpor.sandbox.manager import cluster as cluster_mod
from torpor.sandbox.manager.cluster import ClusterConfig
from torpor.sandbox.models import SandboxInfo
from torpor.sandbox.models import SandboxState as S

pytestmark = [pytest.mark.postgres, pytest.mark.s3]

LEASE = 3.0

WORKER = r"""
import asyncio, json, os, signal, sys, time
from tests.sandbox.fakes import FakeEngine
from torpor.config import paths
from torpor.sandbox.manager import SandboxManager
from torpor.sandbox.manager.cluster import ClusterConfig
from torpor.sandbox.storage.chunks import ChunkStore

home, dsn, store, crash, lease = sys.argv[1:6]

def die():
    os.kill(os.getpid(), signal.SIGKILL)  # no finally, no cleanup: as a node that is killed

def report(**what):
    print(json.dumps(what), flush=True)

async def durable(m, value):
    deadline = time.monotonic() + 60
    while (await m.get("agent")).durable is None:
        assert time.monotonic() < deadline, "never durable"
        await asyncio.sleep(0.05)
    report(durable=value)  # the registry says this pause is durable

async def main():
    config = ClusterConfig(
        dsn=dsn, store=store, node="n1", url="http://n1.test:1",
        lease_seconds=float(lease), heartbeat_seconds=float(lease) / 6,
    )
    m = SandboxManager(paths(home), engine=FakeEngine(), cluster=config)
    await m.start(supervise=False)
    info = await m.create(name="agent")
    report(id=info.id)
    await m.run_code("agent", "x = 1")
    await m.pause("agent")
    await durable(m, 1)
    await m.run_code("agent", "x = 2")  # woken here (its origin node) and changed
    if crash.startswith("wake:"):
        await m.pause("agent")
        await durable(m, 2)
    if crash == "upload":  # the first chunk of this pause is in the store, then n1 dies
        put = ChunkStore.put
        def put_then_die(self, data, **kw):
            out = put(self, data, **kw)
            die()
            return out
        ChunkStore.put = put_then_die
    m.on_step = lambda step, sandbox_id: die() if step == crash else None
    if crash.startswith("wake:"):
        await m.run_code("agent", "x")
    else:
        await m.pause("agent")
        report(paused=2)
        await asyncio.sleep(60)  # the upload runs in the background
    report(survived=crash)
    sys.exit(3)

asyncio.run(main())
"""


async def until(
    what: Callable[[], Awaitable[SandboxInfo]], ok: Callable[[SandboxInfo], bool], timeout: float
) -> SandboxInfo:
    deadline = time.monotonic() + timeout
    info = await what()
    while not ok(info):
        assert time.monotonic() < deadline, f"timed out; last: {info}"
        await asyncio.sleep(0.1)
        info = await what()
    return info


def node(home: Path, dsn: str, store: str, name: str, lease: float = LEASE) -> SandboxManager:
    config = ClusterConfig(
        dsn=dsn,
        store=store,
        node=name,
        url=f"http://{name}.test:8765",
        lease_seconds=lease,
        heartbeat_seconds=lease / 6,
    )
    return SandboxManager(paths(home / name), engine=FakeEngine(), cluster=config)


@pytest.fixture
def dsn(pg_cluster: PgCluster, pg_database: str) -> str:
    return pg_cluster.admin_dsn(pg_database)


@pytest.fixture
def s3_env(monkeypatch: pytest.MonkeyPatch) -> Callable[[S3Server], None]:
    def point(server: S3Server) -> None:
        for key, value in server.env().items():
            monkeypatch.setenv(key, value)

    monkeypatch.setattr(cluster_mod, "RETRY_FIRST", 0.2)
    monkeypatch.setattr(cluster_mod, "RETRY_MAX", 1.0)
    return point


# -- a node SIGKILLed mid-pause, mid-upload, mid-wake -------------------------------------------


@pytest.mark.parametrize(
    ("crash", "durable"),
    [
        pytest.param("pause:saved", 1, id="mid-pause"),
        pytest.param("upload", 1, id="mid-upload"),
        pytest.param("wake:begin", 2, id="wake-begin"),
        pytest.param("wake:woken", 2, id="wake-woken"),
    ],
)
def test_node_killed_mid_step_wakes_elsewhere_from_its_last_durable_pause(
    tmp_path: Path,
    dsn: str,
    s3_server: S3Server,
    s3_bucket: str,
    s3_env: Callable[[S3Server], None],
    crash: str,
    durable: int,
) -> None:
    s3_env(s3_server)
    store = f"s3://{s3_bucket}/c"
    env = {**os.environ, **s3_server.env(), "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [sys.executable, "-c", WORKER, str(tmp_path / "n1"), dsn, store, crash, str(LEASE)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert proc.returncode == -9, f"n1 was not killed at {crash}: {proc.stdout}\n{proc.stderr}"
    said = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    sandbox_id = next(s["id"] for s in said if "id" in s)
    reported = [s["durable"] for s in said if "durable" in s]
    assert reported[-1] == durable, said  # the last pause n1 saw reported durable
    if crash == "upload":
        # the chunk reached the store, but no manifest names it: the pause is not durable
        assert s3_server.client().list_objects_v2(Bucket=s3_bucket)["KeyCount"] > 0

    async def body() -> None:
        n2 = node(tmp_path, dsn, store, "n2")
        await n2.start(supervise=False)
        try:
            back = await until(
                lambda: n2.get(sandbox_id),
                lambda i: i.state is S.PAUSED and i.durable is not None,
                timeout=30,
            )
            assert back.upload_error is None
            out = await n2.run_code(sandbox_id, "x")
            assert out.results[0].data["text/plain"] == str(durable)
            woke = await n2.get(sandbox_id)
            assert woke.state is S.RUNNING
            reasons = [t.reason for t in n2.registry.transitions(sandbox_id)]
            if crash != "wake:begin":  # (a wake killed at its start had changed nothing yet)
                assert any("n1 lost" in r for r in reasons), reasons
            # and it pauses durably from n2 in turn
            await n2.run_code(sandbox_id, "x = 3")
            await n2.pause(sandbox_id)
            await until(lambda: n2.get(sandbox_id), lambda i: i.durable is not None, 30)
        finally:
            await n2.close()

    asyncio.run(body())


# -- the store down for a while ----------------------------------------------------------------


@pytest.fixture
def own_s3() -> Iterator[S3Server]:
    """A SeaweedFS server of this test's own, since the test stops and restarts it."""
    base = Path(tempfile.mkdtemp(prefix="torpor-s3-outage-"))
    server = start_seaweedfs(base)
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


def test_store_down_pause_succeeds_locally_then_becomes_durable(
    tmp_path: Path, dsn: str, own_s3: S3Server, s3_env: Callable[[S3Server], None]
) -> None:
    s3_env(own_s3)
    bucket = own_s3.create_bucket("outage")
    store = f"s3://{bucket}/c"

    async def body() -> None:
        n1 = node(tmp_path, dsn, store, "n1")
        await n1.start(supervise=False)
        await n1.create(name="agent")
        await n1.run_code("agent", "x = 1")
        await n1.pause("agent")
        await until(lambda: n1.get("agent"), lambda i: i.durable is not None, timeout=30)
        await n1.run_code("agent", "x = 2")
        own_s3.stop()  # the store is unreachable from now on
        started = time.monotonic()
        paused = await n1.pause("agent")
        assert time.monotonic() - started < 5  # local: it does not wait for the store
        assert paused.state is S.PAUSED and paused.durable is None
        failing = await until(
            lambda: n1.get("agent"), lambda i: i.upload_error is not None, timeout=60
        )
        assert failing.durable is None and failing.state is S.PAUSED
        assert own_s3.endpoint.split("//")[1] in (failing.upload_error or "") or (
            "connect" in (failing.upload_error or "").lower()
        ), failing.upload_error
        # while the store is down the sandbox still wakes here, where its files are
        out = await n1.run_code("agent", "x")
        assert out.results[0].data["text/plain"] == "2"
        await n1.run_code("agent", "x = 3")
        await n1.pause("agent")
        await asyncio.sleep(1.0)  # a few retries fail
        assert (await n1.get("agent")).durable is None
        restarted = start_seaweedfs(own_s3.base, own_s3.ports)  # back, same data and address
        own_s3.process = restarted.process
        done = await until(lambda: n1.get("agent"), lambda i: i.durable is not None, timeout=60)
        assert done.upload_error is None
        # n1 goes away; the durable pause (x = 3) wakes on n2
        await n1.close()
        shutil.rmtree(tmp_path / "n1")
        n2 = node(tmp_path, dsn, store, "n2")
        await n2.start(supervise=False)
        try:
            with contextlib.suppress(TorporError):
                await n2.get("agent")
            token = cluster_mod.PROXIED.set("test")  # (n1 looks alive a moment longer)
            try:
                out = await n2.run_code("agent", "x")
            finally:
                cluster_mod.PROXIED.reset(token)
            assert out.results[0].data["text/plain"] == "3"
        finally:
            await n2.close()

    asyncio.run(body())


# -- PostgreSQL restarted under load -----------------------------------------------------------


@pytest.fixture
def own_pg() -> Iterator[PgCluster]:
    """A PostgreSQL server of this test's own, since the test stops and restarts it."""
    base = Path(tempfile.mkdtemp(prefix="torpor-pg-outage-"))
    cluster = start_cluster(base)
    try:
        yield cluster
    finally:
        with contextlib.suppress(Exception):
            cluster.resume()  # (cleanup stops the server it knows of)
        cluster.stop()
        shutil.rmtree(base, ignore_errors=True)


#: no call may take longer than this, outage or not
CALL_BOUND = 30.0


def test_postgres_restarted_under_load(
    tmp_path: Path,
    own_pg: PgCluster,
    s3_server: S3Server,
    s3_bucket: str,
    s3_env: Callable[[S3Server], None],
) -> None:
    s3_env(s3_server)
    dsn = own_pg.admin_dsn(own_pg.create_database())
    store = f"s3://{s3_bucket}/c"
    outcomes: list[tuple[float, str, str]] = []  # (when, call, "ok" | error type)

    async def body() -> None:
        n1 = node(tmp_path, dsn, store, "n1", lease=6.0)
        await n1.start(supervise=False)
        names = [f"agent-{i}" for i in range(3)]
        for i, name in enumerate(names):
            await n1.create(name=name)
            await n1.run_code(name, f"x = {i}")
        stop = asyncio.Event()

        async def load(name: str, value: int) -> None:
            calls: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
                ("run", lambda: n1.run_code(name, "x")),
                ("pause", lambda: n1.pause(name)),
                ("run", lambda: n1.run_code(name, "x")),  # wakes it
                ("get", lambda: n1.get(name)),
            ]
            k = 0
            while not stop.is_set():
                what, call = calls[k % len(calls)]
                k += 1
                try:
                    result = await asyncio.wait_for(call(), CALL_BOUND)
                except TorporError as exc:
                    outcomes.append((time.monotonic(), what, type(exc).__name__))
                    await asyncio.sleep(0.05)
                    continue
                except TimeoutError:
                    outcomes.append((time.monotonic(), what, "HUNG"))
                    continue
                except Exception as exc:  # an untyped error: the test fails on it
                    outcomes.append((time.monotonic(), what, f"untyped {exc!r}"))
                    continue
                if what == "run":
                    assert result.results[0].data["text/plain"] == str(value)
                outcomes.append((time.monotonic(), what, "ok"))
                await asyncio.sleep(0.02)

        tasks = [asyncio.create_task(load(n, i)) for i, n in enumerate(names)]
        await asyncio.sleep(1.5)
        await asyncio.to_thread(own_pg.halt)
        down = time.monotonic()
        await asyncio.sleep(4.0)
        await asyncio.to_thread(own_pg.resume)
        up = time.monotonic()
        await asyncio.sleep(12.0)  # the node recovers on its own: no restart, no call from us
        stop.set()
        await asyncio.gather(*tasks)
        marks["down"], marks["up"] = down, up
        # every sandbox is usable again, with its value
        for i, name in enumerate(names):
            out = await asyncio.wait_for(n1.run_code(name, "x"), CALL_BOUND)
            assert out.results[0].data["text/plain"] == str(i)
            assert (await n1.get(name)).state is S.RUNNING
        await n1.close()

    marks: dict[str, float] = {}
    asyncio.run(body())
    bad = [o for o in outcomes if o[2] == "HUNG" or o[2].startswith("untyped")]
    assert not bad, bad
    during = [o for o in outcomes if marks["down"] <= o[0] <= marks["up"]]
    assert any(o[2] != "ok" for o in during), "no call failed while PostgreSQL was down"
    tail = [o for o in outcomes if o[0] > marks["up"] + 6.0]  # settled again
    assert tail and all(o[2] == "ok" for o in tail), [o for o in tail if o[2] != "ok"]
    failed = sorted({o[2] for o in outcomes if o[2] != "ok"})
    print(f"{len(outcomes)} calls; failed with: {failed}")
