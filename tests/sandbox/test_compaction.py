"""Compaction of paused sandboxes: the RAM file into the chunk store and back, the template
fast path, crash points, GC marks, bad input; the manager's sweep on the fake engine and a
real QEMU round trip (marked ``qemu``)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.s3 import S3Server
from tests.sandbox.fakes import FakeEngine
from torpor.config import Paths, paths
from torpor.errors import CorruptData, StorageError
from torpor.sandbox.checkpoints import Checkpoints
from torpor.sandbox.manager import SandboxManager
from torpor.sandbox.storage.chunks import ChunkStore, open_chunk_store
from torpor.sandbox.storage.compaction import (
    MARKER,
    Expansion,
    compact,
    expand,
    is_compacted,
    owned_bytes,
    rebuild,
    settle,
)
from torpor.sandbox.storage.retention import collect_garbage
from torpor.sandbox.storage.snapshots import freeze

try:  # plain pytest puts this directory on sys.path; a package layout needs the relative form
    from tests.sandbox.storage_helpers import make_home, make_machine
except ImportError:  # pragma: no cover
    from .storage_helpers import make_home, make_machine

MIB = 1 << 20


def _template_ram(p: Paths) -> Path:
    """A template's booted RAM: 8 MiB sparse, 3 MiB of it data (as make_machine's layout)."""
    ram = p.templates / "python" / "snapshot" / "ram"
    with open(ram, "wb") as f:
        f.truncate(8 * MIB)
        f.seek(1 * MIB)
        f.write(b"\x42" * (256 << 10))
        f.seek(4 * MIB)
        f.write(os.urandom(3 * MIB))
    return ram


def _sandbox(p: Paths, template_ram: Path, sid: str = "sb1") -> Path:
    """A paused sandbox cloned from the template that then changed 64 KiB of its RAM."""
    d = make_machine(p, sid)
    shutil.copyfile(template_ram, d / "ram")
    with open(d / "ram", "r+b") as f:
        f.seek(5 * MIB)
        f.write(os.urandom(64 << 10))
    return d


def _allocated(path: Path) -> int:
    return path.stat().st_blocks * 512


def test_compact_and_expand_round_trip(tmp_path: Path) -> None:
    p = make_home(tmp_path)
    tram = _template_ram(p)
    d = _sandbox(p, tram)
    original = (d / "ram").read_bytes()
    store = ChunkStore(p.chunks)
    report = compact(d, store, tram)
    assert is_compacted(d)
    assert report.ram_bytes_before >= 3 * MIB and report.ram_bytes_after == 0
    assert (d / "ram").stat().st_size == 8 * MIB  # same size: recovery's checks still hold
    assert report.from_template == report.chunks - 1  # only the chunk it changed is its own
    # owned: the local files and the 64 KiB patch of its one changed chunk; not the
    # template's 3 MiB, nor that chunk whole (the template's chunk is its base)
    local = sum(_allocated(f) for f in d.iterdir() if f.is_file())
    assert owned_bytes(d, store) - local < 100 << 10
    assert compact(d, store, tram).chunks == 0  # idempotent

    seconds = expand(d, store, sandbox_id="sb1")
    assert seconds > 0 and not is_compacted(d)
    assert (d / "ram").read_bytes() == original
    assert _allocated(d / "ram") < 5 * MIB  # rebuilt sparse
    assert expand(d, store) == 0.0  # nothing to do


def test_expand_without_the_template_reads_every_chunk_from_the_store(tmp_path: Path) -> None:
    p = make_home(tmp_path)
    tram = _template_ram(p)
    d = _sandbox(p, tram)
    original = (d / "ram").read_bytes()
    store = ChunkStore(p.chunks)
    compact(d, store, tram)
    _template_ram(p)  # the template is rebuilt: new content, new identity
    expand(d, store)
    assert (d / "ram").read_bytes() == original


def test_a_built_templates_ram_is_read_through_its_snapshot_link(tmp_path: Path) -> None:
    """templates.py lays a template out as templates/<name>/snapshot -> builds/<id>/snapshot:
    the manifest's template path resolves below templates/<name>/builds, and must still be
    read (a check that wanted templates/ three levels up sent every chunk to the store)."""
    p = paths(tmp_path / "home").ensure()
    build = p.templates / "python" / "builds" / "b1" / "snapshot"
    build.mkdir(parents=True)
    (p.templates / "python" / "snapshot").symlink_to(Path("builds") / "b1" / "snapshot")
    tram = p.templates / "python" / "snapshot" / "ram"  # as the manager names it
    with open(tram, "wb") as f:
        f.truncate(8 * MIB)
        f.seek(4 * MIB)
        f.write(os.urandom(3 * MIB))
    d = p.sandboxes / "sb1"
    d.mkdir(parents=True)
    shutil.copyfile(tram, d / "ram")
    (d / "state").write_bytes(os.urandom(5000))
    original = (d / "ram").read_bytes()
    store = ChunkStore(p.chunks)
    assert compact(d, store, tram).from_template > 0
    report = rebuild(d, store, sandbox_id="sb1")
    assert (d / "ram").read_bytes() == original
    assert (report.template_bytes, report.store_bytes) == (3 * MIB, 0)


def test_a_changed_template_rebuilds_patched_chunks_from_the_store_checked(
    tmp_path: Path,
) -> None:
    """Without the template's file, a patched chunk is the template's chunk from the store
    with the patch on top, checked against the chunk's own hash."""
    p = make_home(tmp_path)
    tram = _template_ram(p)
    d = _sandbox(p, tram)
    original = (d / "ram").read_bytes()
    store = ChunkStore(p.chunks)
    compact(d, store, tram)
    tram.unlink()  # the template is gone (another node, a rebuilt template)
    report = rebuild(d, store, durable=False)
    assert report.template_bytes == 0 and (d / "ram").read_bytes() == original
    # a base that is not the chunk the patch was made on: the rebuilt chunk fails its hash
    assert is_compacted(d)  # (durable=False: kept until a wake consumes the state)
    body = json.loads((d / MARKER).read_text())
    [[index, patch, pages, _]] = body["patches"]
    wrong, _ = store.put(os.urandom(256 << 10))
    body["patches"] = [[index, patch, pages, wrong]]
    (d / MARKER).write_text(json.dumps(body))
    with pytest.raises(CorruptData, match="does not match"):
        expand(d, store, sandbox_id="sb1")
    assert is_compacted(d)


@pytest.mark.parametrize(
    "gone", [pytest.param(False, id="template"), pytest.param(True, id="store")]
)
def test_a_template_shorter_than_the_ram(tmp_path: Path, gone: bool) -> None:
    """Chunks past the template's end are stored whole, never patched on a short base."""
    p = make_home(tmp_path)
    tram = _template_ram(p)
    d = _sandbox(p, tram)
    with open(tram, "r+b") as f:
        f.truncate(5 * MIB + (200 << 10))  # ends inside the chunk the sandbox changed
    original = (d / "ram").read_bytes()
    store = ChunkStore(p.chunks)
    compact(d, store, tram)
    assert json.loads((d / MARKER).read_text())["patches"] == []
    if gone:
        tram.unlink()
    expand(d, store)
    assert (d / "ram").read_bytes() == original


def test_crash_after_the_manifest_before_emptying_the_ram(tmp_path: Path) -> None:
    p = make_home(tmp_path)
    tram = _template_ram(p)
    d = _sandbox(p, tram)
    original = (d / "ram").read_bytes()
    store = ChunkStore(p.chunks)
    compact(d, store, tram)
    (d / "ram").write_bytes(original)  # as if the process died before truncating
    expand(d, store)
    assert (d / "ram").read_bytes() == original and not is_compacted(d)


def test_missing_chunk_is_corrupt_data_and_keeps_the_manifest(tmp_path: Path) -> None:
    p = make_home(tmp_path)
    tram = _template_ram(p)
    d = _sandbox(p, tram)
    original = (d / "ram").read_bytes()
    store = ChunkStore(p.chunks)
    compact(d, store, tram)
    body = json.loads((d / MARKER).read_text())
    [[_, patch, _, _]] = body["patches"]  # what expand reads for the changed chunk
    saved = store.get(patch)
    store.remove(patch)
    with pytest.raises(CorruptData) as err:
        expand(d, store, sandbox_id="sb1")
    assert err.value.data["sandbox_id"] == "sb1" and "sb1" in str(err.value)
    assert is_compacted(d)  # nothing lost: once the chunk is back, it expands
    store.put(saved)
    expand(d, store)
    assert (d / "ram").read_bytes() == original


def test_unreadable_manifest_is_corrupt_data(tmp_path: Path) -> None:
    p = make_home(tmp_path)
    d = _sandbox(p, _template_ram(p))
    (d / MARKER).write_text("{not json")
    with pytest.raises(CorruptData):
        expand(d, ChunkStore(p.chunks))


def test_gc_keeps_a_compacted_sandboxs_chunks(tmp_path: Path) -> None:
    p = make_home(tmp_path)
    tram = _template_ram(p)
    d = _sandbox(p, tram)
    original = (d / "ram").read_bytes()
    store = ChunkStore(p.chunks)
    compact(d, store, tram)
    report = collect_garbage(p)
    assert report.removed_chunks == 0 and report.kept_chunks > 0
    expand(d, store)
    assert (d / "ram").read_bytes() == original
    compact(d, store, tram)
    shutil.rmtree(d)  # the sandbox is gone: its chunks go at the next GC
    assert collect_garbage(p).removed_chunks > 0
    # a manifest GC cannot read protects everything: no sweep at all
    d2 = _sandbox(p, tram, "sb2")
    compact(d2, store, tram)
    (d2 / MARKER).write_text("{broken")
    assert collect_garbage(p).removed_chunks == 0


def test_freeze_refuses_a_compacted_dir(tmp_path: Path) -> None:
    p = make_home(tmp_path)
    tram = _template_ram(p)
    d = _sandbox(p, tram)
    compact(d, ChunkStore(p.chunks), tram)
    with pytest.raises(StorageError, match="compacted"):
        freeze(d, p.snapshots / "frozen")


def _holes(path: Path) -> list[tuple[int, int]]:
    from torpor.sandbox.storage.chunks import data_ranges

    with open(path, "rb") as f:
        return data_ranges(f.fileno(), os.fstat(f.fileno()).st_size)


def test_rebuild_reports_where_the_time_went(tmp_path: Path) -> None:
    p = make_home(tmp_path)
    tram = _template_ram(p)
    d = _sandbox(p, tram)
    store = ChunkStore(p.chunks)
    compact(d, store, tram)
    body = json.loads((d / MARKER).read_text())
    [(index, _, pages, base)] = body["patches"]  # the changed chunk: 16 of its 64 pages differ
    assert index == 5 * MIB // (256 << 10) and pages == list(range(16)) and base is not None
    report = rebuild(d, store, sandbox_id="sb1")
    # 3 MiB + 256 KiB of template data are copied; only the 64 KiB that changed are read
    assert report.store_bytes == 64 << 10
    assert report.template_bytes == 3 * MIB + (256 << 10)
    assert report.seconds > 0 and report.durable and not report.stale
    assert rebuild(d, store).seconds == 0.0  # nothing to do


def test_fast_expand_keeps_the_manifest_until_the_state_is_consumed(tmp_path: Path) -> None:
    p = make_home(tmp_path)
    tram = _template_ram(p)
    d = _sandbox(p, tram)
    original = (d / "ram").read_bytes()
    store = ChunkStore(p.chunks)
    compact(d, store, tram)
    report = rebuild(d, store, durable=False)
    assert not report.durable and report.sync_seconds == 0.0
    assert (d / "ram").read_bytes() == original
    assert is_compacted(d)  # a crash now finds the manifest: the pair (RAM, state) is safe
    assert not settle(d)  # the state is still there: nothing to drop
    # a crash that lost the unsynced RAM: the next wake rebuilds it again
    with open(d / "ram", "r+b") as f:
        f.truncate(0)
        f.truncate(len(original))
    expand(d, store, durable=False)
    assert (d / "ram").read_bytes() == original
    (d / "state").unlink()  # the wake consumed the state: the RAM is the guest's now
    assert settle(d) and not is_compacted(d)
    assert not settle(d)


def test_stale_manifest_is_dropped_not_applied(tmp_path: Path) -> None:
    """A crash between a wake and its settle, then a pause: the manifest is older than the
    state; applying it would pair an old RAM with a new state."""
    p = make_home(tmp_path)
    tram = _template_ram(p)
    d = _sandbox(p, tram)
    store = ChunkStore(p.chunks)
    compact(d, store, tram)
    expand(d, store, durable=False)
    (d / "state").unlink()  # woken, the process died before settle...
    with open(d / "ram", "r+b") as f:  # ...the guest ran...
        f.seek(6 * MIB)
        f.write(os.urandom(4096))
    (d / "state").write_bytes(os.urandom(5000))  # ...and paused again
    now = (d / "ram").read_bytes()
    report = rebuild(d, store, sandbox_id="sb1")
    assert report.stale and not is_compacted(d)
    assert (d / "ram").read_bytes() == now  # left alone
    # and a stale manifest does not stop a new compaction
    (d / MARKER).write_text(json.dumps({**_marker_of(d, store, tram), "state": "0" * 64}))
    assert compact(d, store, tram).chunks > 0
    expand(d, store)
    assert (d / "ram").read_bytes() == now


def _marker_of(d: Path, store: ChunkStore, tram: Path) -> dict[str, object]:
    """The manifest a compaction of ``d`` writes (the RAM is put back as it was)."""
    before = (d / "ram").read_bytes()
    compact(d, store, tram)
    body: dict[str, object] = json.loads((d / MARKER).read_text())
    expand(d, store)
    assert (d / "ram").read_bytes() == before
    return body


class _DyingStore(ChunkStore):
    """A chunk store whose process dies (an exception nobody catches) at the n-th read."""

    def __init__(self, root: Path, n: int) -> None:
        super().__init__(root)
        self.left = n

    def get(self, digest: str, *, snapshot_id: str | None = None) -> bytes:
        self.left -= 1
        if self.left < 0:
            raise KeyboardInterrupt("killed mid-expand")
        return super().get(digest, snapshot_id=snapshot_id)


@pytest.mark.parametrize(
    "durable", [pytest.param(True, id="durable"), pytest.param(False, id="fast")]
)
def test_interrupted_expand_leaves_a_wakeable_sandbox(tmp_path: Path, durable: bool) -> None:
    p = make_home(tmp_path)
    tram = _template_ram(p)
    d = _sandbox(p, tram)
    with open(d / "ram", "r+b") as f:  # a second changed chunk, so the kill lands between
        f.seek(7 * MIB)
        f.write(os.urandom(4096))
    original = (d / "ram").read_bytes()
    compact(d, ChunkStore(p.chunks), tram)
    with pytest.raises(KeyboardInterrupt):
        expand(d, _DyingStore(p.chunks, 1), durable=durable)
    assert is_compacted(d)  # the manifest outlives the half-written RAM file
    assert (d / "ram").read_bytes() != original
    expand(d, ChunkStore(p.chunks), durable=durable)
    assert (d / "ram").read_bytes() == original


def test_corrupt_chunk_names_the_sandbox_and_keeps_the_manifest(tmp_path: Path) -> None:
    p = make_home(tmp_path)
    tram = _template_ram(p)
    d = _sandbox(p, tram)
    store = ChunkStore(p.chunks)
    compact(d, store, tram)
    body = json.loads((d / MARKER).read_text())
    [[_, patch, _, _]] = body["patches"]
    import zstandard

    # a patch that decompresses fine but holds other bytes: only the hash check catches it
    store.path_of(patch).write_bytes(zstandard.ZstdCompressor().compress(os.urandom(64 << 10)))
    with pytest.raises(CorruptData) as err:
        expand(d, store, sandbox_id="sb1", durable=False)
    assert err.value.data["sandbox_id"] == "sb1" and "sb1" in str(err.value)
    assert is_compacted(d)


PAGE = 4096
_T = st.sampled_from(["hole", "zeros", "data"])  # a template page
_S = st.sampled_from(["same", "hole", "changed"])  # the sandbox's page against it


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    layout=st.lists(st.tuples(_T, _S), min_size=12, max_size=40),
    durable=st.booleans(),
    template_gone=st.booleans(),
)
def test_expanded_ram_equals_the_original_byte_for_byte(
    tmp_path_factory: pytest.TempPathFactory,
    layout: list[tuple[str, str]],
    durable: bool,
    template_gone: bool,
) -> None:
    """Any mix of template holes, written zeros and data, and sandbox pages equal to the
    template's, punched to holes or changed, with chunks of 4 pages: the rebuilt RAM equals
    the original (with the template's file, or without it: from the store only), and a hole
    of the template inside a template-equal chunk stays a hole."""
    tmp = tmp_path_factory.mktemp("layout")  # a home: expand reads only its templates' RAM
    tram, ram = tmp / "templates" / "t" / "snapshot" / "ram", tmp / "sandboxes" / "sbx" / "ram"
    tram.parent.mkdir(parents=True)
    ram.parent.mkdir(parents=True)
    size = len(layout) * PAGE
    with open(tram, "wb") as t, open(ram, "wb") as s:
        t.truncate(size)
        s.truncate(size)
        for i, (tpage, spage) in enumerate(layout):
            data = {"hole": None, "zeros": bytes(PAGE), "data": os.urandom(PAGE)}[tpage]
            if data is not None:
                t.seek(i * PAGE)
                t.write(data)
            if spage == "changed":
                data = os.urandom(PAGE)
            elif spage == "hole":
                data = None
            if data is not None:
                s.seek(i * PAGE)
                s.write(data)
    (ram.parent / "state").write_bytes(b"device state")
    original = ram.read_bytes()
    store = ChunkStore(tmp / "chunks", chunk_size=4 * PAGE)
    compact(ram.parent, store, tram)
    assert ram.stat().st_blocks == 0
    if template_gone:  # every chunk from the store: patched ones on the template's chunks
        tram.rename(tmp / "elsewhere")
    rebuild(ram.parent, store, durable=durable)
    assert ram.read_bytes() == original
    if template_gone:
        return
    extents = _holes(ram)
    for chunk in range(-(-len(layout) // 4)):
        pages = layout[chunk * 4 : chunk * 4 + 4]
        if any(spage != "same" for _, spage in pages):
            continue  # read from the store (or all zeros): written whole or not at all
        for i, (tpage, _) in enumerate(pages):  # copied from the template: its holes stay
            offset = (chunk * 4 + i) * PAGE
            if tpage == "hole":
                assert not any(a <= offset < b for a, b in extents), f"page {offset // PAGE}"


# -- the manager's sweep, on the fake engine --------------------------------------------------


def test_manager_compacts_long_paused_sandboxes_and_wakes_them(tmp_path: Path) -> None:
    async def main() -> None:
        mgr = SandboxManager(paths(tmp_path / "home"), engine=FakeEngine())
        mgr.compact_after_seconds = 600
        try:
            info = await mgr.create(name="agent")
            await mgr.run_code("agent", "notes = [1, 2]")
            await mgr.pause("agent")
            rec = mgr.registry.get(info.id)
            assert rec.paused_at is not None
            directory = mgr.directory(info.id)
            assert await mgr.compact_sweep(now=rec.paused_at + 599) == []  # not yet
            done = await mgr.compact_sweep(now=rec.paused_at + 601)
            assert [r.sandbox_dir for r in done] == [str(directory)]
            assert is_compacted(directory) and _allocated(directory / "ram") == 0
            mgr.compact_after_seconds = None
            assert await mgr.compact_sweep(now=rec.paused_at + 10**6) == []
            run = await mgr.run_code("agent", "notes")  # wakes it: the RAM is rebuilt first
            assert run.results[0].data["text/plain"] == "[1, 2]"
            assert not is_compacted(directory)
        finally:
            await mgr.close(pause=False)

    asyncio.run(main())


def test_a_gc_during_the_managers_compaction_keeps_its_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between the RAM's chunks being put and compacted.json naming them, no manifest names
    them: a GC (`torpor gc`, POST /v1/gc) that swept then took the RAM for good. The
    compaction holds the store's lock, so the GC waits for it."""

    async def main() -> None:
        mgr = SandboxManager(paths(tmp_path / "home"), engine=FakeEngine())
        mgr.compact_after_seconds = 0
        try:
            info = await mgr.create(name="agent")
            await mgr.run_code("agent", "notes = [1, 2]")
            await mgr.pause("agent")
            rec = mgr.registry.get(info.id)
            store, gcs = mgr.chunk_store, []
            real_sync = store.sync_dirs

            def sync_then_gc() -> None:  # the chunks are in, the marker not yet written
                real_sync()
                gc = threading.Thread(target=collect_garbage, args=(mgr.paths,))
                gc.start()
                gcs.append(gc)
                gc.join(0.5)  # unlocked, it would sweep right here

            monkeypatch.setattr(store, "sync_dirs", sync_then_gc)
            assert rec.paused_at is not None
            done = await mgr.compact_sweep(now=rec.paused_at + 1)
            assert [r.sandbox_dir for r in done] == [str(mgr.directory(info.id))]
            gcs[0].join(30)
            assert not gcs[0].is_alive()
            run = await mgr.run_code("agent", "notes")  # the RAM is rebuilt from its chunks
            assert run.results[0].data["text/plain"] == "[1, 2]"
        finally:
            await mgr.close(pause=False)

    asyncio.run(main())


def test_manager_crash_between_expand_and_wake_leaves_it_compacted(tmp_path: Path) -> None:
    """The wake path rebuilds without fsync and keeps the manifest until the state is
    consumed: a crash at that point leaves a paused, compacted, wakeable sandbox."""

    class Crash(BaseException):
        pass

    def crash_at_wake(name: str, sandbox_id: str) -> None:
        if name == "wake:begin":
            raise Crash(name)

    async def main() -> None:
        home = paths(tmp_path / "home")
        engine = FakeEngine()
        mgr = SandboxManager(home, engine=engine)
        try:
            info = await mgr.create(name="agent")
            await mgr.run_code("agent", "notes = [1, 2]")
            await mgr.pause("agent")
            directory = mgr.directory(info.id)
            compact(directory, mgr.chunk_store, None)
            mgr.on_step = crash_at_wake
            with pytest.raises(Crash):
                await mgr.resume("agent")
            assert is_compacted(directory)  # the RAM is rebuilt, but not durably: kept
        finally:
            await mgr.close(pause=False)
        again = SandboxManager(home, engine=FakeEngine(engine.world))
        try:
            await again.start(supervise=False)  # reconcile: the state is whole -> paused
            assert (await again.get("agent")).state.value == "paused"
            run = await again.run_code("agent", "notes")
            assert run.results[0].data["text/plain"] == "[1, 2]"
            assert not is_compacted(directory)  # the wake consumed the state: settled
        finally:
            await again.close(pause=False)

    asyncio.run(main())


def test_a_cancelled_wake_lets_its_ram_rebuild_end_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A caller's timeout cancels the wake of a compacted sandbox while its RAM is rebuilt in
    a thread. The cancellation waits for that thread: left running, it went on writing the
    RAM file while the next call settled the sandbox, dropped the manifest or began a second
    rebuild of the same file, and then woke a guest on a RAM still being written."""
    real_run = Expansion.run
    gate, finished = threading.Event(), threading.Event()

    def held_run(self: Expansion) -> object:
        gate.wait(30)  # the first rebuild is slow; a test that lets it go sets the gate
        try:
            return real_run(self)
        finally:
            finished.set()

    async def main() -> None:
        engine = FakeEngine()
        mgr = SandboxManager(paths(tmp_path / "home"), engine=engine)
        try:
            info = await mgr.create(name="agent")
            await mgr.run_code("agent", "notes = [1, 2]")
            await mgr.pause("agent")
            directory = mgr.directory(info.id)
            compact(directory, mgr.chunk_store, None)
            monkeypatch.setattr(Expansion, "run", held_run)
            woken = engine.calls.count("wake")
            task = asyncio.ensure_future(mgr.resume("agent"))
            while engine.calls.count("wake") == woken:  # until QEMU waits for the RAM
                await asyncio.sleep(0.01)
            task.cancel()
            asyncio.get_running_loop().call_later(0.3, gate.set)
            with pytest.raises(asyncio.CancelledError):
                await task
            assert finished.is_set()  # no thread writes the RAM file any more
            monkeypatch.setattr(Expansion, "run", real_run)
            run = await mgr.run_code("agent", "notes")
            assert run.results[0].data["text/plain"] == "[1, 2]"
            assert not is_compacted(directory)
        finally:
            gate.set()
            await mgr.close(pause=False)

    asyncio.run(main())


def test_manager_wake_with_a_missing_chunk_is_corrupt_data_and_stays_paused(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        mgr = SandboxManager(paths(tmp_path / "home"), engine=FakeEngine())
        try:
            info = await mgr.create(name="agent")
            await mgr.run_code("agent", "notes = [1, 2]")
            await mgr.pause("agent")
            directory = mgr.directory(info.id)
            compact(directory, mgr.chunk_store, None)
            body = json.loads((directory / MARKER).read_text())
            [digest] = [c for c in body["ram"]["chunks"] if c]
            saved = mgr.chunk_store.get(digest)
            mgr.chunk_store.remove(digest)
            with pytest.raises(CorruptData) as err:
                await mgr.resume("agent")
            assert err.value.data["sandbox_id"] == info.id and info.id in str(err.value)
            assert (await mgr.get("agent")).state.value == "paused"
            assert is_compacted(directory)  # nothing lost: once the chunk is back, it wakes
            mgr.chunk_store.put(saved)
            run = await mgr.run_code("agent", "notes")
            assert run.results[0].data["text/plain"] == "[1, 2]"
            assert not is_compacted(directory)
        finally:
            await mgr.close(pause=False)

    asyncio.run(main())


def test_compact_after_setting_is_checked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from torpor.errors import InvalidArgument

    monkeypatch.setenv("TORPOR_COMPACT_AFTER_SECONDS", "off")
    assert SandboxManager(paths(tmp_path / "h1"), engine=FakeEngine()).compact_after_seconds is None
    monkeypatch.setenv("TORPOR_COMPACT_AFTER_SECONDS", "120")
    assert SandboxManager(paths(tmp_path / "h2"), engine=FakeEngine()).compact_after_seconds == 120
    for bad in ("soon", "-5"):
        monkeypatch.setenv("TORPOR_COMPACT_AFTER_SECONDS", bad)
        with pytest.raises(InvalidArgument):
            SandboxManager(paths(tmp_path / "h3"), engine=FakeEngine())


# -- real QEMU ------------------------------------------------------------------------------


@pytest.mark.qemu
def test_compacted_sandbox_wakes_with_its_ram(qemu_home: Path) -> None:
    async def main() -> None:
        mgr = SandboxManager(paths(qemu_home))
        mgr.compact_after_seconds = 0
        await mgr.start(supervise=False)
        try:
            info = await mgr.create(name="agent")
            await mgr.run_code("agent", "notes = [1, 2]")
            await mgr.pause("agent")
            directory = mgr.directory(info.id)
            held = _allocated(directory / "ram")
            [report] = await mgr.compact_sweep()
            assert report.ram_bytes_before == held and _allocated(directory / "ram") == 0
            assert report.from_template > report.chunks // 2  # mostly the template's RAM
            collect_garbage(mgr.paths)  # the chunks it needs survive a GC
            run = await mgr.run_code("agent", "notes")
            assert run.results[0].data["text/plain"] == "[1, 2]"
            assert not is_compacted(directory)

            # a snapshot of a compacted paused sandbox expands it first, and restores whole
            await mgr.pause("agent")
            await mgr.compact_sweep()
            assert is_compacted(directory)
            cp = Checkpoints(mgr)
            snap = await cp.snapshot(info.id, name="from-compacted")
            assert not is_compacted(directory)
            restored = await cp.restore(snap.id)
            out = await mgr.run_code(restored.id, "notes")
            assert out.results[0].data["text/plain"] == "[1, 2]"
        finally:
            for sandbox in await mgr.list():
                await mgr.kill(sandbox.id)
            await mgr.close(pause=False)

    asyncio.run(main())


@pytest.mark.s3
def test_compaction_into_an_s3_store(tmp_path: Path, s3_server: S3Server, s3_bucket: str) -> None:
    p = make_home(tmp_path)
    tram = _template_ram(p)
    d = _sandbox(p, tram)
    original = (d / "ram").read_bytes()
    store = open_chunk_store(f"s3://{s3_bucket}/c", p.home, client=s3_server.client())
    report = compact(d, store, tram)
    assert report.ram_bytes_after == 0 and report.new_chunk_bytes > 0
    shutil.rmtree(p.home / "chunk-cache")  # this node's cache is gone: the bucket has it all
    expand(d, store)
    assert (d / "ram").read_bytes() == original
