"""The benchmark's torpor adapter and scale helpers, against the real torpor.Memory (SQLite)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest

from bench._quality import docs_of
from bench._scale import ProjectionEmbedder, ScaleResult, scale_run
from bench._torpor import TorporSystem
from bench.memgen import Dataset, GenConfig, generate


@pytest.fixture(scope="module")
def ds() -> Dataset:
    return generate(GenConfig(seed=13, users=4))


@pytest.fixture(scope="module")
def lexical(ds: Dataset, tmp_path_factory: pytest.TempPathFactory) -> TorporSystem:
    system = TorporSystem("torpor-lexical", None, home=tmp_path_factory.mktemp("home"))
    system.add(docs_of(ds))
    return system


def test_every_record_maps_back_to_its_generator_id(ds: Dataset, lexical: TorporSystem) -> None:
    assert sorted(lexical.to_gen.values()) == sorted(d.id for d in docs_of(ds))


def test_as_of_sees_exactly_the_fact_valid_then(ds: Dataset, lexical: TorporSystem) -> None:
    facts = {f.id: f for f in ds.facts}
    temporal = [q for q in ds.questions if q.kind == "temporal"]
    assert temporal
    for q in temporal:
        gold = next(facts[i] for i in q.gold_ids if i in facts)
        hits = lexical.search(q.user, gold.text, 20, q.as_of)
        same_key = [i for i, _ in hits if i in facts and facts[i].key == gold.key]
        assert same_key == [gold.id], q.text


def test_a_superseded_fact_is_not_recalled(ds: Dataset, lexical: TorporSystem) -> None:
    facts = {f.id: f for f in ds.facts}
    for q in ds.questions:
        if q.kind == "update":
            stale = facts[q.stale_fact_ids[0]]
            hits = lexical.search(q.user, stale.text, 20)
            assert stale.id not in [i for i, _ in hits]


def test_projection_embedder_is_deterministic_and_unit_length() -> None:
    texts = ["the quick brown fox", "a slow green turtle", ""]
    a = ProjectionEmbedder().embed(texts)
    b = ProjectionEmbedder().embed(texts)
    assert a.shape == (3, 384) and np.allclose(a, b)
    assert np.allclose(np.linalg.norm(a[:2], axis=1), 1.0) and not a[2].any()


def test_a_tiny_scale_run_reports_every_figure(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the store lands in tmp_path
    res: ScaleResult = scale_run(300, "hybrid", reps=8, progress=lambda _m: None)
    row = res.as_dict()
    assert row["size"] == 300 and row["queries"] == 8
    assert row["add_records_per_s"] > 0 and row["recall_p50_ms"] > 0
    assert len(res.context_ms) == 5
