"""Concurrent single-record writes share model calls (:mod:`torpor.memory._coalesce`): each
caller gets its own record and vector back, a lone caller embeds at once, and an error
reaches only the call whose text causes it."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from torpor.errors import InvalidArgument
from torpor.memory import HashEmbedder, Memory
from torpor.memory._coalesce import FEW, MAX_TEXTS, EmbedBatcher, batcher_for
from torpor.memory.models import Episode, now_us


class SlowEmbedder:
    """HashEmbedder's vectors, each model call taking ``delay`` seconds; refuses any text
    containing "boom" (the whole call fails, as a model error would)."""

    def __init__(self, delay: float = 0.05) -> None:
        self.inner = HashEmbedder(32)
        self.name = self.inner.name
        self.dim = 32
        self.delay = delay
        self.calls: list[list[str]] = []
        self.lock = threading.Lock()

    def embed(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        with self.lock:
            self.calls.append(list(texts))
        time.sleep(self.delay)
        if any("boom" in t for t in texts):
            raise InvalidArgument("this model refuses 'boom'")
        return self.inner.embed(texts)


def _together(n: int, work: Any) -> list[Any]:
    """Run ``work(i)`` on ``n`` threads released at once; each result or exception."""
    start = threading.Barrier(n)
    out: list[Any] = [None] * n

    def run(i: int) -> None:
        start.wait()
        try:
            out[i] = work(i)
        except Exception as exc:
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
        assert not t.is_alive()
    return out


def test_concurrent_logs_share_model_calls_and_each_gets_its_record(home: Path) -> None:
    model = SlowEmbedder()
    mem = Memory(str(home), embedder=model)
    u = mem.scope(app="a", user="u")
    n = 12
    eps = _together(n, lambda i: u.log("user", f"turn number {i} about walrus {i}"))
    assert all(isinstance(e, Episode) for e in eps)
    assert [e.text for e in eps] == [f"turn number {i} about walrus {i}" for i in range(n)]
    # fewer model calls than callers: the texts that came during a call shared the next
    assert len(model.calls) < n
    assert sorted(t for call in model.calls for t in call) == sorted(e.text for e in eps)
    assert max(len(c) for c in model.calls) > 1
    # each record is stored, with the vector of its own text
    back = mem.store.get([e.id for e in eps], now_us())
    assert [r.text for r in back if r is not None] == [e.text for e in eps]
    for e in eps:
        hits = u.recall(e.text, k=1)
        assert hits[0].record.id == e.id and hits[0].scores.get("vector", 0) > 0.99
    mem.close()


def test_an_error_reaches_only_its_own_call(home: Path) -> None:
    model = SlowEmbedder()
    mem = Memory(str(home), embedder=model)
    u = mem.scope(app="a", user="u")
    n = 8

    def work(i: int) -> Any:
        if i == 0:  # the first call runs alone; the others queue behind it
            return u.log("user", "first, alone")
        time.sleep(0.01)
        return u.log("user", "boom goes this one" if i == 5 else f"fine turn {i}")

    out = _together(n, work)
    errors = [x for x in out if isinstance(x, Exception)]
    assert len(errors) == 1 and isinstance(errors[0], InvalidArgument)
    assert isinstance(out[5], InvalidArgument)
    kept = [x for x in out if isinstance(x, Episode)]
    assert len(kept) == n - 1
    stored = u.get_all(page_size=100).items
    assert sorted(r.text for r in stored) == sorted(e.text for e in kept)  # nothing lost
    assert not any("boom" in r.text for r in stored)
    mem.close()


def test_a_lone_caller_embeds_at_once() -> None:
    model = SlowEmbedder(delay=0.0)
    b = EmbedBatcher(model)
    for i in range(3):
        vec = b.embed([f"text {i}"])
        assert vec.shape == (1, 32)
        np.testing.assert_allclose(vec, model.inner.embed([f"text {i}"]))
    assert model.calls == [["text 0"], ["text 1"], ["text 2"]]
    big = [f"t{i}" for i in range(FEW + 1)]  # a batch already: straight to the model
    assert b.embed(big).shape == (FEW + 1, 32) and model.calls[-1] == big


def test_one_batcher_per_embedder() -> None:
    a, b = HashEmbedder(8), HashEmbedder(8)
    assert batcher_for(a) is batcher_for(a)
    assert batcher_for(a) is not batcher_for(b)


def test_an_interrupted_follower_leaves_the_queue_working() -> None:
    """A queued caller that leaves (an exception in its wait) neither hangs the others nor
    keeps the model marked busy."""
    model = SlowEmbedder(delay=0.2)
    b = EmbedBatcher(model)
    leader = threading.Thread(target=b.embed, args=(["lead"],))
    leader.start()
    time.sleep(0.05)  # the leader is inside its model call
    from torpor.memory import _coalesce

    call = _coalesce._Call(["leaver"])
    with b._lock:
        b._queue.append(call)
    b._leave(call)  # what embed() does when its wait is interrupted
    leader.join(5)
    assert not leader.is_alive() and b._running == 0 and not b._queue
    assert b.embed(["after"]).shape == (1, 32)


@pytest.mark.parametrize("n", [pytest.param(1, id="one"), pytest.param(6, id="six")])
def test_vectors_are_the_models_own(n: int) -> None:
    model = SlowEmbedder(delay=0.02)
    b = EmbedBatcher(model)
    texts = [f"sentence {i} with words {i * 7}" for i in range(n)]
    out = _together(n, lambda i: b.embed([texts[i]]))
    for i, vec in enumerate(out):
        np.testing.assert_allclose(vec, model.inner.embed([texts[i]]), rtol=1e-6)


class OverlapEmbedder(SlowEmbedder):
    """Counts the model calls running at once."""

    def __init__(self, delay: float) -> None:
        super().__init__(delay)
        self.now = 0
        self.most = 0

    def embed(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        try:
            return super().embed(texts)
        finally:
            with self.lock:
                self.now -= 1


@pytest.mark.parametrize("lanes", [1, 2])
def test_lanes_bound_the_model_calls_at_once_and_joined_batches_stay_few(lanes: int) -> None:
    """With two lanes two shared model calls run at once (one per core: the default
    embedder's few-text path runs on one thread), never more; each joins at most
    MAX_TEXTS texts, and every caller still gets its own text's vector."""
    model = OverlapEmbedder(delay=0.05)
    b = EmbedBatcher(model, lanes=lanes)
    n = 16
    texts = [f"sentence {i}" for i in range(n)]
    out = _together(n, lambda i: b.embed([texts[i]]))
    assert model.most == lanes
    assert max(len(c) for c in model.calls) <= MAX_TEXTS
    assert len(model.calls) < n  # joined all the same
    for i, vec in enumerate(out):
        np.testing.assert_allclose(vec, model.inner.embed([texts[i]]), rtol=1e-6)
    assert b._running == 0 and not b._queue
