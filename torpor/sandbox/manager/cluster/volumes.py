"""Volumes and drives in a cluster: their records in the registry (:class:`RegistryRecords`,
under an advisory lock per kind), a volume's image pushed to and pulled from the shared store
(:class:`Volumes`, :class:`ClusterVolumeStore`), a drive kept on its node
(:class:`ClusterDriveStore`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

from torpor.errors import Conflict, CorruptData, NotFound, StateLost, StorageError, TorporError
from torpor.sandbox.manager.cluster.node import NodeBase
from torpor.sandbox.registry.postgres import PostgresRegistry
from torpor.sandbox.requests import VolumeSpec
from torpor.sandbox.storage.chunks import FileManifest
from torpor.sandbox.storage.drives import DriveInfo, DriveStore
from torpor.sandbox.storage.records import LiveIds
from torpor.sandbox.storage.volumes import VolumeInfo, VolumeStore

__all__ = ["RECORD_LOCKS", "ClusterDriveStore", "ClusterVolumeStore", "RegistryRecords", "Volumes"]

log = logging.getLogger(__name__)

#: the advisory locks creates, attaches and deletes of volumes ("tvol") and drives ("tdrv")
#: are made under, across nodes
RECORD_LOCKS = {"volume": 0x74766F6C, "drive": 0x74647276}


class Volumes(NodeBase):
    """The part of a :class:`~torpor.sandbox.manager.cluster.ClusterNode` that moves volume
    images through the shared store, and tells which node has a sandbox a volume is
    attached to (see the module docstring)."""

    def push_volume(self, volume_id: str) -> FileManifest:
        """Store this node's image of ``volume_id`` in the shared store (only the chunks the
        store lacks go up: ``new_bytes`` of the result) and record it as the volume's latest
        image, on this node. Returns its file manifest. Raises VolumeNotFound,
        StorageError."""
        started = time.perf_counter()
        image = self.paths.volumes / f"{volume_id}.img"
        # the recorded image's chunks stay marked until this one replaces it: only they are
        # skipped (one the store merely has may be swept before this image is recorded)
        recorded = self.registry.volume_image(volume_id)
        try:
            known = set() if recorded is None else FileManifest.from_json(recorded).hashes()
        except CorruptData:
            known = set()
        fm = self.chunks.put_file(image, known=known)
        self.chunks.sync_dirs()
        self.registry.record_volume_image(volume_id, self.node, fm.to_json())
        log.info(
            "volume %s pushed to %s (%d new bytes, %.2f s)",
            volume_id,
            self.chunks.location,
            fm.new_bytes,
            time.perf_counter() - started,
        )
        return fm

    def pull_volume(self, volume_id: str, manifest: dict[str, Any] | None = None) -> None:
        """Write ``volume_id``'s image into this node's ``volumes/`` from the shared store:
        ``manifest`` (a pause's copy) or else its latest pushed image (verified; replaced
        atomically). Raises StateLost when it was never pushed, CorruptData, StorageError."""
        started = time.perf_counter()
        if manifest is None:
            manifest = self.registry.volume_image(volume_id)
        if manifest is None:
            raise StateLost(
                f"volume {volume_id} has no image in the shared store",
                volume_id=volume_id,
                lost="the volume's image (on its node only)",
            )
        image = self.paths.volumes / f"{volume_id}.img"
        tmp = image.with_name(f".{image.name}.pull")
        try:
            self.chunks.restore_file(FileManifest.from_json(manifest), tmp)
            os.replace(tmp, image)
        except (KeyError, TypeError, ValueError) as exc:
            tmp.unlink(missing_ok=True)
            raise CorruptData(
                f"volume {volume_id}: its image manifest is unreadable ({exc})",
                volume_id=volume_id,
            ) from exc
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise StorageError(f"cannot write volume {volume_id}: {exc}", exc=exc) from exc
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        log.info(
            "volume %s pulled from %s (%.2f s)",
            volume_id,
            self.chunks.location,
            time.perf_counter() - started,
        )

    def volume_pull_lock(self, volume_id: str) -> threading.Lock:
        """This node's lock for pulling ``volume_id`` (not the cluster-wide volumes' lock)."""
        with self._pull_guard:
            return self._pull_locks.setdefault(volume_id, threading.Lock())

    def holder_node(self, sandbox_id: str) -> str | None:
        """The node running ``sandbox_id`` (its lease), else the one holding its latest
        pause's files. Raises StorageError."""
        owner = self.registry.owner(sandbox_id)
        if owner is not None:
            return owner
        pause = self.registry.pause_record(sandbox_id)
        return None if pause is None else pause.node


class ClusterVolumeStore(VolumeStore):
    """A cluster node's volumes: records in the registry (:class:`RegistryRecords`), images
    in this node's ``volumes/`` and in the shared store.

    A new volume's image is pushed at once, and again whenever its last read-write sandbox
    lets go of it (a detach, a kill) and with every pause of a sandbox that has it attached
    (:meth:`ClusterNode.push`): so a volume no sandbox holds can be attached on any node,
    which pulls its latest image when the one here is not it. A push that fails leaves the
    volume on its node: an attach elsewhere is then a Conflict naming that node. A volume
    attached read-write to a sandbox is a Conflict naming the node that runs (or holds the
    pause of) that sandbox. An attach pulls the image it needs before it takes the volumes'
    lock every node shares (:meth:`_pull_ahead`; a lock per volume on this node instead), so
    no other node's volume operation waits for a transfer."""

    def __init__(self, cluster: Volumes) -> None:
        super().__init__(cluster.paths, RegistryRecords(cluster.registry, "volume", cluster.node))
        self.cluster = cluster

    def create(
        self, spec: VolumeSpec | str | None = None, /, *, tenant: str = "default", **fields: Any
    ) -> VolumeInfo:
        info = super().create(spec, tenant=tenant, **fields)
        self._push(info.id)
        return info

    def _push(self, volume_id: str) -> None:
        try:
            self.cluster.push_volume(volume_id)
        except TorporError as exc:  # it stays on this node until a later push
            log.warning(
                "volume %s: push failed, it stays on node %s: %s", volume_id, self.cluster.node, exc
            )
            with contextlib.suppress(TorporError):
                self.cluster.registry.forget_volume_image(volume_id, self.cluster.node)

    def _pulled(self, volume_id: str, manifest: dict[str, Any]) -> bool:
        """Whether this node's image of ``volume_id`` is the one ``manifest`` describes
        (pulled from it, and no sandbox of this node has written it since: one that did
        holds the volume here, so it is not pulled at all)."""
        return self.image(volume_id).exists() and self.cluster.pulled_volumes.get(
            volume_id
        ) == _manifest_key(manifest)

    def _pull(self, volume_id: str, manifest: dict[str, Any] | None) -> None:
        """Pull ``volume_id``'s image (``manifest``: its latest, None: never pushed) unless
        this node's copy is it already. Raises as :meth:`ClusterNode.pull_volume`."""
        with self.cluster.volume_pull_lock(volume_id):
            if manifest is not None and self._pulled(volume_id, manifest):
                return
            self.cluster.pull_volume(volume_id, manifest)
            if manifest is not None:
                self.cluster.pulled_volumes[volume_id] = _manifest_key(manifest)

    def _pull_ahead(self, id_or_name: str, tenant: str, read_only: bool) -> None:
        """Before the cluster-wide volumes' lock: pull the volume's latest image when the
        attach will need it, so no node's volume create, attach or delete waits for the
        transfer. Under the lock, :meth:`_before_attach` pulls again only if the latest
        image changed meanwhile. Not for an attach the sharing rule refuses as things stand
        (a writer holds it, or this one would write to a volume others read). Best effort:
        what fails here is tried again there."""
        try:
            info = self.get(id_or_name, tenant=tenant)
            if info.node in (None, self.cluster.node) and self.image(info.id).exists():
                return
            if any(not a.read_only for a in info.attachments) or (
                info.attachments and not read_only
            ):
                return
            manifest = self.cluster.registry.volume_image(info.id)
            if manifest is not None:
                self._pull(info.id, manifest)
        except TorporError as exc:
            log.info("volume %s: no pull ahead of the attach: %s", id_or_name, exc)

    def _before_attach(self, info: VolumeInfo, first: bool) -> None:
        here = self.cluster.node
        if info.node not in (None, here) or not self.image(info.id).exists():
            try:
                self._pull(info.id, self.cluster.registry.volume_image(info.id))
            except StateLost as exc:
                raise Conflict(
                    f"volume {info.name!r} ({info.id}) is on node {info.node} only (its latest "
                    "image was never stored off-node): attach it there",
                    kind="volume",
                    id=info.id,
                    node=info.node,
                ) from exc
            if first:
                info.node = here
        elif first:
            info.node = here
        super()._before_attach(info, first)

    def attach(
        self,
        id_or_name: str,
        sandbox_id: str,
        path: str,
        *,
        read_only: bool = False,
        tenant: str = "default",
    ) -> VolumeInfo:
        self._pull_ahead(id_or_name, tenant, read_only)
        try:
            return super().attach(id_or_name, sandbox_id, path, read_only=read_only, tenant=tenant)
        except Conflict as exc:
            holder = exc.data.get("holder")
            if not isinstance(holder, str):
                raise
            node = self.cluster.holder_node(holder)
            if node is None or node == self.cluster.node:
                raise
            url = ""
            with contextlib.suppress(TorporError):
                url = self.cluster.registry.node(node).url
            raise Conflict(
                f"{exc.message} (sandbox {holder} is on node {node}"
                + (f", {url}" if url else "")
                + ")",
                **{**exc.data, "node": node, "node_url": url},
            ) from exc

    def tidy(self) -> list[str]:
        """Delete this node's copies of volume images that are of no use here any more: the
        volume was deleted (from another node), or its latest image is on another node and
        no sandbox of this node (running here, or whose pause is here) has it attached.
        Under the volumes' lock (no create, attach or pull is half done meanwhile). Returns
        the ids dropped. Raises StorageError."""
        dropped = []
        here = self.cluster.node
        with self.records.lock():
            records = {i.id: i for i in self._infos()}
            for image in sorted(self.root.glob("vol-*.img")):
                info = records.get(image.stem)
                if info is not None and (
                    info.node in (None, here)
                    or any(self.cluster.holder_node(a.sandbox_id) == here for a in info.attachments)
                ):
                    continue
                image.unlink(missing_ok=True)
                dropped.append(image.stem)
        for vid in dropped:
            log.info("node %s: dropped its stale copy of volume %s", here, vid)
        return dropped

    def _let_go(self, before: list[VolumeInfo]) -> None:
        """Push the image of every volume here that a read-write sandbox let go of."""
        for info in before:
            if any(not a.read_only for a in info.attachments) and self.image(info.id).exists():
                now = next((v for v in self._infos() if v.id == info.id), None)
                if now is not None and not any(not a.read_only for a in now.attachments):
                    self._push(info.id)

    def detach(self, id_or_name: str, sandbox_id: str, *, tenant: str = "default") -> VolumeInfo:
        before = self.get(id_or_name, tenant=tenant)
        info = super().detach(id_or_name, sandbox_id, tenant=tenant)
        self._let_go([before])
        return info

    def release(self, sandbox_ids: set[str] | None = None, *, keep: LiveIds | None = None) -> int:
        before = [i for i in self._infos() if i.node == self.cluster.node]
        dropped = super().release(sandbox_ids, keep=keep)
        if dropped:
            self._let_go(before)
        return dropped


class ClusterDriveStore(DriveStore):
    """A cluster node's drives: records in the registry (:class:`RegistryRecords`), each
    drive's directory on the node that made it (``node``). A drive is attached only to a
    sandbox on its node (else a Conflict naming the node), and pins that sandbox there
    (:meth:`ClusterNode.check_pins`). A drive is deleted only on its node (its directory is
    there)."""

    def __init__(self, cluster: Volumes) -> None:
        super().__init__(cluster.paths, RegistryRecords(cluster.registry, "drive", cluster.node))
        self.cluster = cluster

    def _elsewhere(self, info: DriveInfo, what: str) -> Conflict:
        url = ""
        with contextlib.suppress(TorporError):
            url = self.cluster.registry.node(str(info.node)).url
        return Conflict(
            f"drive {info.name!r} ({info.id}) is a directory of node {info.node}: {what} "
            + (f"there ({url})" if url else "there"),
            kind="drive",
            id=info.id,
            node=info.node,
            node_url=url,
        )

    def _before_attach(self, info: DriveInfo, first: bool) -> None:
        if info.node not in (None, self.cluster.node):
            raise self._elsewhere(info, "attach it to a sandbox running")
        super()._before_attach(info, first)

    def delete(self, id_or_name: str, *, tenant: str = "default") -> DriveInfo:
        info = self.get(id_or_name, tenant=tenant)
        if info.node not in (None, self.cluster.node) and not info.attachments:
            raise self._elsewhere(info, "delete it")
        return super().delete(id_or_name, tenant=tenant)


class RegistryRecords:
    """Volume or drive records in the cluster's PostgreSQL registry (the
    :class:`~torpor.sandbox.storage.records.RecordMedium` of a cluster node): every node lists,
    gets, attaches and deletes every volume and drive; creates, attaches and deletes are
    serialized across nodes by a PostgreSQL advisory lock per kind. Raises StorageError."""

    shared = True

    def __init__(self, registry: PostgresRegistry, kind: str, node: str) -> None:
        self.registry = registry
        self.kind = kind
        self.node: str | None = node

    def rows(self) -> Iterator[dict[str, Any]]:
        yield from self.registry.record_rows(self.kind)

    def save(self, data: dict[str, Any]) -> None:
        try:
            self.registry.save_record(self.kind, data)
        except Conflict as exc:  # two nodes creating one name at once: the unique index decides
            name = data.get("name")
            raise Conflict(
                f"a {self.kind} named {name!r} already exists", kind=self.kind, name=name
            ) from exc

    def remove(self, rid: str) -> None:
        self.registry.remove_record(self.kind, rid)

    def lock(self) -> contextlib.AbstractContextManager[None]:
        return self.registry.locked(RECORD_LOCKS[self.kind])

    def written_at(self, rid: str) -> float | None:
        return self.registry.record_written_at(self.kind, rid)

    def node_url(self, node: str) -> str | None:
        try:
            return self.registry.node(node).url or None
        except NotFound:
            return None


def _manifest_key(manifest: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()
