"""Records from what callers pass to ``remember_many`` / ``log_many``: every item checked,
then the whole batch built at once.

Two passes. The first checks each item (:mod:`torpor.memory._validate`, in the item's order,
so the first bad item is the one reported) and reads each fact's cited source. The second
gives the batch its times and ids: one run of consecutive microseconds reserved from the
process clock (:func:`~torpor.memory.models.now_us_run`: record ``i`` is ``first + i``, as
one :func:`~torpor.memory.models.now_us` call per record would have given, so facts with the
same key in one batch still supersede one another in order), and the random part of every id
read at once. The models are built with :func:`~torpor.memory.models.trusted`: every value
has just been checked here, and pydantic would only check the same types again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from torpor.errors import InvalidArgument
from torpor.memory import _validate as check
from torpor.memory import provenance
from torpor.memory.models import (
    Durability,
    Episode,
    Fact,
    Policy,
    SourceRef,
    from_us,
    new_ids,
    now_us_run,
    trusted,
)

__all__ = ["episodes", "facts"]

_FACT_FIELDS = frozenset({"text", "key", "metadata", "source", "durability", "ttl"})
_TURN_FIELDS = frozenset({"role", "text", "session", "metadata", "at", "durability", "ttl"})


def _times(n: int) -> tuple[list[int], list[str]]:
    """``n`` increasing write times and their record ids."""
    first = now_us_run(n)
    times = list(range(first, first + n))
    return times, new_ids(times)


def facts(
    items: Iterable[str | Mapping[str, Any]],
    scope: str,
    policy: Policy,
    may_cite: Callable[[SourceRef], None] | None = None,
) -> list[Fact]:
    """The facts for ``items`` (texts, or mappings of :data:`_FACT_FIELDS`) in ``scope``.
    ``may_cite`` raises for a source the caller may not have read (before any is read); with
    one, URL sources are fetched from public addresses only (a token's call).
    Raises :class:`InvalidArgument` / :class:`PayloadTooLarge` for the first bad item, and
    what ``may_cite`` raises."""
    checked = []
    for item in items:
        if isinstance(item, str):
            spec: Mapping[str, Any] = {"text": item}
        elif isinstance(item, Mapping):
            spec = item
            unknown = spec.keys() - _FACT_FIELDS
            if unknown:
                raise InvalidArgument(f"unknown fields {sorted(unknown)}")
        else:
            raise InvalidArgument(f"an item is a text or a mapping, not {type(item).__name__}")
        text, key = check.text(spec.get("text", "")), check.key(spec.get("key"))
        meta, ttl = check.metadata(spec.get("metadata")), check.ttl(spec.get("ttl"))
        source = check.source(spec.get("source"))
        if source is not None and may_cite is not None:
            may_cite(source)
        durability: Durability = spec.get("durability") or "persistent"
        # when it expires, counted from its write (added once the batch has its times)
        life = check.expiry(policy, 0, durability, ttl)
        proof = _provenance(source, public_only=may_cite is not None)
        checked.append((text, key, meta, durability, life, source, proof))
    times, ids = _times(len(checked))
    out = []
    for (text, key, meta, durability, life, source, proof), t, id_ in zip(
        checked, times, ids, strict=True
    ):
        at = from_us(t)
        out.append(
            trusted(
                Fact,
                {
                    "id": id_,
                    "kind": "fact",
                    "scope": scope,
                    "text": text,
                    "metadata": meta,
                    "created_at": at,
                    "valid_from": at,
                    "valid_to": None,
                    "durability": durability,
                    "expires_at": None if life is None else from_us(t + life),
                    "key": key,
                    "source": source,
                    "source_hash": proof[1],
                    "verified": proof[0],
                    "reason": proof[2],
                    "stale": False,
                    "superseded_by": None,
                },
            )
        )
    return out


def _provenance(source: SourceRef | None, public_only: bool) -> tuple[bool, str | None, str | None]:
    """``(verified, sha256, reason)`` of a fact citing ``source`` (read and hashed now)."""
    if source is None:
        return False, None, None
    outcome = provenance.check(source, public_only=public_only)
    if outcome.verified:
        return True, outcome.sha256, None
    return False, outcome.sha256, outcome.reason or "not verified"


def episodes(
    turns: Iterable[Mapping[str, Any]], scope: str, policy: Policy, session: str | None
) -> list[Episode]:
    """The episodes for ``turns`` (mappings of :data:`_TURN_FIELDS`) in ``scope``; a turn
    without a session gets ``session``. Raises as :func:`facts` does."""
    checked = []
    for turn in turns:
        if not isinstance(turn, Mapping):
            raise InvalidArgument(f"a turn is a mapping, not {type(turn).__name__}")
        unknown = turn.keys() - _TURN_FIELDS
        if unknown:
            raise InvalidArgument(f"unknown fields {sorted(unknown)}")
        role = check.text(turn.get("role"), "role")
        text = check.text(turn.get("text"))
        meta = check.metadata(turn.get("metadata"))
        ttl = check.ttl(turn.get("ttl"))
        own = turn.get("session") or session
        if own is not None:
            check.text(own, "session")
        at = check.time(turn.get("at"), "at")
        durability: Durability = turn.get("durability") or "persistent"
        life = check.expiry(policy, 0, durability, ttl)
        checked.append((role[:64], text, meta, own, at, durability, life))
    times, ids = _times(len(checked))
    out = []
    for (role, text, meta, own, at, durability, life), t, id_ in zip(
        checked, times, ids, strict=True
    ):
        created = from_us(t)
        out.append(
            trusted(
                Episode,
                {
                    "id": id_,
                    "kind": "episode",
                    "scope": scope,
                    "text": text,
                    "metadata": meta,
                    "created_at": created,
                    "valid_from": created if at is None else from_us(at),  # 0 is 1970, not none
                    "valid_to": None,
                    "durability": durability,
                    "expires_at": None if life is None else from_us(t + life),
                    "role": role,
                    "session": own,
                },
            )
        )
    return out
