"""Checks of what a caller passes to :class:`~torpor.memory.ScopedMemory`, before any write.

Each function returns the value in the form the models store, or raises
:class:`~torpor.errors.InvalidArgument` (:class:`~torpor.errors.PayloadTooLarge` for a value
over :data:`torpor.config.LIMITS`). Used as ``check.text(...)``, ``check.key(...)`` and so on.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from datetime import date, datetime, timedelta
from typing import Any

import jsonschema
from pydantic import BaseModel
from pydantic import ValidationError as PydanticValidationError
from referencing import Registry
from referencing.exceptions import Unresolvable

from torpor.config import LIMITS
from torpor.errors import InvalidArgument, PayloadTooLarge, SchemaViolation
from torpor.memory.models import MAX_SECONDS, Durability, Policy, SourceRef, to_us

__all__ = ["expiry", "key", "metadata", "profile", "source", "storable_json", "text", "time", "ttl"]

_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:/-]{0,199}$")
#: how deep metadata and profiles may nest (a JSON document, not a recursion bomb)
MAX_DEPTH = 32
_META_KEY_RE = re.compile(r'^[^"\\]{1,200}$')


def text(text: object, what: str = "text") -> str:
    """A non-empty string without NUL, at most ``LIMITS.max_memory_text_chars`` long."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidArgument(f"{what} must be a non-empty string")
    if "\x00" in text:  # PostgreSQL cannot store it; refuse it on every backend alike
        raise InvalidArgument(f"{what} must not contain NUL characters")
    _encodable(text, what)
    if len(text) > LIMITS.max_memory_text_chars:
        raise PayloadTooLarge(
            f"{what} is {len(text)} characters, over the limit of {LIMITS.max_memory_text_chars}",
            size=len(text),
            limit=LIMITS.max_memory_text_chars,
        )
    return text


def _encodable(value: str, what: str) -> None:
    """Refuse a lone surrogate (``"\\ud800"``): no store can encode it as UTF-8."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgument(
            f"{what} is not valid Unicode (a lone surrogate at position {exc.start})"
        ) from None


def _strings(value: object, what: str, max_depth: int | None = MAX_DEPTH) -> None:
    """Check every string in a JSON-like value (keys included) and its depth, without
    recursion: no NUL (checked on the values, not on their JSON text: a literal
    backslash-u-0000 string is text), no lone surrogate, at most ``max_depth`` levels (None:
    any)."""
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if "\x00" in item:
                raise InvalidArgument(f"{what} must not contain NUL characters")
            _encodable(item, what)
            continue
        if isinstance(item, Mapping | list | tuple):
            if max_depth is not None and depth >= max_depth:
                raise InvalidArgument(f"{what} nests deeper than {max_depth} levels")
            children = [*item.keys(), *item.values()] if isinstance(item, Mapping) else item
            stack.extend((child, depth + 1) for child in children)


def metadata(metadata: Mapping[str, Any] | None, what: str = "metadata") -> dict[str, Any]:
    """A JSON-serializable mapping with valid keys and no NUL, its JSON within the limit."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise InvalidArgument(f"{what} must be a mapping")
    out = dict(metadata)
    for k in out:
        if not isinstance(k, str) or not _META_KEY_RE.match(k):
            raise InvalidArgument(f"invalid {what} key {k!r}")
    _strings(out, what)  # before json.dumps: it recurses, and would pass a surrogate
    try:
        encoded = json.dumps(out, allow_nan=False)  # NaN is not JSON: no store could filter on it
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"{what} must be JSON-serializable: {exc}") from None
    size = len(encoded)
    if size > LIMITS.max_memory_text_chars:
        raise PayloadTooLarge(
            f"{what} is {size} characters of JSON", size=size, limit=LIMITS.max_memory_text_chars
        )
    return out


def storable_json(value: object, what: str) -> None:
    """Raise :class:`InvalidArgument` when a JSON-like value holds a string (a key too) that
    no store keeps (a NUL: PostgreSQL's JSON cannot; a lone surrogate), at any depth, or is
    not JSON (NaN, which PostgreSQL refuses and SQLite kept; an object json cannot write)."""
    _strings(value, what, max_depth=None)
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidArgument(f"{what} must be JSON: {exc}") from None


def key(key: object) -> str | None:
    """None, or a fact key: 1-200 letters, digits and ``_ . : / -``."""
    if key is None:
        return None
    if not isinstance(key, str) or not _KEY_RE.match(key):
        raise InvalidArgument(
            f"invalid key {key!r}: 1-200 characters of letters, digits and "
            "_ . : / -, starting with a letter or digit"
        )
    return key


def storable(text: str) -> bool:
    """True when both stores can keep ``text``: no NUL (PostgreSQL), valid UTF-8 (no lone
    surrogate, which JSON can carry: SQLite stored it, and every answer naming it failed)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return "\x00" not in text


def record_id(value: object) -> str | None:
    """``value`` as a record id to look up, or None for a string no record can have as its id
    (not :func:`storable`: neither store can even be asked). Raises InvalidArgument for
    anything but a string."""
    if not isinstance(value, str):
        raise InvalidArgument(f"a record id is a string, not {type(value).__name__}")
    return value if storable(value) else None


def profile(
    doc: Mapping[str, Any],
    schema: type[BaseModel] | Mapping[str, Any] | None,
    stored: dict[str, Any] | None,
) -> dict[str, Any] | None:
    """The JSON schema to keep with profile ``doc`` (``schema``: a pydantic model or a JSON
    schema; without one, the ``stored`` schema), once ``doc`` is checked against it.

    Raises :class:`~torpor.errors.SchemaViolation` for a document that breaks it and
    :class:`InvalidArgument` for an invalid JSON schema (one whose ``$ref`` names a URL too:
    nothing is fetched)."""
    json_schema: dict[str, Any] | None
    if isinstance(schema, type) and issubclass(schema, BaseModel):
        json_schema = schema.model_json_schema()
        try:
            schema.model_validate(doc)
        except PydanticValidationError as exc:
            raise SchemaViolation(f"profile breaks {schema.__name__}: {exc}") from None
    else:
        json_schema = dict(schema) if schema is not None else stored
    if schema is not None:  # a new one: as every store keeps it, or not at all
        storable_json(json_schema, "json_schema")
    if json_schema is not None:
        try:
            # an empty registry: a $ref reaches what the schema holds and the standard
            # meta-schemas, never a URL (jsonschema would fetch it, from any address)
            jsonschema.validate(doc, json_schema, registry=Registry())
        except jsonschema.ValidationError as exc:
            raise SchemaViolation(f"profile breaks its schema: {exc.message}") from None
        except jsonschema.SchemaError as exc:
            raise InvalidArgument(f"invalid JSON schema: {exc.message}") from None
        except (Unresolvable, RecursionError) as exc:  # a $ref to nothing, or to itself
            raise InvalidArgument(f"invalid JSON schema: {exc}") from None
    return json_schema


def source(source: SourceRef | Mapping[str, Any] | None) -> SourceRef | None:
    """None, or a :class:`~torpor.memory.SourceRef` (a mapping of its fields becomes one)."""
    if source is None or isinstance(source, SourceRef):
        return source
    if not isinstance(source, Mapping):
        raise InvalidArgument("source must be a SourceRef")
    return SourceRef(**source)


def ttl(ttl: float | timedelta | None) -> float | None:
    """None, or a time to live in seconds: a number or a timedelta, more than 0 and at most
    :data:`~torpor.memory.models.MAX_SECONDS` (a thousand years)."""
    if ttl is None:
        return None
    if isinstance(ttl, timedelta):
        seconds = ttl.total_seconds()
    elif isinstance(ttl, int | float) and not isinstance(ttl, bool):
        seconds = float(ttl)
    else:
        raise InvalidArgument(f"ttl must be a number of seconds or a timedelta, not {ttl!r}")
    if not 0 < seconds <= MAX_SECONDS:  # NaN fails this too
        raise InvalidArgument(
            f"ttl must be more than 0 and at most {MAX_SECONDS:.0f} seconds, not {ttl!r}"
        )
    return seconds


def time(value: datetime | date | str | None, what: str) -> int | None:
    """None, or a point in time in microseconds since the epoch.

    Accepted: a :class:`~datetime.datetime`; an ISO 8601 string (``"2024-03-15T09:30:00Z"``,
    ``"2024-03-15T09:30:00+02:00"``, ``"2024-03-15 09:30"``, ``"2024-03-15"``); a
    :class:`~datetime.date` (its midnight). **A time without an offset is UTC**: a naive
    datetime, an ISO string without ``Z`` or ``+hh:mm`` and a bare date are all read as UTC
    (never as the machine's local time, which would make the same call mean different
    instants on different hosts). Raises :class:`InvalidArgument` for anything else.
    """
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        try:
            parsed = datetime.fromisoformat(text)
        except ValueError:
            raise InvalidArgument(
                f"{what} must be a datetime or an ISO 8601 string such as "
                f"2024-03-15T09:30:00Z, not {value[:64]!r}"
            ) from None
        us = to_us(parsed)
    elif isinstance(value, datetime):
        us = to_us(value)
    elif isinstance(value, date):
        us = to_us(datetime(value.year, value.month, value.day))
    else:
        raise InvalidArgument(f"{what} must be a datetime or an ISO 8601 string")
    if not _FIRST_US <= us <= _LAST_US:  # 0001-01-01T00:00+01:00 is before year 1 in UTC
        raise InvalidArgument(f"{what} must fall within years 1-9999 in UTC, not {value!r}")
    return us


_FIRST_US = to_us(datetime.min)
_LAST_US = to_us(datetime.max)


def expiry(policy: Policy, now: int, durability: Durability, ttl: float | None) -> int | None:
    """When a record written ``now`` expires (microseconds), or None: the sooner of its TTL
    (a ``cache`` record's default: the policy's) and the scope's retention."""
    if durability not in ("persistent", "cache"):
        raise InvalidArgument(f"durability must be 'persistent' or 'cache', not {durability!r}")
    if ttl is None and durability == "cache":
        ttl = policy.cache_ttl_seconds
    ends = [now + int(s * 1e6) for s in (ttl, policy.retention_seconds) if s is not None]
    return min(ends) if ends else None
