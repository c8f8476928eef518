"""Connections for the PostgreSQL backend: ``psycopg_pool`` when installed, else a small pool.

The built-in pool keeps up to ``size`` idle connections and opens more on demand (never
blocking a caller), drops broken ones, and rolls back anything a caller left open. That is all
the backend needs: every operation is one short transaction.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

import psycopg
from psycopg import pq

log = logging.getLogger(__name__)

__all__ = ["Pool", "SimplePool", "make_pool"]

_CONNECT_TIMEOUT = 10


class Pool(Protocol):
    """What the backend uses of a pool (``psycopg_pool.ConnectionPool`` fits)."""

    def connection(self) -> AbstractContextManager[psycopg.Connection[Any]]: ...

    def close(self) -> None: ...


class SimplePool:
    """A thread-safe stack of idle connections (see the module docstring)."""

    def __init__(self, dsn: str, size: int) -> None:
        self.dsn = dsn
        self.size = max(1, size)
        self._idle: list[psycopg.Connection[Any]] = []
        self._lock = threading.Lock()
        self._closed = False

    def _take(self) -> psycopg.Connection[Any]:
        with self._lock:
            if self._closed:
                raise psycopg.OperationalError("connection pool is closed")
            while self._idle:
                conn = self._idle.pop()
                if not conn.closed and not conn.broken:
                    return conn
        return psycopg.connect(self.dsn, connect_timeout=_CONNECT_TIMEOUT)

    def _give(self, conn: psycopg.Connection[Any]) -> None:
        if conn.closed or conn.broken:
            return
        if conn.info.transaction_status != pq.TransactionStatus.IDLE:
            try:
                conn.rollback()
            except psycopg.Error:
                conn.close()
                return
        with self._lock:
            if not self._closed and len(self._idle) < self.size:
                self._idle.append(conn)
                return
        conn.close()

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Any]]:
        """A connection for the length of the ``with`` block (raises ``psycopg.Error``)."""
        conn = self._take()
        try:
            yield conn
        finally:
            self._give(conn)

    def close(self) -> None:
        """Close the idle connections; connections in use close when returned."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


def make_pool(dsn: str, size: int) -> Pool:
    """A ``psycopg_pool.ConnectionPool`` if that package is installed, else a
    :class:`SimplePool`."""
    try:
        from psycopg_pool import ConnectionPool
    except ImportError:
        log.debug("psycopg_pool not installed: using the built-in connection pool")
        return SimplePool(dsn, size)
    # a caller waits at most _CONNECT_TIMEOUT for a free connection, then gets PoolTimeout
    # (a psycopg.OperationalError, so a StorageError to torpor's callers)
    pool: Pool = ConnectionPool(
        dsn,
        min_size=1,
        max_size=max(1, size),
        open=True,
        timeout=_CONNECT_TIMEOUT,
        name="torpor-memory",
        kwargs={"connect_timeout": _CONNECT_TIMEOUT},
    )
    return pool
