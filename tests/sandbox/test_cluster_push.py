"""The pause push's skip rule and the one-query lease claim, against a real S3 store
(SeaweedFS) and a real PostgreSQL.

A push sends every chunk but the template's, those the sandbox's recorded pause names and
those this node wrote a moment ago: a chunk this node only has in its cache may have been
swept from the store since, and skipping it would record a durable pause that cannot wake.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.s3 import S3Server
from torpor.errors import SandboxNotFound
from torpor.sandbox.models import SandboxState as S
from torpor.sandbox.registry import SandboxRecord
from torpor.sandbox.registry.postgres import PostgresRegistry
from torpor.sandbox.storage.chunks import ChunkStore, PutStats, open_chunk_store
from torpor.sandbox.storage.pauses import manifest_chunks, push_pause, rebuild_pause

pytestmark = [pytest.mark.postgres, pytest.mark.s3]

CHUNK = 256 * 1024


def _template(root: Path, build: str = "b1") -> Path:
    t = root / "templates" / "python"
    (t / "snapshot").mkdir(parents=True)
    (t / "template.json").write_text(
        json.dumps({"name": "python", "build_id": build, "directory": str(t)})
    )
    ram = bytearray(8 * CHUNK)
    for i in range(0, len(ram), 4096):
        ram[i] = (i // 4096) % 251 + 1
    (t / "snapshot" / "ram").write_bytes(bytes(ram))
    return t


def _sandbox(root: Path, template: Path, changed: dict[int, int]) -> Path:
    """A paused sandbox directory whose RAM is the template's but for ``changed`` (chunk
    index -> the byte its first page starts with)."""
    sandbox = root / "sandboxes" / "sbx-1"
    sandbox.mkdir(parents=True, exist_ok=True)
    ram = bytearray((template / "snapshot" / "ram").read_bytes())
    for index, byte in changed.items():
        ram[index * CHUNK + 11] = byte
    (sandbox / "ram").write_bytes(bytes(ram))
    (sandbox / "state").write_bytes(b"device state")
    return sandbox


@pytest.fixture
def s3_store(s3_server: S3Server, s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> str:
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    return f"s3://{s3_bucket}/cluster"


def _on_store(chunks: ChunkStore, digest: str) -> bool:
    return chunks.verify(digest)


def test_a_cached_chunk_swept_from_the_store_is_sent_again(tmp_path: Path, s3_store: str) -> None:
    template = _template(tmp_path)
    chunks = open_chunk_store(s3_store, tmp_path / "home")
    sandbox = _sandbox(tmp_path, template, {2: 0xA1, 5: 0xB2})
    first = push_pause(sandbox, chunks, template, sandbox_id="sbx-1")
    ram = first["files"]["ram"]["chunks"]
    assert sorted(first["from_template"]) == [0, 1, 3, 4, 6, 7]
    swept = ram[2]
    # a sweep of the shared store removed it (nothing named it), on another node: this
    # node's cache still holds it, and what this node wrote is older than the grace
    chunks.backend.client.delete_object(  # type: ignore[attr-defined]
        Bucket=chunks.backend.where.bucket,  # type: ignore[attr-defined]
        Key=chunks.backend.key_of(swept),  # type: ignore[attr-defined]
    )
    assert swept in chunks.backend.cache  # type: ignore[attr-defined]
    chunks.backend.gc_grace_seconds = 0.0  # type: ignore[attr-defined]
    stats = PutStats()
    again = push_pause(sandbox, chunks, template, sandbox_id="sbx-1", stats=stats)
    assert again["files"]["ram"]["chunks"][2] == swept
    assert _on_store(chunks, swept), "the push skipped a chunk the store had lost"
    assert stats.chunks.get("stored", 0) >= 2 and stats.chunks.get("known", 0) == 0
    # what a rebuild elsewhere needs is all there
    other = _template(tmp_path / "b")
    rebuild_pause(again, tmp_path / "b" / "sbx-1", chunks, other)
    assert (tmp_path / "b" / "sbx-1" / "ram").read_bytes() == (sandbox / "ram").read_bytes()


def test_chunks_of_the_recorded_pause_are_not_sent_again(tmp_path: Path, s3_store: str) -> None:
    template = _template(tmp_path)
    chunks = open_chunk_store(s3_store, tmp_path / "home")
    chunks.backend.gc_grace_seconds = 0.0  # type: ignore[attr-defined]  # nothing "recent"
    sandbox = _sandbox(tmp_path, template, {2: 0xA1, 5: 0xB2})
    first = push_pause(sandbox, chunks, template, sandbox_id="sbx-1")
    known = manifest_chunks(first)
    assert known == {first["files"]["ram"]["chunks"][i] for i in (2, 5)} | set(
        first["files"]["state"]["chunks"]
    )
    _sandbox(tmp_path, template, {2: 0xA1, 5: 0xC3})  # chunk 5 changed again
    stats = PutStats()
    second = push_pause(sandbox, chunks, template, sandbox_id="sbx-1", known=known, stats=stats)
    assert stats.chunks == {"template": 6, "known": 2, "stored": 1}  # ram 2 and the state
    assert _on_store(chunks, second["files"]["ram"]["chunks"][5])


def test_manifest_chunks_leaves_out_what_the_template_gave() -> None:
    a, b = "a" * 64, "b" * 64
    manifest = {
        "files": {
            "ram": {"size": 3 * CHUNK, "chunk_size": CHUNK, "chunks": [a, None, b]},
            "state": {"size": 5, "chunk_size": CHUNK, "chunks": [a]},
        },
        "from_template": [0],
        "volumes": {},
    }
    assert manifest_chunks(manifest) == {a, b}  # a: stored as the state's chunk
    manifest["files"]["state"]["chunks"] = ["c" * 64]  # type: ignore[index]
    assert manifest_chunks(manifest) == {b, "c" * 64}
    assert manifest_chunks(None) == set()
    assert manifest_chunks({"files": {"ram": {"size": "x"}}}) == set()  # unreadable: none


def _rec(state: S, **kw: object) -> SandboxRecord:
    return SandboxRecord(
        id="sbx-1",
        tenant="default",
        name="a",
        template="python",
        state=state,
        **kw,  # type: ignore[arg-type]
    )


@pytest.fixture
def pg(dsn: str) -> Iterator[PostgresRegistry]:
    reg = PostgresRegistry(dsn)
    yield reg
    reg.close()


def test_claim_takes_only_a_free_or_own_sandbox(pg: PostgresRegistry) -> None:
    pg.insert(_rec(S.PAUSED, paused_at=100.0))
    facts = pg.claim_facts("sbx-1", "n1")
    assert (facts.state, facts.owner_node, facts.origin, facts.pinned_elsewhere) == (
        S.PAUSED,
        None,
        None,
        False,
    )
    pg.record_durable("sbx-1", "n1", 100.0, {"version": 1, "files": {}, "origin": {"node": "n1"}})
    facts = pg.claim_facts("sbx-1", "n2")
    assert facts.origin == {"node": "n1"} and facts.manifest_paused_at == facts.paused_at == 100.0
    assert pg.claim("sbx-1", "n1", lease_seconds=60)
    assert pg.claim("sbx-1", "n1", lease_seconds=60)  # its own: renewed
    assert not pg.claim("sbx-1", "n2", lease_seconds=60)  # another node's: refused
    assert pg.owner("sbx-1") == "n1"
    pg.acquire("sbx-1", "n1", lease_seconds=1, at=1000.0)  # lapsed long ago
    assert not pg.claim("sbx-1", "n2", lease_seconds=60)  # a lapse is recover()'s to handle
    with pytest.raises(SandboxNotFound):
        pg.claim_facts("sbx-nope", "n1")
    assert not pg.claim("sbx-nope", "n1", lease_seconds=60)
