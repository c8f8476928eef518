"""The default embedder: all-MiniLM-L6-v2 loaded offline from the local package."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from torpor.errors import InvalidArgument
from torpor.memory import Memory, SentenceTransformerEmbedder
from torpor.memory.embeddings import HashEmbedder, default_model_path, resolve_embedder

pytestmark = pytest.mark.embeddings


@pytest.fixture(scope="module")
def minilm() -> SentenceTransformerEmbedder:
    return SentenceTransformerEmbedder()


@pytest.fixture
def smem(home: Path, minilm: SentenceTransformerEmbedder) -> Iterator[Memory]:
    m = Memory(str(home), embedder=minilm)
    yield m
    m.close()


def test_model_is_local_and_normalized(minilm: SentenceTransformerEmbedder) -> None:
    assert default_model_path() is not None
    vecs = minilm.embed(["hello world", "a second sentence"])
    assert vecs.shape == (2, 384) and vecs.dtype == np.float32
    assert np.allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)


def test_a_query_gets_the_vector_a_batch_gives(minilm: SentenceTransformerEmbedder) -> None:
    """A few texts take the one-thread path, many take encode's batches: same vectors."""
    texts = ["what did Caroline paint last week?", "hi", "a much longer sentence " * 40]
    many = minilm.embed([*texts, "filler one", "filler two", "filler three"])
    one_by_one = np.stack([minilm.embed([t])[0] for t in texts])
    assert one_by_one.dtype == np.float32
    assert np.allclose(one_by_one, many[: len(texts)], atol=1e-5)
    assert np.allclose(minilm.embed(texts), many[: len(texts)], atol=1e-5)


def test_semantic_recall_without_shared_words(smem: Memory) -> None:
    u = smem.scope(app="a", user="u")
    u.remember("Jordan's dog is called Rex")
    u.remember("the quarterly invoice was paid late")
    u.log("user", "I moved to Lisbon last spring")
    assert u.recall("what is the name of the pet?", k=1)[0].text == "Jordan's dog is called Rex"
    assert u.recall("which city does the user live in?", k=1)[0].text.startswith("I moved")


def test_abstention_on_unrelated_query(smem: Memory) -> None:
    u = smem.scope(app="a", user="u")
    u.remember("prefers daily summaries")
    assert u.recall("quantum chromodynamics lattice gauge", k=3) == []


def test_issue_example_with_vectors(smem: Memory) -> None:
    u = smem.scope(app="support", user="u-42")
    u.log("user", "Can you send me summaries every week?", session="s1")
    u.remember("prefers weekly summaries", key="summary_cadence")
    u.remember("prefers daily summaries", key="summary_cadence")
    assert u.recall("how often should I send summaries?", k=3)[0].text == "prefers daily summaries"


def test_model_mismatch_falls_back_to_lexical(home: Path, smem: Memory) -> None:
    smem.scope(app="a").remember("stored with MiniLM vectors")
    other = Memory(str(home), embedder=HashEmbedder(16))
    assert other.usable_embedder() is None
    assert [h.text for h in other.scope(app="a").recall("MiniLM vectors")] == [
        "stored with MiniLM vectors"
    ]
    other.close()


def test_resolve() -> None:
    assert resolve_embedder(None) is None
    with pytest.raises(InvalidArgument):
        resolve_embedder(42)
    with pytest.raises(InvalidArgument):
        SentenceTransformerEmbedder("/nonexistent/model")


def test_onnx_query_path_gives_the_torch_vectors(tmp_path: Path) -> None:
    """With onnxruntime installed, queries run through an exported graph that must give
    PyTorch's vectors (cosine >= 0.9999) at any length, padded in a batch or alone."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    fast = SentenceTransformerEmbedder(cache=tmp_path)
    slow = SentenceTransformerEmbedder(onnx=False)
    texts = ["what did Caroline paint last week?", "hi", "a much longer sentence " * 200, "é ü"]
    got = np.vstack([fast.embed([t]) for t in texts] + [fast.embed(texts)])
    assert fast._onnx is not None and fast._onnx.graph.parent == tmp_path
    assert slow._query_model() is None
    ref = slow.embed([*texts, *texts])  # a batch: encode's path, what stored vectors use
    assert got.shape == ref.shape == (8, 384)
    assert float((got * ref).sum(axis=1).min()) >= 0.9999


def test_onnx_query_path_can_be_turned_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORPOR_ONNX", "0")
    emb = SentenceTransformerEmbedder(cache=tmp_path)
    assert emb.embed(["hello"]).shape == (1, 384)
    assert emb._onnx is None and not list(tmp_path.iterdir())
