"""torpor.memory: the knowledge layer.

Facts that supersede (bi-temporal, history kept), append-only episodes, one profile per scope,
hybrid recall (FTS5/full-text + vectors, ranked by a pluggable :class:`Ranker`), a budgeted
context block, checked provenance, persistent/cache policy, and tenant isolation enforced by
storage.

    import torpor
    mem = torpor.Memory()
    u = mem.scope(app="support", user="u-42")
    u.remember("prefers daily summaries", key="summary_cadence")
    u.recall("how often should I send summaries?", k=3)
"""

from __future__ import annotations

from torpor.memory.context import Context
from torpor.memory.embeddings import Embedder, HashEmbedder, SentenceTransformerEmbedder
from torpor.memory.memory import Memory
from torpor.memory.models import (
    Episode,
    Fact,
    Grant,
    Hit,
    Policy,
    Profile,
    RecordPage,
    Scope,
    SourceRef,
)
from torpor.memory.provenance import register_resolver
from torpor.memory.ranking import Candidates, HybridRanker, Ranker
from torpor.memory.scoped import ScopedMemory

__all__ = [
    "Candidates",
    "Context",
    "Embedder",
    "Episode",
    "Fact",
    "Grant",
    "HashEmbedder",
    "Hit",
    "HybridRanker",
    "Memory",
    "Policy",
    "Profile",
    "Ranker",
    "RecordPage",
    "Scope",
    "ScopedMemory",
    "SentenceTransformerEmbedder",
    "SourceRef",
    "register_resolver",
]
