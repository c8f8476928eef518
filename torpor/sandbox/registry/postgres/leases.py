"""The cluster's nodes, leases and pauses in the PostgreSQL registry (schema v2, v4, v5).

Each node heartbeats (:meth:`Leases.heartbeat`: its accelerator, CPU model, capacity), which
also renews the leases of the sandboxes it owns. A node takes a sandbox before it runs it
(:meth:`Leases.acquire`, compare-and-set: free, its own, or a lapsed lease) and gives it back
once it is paused (:meth:`Leases.release`). The ``pauses`` table says which node holds a
sandbox's latest pause and which pause is stored off-node; :meth:`Leases.recover` takes a
sandbox from an owner whose lease lapsed back to its last durable pause.
"""

from __future__ import annotations

import builtins
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from torpor.config import check_name
from torpor.errors import (
    Conflict,
    CorruptData,
    InvalidArgument,
    NotFound,
    SandboxNotFound,
    StorageError,
)
from torpor.sandbox.models import SandboxState
from torpor.sandbox.registry.lifecycle import Transition
from torpor.sandbox.registry.postgres.core import PostgresCore
from torpor.sandbox.registry.records import SandboxRecord

__all__ = ["ClaimFacts", "Leases", "NodeInfo", "PauseRecord"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeInfo:
    """One node of a cluster as the registry knows it."""

    id: str
    accelerator: str  # "kvm" or "tcg": a snapshot wakes only where it was taken's kind is
    cpu_model: str
    capacity_mib: int  # guest RAM it may run
    url: str = ""
    started_at: float = 0.0
    heartbeat_at: float = 0.0
    draining: bool = False  # it takes no new sandbox (``torpor node drain``)
    vcpus: int = 0

    def alive(self, now: float, stale_after: float) -> bool:
        """Whether the node heartbeat within ``stale_after`` seconds of ``now``."""
        return now - self.heartbeat_at <= stale_after


@dataclass(frozen=True)
class PauseRecord:
    """What the registry knows of a sandbox's pauses (schema v4): where the latest one's
    files are, and the latest one stored off-node."""

    sandbox_id: str
    node: str | None  # the node holding the latest pause's files (None: no node's)
    paused_at: float | None  # that pause (the sandbox's ``paused_at`` then)
    manifest: dict[str, Any] | None  # the latest durable pause
    manifest_paused_at: float | None
    durable_at: float | None
    upload_error: str | None
    attempts: int


@dataclass(frozen=True)
class ClaimFacts:
    """What a node needs to take a sandbox without a detour, read in one round trip
    (:meth:`PostgresRegistry.claim_facts`): its row's state and owner, whether a drive
    attached pins it to another node, its pause record's where and when (the manifest's
    ``origin`` only), and what the asking node holds running."""

    state: SandboxState
    paused_at: float | None
    memory_mib: int
    owner_node: str | None
    lease_until: float | None
    pinned_elsewhere: bool
    pause_node: str | None
    pause_at: float | None
    manifest_paused_at: float | None
    origin: dict[str, Any] | None
    node_sandboxes: int
    node_memory_mib: int


class Leases(PostgresCore):
    """The registry's nodes, leases, pause records and recovery (see the module docstring)."""

    # -- nodes and leases (schema v2) -----------------------------------------------------

    def heartbeat(self, node: NodeInfo, *, lease_seconds: float, at: float | None = None) -> None:
        """Record that ``node`` is alive (registering it the first time) and renew the leases
        of every sandbox it owns to ``at + lease_seconds``. Raises InvalidArgument for a bad
        node, StorageError."""
        check_name(node.id, "node name")
        if node.capacity_mib < 0 or lease_seconds <= 0:
            raise InvalidArgument("capacity must be >= 0 and the lease > 0")
        now = time.time() if at is None else at
        with self._tx() as db:
            db.execute(
                "INSERT INTO torpor_registry.nodes (id, url, accelerator, cpu_model,"
                " capacity_mib, started_at, heartbeat_at, draining, vcpus)"
                " VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s) ON CONFLICT (id) DO UPDATE SET"
                " url = excluded.url, accelerator = excluded.accelerator,"
                " cpu_model = excluded.cpu_model, capacity_mib = excluded.capacity_mib,"
                " heartbeat_at = excluded.heartbeat_at, draining = excluded.draining,"
                " vcpus = excluded.vcpus",
                (
                    node.id,
                    node.url,
                    node.accelerator,
                    node.cpu_model,
                    node.capacity_mib,
                    node.started_at or now,
                    now,
                    node.draining,
                    node.vcpus,
                ),
            )
            db.execute(
                "UPDATE torpor_registry.sandboxes SET lease_until = %s WHERE owner_node = %s",
                (now + lease_seconds, node.id),
            )

    def nodes(self) -> builtins.list[NodeInfo]:
        """Every node that ever heartbeat, by name."""
        rows = self._query(
            "SELECT id, accelerator, cpu_model, capacity_mib, url, started_at, heartbeat_at,"
            " draining, vcpus FROM torpor_registry.nodes ORDER BY id"
        )
        return [NodeInfo(*row) for row in rows]

    def loads(self, *, at: float | None = None) -> dict[str, tuple[int, int]]:
        """node -> (sandboxes it runs, their RAM in MiB): the running or starting sandboxes
        each node holds with a lease still running. Raises StorageError."""
        now = time.time() if at is None else at
        rows = self._query(
            "SELECT owner_node, count(*),"
            " coalesce(sum(coalesce((spec::json->>'memory_mib')::int, 512)), 0)"
            " FROM torpor_registry.sandboxes WHERE owner_node IS NOT NULL"
            " AND lease_until >= %s AND state IN ('running', 'creating') GROUP BY owner_node",
            (now,),
        )
        return {str(node): (int(count), int(mib)) for node, count, mib in rows}

    def acquire(
        self, sandbox_id: str, node_id: str, *, lease_seconds: float, at: float | None = None
    ) -> None:
        """Make ``node_id`` the owner of ``sandbox_id`` until ``at + lease_seconds``: when it
        has no owner, is this node's already, or its owner's lease lapsed (compare-and-set, so
        of two nodes racing exactly one gets it). Raises Conflict naming the owner
        (``owner_node``) otherwise, SandboxNotFound, StorageError."""
        now = time.time() if at is None else at
        with self._tx() as db:
            cur = db.execute(
                "UPDATE torpor_registry.sandboxes SET owner_node = %s, lease_until = %s"
                " WHERE id = %s AND (owner_node IS NULL OR owner_node = %s OR lease_until < %s)",
                (node_id, now + lease_seconds, sandbox_id, node_id, now),
            )
            if cur.rowcount == 1:
                return
            row = db.execute(
                "SELECT owner_node, lease_until FROM torpor_registry.sandboxes WHERE id = %s",
                (sandbox_id,),
            ).fetchone()
        if row is None:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r}", kind="sandbox", name=sandbox_id)
        raise Conflict(
            f"sandbox {sandbox_id} is held by node {row[0]} (lease until {row[1]:.0f})",
            sandbox_id=sandbox_id,
            owner_node=row[0],
            lease_until=row[1],
        )

    def claim_facts(self, sandbox_id: str, node_id: str, *, at: float | None = None) -> ClaimFacts:
        """Everything :meth:`~torpor.sandbox.manager.cluster.ClusterNode.acquire` reads to
        take ``sandbox_id`` for ``node_id`` in the common case, in one query (see
        :class:`ClaimFacts`). Raises SandboxNotFound, StorageError."""
        now = time.time() if at is None else at
        rows = self._query(
            "SELECT s.state, s.paused_at, coalesce((s.spec::json->>'memory_mib')::int, 512),"
            " s.owner_node, s.lease_until,"
            " EXISTS (SELECT 1 FROM torpor_registry.drives d WHERE d.node IS NOT NULL"
            " AND d.node <> %s AND d.record::jsonb -> 'attachments' @> jsonb_build_array("
            "jsonb_build_object('sandbox_id', s.id))),"
            " p.pause_node, p.pause_at, p.manifest_paused_at,"
            " CASE WHEN p.manifest IS NULL THEN NULL ELSE (p.manifest::json->'origin')::text END,"
            " l.n, l.mib"
            " FROM torpor_registry.sandboxes s"
            " LEFT JOIN torpor_registry.pauses p ON p.sandbox_id = s.id"
            " CROSS JOIN (SELECT count(*) AS n,"
            " coalesce(sum(coalesce((spec::json->>'memory_mib')::int, 512)), 0) AS mib"
            " FROM torpor_registry.sandboxes WHERE owner_node = %s AND lease_until >= %s"
            " AND state IN ('running', 'creating')) l"
            " WHERE s.id = %s",
            (node_id, node_id, now, sandbox_id),
        )
        if not rows:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r}", kind="sandbox", name=sandbox_id)
        r = rows[0]
        try:
            origin = None if r[9] is None else json.loads(r[9])
        except ValueError:
            origin = None
        return ClaimFacts(
            state=SandboxState(r[0]),
            paused_at=r[1],
            memory_mib=int(r[2]),
            owner_node=r[3],
            lease_until=r[4],
            pinned_elsewhere=bool(r[5]),
            pause_node=r[6],
            pause_at=r[7],
            manifest_paused_at=r[8],
            origin=origin if isinstance(origin, dict) else None,
            node_sandboxes=int(r[10]),
            node_memory_mib=int(r[11]),
        )

    def claim(
        self, sandbox_id: str, node_id: str, *, lease_seconds: float, at: float | None = None
    ) -> bool:
        """Make ``node_id`` the owner of ``sandbox_id`` until ``at + lease_seconds`` when no
        node holds it or ``node_id`` does (one statement); False otherwise (another node
        holds it, or held it and lapsed: :meth:`recover` and :meth:`acquire` are for
        that). Raises StorageError."""
        now = time.time() if at is None else at
        with self._lock:
            import psycopg

            try:
                cur = self._connection().execute(
                    b"UPDATE torpor_registry.sandboxes SET owner_node = %s, lease_until = %s"
                    b" WHERE id = %s AND (owner_node IS NULL OR owner_node = %s)",
                    (node_id, now + lease_seconds, sandbox_id, node_id),
                )
            except psycopg.Error as exc:
                raise StorageError(f"registry error: {exc}", exc=exc) from exc
            return bool(cur.rowcount == 1)

    def pause_location(self, sandbox_id: str) -> tuple[str | None, float | None] | None:
        """The node holding the files of the sandbox's latest pause and that pause's time
        (None: it was never paused in cluster mode): :meth:`pause_record` without the
        manifest. Raises StorageError."""
        rows = self._query(
            "SELECT pause_node, pause_at FROM torpor_registry.pauses WHERE sandbox_id = %s",
            (sandbox_id,),
        )
        return None if not rows else (rows[0][0], rows[0][1])

    def release(self, sandbox_id: str, node_id: str) -> bool:
        """Give ``sandbox_id`` up (after its pause is durable). True when ``node_id`` held it;
        False when it did not (another node took it over: nothing to give). Raises
        StorageError."""
        with self._tx() as db:
            cur = db.execute(
                "UPDATE torpor_registry.sandboxes SET owner_node = NULL, lease_until = NULL"
                " WHERE id = %s AND owner_node = %s",
                (sandbox_id, node_id),
            )
            return bool(cur.rowcount == 1)

    def owner(self, sandbox_id: str, *, at: float | None = None) -> str | None:
        """The node holding ``sandbox_id`` with a lease still running, or None. Raises
        SandboxNotFound, StorageError."""
        now = time.time() if at is None else at
        rows = self._query(
            "SELECT owner_node, lease_until FROM torpor_registry.sandboxes WHERE id = %s",
            (sandbox_id,),
        )
        if not rows:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r}", kind="sandbox", name=sandbox_id)
        owner, until = rows[0]
        return str(owner) if owner is not None and until is not None and until >= now else None

    def holder(self, sandbox_id: str) -> str | None:
        """The node the row names as holding ``sandbox_id``, whatever its lease (None: no
        node; a lapsed lease is still its holder's until another node recovers it). Raises
        SandboxNotFound, StorageError."""
        rows = self._query(
            "SELECT owner_node FROM torpor_registry.sandboxes WHERE id = %s", (sandbox_id,)
        )
        if not rows:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r}", kind="sandbox", name=sandbox_id)
        return None if rows[0][0] is None else str(rows[0][0])

    def lapsed(self, *, at: float | None = None) -> builtins.list[SandboxRecord]:
        """Sandboxes whose owner's lease ran out (the owner stopped heartbeating): another
        node must recover them. Raises StorageError."""
        now = time.time() if at is None else at
        rows = self._query(
            self._select() + " WHERE s.owner_node IS NOT NULL AND s.lease_until < %s"
            " ORDER BY s.created_at, s.id",
            (now,),
        )
        return [self._record(r) for r in rows]

    def node(self, node_id: str) -> NodeInfo:
        """One node. Raises NotFound, StorageError."""
        for n in self.nodes():
            if n.id == node_id:
                return n
        raise NotFound(f"no node {node_id!r}", kind="node", name=node_id)

    # -- pause manifests (schema v4) ------------------------------------------------------

    def note_pause(self, sandbox_id: str, node: str, paused_at: float) -> None:
        """Record that ``node`` holds the files of the pause taken at ``paused_at`` (not yet
        durable: :meth:`record_durable` follows once the upload is done). Raises
        StorageError."""
        with self._tx() as db:
            db.execute(
                "INSERT INTO torpor_registry.pauses (sandbox_id, pause_node, pause_at)"
                " VALUES (%s,%s,%s) ON CONFLICT (sandbox_id) DO UPDATE SET"
                " pause_node = excluded.pause_node, pause_at = excluded.pause_at,"
                " upload_error = NULL, attempts = 0",
                (sandbox_id, node, paused_at),
            )

    def record_durable(
        self, sandbox_id: str, node: str, paused_at: float, manifest: Mapping[str, Any]
    ) -> float:
        """Record that the pause ``node`` took at ``paused_at`` is stored off-node, as
        ``manifest`` says, and in the same transaction give the sandbox up if ``node`` holds
        it and it is still in that pause (any node may wake it from now on: no moment in
        which it is durable yet held); return when (now). Raises StorageError, Conflict when
        the pause is no longer the sandbox's: another node holds it (its lease lapsed during
        the upload and it was taken over), or it was paused again since (the late record
        would have made the next wake rebuild a lost pause over the newer one)."""
        now = time.time()
        with self._tx() as db:
            row = db.execute(
                "SELECT state, owner_node, paused_at FROM torpor_registry.sandboxes"
                " WHERE id = %s FOR UPDATE",
                (sandbox_id,),
            ).fetchone()
            if row is not None:
                state, owner, latest = SandboxState(row[0]), row[1], row[2]
                newer = state is SandboxState.PAUSED and latest is not None and latest != paused_at
                if (owner is not None and owner != node) or newer:
                    raise Conflict(
                        f"sandbox {sandbox_id}: the pause node {node} took at {paused_at} is no "
                        f"longer its latest (held by {owner}, {state.value} at {latest})",
                        sandbox_id=sandbox_id,
                    )
            db.execute(
                "INSERT INTO torpor_registry.pauses (sandbox_id, pause_node, pause_at, manifest,"
                " manifest_paused_at, durable_at) VALUES (%s,%s,%s,%s,%s,%s)"
                " ON CONFLICT (sandbox_id) DO UPDATE SET pause_node = excluded.pause_node,"
                " pause_at = excluded.pause_at, manifest = excluded.manifest,"
                " manifest_paused_at = excluded.manifest_paused_at,"
                " durable_at = excluded.durable_at, upload_error = NULL",
                (
                    sandbox_id,
                    node,
                    paused_at,
                    json.dumps(dict(manifest), sort_keys=True),
                    paused_at,
                    now,
                ),
            )
            db.execute(
                "UPDATE torpor_registry.sandboxes SET owner_node = NULL, lease_until = NULL"
                " WHERE id = %s AND owner_node = %s AND state = 'paused' AND paused_at = %s",
                (sandbox_id, node, paused_at),
            )
        return now

    def record_upload_error(self, sandbox_id: str, error: str) -> None:
        """Say why the current pause's upload failed (it is retried). Raises StorageError."""
        with self._tx() as db:
            db.execute(
                "INSERT INTO torpor_registry.pauses (sandbox_id, upload_error, attempts)"
                " VALUES (%s,%s,1) ON CONFLICT (sandbox_id) DO UPDATE SET"
                " upload_error = excluded.upload_error, attempts = pauses.attempts + 1",
                (sandbox_id, error[:2000]),
            )

    def pause_record(self, sandbox_id: str) -> PauseRecord | None:
        """The sandbox's pause record, or None when it was never paused in cluster mode.
        Raises CorruptData for a manifest that does not parse, StorageError."""
        rows = self._query(
            "SELECT pause_node, pause_at, manifest, manifest_paused_at, durable_at,"
            " upload_error, attempts FROM torpor_registry.pauses WHERE sandbox_id = %s",
            (sandbox_id,),
        )
        if not rows:
            return None
        node, at, text, mat, durable, error, attempts = rows[0]
        try:
            manifest = None if text is None else dict(json.loads(text))
        except (TypeError, ValueError) as exc:
            raise CorruptData(
                f"sandbox {sandbox_id}: its pause manifest in the registry is unreadable ({exc})",
                sandbox_id=sandbox_id,
            ) from exc
        return PauseRecord(sandbox_id, node, at, manifest, mat, durable, error, attempts)

    def recover(self, sandbox_id: str, node: str, *, at: float | None = None) -> Transition | None:
        """Take over ``sandbox_id`` from an owner whose lease lapsed (it stopped
        heartbeating: its machine and local files count as gone), on behalf of ``node``.

        One transaction, compare-and-set on the lapsed lease, so of many nodes recovering at
        once exactly one does it (the others get None). A sandbox with a drive attached is
        never taken (a drive is a directory of its node: the sandbox waits for that node,
        nothing of it is lost; None). A sandbox with a durable pause goes
        to ``paused`` at that pause (what changed since is lost, and the transition's reason
        says so); one without goes to ``error`` (its error says what was lost). The owner is
        cleared: the sandbox wakes on whichever node asks next. Returns the transition
        recorded (None: nothing to do, or another node did it). Raises StorageError."""
        now = time.time() if at is None else at
        with self._tx() as db:
            row = db.execute(
                "SELECT state, owner_node, paused_at FROM torpor_registry.sandboxes"
                " WHERE id = %s AND owner_node IS NOT NULL AND owner_node <> %s"
                # FOR UPDATE (not SKIP LOCKED): a node that races another's recovery waits
                # for it and then finds the sandbox recovered, so its acquire that follows
                # never takes over a lapsed lease of a sandbox still marked as running
                " AND lease_until < %s"
                # a drive pins its sandbox to the drive's node: it waits for that node
                " AND NOT EXISTS (SELECT 1 FROM torpor_registry.drives d WHERE"
                " d.record::jsonb -> 'attachments' @> jsonb_build_array("
                "jsonb_build_object('sandbox_id', %s::text))) FOR UPDATE",
                (sandbox_id, node, now, sandbox_id),
            ).fetchone()
            if row is None:
                return None
            state, owner, paused_at = SandboxState(row[0]), row[1], row[2]
            pause = db.execute(
                "SELECT manifest_paused_at, durable_at FROM torpor_registry.pauses"
                " WHERE sandbox_id = %s AND manifest IS NOT NULL",
                (sandbox_id,),
            ).fetchone()
            release = "UPDATE torpor_registry.sandboxes SET owner_node = NULL, lease_until = NULL"
            if state in (SandboxState.STOPPED, SandboxState.ERROR) or (
                state is SandboxState.PAUSED and pause is not None and pause[0] == paused_at
            ):  # nothing was lost: only the lease goes
                db.execute(release + " WHERE id = %s", (sandbox_id,))
                return None
            if pause is not None:
                dst = SandboxState.PAUSED
                reason = (
                    f"node {owner} lost (its lease lapsed); recovered by {node} to its last "
                    f"durable pause of {_iso(pause[0])}: RAM, processes and disk changes since "
                    "then are lost"
                )
                db.execute(
                    release + ", state = %s, paused_at = %s, error = NULL WHERE id = %s",
                    (dst.value, pause[0], sandbox_id),
                )
                db.execute(
                    "UPDATE torpor_registry.pauses SET pause_node = NULL, pause_at = %s,"
                    " upload_error = NULL WHERE sandbox_id = %s",
                    (pause[0], sandbox_id),
                )
            else:
                dst = SandboxState.ERROR
                reason = (
                    f"node {owner} lost (its lease lapsed) while the sandbox was "
                    f"{state.value}, and it had no durable pause: recovered by {node} as lost"
                )
                db.execute(
                    release + ", state = %s, error = %s WHERE id = %s",
                    (
                        dst.value,
                        f"RAM, processes and disk: node {owner} was lost before any pause of "
                        "this sandbox was stored off-node",
                        sandbox_id,
                    ),
                )
            self._log_transition(db, sandbox_id, state, dst, now, reason)
        self.generation += 1
        log.warning("sandbox %s: %s", sandbox_id, reason)
        return Transition(sandbox_id, state, dst, now, reason)

    def owned_by(self, node_id: str) -> builtins.list[SandboxRecord]:
        """Sandboxes ``node_id`` holds (whatever its lease), oldest first. Raises
        StorageError."""
        rows = self._query(
            self._select() + " WHERE s.owner_node = %s ORDER BY s.created_at, s.id", (node_id,)
        )
        return [self._record(r) for r in rows]


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=UTC).isoformat(timespec="seconds")
