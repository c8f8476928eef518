"""A node's own part in cluster mode: joining at start, dropping stale directories, draining.

:class:`NodeOperations` is the part of :class:`~torpor.sandbox.manager.SandboxManager` that
speaks for this node of a cluster (``torpor serve --cluster``): the nodes and their load, a
drain that moves every sandbox off this node, and at start the heartbeat, the reconcile of the
sandboxes this node holds and the directories other nodes made stale. The cluster's machinery
itself (leases, placement, pushes) is :mod:`torpor.sandbox.manager.cluster`.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import shutil
import time
from contextlib import suppress
from typing import TYPE_CHECKING

from torpor.config import check_name
from torpor.errors import Conflict, InvalidArgument, TorporError
from torpor.sandbox.manager.cluster import local_status
from torpor.sandbox.manager.recovery import Reconciler
from torpor.sandbox.models import DrainedSandbox, DrainReport, NodeStatus
from torpor.sandbox.models import SandboxState as S

if TYPE_CHECKING:
    from torpor.sandbox.models import SandboxInfo

__all__ = ["DRAIN_SECONDS", "NodeOperations"]

log = logging.getLogger(__name__)

#: cluster mode: seconds a drain waits, by default, for its pauses to become durable
DRAIN_SECONDS = 300.0


class NodeOperations(Reconciler):
    """What this node does as a node of a cluster (see the module); outside a cluster only
    :meth:`nodes` answers (a single row for this machine)."""

    if TYPE_CHECKING:  # SandboxManager's, which a drain pauses with

        async def pause(self, id_or_name: str, *, tenant: str = "default") -> SandboxInfo: ...

    async def nodes(self) -> builtins.list[NodeStatus]:
        """Every node with its health and load; on one machine a single row for it
        (``local``). Raises StorageError."""
        if self.cluster is not None:
            return await asyncio.to_thread(self.cluster.statuses)
        running = self.registry.list(states={S.RUNNING, S.CREATING})
        return [local_status(len(running), sum(r.memory_mib for r in running))]

    async def drain_node(self, name: str, *, timeout: float = DRAIN_SECONDS) -> DrainReport:
        """Drain node ``name``: it takes no new sandbox from now on (until it restarts),
        pauses each sandbox it runs, waits up to ``timeout`` seconds until each pause is
        durable and gives it up (any node wakes it next). Only the node itself can: for
        another live node this raises a Conflict naming it (``owner_url``: the server proxies
        the request there). Raises InvalidArgument (not in cluster mode), NotFound (no such
        node), Conflict (another node; or a node that is not alive: nothing to move, its
        sandboxes are recovered when its lease lapses), StorageError."""
        cluster = self.cluster
        if cluster is None:
            raise InvalidArgument("draining a node needs cluster mode (torpor serve --cluster)")
        check_name(name, "node name")
        if name != cluster.node:
            other = await asyncio.to_thread(cluster.registry.node, name)
            if not other.alive(time.time(), cluster.config.lease_seconds) or not other.url:
                raise Conflict(
                    f"node {name} is not alive: nothing to drain (its sandboxes are recovered "
                    "from their last durable pause when its lease lapses)",
                    node=name,
                )
            raise Conflict(
                f"node {name} drains itself: send the request to {other.url}",
                owner_node=name,
                owner_url=other.url,
            )
        cluster.draining = True
        await asyncio.to_thread(cluster.beat)  # the registry says so before anything moves
        held = await asyncio.to_thread(cluster.registry.owned_by, cluster.node)
        report = DrainReport(node=name)
        errors: dict[str, str] = {}
        pins: dict[str, list[str]] = {}
        for rec in held:
            pinned = await asyncio.to_thread(cluster.pinned_to, rec.id)
            if pinned is not None:  # paused here, but it cannot leave this node
                pins[rec.id] = pinned[1]
                errors[rec.id] = (
                    f"drive {', '.join(pinned[1])} is attached, a directory of this node: "
                    "the sandbox runs only here (detach the drive to move it)"
                )
            if rec.state is S.RUNNING:
                try:
                    await self.pause(rec.id, tenant=rec.tenant)
                except TorporError as exc:
                    errors[rec.id] = str(exc)
        deadline = time.monotonic() + timeout
        for rec in held:
            while rec.id not in errors:
                # the owner first: a release lands after the durable stamp, so a record
                # read after a release already carries it
                owner = await asyncio.to_thread(cluster.registry.owner, rec.id)
                rec = await asyncio.to_thread(self.registry.get, rec.id)
                if owner != cluster.node:
                    break  # released (durable), or taken over
                if rec.state is not S.PAUSED:
                    errors[rec.id] = f"it is {rec.state.value}, not paused"
                elif rec.durable_at is None and not cluster.pushing(rec.id):
                    await self.give_back(rec.id)
                    if rec.upload_error:
                        errors[rec.id] = f"its pause is not durable: {rec.upload_error}"
                if time.monotonic() > deadline:
                    errors[rec.id] = f"its pause was not durable within {timeout:.0f} s" + (
                        f": {rec.upload_error}" if rec.upload_error else ""
                    )
                if rec.id not in errors:
                    await asyncio.sleep(0.1)
            if rec.id in pins:  # paused in place (or why not)
                rec = await asyncio.to_thread(self.registry.get, rec.id)
            info = rec.to_info()
            line = DrainedSandbox(
                id=rec.id,
                name=rec.name,
                tenant=rec.tenant,
                state=rec.state,
                durable=info.durable,
                error=errors.get(rec.id),
                drives=pins.get(rec.id, []),
            )
            (report.failed if rec.id in errors else report.moved).append(line)
        log.info(
            "node %s drained: %d sandboxes moved, %d not",
            name,
            len(report.moved),
            len(report.failed),
        )
        return report

    async def _start_node(self) -> None:
        """Cluster mode: heartbeat (renewing this node's leases first, so no other node
        recovers them meanwhile), reconcile only the sandboxes this node holds, push the
        pauses that are not durable yet, then heartbeat in the background."""
        cluster = self.cluster
        assert cluster is not None
        await asyncio.to_thread(cluster.beat)
        for rec in await asyncio.to_thread(cluster.registry.owned_by, cluster.node):
            try:
                await self._reconcile(rec)
                rec = self.registry.get(rec.id)
                if rec.state is S.PAUSED and rec.durable_at is None:
                    self._paused(rec)
                else:
                    await self.give_back(rec.id)
            except Exception:  # one broken sandbox must not keep the others from starting
                log.exception("reconciling sandbox %s failed", rec.id)
        await asyncio.to_thread(cluster.recover_lapsed)
        await self.drop_stale()
        cluster.start_heartbeat(self.drop_stale)
        log.info("node %s joined the cluster (store %s)", cluster.node, cluster.chunks.location)

    async def drop_stale(self) -> builtins.list[str]:
        """Cluster mode: delete this node's sandbox directories that another node made stale
        (the sandbox woke there since, or was killed); return their ids. A machine still
        running here whose sandbox another node took over (this node was cut off past its
        lease) is stopped first. A failure is logged, not raised."""
        cluster = self.cluster
        dropped: builtins.list[str] = []
        if cluster is None or not self.paths.sandboxes.is_dir():
            return dropped
        for directory in sorted(self.paths.sandboxes.iterdir()):
            sandbox_id = directory.name
            if not directory.is_dir() or not sandbox_id.startswith("sbx-"):
                continue
            live = self.live(sandbox_id)
            if live.lock.locked():
                continue
            try:
                async with live.lock:
                    if live.machine is not None:
                        if not await asyncio.to_thread(cluster.taken_over, sandbox_id):
                            continue
                        # this node outlived its lease (cut off) and another node took the
                        # sandbox over: the copy still running here is stopped
                        log.warning("sandbox %s was taken over: stopping its copy", sandbox_id)
                        await self._quiet_kill(live, directory)
                    if await asyncio.to_thread(cluster.stale, sandbox_id):
                        # a QEMU left from before this node was declared lost runs a machine
                        # another node has taken over: it goes with the files
                        with suppress(TorporError):
                            self.engine.terminate(directory)
                        await asyncio.to_thread(shutil.rmtree, directory, True)
                        dropped.append(sandbox_id)
                        self._lives.pop(sandbox_id, None)
            except TorporError as exc:
                log.warning("cannot tell whether %s is stale: %s", sandbox_id, exc)
        if dropped:
            log.info("dropped %d stale sandbox directories: %s", len(dropped), dropped)
        return dropped
