"""An in-process vector index over one tenant's embeddings (numpy, exact search).

The matrix of L2-normalized float32 vectors is cached with the few columns that filtering
needs (scope, kind, validity, expiry), so a query is one masked matrix-vector product. The
cache is refreshed when the database changes (the caller passes a change token); new rows are
appended, and the small per-row columns are re-read so supersession and deletion show up.

The index only *proposes* candidates: the store re-checks every candidate against the full
filter in SQL, so a stale cache can cost a result but can never leak an invisible record.
Exact search costs O(n·d) per query: about 10 ms for 100k × 384 on one core.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Hashable, Sequence

import numpy as np
import numpy.typing as npt

from torpor.memory.backends.base import RecordFilter

log = logging.getLogger(__name__)

__all__ = ["VectorIndex"]

_NONE = np.iinfo(np.int64).max
_KIND = {"fact": 0, "episode": 1}


class VectorIndex:
    """Cached embeddings of one SQLite tenant database."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._token: Hashable = None
        self._dim = 0
        self._rids = np.zeros(0, dtype=np.int64)
        self._mat = np.zeros((0, 0), dtype=np.float32)
        self._scope_ix = np.zeros(0, dtype=np.int32)
        self._kind = np.zeros(0, dtype=np.int8)
        self._vf = np.zeros(0, dtype=np.int64)
        self._vt = np.zeros(0, dtype=np.int64)
        self._exp = np.zeros(0, dtype=np.int64)
        self._scopes: dict[str, int] = {}

    def invalidate(self) -> None:
        """Force a refresh on the next query."""
        with self._lock:
            self._token = None

    def _refresh(self, conn: sqlite3.Connection, token: Hashable) -> None:
        rows = conn.execute(
            "SELECT v.rid, r.scope, r.kind, r.valid_from, r.valid_to, r.expires_at "
            "FROM vectors v JOIN records r ON r.rid = v.rid ORDER BY v.rid"
        ).fetchall()
        rids = np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows))
        known = self._rids
        keep = np.isin(known, rids, assume_unique=True)
        mat = self._mat[keep] if len(known) else self._mat
        have = known[keep]
        new = rids[~np.isin(rids, have, assume_unique=True)] if len(have) else rids
        if len(new):
            blobs = []
            for chunk in range(0, len(new), 900):
                part = [int(x) for x in new[chunk:chunk + 900]]
                got = dict(conn.execute(
                    f"SELECT rid, vec FROM vectors WHERE rid IN ({','.join('?' * len(part))})",
                    part,
                ).fetchall())
                blobs += [got[r] for r in part]
            added = np.frombuffer(b"".join(blobs), dtype=np.float32).reshape(len(new), -1)
            mat = added if not len(have) else np.vstack([mat, added])
            have = np.concatenate([have, new])
        order = np.argsort(have, kind="stable")
        self._rids, self._mat = have[order], np.ascontiguousarray(mat[order])
        self._dim = self._mat.shape[1] if self._mat.ndim == 2 and len(self._mat) else 0
        scopes: dict[str, int] = {}
        self._scope_ix = np.fromiter((scopes.setdefault(r[1], len(scopes)) for r in rows),
                                     dtype=np.int32, count=len(rows))
        self._scopes = scopes
        self._kind = np.fromiter((_KIND[r[2]] for r in rows), dtype=np.int8, count=len(rows))
        self._vf = np.fromiter((r[3] for r in rows), dtype=np.int64, count=len(rows))
        self._vt = np.fromiter((_NONE if r[4] is None else r[4] for r in rows), dtype=np.int64,
                               count=len(rows))
        self._exp = np.fromiter((_NONE if r[5] is None else r[5] for r in rows), dtype=np.int64,
                                count=len(rows))
        self._token = token
        log.debug("vector index refreshed: %d vectors, %d new", len(rows), len(new))

    def candidates(
        self, conn: sqlite3.Connection, token: Hashable, vector: Sequence[float],
        flt: RecordFilter, limit: int,
    ) -> list[tuple[int, float]]:
        """Up to ``limit`` ``(rid, cosine)`` pairs, best first, passing the cheap part of
        ``flt`` (scope, kind, validity, expiry, since/until)."""
        with self._lock:
            if token != self._token:
                self._refresh(conn, token)
            if not len(self._rids):
                return []
            q = np.asarray(vector, dtype=np.float32)
            if q.shape != (self._dim,):
                return []
            mask = np.isin(self._scope_ix, [self._scopes[s] for s in flt.scopes
                                            if s in self._scopes])
            mask &= np.isin(self._kind, [_KIND[k] for k in flt.kinds])
            mask &= self._exp > flt.now
            if flt.as_of is not None:
                mask &= (self._vf <= flt.as_of) & (self._vt > flt.as_of)
            elif not flt.include_history:
                mask &= self._vt == _NONE
            if flt.since is not None:
                mask &= self._vf >= flt.since
            if flt.until is not None:
                mask &= self._vf < flt.until
            idx = np.flatnonzero(mask)
            if not len(idx):
                return []
            # the full product is cheaper than gathering the masked rows first (no 100 MB copy)
            sims: npt.NDArray[np.float32] = (self._mat @ q)[idx]
            n = min(limit, len(idx))
            top = np.argpartition(-sims, n - 1)[:n] if n < len(idx) else np.arange(len(idx))
            top = top[np.argsort(-sims[top], kind="stable")]
            return [(int(self._rids[idx[i]]), float(sims[i])) for i in top]
