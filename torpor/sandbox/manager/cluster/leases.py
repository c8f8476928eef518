"""The sandboxes a node holds: taking one (:meth:`Leases.acquire`: placed first, pinned by
a drive, recovered from a lost owner), giving it back (:meth:`Leases.settle`), recovering
those whose owner stopped heartbeating, and telling which local directories went stale.
"""

from __future__ import annotations

import contextlib
import logging
import time

from torpor.errors import Conflict, NoNodeAvailable, SandboxNotFound, TorporError
from torpor.sandbox.manager.cluster.config import PROXIED
from torpor.sandbox.manager.cluster.placement import Placement, compatible
from torpor.sandbox.models import SandboxState as S

__all__ = ["Leases"]

log = logging.getLogger(__name__)


class Leases(Placement):
    """The part of a :class:`~torpor.sandbox.manager.cluster.ClusterNode` that holds
    sandboxes (see the module docstring)."""

    def acquire(self, sandbox_id: str, *, place: bool = True) -> None:
        """Hold ``sandbox_id`` (renewed by the heartbeat). With ``place``, a paused sandbox no
        node holds is first placed (:meth:`place`): when another node should wake it, a
        Conflict names that node (``owner_node``, ``owner_url``, ``placed``). Raises Conflict
        naming the node that holds it (``owner_node``) and its URL (``owner_url``),
        NoNodeAvailable, SandboxNotFound, StorageError."""
        if self._claimed(sandbox_id, place=place):
            return
        self.check_pins(sandbox_id)
        # an owner that stopped heartbeating lost it: fall back to its last durable pause first;
        # the take below judges the lease at the same instant, so a lease running out between
        # the two is not taken over with the sandbox still as its lost owner left it
        now = time.time()
        self.registry.recover(sandbox_id, self.node, at=now)
        if (
            place
            and self.draining
            and self.registry.owner(sandbox_id) == self.node
            and self.registry.get(sandbox_id).state is S.PAUSED  # drained, not durable yet
        ):
            raise Conflict(
                f"node {self.node} is draining: sandbox {sandbox_id} wakes on another node "
                "once its pause is durable (in a few seconds): retry then",
                sandbox_id=sandbox_id,
                node=self.node,
            )
        if place:
            target, why = self.place(sandbox_id)
            if target is not None:
                raise Conflict(
                    f"sandbox {sandbox_id} wakes on node {target.id} ({why}): "
                    f"send the request to {target.url}",
                    sandbox_id=sandbox_id,
                    owner_node=target.id,
                    owner_url=target.url,
                    placed=why,
                )
        try:
            self.registry.acquire(
                sandbox_id,
                self.node,
                lease_seconds=self.config.lease_seconds + (time.time() - now),  # a full lease
                at=now,
            )
        except Conflict as exc:
            owner = str(exc.data.get("owner_node") or "")
            url = ""
            with contextlib.suppress(TorporError):
                url = self.registry.node(owner).url
            raise Conflict(
                f"sandbox {sandbox_id} runs on node {owner}"
                + (f" ({url})" if url else "")
                + ": send the request there",
                sandbox_id=sandbox_id,
                owner_node=owner,
                owner_url=url,
            ) from exc

    def _claimed(self, sandbox_id: str, *, place: bool) -> bool:
        """:meth:`acquire`'s common cases in one query and at most one write: the sandbox is
        this node's already (its lease good for half a lease more: nothing to write), or no
        node holds it and it needs no placement or its placement is this node (its pause
        was made here, this node is not full). False for everything else (another node holds
        it or lapsed, a drive pins it elsewhere, this node drains, placement may name
        another node), which :meth:`acquire` then walks through step by step. Raises
        SandboxNotFound, StorageError."""
        if self.draining or PROXIED.get() is not None:
            return False
        now = time.time()
        facts = self.registry.claim_facts(sandbox_id, self.node, at=now)
        if facts.pinned_elsewhere:
            return False
        mine = facts.owner_node == self.node
        if facts.owner_node is not None and not mine:
            return False
        if mine and (facts.lease_until or 0.0) >= now + self.config.lease_seconds / 2:
            return True  # the heartbeat renews it
        if (
            place
            and facts.owner_node is None
            and facts.state is S.PAUSED
            and facts.manifest_paused_at is not None
            and facts.manifest_paused_at == facts.paused_at
        ):  # placed (:meth:`place`): only its origin node being this one is decided here
            if facts.origin is None:
                return False
            here = self.info()
            full = (
                here.capacity_mib > 0
                and facts.node_memory_mib + facts.memory_mib > here.capacity_mib
            )
            if facts.origin.get("node") != self.node or full or not compatible(here, facts.origin):
                return False
        return self.registry.claim(
            sandbox_id, self.node, lease_seconds=self.config.lease_seconds, at=now
        )

    def settle(self, sandbox_id: str) -> None:
        """Give ``sandbox_id`` back unless this node must keep it: it runs here, or its pause
        is not durable yet. Best effort (logged)."""
        if sandbox_id in self._pushes:
            return
        try:
            rec = self.registry.get(sandbox_id)
            if rec.state in (S.STOPPED, S.ERROR) or (
                rec.state is S.PAUSED and rec.durable_at is not None
            ):
                self.registry.release(sandbox_id, self.node)
        except TorporError as exc:
            log.warning("cannot release %s: %s", sandbox_id, exc)

    def recover_lapsed(self) -> list[str]:
        """Recover every sandbox whose owner's lease lapsed (see
        :meth:`PostgresRegistry.recover`); return the ids this node recovered."""
        lapsed = self.registry.lapsed()
        return [r.id for r in lapsed if self.registry.recover(r.id, self.node) is not None]

    def stale(self, sandbox_id: str) -> bool:
        """Whether this node's directory of ``sandbox_id`` is of no use any more: the sandbox
        was killed; or this node does not hold it and its latest pause is not this node's
        (it woke elsewhere since, or was recovered from the store after this node was lost).
        A sandbox in ``error`` keeps its directory (the disk it kept can still be read).
        Raises StorageError."""
        try:
            rec = self.registry.get(sandbox_id)
        except TorporError:
            return False  # not a sandbox of this cluster: not ours to judge
        if rec.state is S.STOPPED:
            return True
        if rec.state is S.ERROR or self.registry.owner(sandbox_id) == self.node:
            return False
        pause = self.registry.pause_record(sandbox_id)
        return pause is None or pause.node != self.node

    def taken_over(self, sandbox_id: str) -> bool:
        """Whether a machine this node still runs for ``sandbox_id`` is no longer its own:
        the registry names another node as its holder, or none (this node's lease lapsed,
        say it was cut off from PostgreSQL, and another node recovered the sandbox; or it
        was killed). Raises StorageError."""
        try:
            return self.registry.holder(sandbox_id) != self.node
        except SandboxNotFound:
            return False  # not a sandbox of this cluster: not ours to judge

    def pinned_to(self, sandbox_id: str) -> tuple[str, list[str]] | None:
        """The node a drive attached to ``sandbox_id`` is on, with the names of those
        drives (None: no drive pins it). Raises StorageError."""
        pins = [(name, node) for _, name, node in self.registry.drives_of(sandbox_id) if node]
        if not pins:
            return None
        node = pins[0][1]
        return node, [name for name, n in pins if n == node]

    def check_pins(self, sandbox_id: str) -> None:
        """Raise unless this node may run ``sandbox_id``: one with a drive attached runs only
        on the drive's node (a Conflict naming it, ``owner_url``: the server proxies there;
        NoNodeAvailable naming it when it is down: the sandbox waits for it, nothing of it
        is lost). Raises StorageError."""
        pinned = self.pinned_to(sandbox_id)
        if pinned is None or pinned[0] == self.node:
            return
        node, drives = pinned
        nodes, _ = self._live_nodes()
        there = next((n for n in nodes if n.id == node), None)
        if there is None or not there.url:
            raise NoNodeAvailable(
                f"sandbox {sandbox_id} has drive {', '.join(drives)} attached, a directory of "
                f"node {node}, which is down: the sandbox runs only there and waits for it "
                f"(nothing of it is lost); start node {node} again, or detach the drive "
                "there first",
                sandbox_id=sandbox_id,
                node=node,
                drives=drives,
            )
        raise Conflict(
            f"sandbox {sandbox_id} has drive {', '.join(drives)} attached, a directory of "
            f"node {node}: it runs only there; send the request to {there.url}",
            sandbox_id=sandbox_id,
            owner_node=node,
            owner_url=there.url,
            placed=f"drive {', '.join(drives)}",
        )
