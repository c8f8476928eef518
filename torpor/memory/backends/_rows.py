"""The row <-> model conversions both SQL backends share: records, tokens, audit entries.

SQLite and PostgreSQL keep the same record columns (:data:`RECORD_COLUMNS`; SQLite puts its
``rid`` in front) with times in microseconds since the epoch. They differ in how JSON comes
back: SQLite stores it as text (``json_text=True``: decoded here), PostgreSQL as ``jsonb``,
which psycopg has already decoded. Booleans are bound as ``bool`` (sqlite3 stores 0 / 1).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from torpor.memory.backends.base import AnyRecord
from torpor.memory.models import (
    AuditEntry,
    Episode,
    Fact,
    Grant,
    SourceRef,
    TokenInfo,
    from_us,
    to_us,
    trusted,
)

__all__ = [
    "RECORD_COLUMNS",
    "TOKEN_COLUMNS",
    "audit_from_row",
    "record_from_row",
    "record_to_row",
    "token_from_row",
    "token_to_row",
]

#: the record columns, in the order :func:`record_to_row` and :func:`record_from_row` use
RECORD_COLUMNS = (
    "id, kind, scope, key, text, metadata, created_at, valid_from, valid_to, "
    "durability, expires_at, role, session, source, source_hash, verified, stale, "
    "superseded_by"
)
_NCOLS = len(RECORD_COLUMNS.split(", "))


def _opt_us(value: Any) -> int | None:
    return None if value is None else to_us(value)


def _json(value: Any, json_text: bool) -> Any:
    if not json_text:
        return value
    return {} if value == "{}" else json.loads(value)  # most records carry no metadata


def _source(value: Any, json_text: bool) -> SourceRef:
    if json_text:
        return SourceRef.model_validate_json(value)
    return SourceRef.model_validate(value)


def record_to_row(r: AnyRecord) -> tuple[Any, ...]:
    """The INSERT parameters for ``r``, in :data:`RECORD_COLUMNS` order (JSON as text)."""
    source = (
        r.source.model_dump_json(exclude_none=True) if isinstance(r, Fact) and r.source else None
    )
    return (
        r.id,
        r.kind,
        r.scope,
        r.key if isinstance(r, Fact) else None,
        r.text,
        json.dumps(r.metadata, separators=(",", ":")) if r.metadata else "{}",
        to_us(r.created_at),
        to_us(r.valid_from),
        _opt_us(r.valid_to),
        r.durability,
        _opt_us(r.expires_at),
        r.role if isinstance(r, Episode) else None,
        r.session if isinstance(r, Episode) else None,
        source,
        r.source_hash if isinstance(r, Fact) else None,
        bool(r.verified) if isinstance(r, Fact) else False,
        bool(r.stale) if isinstance(r, Fact) else False,
        r.superseded_by if isinstance(r, Fact) else None,
    )


def record_from_row(values: Sequence[Any], *, json_text: bool) -> AnyRecord:
    """A model from the values of :data:`RECORD_COLUMNS` (trusted data: no re-validation)."""
    (
        id_,
        kind,
        scope,
        key,
        text,
        metadata,
        created_at,
        valid_from,
        valid_to,
        durability,
        expires_at,
        role,
        session,
        source,
        source_hash,
        verified,
        stale,
        superseded_by,
    ) = values[:_NCOLS]
    common: dict[str, Any] = {
        "id": id_,
        "scope": scope,
        "text": text,
        "metadata": _json(metadata, json_text),
        "created_at": from_us(created_at),
        "valid_from": from_us(valid_from),
        "valid_to": None if valid_to is None else from_us(valid_to),
        "durability": durability,
        "expires_at": None if expires_at is None else from_us(expires_at),
    }
    if kind == "fact":
        common.update(
            kind="fact",
            key=key,
            source=None if source is None else _source(source, json_text),
            source_hash=source_hash,
            verified=bool(verified),
            stale=bool(stale),
            superseded_by=superseded_by,
            reason=None,
        )
        return trusted(Fact, common)
    common.update(kind="episode", role=role or "user", session=session)
    return trusted(Episode, common)


#: the token columns both backends select, in :func:`token_from_row`'s order
TOKEN_COLUMNS = (
    "token_hash, {tenant}, grants, name, created_at, revoked, sandboxes, admin, expires_at"
)


def token_to_row(token: TokenInfo, *, json_text: bool) -> tuple[Any, ...]:
    """The row of :data:`TOKEN_COLUMNS` for ``token`` (JSON as text for SQLite, objects for
    PostgreSQL, which the caller wraps in ``Jsonb``)."""
    grants: Any = [g.model_dump() for g in token.grants]
    sandboxes: Any = token.sandboxes
    if json_text:
        grants = json.dumps(grants)
        sandboxes = None if sandboxes is None else json.dumps(sandboxes)
    return (
        token.token_hash,
        token.tenant,
        grants,
        token.name,
        to_us(token.created_at),
        token.revoked,
        sandboxes,
        token.admin,
        None if token.expires_at is None else to_us(token.expires_at),
    )


def token_from_row(row: Sequence[Any], *, json_text: bool) -> TokenInfo:
    """A token from a row of :data:`TOKEN_COLUMNS`."""
    sandboxes = row[6]
    return TokenInfo(
        token_hash=row[0],
        tenant=row[1],
        grants=[Grant(**g) for g in _json(row[2], json_text)],
        name=row[3],
        created_at=from_us(row[4]),
        revoked=bool(row[5]),
        sandboxes=None if sandboxes is None else _json(sandboxes, json_text),
        admin=bool(row[7]),
        expires_at=None if row[8] is None else from_us(row[8]),
    )


def audit_from_row(row: Sequence[Any], *, json_text: bool) -> AuditEntry:
    """An audit entry from ``at, tenant, actor, action, scope, allowed, detail``."""
    return AuditEntry(
        at=from_us(row[0]),
        tenant=row[1],
        actor=row[2],
        action=row[3],
        scope=row[4],
        allowed=bool(row[5]),
        detail=_json(row[6], json_text),
    )
