"""Retrieval quality: run every system on one generated data set and score it by question kind.

Scoring (all on the ``test`` split unless said otherwise):

* **Recall@5** per kind: the share of gold groups found in the top 5 (:func:`memgen.recall_at_k`),
  averaged over the questions of that kind.
* **abstain**: a system abstains when its best score among the hits it returned is under a
  threshold (no hit at all counts as abstaining). The threshold is the one that maximises
  balanced accuracy on the held-out ``calib`` split (abstention questions vs answerable
  ones). The ``abstain`` column is that balanced accuracy measured on the test split: the
  mean of "abstained on an abstention question" and "answered an answerable question".
* **current**: for knowledge-update questions (both splits) on which the system returned any
  fact of the asked key in its top 5, the share whose first such fact is the current value
  (a superseded value ranked first is the failure). ``current_found`` is the share of all
  update questions with the current fact in the top 5 at all (a retrieval miss, not a stale
  answer), so the two failure modes stay apart.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.memgen import KINDS, Dataset, Question, recall_at_k
from bench.peers import Doc, Peer

__all__ = ["QualityResult", "calibrate", "docs_of", "evaluate"]

K = 5


@dataclass
class QualityResult:
    """One system's scores on one data set."""

    system: str
    recall: dict[str, float] = field(default_factory=dict)
    current: float = 0.0
    current_found: float = 0.0
    threshold: float | None = None
    abstain_rate: float = 0.0  # test abstention questions on which it abstained
    answer_rate: float = 0.0  # test answerable questions on which it answered
    ingest_s: float = 0.0
    query_p50_ms: float = 0.0
    query_p95_ms: float = 0.0
    misses: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (misses capped to a sample)."""
        return {
            "system": self.system,
            "recall_at_5": self.recall,
            "current": self.current,
            "current_found": self.current_found,
            "abstain_threshold": self.threshold,
            "abstain_rate": self.abstain_rate,
            "answer_rate": self.answer_rate,
            "ingest_s": self.ingest_s,
            "query_p50_ms": self.query_p50_ms,
            "query_p95_ms": self.query_p95_ms,
            "sample_misses": self.misses[:20],
        }


def docs_of(ds: Dataset) -> list[Doc]:
    """Every record of the data set in write order (a fact right after its turn)."""
    docs = [Doc(t.id, t.user, t.text, t.at, "episode", None, t.session, t.role) for t in ds.turns]
    docs += [Doc(f.id, f.user, f.text, f.at, "fact", f.key, f.session, "user") for f in ds.facts]
    # a fact shares its turn's timestamp: order it just after that turn
    docs.sort(key=lambda d: (d.user, d.at, d.kind == "fact"))
    return docs


def calibrate(answerable: Sequence[float], abstain: Sequence[float]) -> float:
    """The threshold (answer when top score >= it) that maximises balanced accuracy."""
    if not answerable or not abstain:
        return float("-inf")
    cands = sorted({*answerable, *abstain, float("inf")})
    best, best_acc = cands[0], -1.0
    for thr in cands:
        acc = (
            sum(s < thr for s in abstain) / len(abstain)
            + sum(s >= thr for s in answerable) / len(answerable)
        ) / 2
        if acc > best_acc:
            best, best_acc = thr, acc
    return best


def _first_in_chain(ranked: Sequence[str], q: Question) -> str | None:
    chain = {q.current_fact_id, *q.stale_fact_ids}
    return next((i for i in ranked[:K] if i in chain), None)


def evaluate(system: Peer, ds: Dataset, docs: Sequence[Doc] | None = None) -> QualityResult:
    """Ingest ``ds`` into ``system``, ask every question, and score it (see the module doc)."""
    res = QualityResult(system.name)
    docs = list(docs) if docs is not None else docs_of(ds)
    t0 = time.perf_counter()
    system.add(docs)
    res.ingest_s = time.perf_counter() - t0

    ranked: dict[str, list[str]] = {}
    top: dict[str, float] = {}
    lat: list[float] = []
    for q in ds.questions:
        t1 = time.perf_counter()
        hits = system.search(q.user, q.text, K, q.as_of)
        lat.append((time.perf_counter() - t1) * 1000)
        ranked[q.id] = [i for i, _ in hits]
        # the system's highest confidence (a tiered ranking may not put it first)
        top[q.id] = max(s for _, s in hits) if hits else float("-inf")
    res.query_p50_ms = statistics.median(lat)
    res.query_p95_ms = statistics.quantiles(lat, n=20)[-1] if len(lat) > 1 else lat[0]

    test = [q for q in ds.questions if q.split == "test"]
    for kind in KINDS:
        if kind == "abstain":
            continue
        qs = [q for q in test if q.kind == kind]
        scores = [recall_at_k(ranked[q.id], q.gold, K) for q in qs]
        res.recall[kind] = sum(scores) / len(scores) if scores else float("nan")
        for q, s in zip(qs, scores, strict=True):
            if s < 1.0:
                res.misses.append(
                    {
                        "q": q.id,
                        "kind": kind,
                        "text": q.text,
                        "gold": sorted(q.gold_ids),
                        "got": ranked[q.id],
                    }
                )

    calib = [q for q in ds.questions if q.split == "calib"]
    res.threshold = calibrate(
        [top[q.id] for q in calib if q.kind != "abstain"],
        [top[q.id] for q in calib if q.kind == "abstain"],
    )
    abst = [q for q in test if q.kind == "abstain"]
    answ = [q for q in test if q.kind != "abstain"]
    res.abstain_rate = sum(top[q.id] < res.threshold for q in abst) / max(len(abst), 1)
    res.answer_rate = sum(top[q.id] >= res.threshold for q in answ) / max(len(answ), 1)
    res.recall["abstain"] = (res.abstain_rate + res.answer_rate) / 2

    updates = [q for q in ds.questions if q.kind == "update"]
    first = [_first_in_chain(ranked[q.id], q) for q in updates]
    answered = [(f, q) for f, q in zip(first, updates, strict=True) if f is not None]
    res.current = (
        sum(f == q.current_fact_id for f, q in answered) / len(answered)
        if answered
        else float("nan")
    )
    res.current_found = (
        sum(q.current_fact_id in ranked[q.id][:K] for q in updates) / len(updates)
        if updates
        else float("nan")
    )
    return res
