"""Where a sandbox runs: which nodes can wake a pause (:func:`compatible`), which one should
(:meth:`Placement.place`: its origin node, else the node asked, else the least loaded), where
a draining node sends a create, where a snapshot is restored, and the nodes' status.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from torpor.errors import Conflict, NoNodeAvailable, StateLost
from torpor.sandbox.manager.cluster.config import PROXIED
from torpor.sandbox.manager.cluster.node import NodeBase
from torpor.sandbox.models import NodeStatus
from torpor.sandbox.models import SandboxState as S
from torpor.sandbox.registry.postgres import NodeInfo
from torpor.sandbox.storage.snapshots import SnapshotInfo

__all__ = ["Placement", "compatible"]


def compatible(node: NodeInfo, origin: dict[str, Any] | None) -> bool:
    """Whether a pause made where ``origin`` says (``{"accelerator", "cpu_model"}``; None: a
    pause that does not say) can wake on ``node``: the same accelerator and, for kvm, the same
    CPU model (a KVM guest's CPU state carries the host CPU's features; under TCG QEMU
    emulates its own CPU)."""
    if not origin:
        return True
    accel = str(origin.get("accelerator") or "")
    if accel and node.accelerator != accel:
        return False
    return accel != "kvm" or node.cpu_model == str(origin.get("cpu_model") or "")


class Placement(NodeBase):
    """The part of a :class:`~torpor.sandbox.manager.cluster.ClusterNode` that picks nodes
    (see the module docstring)."""

    def _live_nodes(self) -> tuple[list[NodeInfo], dict[str, tuple[int, int]]]:
        now = time.time()
        nodes = [
            n if n.id != self.node else replace(n, draining=self.draining)
            for n in self.registry.nodes()
            if n.id == self.node or n.alive(now, self.config.lease_seconds)
        ]
        if not any(n.id == self.node for n in nodes):
            nodes.append(replace(self.info(), heartbeat_at=now))
        return nodes, self.registry.loads(at=now)

    def place(self, sandbox_id: str) -> tuple[NodeInfo | None, str]:
        """Where the paused ``sandbox_id`` should wake (the rule is in the module docstring):
        ``(None, why)`` for this node, else ``(node, why)``. A sandbox that is not paused, is
        held by a node, or whose latest pause is not durable is not placed (None). Raises
        NoNodeAvailable when no live node can wake its pause, SandboxNotFound, StorageError."""
        rec = self.registry.get(sandbox_id)
        if rec.state is not S.PAUSED or self.registry.owner(sandbox_id) is not None:
            return None, "not placed"
        pause = self.registry.pause_record(sandbox_id)
        if pause is None or pause.manifest is None or pause.manifest_paused_at != rec.paused_at:
            return None, "not durable"
        raw = pause.manifest.get("origin")
        origin: dict[str, Any] = dict(raw) if isinstance(raw, dict) else {}
        nodes, loads = self._live_nodes()
        ok = [n for n in nodes if not n.draining and compatible(n, origin)]

        def full(n: NodeInfo) -> bool:
            held = loads.get(n.id, (0, 0))[1]
            return n.capacity_mib > 0 and held + rec.memory_mib > n.capacity_mib

        def share(n: NodeInfo) -> tuple[float, int, str]:
            count, held = loads.get(n.id, (0, 0))
            return (held / n.capacity_mib if n.capacity_mib else float(count), count, n.id)

        here = next((n for n in ok if n.id == self.node), None)
        if PROXIED.get() is not None and here is not None:
            return None, f"sent here by node {PROXIED.get()}"
        if not ok:
            need = str(origin.get("accelerator") or "?")
            if need == "kvm":
                need += f" on a {origin.get('cpu_model')!r} CPU"
            raise NoNodeAvailable(
                f"sandbox {sandbox_id}: no live node that is not draining can wake its pause "
                f"(made on node {origin.get('node') or pause.node or '?'}: it needs {need})",
                sandbox_id=sandbox_id,
                accelerator=origin.get("accelerator"),
                cpu_model=origin.get("cpu_model"),
            )
        reachable = [n for n in ok if n.id == self.node or n.url]
        origin_node = next((n for n in reachable if n.id == origin.get("node")), None)
        if origin_node is not None and not full(origin_node):
            return (None if origin_node.id == self.node else origin_node), "its origin node"
        if here is not None and not full(here):
            return None, "the node that received the request"
        best = min([n for n in reachable if not full(n)] or reachable or ok, key=share)
        return (None if best.id == self.node else best), "the least loaded node"

    def accepting(self) -> None:
        """Raise unless this node takes new sandboxes: a draining node raises a Conflict
        naming the least loaded other live node (``owner_url``: the server proxies the create
        there), or NoNodeAvailable when there is none. Raises StorageError."""
        if not self.draining:
            return
        nodes, loads = self._live_nodes()
        others = [n for n in nodes if n.id != self.node and not n.draining and n.url]
        if not others:
            raise NoNodeAvailable(
                f"node {self.node} is draining and no other live node takes sandboxes",
                node=self.node,
            )
        best = min(
            others,
            key=lambda n: (loads.get(n.id, (0, 0))[1] / max(n.capacity_mib, 1), n.id),
        )
        raise Conflict(
            f"node {self.node} is draining: create the sandbox on node {best.id} ({best.url})",
            owner_node=best.id,
            owner_url=best.url,
            placed="this node is draining",
        )

    def statuses(self) -> list[NodeStatus]:
        """Every node the registry knows, with its health and load. Raises StorageError."""
        now = time.time()
        loads = self.registry.loads(at=now)
        out = []
        for n in self.registry.nodes():
            count, held = loads.get(n.id, (0, 0))
            out.append(
                NodeStatus(
                    name=n.id,
                    url=n.url,
                    alive=n.alive(now, self.config.lease_seconds),
                    draining=self.draining if n.id == self.node else n.draining,
                    heartbeat_age_seconds=round(max(0.0, now - n.heartbeat_at), 3),
                    accelerator=n.accelerator,
                    cpu_model=n.cpu_model,
                    capacity_mib=n.capacity_mib,
                    vcpus=n.vcpus,
                    sandboxes=count,
                    memory_mib=held,
                    this=n.id == self.node,
                )
            )
        return out

    def check_restore(self, info: SnapshotInfo, origin: dict[str, Any]) -> None:
        """Raise unless this node can restore (or fork from) snapshot ``info`` taken where
        ``origin`` says: one not durable yet is only on the node that saved it (a Conflict
        naming it, proxied there; StateLost when that node is gone); one taken on another
        accelerator or, for kvm, another CPU model restores only on a node like it (a
        Conflict naming the least loaded such node, proxied there; NoNodeAvailable when there
        is none). Raises StorageError."""
        nodes, loads = self._live_nodes()
        if info.durable is None and info.node not in (None, self.node):
            holder = next((n for n in nodes if n.id == info.node), None)
            if holder is None or not holder.url:
                raise StateLost(
                    f"snapshot {info.id} ({info.name}) was saved on node {info.node}, which is "
                    "gone, before it was stored off-node: it cannot be restored",
                    snapshot_id=info.id,
                    lost="the snapshot's chunks (on its node only)",
                    node=info.node,
                )
            raise Conflict(
                f"snapshot {info.id} is on node {info.node} only until it is durable (seconds): "
                f"send the request to {holder.url}",
                snapshot_id=info.id,
                owner_node=holder.id,
                owner_url=holder.url,
            )
        here = next(n for n in nodes if n.id == self.node)
        if compatible(here, origin):
            return
        need = str(origin.get("accelerator") or "?")
        if need == "kvm":
            need += f" on a {origin.get('cpu_model')!r} CPU"
        fits = [n for n in nodes if not n.draining and n.url and compatible(n, origin)]
        if not fits or PROXIED.get() is not None:
            raise NoNodeAvailable(
                f"snapshot {info.id} ({info.name}) was taken on node {origin.get('node')} and "
                f"needs {need}; node {self.node} is {here.accelerator} ({here.cpu_model})"
                + ("" if fits else " and no live node is like its origin"),
                snapshot_id=info.id,
                accelerator=origin.get("accelerator"),
                cpu_model=origin.get("cpu_model"),
            )
        best = min(fits, key=lambda n: (loads.get(n.id, (0, 0))[1] / max(n.capacity_mib, 1), n.id))
        raise Conflict(
            f"snapshot {info.id} needs {need}: it is restored on node {best.id} ({best.url})",
            snapshot_id=info.id,
            owner_node=best.id,
            owner_url=best.url,
            placed=f"a node with {need}",
        )
