"""Durable pauses, the node's side: a paused directory stored in the shared chunk store
(:meth:`Pauses.push`, with where it was made) and rebuilt from its manifest on whichever node
wakes it (:meth:`Pauses.begin_rebuild`: QEMU may start while the RAM is fetched).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from torpor.sandbox.manager.cluster.node import NodeBase
from torpor.sandbox.storage.chunks import PutStats
from torpor.sandbox.storage.pauses import (
    RamFill,
    begin_rebuild,
    manifest_chunks,
    push_pause,
    rebuild_pause,
    warm_template,
)

__all__ = ["Pauses"]

log = logging.getLogger(__name__)


class Pauses(NodeBase):
    """The part of a :class:`~torpor.sandbox.manager.cluster.ClusterNode` that moves pauses
    through the shared store (see the module docstring)."""

    def warm(self) -> None:
        """Hash every template's booted RAM once (pushes and rebuilds compare against it);
        best effort."""
        if not self.paths.templates.is_dir():
            return
        for template_dir in sorted(self.paths.templates.iterdir()):
            try:
                warm_template(template_dir, self.chunks.chunk_size)
            except OSError as exc:
                log.warning("cannot read template %s: %s", template_dir.name, exc)

    def template_dir(self, template: str) -> Path:
        return self.paths.templates / template

    def push(self, directory: Path, template: str, sandbox_id: str) -> dict[str, Any]:
        """Store the paused directory; return its manifest (see :func:`push_pause`), with
        where it was made (``origin``: node, accelerator, CPU model; placement reads it).
        Chunks the sandbox's recorded pause names are not sent again (they stay in the store
        until this manifest replaces that one). Where the time went is kept in
        :attr:`last_push` (the bench prints it). Raises as :func:`push_pause`,
        StorageError."""
        started = time.perf_counter()
        stats = PutStats()
        prior = self.registry.pause_record(sandbox_id)
        known = manifest_chunks(None if prior is None else prior.manifest)
        looked_up = time.perf_counter()
        manifest = push_pause(
            directory,
            self.chunks,
            self.template_dir(template),
            sandbox_id=sandbox_id,
            known=known,
            stats=stats,
        )
        pushed = time.perf_counter()
        info = self.info()
        manifest["origin"] = {
            "node": self.node,
            "accelerator": info.accelerator,
            "cpu_model": info.cpu_model,
        }
        for vid, fm in (manifest.get("volumes") or {}).items():  # their latest images
            self.registry.record_volume_image(vid, self.node, fm)
        while len(self.last_push) >= 256:  # a report per sandbox, of the latest ones
            self.last_push.pop(next(iter(self.last_push)))
        self.last_push[sandbox_id] = {
            "prior manifest": looked_up - started,
            "chunks": pushed - looked_up,
            "volume records": time.perf_counter() - pushed,
            "stats": stats.to_json(),
        }
        return manifest

    def record_durable(self, sandbox_id: str, paused_at: float, manifest: dict[str, Any]) -> None:
        """Record the pause taken at ``paused_at`` as durable, as ``manifest`` says (see
        :meth:`PostgresRegistry.record_durable`). Raises StorageError."""
        started = time.perf_counter()
        self.registry.record_durable(sandbox_id, self.node, paused_at, manifest)
        self.last_push.setdefault(sandbox_id, {})["record"] = time.perf_counter() - started

    def rebuild(
        self, manifest: dict[str, Any], directory: Path, template: str, sandbox_id: str
    ) -> float:
        """Rebuild a paused directory from its manifest (see :func:`rebuild_pause`)."""
        seconds = rebuild_pause(
            manifest,
            directory,
            self.chunks,
            self.template_dir(template),
            sandbox_id=sandbox_id,
            volumes_dir=self.paths.volumes,
        )
        self._volumes_here(manifest)
        return seconds

    def _volumes_here(self, manifest: dict[str, Any]) -> None:
        """Record that the volume images a rebuilt pause carries are on this node now."""
        for vid, fm in (manifest.get("volumes") or {}).items():
            self.registry.record_volume_image(vid, self.node, fm)

    def begin_rebuild(
        self,
        manifest: dict[str, Any],
        directory: Path,
        template: str,
        sandbox_id: str,
        durable: bool = True,
    ) -> RamFill:
        """Rebuild a paused directory but its RAM's content, which the returned job fills
        (see :func:`begin_rebuild`; ``durable=False`` for a wake): QEMU may start
        meanwhile."""
        fill = begin_rebuild(
            manifest,
            directory,
            self.chunks,
            self.template_dir(template),
            sandbox_id=sandbox_id,
            volumes_dir=self.paths.volumes,
            durable=durable,
        )
        self._volumes_here(manifest)
        return fill

    def origin(self) -> dict[str, Any]:
        """What a snapshot or pause taken here records of where it was made."""
        info = self.info()
        return {"node": self.node, "accelerator": info.accelerator, "cpu_model": info.cpu_model}
