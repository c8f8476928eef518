"""Chunks in S3-compatible object storage, with a bounded cache on the node's disk.

A store URL ``s3://bucket/prefix`` puts every chunk at ``<prefix>/chunks/<xx>/<hash>.zst`` in
``bucket`` (any S3-compatible server: AWS, SeaweedFS, MinIO, Ceph ...), so every node that
names the same URL shares the chunks, and a snapshot taken on one node restores on another.

* **Idempotent uploads.** A chunk's name is its content's hash: an upload first asks whether
  the object exists and skips it when it does (the common case: siblings of one template share
  most chunks). A PUT is atomic in S3, so an object is whole or absent.
* **A bounded local cache** (:class:`ChunkCache`): blobs read or written on this node, kept
  under the home up to a byte budget, least recently used first out. The cache is never
  trusted: the chunk store verifies every blob it returns, and a bad cached copy is dropped
  and read again from the bucket before the chunk is judged corrupt.
* **Faults.** A request that fails for a reason that can pass (connection refused or reset, a
  timeout, a 5xx, throttling) is retried with backoff (:data:`ATTEMPTS` tries), then raised as
  :class:`~torpor.errors.StorageError` naming the store and the operation; any other refusal
  (no such bucket, access denied, no credentials) is a StorageError at once.

Endpoint and credentials: ``endpoint_url`` when given, else ``$TORPOR_STORE_ENDPOINT``, else
boto3's own chain (``$AWS_ENDPOINT_URL``, ``~/.aws/config``); keys come from boto3's usual
chain (``$AWS_ACCESS_KEY_ID`` ...). boto3 is imported only when an S3 store is opened (the
``cluster`` extra: ``pip install 'torpor[cluster]'``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from torpor.errors import InvalidArgument, StorageError
from torpor.sandbox.storage.chunk_backends import ChunkEntry, check_hash, is_hash

__all__ = [
    "ATTEMPTS",
    "DEFAULT_CACHE_BYTES",
    "ChunkCache",
    "S3ChunkBackend",
    "S3Location",
    "parse_store_url",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: tries of one request before a transient failure becomes a StorageError
ATTEMPTS = 5
#: the first pause between tries, doubled after each
BACKOFF_SECONDS = 0.2
#: default size of a node's chunk cache
DEFAULT_CACHE_BYTES = 2 * 1024**3
#: a temporary file in a node's cache older than this was left by a write a crash cut short
CACHE_LEFTOVER_SECONDS = 3600.0
#: a sweep of a shared store keeps chunks younger than this: another node may be saving a
#: snapshot whose manifest is not written yet
SHARED_SWEEP_GRACE_SECONDS = 3600.0

_RETRY_CODES = frozenset(
    {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "InternalError"}
)


@dataclass(frozen=True)
class S3Location:
    """A parsed ``s3://bucket/prefix``: ``prefix`` is empty or has no slash at either end."""

    bucket: str
    prefix: str

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)


def parse_store_url(url: str) -> S3Location:
    """Parse ``s3://bucket[/prefix]``. Raises InvalidArgument for anything else."""
    parts = urlsplit(url)
    bucket = parts.netloc
    if parts.scheme != "s3" or not bucket or parts.query or parts.fragment:
        raise InvalidArgument(f"not an S3 store URL (s3://bucket/prefix): {url!r}")
    if not (3 <= len(bucket) <= 63) or not all(c.isalnum() or c in ".-" for c in bucket):
        raise InvalidArgument(f"invalid bucket name {bucket!r} in {url!r}")
    prefix = parts.path.strip("/")
    if any(p in {"", ".", ".."} for p in prefix.split("/")) and prefix:
        raise InvalidArgument(f"invalid prefix {prefix!r} in {url!r}")
    return S3Location(bucket=bucket, prefix=prefix)


class ChunkCache:
    """Compressed chunks on local disk, at most ``max_bytes`` of them, least recently used
    evicted first. Thread-safe. A file's mtime is its last use, so the order survives a
    restart. Files are written whole (temporary file, rename) but not fsynced: a torn one
    after a crash fails the store's check and is read again from the bucket."""

    def __init__(self, root: Path, max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        if max_bytes < 0:
            raise InvalidArgument(f"cache size must be >= 0, not {max_bytes}")
        self.root = Path(root)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._sizes: OrderedDict[str, int] = OrderedDict()  # oldest use first
        self.used_bytes = 0
        self._load()

    def _load(self) -> None:
        found: list[tuple[float, str, int]] = []
        if self.root.is_dir():
            # a write a crash cut short (one not older than this may be another process's)
            for f in self.root.glob("*/.*.tmp"):
                try:
                    if time.time() - f.stat().st_mtime > CACHE_LEFTOVER_SECONDS:
                        f.unlink()
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    log.warning("chunk cache %s: cannot remove %s: %s", self.root, f.name, exc)
            for f in self.root.glob("*/*.zst"):
                if is_hash(f.stem):
                    try:
                        st = f.stat()
                    except FileNotFoundError:
                        continue
                    found.append((st.st_mtime, f.stem, st.st_size))
        for _, digest, size in sorted(found):
            self._sizes[digest] = size
            self.used_bytes += size
        self._evict()

    def _path(self, digest: str) -> Path:
        return self.root / digest[:2] / f"{digest}.zst"

    def __contains__(self, digest: object) -> bool:
        with self._lock:
            return digest in self._sizes

    def get(self, digest: str) -> bytes | None:
        """The cached blob (and mark it used), or None."""
        with self._lock:
            if digest not in self._sizes:
                return None
            self._sizes.move_to_end(digest)
        path = self._path(digest)
        try:
            blob = path.read_bytes()
            os.utime(path)
        except OSError:
            self.drop(digest)
            return None
        return blob

    def put(self, digest: str, blob: bytes) -> None:
        """Keep ``blob``, evicting the least recently used ones to stay within the budget.
        A cache that cannot write only logs: it is an optimisation, never a dependency."""
        if len(blob) > self.max_bytes:
            return
        path = self._path(digest)
        tmp = path.with_name(f".{digest}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(blob)
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            log.warning("chunk cache %s: cannot keep %s: %s", self.root, digest[:12], exc)
            return
        with self._lock:
            self.used_bytes += len(blob) - self._sizes.pop(digest, 0)
            self._sizes[digest] = len(blob)
            self._evict()

    def drop(self, digest: str) -> bool:
        """Forget a chunk; True when it was cached."""
        with self._lock:
            size = self._sizes.pop(digest, None)
            if size is not None:
                self.used_bytes -= size
        self._path(digest).unlink(missing_ok=True)
        return size is not None

    def _evict(self) -> None:
        # called with the lock held (or from __init__)
        while self.used_bytes > self.max_bytes and self._sizes:
            digest, size = self._sizes.popitem(last=False)
            self.used_bytes -= size
            self._path(digest).unlink(missing_ok=True)


class S3ChunkBackend:
    """A :class:`~torpor.sandbox.storage.chunk_backends.ChunkBackend` over an S3 bucket; see
    the module docstring. ``client`` is a boto3 S3 client (made from the endpoint and
    boto3's credential chain when omitted); ``cache`` the node's :class:`ChunkCache` (none:
    every read goes to the bucket)."""

    shared = True
    caches = True

    def __init__(
        self,
        url: str,
        *,
        cache: ChunkCache | None = None,
        client: Any = None,
        endpoint_url: str | None = None,
        attempts: int = ATTEMPTS,
        backoff_seconds: float = BACKOFF_SECONDS,
    ) -> None:
        self.where = parse_store_url(url)
        self.location = self.where.url
        self.cache = cache
        self.caches = cache is not None
        self.attempts = max(1, attempts)
        self.backoff_seconds = backoff_seconds
        self.gc_grace_seconds = SHARED_SWEEP_GRACE_SECONDS
        self.client = client if client is not None else _make_client(endpoint_url, self.location)
        #: chunks this process wrote, with when (monotonic), oldest first (see
        #: :meth:`written_recently`)
        self._written: OrderedDict[str, float] = OrderedDict()
        self._written_lock = threading.Lock()

    # -- keys ---------------------------------------------------------------------------------

    def key_of(self, digest: str) -> str:
        """The object key of chunk ``digest``."""
        check_hash(digest)
        return self.where.key("chunks", digest[:2], f"{digest}.zst")

    # -- the backend interface ----------------------------------------------------------------

    def _head(self, digest: str) -> dict[str, Any] | None:
        """The store's HEAD of chunk ``digest`` (None: it has none). Raises StorageError."""
        key = self.key_of(digest)
        head: dict[str, Any] | None = self._call(
            f"check chunk {digest[:12]}",
            lambda: self.client.head_object(Bucket=self.where.bucket, Key=key),
            missing_ok=True,
        )
        return head

    def exists(self, digest: str) -> bool:
        return self._head(digest) is not None

    def read(self, digest: str, *, cached: bool = True) -> bytes | None:
        if self.cache is not None:
            if cached:
                blob = self.cache.get(digest)
                if blob is not None:
                    return blob
            else:
                self.cache.drop(digest)
        key = self.key_of(digest)

        def get() -> bytes:
            body = self.client.get_object(Bucket=self.where.bucket, Key=key)["Body"]
            try:
                data: bytes = body.read()
            finally:
                body.close()
            return data

        blob = self._call(f"read chunk {digest[:12]}", get, missing_ok=True)
        if blob is not None and self.cache is not None:
            self.cache.put(digest, blob)
        return blob

    def write(self, digest: str, blob: bytes) -> int:
        key = self.key_of(digest)
        self._call(
            f"write chunk {digest[:12]}",
            lambda: self.client.put_object(Bucket=self.where.bucket, Key=key, Body=blob),
        )
        if self.cache is not None:  # the node that wrote a chunk is the likeliest to read it
            self.cache.put(digest, blob)
        now = time.monotonic()
        with self._written_lock:
            self._written.pop(digest, None)
            self._written[digest] = now
            while self._written:  # forget what is too old to be trusted anyway
                oldest = next(iter(self._written.values()))
                if now - oldest < self.gc_grace_seconds / 2:
                    break
                self._written.popitem(last=False)
        return len(blob)

    def written_recently(self, digest: str) -> bool:
        """Whether this process wrote chunk ``digest`` less than half the sweep grace ago:
        it is in the store, and a sweep spares it (young) long enough for a manifest naming
        it to be recorded, so a push may skip it without asking. A chunk this node merely
        cached is no proof: a sweep may have removed it from the store since (nothing
        named it)."""
        with self._written_lock:
            at = self._written.get(digest)
        return at is not None and time.monotonic() - at < self.gc_grace_seconds / 2

    def keep(self, digest: str) -> bool:
        """Whether the store has chunk ``digest``, made young as a write would make it when
        it is not (a copy onto itself, nothing sent): a sweep whose marks were read before a
        manifest naming it was recorded may delete an old chunk, never a young one. False
        when the store lacks it."""
        key = self.key_of(digest)
        head = self._head(digest)
        if head is None:
            return False
        written = head.get("LastModified")
        if written is not None and time.time() - written.timestamp() < self.gc_grace_seconds / 2:
            return True
        copied = self._call(
            f"keep chunk {digest[:12]}",
            lambda: self.client.copy_object(
                Bucket=self.where.bucket,
                Key=key,
                CopySource={"Bucket": self.where.bucket, "Key": key},
                MetadataDirective="REPLACE",
            ),
            missing_ok=True,
        )
        return copied is not None  # None: a sweep took it meanwhile

    def _forget(self, digest: str) -> None:
        if self.cache is not None:
            self.cache.drop(digest)
        with self._written_lock:
            self._written.pop(digest, None)

    def delete(self, digest: str, *, before: float | None = None) -> int | None:
        key = self.key_of(digest)
        head = self._head(digest)
        if head is None:
            self._forget(digest)
            return 0
        written = head.get("LastModified")
        if before is not None and written is not None and written.timestamp() >= before:
            return None  # written again since a sweep listed it: a manifest may name it soon
        self._forget(digest)
        self._call(
            f"delete chunk {digest[:12]}",
            lambda: self.client.delete_object(Bucket=self.where.bucket, Key=key),
        )
        return int(head.get("ContentLength", 0))

    def quarantine(self, digest: str, *, cached: bool = True) -> None:
        key = self.key_of(digest)  # the cached copy is dropped either way
        bad = self.where.key("quarantine", f"{digest}.zst")
        self._forget(digest)
        copied = self._call(
            f"quarantine chunk {digest[:12]}",
            lambda: self.client.copy_object(
                Bucket=self.where.bucket,
                Key=bad,
                CopySource={"Bucket": self.where.bucket, "Key": key},
            ),
            missing_ok=True,
        )
        if copied is not None:
            self._call(
                f"quarantine chunk {digest[:12]}",
                lambda: self.client.delete_object(Bucket=self.where.bucket, Key=key),
            )

    def entries(self) -> Iterator[ChunkEntry]:
        prefix = self.where.key("chunks") + "/"
        token: str | None = None
        while True:
            args: dict[str, Any] = {"Bucket": self.where.bucket, "Prefix": prefix}
            if token:
                args["ContinuationToken"] = token
            page: dict[str, Any] = self._call("list chunks", self._lister(args)) or {}
            for obj in page.get("Contents", []):
                rest = obj["Key"][len(prefix) :]
                sub, _, name = rest.partition("/")
                if len(sub) == 2 and name.endswith(".zst") and is_hash(name[:-4]):
                    modified = obj["LastModified"].timestamp()
                    yield ChunkEntry(name[:-4], int(obj["Size"]), modified)
            if not page.get("IsTruncated"):
                return
            token = page.get("NextContinuationToken")

    def _lister(self, args: dict[str, Any]) -> Callable[[], dict[str, Any]]:
        return lambda: dict(self.client.list_objects_v2(**args))

    def sync(self) -> None:
        # a successful PUT is durable in the store: nothing is left to flush
        return None

    # -- requests -----------------------------------------------------------------------------

    def _call(self, what: str, fn: Callable[[], T], *, missing_ok: bool = False) -> T | None:
        """Run one request, retrying transient failures; None for a missing object when
        ``missing_ok``. Raises StorageError."""
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        delay = self.backoff_seconds
        for attempt in range(1, self.attempts + 1):
            try:
                return fn()
            except ClientError as exc:
                error = exc.response.get("Error", {})
                code = str(error.get("Code", ""))
                status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
                not_found = code in {"404", "NoSuchKey", "NotFound"} or status == 404
                if missing_ok and not_found and code != "NoSuchBucket":
                    return None
                transient = status >= 500 or code in _RETRY_CODES
                cause: Exception = exc
                reason = f"{code or status}: {error.get('Message', '')}".rstrip(": ")
            except NoCredentialsError as exc:
                raise StorageError(
                    f"cannot {what} in {self.location}: no S3 credentials "
                    "(set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or ~/.aws/credentials)",
                    exc=exc,
                    store=self.location,
                ) from exc
            except BotoCoreError as exc:  # connection refused or reset, timeouts ...
                transient, cause, reason = True, exc, str(exc)
            if not transient or attempt == self.attempts:
                tries = f" after {attempt} tries" if attempt > 1 else ""
                raise StorageError(
                    f"cannot {what} in {self.location}{tries}: {reason}",
                    exc=cause,
                    store=self.location,
                    attempts=attempt,
                ) from cause
            log.warning(
                "%s in %s failed (%s); retry %d/%d in %.1f s",
                what,
                self.location,
                reason,
                attempt,
                self.attempts - 1,
                delay,
            )
            time.sleep(delay)
            delay *= 2
        raise AssertionError("unreachable")  # the loop returns or raises


def _make_client(endpoint_url: str | None, location: str) -> Any:
    """A boto3 S3 client for the store at ``location``; boto3's own retries are off
    (:meth:`S3ChunkBackend._call` retries, with a log line per retry). Raises StorageError
    when boto3 is not installed or its configuration does not load (a missing profile),
    InvalidArgument for an endpoint or region it refuses."""
    try:
        import boto3
        from botocore.config import Config
        from botocore.exceptions import BotoCoreError
    except ImportError as exc:
        raise StorageError(
            "an s3:// chunk store needs boto3: pip install 'torpor[cluster]'", exc=exc
        ) from exc
    endpoint = endpoint_url or os.environ.get("TORPOR_STORE_ENDPOINT") or None
    config = Config(
        retries={"total_max_attempts": 1},
        connect_timeout=5,
        read_timeout=30,
        max_pool_connections=16,
    )
    try:
        return boto3.client("s3", endpoint_url=endpoint, config=config)
    except ValueError as exc:  # an endpoint without a scheme, a malformed region
        raise InvalidArgument(
            f"cannot open {location}: {exc}", exc=exc, store=location, endpoint=endpoint
        ) from exc
    except BotoCoreError as exc:  # a missing profile, an unreadable ~/.aws/config
        raise StorageError(f"cannot open {location}: {exc}", exc=exc, store=location) from exc
