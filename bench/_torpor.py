"""torpor.Memory behind the benchmark's peer interface (``add`` / ``search``).

Each generated user is one scope, ``app="bench", user=<id>``, in one tenant. Turns are logged as
episodes (role, session); facts are remembered with their ``key``, so a later value supersedes
the earlier one exactly as an agent using torpor would write them. Temporal questions use
``recall(..., as_of=...)``, torpor's own time travel.

``remember`` cannot back-date a fact (only ``log`` takes ``at=``), so nothing is back-dated:
records are written in the generator's time order and keep torpor's real clock times. A
question's generated ``as_of`` date maps to the real time just before the first record the
generator wrote after that date (the mapping preserves order, so "what was valid then" is the
same set of records). One consequence: torpor's recency prior sees all records as equally
new, which neither helps nor hurts it.
"""

from __future__ import annotations

import bisect
import inspect
import logging
import tempfile
from collections.abc import Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from bench.peers import Doc

__all__ = ["TorporSystem", "open_memory"]

log = logging.getLogger(__name__)


def open_memory(home: Path, embedder: Any | None) -> Any:
    """A fresh ``torpor.Memory`` rooted in ``home`` with ``embedder`` (None = lexical only)."""
    import torpor

    params = inspect.signature(torpor.Memory).parameters
    kw: dict[str, Any] = {}
    if "embedder" in params:
        kw["embedder"] = embedder
    if "home" in params:
        kw["home"] = str(home)
    elif "path" in params:
        kw["path"] = home
    return torpor.Memory(**kw)


class TorporSystem:
    """torpor as a benchmark system: ``torpor-lexical`` (no embedder) or ``torpor-hybrid``."""

    def __init__(
        self,
        name: str,
        embedder: Any | None,
        home: Path | None = None,
        min_similarity: float | None = None,
    ) -> None:
        self.name = name
        self.min_similarity = min_similarity  # None: torpor's default floor
        self._tmp = None if home else tempfile.TemporaryDirectory(prefix="torpor-bench-")
        self.home = home or Path(self._tmp.name)  # type: ignore[union-attr]
        self.mem = open_memory(self.home, embedder)
        self.scopes: dict[str, Any] = {}
        self.to_gen: dict[str, str] = {}
        # per user: generated times and the real valid_from of the same records, in order
        self.gen_at: dict[str, list[datetime]] = {}
        self.real_at: dict[str, list[datetime]] = {}

    def scope(self, user: str) -> Any:
        """The scope of one generated user (cached)."""
        if user not in self.scopes:
            self.scopes[user] = self.mem.scope(app="bench", user=user)
        return self.scopes[user]

    def add(self, docs: Sequence[Doc]) -> None:
        for d in docs:
            u = self.scope(d.user)
            if d.kind == "episode":
                rec = u.log(d.role, d.text, session=d.session)
            else:
                rec = u.remember(d.text, key=d.key)
            self.to_gen[rec.id] = d.id
            self.gen_at.setdefault(d.user, []).append(d.at)
            self.real_at.setdefault(d.user, []).append(rec.valid_from)

    def real_time(self, user: str, when: datetime) -> datetime:
        """The real time that stands for the generated time ``when`` (see the module doc)."""
        gen, real = self.gen_at.get(user, []), self.real_at.get(user, [])
        i = bisect.bisect_right(gen, when)  # records [0, i) were written by then
        if i == len(real):
            return real[-1] if real else when
        return real[i] - timedelta(microseconds=1)

    def search(
        self, user: str, query: str, k: int, as_of: datetime | None = None
    ) -> list[tuple[str, float]]:
        kw: dict[str, Any] = {"k": k}
        if self.min_similarity is not None:
            kw["min_similarity"] = self.min_similarity
        if as_of is not None:
            kw["as_of"] = self.real_time(user, as_of)
        hits = self.scope(user).recall(query, **kw)
        return [(self.to_gen.get(h.id, h.id), float(h.score)) for h in hits]

    def close(self) -> None:
        close = getattr(self.mem, "close", None)
        if close is not None:
            close()
        if self._tmp is not None:
            self._tmp.cleanup()
