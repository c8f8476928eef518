"""Mark-and-sweep of a chunk store many nodes share: the manifests live in the PostgreSQL
registry, the chunks in S3 (real PostgreSQL, real SeaweedFS). Two homes save snapshots, one is
deleted, the sweep marks from the registry, and what remains restores on a third home."""

from __future__ import annotations

import json
from pathlib import Path

import psycopg
import pytest

from tests.pg import PgCluster
from tests.s3 import S3Server
from torpor.errors import Conflict, CorruptData, InvalidArgument, SnapshotNotFound
from torpor.sandbox.registry.postgres import PostgresRegistry
from torpor.sandbox.storage.chunks import STORE_ENV, FileManifest
from torpor.sandbox.storage.retention import sweep_shared_store
from torpor.sandbox.storage.snapshots import SnapshotStore, freeze

try:  # plain pytest puts this directory on sys.path; a package layout needs the relative form
    from tests.sandbox.storage_helpers import make_home, make_machine
except ImportError:  # pragma: no cover
    from .storage_helpers import make_home, make_machine

pytestmark = [pytest.mark.postgres, pytest.mark.s3]


def _hashes(body: dict[str, object]) -> set[str]:
    files = body["files"]
    assert isinstance(files, dict)
    return set().union(*(FileManifest.from_json(fm).hashes() for fm in files.values()))


def test_sweep_of_a_shared_store_marks_from_the_registry(
    tmp_path: Path,
    s3_server: S3Server,
    s3_bucket: str,
    pg_cluster: PgCluster,
    pg_database: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv(STORE_ENV, f"s3://{s3_bucket}/shared")
    reg = PostgresRegistry(pg_cluster.admin_dsn(pg_database))
    bodies = {}
    for node, fill in (("a", 0x42), ("b", 0x55)):
        home = make_home(tmp_path / node)
        store = SnapshotStore(home)
        info = store.save(freeze(make_machine(home, "sb", fill=fill), store.frozen_root), name=node)
        body = json.loads((home.snapshots / f"{info.id}.json").read_text())
        reg.put_snapshot(body, node=node)
        bodies[node] = body
    with pytest.raises(Conflict):  # one name per tenant
        reg.put_snapshot(bodies["a"], node="a")
    with pytest.raises(InvalidArgument):
        reg.put_snapshot({"files": {}})
    a_id, b_id = (bodies[n]["info"]["id"] for n in "ab")
    assert reg.snapshot_manifest(b_id) == bodies["b"]

    chunks = SnapshotStore(make_home(tmp_path / "c")).chunks
    everything = set(chunks)
    assert everything == _hashes(bodies["a"]) | _hashes(bodies["b"])
    # within the grace period nothing goes, even unmarked: a node may be mid-upload
    assert reg.delete_snapshot(a_id) and not reg.delete_snapshot(a_id)
    assert sweep_shared_store(chunks, reg.referenced_chunks()).removed == 0
    with pytest.raises(SnapshotNotFound):
        reg.snapshot_manifest(a_id)

    report = sweep_shared_store(chunks, reg.referenced_chunks(), min_age_seconds=0)
    only_a = _hashes(bodies["a"]) - _hashes(bodies["b"])
    assert report.removed == len(only_a) > 0
    assert set(chunks) == _hashes(bodies["b"])

    # what remains restores on a third node, from the registry's manifest and the bucket
    c = make_home(tmp_path / "c2")
    (c.snapshots / f"{b_id}.json").write_text(json.dumps(reg.snapshot_manifest(b_id)))
    out = SnapshotStore(c).materialize(b_id)
    assert (out / "ram").stat().st_size == 8 << 20

    # a manifest the registry cannot read stops the marks (and so the sweep)
    with psycopg.connect(pg_cluster.admin_dsn(pg_database), autocommit=True) as conn:
        conn.execute("UPDATE torpor_registry.snapshots SET manifest = '{\"files\": 3}'")
    with pytest.raises(CorruptData):
        reg.referenced_chunks()
    reg.close()


def test_scheduled_sweep_runs_on_one_node_and_spares_live_and_young_chunks(
    tmp_path: Path, dsn: str, store: str
) -> None:
    """Two nodes whose sweeps are due at once: exactly one sweeps (PostgreSQL advisory lock,
    then the record of the last sweep), a dead chunk goes, a chunk a snapshot manifest names
    stays, and so does a young chunk no manifest names yet (an upload in flight)."""
    import threading
    import time

    from torpor.sandbox.manager.cluster import ClusterConfig, ClusterNode
    from torpor.sandbox.storage.snapshots import SnapshotStore as Store

    def cluster_node(name: str) -> ClusterNode:
        config = ClusterConfig(dsn=dsn, store=store, node=name)
        return ClusterNode(config, make_home(tmp_path / name))

    a, b = cluster_node("a"), cluster_node("b")
    shared = a.chunks
    dead, _ = shared.put(b"a chunk no manifest names any more" * 100)
    snapshots: Store = a.snapshot_store()
    info = snapshots.save(
        freeze(make_machine(snapshots.paths, "sb"), snapshots.frozen_root), name="live"
    )
    snapshots.push(info.id)  # its chunks are in the shared store now
    live = set().union(
        *(
            FileManifest.from_json(fm).hashes()
            for fm in a.registry.snapshot_manifest(info.id)["files"].values()
        )
    )
    # S3 keeps a write's time to the second, and another node's sweep knows a chunk's age
    # from it alone: margins of seconds, so a loaded machine cannot make the young one old
    time.sleep(4.5)
    young, _ = shared.put(b"a chunk whose manifest is not recorded yet" * 100)

    reports: dict[str, object] = {}
    gate = threading.Barrier(2)

    def sweep(n: ClusterNode) -> None:
        gate.wait()
        reports[n.node] = n.sweep_if_due(period=3600, min_age_seconds=3.0)

    threads = [threading.Thread(target=sweep, args=(n,)) for n in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done = [r for r in reports.values() if r is not None]
    assert len(done) == 1, reports
    left = set(shared)
    assert dead not in left and young in left and live <= left
    assert a.sweep_if_due(period=3600, min_age_seconds=0) is None  # not due again yet
    assert young in set(shared)
    assert a.registry.last_sweep() is not None
    a.registry.close()
    b.registry.close()
