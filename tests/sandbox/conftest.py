"""Fixtures of the cluster tests without VMs (test_cluster.py, test_nodes.py): a real
PostgreSQL database for the shared registry and a real S3 store (SeaweedFS) for the chunks."""

from __future__ import annotations

import pytest

from tests.pg import PgCluster
from tests.s3 import S3Server
from torpor.sandbox.manager import cluster as cluster_mod


@pytest.fixture
def dsn(pg_cluster: PgCluster, pg_database: str) -> str:
    """A fresh database of the session's PostgreSQL, as its owner."""
    return pg_cluster.admin_dsn(pg_database)


@pytest.fixture
def store(s3_server: S3Server, s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """An ``s3://`` chunk store in a fresh bucket; failed uploads retry after 0.2 s."""
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(cluster_mod, "RETRY_FIRST", 0.2)
    return f"s3://{s3_bucket}/cluster"
