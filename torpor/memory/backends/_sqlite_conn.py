"""SQLite connections for the memory store: WAL, busy timeout, versioned migrations, write
transactions that retry a busy database, and sqlite3 errors translated into torpor errors.

Every write runs in ``BEGIN IMMEDIATE`` (taking the write lock up front, so two writers never
deadlock upgrading read locks), retried with a short back-off while another process holds the
lock; the 10 s busy timeout covers the wait inside SQLite itself.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torpor.config import make_private
from torpor.errors import CorruptData, InvalidArgument, StorageError

log = logging.getLogger(__name__)

__all__ = ["Conn", "connect", "translate"]

_BUSY_TIMEOUT_MS = 10_000
_BEGIN_RETRIES = 20


def translate(exc: sqlite3.Error, path: Path, what: str) -> StorageError:
    """A torpor error for a sqlite3 exception (corruption is told apart)."""
    text = str(exc)
    if isinstance(exc, sqlite3.DatabaseError) and (
        "not a database" in text or "malformed" in text or "corrupt" in text
    ):
        return CorruptData(
            f"memory database {path} is corrupt ({what}): {text}", exc=exc, path=str(path)
        )
    return StorageError(f"memory database {path} failed ({what}): {text}", exc=exc, path=str(path))


def canonical_json(value: Any) -> str:
    """``value`` as JSON in one spelling: keys sorted, a whole float written as an integer, so
    that values equal in Python (and in PostgreSQL's jsonb) are equal as text."""

    def plain(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, list):
            return [plain(x) for x in v]
        if isinstance(v, float) and v.is_integer():
            return int(v)
        return v

    return json.dumps(plain(value), sort_keys=True, separators=(",", ":"))


def _sql_canonical_json(text: str | None) -> str | None:
    """SQL ``torpor_json(text)``: :func:`canonical_json` of a JSON text (NULL if it is none)."""
    try:
        return None if text is None else canonical_json(json.loads(text))
    except ValueError:
        return None


def connect(path: Path, migrations: list[str]) -> sqlite3.Connection:
    """Open (creating if needed) the database at ``path``, in WAL mode, migrated to the latest
    version. Raises :class:`CorruptData` or :class:`StorageError`."""
    try:
        make_private(path.parent)  # a tenant's rows are for the owner of the home only
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)  # created 0600 whatever the umask
        os.close(fd)
    except OSError as exc:
        raise StorageError(f"cannot create {path}: {exc}", exc=exc) from exc
    try:
        conn = sqlite3.connect(
            path, isolation_level=None, check_same_thread=False, timeout=_BUSY_TIMEOUT_MS / 1000
        )
    except sqlite3.Error as exc:
        raise translate(exc, path, "open") from exc
    try:
        conn.create_function("torpor_json", 1, _sql_canonical_json, deterministic=True)
        conn.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = NORMAL")
        _migrate(conn, migrations)
    except sqlite3.Error as exc:
        conn.close()
        raise translate(exc, path, "open") from exc
    return conn


def _split(script: str) -> list[str]:
    statements, buf = [], ""
    for line in script.splitlines(keepends=True):
        buf += line
        if sqlite3.complete_statement(buf):
            statements.append(buf.strip())
            buf = ""
    return [s for s in statements if s.strip(" ;\n")]


def _migrate(conn: sqlite3.Connection, migrations: list[str]) -> None:
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version > len(migrations):
        raise sqlite3.DatabaseError(
            f"schema version {version} is newer than this torpor ({len(migrations)})"
        )
    while version < len(migrations):
        conn.execute("BEGIN IMMEDIATE")
        try:
            # another process may have migrated while we waited for the lock
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version < len(migrations):
                for statement in _split(migrations[version]):
                    conn.execute(statement)
                version += 1
                conn.execute(f"PRAGMA user_version = {version}")
                log.info("memory schema migrated to version %d", version)
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise


class Conn:
    """One connection with a lock, write transactions with retry, and error translation."""

    def __init__(self, path: Path, migrations: list[str]) -> None:
        self.path = path
        self.lock = threading.RLock()
        self.conn: sqlite3.Connection | None = connect(path, migrations)
        self.writes = 0

    def _live(self) -> sqlite3.Connection:
        if self.conn is None:
            raise StorageError(f"memory database {self.path} is closed", path=str(self.path))
        return self.conn

    @contextmanager
    def read(self, what: str) -> Iterator[sqlite3.Connection]:
        with self.lock:
            conn = self._live()
            try:
                yield conn
            except sqlite3.Error as exc:
                raise translate(exc, self.path, what) from exc

    @contextmanager
    def snapshot(self, what: str) -> Iterator[sqlite3.Connection]:
        """As :meth:`read`, in one read transaction: every statement sees the same database
        state, even while another connection (another process) commits writes."""
        with self.read(what) as conn:
            conn.execute("BEGIN")
            try:
                yield conn
            finally:
                conn.execute("COMMIT")  # read only: it ends the transaction, nothing else

    @contextmanager
    def write(self, what: str) -> Iterator[sqlite3.Connection]:
        with self.lock:
            conn = self._live()
            for attempt in range(_BEGIN_RETRIES):
                try:
                    conn.execute("BEGIN IMMEDIATE")
                    break
                except sqlite3.OperationalError as exc:
                    if "locked" not in str(exc) and "busy" not in str(exc):
                        raise translate(exc, self.path, what) from exc
                    if attempt == _BEGIN_RETRIES - 1:
                        raise translate(exc, self.path, what) from exc
                    time.sleep(0.01 * (attempt + 1))
                except sqlite3.Error as exc:
                    raise translate(exc, self.path, what) from exc
            try:
                yield conn
                conn.execute("COMMIT")
            except BaseException as exc:
                try:
                    conn.execute("ROLLBACK")
                except sqlite3.Error:
                    log.warning("rollback failed on %s", self.path, exc_info=True)
                if isinstance(exc, sqlite3.IntegrityError):
                    raise InvalidArgument(f"{what}: {exc}", exc=exc) from exc
                if isinstance(exc, sqlite3.Error):
                    raise translate(exc, self.path, what) from exc
                raise
            self.writes += 1

    def close(self) -> None:
        with self.lock:
            if self.conn is not None:
                self.conn.close()
                self.conn = None
