""":class:`ScopedMemory`: every record operation, seen from one scope.

A scope sees its own records and its ancestors' (those the caller may read); it writes only
to itself. Input is validated completely (:mod:`torpor.memory._validate`) before anything is
written.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import IO, Any, Protocol

from pydantic import BaseModel

from torpor.errors import Conflict, InvalidArgument, RecordNotFound
from torpor.memory import _build, provenance, transfer
from torpor.memory import _validate as check
from torpor.memory._lines import write_lines
from torpor.memory.access import Access
from torpor.memory.backends.base import AnyRecord, RecordFilter, TenantStore, Vector
from torpor.memory.context import Context, build_context
from torpor.memory.embeddings import Embedder, token_counter
from torpor.memory.models import (
    LAST_US,
    Durability,
    Episode,
    Fact,
    Hit,
    Kind,
    Policy,
    Profile,
    RecordPage,
    Scope,
    SourceRef,
    from_us,
    now_us,
    path_within,
    to_us,
)
from torpor.memory.ranking import Ranker
from torpor.memory.recall import recall as _recall
from torpor.memory.rerank import Reranker

log = logging.getLogger(__name__)

__all__ = ["PROFILE_TRIES", "Owner", "ScopedMemory"]

#: how many times :meth:`ScopedMemory.set_profile` reads and writes again when another writer
#: changed the profile between its read and its write
PROFILE_TRIES = 100


class Owner(Protocol):
    """What a :class:`ScopedMemory` uses of the :class:`~torpor.memory.Memory` that made it.

    A protocol, not an import: :mod:`torpor.memory.memory` makes scopes, so it sits above
    this module and this module never imports it."""

    @property
    def access(self) -> Access: ...

    @property
    def store(self) -> TenantStore: ...

    @property
    def ranking(self) -> Ranker: ...

    @property
    def reranker(self) -> Reranker | None: ...

    def usable_embedder(self) -> Embedder | None: ...

    def writer_embedder(self) -> Embedder | None: ...

    def embed(self, texts: list[str]) -> list[Vector | None] | None: ...

    def record_quota(self) -> int: ...


class ScopedMemory:
    """The records of one scope (see the module docstring). Made by :meth:`Memory.scope`."""

    def __init__(self, memory: Owner, scope: Scope) -> None:
        self.memory = memory
        self.scope = scope
        self.path = scope.path

    def __repr__(self) -> str:
        return f"ScopedMemory({self.scope})"

    # -- helpers ----------------------------------------------------------------------------
    def _filter(self, now: int, **kw: Any) -> RecordFilter:
        visible = self.memory.access.readable(self.scope.ancestors())
        return RecordFilter(scopes=visible, now=now, **kw)

    def _policy(self) -> Policy:
        return self.memory.store.get_policy(self.path) or Policy()

    @property
    def _by_token(self) -> bool:
        """Whether the caller has a token (a grant list), not the home's own owner."""
        return self.memory.access.grants is not None

    def _may_cite(self, ref: SourceRef) -> None:
        """For a caller with a token: refuse (:class:`AccessDenied`, audited) a source it may
        not have read (:func:`provenance.refusal`)."""
        why = provenance.refusal(ref)
        if why is not None:
            raise self.memory.access.deny("cite", self.path, why)

    def _add(self, records: Sequence[AnyRecord], policy: Policy) -> list[AnyRecord]:
        """Store ``records`` (built under ``policy``) with their vectors, in one transaction
        (all or none: over the tenant's memory-records quota, :class:`QuotaExceeded` and
        nothing written). A shorter retention set meanwhile (its cap ran before these were
        stored) caps them now."""
        quota = self.memory.record_quota()
        vectors = self.memory.embed([r.text for r in records])
        stored = self.memory.store.add(records, vectors, quota=quota)
        retention = self._policy().retention_seconds
        if retention is None or (
            policy.retention_seconds is not None and policy.retention_seconds <= retention
        ):
            return stored
        life = int(retention * 1e6)
        self.memory.store.cap_expiry(self.path, life)
        out: list[AnyRecord] = []
        for rec in stored:  # as the cap left them
            ends = min(to_us(rec.created_at) + life, LAST_US)
            if rec.expires_at is None or to_us(rec.expires_at) > ends:
                rec = rec.model_copy(update={"expires_at": from_us(ends)})
            out.append(rec)
        return out

    # -- writes -----------------------------------------------------------------------------
    def remember(
        self,
        text: str,
        *,
        key: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        source: SourceRef | Mapping[str, Any] | None = None,
        durability: Durability = "persistent",
        ttl: float | timedelta | None = None,
    ) -> Fact:
        """Store a fact; with ``key``, end the current fact with that key in this scope.

        With ``source``, read and hash the cited content (``verified``). Raises
        :class:`InvalidArgument`, :class:`PayloadTooLarge`, :class:`AccessDenied`,
        :class:`StorageError`, :class:`Conflict` (the store's vectors come from another
        embedding model than this memory's), :class:`QuotaExceeded` (the tenant holds its
        ``memory_records`` quota; nothing written). With a token, a host, sandbox or volume
        ``source``, or a URL that is not public, is :class:`AccessDenied`.
        """
        return self.remember_many(
            [
                {
                    "text": text,
                    "key": key,
                    "metadata": metadata,
                    "source": source,
                    "durability": durability,
                    "ttl": ttl,
                }
            ]
        )[0]

    def remember_many(self, items: Iterable[str | Mapping[str, Any]]) -> list[Fact]:
        """Store many facts in one transaction with one embedding batch. Each item is a text
        or a mapping with ``text`` and optionally ``key``, ``metadata``, ``source``,
        ``durability``, ``ttl``. All or nothing: every item is checked before anything is
        written. Items with the same key supersede one another in order (the facts returned
        say so). Raises as :meth:`remember` does."""
        self.memory.access.require("write", self.path, "remember")
        may_cite = self._may_cite if self._by_token else None
        policy = self._policy()
        facts = _build.facts(items, self.path, policy, may_cite)
        stored = [f for f in self._add(facts, policy) if isinstance(f, Fact)]
        latest: dict[str, int] = {}  # a later item with the same key ended this one, as stored
        for i, fact in enumerate(stored):
            if fact.key is None:
                continue
            if (j := latest.get(fact.key)) is not None:
                stored[j] = stored[j].model_copy(
                    update={"valid_to": fact.valid_from, "superseded_by": fact.id}
                )
            latest[fact.key] = i
        return stored

    def log(
        self,
        role: str,
        text: str,
        *,
        session: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        at: datetime | str | None = None,
        durability: Durability = "persistent",
        ttl: float | timedelta | None = None,
    ) -> Episode:
        """Append one turn (``role``: who spoke; ``at``: back-fill its time, a datetime or an
        ISO 8601 string; without an offset it is UTC). Turns of one session that share a time
        (a log that dates only its sessions) keep the order they were logged in. Raises as
        :meth:`remember` does."""
        return self.log_many(
            [
                {
                    "role": role,
                    "text": text,
                    "session": session,
                    "metadata": metadata,
                    "at": at,
                    "durability": durability,
                    "ttl": ttl,
                }
            ]
        )[0]

    def log_many(self, turns: Iterable[Mapping[str, Any]]) -> list[Episode]:
        """Append many turns in one transaction (mappings with ``role``, ``text`` and
        optionally ``session``, ``metadata``, ``at``, ``durability``, ``ttl``), with one
        embedding batch. All or nothing: every turn is checked before anything is written.
        Raises as :meth:`remember` does."""
        self.memory.access.require("write", self.path, "log")
        policy = self._policy()
        episodes = _build.episodes(turns, self.path, policy, self.scope.session)
        return [e for e in self._add(episodes, policy) if isinstance(e, Episode)]

    # -- reads ------------------------------------------------------------------------------
    #: the most hits :meth:`recall` is asked for (as many as the default record quota holds;
    #: each search reaches three times ``k`` deep, and PostgreSQL's limits are 32-bit)
    MAX_K = 1_000_000

    def recall(
        self,
        query: str,
        k: int = 5,
        *,
        kind: Kind | Sequence[Kind] | None = None,
        metadata: Mapping[str, Any] | None = None,
        since: datetime | str | None = None,
        until: datetime | str | None = None,
        as_of: datetime | str | None = None,
        include_history: bool = False,
        session: str | None = None,
        min_similarity: float | None = None,
    ) -> list[Hit]:
        """The ``k`` best records for ``query`` from this scope and its ancestors, as the
        memory's ranking orders them: by default most specific scope first, then relevance,
        then recency (see :mod:`torpor.memory.recall`). Each search reaches three times ``k``
        deep (at least 30), so asking for more than 10 can also change the first few; ``k``
        is at most :attr:`MAX_K`.

        Current facts only, unless ``include_history`` or ``as_of`` (what was valid then).
        ``since``, ``until`` and ``as_of`` take a datetime or an ISO 8601 string; a time
        without an offset (naive datetime, ``"2024-03-15"``) is UTC. ``session``: that
        session's turns only; ``min_similarity``: this query's vector floor (a finite number).
        Raises :class:`InvalidArgument`, :class:`AccessDenied`, :class:`StorageError`.
        """
        check.text(query, "query")
        if not isinstance(k, int) or not 0 <= k <= self.MAX_K:
            raise InvalidArgument(f"k must be an integer from 0 to {self.MAX_K}, not {k!r}")
        if kind is not None and not isinstance(kind, str | list | tuple):
            raise InvalidArgument(f"kind must be 'fact', 'episode' or a list of them, not {kind!r}")
        kinds: tuple[Kind, ...] = (
            ("fact", "episode")
            if kind is None
            else ((kind,) if isinstance(kind, str) else tuple(kind))
        )
        if not all(k in ("fact", "episode") for k in kinds):
            raise InvalidArgument(f"kind must be 'fact' or 'episode', not {kind!r}")
        if min_similarity is not None and (
            not isinstance(min_similarity, int | float)
            or isinstance(min_similarity, bool)
            or not math.isfinite(min_similarity)
        ):
            raise InvalidArgument(f"min_similarity must be a number, not {min_similarity!r}")
        flt = self._filter(
            now_us(),
            kinds=kinds,
            metadata=check.metadata(metadata),
            since=check.time(since, "since"),
            until=check.time(until, "until"),
            as_of=check.time(as_of, "as_of"),
            include_history=include_history,
            session=None if session is None else check.text(session, "session"),
        )
        return _recall(
            self.memory.store,
            query,
            flt,
            k,
            query_scope=self.path,
            embedder=self.memory.usable_embedder(),
            ranking=self.memory.ranking,
            min_similarity=min_similarity,
            reranker=self.memory.reranker,
        )

    def context(
        self, query: str, budget_tokens: int = 500, *, k_facts: int = 20, k_episodes: int = 10
    ) -> Context:
        """A prompt-ready block: profile, current facts (relevant first), relevant episodes,
        never over ``budget_tokens``. Raises :class:`InvalidArgument`."""
        if not isinstance(budget_tokens, int) or budget_tokens < 1:
            raise InvalidArgument("budget_tokens must be a positive integer")
        facts = [h.record for h in self.recall(query, k_facts, kind="fact")]
        now = now_us()
        facts += self.memory.store.scan(self._filter(now, kinds=("fact",)), 50)
        episodes = [h.record for h in self.recall(query, k_episodes, kind="episode")]
        return build_context(
            budget_tokens=budget_tokens,
            count=token_counter(),
            profile=self._profile(),
            facts=[f for f in facts if isinstance(f, Fact)],
            episodes=[e for e in episodes if isinstance(e, Episode)],
        )

    def history(self, key: str) -> list[Fact]:
        """Every fact with ``key`` in this scope, oldest first, with ``valid_from``/``valid_to``.
        Raises :class:`RecordNotFound` for a key never used here."""
        self.memory.access.require("read", self.path, "history")
        facts = self.memory.store.history(self.path, check.key(key) or "", now_us())
        if not facts:
            raise RecordNotFound(f"no facts with key {key!r} in {self.scope}", kind="key", name=key)
        return facts

    def get(self, record_id: str) -> AnyRecord:
        """One record visible from this scope (its own, an ancestor's or a descendant's).
        Raises :class:`RecordNotFound`, or :class:`AccessDenied` for an ungranted scope."""
        rid = check.record_id(record_id)
        found = self.memory.store.get([rid], now_us()) if rid is not None else []
        rec = found[0] if found else None
        if rec is None or not (
            rec.scope in self.scope.ancestors() or path_within(rec.scope, self.path)
        ):
            raise RecordNotFound(
                f"no record {record_id!r} in {self.scope}", kind="record", name=record_id
            )
        self.memory.access.require("read", rec.scope, "get")
        return rec

    #: the largest page :meth:`get_all` returns
    MAX_PAGE_SIZE = 1000

    def get_all(
        self,
        *,
        filters: Mapping[str, Any] | None = None,
        kind: Kind | None = None,
        page: int = 1,
        page_size: int = 100,
    ) -> RecordPage:
        """The current records stored in this scope (not its ancestors or descendants),
        newest first, one page at a time: ``filters`` are metadata equalities
        (``{"topic": "billing"}``), ``kind`` is ``"fact"`` or ``"episode"`` (default both).
        Raises :class:`InvalidArgument` (a page below 1, a page size outside 1-1000, a bad
        filter), :class:`AccessDenied`."""
        if not isinstance(page, int) or isinstance(page, bool) or page < 1:
            raise InvalidArgument(f"page must be an integer from 1, not {page!r}")
        if (
            not isinstance(page_size, int)
            or isinstance(page_size, bool)
            or not 1 <= page_size <= self.MAX_PAGE_SIZE
        ):
            raise InvalidArgument(f"page_size must be 1-{self.MAX_PAGE_SIZE}, not {page_size!r}")
        if page * page_size > 2**63 - 1:  # the stores' offsets are 64-bit integers
            raise InvalidArgument(f"page {page} of {page_size} records is past any store's end")
        if kind not in (None, "fact", "episode"):
            raise InvalidArgument(f"kind must be 'fact' or 'episode', not {kind!r}")
        self.memory.access.require("read", self.path, "get_all")
        flt = RecordFilter(
            scopes=[self.path],
            now=now_us(),
            kinds=("fact", "episode") if kind is None else (kind,),
            metadata=check.metadata(filters) or {},
        )
        store = self.memory.store
        items = store.scan(flt, page_size, offset=(page - 1) * page_size)
        return RecordPage(items=items, page=page, page_size=page_size, total=store.count(flt))

    def update(
        self, record_id: str, text: str, *, metadata: Mapping[str, Any] | None = None
    ) -> Fact:
        """A new version of the keyed fact ``record_id`` with ``text`` (and ``metadata``, else
        the old one's; its durability, and its time to live counted afresh; no source: the
        old one's cited the old text): the old version ends and stays in :meth:`history`. A
        fact without a key has no versions (remember it with ``key=`` to make it updatable)
        and an episode is an event: both are :class:`InvalidArgument`. Raises
        :class:`RecordNotFound`, :class:`AccessDenied`, and what :meth:`remember` raises."""
        old = self.get(record_id)
        if not isinstance(old, Fact) or old.key is None:
            what = "an episode" if not isinstance(old, Fact) else "a fact without a key"
            raise InvalidArgument(
                f"record {record_id!r} is {what}: only keyed facts have versions "
                "(remember it with key= to make it updatable)",
                record_id=record_id,
            )
        if old.valid_to is not None:
            raise InvalidArgument(
                f"record {record_id!r} is an old version: update the current one",
                record_id=record_id,
            )
        scope = self
        if old.scope != self.path:  # an ancestor's or a descendant's: its own scope
            scope = ScopedMemory(self.memory, Scope.from_path(old.scope, tenant=self.scope.tenant))
        # the new version lives as long as the old one was given to (a fact remembered for an
        # hour and updated is still one for an hour); a source cited the old text, not this
        life = None if old.expires_at is None else (old.expires_at - old.valid_from)
        return scope.remember(
            text,
            key=old.key,
            metadata=old.metadata if metadata is None else metadata,
            durability=old.durability,
            ttl=None if life is None else max(life.total_seconds(), 1e-6),
        )

    def delete_all(self) -> int:
        """Erase everything in this scope and below (records, profiles, policies), however
        many, in one transaction; returns how many records. As :meth:`forget` with no id.
        Raises :class:`AccessDenied`."""
        return self.forget()

    # -- profile and policy -----------------------------------------------------------------
    def get_profile(self) -> dict[str, Any]:
        """This scope's profile data (``{}`` when none is set): what :meth:`set_profile`
        stored. Raises :class:`AccessDenied`."""
        profile = self._profile()
        return {} if profile is None else dict(profile.data)

    def profile(self) -> Profile | None:
        """Deprecated: use :meth:`get_profile` (the data; :meth:`set_profile` returns the
        whole document). This scope's profile document, or None."""
        warnings.warn(
            "ScopedMemory.profile() is deprecated: use get_profile()",
            DeprecationWarning,
            stacklevel=2,
        )
        return self._profile()

    def _profile(self) -> Profile | None:
        self.memory.access.require("read", self.path, "get_profile")
        return self.memory.store.get_profile(self.path)

    def set_profile(
        self,
        data: Mapping[str, Any],
        *,
        schema: type[BaseModel] | Mapping[str, Any] | None = None,
        merge: bool = False,
    ) -> Profile:
        """Replace (or with ``merge``, update) the profile, checked against ``schema`` (a
        pydantic model or a JSON schema) or else the schema stored with the profile. The
        write is made over the profile it read: a concurrent change makes it read and merge
        again, so no caller's keys are lost. Raises :class:`SchemaViolation`,
        :class:`InvalidArgument`, :class:`Conflict` (overtaken :data:`PROFILE_TRIES` times)."""
        self.memory.access.require("write", self.path, "set_profile")
        store = self.memory.store
        new = check.metadata(data, "profile")
        for _ in range(PROFILE_TRIES):
            old = store.get_profile(self.path)
            doc = {**(old.data if (merge and old) else {}), **new}
            json_schema = check.profile(doc, schema, old.json_schema if old else None)
            profile = Profile(
                scope=self.path, data=doc, json_schema=json_schema, updated_at=from_us(now_us())
            )
            try:
                return store.put_profile(profile, expect_version=old.version if old else 0)
            except Conflict:
                continue  # another writer's profile came in between: read it and merge again
        raise Conflict(f"the profile of {self.scope} kept changing: not written", kind="profile")

    def set_policy(
        self, *, retention_seconds: float | None = None, cache_ttl_seconds: float | None = None
    ) -> Policy:
        """Set this scope's retention (applied at once to existing records) and the default
        TTL of ``cache`` records. Raises :class:`InvalidArgument`."""
        self.memory.access.require("write", self.path, "set_policy")
        policy = Policy(retention_seconds=retention_seconds, cache_ttl_seconds=cache_ttl_seconds)
        self.memory.store.set_policy(self.path, policy)
        if retention_seconds is not None:
            self.memory.store.cap_expiry(self.path, int(retention_seconds * 1e6))
        return policy

    # -- erase, verify, move ----------------------------------------------------------------
    def forget(self, record_id: str | None = None) -> int:
        """Erase one record (in this scope or below) or, with no id, this whole scope subtree
        (records, profiles, policies). Returns how many records. Raises
        :class:`RecordNotFound`, :class:`AccessDenied`."""
        access = self.memory.access
        if record_id is None:
            access.require("write", self.path, "forget")
            n = self.memory.store.forget_scope(self.path)
            access.audit("forget.scope", self.path, records=n)
            return n
        rid = check.record_id(record_id)
        found = self.memory.store.get([rid], 0) if rid is not None else []  # expired ones too
        if not found or not path_within(found[0].scope, self.path):
            raise RecordNotFound(
                f"no record {record_id!r} in {self.scope}", kind="record", name=record_id
            )
        access.require("write", found[0].scope, "forget")
        n = self.memory.store.forget([record_id])
        access.audit("forget.record", found[0].scope, id=record_id)
        return n

    def verify(self, record_id: str | None = None) -> list[Fact]:
        """Re-check the sources of one fact or of every sourced fact in this scope; a changed
        or missing source becomes ``stale`` and unverified. Returns the updated facts. A host,
        sandbox or volume source is re-read for the home's owner only: with a token, such a
        fact is left as it is (:class:`AccessDenied` when named by ``record_id``), and so is
        one citing a URL that is not public (an intranet page the owner cited): a token's
        fetch reaches public addresses only."""
        self.memory.access.require("write", self.path, "verify")
        if record_id is not None:
            rec = self.get(record_id)  # may be an ancestor's record, which this scope reads
            self.memory.access.require("write", rec.scope, "verify")
            if isinstance(rec, Fact) and rec.source is not None and self._by_token:
                self._may_cite(rec.source)
            facts = [rec] if isinstance(rec, Fact) else []
        else:
            flt = RecordFilter(
                scopes=[self.path], now=now_us(), kinds=("fact",), include_history=True
            )
            facts = [f for f in self.memory.store.scan(flt, 1_000_000) if isinstance(f, Fact)]
        out = []
        for fact in facts:
            if fact.source is None or (
                self._by_token and provenance.refusal(fact.source) is not None
            ):
                continue
            outcome = provenance.check(fact.source, public_only=self._by_token)
            stale = fact.source_hash is not None and outcome.sha256 != fact.source_hash
            verified = outcome.verified and not stale
            reason = None
            if not verified:
                reason = (
                    "the source changed since the fact was stored"
                    if (stale and outcome.verified)
                    else outcome.reason or "not verified"
                )
            self.memory.store.set_verification(
                fact.id,
                verified=verified,
                stale=stale,
                source_hash=fact.source_hash or outcome.sha256,
            )
            out.append(
                fact.model_copy(update={"verified": verified, "stale": stale, "reason": reason})
            )
        return out

    def export_lines(self) -> Iterator[str]:
        """This scope subtree as JSONL lines, produced as they are read (the access check runs
        now, before the first line). Raises :class:`AccessDenied`."""
        self.memory.access.require("read", self.path, "export")
        emb = self.memory.store.get_meta("embedding_model")
        return transfer.export_lines(self.memory.store, self.path, emb)

    def export(self, dest: str | Path | IO[str]) -> int:
        """Write this scope subtree as JSONL to a path (whole or not at all: an existing file
        stays as it was when the export fails) or a text stream. Returns lines written."""
        return write_lines(self.export_lines(), dest)

    def import_(self, src: str | Path | IO[str] | Iterable[str]) -> int:
        """Load an export into this scope (re-rooted here). All or nothing. Returns records
        inserted. Raises :class:`InvalidArgument` for a malformed file or one holding a scope
        that has no place here (``app/a/user/v`` onto ``app/b/user/w``), :class:`QuotaExceeded`
        (nothing inserted) when the records would take the tenant over its quota."""
        self.memory.access.require("write", self.path, "import")
        if isinstance(src, (str, Path)):
            try:
                with open(src, encoding="utf-8") as fh:
                    bundle = transfer.parse_lines(fh)
            except OSError as exc:
                raise InvalidArgument(f"cannot read {src}: {exc}", exc=exc) from exc
        else:
            bundle = transfer.parse_lines(src)
        return _load_into(self, transfer.reroot(bundle, self.path), "import")

    def fork(self, **levels: str) -> ScopedMemory:
        """Copy this scope subtree (records with history, profiles, policies) to a new scope
        of the same tenant, e.g. ``u.fork(user="u-43")``; returns the new scope. Raises
        :class:`InvalidArgument` (nothing copied) when a scope of the subtree has no place
        under the new one."""
        self.memory.access.require("read", self.path, "fork")
        target = (
            ScopedMemory(self.memory, Scope(tenant=self.scope.tenant, **levels)) if levels else self
        )
        emb = self.memory.store.get_meta("embedding_model")
        bundle = transfer.parse_lines(transfer.export_lines(self.memory.store, self.path, emb))
        _load_into(target, transfer.reroot(bundle, target.path), "fork")
        return target


def _load_into(scope: ScopedMemory, bundle: transfer.Bundle, action: str) -> int:
    """Insert a parsed, re-rooted bundle into ``scope`` (import and fork). Returns records."""
    access, store = scope.memory.access, scope.memory.store
    paths = {r.scope for r in bundle.records} | {p.scope for p in bundle.profiles}
    for path in paths | {path for path, _ in bundle.policies}:
        access.require("write", path, action)
    emb = scope.memory.writer_embedder()
    vectors: list[Any] | None = None
    if emb is not None:  # keep a vector of this tenant's model; embed the others again
        same = bundle.embedding_model == emb.name
        vectors = list(bundle.vectors)
        redo = [i for i, v in enumerate(vectors) if not same or v is None or len(v) != emb.dim]
        made = scope.memory.embed([bundle.records[i].text for i in redo]) or []
        for i, vec in zip(redo, made, strict=True):
            vectors[i] = vec
    n = store.import_records(bundle.records, vectors, quota=scope.memory.record_quota())
    for profile in bundle.profiles:
        store.put_profile(profile)
    for path, policy in bundle.policies:
        store.set_policy(path, policy)
    # a scope's retention caps what came in too, and a retention that came in caps the
    # records its scope already held (as set_policy does)
    for path in {r.scope for r in bundle.records} | {path for path, _ in bundle.policies}:
        retention = (store.get_policy(path) or Policy()).retention_seconds
        if retention is not None:
            store.cap_expiry(path, int(retention * 1e6))
    access.audit(action, scope.path, records=n)
    return n
