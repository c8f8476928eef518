"""The storage interface every memory backend implements (SQLite, PostgreSQL).

A :class:`MemoryBackend` holds many tenants and hands out one :class:`TenantStore` per tenant;
every record operation goes through a ``TenantStore``, so code above the backend cannot name
another tenant's data. Isolation is the backend's job: SQLite keeps one database file per
tenant, PostgreSQL sets the tenant per transaction under row-level security.

What stays *above* the backend (``torpor.memory.memory`` and friends), so both backends behave the
same: tokenizing queries, embedding, fusing and ranking hits, building context, checking
grants, provenance hashing, policy arithmetic. What the backend owns: atomic writes
(supersede), filtering by :class:`RecordFilter`, lexical and vector top-k, and durability.

Conventions every backend follows (the shared tests in ``tests/memory`` check them):

* Times cross this interface as the models' UTC datetimes and are stored as integer
  microseconds (:func:`~torpor.memory.models.to_us`); comparisons use microseconds.
* A record is *visible* under a filter exactly when :func:`visible` says so; lexical, vector,
  scan, count, history and get never return a record that is expired (``expires_at <= now``).
* Scores: higher is better. Lexical = the engine's relevance (SQLite ``-bm25()``, PostgreSQL
  ``ts_rank_cd``), any positive scale; vector = cosine similarity in [-1, 1].
* Errors: only :mod:`torpor.errors` classes leave a backend (``StorageError``, ``CorruptData``,
  ``RecordNotFound``, ``InvalidArgument``, ``QuotaExceeded``); driver exceptions are wrapped
  with ``exc=``.
* Record quota: a store counts every row it holds (facts and episodes; current, superseded and
  expired-but-unpurged alike) in a counter its own triggers keep, so checking a quota costs
  no scan. :meth:`TenantStore.add` and :meth:`TenantStore.import_records` take ``quota=`` and
  refuse, inside the write transaction, a batch that would take the count over it: all or
  nothing (:func:`check_record_quota`).

Version 2 of this interface (2: ``lexical_search`` and ``vector_search`` take ``memo=``, a
:class:`SearchMemo` a backend may use or ignore). Changes are announced in commit messages.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from torpor.errors import Conflict, QuotaExceeded
from torpor.memory.models import (
    AuditEntry,
    Episode,
    Fact,
    Kind,
    Policy,
    Profile,
    TokenInfo,
    from_us,
    path_within,
    to_us,
)

__all__ = [
    "INTERFACE_VERSION",
    "MAX_LEXICAL_TERMS",
    "AnyRecord",
    "MemoryBackend",
    "RecordFilter",
    "SearchMemo",
    "TenantStore",
    "Vector",
    "check_record_quota",
    "profile_moved",
    "successor",
    "time_clauses",
    "visible",
]

#: the distinct terms a lexical search uses, the first ones of the query (a pasted page
#: would otherwise be a query of thousands of ORed terms; both backends cut at the same place)
MAX_LEXICAL_TERMS = 256

INTERFACE_VERSION = 2

AnyRecord = Fact | Episode
#: A dense vector: a sequence of floats (a float32 numpy array in practice), L2-normalized.
Vector = Sequence[float]


@dataclass(frozen=True)
class RecordFilter:
    """Which records a query may see.

    ``scopes``: the exact scope paths visible (a scope and its ancestors), required.
    ``now``: microseconds; records with ``expires_at <= now`` are never visible.
    ``as_of``: microseconds; when set, only records with ``valid_from <= as_of`` and
    (``valid_to`` null or ``> as_of``), superseded or not. When unset, only current records
    (``valid_to`` null) unless ``include_history``.
    ``kinds``, ``key``, ``session`` (episodes), ``metadata`` (equality on top-level keys, JSON
    values), ``since``/``until`` (microseconds, on ``valid_from``: since <= valid_from < until).
    """

    scopes: Sequence[str]
    now: int
    kinds: Sequence[Kind] = ("fact", "episode")
    as_of: int | None = None
    include_history: bool = False
    key: str | None = None
    session: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    since: int | None = None
    until: int | None = None


def visible(record: AnyRecord, flt: RecordFilter) -> bool:
    """The reference definition of :class:`RecordFilter`: True when ``record`` passes ``flt``.

    Backends implement the same predicate in their query language; tests compare against this.
    """
    if record.scope not in flt.scopes or record.kind not in flt.kinds:
        return False
    if record.expires_at is not None and to_us(record.expires_at) <= flt.now:
        return False
    vf = to_us(record.valid_from)
    vt = None if record.valid_to is None else to_us(record.valid_to)
    if flt.as_of is not None:
        if vf > flt.as_of or (vt is not None and vt <= flt.as_of):
            return False
    elif not flt.include_history and vt is not None:
        return False
    if flt.key is not None and (not isinstance(record, Fact) or record.key != flt.key):
        return False
    if flt.session is not None and (
        not isinstance(record, Episode) or record.session != flt.session
    ):
        return False
    if flt.since is not None and vf < flt.since:
        return False
    if flt.until is not None and vf >= flt.until:
        return False
    return all(record.metadata.get(k, _MISSING) == v for k, v in flt.metadata.items())


_MISSING = object()


def successor(rec: Fact, current_valid_from_us: int) -> Fact:
    """``rec`` as the successor of the current fact that started at ``current_valid_from_us``.

    A successor starts strictly after its predecessor (one microsecond later at the least), so
    history stays strictly ordered even when two writes share a clock tick. Backends close the
    predecessor with ``valid_to`` = the returned fact's ``valid_from``."""
    start = max(to_us(rec.valid_from), current_valid_from_us + 1)
    if start != to_us(rec.valid_from):
        rec = rec.model_copy(update={"valid_from": from_us(start)})
    return rec


def profile_moved(scope: str, expected: int) -> Conflict:
    """The error of a :meth:`TenantStore.put_profile` whose ``expect_version`` is not the
    stored version any more."""
    return Conflict(
        f"the profile of {scope or '/'!r} changed since version {expected} was read",
        kind="profile",
        scope=scope,
        expected=expected,
    )


def check_record_quota(tenant: str, quota: int | None, used: int, adding: int) -> None:
    """Raise :class:`QuotaExceeded` (``quota="memory_records"``, ``limit``, ``used``) when a
    store holding ``used`` records may not take ``adding`` more under ``quota`` (None: no
    limit). Backends call it inside the write transaction, so a refused batch writes nothing."""
    if quota is not None and adding > 0 and used + adding > quota:
        raise QuotaExceeded(
            f"tenant {tenant!r} is at its memory records quota: {used} of {quota} used, "
            f"{adding} more asked (forget records, or raise it in quotas.json)",
            tenant=tenant,
            quota="memory_records",
            limit=quota,
            used=used,
        )


def time_clauses(flt: RecordFilter, alias: str, ph: str) -> tuple[list[str], list[Any]]:
    """The SQL both backends share for :func:`visible`'s time, key and session rules.

    ``ph`` is the driver's placeholder (``?`` for sqlite3, ``%s`` for psycopg). Returns the
    clauses to AND together and their parameters, in order."""
    a = alias
    parts: list[str] = []
    params: list[Any] = []
    if flt.as_of is not None:
        parts.append(f"{a}.valid_from <= {ph} AND ({a}.valid_to IS NULL OR {a}.valid_to > {ph})")
        params += [flt.as_of, flt.as_of]
    elif not flt.include_history:
        parts.append(f"{a}.valid_to IS NULL")
    if flt.key is not None:
        parts.append(f"{a}.key = {ph} AND {a}.kind = 'fact'")
        params.append(flt.key)
    if flt.session is not None:
        parts.append(f"{a}.session = {ph} AND {a}.kind = 'episode'")
        params.append(flt.session)
    if flt.since is not None:
        parts.append(f"{a}.valid_from >= {ph}")
        params.append(flt.since)
    if flt.until is not None:
        parts.append(f"{a}.valid_from < {ph}")
        params.append(flt.until)
    return parts, params


@dataclass
class SearchMemo:
    """What the searches of ONE query may share: recall passes the same memo to its lexical
    search(es) and its vector search, so a record both find is built once and a term searched
    twice (content words, then all words) is looked up once. A backend keys both by what it
    read (the whole row; the term and the database's change counter), so a stale entry is
    never used; one that keeps nothing here is still correct. Never kept across queries."""

    records: dict[Any, Any] = field(default_factory=dict)
    postings: dict[Any, Any] = field(default_factory=dict)


class TenantStore(abc.ABC):
    """All records, profiles and policies of one tenant. Thread-safe; usable across processes."""

    tenant: str

    @abc.abstractmethod
    def schema_version(self) -> int:
        """The migration version of this tenant's schema (raises :class:`StorageError`)."""

    # -- writes ---------------------------------------------------------------------------
    @abc.abstractmethod
    def add(
        self,
        records: Sequence[AnyRecord],
        vectors: Sequence[Vector | None] | None = None,
        *,
        quota: int | None = None,
    ) -> list[AnyRecord]:
        """Insert ``records`` (with their optional embeddings) in one transaction, in order.

        For each fact with a ``key``, the current fact with the same ``(scope, key)`` (if any)
        is ended in the same transaction: its ``valid_to`` becomes the new fact's
        ``valid_from`` and its ``superseded_by`` the new id. If the new ``valid_from`` is not
        after the old one's, it is moved to old ``valid_from`` + 1 µs, so history is strictly
        ordered even across processes. Nothing outside that scope and key changes.
        Returns the stored records (with any adjusted ``valid_from``). All or nothing:
        raises :class:`StorageError` (or :class:`InvalidArgument` for a duplicate id, or
        :class:`QuotaExceeded` when the store would then hold more than ``quota`` records)
        and leaves no partial state.
        """

    @abc.abstractmethod
    def import_records(
        self,
        records: Sequence[AnyRecord],
        vectors: Sequence[Vector | None] | None = None,
        *,
        quota: int | None = None,
    ) -> int:
        """Insert records exactly as given (ids, validity, supersession kept), skipping ids
        that already exist. Returns how many were inserted. One transaction; raises
        :class:`QuotaExceeded` (nothing inserted) when the store would then hold more than
        ``quota`` records."""

    @abc.abstractmethod
    def record_count(self) -> int:
        """How many records the store holds, as the record quota counts them (every row:
        current, superseded and expired-but-unpurged facts and episodes)."""

    @abc.abstractmethod
    def set_verification(
        self, record_id: str, *, verified: bool, stale: bool, source_hash: str | None
    ) -> None:
        """Record the outcome of a provenance check (raises :class:`RecordNotFound`)."""

    @abc.abstractmethod
    def forget(self, ids: Sequence[str]) -> int:
        """Erase records by id (text, index entries, vectors). Returns how many existed."""

    @abc.abstractmethod
    def forget_scope(self, prefix: str) -> int:
        """Erase every record, profile and policy at ``prefix`` or below it (component-wise:
        ``app/a`` covers ``app/a/user/u`` but not ``app/ab``; ``""`` is the whole tenant).
        Returns how many records were erased."""

    @abc.abstractmethod
    def cap_expiry(self, scope: str, retention_us: int) -> int:
        """Apply a retention period to the records of exactly ``scope``: each one's
        ``expires_at`` becomes ``min(expires_at, created_at + retention_us, LAST_US)`` (a
        time past :data:`~torpor.memory.models.LAST_US` could not be read back). Returns how
        many changed."""

    @abc.abstractmethod
    def purge_expired(self, now: int) -> int:
        """Physically delete records with ``expires_at <= now``. Returns how many."""

    # -- reads ----------------------------------------------------------------------------
    @abc.abstractmethod
    def get(self, ids: Sequence[str], now: int) -> list[AnyRecord]:
        """The records with these ids that exist and are not expired, in the order asked."""

    @abc.abstractmethod
    def history(self, scope: str, key: str, now: int) -> list[Fact]:
        """Every unexpired fact with ``key`` in exactly ``scope``, oldest ``valid_from`` first."""

    @abc.abstractmethod
    def scan(
        self, flt: RecordFilter, limit: int, *, newest_first: bool = True, offset: int = 0
    ) -> list[AnyRecord]:
        """Visible records ordered by ``valid_from`` (newest first by default), up to
        ``limit``, after skipping the first ``offset`` (a page)."""

    def previous_episodes(self, episodes: Sequence[Episode], flt: RecordFilter) -> dict[str, str]:
        """For each of ``episodes``: the id of the episode ``flt`` lets through just before it
        in the same scope and session (the turns logged without a session are one running
        log of their scope), when there is one: the latest earlier ``valid_from``, and among
        turns of the same time (a log that dates a session's turns alike) the one stored
        before it. This default pages through :meth:`scan` (newest first, same-time records
        last stored first) per episode; a backend may answer in one query. Raises
        :class:`StorageError`."""
        out: dict[str, str] = {}
        for ep in episodes:
            at = to_us(ep.valid_from)
            until = at + 1 if flt.until is None else min(flt.until, at + 1)
            sub = replace(flt, scopes=(ep.scope,), kinds=("episode",), session=ep.session)
            found = self._stored_before(ep, at, replace(sub, until=until))
            if found is not None:
                out[ep.id] = found
        return out

    def _stored_before(self, ep: Episode, at: int, flt: RecordFilter, page: int = 64) -> str | None:
        """The id of the first episode of ``ep``'s session in ``flt``'s newest-first scan that
        comes after ``ep`` (or, when ``ep`` is not among them, that is older than ``at``)."""
        seen, offset = False, 0
        while batch := self.scan(flt, page, offset=offset):
            for rec in batch:
                if rec.id == ep.id:
                    seen = True
                elif (seen or to_us(rec.valid_from) < at) and (
                    isinstance(rec, Episode) and rec.session == ep.session
                ):
                    return rec.id
            offset += page
        return None

    @abc.abstractmethod
    def count(self, flt: RecordFilter) -> int:
        """How many records are visible under ``flt``."""

    @abc.abstractmethod
    def lexical_search(
        self,
        terms: Sequence[str],
        flt: RecordFilter,
        limit: int,
        *,
        memo: SearchMemo | None = None,
    ) -> list[tuple[AnyRecord, float]]:
        """Visible records matching ANY of ``terms`` (already lower-cased word tokens, no
        operators; the first :data:`MAX_LEXICAL_TERMS` distinct ones, on every backend alike),
        best first, with a positive relevance score. Empty ``terms`` -> ``[]``.
        ``memo``: shared by the searches of one query (:class:`SearchMemo`); may be ignored."""

    def mean_words(self) -> float | None:
        """The mean word count of the tenant's indexed texts (BM25's average document length),
        or None when the backend cannot tell cheaply; the ranker then uses its candidates'
        mean. Not abstract: a backend without the statistic inherits None."""
        return None

    @abc.abstractmethod
    def vector_search(
        self,
        vector: Vector,
        flt: RecordFilter,
        limit: int,
        *,
        memo: SearchMemo | None = None,
    ) -> list[tuple[AnyRecord, float]]:
        """Visible records that have an embedding, by cosine similarity to ``vector``, best
        first. Exact or approximate; approximate search must still apply ``flt`` exactly.
        ``memo``: as for :meth:`lexical_search`."""

    @abc.abstractmethod
    def iter_records(self, prefix: str) -> Iterator[tuple[AnyRecord, list[float] | None]]:
        """Every record at ``prefix`` or below (expired included), with its embedding, in
        insertion order: the export stream."""

    @abc.abstractmethod
    def without_vectors(self, limit: int) -> list[tuple[str, str]]:
        """``(id, text)`` of up to ``limit`` records that have no embedding (expired and
        superseded ones included), oldest first: what a reindex fills in."""

    @abc.abstractmethod
    def set_vectors(self, pairs: Sequence[tuple[str, Vector]]) -> int:
        """Store the embedding of each ``(id, vector)`` (replacing any), in one transaction.
        Ids that no longer exist are skipped. Returns how many records got a vector."""

    # -- profiles, policies, metadata -----------------------------------------------------
    @abc.abstractmethod
    def get_profile(self, scope: str) -> Profile | None:
        """The profile of exactly ``scope``, or None."""

    @abc.abstractmethod
    def put_profile(self, profile: Profile, *, expect_version: int | None = None) -> Profile:
        """Store ``profile`` (replacing the old one); the stored version is old version + 1.
        With ``expect_version``, only while the stored version is that one (0: none stored):
        else :class:`~torpor.errors.Conflict` and nothing written (a read-modify-write, such
        as a merge, that another writer overtook)."""

    @abc.abstractmethod
    def iter_profiles(self, prefix: str) -> Iterator[Profile]:
        """Every profile at ``prefix`` or below."""

    @abc.abstractmethod
    def get_policy(self, scope: str) -> Policy | None:
        """The policy set on exactly ``scope``, or None."""

    @abc.abstractmethod
    def set_policy(self, scope: str, policy: Policy) -> None:
        """Set the policy of ``scope`` (replacing the old one)."""

    @abc.abstractmethod
    def iter_policies(self, prefix: str) -> Iterator[tuple[str, Policy]]:
        """Every ``(scope, policy)`` set at ``prefix`` or below, by scope."""

    @abc.abstractmethod
    def get_meta(self, key: str) -> str | None:
        """A tenant-level setting (e.g. ``embedding_model``, ``embedding_dim``), or None."""

    @abc.abstractmethod
    def set_meta(self, key: str, value: str) -> None:
        """Set a tenant-level setting."""

    def claim_meta(self, key: str, value: str) -> str:
        """Set ``key`` to ``value`` unless it holds a value already; return what it holds
        then. Backends make it one step, so two writers (two processes) never both set it."""
        stored = self.get_meta(key)
        if stored is None:
            self.set_meta(key, value)
            return value
        return stored

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections. Later calls raise :class:`StorageError`."""


class MemoryBackend(abc.ABC):
    """A storage engine holding many tenants, plus the token table and the audit log."""

    name: str

    @abc.abstractmethod
    def tenant(self, tenant: str) -> TenantStore:
        """The store of ``tenant`` (a valid name, see ``check_name``), created and migrated
        on first use. Raises :class:`InvalidName`, :class:`StorageError`, :class:`CorruptData`."""

    @abc.abstractmethod
    def tenants(self) -> list[str]:
        """The names of tenants that have a store."""

    @abc.abstractmethod
    def put_token(self, token: TokenInfo) -> None:
        """Store a token record (by its hash; replacing one with the same hash)."""

    @abc.abstractmethod
    def get_token(self, token_hash: str) -> TokenInfo | None:
        """The token record with this hash, or None."""

    @abc.abstractmethod
    def list_tokens(self, tenant: str) -> list[TokenInfo]:
        """Every token record of ``tenant`` (revoked ones too), oldest first."""

    @abc.abstractmethod
    def revoke_token(self, token_hash: str) -> bool:
        """Mark a token revoked. Returns False if it did not exist."""

    @abc.abstractmethod
    def append_audit(self, entry: AuditEntry) -> None:
        """Append one entry to the audit log (never fails silently: raises StorageError)."""

    @abc.abstractmethod
    def audit_log(self, tenant: str | None = None, limit: int = 100) -> list[AuditEntry]:
        """The newest ``limit`` audit entries, newest first, optionally for one tenant."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close every tenant store and the shared tables."""


def scope_within(path: str, prefix: str) -> bool:
    """True when ``path`` is ``prefix`` or below it (re-exported for backends)."""
    return path_within(path, prefix)
