"""SQLite schema, migrations and the SQL form of :class:`RecordFilter` (the row conversion it
shares with PostgreSQL is :mod:`torpor.memory.backends._rows`).

The schema version is ``PRAGMA user_version``; :data:`MIGRATIONS` lists the steps, each run in
one transaction, so a database is always at a whole version. Records live in one table
(facts and episodes together, so one FTS5 query ranks both), the FTS5 index is an external
content table kept in sync by the store's inserts (since v3) and by triggers on delete and
update, and embeddings sit in their own table so that scans of records do not drag vectors
along.
"""

from __future__ import annotations

import math
from typing import Any

from torpor.memory.backends._rows import RECORD_COLUMNS, record_from_row, record_to_row
from torpor.memory.backends._sqlite_conn import canonical_json
from torpor.memory.backends.base import AnyRecord, RecordFilter, time_clauses

__all__ = [
    "COLUMNS",
    "MIGRATIONS",
    "SYSTEM_MIGRATIONS",
    "filter_sql",
    "record_to_row",
    "row_to_record",
]

MIGRATIONS: list[str] = [
    # v1
    """
    CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
    CREATE TABLE records (
        rid INTEGER PRIMARY KEY,
        id TEXT NOT NULL UNIQUE,
        kind TEXT NOT NULL CHECK (kind IN ('fact', 'episode')),
        scope TEXT NOT NULL,
        key TEXT,
        text TEXT NOT NULL,
        metadata TEXT NOT NULL DEFAULT '{}',
        created_at INTEGER NOT NULL,
        valid_from INTEGER NOT NULL,
        valid_to INTEGER,
        durability TEXT NOT NULL DEFAULT 'persistent',
        expires_at INTEGER,
        role TEXT,
        session TEXT,
        source TEXT,
        source_hash TEXT,
        verified INTEGER NOT NULL DEFAULT 0,
        stale INTEGER NOT NULL DEFAULT 0,
        superseded_by TEXT
    );
    CREATE INDEX records_scope_time ON records (scope, valid_from);
    CREATE INDEX records_key ON records (scope, key, valid_from) WHERE key IS NOT NULL;
    -- at most one current fact per (scope, key): the storage enforces supersession
    CREATE UNIQUE INDEX records_current_key ON records (scope, key)
        WHERE key IS NOT NULL AND valid_to IS NULL;
    CREATE INDEX records_expiry ON records (expires_at) WHERE expires_at IS NOT NULL;
    CREATE TABLE vectors (rid INTEGER PRIMARY KEY REFERENCES records (rid) ON DELETE CASCADE,
                          vec BLOB NOT NULL);
    CREATE VIRTUAL TABLE records_fts USING fts5 (
        text, content='records', content_rowid='rid', tokenize='porter unicode61'
    );
    CREATE TRIGGER records_ai AFTER INSERT ON records BEGIN
        INSERT INTO records_fts (rowid, text) VALUES (new.rid, new.text);
    END;
    CREATE TRIGGER records_ad AFTER DELETE ON records BEGIN
        INSERT INTO records_fts (records_fts, rowid, text) VALUES ('delete', old.rid, old.text);
        DELETE FROM vectors WHERE rid = old.rid;
    END;
    CREATE TRIGGER records_au AFTER UPDATE OF text ON records BEGIN
        INSERT INTO records_fts (records_fts, rowid, text) VALUES ('delete', old.rid, old.text);
        INSERT INTO records_fts (rowid, text) VALUES (new.rid, new.text);
    END;
    CREATE TABLE profiles (
        scope TEXT PRIMARY KEY,
        data TEXT NOT NULL,
        json_schema TEXT,
        updated_at INTEGER NOT NULL,
        version INTEGER NOT NULL
    );
    CREATE TABLE policies (
        scope TEXT PRIMARY KEY,
        retention_seconds REAL,
        cache_ttl_seconds REAL
    );
    """,
    # v2: the record count the memory-records quota reads, kept by triggers (no scan per write)
    """
    CREATE TABLE counts (what TEXT PRIMARY KEY, n INTEGER NOT NULL);
    INSERT INTO counts VALUES ('records', (SELECT count(*) FROM records));
    CREATE TRIGGER records_count_ai AFTER INSERT ON records BEGIN
        UPDATE counts SET n = n + 1 WHERE what = 'records';
    END;
    CREATE TRIGGER records_count_ad AFTER DELETE ON records BEGIN
        UPDATE counts SET n = n - 1 WHERE what = 'records';
    END;
    """,
    # v3: an insert indexes its text and counts itself in the statements that add a batch
    # (:data:`INSERT_SQL`, :data:`FTS_INSERT_SQL`, :data:`COUNT_SQL`): a trigger per row
    # doubled the time SQLite spent on a batch add (``bench/README.md``, "Lexical batched
    # adds"); deletes and text updates keep theirs
    """
    DROP TRIGGER records_ai;
    DROP TRIGGER records_count_ai;
    """,
]

SYSTEM_MIGRATIONS: list[str] = [
    # v1
    """
    CREATE TABLE tokens (
        token_hash TEXT PRIMARY KEY,
        tenant TEXT NOT NULL,
        grants TEXT NOT NULL,
        name TEXT NOT NULL DEFAULT '',
        created_at INTEGER NOT NULL,
        revoked INTEGER NOT NULL DEFAULT 0
    );
    CREATE TABLE audit (
        seq INTEGER PRIMARY KEY,
        at INTEGER NOT NULL,
        tenant TEXT NOT NULL,
        actor TEXT NOT NULL,
        action TEXT NOT NULL,
        scope TEXT NOT NULL DEFAULT '',
        allowed INTEGER NOT NULL,
        detail TEXT NOT NULL DEFAULT '{}'
    );
    CREATE INDEX audit_tenant ON audit (tenant, seq);
    """,
    # v2: one identity for both layers: sandbox rights (a label selector), admin, expiry
    """
    ALTER TABLE tokens ADD COLUMN sandboxes TEXT;
    ALTER TABLE tokens ADD COLUMN admin INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE tokens ADD COLUMN expires_at INTEGER;
    CREATE INDEX tokens_tenant ON tokens (tenant);
    """,
]

COLUMNS = "rid, " + RECORD_COLUMNS
_MARKS = ", ".join(["?"] * len(COLUMNS.split(", ")))
#: a record with its rowid first (the writer numbers a batch itself: the FTS5 index and the
#: vectors then need no lookup of the rowids SQLite chose)
INSERT_SQL = f"INSERT INTO records ({COLUMNS}) VALUES ({_MARKS})"
#: the FTS5 entry of a new record: ``(rid, text)``, what the v1 insert trigger did
FTS_INSERT_SQL = "INSERT INTO records_fts (rowid, text) VALUES (?, ?)"
#: ``n`` more records in the quota's counter, what the v2 insert trigger did one by one
COUNT_SQL = "UPDATE counts SET n = n + ? WHERE what = 'records'"


def row_to_record(row: tuple[Any, ...]) -> AnyRecord:
    """A model from a row selected with :data:`COLUMNS` (``rid`` first; JSON as text)."""
    return record_from_row(row[1:], json_text=True)


def _json_path(key: str) -> str:
    return '$."' + key + '"'


def filter_sql(flt: RecordFilter, alias: str = "r") -> tuple[str, list[Any]]:
    """The WHERE clause (without ``WHERE``) and parameters equivalent to
    :func:`~torpor.memory.backends.base.visible`."""
    a = alias
    scopes = list(flt.scopes)
    kinds = list(flt.kinds)
    if not scopes or not kinds:
        return "0", []
    parts = [
        f"{a}.scope IN ({','.join('?' * len(scopes))})",
        f"{a}.kind IN ({','.join('?' * len(kinds))})",
        f"({a}.expires_at IS NULL OR {a}.expires_at > ?)",
    ]
    params: list[Any] = [*scopes, *kinds, flt.now]
    more, more_params = time_clauses(flt, a, "?")
    parts += more
    params += more_params
    for k, v in flt.metadata.items():
        path = _json_path(k)
        if v is None:
            parts.append(f"json_type({a}.metadata, ?) = 'null'")
            params.append(path)
        elif isinstance(v, bool):
            parts.append(f"json_type({a}.metadata, ?) = ?")
            params += [path, "true" if v else "false"]
        elif isinstance(v, (int, float)):
            parts.append(
                f"json_type({a}.metadata, ?) IN ('integer', 'real') "
                f"AND json_extract({a}.metadata, ?) = ?"
            )
            # sqlite3 binds 64-bit integers only; SQLite reads a larger JSON one as a real
            params += [path, path, v if -(2**63) <= v < 2**63 else _real(v)]
        elif isinstance(v, str):
            parts.append(
                f"json_type({a}.metadata, ?) = 'text' AND json_extract({a}.metadata, ?) = ?"
            )
            params += [path, path, v]
        else:  # an object or a list: equal as values (key order, 1 and 1.0 aside)
            parts.append(
                f"json_type({a}.metadata, ?) IN ('object', 'array') "
                f"AND torpor_json(json_extract({a}.metadata, ?)) = ?"
            )
            params += [path, path, canonical_json(v)]
    return " AND ".join(parts), params


def _real(value: float) -> float:
    """``value`` as SQLite reads a JSON number: a real, infinite past a float's range."""
    try:
        return float(value)
    except OverflowError:  # an integer of over 308 digits
        return math.inf if value > 0 else -math.inf
