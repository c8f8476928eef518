"""Memory storage backends: :mod:`.sqlite` (embedded, one file per tenant) and
:mod:`.postgres` (PostgreSQL + pgvector, row-level security). Both implement
:class:`~torpor.memory.backends.base.MemoryBackend`."""

from __future__ import annotations

from pathlib import Path
from typing import cast

from torpor.errors import InvalidArgument
from torpor.memory.backends.base import MemoryBackend, RecordFilter, TenantStore

__all__ = ["MemoryBackend", "RecordFilter", "TenantStore", "open_backend"]


def open_backend(spec: str, memory_dir: Path) -> MemoryBackend:
    """Open the backend named by ``spec``: ``"sqlite"`` (files under ``memory_dir``) or a
    PostgreSQL DSN (``postgresql://...``). Raises :class:`InvalidArgument` for anything else."""
    if spec == "sqlite":
        from torpor.memory.backends.sqlite import SQLiteBackend

        return SQLiteBackend(memory_dir)
    if spec.startswith(("postgresql://", "postgres://")):
        import importlib

        module = importlib.import_module("torpor.memory.backends.postgres")
        return cast(MemoryBackend, module.PostgresBackend(spec))
    raise InvalidArgument(f"unknown memory backend {spec!r}: use 'sqlite' or a postgresql:// DSN")
