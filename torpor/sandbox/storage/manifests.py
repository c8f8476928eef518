"""Snapshot manifests: what a stored snapshot's manifest holds and how the store reads them.

A manifest (``snapshots/<id>.json``, or a row of the cluster's registry: see
:mod:`~torpor.sandbox.storage.catalog`) records a snapshot's :class:`SnapshotInfo`, the chunks
of each of its files, the template disk its disk layer rests on, and a digest of its own body.
:class:`ManifestReader` is the reading half of
:class:`~torpor.sandbox.storage.snapshots.SnapshotStore`: it lists only manifests whose digest
checks, finds one by id or name, and pushes or scrubs the chunks they name.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from torpor.config import Paths, Quotas
from torpor.errors import (
    Conflict,
    CorruptData,
    InvalidArgument,
    SnapshotNotFound,
    TemplateNotFound,
)
from torpor.sandbox.requests import MAX_RETENTION_DAYS
from torpor.sandbox.storage.captures import PendingCaptures
from torpor.sandbox.storage.catalog import CatalogEntry, SnapshotCatalog, not_found
from torpor.sandbox.storage.chunks import ChunkStore, FileManifest

__all__ = [
    "FORMAT_VERSION",
    "STATUS_FIELDS",
    "CarriedSettings",
    "ManifestReader",
    "SnapshotInfo",
    "check_retention",
    "dump_info",
    "file_identity",
    "manifest_digest",
    "template_build",
]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1


class CarriedSettings(BaseModel):
    """The settings of the sandbox a snapshot was taken of, which a restore or a fork of the
    snapshot carries over unless the caller gives its own: whose the machine is (labels), when
    it pauses by itself, how long a pause is kept, and the memory its guest reaches."""

    labels: dict[str, str] = Field(default_factory=dict)
    idle_pause_seconds: int | None = None
    pause_retention_days: int | None = None
    #: the memory scope its guest reaches at ``localhost:7777`` (None: none)
    memory_scope: dict[str, Any] | None = None


class SnapshotInfo(BaseModel):
    """What a caller sees of a stored snapshot."""

    id: str
    name: str
    tenant: str = "default"
    sandbox_id: str | None = None
    template: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    retention_days: int = 7
    created_at: datetime
    expires_at: datetime
    #: logical bytes of the captured files, and bytes this snapshot added to the chunk store
    size_bytes: int = 0
    stored_bytes: int = 0
    #: volumes that were attached to the source (not part of the snapshot: see checkpoints)
    volumes: list[dict[str, Any]] = Field(default_factory=list)
    #: drives the source had mounted ({"id", "tenant", "path", "read_only"}): their contents
    #: are not in the snapshot, but a restore mounts them again where they were
    drives: list[dict[str, Any]] = Field(default_factory=list)
    #: the source sandbox's settings, carried over to what is restored or forked from this
    carried: CarriedSettings = Field(default_factory=CarriedSettings)
    #: ``capturing``: frozen on this node and usable (restore, fork), its chunks and manifest
    #: still being written (``stored_bytes`` is 0 until then); ``stored``: in the chunk store
    status: Literal["capturing", "stored"] = "stored"
    #: cluster mode (not in the manifest: the registry's): the node the snapshot was saved on,
    #: when all of it was stored in the shared store (None: not yet, or no cluster), and why
    #: the last push failed (it is retried)
    node: str | None = None
    durable: datetime | None = None
    upload_error: str | None = None

    def expired(self, now: datetime | None = None) -> bool:
        return (now or datetime.now(UTC)) >= self.expires_at


#: the fields of a SnapshotInfo its catalog fills in, never written into a manifest
STATUS_FIELDS = frozenset({"node", "durable", "upload_error"})


def check_retention(days: int, *, what: str = "retention_days") -> int:
    """Return ``days`` if it is an int in 1..:data:`~torpor.sandbox.requests.MAX_RETENTION_DAYS`
    (the store's own guard; requests are checked by their model), else raise InvalidArgument."""
    if isinstance(days, bool) or not isinstance(days, int) or not 1 <= days <= MAX_RETENTION_DAYS:
        raise InvalidArgument(
            f"{what} must be a whole number of days from 1 to {MAX_RETENTION_DAYS}, not {days!r}",
            field=what,
            value=str(days),
        )
    return days


def dump_info(info: SnapshotInfo) -> dict[str, Any]:
    """``info`` as its manifest keeps it (what the catalog says is not written there)."""
    return info.model_dump(mode="json", exclude=set(STATUS_FIELDS))


def template_build(
    paths: Paths, template: str, *, disk: Path | None = None
) -> dict[str, str] | None:
    """The name, build and directory of ``template`` in the home ``paths`` (None: it has no
    ``template.json``, e.g. a test engine's). ``disk``: the template disk a snapshot's disk
    rests on; when it is an older build's (``builds/<id>/``: the template was rebuilt after
    the sandbox was made), that build is the one named, not the current one."""
    template_dir = paths.templates / template
    try:
        body = json.loads((template_dir / "template.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(body, dict):
        return None
    build_id = str(body.get("build_id", ""))
    if disk is not None:
        builds = (template_dir / "builds").resolve()
        within = disk.resolve()
        if within.is_relative_to(builds) and within != builds:  # else a template from before
            build_id = within.relative_to(builds).parts[0]  # builds/: its one build
    return {
        "name": str(body.get("name", template)),
        "build_id": build_id,
        "directory": str(body.get("directory", template_dir)),
    }


def manifest_digest(body: dict[str, Any]) -> str:
    """The sha256 of ``body`` as canonical JSON (what a manifest's ``digest`` is)."""
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def file_identity(path: Path) -> dict[str, Any]:
    """What tells a template disk from a rebuilt one: its path, size and mtime."""
    st = path.stat()
    return {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


class ManifestReader:
    """The reading half of :class:`~torpor.sandbox.storage.snapshots.SnapshotStore`: the
    manifests of its catalog that check, and the capturing snapshots of its pending records."""

    paths: Paths
    chunks: ChunkStore
    catalog: SnapshotCatalog
    captures: PendingCaptures

    @staticmethod
    def _load(entry: CatalogEntry) -> dict[str, Any]:
        """A manifest whose digest checks; raises CorruptData otherwise."""
        sid = entry.id
        try:
            if entry.body is None:
                raise ValueError(entry.error or "unreadable")
            body = dict(entry.body)
            digest = body.pop("digest")
        except (ValueError, KeyError) as exc:
            raise CorruptData(
                f"snapshot manifest {sid}.json is unreadable", exc=exc, snapshot_id=sid
            ) from exc
        if digest != manifest_digest(body) or body.get("version") != FORMAT_VERSION:
            raise CorruptData(f"snapshot {sid}: its manifest fails its digest", snapshot_id=sid)
        return body

    @staticmethod
    def _info(entry: CatalogEntry, body: dict[str, Any]) -> SnapshotInfo:
        info = SnapshotInfo.model_validate(
            {k: v for k, v in body["info"].items() if k not in STATUS_FIELDS}
        )
        if entry.node is None and entry.durable_at is None and entry.upload_error is None:
            return info
        durable = None
        if entry.durable_at is not None:
            durable = datetime.fromtimestamp(entry.durable_at, UTC)
        return info.model_copy(
            update={"node": entry.node, "durable": durable, "upload_error": entry.upload_error}
        )

    def manifests(
        self, snapshot_id: str | None = None
    ) -> Iterator[tuple[SnapshotInfo, dict[str, Any]]]:
        """Every manifest that checks (tenant-blind; for GC), or only ``snapshot_id``'s. Bad
        ones are logged and skipped. Raises StorageError when the catalog cannot be read."""
        entries = sorted(self.catalog.entries(snapshot_id), key=lambda e: e.id)
        for entry in entries:
            try:
                body = self._load(entry)
                yield self._info(entry, body), body
            except (CorruptData, ValueError) as exc:
                log.warning("skipping snapshot manifest %s: %s", entry.id, exc)

    def _all(self) -> Iterator[tuple[SnapshotInfo, dict[str, Any]]]:
        """Stored snapshots, then the capturing ones whose frozen dir is whole (a pending
        record whose manifest exists already is the stored one)."""
        seen: set[str] = set()
        for info, body in self.manifests():
            seen.add(info.id)
            yield info, body
        for sid, body in self.captures.records():
            if sid in seen or self.captures.cached(sid) is None:
                continue
            try:
                yield SnapshotInfo.model_validate(body["info"]), body
            except (KeyError, ValueError) as exc:
                log.warning("skipping pending snapshot %s: %s", sid, exc)

    def list(
        self, *, tenant: str = "default", include_expired: bool = False, now: datetime | None = None
    ) -> list[SnapshotInfo]:
        """The tenant's snapshots whose manifests check, oldest first."""
        found = [
            info
            for info, _ in self._all()
            if info.tenant == tenant and (include_expired or not info.expired(now))
        ]
        return sorted(found, key=lambda i: i.created_at)

    def get(
        self, id_or_name: str, *, tenant: str = "default", include_expired: bool = False
    ) -> SnapshotInfo:
        """One snapshot by id or name. Raises SnapshotNotFound (also for an expired one)."""
        return self._find(id_or_name, tenant, include_expired)[0]

    def origin(self, id_or_name: str, *, tenant: str = "default") -> dict[str, Any]:
        """Where the snapshot was taken (``{"node", "accelerator", "cpu_model"}``; empty for
        one taken outside a cluster). Raises SnapshotNotFound."""
        body = self._find(id_or_name, tenant, False)[1]
        raw = body.get("origin")
        return dict(raw) if isinstance(raw, dict) else {}

    def envs(self, id_or_name: str, *, tenant: str = "default") -> dict[str, str]:
        """The environment variables of the sandbox snapshot ``id_or_name`` was taken of
        (empty for one taken before they were kept). Raises SnapshotNotFound."""
        body = self._find(id_or_name, tenant, False)[1]
        return {str(k): str(v) for k, v in (body.get("envs") or {}).items()}

    def _find(
        self, id_or_name: str, tenant: str, include_expired: bool
    ) -> tuple[SnapshotInfo, dict[str, Any]]:
        found = list(self.manifests(id_or_name)) if id_or_name.startswith("snap-") else []
        for info, body in found or self._all():
            if info.tenant == tenant and id_or_name in (info.id, info.name):
                if info.expired() and not include_expired:
                    raise SnapshotNotFound(
                        f"snapshot {id_or_name!r} expired on {info.expires_at:%Y-%m-%d %H:%M} UTC",
                        kind="snapshot",
                        name=id_or_name,
                        expired=True,
                    )
                return info, body
        raise not_found(id_or_name)

    def cached(self, snapshot_id: str) -> Path | None:
        """The local frozen dir of ``snapshot_id`` if it still holds its RAM, else None."""
        return self.captures.cached(snapshot_id)

    def check_room(self, tenant: str) -> None:
        """Raise QuotaExceeded if ``tenant`` holds its quota of snapshots (expired ones count
        until GC removes them)."""
        held = self.list(tenant=tenant, include_expired=True)
        Quotas.of(self.paths, tenant).check(tenant, "snapshots", len(held))

    def check_name_free(self, name: str, tenant: str, *, exclude: str | None = None) -> None:
        """Raise Conflict if ``tenant`` has a snapshot named ``name`` (expired and capturing
        ones count; ``exclude``: a capture's own pending record)."""
        for info in self.list(tenant=tenant, include_expired=True):
            if info.name == name and info.id != exclude:
                raise Conflict(
                    f"a snapshot named {name!r} already exists ({info.id})",
                    kind="snapshot",
                    name=name,
                    id=info.id,
                )

    def _same_template(
        self, info: SnapshotInfo, body: dict[str, Any]
    ) -> tuple[Path, tuple[str, str]] | None:
        """For a snapshot taken in another home (another node of a cluster): this home's
        template disk directory and (its template directory there, here) when this home has
        the very build the snapshot was taken on; None when the snapshot does not say its
        build. Raises TemplateNotFound when this home lacks that build."""
        wanted = body.get("template")
        if not isinstance(wanted, dict) or not info.template:
            return None
        mine = template_build(self.paths, info.template)
        if mine is None or mine["build_id"] != wanted.get("build_id"):
            raise TemplateNotFound(
                f"snapshot {info.id} was taken on template {info.template!r} build "
                f"{wanted.get('build_id')}; this node has "
                + ("no such template" if mine is None else f"build {mine['build_id']}")
                + ": build the same template here (same name, same build) to restore it",
                kind="template",
                name=info.template,
                build_id=wanted.get("build_id"),
                snapshot_id=info.id,
            )
        disk_dir = (self.paths.templates / info.template / "snapshot").resolve()
        return disk_dir, (str(wanted.get("directory")), str(mine["directory"]))

    def push(self, snapshot_id: str, *, workers: int = 8) -> int:
        """Copy every chunk of the snapshot that the shared store lacks there (cluster mode:
        its chunks were saved on this node, see
        :class:`~torpor.sandbox.storage.tiered.TieredChunkBackend`); each is verified before
        it goes. Returns the bytes uploaded. Idempotent. Raises SnapshotNotFound (deleted
        meanwhile), CorruptData (a local chunk fails its check, naming the snapshot),
        InvalidArgument (the store is not tiered), StorageError."""
        from torpor.sandbox.storage.tiered import TieredChunkBackend

        backend = self.chunks.backend
        if not isinstance(backend, TieredChunkBackend):
            raise InvalidArgument(f"chunks in {self.chunks.location} are not pushed anywhere")
        found = list(self.manifests(snapshot_id))
        if not found:
            raise not_found(snapshot_id)
        digests: set[str] = set()
        for fm in found[0][1]["files"].values():
            digests |= FileManifest.from_json(fm).hashes()

        def one(digest: str) -> int:
            try:
                return backend.push(
                    digest, lambda blob: self.chunks.check(digest, blob, snapshot_id)
                )
            except CorruptData as exc:
                exc.data["snapshot_id"] = snapshot_id
                raise

        with ThreadPoolExecutor(max(1, workers)) as pool:
            sent = sum(pool.map(one, sorted(digests)))
        log.info("pushed snapshot %s: %d chunks, %d bytes sent", snapshot_id, len(digests), sent)
        return sent

    def verify(self) -> dict[str, Any]:
        """Scrub the store: read back every chunk a manifest names, quarantine the bad ones and
        say which snapshots they belong to. A snapshot whose chunks are bad or missing reads
        again once a later snapshot stores the same data (chunks are named by content).

        Returns ``{"chunks": checked, "bad_chunks": [...], "affected": {snapshot_id: [chunk,
        ...]}}``. Raises StorageError when a chunk cannot be read at all."""
        users: dict[str, list[str]] = {}
        for info, body in self.manifests():
            for fm in body["files"].values():
                for digest in FileManifest.from_json(fm).hashes():
                    users.setdefault(digest, []).append(info.id)
        bad = sorted(d for d in users if not self.chunks.verify(d))
        affected: dict[str, list[str]] = {}
        for digest in bad:
            for sid in users[digest]:
                affected.setdefault(sid, []).append(digest)
        if bad:
            log.error("scrub: %d bad chunk(s) in %d snapshot(s)", len(bad), len(affected))
        return {"chunks": len(users), "bad_chunks": bad, "affected": affected}

    def referenced_chunks(self) -> set[str]:
        """Every chunk some manifest names (expired ones included: GC deletes those first)."""
        refs: set[str] = set()
        for _, body in self.manifests():
            for fm in body["files"].values():
                refs |= FileManifest.from_json(fm).hashes()
        return refs
