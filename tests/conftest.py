"""Shared fixtures.

Tests that boot VMs are marked ``qemu``. They reuse the one ``python`` template that
``scripts/setup`` built into ``$TORPOR_HOME`` (or the default home), and each test gets a
fresh home of its own whose ``templates/`` points at that shared one. A missing template is
a failure with a clear message, never a silent skip (set TORPOR_SKIP_QEMU=1 to skip on purpose).

The real servers, each started once per session on first use and torn down at its end:
tests marked ``postgres`` take ``pg_cluster`` / ``pg_database`` / ``pg_memory_dsn``
(PostgreSQL 18 + pgvector, :mod:`tests.pg`), tests marked ``s3`` take ``s3_server`` /
``s3_bucket`` (SeaweedFS, :mod:`tests.s3`). They are imported here once, so every folder
shares the one server.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.pg import (  # noqa: F401 (fixtures: PostgreSQL + pgvector)
    _pg_memory_database,
    pg_cluster,
    pg_database,
    pg_memory_dsn,
)
from tests.s3 import s3_bucket, s3_server  # noqa: F401 (fixtures: a real S3 server)
from torpor.config import paths


@pytest.fixture(scope="session", autouse=True)
def _onnx_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One exported ONNX query model per test session, not one per test's fresh home (an
    export takes seconds: :mod:`torpor.memory._onnx`)."""
    if os.environ.get("TORPOR_ONNX_CACHE"):
        yield
        return
    os.environ["TORPOR_ONNX_CACHE"] = str(tmp_path_factory.mktemp("onnx"))
    yield
    os.environ.pop("TORPOR_ONNX_CACHE", None)


@pytest.fixture(scope="session")
def template_home() -> Path:
    """The torpor home holding the built ``python`` template."""
    if os.environ.get("TORPOR_SKIP_QEMU") == "1":
        pytest.skip("TORPOR_SKIP_QEMU=1")
    home = paths().home
    if not (home / "templates" / "python" / "template.json").exists():
        pytest.fail(f"no built 'python' template under {home}: run scripts/setup first")
    return home


@pytest.fixture
def qemu_home(template_home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh torpor home for one test that shares the built templates (read-only).

    It lives directly in /tmp, not in pytest's 0700 ``tmp_path``: as root, QEMU runs as an
    unprivileged uid (torpor.sandbox.vm.jail), which must be able to walk down to the home."""
    home = Path(tempfile.mkdtemp(prefix="torpor-home-"))
    (home / "templates").symlink_to(template_home / "templates")
    accel = template_home / "cache" / "accel.json"  # the probe's answer for these templates'
    if accel.is_file():  # kernel (a fresh probe waits up to 20 s for a guest under KVM)
        (home / "cache").mkdir()
        shutil.copy2(accel, home / "cache" / "accel.json")
    monkeypatch.setenv("TORPOR_HOME", str(home))
    yield home
    shutil.rmtree(home, ignore_errors=True)
