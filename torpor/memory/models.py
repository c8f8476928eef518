"""The records of the memory store, shared by the API, the backends and the HTTP layer.

A *record* is a fact or an episode; both live in one table per backend so that one recall
ranks them together::

    Record                 id, kind, scope, text, metadata, created_at, valid_from, valid_to,
    ├── Fact                 durability, expires_at + key, source, verified, stale, superseded_by
    └── Episode              + role, session  (``at`` is ``valid_from``)
    Profile                one JSON document per scope (working memory)
    Hit                    a recalled record with its final score and its scores by source
    Scope                  tenant > app > user > agent > session, as a path "app/x/user/y"
    SourceRef              where a fact came from: a sandbox file, a volume file, a URL, a host file
    Policy                 per-scope retention and default TTL
    Grant, TokenInfo       what an API token may touch; AuditEntry: one access decision

Times are timezone-aware UTC datetimes in the models and integer microseconds since the epoch
in storage (:func:`to_us` / :func:`from_us`), so ``as_of=fact.valid_from`` round-trips exactly.
Constructors raise :class:`~torpor.errors.InvalidArgument` on bad input, never pydantic's error.
"""

from __future__ import annotations

import secrets
import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from torpor.config import check_name
from torpor.errors import InvalidArgument, InvalidName

__all__ = [
    "SCOPE_LEVELS",
    "AuditEntry",
    "Durability",
    "Episode",
    "Fact",
    "Grant",
    "Hit",
    "Kind",
    "NewToken",
    "Policy",
    "Profile",
    "Record",
    "RecordPage",
    "Scope",
    "SourceRef",
    "TokenInfo",
    "TokenSpec",
    "TokenSummary",
    "canonical_path",
    "from_us",
    "new_id",
    "new_ids",
    "now_us",
    "now_us_run",
    "path_depth",
    "path_within",
    "to_us",
    "trusted",
]

Kind = Literal["fact", "episode"]
Durability = Literal["persistent", "cache"]

#: Scope levels below the tenant, most general first.
SCOPE_LEVELS: tuple[str, ...] = ("app", "user", "agent", "session")

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_clock_lock = threading.Lock()
_last_us = 0


def to_us(dt: datetime) -> int:
    """Microseconds since the epoch for ``dt`` (a naive datetime is taken as UTC)."""
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    delta = dt - _EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def from_us(us: int) -> datetime:
    """The UTC datetime for ``us`` microseconds since the epoch (one addition: recall builds
    three per candidate record)."""
    return _EPOCH + timedelta(microseconds=us)


#: the last microsecond a datetime holds (9999-12-31T23:59:59.999999 UTC): a stored time past
#: it could not be read back (:func:`from_us` would overflow)
LAST_US = to_us(datetime.max)


def now_us() -> int:
    """The current time in microseconds, strictly increasing within this process.

    Strictly increasing so that a fact remembered right after another never shares its
    ``valid_from`` (time travel with ``as_of=`` relies on that).
    """
    global _last_us
    with _clock_lock:
        us = max(time.time_ns() // 1000, _last_us + 1)
        _last_us = us
        return us


def now_us_run(n: int) -> int:
    """The first of ``n`` consecutive microsecond times, all reserved at once: each is one a
    call of :func:`now_us` could have returned (strictly increasing, none given twice), for
    a batch of records that need a time each (one lock and one clock read for the batch)."""
    global _last_us
    with _clock_lock:
        first = max(time.time_ns() // 1000, _last_us + 1)
        _last_us = first + max(n, 1) - 1
        return first


def new_id() -> str:
    """A new record id: 14 hex digits of time then 10 random hex digits (sortable by time)."""
    return f"{now_us():014x}{secrets.token_hex(5)}"


def new_ids(times: list[int]) -> list[str]:
    """One id per time in ``times``, in :func:`new_id`'s form (the time's 14 hex digits, then
    10 random hex digits; the random part from one read of the system's source for them all)."""
    noise = secrets.token_hex(5 * len(times))
    return [f"{t:014x}{noise[10 * i : 10 * i + 10]}" for i, t in enumerate(times)]


class _Model(BaseModel):
    """Base: pydantic validation errors become :class:`InvalidArgument`."""

    model_config = ConfigDict(extra="forbid")

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            msg = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or type(self).__name__}: {e['msg']}"
                for e in exc.errors()
            )
            raise InvalidArgument(f"invalid {type(self).__name__}: {msg}") from None


class Scope(_Model):
    """An address in the scope tree: tenant > app > user > agent > session.

    Levels are optional and composable (``app`` + ``session`` is valid). ``path`` is the
    tenant-relative address used in storage and in grants, e.g. ``"app/support/user/u-42"``;
    the root scope of a tenant has the path ``""``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    tenant: str = "default"
    app: str | None = None
    user: str | None = None
    agent: str | None = None
    session: str | None = None

    @model_validator(mode="after")
    def _check(self) -> Scope:
        for level in ("tenant", *SCOPE_LEVELS):
            value = getattr(self, level)
            if value is not None:
                try:
                    check_name(value, f"{level} name")
                except InvalidName as exc:
                    raise ValueError(exc.message) from None
        return self

    @property
    def levels(self) -> list[tuple[str, str]]:
        """The set levels below the tenant, most general first."""
        return [(lv, v) for lv in SCOPE_LEVELS if (v := getattr(self, lv)) is not None]

    @property
    def path(self) -> str:
        """The tenant-relative path, e.g. ``"app/support/user/u-42"``."""
        return "/".join(f"{lv}/{v}" for lv, v in self.levels)

    @property
    def depth(self) -> int:
        """How many levels are set (0 = the tenant root): the scope's specificity."""
        return len(self.levels)

    def ancestors(self) -> list[str]:
        """The paths this scope can see, itself first, then each ancestor up to the root."""
        levels = self.levels
        return ["/".join(f"{lv}/{v}" for lv, v in levels[:n]) for n in range(len(levels), -1, -1)]

    def child(self, **levels: str) -> Scope:
        """This scope with more levels set (raises :class:`InvalidArgument` on a bad level)."""
        unknown = set(levels) - set(SCOPE_LEVELS)
        if unknown:
            raise InvalidArgument(f"unknown scope level(s): {sorted(unknown)}")
        return Scope(**{**self.model_dump(), **levels})

    @classmethod
    def from_path(cls, path: str, tenant: str = "default") -> Scope:
        """Parse a path such as ``"app/support/user/u-42"`` (raises :class:`InvalidArgument`)."""
        parts = [p for p in path.strip("/").split("/") if p] if path else []
        if len(parts) % 2:
            raise InvalidArgument(f"invalid scope path {path!r}: expected level/value pairs")
        pairs = dict(zip(parts[0::2], parts[1::2], strict=True))
        if len(pairs) * 2 != len(parts) or set(pairs) - set(SCOPE_LEVELS):
            raise InvalidArgument(f"invalid scope path {path!r}: levels are {SCOPE_LEVELS}")
        return cls(tenant=tenant, **pairs)

    def __str__(self) -> str:
        return f"{self.tenant}:{self.path or '/'}"


def canonical_path(path: object) -> str:
    """``path`` if it is a scope path in its one spelling (``"app/a/user/u"``: level/value
    pairs in the levels' order, no empty part). Raises :class:`InvalidArgument` otherwise
    (``"app//u"`` would name a scope no record is in)."""
    if not isinstance(path, str) or Scope.from_path(path).path != path:
        raise InvalidArgument(f"{path!r} is not a scope path such as 'app/a/user/u'")
    return path


def path_depth(path: str) -> int:
    """The specificity of a scope path (number of levels)."""
    return 0 if not path else path.count("/") // 2 + 1


def path_within(path: str, prefix: str) -> bool:
    """True when scope ``path`` is ``prefix`` or below it (component-wise, not by characters)."""
    return not prefix or path == prefix or path.startswith(prefix + "/")


class SourceRef(_Model):
    """Where a fact came from.

    Exactly one of: ``sandbox`` + ``path``, ``volume`` + ``path``, ``url``, or a bare absolute
    ``path`` (a file on the host: valid until the sandbox layer serves files). Optionally a
    1-based ``line`` or ``lines=(first, last)``, or a byte range ``start``/``end`` (end
    exclusive) narrows the cited content. ``quote``, when given, must occur in the cited
    content (case and whitespace aside) for the fact to be verified.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    sandbox: str | None = None
    volume: str | None = None
    path: str | None = None
    url: str | None = None
    line: int | None = Field(default=None, ge=1)
    lines: tuple[int, int] | None = None
    start: int | None = Field(default=None, ge=0)
    end: int | None = Field(default=None, ge=0)
    quote: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _check(self) -> SourceRef:
        if self.sandbox is not None and self.volume is not None:
            raise ValueError("give a sandbox or a volume, not both")
        if self.url is not None:
            if self.path or self.sandbox or self.volume:
                raise ValueError("a url source takes no sandbox, volume or path")
            if not self.url.startswith(("http://", "https://")):
                raise ValueError("url must start with http:// or https://")
        elif not self.path:
            raise ValueError("a source needs a path (with a sandbox or volume) or a url")
        elif not self.path.startswith("/"):
            raise ValueError("path must be absolute")
        narrowing = sum(x is not None for x in (self.line, self.lines, self.start))
        if narrowing > 1:
            raise ValueError("give one of line, lines, or start/end")
        if self.lines is not None and not (1 <= self.lines[0] <= self.lines[1]):
            raise ValueError("lines must be (first, last) with 1 <= first <= last")
        if (self.start is None) != (self.end is None):
            raise ValueError("a byte range needs both start and end")
        if self.start is not None and self.end is not None and self.end <= self.start:
            raise ValueError("end must be greater than start")
        return self

    @property
    def location(self) -> str:
        """A short human form: ``sandbox:agent-u-42:/workspace/ledger.csv#L3``."""
        if self.url:
            base = self.url
        elif self.sandbox:
            base = f"sandbox:{self.sandbox}:{self.path}"
        elif self.volume:
            base = f"volume:{self.volume}:{self.path}"
        else:
            base = f"host:{self.path}"
        if self.line is not None:
            return f"{base}#L{self.line}"
        if self.lines is not None:
            return f"{base}#L{self.lines[0]}-L{self.lines[1]}"
        if self.start is not None:
            return f"{base}#bytes={self.start}-{self.end}"
        return base


#: the longest time to live, retention or cache TTL, in seconds (1,000 years): a record's end
#: stays a datetime (beyond it, one would pass year 9999 and fail every later write or read)
MAX_SECONDS = 1000 * 365.25 * 86_400


class Policy(_Model):
    """Per-scope policy: ``retention_seconds`` caps how long any record in the scope lives;
    ``cache_ttl_seconds`` is the default TTL of ``cache`` records written there (each more
    than 0 and at most 1,000 years, :data:`MAX_SECONDS`)."""

    retention_seconds: float | None = Field(default=None, gt=0, le=MAX_SECONDS, allow_inf_nan=False)
    cache_ttl_seconds: float | None = Field(default=None, gt=0, le=MAX_SECONDS, allow_inf_nan=False)


_M = TypeVar("_M", bound=BaseModel)


def trusted(cls: type[_M], values: dict[str, Any]) -> _M:
    """A ``cls`` holding ``values``, which give every field and are already checked (a batch
    the API has just validated, a row read back from storage): no validation, as
    ``model_construct``, without its per-field alias search, which made it slower than
    validating (pydantic 2.13: 9.9 us against 6.7 us to validate and 1.8 us here, for a
    fact). Raises KeyError for a missing field: a caller's bug, not a user's."""
    m = cls.__new__(cls)
    object.__setattr__(m, "__dict__", {name: values[name] for name in cls.__pydantic_fields__})
    object.__setattr__(m, "__pydantic_fields_set__", set(values))
    object.__setattr__(m, "__pydantic_extra__", None)
    object.__setattr__(m, "__pydantic_private__", None)
    return m


class Record(BaseModel):
    """Fields shared by facts and episodes (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    id: str
    kind: Kind
    scope: str
    text: str
    metadata: dict[str, Any] = Field(default_factory=dict)
    created_at: datetime
    valid_from: datetime
    valid_to: datetime | None = None
    durability: Durability = "persistent"
    expires_at: datetime | None = None

    @property
    def current(self) -> bool:
        """True while the record has not been superseded (its validity is open)."""
        return self.valid_to is None


class Fact(Record):
    """A statement; with a ``key`` a newer fact in the same scope supersedes it."""

    kind: Literal["fact"] = "fact"
    key: str | None = None
    source: SourceRef | None = None
    source_hash: str | None = None
    verified: bool = False
    #: why ``verified`` is False, on the fact that ``remember``/``verify`` return (the check
    #: just made: unreadable source, quote not found ...); not stored, None when read back
    reason: str | None = None
    stale: bool = False
    superseded_by: str | None = None


class Episode(Record):
    """One append-only, time-stamped turn of a conversation or event log."""

    kind: Literal["episode"] = "episode"
    role: str = "user"
    session: str | None = None

    @property
    def at(self) -> datetime:
        """When the turn happened (``valid_from``; back-filled with ``log(at=...)``)."""
        return self.valid_from


class Profile(BaseModel):
    """The working-memory document of one scope, optionally checked against ``json_schema``."""

    model_config = ConfigDict(extra="forbid")

    scope: str
    data: dict[str, Any] = Field(default_factory=dict)
    json_schema: dict[str, Any] | None = None
    updated_at: datetime
    version: int = 1


class RecordPage(BaseModel):
    """One page of a scope's records (:meth:`ScopedMemory.get_all`), newest first: ``items``,
    the ``page`` (from 1) and ``page_size`` asked for, and ``total`` records in all."""

    model_config = ConfigDict(extra="forbid")

    items: list[Fact | Episode]
    page: int
    page_size: int
    total: int

    @property
    def has_more(self) -> bool:
        """True when a later page holds more records."""
        return self.page * self.page_size < self.total


class Hit(BaseModel):
    """One recalled record. ``score`` is the final rank score; ``scores`` says why, as the
    ranker reports it (the default's: ``coverage``, ``bm25``, ``lexical`` (their blend),
    ``vector`` (cosine), ``lexical_weight``, ``relevance``, ``scope_distance``, ``scope``,
    ``kind``, ``speaker`` (episodes), ``date`` (when the query names a day), ``asks`` (an
    episode that only asks a question), ``instructs`` / ``prefers`` (an episode that gives a
    standing instruction / states a preference, when the query is not about the past),
    ``recency``, ``reply`` (the share of its next turn's score, when it has one); see
    :mod:`torpor.memory.ranking`), and with a reranker ``rerank`` (its probability) and
    ``ranked`` (the ranker's score; ``score`` is then their blend, :mod:`torpor.memory.rerank`).
    """

    model_config = ConfigDict(extra="forbid")

    record: Fact | Episode
    score: float
    scores: dict[str, float] = Field(default_factory=dict)

    @property
    def id(self) -> str:
        return self.record.id

    @property
    def kind(self) -> Kind:
        return self.record.kind

    @property
    def text(self) -> str:
        return self.record.text

    @property
    def scope(self) -> str:
        return self.record.scope

    @property
    def metadata(self) -> dict[str, Any]:
        return self.record.metadata

    @property
    def created_at(self) -> datetime:
        return self.record.created_at

    @property
    def valid_from(self) -> datetime:
        return self.record.valid_from

    @property
    def valid_to(self) -> datetime | None:
        return self.record.valid_to


class Grant(_Model):
    """Permission to ``read`` or ``write`` (write implies read) every scope under ``prefix``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["read", "write"]
    prefix: str = ""


class TokenInfo(BaseModel):
    """A stored API token: only its SHA-256 hash is kept.

    One token serves both layers: ``grants`` are its memory rights; ``sandboxes`` its sandbox
    rights as a label selector (``None``: none; ``{}``: every sandbox of the tenant;
    ``{"user": "u-42"}``: only sandboxes carrying those labels, and a sandbox it creates gets
    them); ``admin`` lets it create, list and revoke its tenant's tokens. A token past
    ``expires_at`` is refused like a revoked one.
    """

    model_config = ConfigDict(extra="forbid")

    token_hash: str
    tenant: str
    grants: list[Grant]
    name: str = ""
    created_at: datetime
    revoked: bool = False
    sandboxes: dict[str, str] | None = None
    admin: bool = False
    expires_at: datetime | None = None

    @property
    def id(self) -> str:
        """The token's public id: the start of its hash (what lists show, what revoke takes)."""
        return self.token_hash[:16]

    def live(self, now: datetime) -> bool:
        """Neither revoked nor expired at ``now``."""
        return not self.revoked and (self.expires_at is None or now < self.expires_at)


class TokenSpec(BaseModel):
    """What ``POST /v1/tokens`` (``torpor token create``) takes: see :class:`TokenInfo`.

    ``tenant``: only the home's owner may name another tenant than its own;
    ``expires_in_seconds``: the token is refused from then on.
    """

    model_config = ConfigDict(extra="forbid")

    tenant: str | None = None
    name: str = Field(default="", max_length=200)
    grants: list[Grant] = Field(default_factory=list, max_length=100)
    sandboxes: dict[str, str] | None = None
    admin: bool = False
    expires_in_seconds: float | None = Field(default=None, ge=1, le=10 * 365 * 86400)


class TokenSummary(BaseModel):
    """A token as lists show it: its public id, never its secret or its hash."""

    model_config = ConfigDict(extra="forbid")

    id: str
    tenant: str
    name: str = ""
    grants: list[Grant]
    sandboxes: dict[str, str] | None = None
    admin: bool = False
    created_at: datetime
    expires_at: datetime | None = None
    revoked: bool = False

    @classmethod
    def of(cls, info: TokenInfo) -> TokenSummary:
        """The summary of a stored token."""
        data = info.model_dump(exclude={"token_hash"})
        return cls(id=info.id, **data)


class NewToken(BaseModel):
    """A token just created: its secret (shown this once) and its summary."""

    model_config = ConfigDict(extra="forbid")

    token: str
    info: TokenSummary


class AuditEntry(BaseModel):
    """One access decision or administrative action."""

    model_config = ConfigDict(extra="forbid")

    at: datetime
    tenant: str
    actor: str
    action: str
    scope: str = ""
    allowed: bool = True
    detail: dict[str, Any] = Field(default_factory=dict)

    @field_validator("tenant", "actor", "action", "scope")
    @classmethod
    def _storable(cls, value: str) -> str:
        """What a caller named, in text every store keeps (a refusal of a tenant named with a
        lone surrogate or NUL is audited too): those characters escaped."""
        return value.encode("utf-8", "backslashreplace").decode("utf-8").replace("\x00", "\\x00")
