"""Cluster mode without VMs: two managers (nodes) on one real PostgreSQL registry and one real
S3 store (SeaweedFS), each with its own home and a fake engine (tests/sandbox/fakes.py).

What is checked here is the cluster's logic: leases (a sandbox another node runs is a Conflict
naming it), durable pauses (``info.durable``, retried uploads visible as ``upload_error``),
wake on another node from the store, recovery of a lost node's sandboxes, and the pause
records of the PostgreSQL registry. The same path with real QEMU nodes and ``torpor serve``
processes is tests/cluster/test_node_loss.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.s3 import S3Server
from tests.sandbox.fakes import FakeEngine
from torpor.config import paths
from torpor.errors import Conflict, InvalidArgument, StateLost
from torpor.sandbox.manager import SandboxManager
from torpor.sandbox.manager.cluster import PROXIED, ClusterConfig
from torpor.sandbox.models import SandboxInfo
from torpor.sandbox.models import SandboxState as S
from torpor.sandbox.registry import SandboxRecord
from torpor.sandbox.registry.postgres import PostgresRegistry
from torpor.sandbox.storage.chunks import ChunkStore
from torpor.sandbox.storage.pauses import begin_rebuild, is_whole, push_pause, rebuild_pause

pytestmark = [pytest.mark.postgres, pytest.mark.s3]


def node(
    tmp_path: Path, dsn: str, store: str, name: str, lease: float = 3.0, engine: Any = None
) -> SandboxManager:
    config = ClusterConfig(
        dsn=dsn,
        store=store,
        node=name,
        url=f"http://{name}.test:8765",
        lease_seconds=lease,
        heartbeat_seconds=lease / 6,
    )
    engine = engine or FakeEngine()
    return SandboxManager(paths(tmp_path / name), engine=engine, cluster=config)


def run(body: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(body())


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


@contextlib.contextmanager
def sent_here() -> Iterator[None]:
    """Calls made inside are as if another node proxied them here: placement wakes a paused
    sandbox on this node rather than naming its origin (which is still alive, or died a moment
    ago and looks alive; over HTTP the proxy does this when the origin cannot be reached)."""
    token = PROXIED.set("test")
    try:
        yield
    finally:
        PROXIED.reset(token)


def die(manager: SandboxManager, home: Path | None) -> None:
    """The node is gone: no heartbeat any more, its directory deleted (unless None), nothing
    closed."""
    assert manager.cluster is not None
    if manager.cluster._heartbeat is not None:
        manager.cluster._heartbeat.cancel()
    for task in manager.cluster._pushes.values():
        task.cancel()
    if manager._supervisor is not None:
        manager._supervisor.cancel()
    manager._closed = True
    if home is not None:
        shutil.rmtree(home, ignore_errors=True)


def test_pause_is_durable_and_wakes_on_another_node(tmp_path: Path, dsn: str, store: str) -> None:
    async def body() -> None:
        n1, n2 = node(tmp_path, dsn, store, "n1"), node(tmp_path, dsn, store, "n2")
        await n1.start(supervise=False)
        await n2.start(supervise=False)
        await n1.get_or_create("agent-u-42")
        await n1.run_code("agent-u-42", "notes = [1, 2]")
        with pytest.raises(Conflict) as taken:  # n1 runs it: n2 says where it is
            await n2.run_code("agent-u-42", "notes")
        assert taken.value.data["owner_node"] == "n1"
        assert taken.value.data["owner_url"] == "http://n1.test:8765"
        paused = await n1.pause("agent-u-42")
        assert paused.state is S.PAUSED
        info = await until(
            lambda: n1.get("agent-u-42"), lambda i: i.durable is not None, timeout=30
        )
        assert info.upload_error is None and info.durable is not None
        assert info.paused_at is not None and info.durable >= info.paused_at
        die(n1, tmp_path / "n1")
        with sent_here():  # n1 still looks alive a moment (placement would pick it)
            out = await n2.run_code("agent-u-42", "notes")
        assert out.results[0].data["text/plain"] == "[1, 2]"
        woke = await n2.get("agent-u-42")
        assert (woke.state, woke.durable) == (S.RUNNING, None)  # running: nothing durable now
        await n2.close()

    run(body)


def test_lost_node_falls_back_to_last_durable_pause(tmp_path: Path, dsn: str, store: str) -> None:
    async def body() -> None:
        n1, n2 = node(tmp_path, dsn, store, "n1"), node(tmp_path, dsn, store, "n2")
        await n1.start(supervise=False)
        await n2.start(supervise=False)
        kept = await n1.create(name="kept")
        await n1.run_code("kept", "notes = [1, 2]")
        await n1.pause("kept")
        await until(lambda: n1.get("kept"), lambda i: i.durable is not None, timeout=30)
        await n1.run_code("kept", "notes.append(3)")  # woken on n1: this change is not durable
        fresh = await n1.create(name="never-paused")
        die(n1, tmp_path / "n1")
        # n2's heartbeat sees n1's lease lapse and recovers both
        back = await until(lambda: n2.get("kept"), lambda i: i.state is S.PAUSED, timeout=30)
        assert back.durable is not None
        reason = n2.registry.transitions(kept.id)[-1].reason
        assert "n1 lost" in reason and "lost" in reason.split("then")[-1]
        lost = await until(lambda: n2.get("never-paused"), lambda i: i.state is S.ERROR, 30)
        assert "n1" in (lost.error or "")
        out = await n2.run_code("kept", "notes")
        assert out.results[0].data["text/plain"] == "[1, 2]"
        with pytest.raises(StateLost):
            await n2.run_code(fresh.id, "1")
        await n2.close()

    run(body)


def test_node_killed_before_its_upload_loses_only_that_pause(
    tmp_path: Path, dsn: str, store: str
) -> None:
    async def body() -> None:
        n1, n2 = node(tmp_path, dsn, store, "n1"), node(tmp_path, dsn, store, "n2")
        await n1.start(supervise=False)
        await n2.start(supervise=False)
        sbx = await n1.create(name="agent")
        await n1.run_code("agent", "x = 1")
        await n1.pause("agent")
        await until(lambda: n1.get("agent"), lambda i: i.durable is not None, timeout=30)
        await n1.run_code("agent", "x = 2")
        again = await n1.pause("agent")  # paused locally; n1 dies before its upload
        die(n1, tmp_path / "n1")
        assert again.durable is None
        # n2 must not wake it while n1's lease runs (its files may still come back)
        with pytest.raises(Conflict):
            await n2.run_code("agent", "x")
        back = await until(lambda: n2.get("agent"), lambda i: i.durable is not None, timeout=30)
        assert back.paused_at is not None and again.paused_at is not None
        assert back.paused_at < again.paused_at
        assert "lost" in n2.registry.transitions(sbx.id)[-1].reason
        out = await n2.run_code("agent", "x")
        assert out.results[0].data["text/plain"] == "1"  # the last durable pause's
        await n2.close()

    run(body)


def test_a_lost_node_coming_back_drops_what_was_taken_over(
    tmp_path: Path, dsn: str, store: str
) -> None:
    async def body() -> None:
        engine = FakeEngine()
        n1 = node(tmp_path, dsn, store, "n1", engine=engine)
        n2 = node(tmp_path, dsn, store, "n2")
        await n1.start(supervise=False)
        await n2.start(supervise=False)
        sbx = await n1.create(name="agent")
        await n1.run_code("agent", "x = 1")
        await n1.pause("agent")
        await until(lambda: n1.get("agent"), lambda i: i.durable is not None, timeout=30)
        await n1.run_code("agent", "x = 2")  # running on n1 when n1 stops heartbeating
        directory = tmp_path / "n1" / "sandboxes" / sbx.id
        die(n1, None)  # its QEMU and files stay: a partition, not a dead disk
        await until(lambda: n2.get("agent"), lambda i: i.state is S.PAUSED, timeout=30)
        assert directory in engine.world.processes
        again = node(tmp_path, dsn, store, "n1", engine=FakeEngine(engine.world))
        await again.start(supervise=False)  # n1 is back: the machine is n2's to wake now
        assert directory not in engine.world.processes and not directory.exists()
        with sent_here():  # (n1, alive again, made that pause: placement would pick it)
            out = await n2.run_code("agent", "x")
        assert out.results[0].data["text/plain"] == "1"
        await again.close()
        await n2.close()

    run(body)


def test_upload_failure_is_visible_then_retried(
    tmp_path: Path, dsn: str, store: str, s3_server: S3Server
) -> None:
    missing = "late-bucket"  # the store is unreachable until this bucket exists

    async def body() -> None:
        n1 = node(tmp_path, dsn, f"s3://{missing}/c", "n1")
        await n1.start(supervise=False)
        await n1.create(name="agent")
        await n1.run_code("agent", "x = 7")
        paused = await n1.pause("agent")  # the pause itself succeeds locally, at once
        assert paused.state is S.PAUSED and paused.durable is None
        failing = await until(
            lambda: n1.get("agent"), lambda i: i.upload_error is not None, timeout=30
        )
        assert failing.durable is None and failing.state is S.PAUSED
        s3_server.client().create_bucket(Bucket=missing)
        done = await until(lambda: n1.get("agent"), lambda i: i.durable is not None, timeout=60)
        assert done.upload_error is None
        await n1.close()

    run(body)


def test_two_nodes_racing_to_wake_one_wins(tmp_path: Path, dsn: str, store: str) -> None:
    async def body() -> None:
        n1, n2, n3 = (node(tmp_path, dsn, store, n) for n in ("n1", "n2", "n3"))
        for n in (n1, n2, n3):
            await n.start(supervise=False)
        await n1.create(name="agent")
        await n1.run_code("agent", "x = 7")
        await n1.pause("agent")
        await until(lambda: n1.get("agent"), lambda i: i.durable is not None, timeout=30)
        with sent_here():  # both requests were sent to them (placement would pick n1)
            results = await asyncio.gather(
                n2.run_code("agent", "x"), n3.run_code("agent", "x"), return_exceptions=True
            )
        won = [r for r in results if not isinstance(r, BaseException)]
        lost = [r for r in results if isinstance(r, BaseException)]
        assert len(won) == 1 and won[0].results[0].data["text/plain"] == "7"
        assert len(lost) == 1 and isinstance(lost[0], Conflict)
        assert lost[0].data["owner_node"] in ("n2", "n3")
        # n1's copy of the pause is stale now (the sandbox runs elsewhere): n1 drops it
        sandbox_id = (await n1.get("agent")).id
        assert (tmp_path / "n1" / "sandboxes" / sandbox_id).is_dir()
        assert await n1.drop_stale() == [sandbox_id]
        assert not (tmp_path / "n1" / "sandboxes" / sandbox_id).exists()
        assert await n2.drop_stale() == [] and await n3.drop_stale() == []
        for n in (n1, n2, n3):
            await n.close()

    run(body)


def test_a_wake_racing_a_give_back_keeps_its_lease(tmp_path: Path, dsn: str, store: str) -> None:
    """A call that finds the sandbox paused and durable gives its lease back when it ends;
    a wake queued behind it on the same node must not be left running with no owner (the
    scale bench caught it: another node took the lease, found no QEMU and marked the
    sandbox lost)."""

    async def body() -> None:
        n1, n2 = node(tmp_path, dsn, store, "n1"), node(tmp_path, dsn, store, "n2")
        await n1.start(supervise=False)
        await n2.start(supervise=False)
        sbx = await n1.create(name="agent")
        await n1.run_code("agent", "x = 7")
        assert n1.cluster is not None
        shared = n1.cluster.registry
        for _ in range(4):
            await n1.pause("agent")
            await until(lambda: n1.get("agent"), lambda i: i.durable is not None, timeout=30)
            assert shared.owner(sbx.id) is None  # durable: given back
            # the pause first (a no-op that gives the lease back), the wake queued behind it
            # (both take their lease in one query now: started together, either may be first)
            pausing = asyncio.ensure_future(n1.pause("agent"))
            while not n1.live(sbx.id).lock.locked() and not pausing.done():
                await asyncio.sleep(0)
            await asyncio.gather(pausing, n1.resume("agent"))
            assert (await n1.get("agent")).state is S.RUNNING
            assert shared.owner(sbx.id) == "n1"
            with pytest.raises(Conflict):  # so n2 proxies, and never takes it over
                await n2.run_code("agent", "x")
        out = await n1.run_code("agent", "x")
        assert out.results[0].data["text/plain"] == "7"
        await n1.close()
        await n2.close()

    run(body)


def test_start_reconciles_only_this_nodes_sandboxes(tmp_path: Path, dsn: str, store: str) -> None:
    async def body() -> None:
        n1 = node(tmp_path, dsn, store, "n1", lease=30)
        await n1.start(supervise=False)
        running = await n1.create(name="busy")
        n2 = node(tmp_path, dsn, store, "n2", lease=30)
        await n2.start(supervise=False)  # must not touch n1's running sandbox
        assert (await n2.get("busy")).state is S.RUNNING
        assert n1.registry.transitions(running.id)[-1].dst is S.RUNNING
        await n1.close()
        await n2.close()

    run(body)


async def _cut_off_and_taken_over(
    tmp_path: Path, dsn: str, store: str, engine: FakeEngine
) -> tuple[SandboxManager, SandboxManager, Path]:
    """n1 runs a sandbox when its heartbeat stalls past its lease (cut off from PostgreSQL,
    its process and machine alive); n2 recovers the sandbox to its last durable pause and
    wakes it; then n1 is back. Returns n1, n2 and n1's directory of the sandbox."""
    n1 = node(tmp_path, dsn, store, "n1", engine=engine)
    n2 = node(tmp_path, dsn, store, "n2")
    await n1.start(supervise=False)
    await n2.start(supervise=False)
    sbx = await n1.create(name="agent", idle_pause_seconds=60)
    await n1.run_code("agent", "x = 1")
    await n1.pause("agent")
    await until(lambda: n1.get("agent"), lambda i: i.durable is not None, timeout=30)
    await n1.run_code("agent", "x = 2")  # running on n1 when its heartbeat stalls
    assert n1.cluster is not None and n1.cluster._heartbeat is not None
    n1.cluster._heartbeat.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await n1.cluster._heartbeat
    n1.cluster._heartbeat = None
    await until(lambda: n2.get("agent"), lambda i: i.state is S.PAUSED, timeout=30)
    with sent_here():
        out = await n2.run_code("agent", "x")
    assert out.results[0].data["text/plain"] == "1"  # n2 runs it now
    directory = tmp_path / "n1" / "sandboxes" / sbx.id
    assert directory in engine.world.processes  # n1's copy still runs
    n1.cluster.start_heartbeat(n1.drop_stale)  # n1 is back
    return n1, n2, directory


def test_a_cut_off_node_does_not_idle_pause_a_sandbox_taken_over(
    tmp_path: Path, dsn: str, store: str
) -> None:
    """The idle sweep of a node whose sandbox another node took over (and runs) must not
    pause its own stale copy over the registry row of the new owner's."""

    async def body() -> None:
        n1, n2, _ = await _cut_off_and_taken_over(tmp_path, dsn, store, FakeEngine())
        assert await n1.idle_sweep(now=time.time() + 3600) == []  # not n1's to pause
        assert (await n2.get("agent")).state is S.RUNNING
        out = await n2.run_code("agent", "x")
        assert out.results[0].data["text/plain"] == "1"
        await n1.close()
        await n2.close()

    run(body)


def test_a_cut_off_node_coming_back_stops_its_copy_of_a_sandbox_taken_over(
    tmp_path: Path, dsn: str, store: str
) -> None:
    """A node whose process outlived its lease (cut off, not restarted) still runs the
    machine of a sandbox another node took over and woke: its tidy-up stops that copy (two
    live machines of one sandbox otherwise, the stale one for ever)."""

    async def body() -> None:
        engine = FakeEngine()
        n1, n2, directory = await _cut_off_and_taken_over(tmp_path, dsn, store, engine)
        sandbox_id = directory.name
        assert await n1.drop_stale() == [sandbox_id]
        assert directory not in engine.world.processes and not directory.exists()
        assert n1.live(sandbox_id).machine is None
        out = await n2.run_code("agent", "x")
        assert out.results[0].data["text/plain"] == "1"
        await n1.close()
        await n2.close()

    run(body)


# -- the registry's pause records and recovery -------------------------------------------------


@pytest.fixture
def pg(dsn: str) -> Iterator[PostgresRegistry]:
    reg = PostgresRegistry(dsn)
    yield reg
    reg.close()


def _rec(state: S, **kw: object) -> SandboxRecord:
    return SandboxRecord(
        id="sbx-1",
        tenant="default",
        name="a",
        template="python",
        state=state,
        **kw,  # type: ignore[arg-type]
    )


def test_durable_only_for_the_current_pause(pg: PostgresRegistry) -> None:
    pg.insert(_rec(S.PAUSED, paused_at=100.0))
    assert pg.get("sbx-1").durable_at is None and pg.pause_record("sbx-1") is None
    pg.note_pause("sbx-1", "n1", 100.0)
    pg.acquire("sbx-1", "n1", lease_seconds=60)  # held until durable
    pg.record_upload_error("sbx-1", "store down")
    assert pg.owner("sbx-1") == "n1"
    assert pg.get("sbx-1").upload_error == "store down"
    at = pg.record_durable("sbx-1", "n1", 100.0, {"version": 1, "files": {}})
    got = pg.get("sbx-1")
    assert (got.durable_at, got.upload_error) == (at, None)
    assert got.to_info().durable is not None
    assert pg.owner("sbx-1") is None  # durable and given up in one step
    pg.set_state("sbx-1", S.PAUSED, S.WAKING)  # woken: the durable pause is not the state
    assert pg.get("sbx-1").durable_at is None
    record = pg.pause_record("sbx-1")
    assert record is not None and (record.node, record.manifest_paused_at) == ("n1", 100.0)


def test_a_late_record_of_a_taken_over_pause_is_refused(pg: PostgresRegistry) -> None:
    """n1's lease lapses during its upload of the pause at 100; n2 recovers the sandbox,
    wakes it and pauses it at 200. n1's upload then ends: recording it would have made the
    next wake rebuild the pause at 100 over n2's newer one."""
    pg.insert(_rec(S.PAUSED, paused_at=50.0))
    pg.record_durable("sbx-1", "n1", 50.0, {"version": 1, "files": {}, "tag": "p0"})
    pg.acquire("sbx-1", "n1", lease_seconds=5, at=1000.0)
    for a, b, at in ((S.PAUSED, S.WAKING, None), (S.WAKING, S.RUNNING, None)):
        pg.set_state("sbx-1", a, b, paused_at=at)
    pg.set_state("sbx-1", S.RUNNING, S.PAUSING)
    pg.set_state("sbx-1", S.PAUSING, S.PAUSED, paused_at=100.0)
    pg.note_pause("sbx-1", "n1", 100.0)  # n1 starts pushing
    assert pg.recover("sbx-1", "n2", at=2000.0) is not None  # its lease lapsed
    pg.acquire("sbx-1", "n2", lease_seconds=5, at=2000.0)
    with pytest.raises(Conflict):  # held by n2 now
        pg.record_durable("sbx-1", "n1", 100.0, {"version": 1, "files": {}, "tag": "p1"})
    pg.set_state("sbx-1", S.PAUSED, S.WAKING)
    pg.set_state("sbx-1", S.WAKING, S.RUNNING, paused_at=None)
    pg.set_state("sbx-1", S.RUNNING, S.PAUSING)
    pg.set_state("sbx-1", S.PAUSING, S.PAUSED, paused_at=200.0)
    pg.note_pause("sbx-1", "n2", 200.0)
    pg.record_durable("sbx-1", "n2", 200.0, {"version": 1, "files": {}, "tag": "p2"})
    with pytest.raises(Conflict):  # given up by n2, but paused again since
        pg.record_durable("sbx-1", "n1", 100.0, {"version": 1, "files": {}, "tag": "p1"})
    record = pg.pause_record("sbx-1")
    assert record is not None and record.manifest is not None
    assert (record.node, record.manifest["tag"]) == ("n2", "p2")


def test_recover_exactly_once(pg: PostgresRegistry, dsn: str) -> None:
    pg.insert(_rec(S.RUNNING, paused_at=None))
    pg.record_durable("sbx-1", "n1", 50.0, {"version": 1, "files": {}})
    pg.acquire("sbx-1", "n1", lease_seconds=1, at=1000.0)
    assert pg.recover("sbx-1", "n2", at=1000.5) is None  # the lease still runs
    others = [PostgresRegistry(dsn) for _ in range(3)]
    done = [r.recover("sbx-1", f"n{i + 2}", at=1002.0) for i, r in enumerate(others)]
    assert sum(t is not None for t in done) == 1
    got = pg.get("sbx-1")
    assert (got.state, got.paused_at) == (S.PAUSED, 50.0)
    assert pg.owner("sbx-1", at=1002.0) is None
    for r in others:
        r.close()


def test_invalid_cluster_config() -> None:
    with pytest.raises(InvalidArgument):
        ClusterConfig(dsn="sqlite:///x", store="s3://b/p", node="n1")
    with pytest.raises(InvalidArgument):
        ClusterConfig(dsn="postgresql://h/db", store="/var/chunks", node="n1")


# -- push and rebuild of a paused directory ----------------------------------------------------


def _template(root: Path, build: str) -> Path:
    t = root / "templates" / "python"
    (t / "snapshot").mkdir(parents=True)
    (t / "template.json").write_text(
        f'{{"name": "python", "build_id": "{build}", "directory": "{t}"}}'
    )
    ram = bytearray(8 * 4096 * 64)  # 8 chunks of 256 KiB
    for i in range(0, len(ram), 4096):
        ram[i] = (i // 4096) % 251 + 1
    (t / "snapshot" / "ram").write_bytes(bytes(ram))
    return t


def test_push_dedups_against_the_template_and_rebuilds(tmp_path: Path) -> None:
    template = _template(tmp_path / "a", "b1")
    chunks = ChunkStore(tmp_path / "chunks")
    sandbox = tmp_path / "a" / "sandboxes" / "sbx-1"
    sandbox.mkdir(parents=True)
    ram = bytearray((template / "snapshot" / "ram").read_bytes())
    ram[3 * 262144 + 5] = 0xEE  # one chunk changed
    (sandbox / "ram").write_bytes(bytes(ram))
    (sandbox / "state").write_bytes(b"device state")
    (sandbox / "machine.json").write_text(f'{{"kernel": "{template}/vmlinuz", "devices": []}}')
    (sandbox / "console.log").write_text("not pushed")
    manifest = push_pause(sandbox, chunks, template)
    assert sorted(manifest["files"]) == ["machine.json", "ram", "state"]
    assert len(manifest["from_template"]) == 7  # only the changed chunk was stored
    other = _template(tmp_path / "b", "b1")
    dest = tmp_path / "b" / "sandboxes" / "sbx-1"
    rebuild_pause(manifest, dest, chunks, other)
    assert (dest / "ram").read_bytes() == bytes(ram)
    assert (dest / "state").read_bytes() == b"device state"
    assert f"{other}/vmlinuz" in (dest / "machine.json").read_text()  # moved to this node's
    wrong = _template(tmp_path / "c", "b2")
    from torpor.errors import TemplateNotFound

    with pytest.raises(TemplateNotFound):
        rebuild_pause(manifest, tmp_path / "c" / "sbx-1", chunks, wrong)
    assert not (tmp_path / "c" / "sbx-1").exists()


def test_a_corrupt_chunk_fails_the_rebuild_naming_the_sandbox(tmp_path: Path) -> None:
    from torpor.errors import CorruptData

    template = _template(tmp_path / "a", "b1")
    chunks = ChunkStore(tmp_path / "chunks")
    sandbox = tmp_path / "a" / "sandboxes" / "sbx-1"
    sandbox.mkdir(parents=True)
    (sandbox / "state").write_bytes(b"device state " * 1000)
    manifest = push_pause(sandbox, chunks, template, sandbox_id="sbx-1")
    digest = manifest["files"]["state"]["chunks"][0]
    chunks.path_of(digest).write_bytes(b"not the chunk")  # bit rot in the store
    dest = tmp_path / "b" / "sbx-1"
    with pytest.raises(CorruptData) as bad:
        rebuild_pause(manifest, dest, chunks, template, sandbox_id="sbx-1")
    assert "sbx-1" in str(bad.value) and bad.value.data["sandbox_id"] == "sbx-1"
    assert not dest.exists() and not any(dest.parent.glob(".*rebuild"))


def test_a_rebuild_begun_is_not_whole_until_its_ram_is_filled(tmp_path: Path) -> None:
    """A cross-node wake starts QEMU on a directory whose RAM is still being fetched: until
    the fill ends the directory is not taken for a whole pause (a crash then leaves one the
    next wake rebuilds), and the RAM is sized but empty."""
    template = _template(tmp_path / "a", "b1")
    chunks = ChunkStore(tmp_path / "chunks")
    sandbox = tmp_path / "a" / "sandboxes" / "sbx-1"
    sandbox.mkdir(parents=True)
    ram = bytearray((template / "snapshot" / "ram").read_bytes())
    ram[5 * 262144 + 7] = 0xEE
    (sandbox / "ram").write_bytes(bytes(ram))
    (sandbox / "state").write_bytes(b"device state")
    manifest = push_pause(sandbox, chunks, template)
    dest = tmp_path / "b" / "sandboxes" / "sbx-1"
    fill = begin_rebuild(manifest, dest, chunks, template, sandbox_id="sbx-1")
    assert (dest / "state").read_bytes() == b"device state" and not is_whole(dest)
    assert (dest / "ram").stat().st_size == len(ram) and (dest / "ram").stat().st_blocks == 0
    fill.run()
    assert is_whole(dest) and (dest / "ram").read_bytes() == bytes(ram)
    # a fill that fails (a chunk gone from the store) leaves the marker: not whole
    chunks.path_of(manifest["files"]["ram"]["chunks"][5]).unlink()
    from torpor.errors import CorruptData

    again = begin_rebuild(manifest, dest, chunks, template, sandbox_id="sbx-1")
    with pytest.raises(CorruptData, match="sbx-1"):
        again.run()
    assert not is_whole(dest)


def test_a_lease_lapsing_during_an_acquire_is_recovered_not_taken_over(
    tmp_path: Path, dsn: str, store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node's acquire first recovers a sandbox whose owner's lease lapsed (back to its last
    durable pause), then takes it. When the lease runs out between the two steps, the take
    must not grab the running sandbox as it is (the node then finds no machine and marks it
    lost, its durable pause ignored)."""

    async def body() -> None:
        n1, n2 = node(tmp_path, dsn, store, "n1"), node(tmp_path, dsn, store, "n2")
        await n1.start(supervise=False)
        await n2.start(supervise=False)
        await n1.create(name="agent")
        await n1.run_code("agent", "x = 1")
        await n1.pause("agent")
        await until(lambda: n1.get("agent"), lambda i: i.durable is not None, timeout=30)
        await n1.run_code("agent", "x = 2")  # running on n1, its lease just renewed
        die(n1, tmp_path / "n1")
        assert n2.cluster is not None
        assert n2.cluster._heartbeat is not None
        n2.cluster._heartbeat.cancel()  # (its own recovery would get there first)
        registry = n2.cluster.registry
        recover = registry.recover

        def late(sandbox_id: str, node: str, *, at: float | None = None) -> Any:
            done = recover(sandbox_id, node, at=at)  # the lease still runs: nothing to do
            time.sleep(3.5)  # ... and runs out now (lease: 3 s)
            return done

        monkeypatch.setattr(registry, "recover", late)
        with sent_here(), contextlib.suppress(Conflict):  # (n1 still looked alive)
            await n2.run_code("agent", "x")
        monkeypatch.setattr(registry, "recover", recover)
        with sent_here():
            out = await n2.run_code("agent", "x")
        assert out.results[0].data["text/plain"] == "1"  # its last durable pause
        await n2.close()

    run(body)
