"""An in-process vector index over one tenant's embeddings (numpy).

The matrix of L2-normalized float32 vectors is cached with the few columns that filtering
needs (scope, kind, validity, expiry), so a query is a matrix-vector product plus a mask.
The cache is refreshed when the database changes (the caller passes a change token): new
rows are appended, deleted rows dropped, and the small per-row columns re-read so
supersession and expiry show up.

Below :data:`IVF_MIN` vectors the search is exact (brute force is fast enough there).
From there an IVF index (inverted file: spherical k-means into ``sqrt(n)/4`` lists, at most
256) is built lazily on the next query: rows are stored list by list, a query scores the
centroids and scans the ``nprobe`` nearest lists (about a sixteenth of the data) plus the rows
appended since the build, probing more lists when the filter leaves too few. The scan reads
64-dimensional projections (the top principal directions of a sample) rather than the full
vectors, since a scan is bound by memory bandwidth, and re-scores the best 1024 exactly.
Appends keep the index; a deletion, or a tail over a quarter of the indexed rows, triggers a
rebuild.

The approximation costs recall most on structureless vectors; topical embeddings cluster,
which is what IVF relies on. Exact search stays the default below 50k vectors. What each
stage measured is in ``bench/README.md`` ("SQLite vector index").

The index only *proposes* candidates: the store re-checks every candidate against the full
filter in SQL, so a stale cache can cost a result but can never leak an invisible record.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Hashable, Sequence

import numpy as np
import numpy.typing as npt

from torpor.memory.backends.base import RecordFilter

log = logging.getLogger(__name__)

__all__ = ["IVF_MIN", "VectorIndex"]

#: vectors from which the IVF index is used instead of exact search
IVF_MIN = 50_000
_NONE = np.iinfo(np.int64).max
_KIND = {"fact": 0, "episode": 1}
_CHUNK = 32_768
#: dimensions of the coarse (projected) scan; the best candidates are then re-scored exactly
_PROJ_DIM = 64
_RESCORE = 1024


class VectorIndex:
    """Cached embeddings of one SQLite tenant database."""

    def __init__(self, ivf_min: int = IVF_MIN) -> None:
        self._lock = threading.Lock()
        self._token: Hashable = None
        self.ivf_min = ivf_min
        self._rids = np.zeros(0, dtype=np.int64)
        self._mat = np.zeros((0, 0), dtype=np.float32)
        self._scope_ix = np.zeros(0, dtype=np.int32)
        self._kind = np.zeros(0, dtype=np.int8)
        self._vf = np.zeros(0, dtype=np.int64)
        self._vt = np.zeros(0, dtype=np.int64)
        self._exp = np.zeros(0, dtype=np.int64)
        self._scopes: dict[str, int] = {}
        # IVF: centroids (L x d), list boundaries into rows [0, built_n); None = exact search
        self._centroids: npt.NDArray[np.float32] | None = None
        self._offsets = np.zeros(0, dtype=np.int64)
        self._built_n = 0
        # coarse scoring: rows projected on the top principal directions (``_basis``, d x p)
        self._basis: npt.NDArray[np.float32] | None = None
        self._proj = np.zeros((0, 0), dtype=np.float32)

    def invalidate(self) -> None:
        """Force a refresh on the next query."""
        with self._lock:
            self._token = None

    # -- cache maintenance ----------------------------------------------------------------
    def _refresh(self, conn: sqlite3.Connection, token: Hashable) -> None:
        rows = conn.execute(
            "SELECT v.rid, r.scope, r.kind, r.valid_from, r.valid_to, r.expires_at "
            "FROM vectors v JOIN records r ON r.rid = v.rid ORDER BY v.rid"
        ).fetchall()
        n = len(rows)
        r_rid = np.fromiter((r[0] for r in rows), dtype=np.int64, count=n)
        known = self._rids
        if len(known):
            pos = np.minimum(np.searchsorted(r_rid, known), max(n - 1, 0))
            present = (r_rid[pos] == known) if n else np.zeros(len(known), dtype=bool)
            if not present.all():  # deletions: drop rows, and the IVF's row positions with them
                self._rids, self._mat = known[present], self._mat[present]
                self._centroids, self._built_n = None, 0
        new = r_rid[~np.isin(r_rid, self._rids, assume_unique=True)] if len(self._rids) else r_rid
        if len(new):
            added = self._load_vectors(conn, new)
            if len(self._rids) and added.shape[1] == self._mat.shape[1]:
                self._mat = np.vstack([self._mat, added])
                self._rids = np.concatenate([self._rids, new])
                if self._centroids is not None and self._basis is not None:
                    self._proj = np.vstack([self._proj, added @ self._basis])
            else:  # first load, or a different dimension (a new embedder): start over
                self._mat, self._rids = added, new
                self._centroids, self._built_n = None, 0
        idx = np.searchsorted(r_rid, self._rids)  # row order -> position in the query result
        scopes: dict[str, int] = {}
        scope_ix = np.fromiter(
            (scopes.setdefault(r[1], len(scopes)) for r in rows), dtype=np.int32, count=n
        )
        kind = np.fromiter((_KIND[r[2]] for r in rows), dtype=np.int8, count=n)
        vf = np.fromiter((r[3] for r in rows), dtype=np.int64, count=n)
        vt = np.fromiter((_NONE if r[4] is None else r[4] for r in rows), dtype=np.int64, count=n)
        exp = np.fromiter((_NONE if r[5] is None else r[5] for r in rows), dtype=np.int64, count=n)
        self._scopes = scopes
        self._scope_ix, self._kind, self._vf = scope_ix[idx], kind[idx], vf[idx]
        self._vt, self._exp = vt[idx], exp[idx]
        self._token = token
        log.debug("vector index refreshed: %d vectors, %d new", n, len(new))

    @staticmethod
    def _load_vectors(
        conn: sqlite3.Connection, rids: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.float32]:
        blobs: list[bytes] = []
        for start in range(0, len(rids), 900):
            part = [int(x) for x in rids[start : start + 900]]
            got = dict(
                conn.execute(
                    f"SELECT rid, vec FROM vectors WHERE rid IN ({','.join('?' * len(part))})", part
                ).fetchall()
            )
            blobs += [got[r] for r in part]
        return np.frombuffer(b"".join(blobs), dtype=np.float32).reshape(len(rids), -1).copy()

    def _maybe_build(self) -> None:
        n = len(self._rids)
        if n < self.ivf_min:
            self._centroids, self._built_n = None, 0
            return
        if self._centroids is not None and (n - self._built_n) * 4 <= self._built_n:
            return
        t0 = time.perf_counter()
        lists = int(min(256, max(16, np.sqrt(n) / 4)))
        rng = np.random.default_rng(0)
        sample = self._mat[rng.choice(n, size=min(n, lists * 40), replace=False)]
        cent = sample[rng.choice(len(sample), size=lists, replace=False)].copy()
        for _ in range(6):  # spherical k-means on the sample
            assign = np.argmax(sample @ cent.T, axis=1)
            for c in range(lists):
                members = sample[assign == c]
                cent[c] = members.sum(axis=0) if len(members) else sample[rng.integers(len(sample))]
            cent /= np.maximum(np.linalg.norm(cent, axis=1, keepdims=True), 1e-12)
        assign = np.concatenate(
            [np.argmax(self._mat[i : i + _CHUNK] @ cent.T, axis=1) for i in range(0, n, _CHUNK)]
        )
        order = np.argsort(assign, kind="stable")
        for name in ("_rids", "_mat", "_scope_ix", "_kind", "_vf", "_vt", "_exp"):
            setattr(self, name, np.ascontiguousarray(getattr(self, name)[order]))
        counts = np.bincount(assign, minlength=lists)
        self._offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._centroids, self._built_n = cent.astype(np.float32), n
        # the directions that carry most of the vectors' energy (uncentered: dot products)
        _, _, vt = np.linalg.svd(sample[:20_000], full_matrices=False)
        self._basis = np.ascontiguousarray(vt[:_PROJ_DIM].T.astype(np.float32))
        self._proj = np.concatenate(
            [self._mat[i : i + _CHUNK] @ self._basis for i in range(0, n, _CHUNK)]
        )
        log.info(
            "vector index: IVF with %d lists over %d vectors in %.1f s",
            lists,
            n,
            time.perf_counter() - t0,
        )

    # -- queries --------------------------------------------------------------------------
    def _mask(self, idx: npt.NDArray[np.int64], flt: RecordFilter) -> npt.NDArray[np.bool_]:
        allowed = [self._scopes[s] for s in flt.scopes if s in self._scopes]
        mask = np.isin(self._scope_ix[idx], allowed)
        mask &= np.isin(self._kind[idx], [_KIND[k] for k in flt.kinds])
        mask &= self._exp[idx] > flt.now
        vf, vt = self._vf[idx], self._vt[idx]
        if flt.as_of is not None:
            mask &= (vf <= flt.as_of) & (vt > flt.as_of)
        elif not flt.include_history:
            mask &= vt == _NONE
        if flt.since is not None:
            mask &= vf >= flt.since
        if flt.until is not None:
            mask &= vf < flt.until
        return mask

    def _probe(
        self, q: npt.NDArray[np.float32], nprobe: int, keep: int, flt: RecordFilter
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
        """Row indices and exact similarities of the best rows of the ``nprobe`` nearest
        lists plus the tail that pass the mask: a projected (coarse) scan keeps the best
        ``keep`` rows, which are then re-scored with the full vectors."""
        assert self._centroids is not None and self._basis is not None
        near = np.argsort(-(self._centroids @ q))[:nprobe]
        spans = [(int(self._offsets[c]), int(self._offsets[c + 1])) for c in near]
        spans.append((self._built_n, len(self._rids)))
        idx = np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in spans])
        qp = q @ self._basis
        coarse = np.concatenate([self._proj[a:b] @ qp for a, b in spans])
        ok = self._mask(idx, flt)
        idx, coarse = idx[ok], coarse[ok]
        if len(idx) > keep:
            best = np.argpartition(-coarse, keep - 1)[:keep]
            idx = idx[best]
        return idx, self._mat[idx] @ q

    def candidates(
        self,
        conn: sqlite3.Connection,
        token: Hashable,
        vector: Sequence[float],
        flt: RecordFilter,
        limit: int,
    ) -> list[tuple[int, float]]:
        """Up to ``limit`` ``(rid, cosine)`` pairs, best first, passing the cheap part of
        ``flt`` (scope, kind, validity, expiry, since/until)."""
        with self._lock:
            if token != self._token:
                self._refresh(conn, token)
            if not len(self._rids):
                return []
            self._maybe_build()
            q = np.asarray(vector, dtype=np.float32)
            if q.shape != (self._mat.shape[1],):
                return []
            if self._centroids is None:
                idx = np.arange(len(self._rids), dtype=np.int64)
                sims = self._mat @ q
                keep = self._mask(idx, flt)
                idx, sims = idx[keep], sims[keep]
            else:
                lists = len(self._centroids)
                nprobe = max(4, lists // 16)
                while True:
                    idx, sims = self._probe(q, nprobe, max(_RESCORE, limit * 8), flt)
                    if len(idx) >= limit or nprobe >= lists:
                        break
                    nprobe = min(lists, nprobe * 4)
            if not len(idx):
                return []
            n = min(limit, len(idx))
            top = np.argpartition(-sims, n - 1)[:n] if n < len(idx) else np.arange(len(idx))
            top = top[np.argsort(-sims[top], kind="stable")]
            return [(int(self._rids[idx[i]]), float(sims[i])) for i in top]
