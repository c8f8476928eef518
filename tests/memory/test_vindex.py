"""The SQLite backend's in-process vector index: exact below IVF_MIN, IVF above it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from torpor.memory.backends._vindex import VectorIndex
from torpor.memory.backends.base import RecordFilter
from torpor.memory.backends.sqlite import SQLiteTenantStore
from torpor.memory.models import Fact, from_us, new_id, now_us

DIM = 32


def _facts(n: int, scope: str = "app/a") -> list[Fact]:
    out = []
    for i in range(n):
        t = from_us(now_us())
        out.append(Fact(id=new_id(), scope=scope, text=f"r{i}", created_at=t, valid_from=t))
    return out


def _vecs(n: int, seed: int) -> np.ndarray:
    """Clustered unit vectors (real embeddings have topics; uniform noise has none)."""
    rng = np.random.default_rng(seed)
    centers = np.random.default_rng(0).normal(size=(40, DIM))
    v = (centers[rng.integers(40, size=n)] + 0.35 * rng.normal(size=(n, DIM))).astype(np.float32)
    out: np.ndarray = v / np.linalg.norm(v, axis=1, keepdims=True)
    return out


@pytest.fixture
def ivf_store(tmp_path: Path) -> SQLiteTenantStore:
    s = SQLiteTenantStore("t", tmp_path / "t.db")
    s._index = VectorIndex(ivf_min=1000)
    return s


def _flt(scopes: list[str] | None = None) -> RecordFilter:
    return RecordFilter(scopes=scopes or ["app/a", ""], now=now_us())


def test_ivf_recall_close_to_exact(ivf_store: SQLiteTenantStore) -> None:
    vecs = _vecs(4000, 1)
    recs = _facts(4000)
    ivf_store.add(recs, list(vecs))
    queries = _vecs(20, 2)
    found = 0
    for q in queries:
        exact = {recs[i].id for i in np.argsort(-(vecs @ q))[:10]}
        got = {r.id for r, _ in ivf_store.vector_search(q.tolist(), _flt(), 10)}
        found += len(exact & got)
    assert ivf_store._index._centroids is not None  # the IVF path ran
    assert found / 200 >= 0.8
    hit = ivf_store.vector_search(vecs[123].tolist(), _flt(), 1)
    assert hit[0][0].id == recs[123].id


def test_ivf_tail_filters_and_deletion(ivf_store: SQLiteTenantStore) -> None:
    vecs = _vecs(2000, 3)
    recs = _facts(2000)
    ivf_store.add(recs, list(vecs))
    ivf_store.vector_search(vecs[0].tolist(), _flt(), 5)  # builds
    extra_vec = _vecs(1, 4)
    [extra] = ivf_store.add(_facts(1, scope="app/b"), list(extra_vec))
    assert ivf_store.vector_search(extra_vec[0].tolist(), _flt(), 3)[0][0].id != extra.id
    got = ivf_store.vector_search(extra_vec[0].tolist(), _flt(["app/b"]), 3)
    assert [r.id for r, _ in got] == [extra.id]  # appended rows are searched (the tail)
    ivf_store.forget([recs[5].id])
    got = ivf_store.vector_search(vecs[5].tolist(), _flt(), 3)
    assert recs[5].id not in {r.id for r, _ in got}
    assert ivf_store.vector_search(vecs[6].tolist(), _flt(), 1)[0][0].id == recs[6].id


def test_a_record_forgotten_by_another_connection_mid_refresh(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process (its own connection) forgetting a record while the index reads the
    new rows and then their vectors: the refresh sees one database state, no KeyError."""
    mine = SQLiteTenantStore("t", tmp_path / "t.db")
    other = SQLiteTenantStore("t", tmp_path / "t.db")
    kept, gone = mine.add(_facts(2), [[1.0] + [0.0] * (DIM - 1), [0.0, 1.0] + [0.0] * (DIM - 2)])
    load = VectorIndex._load_vectors

    def forgetting_first(conn: object, rids: np.ndarray) -> np.ndarray:
        other.forget([gone.id])  # committed between the index's two reads
        return load(conn, rids)  # type: ignore[arg-type]

    monkeypatch.setattr(VectorIndex, "_load_vectors", staticmethod(forgetting_first))
    query = [1.0] + [0.0] * (DIM - 1)
    got = mine.vector_search(query, _flt(), 5)
    assert got[0][0].id == kept.id
    monkeypatch.setattr(VectorIndex, "_load_vectors", staticmethod(load))
    assert [r.id for r, _ in mine.vector_search(query, _flt(), 5)] == [kept.id]
    mine.close()
    other.close()
