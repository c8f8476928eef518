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

from typing import TYPE_CHECKING

from torpor._lazy import lazy_exports

if TYPE_CHECKING:  # the real names, for type checkers; at run time each loads on first use
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

# Loaded lazily (as ``torpor`` does): ``from torpor.memory.models import Fact`` (the client,
# the CLI) then costs the models alone, not numpy, jsonschema and the whole store.
#: public name -> module that defines it
_LAZY = {
    "Candidates": "torpor.memory.ranking",
    "Context": "torpor.memory.context",
    "Embedder": "torpor.memory.embeddings",
    "Episode": "torpor.memory.models",
    "Fact": "torpor.memory.models",
    "Grant": "torpor.memory.models",
    "HashEmbedder": "torpor.memory.embeddings",
    "Hit": "torpor.memory.models",
    "HybridRanker": "torpor.memory.ranking",
    "Memory": "torpor.memory.memory",
    "Policy": "torpor.memory.models",
    "Profile": "torpor.memory.models",
    "Ranker": "torpor.memory.ranking",
    "RecordPage": "torpor.memory.models",
    "Scope": "torpor.memory.models",
    "ScopedMemory": "torpor.memory.scoped",
    "SentenceTransformerEmbedder": "torpor.memory.embeddings",
    "SourceRef": "torpor.memory.models",
    "register_resolver": "torpor.memory.provenance",
}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals(), __all__)
