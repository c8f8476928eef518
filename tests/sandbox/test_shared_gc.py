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
