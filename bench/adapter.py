"""A learned linear adapter on the query vector (issue 10): train it on BEAM, measure MiniLM alone.

Run from the repository root (the data is not in this repository; see ``bench/README.md``)::

    python -m bench.adapter --train 500K,100K-dev --val 500K-val --out /tmp/adapter.npy
    python -m bench.adapter --train 100K-dev-fit --val 100K-dev-val --rank 32 --lam 1,10
    python -m bench.adapter --eval /tmp/adapter.npy          # MiniLM alone, baseline vs adapted

The adapter maps a query's MiniLM vector ``q`` to ``normalize(M q)``, ``M = I + U V^T`` (rank
``--rank``; 0: a full 384 x 384 ``A``); the turns' vectors are left as they are, so a stored
index does not change, only the query is moved. It is trained so that a question's vector
ranks its evidence turns above the other turns of the same conversation: for each question,
the softmax over every turn of its conversation of ``cos(q', turn) / tau`` (tau ``--tau``,
0.05), and the loss is minus the log of the probability mass on its evidence turns (InfoNCE
with a set of positives), plus ``lam x ||M - I||^2`` (``--lam``, a sweep) pulling it to the
identity. Full-batch Adam (lr ``--lr``, 2e-4) over every training question per step; after each
epoch the held-out BEAM slice's R@5 + R@10 (MiniLM alone, the adapted query) is read and the
best epoch is kept
(early stopping, patience ``--patience``). The chosen ``M`` (float32, 384 x 384) is written
with ``np.save``; ``python -m bench.conversations --query-adapter M.npy`` measures it through
torpor (queries only: the turns' vectors come from the cache).

Slices (``--train`` / ``--val``, comma-separated):

* ``100K-dev`` / ``100K-test``: BEAM 100K's halves as ``bench.conversations --split`` has them;
* ``100K-dev-fit`` / ``100K-dev-val``: the dev half without / with only its last two chats;
* ``500K``: BEAM 500K without the validation slice; ``500K-val``: every fifth 500K chat (5th,
  10th, ...); only chats whose turn vectors are already cached are used (``--embed`` to embed
  the missing ones first: ~10 turns/s here);
* ``realtalk``: REALTALK's ten chats (``data/Chat_*.json`` only), for evaluation, never training.

``--user-only`` trains and validates on BEAM's user turns alone (the questions whose evidence
is among them), so the adapter cannot learn "prefer the user's turns", a trait of BEAM's
generator that conversations between people do not share.

Training uses BEAM only. Turn vectors come from ``bench.conversations``' cache
(``~/.cache/torpor-bench/vectors``), question vectors from the same model's query path (ONNX
Runtime one at a time, as torpor embeds a query), cached beside them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from bench.conversations import (
    DEFAULT_DATA,
    KS,
    SETS,
    CachedEmbedder,
    Conversation,
    load,
    load_realtalk,
    split,
)

CACHE = DEFAULT_DATA.parent / "vectors"
F32 = npt.NDArray[np.float32]


@dataclass
class Chat:
    """One conversation as arrays: turn vectors, question vectors, each question's evidence
    rows and ability."""

    name: str
    docs: F32  # (turns, dim), unit rows
    queries: F32  # (questions, dim), unit rows
    evidence: list[npt.NDArray[np.int64]]
    abilities: list[str]
    user: npt.NDArray[np.bool_]  # the turn's speaker is BEAM's "user" (diagnostics only)


def _cached(emb: CachedEmbedder, conv: Conversation, embed_missing: bool) -> F32 | None:
    texts = [conv.record_text(t) for t in conv.turns]
    key = hashlib.sha256(("\x00".join([emb.name, *texts])).encode()).hexdigest()[:24]
    path = CACHE / f"{key}.npy"
    if path.exists():
        vecs: F32 = np.load(path)
        return vecs
    if not embed_missing:
        return None
    emb.warm(conv)
    return np.stack([emb.cache[t] for t in texts])


def _query_vectors(emb: CachedEmbedder, texts: list[str]) -> F32:
    key = hashlib.sha256(("\x00".join([emb.name, "queries", *texts])).encode()).hexdigest()[:24]
    path = CACHE / f"q-{key}.npy"
    if path.exists():
        cached: F32 = np.load(path)
        return cached
    vecs = np.stack([emb.query(t) for t in texts]).astype(np.float32)
    np.save(path, vecs)
    return vecs


def chats(convs: list[Conversation], emb: CachedEmbedder, embed_missing: bool) -> list[Chat]:
    out = []
    for conv in convs:
        docs = _cached(emb, conv, embed_missing)
        if docs is None or not conv.questions:
            continue
        row = {t.id: i for i, t in enumerate(conv.turns)}
        out.append(
            Chat(
                conv.name,
                docs.astype(np.float32),
                _query_vectors(emb, [q.text for q in conv.questions]),
                [np.array(sorted(row[e] for e in q.evidence)) for q in conv.questions],
                [q.ability for q in conv.questions],
                np.array([t.role == "user" for t in conv.turns]),
            )
        )
    return out


def users_only(data: list[Chat]) -> list[Chat]:
    """Each chat cut to the user's turns, questions kept with their evidence among them: the
    adapter cannot then gain by preferring BEAM's "user" turns over the assistant's (BEAM's
    generator puts most evidence there; conversations between people have no such side)."""
    out = []
    for c in data:
        keep = np.flatnonzero(c.user)
        new = {int(old): i for i, old in enumerate(keep)}
        ev, ab, qs = [], [], []
        for i, e in enumerate(c.evidence):
            rows = [new[int(x)] for x in e if int(x) in new]
            if rows:
                ev.append(np.array(rows))
                ab.append(c.abilities[i])
                qs.append(c.queries[i])
        if ev:
            out.append(Chat(c.name, c.docs[keep], np.stack(qs), ev, ab, np.ones(len(keep), bool)))
    return out


def select(name: str) -> list[Conversation]:
    """The conversations of one slice name (see the module's docstring)."""
    if name == "realtalk":
        return load_realtalk(SETS["realtalk"], None)
    if name.startswith("100K"):
        convs = load(DEFAULT_DATA, ["100K"], None)
        half = split(convs, "test" if name == "100K-test" else "dev")
        if name == "100K-dev-fit":
            return half[:-2]
        if name == "100K-dev-val":
            return half[-2:]
        return half
    if name.startswith("500K"):
        convs = load(DEFAULT_DATA, ["500K"], None)
        val = [c for i, c in enumerate(convs, 1) if i % 5 == 0]
        return val if name == "500K-val" else [c for c in convs if c not in val]
    raise SystemExit(f"unknown slice {name!r}")


# -- scoring ---------------------------------------------------------------------------------
def adapt(q: F32, m: F32 | None) -> F32:
    """``normalize(M q)`` for each row ``q`` (``m`` None: unchanged)."""
    if m is None:
        return q
    out = q @ m.T
    moved: F32 = (out / np.linalg.norm(out, axis=1, keepdims=True)).astype(np.float32)
    return moved


def recall(data: list[Chat], m: F32 | None, user_only: bool = False) -> dict[str, dict[str, float]]:
    """Recall@1/5/10 of MiniLM alone (cosine, exact) per ability and ``all``, the bench's way:
    the share of a question's evidence among the first k, averaged over questions.
    ``user_only``: only the user's turns are searched, questions scored on their evidence there
    (BEAM's "user-only" stand-in for short turns)."""
    rows: dict[str, dict[int, list[float]]] = {}
    for c in data:
        q = adapt(c.queries, m)
        docs = c.docs
        keep = np.flatnonzero(c.user) if user_only else np.arange(len(docs))
        sims = q @ docs[keep].T
        order = np.argsort(-sims, axis=1, kind="stable")[:, : max(KS)]
        for i, ev in enumerate(c.evidence):
            ev_set = set(ev.tolist()) & set(keep.tolist())
            if not ev_set:
                continue
            got = keep[order[i]]
            row = rows.setdefault(c.abilities[i], {k: [] for k in KS})
            for k in KS:
                row[k].append(len(ev_set & set(got[:k].tolist())) / len(ev_set))
    out: dict[str, dict[str, float]] = {}
    every: dict[int, list[float]] = {k: [] for k in KS}
    for ability, row in sorted(rows.items()):
        out[ability] = {**{f"R@{k}": statistics.fmean(row[k]) for k in KS}, "n": len(row[1])}
        for k in KS:
            every[k] += row[k]
    if every[1]:
        out["all"] = {**{f"R@{k}": statistics.fmean(every[k]) for k in KS}, "n": len(every[1])}
    return out


# -- training --------------------------------------------------------------------------------
def train(
    data: list[Chat],
    val: list[Chat],
    rank: int,
    lam: float,
    tau: float = 0.05,
    lr: float = 1e-3,
    epochs: int = 300,
    patience: int = 30,
    seed: int = 0,
) -> tuple[F32, dict[str, float]]:
    """Fit ``M = I + U V^T`` (or ``I + A``, ``rank`` 0); returns the best epoch's ``M`` on
    ``val``'s R@5 + R@10 (MiniLM alone; R@10 added because a validation slice of a few dozen
    questions is noisy at R@5 alone) and a summary of the run."""
    import torch

    torch.manual_seed(seed)
    dim = data[0].docs.shape[1]
    batches = []
    for c in data:
        pos = torch.zeros(len(c.evidence), len(c.docs), dtype=torch.bool)
        for i, ev in enumerate(c.evidence):
            pos[i, torch.from_numpy(ev)] = True
        batches.append((torch.from_numpy(c.docs), torch.from_numpy(c.queries), pos))
    if rank:
        u = torch.zeros(dim, rank, requires_grad=True)
        v = torch.nn.Parameter(torch.randn(dim, rank) / dim**0.5)
        params = [u, v]
    else:
        a = torch.zeros(dim, dim, requires_grad=True)
        params = [a]
    eye = torch.eye(dim)

    def delta() -> torch.Tensor:
        return u @ v.T if rank else a

    opt = torch.optim.Adam(params, lr=lr)
    n_q = sum(len(b[1]) for b in batches)
    best = (-1.0, 0, eye.numpy().copy())
    base = recall(val, None)["all"]
    base_val = base["R@5"] + base["R@10"]
    history = []
    since = 0
    for epoch in range(1, epochs + 1):
        opt.zero_grad()
        d = delta()
        m = eye + d
        loss = torch.zeros(())
        for docs, queries, pos in batches:
            q = torch.nn.functional.normalize(queries @ m.T, dim=1)
            logits = q @ docs.T / tau
            every = torch.logsumexp(logits, dim=1)
            hit = torch.logsumexp(logits.masked_fill(~pos, float("-inf")), dim=1)
            loss = loss + (every - hit).sum()
        loss = loss / n_q + lam * (d**2).sum()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        mat = (eye + delta()).detach().numpy().astype(np.float32)
        fig = recall(val, mat)["all"]
        r5 = fig["R@5"] + fig["R@10"]
        history.append((epoch, float(loss.detach()), r5))
        if r5 > best[0] + 1e-9:
            best, since = (r5, epoch, mat), 0
        else:
            since += 1
            if since >= patience:
                break
    r5, epoch, mat = best
    return mat, {
        "rank": rank,
        "lam": lam,
        "tau": tau,
        "best_epoch": epoch,
        "epochs_run": len(history),
        "val_R@5+10_base": base_val,
        "val_R@5+10": r5,
        "delta_norm": float(np.linalg.norm(mat - np.eye(dim))),
        "final_loss": history[-1][1],
    }


def _fmt(fig: dict[str, float]) -> str:
    return " / ".join(f"{fig[f'R@{k}']:.3f}" for k in KS)


def report(sets: dict[str, list[Chat]], m: F32 | None, per_ability: bool) -> dict[str, object]:
    out: dict[str, object] = {}
    for name, data in sets.items():
        base, got = recall(data, None), recall(data, m)
        out[name] = {"base": base, "adapted": got}
        print(
            f"  {name:14s} n={int(base['all']['n']):4d}  MiniLM {_fmt(base['all'])}  ->  "
            f"adapted {_fmt(got['all'])}"
        )
        if per_ability:
            for ab in base:
                if ab != "all":
                    print(
                        f"      {ab:28s} n={int(base[ab]['n']):3d}  {_fmt(base[ab])} -> "
                        f"{_fmt(got[ab])}"
                    )
        if any(c.user.any() and not c.user.all() for c in data):
            bu, gu = recall(data, None, True), recall(data, m, True)
            out[name + " user-only"] = {"base": bu, "adapted": gu}
            print(
                f"  {name + ' user-only':14s}          MiniLM {_fmt(bu['all'])}  ->  "
                f"adapted {_fmt(gu['all'])}"
            )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--train", default="500K,100K-dev", help="slices to train on")
    ap.add_argument("--val", default="500K-val", help="held-out BEAM slices for early stopping")
    ap.add_argument("--eval", type=Path, default=None, help="only measure this adapter (.npy)")
    ap.add_argument("--report", default="100K-test", help="slices to print after training")
    ap.add_argument("--rank", default="32", help="comma-separated ranks (0: full matrix)")
    ap.add_argument("--lam", default="0.1,1,10", help="comma-separated ||M - I||^2 weights")
    ap.add_argument("--tau", type=float, default=0.05)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--epochs", type=int, default=400)
    ap.add_argument("--patience", type=int, default=30)
    ap.add_argument("--embed", action="store_true", help="embed turns missing from the cache")
    ap.add_argument("--out", type=Path, default=None, help="write the best adapter (.npy)")
    ap.add_argument("--per-ability", action="store_true")
    ap.add_argument(
        "--user-only", action="store_true", help="train and validate on BEAM's user turns only"
    )
    ap.add_argument("--json", type=Path, default=None, help="write the figures as JSON")
    args = ap.parse_args(argv)
    emb = CachedEmbedder(CACHE)

    def get(spec: str) -> dict[str, list[Chat]]:
        return {s: chats(select(s), emb, args.embed) for s in spec.split(",") if s.strip()}

    result: dict[str, object] = {}
    if args.eval is not None:
        m = np.load(args.eval).astype(np.float32)
        result["eval"] = report(get(args.report), m, args.per_ability)
    else:
        tr = [c for v in get(args.train).values() for c in v]
        va = [c for v in get(args.val).values() for c in v]
        if args.user_only:
            tr, va = users_only(tr), users_only(va)
        print(
            f"train: {len(tr)} chats, {sum(len(c.evidence) for c in tr)} questions, "
            f"{sum(len(c.docs) for c in tr)} turns; val: {len(va)} chats, "
            f"{sum(len(c.evidence) for c in va)} questions ({[c.name for c in va]})"
        )
        runs = []
        best: tuple[float, F32 | None, dict[str, float]] = (-1.0, None, {})
        for rank in (int(r) for r in args.rank.split(",")):
            for lam in (float(x) for x in args.lam.split(",")):
                t0 = time.perf_counter()
                m, info = train(tr, va, rank, lam, args.tau, args.lr, args.epochs, args.patience)
                info["seconds"] = time.perf_counter() - t0
                runs.append(info)
                print(
                    "  "
                    + json.dumps(
                        {k: round(v, 4) if isinstance(v, float) else v for k, v in info.items()}
                    ),
                    flush=True,
                )
                if info["val_R@5+10"] > best[0]:
                    best = (info["val_R@5+10"], m, info)
        result["runs"] = runs
        result["chosen"] = best[2]
        print(f"chosen on the validation slice: rank {best[2]['rank']}, lam {best[2]['lam']}")
        if args.out is not None and best[1] is not None:
            np.save(args.out, best[1])
            print(f"wrote {args.out}")
        if args.report:
            result["eval"] = report(get(args.report), best[1], args.per_ability)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
