""":class:`Memory`: one tenant's memory store, the entry point of the knowledge layer.

::

    mem = Memory()                                   # SQLite under paths().memory, tenant "default"
    u = mem.scope(app="support", user="u-42")
    u.remember("prefers daily summaries", key="summary_cadence")
    u.recall("how often should I send summaries?", k=3)

Every operation checks the caller's grants first (:mod:`torpor.memory.access`), validates its
input completely before writing (bad input leaves no partial state), and then makes one
backend call. The operations of a scope are in :mod:`torpor.memory.scoped`, recall in
:mod:`torpor.memory.recall` (its ranking, which ``Memory(ranking=...)`` replaces, in
:mod:`torpor.memory.ranking`), context in :mod:`torpor.memory.context`.
"""

from __future__ import annotations

import copy
import logging
import os
from typing import Self

from torpor.config import Quotas, paths
from torpor.errors import AccessDenied, Conflict, InvalidArgument, RecordNotFound
from torpor.memory import _validate as check
from torpor.memory._coalesce import batcher_for
from torpor.memory.access import Access, TokenManager, hash_token
from torpor.memory.backends import open_backend
from torpor.memory.backends.base import MemoryBackend, Vector
from torpor.memory.embeddings import INSTALL_HINT, Embedder, resolve_embedder
from torpor.memory.models import AuditEntry, Scope, from_us, now_us
from torpor.memory.ranking import HybridRanker, Ranker
from torpor.memory.rerank import Reranker, resolve_reranker
from torpor.memory.scoped import ScopedMemory

log = logging.getLogger(__name__)

__all__ = ["Memory"]


class Memory:
    """One tenant's memory store.

    ``home``: the torpor home (default ``$TORPOR_HOME``); ``token``: an API token (its tenant
    and grants then apply; without one the caller owns ``tenant``, default ``"default"``);
    ``embedder``: ``"default"`` (local MiniLM if installed, else lexical only), ``None``
    (lexical only) or an :class:`Embedder`; ``backend``: ``"sqlite"`` or a PostgreSQL DSN;
    ``ranking``: how recall orders what it finds, for every scope of this memory (a
    :class:`~torpor.memory.ranking.Ranker`; default :class:`~torpor.memory.HybridRanker`, e.g.
    ``HybridRanker(tiered=False)`` to let relevance outrank scope); ``reranker``: None (the
    default), ``"default"`` (the packaged cross-encoder, the ``torpor[rerank]`` extra), a
    model folder or a :class:`~torpor.memory.rerank.Reranker`, which reorders each recall's
    first hits (:mod:`torpor.memory.rerank`; better on real conversations, ~30x the search
    time).

    Raises :class:`InvalidArgument` for a ``ranking`` without a ``rank`` method,
    :class:`AccessDenied` (audited) for an unknown/revoked token or a token of another
    tenant, :class:`InvalidName`, :class:`StorageError`, :class:`CorruptData`.
    """

    def __init__(
        self,
        home: str | os.PathLike[str] | None = None,
        *,
        token: str | None = None,
        tenant: str | None = None,
        embedder: str | Embedder | None = "default",
        backend: str = "sqlite",
        ranking: Ranker | None = None,
        reranker: str | Reranker | None = None,
    ) -> None:
        if ranking is not None and not callable(getattr(ranking, "rank", None)):
            raise InvalidArgument(f"ranking must have a rank(candidates) method, not {ranking!r}")
        self.ranking: Ranker = HybridRanker() if ranking is None else ranking
        self.reranker = resolve_reranker(reranker)
        self.paths = paths(home)
        self.backend = open_backend(backend, self.paths.memory)
        try:
            self._open(token, tenant, embedder)
        except BaseException:
            self.backend.close()  # a refused token or a bad embedder keeps nothing open
            raise

    def _open(self, token: str | None, tenant: str | None, embedder: str | Embedder | None) -> None:
        """The rest of :meth:`__init__`, once the backend is open."""
        self.tokens = TokenManager(self.backend)
        if token is not None:
            info = self.tokens.lookup(token)
            actor = f"token:{hash_token(token)[:12]}"
            if info is None:
                self.backend.append_audit(
                    AuditEntry(
                        at=from_us(now_us()),
                        tenant=tenant or "",
                        actor=actor,
                        action="connect",
                        allowed=False,
                        detail={"reason": "unknown or revoked token"},
                    )
                )
                raise AccessDenied("unknown or revoked token", tenant=tenant or "", scope="")
            self.access = Access(self.backend, info.tenant, actor, list(info.grants))
            if tenant is not None:
                self.access.require_tenant(tenant, "connect")
        else:
            self.access = Access(self.backend, tenant or "default", "local", None)
        self.tenant = self.access.tenant
        self.store = self.backend.tenant(self.tenant)
        self.embedder = resolve_embedder(embedder)
        self._model: str | None = None
        self._model_known = False
        self._mismatch_warned = False

    @classmethod
    def attach(
        cls,
        backend: MemoryBackend,
        tenant: str,
        *,
        embedder: Embedder | None = None,
        ranking: Ranker | None = None,
        reranker: Reranker | None = None,
        home: str | os.PathLike[str] | None = None,
    ) -> Memory:
        """A Memory of ``tenant`` over a backend that someone else opened and closes (the
        server's), as the tenant's owner; :meth:`acting_as` narrows it to a caller.
        ``embedder`` is an :class:`Embedder` or None (lexical only): never loaded here.
        Raises :class:`InvalidName`, :class:`StorageError`."""
        self = cls.__new__(cls)
        self.ranking = HybridRanker() if ranking is None else ranking
        self.reranker = reranker
        self.paths = paths(home)
        self.backend = backend
        self.tokens = TokenManager(backend)
        self.access = Access(backend, tenant, "local", None)
        self.tenant = tenant
        self.store = backend.tenant(tenant)
        self.embedder = embedder
        self._model = None
        self._model_known = False
        self._mismatch_warned = False
        return self

    def acting_as(self, access: Access) -> Memory:
        """This memory as seen by another caller of the same tenant (its grants apply).
        Raises :class:`AccessDenied` (audited) for a caller of another tenant."""
        if access.tenant != self.tenant:
            raise access.deny("connect", "", "another tenant's memory", tenant=self.tenant)
        self.usable_embedder()  # settle the vector check once, on the shared original
        view = copy.copy(self)
        view.access = access
        return view

    # -- embedding bookkeeping --------------------------------------------------------------
    # A store records the model its vectors come from (meta ``embedding_model`` and
    # ``embedding_dim``), set by the first write that stores vectors. Vectors of two models
    # are never mixed: a writer with another model gets Conflict, a reader with another model
    # searches lexically (with a warning). A lexical-only writer (``embedder=None``, the CLI
    # by default) stores records without vectors; :meth:`reindex` fills them in.
    def _stored_model(self) -> str | None:
        if not self._model_known:
            self._model = self.store.get_meta("embedding_model")
            self._model_known = self._model is not None
        return self._model

    def usable_embedder(self) -> Embedder | None:
        """The embedder for reads: None without one, or when this store's vectors come from
        another model (recall is then lexical only, and a warning says so once)."""
        if self.embedder is None:
            return None
        stored = self._stored_model()
        if stored is not None and stored != self.embedder.name:
            if not self._mismatch_warned:
                log.warning(
                    "tenant %s holds %s vectors; embedder %s is not used for recall (lexical only)",
                    self.tenant,
                    stored,
                    self.embedder.name,
                )
                self._mismatch_warned = True
            return None
        return self.embedder

    def writer_embedder(self) -> Embedder | None:
        """The embedder for writes, recording its model in the store on first use; None
        without one (records are stored without vectors).

        Raises :class:`Conflict` when the store's vectors come from another model (mixing
        them would make vector search meaningless), :class:`StorageError`."""
        if self.embedder is None:
            return None
        stored = self._stored_model()
        if stored is None:  # another process may claim the store for its model meanwhile
            stored = self.store.claim_meta("embedding_model", self.embedder.name)
            if stored == self.embedder.name:
                self.store.set_meta("embedding_dim", str(self.embedder.dim))
            self._model, self._model_known = stored, True
        if stored != self.embedder.name:
            raise Conflict(
                f"tenant {self.tenant!r} holds vectors of {stored}, not of this memory's "
                f"embedder {self.embedder.name}: open it with that model, or with "
                "embedder=None (records are then stored without vectors)",
                kind="embedding_model",
                stored=stored,
                embedder=self.embedder.name,
            )
        return self.embedder

    def record_quota(self) -> int:
        """How many records this tenant's store may hold: ``memory_records`` of its
        :class:`~torpor.config.Quotas` (``<home>/quotas.json``, read per write like the other
        quotas, so a change applies without a restart). Raises :class:`InvalidArgument` for a
        bad quotas.json."""
        return Quotas.of(self.paths, self.tenant).memory_records

    def embed(self, texts: list[str]) -> list[Vector | None] | None:
        """Vectors for ``texts`` to store with them, or None (lexical only). A call of a few
        texts (a single ``log()`` or ``remember()``) that arrives while the model embeds
        another thread's shares the next model call with the others that came meanwhile
        (:mod:`torpor.memory._coalesce`). Raises what :meth:`writer_embedder` raises and
        what the embedder raises for these texts."""
        emb = self.writer_embedder()
        if emb is None or not texts:
            return None
        return list(batcher_for(emb).embed(texts))

    def reindex(self, *, batch: int = 256) -> int:
        """Embed every record of this tenant that has no vector (written by a lexical-only
        writer, such as the CLI without ``--embeddings``), ``batch`` texts at a time.
        Returns how many records got a vector. Needs write on the tenant root (audited).

        Raises :class:`InvalidArgument` when this memory has no embedder or ``batch`` < 1,
        :class:`Conflict` when the store's vectors come from another model,
        :class:`AccessDenied`, :class:`StorageError`."""
        if not isinstance(batch, int) or batch < 1:
            raise InvalidArgument("batch must be a positive integer")
        self.access.require("write", "", "reindex")
        emb = self.writer_embedder()
        if emb is None:
            raise InvalidArgument(
                "reindex needs an embedder: open the memory with embedder='default' "
                f"(install: {INSTALL_HINT})"
            )
        done = 0
        while todo := self.store.without_vectors(batch):
            vectors = emb.embed([text for _, text in todo])
            n = self.store.set_vectors(
                [(rid, v) for (rid, _), v in zip(todo, vectors, strict=True)]
            )
            done += n
            if n == 0:  # every one of them was erased meanwhile: nothing left to do here
                break
        self.access.audit("reindex", "", records=done, model=emb.name)
        log.info("reindexed %d records of tenant %s with %s", done, self.tenant, emb.name)
        return done

    # -- scopes -----------------------------------------------------------------------------
    def scope(
        self,
        *,
        app: str | None = None,
        user: str | None = None,
        agent: str | None = None,
        session: str | None = None,
        tenant: str | None = None,
    ) -> ScopedMemory:
        """A handle on one scope of this tenant (levels are optional and composable).

        Raises :class:`InvalidArgument` for a bad name, :class:`AccessDenied` (audited) for
        another tenant or a scope the token cannot read.
        """
        if tenant is not None:
            self.access.require_tenant(tenant, "scope")
        scope = Scope(tenant=self.tenant, app=app, user=user, agent=agent, session=session)
        self.access.require("read", scope.path, "scope")
        return ScopedMemory(self, scope)

    def scope_from_path(self, path: str) -> ScopedMemory:
        """:meth:`scope` from a path such as ``"app/support/user/u-42"``."""
        scope = Scope.from_path(path, tenant=self.tenant)
        self.access.require("read", scope.path, "scope")
        return ScopedMemory(self, scope)

    # -- tenant-wide operations -------------------------------------------------------------
    def forget(self, target: str | ScopedMemory) -> int:
        """Erase a record by id, or a whole scope subtree (``forget(mem.scope(user=...))``).
        Returns how many records were erased. Raises :class:`RecordNotFound`,
        :class:`AccessDenied`."""
        if isinstance(target, ScopedMemory):
            return target.forget()
        if not isinstance(target, str):
            raise InvalidArgument("forget() takes a record id or a scope")
        rid = check.record_id(target)
        found = self.store.get([rid], 0) if rid is not None else []  # expired ones too
        if not found:
            raise RecordNotFound(f"no record {target!r}", kind="record", name=target)
        self.access.require("write", found[0].scope, "forget")
        n = self.store.forget([target])
        self.access.audit("forget.record", found[0].scope, id=target)
        return n

    def gc(self) -> int:
        """Purge expired records for good. Returns how many. Needs write on the root scope."""
        self.access.require("write", "", "gc")
        n = self.store.purge_expired(now_us())
        log.info("memory gc purged %d records from tenant %s", n, self.tenant)
        return n

    def audit_log(self, limit: int = 100) -> list[AuditEntry]:
        """This tenant's newest audit entries, ``limit`` at most (a positive integer; one past
        any count reads them all). Needs read on the tenant root: the log names every
        scope's actions. Raises :class:`InvalidArgument`, :class:`AccessDenied` (audited),
        :class:`StorageError`."""
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise InvalidArgument(f"limit must be a positive integer, not {limit!r}")
        self.access.require("read", "", "audit")
        return self.backend.audit_log(self.tenant, min(limit, 2**63 - 1))

    def close(self) -> None:
        """Close the backend (later calls raise :class:`StorageError`)."""
        self.backend.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Memory(tenant={self.tenant!r}, backend={self.backend.name!r})"
