"""The sandbox registry on PostgreSQL: the same interface as the SQLite
:class:`~torpor.sandbox.registry.Registry`, for many nodes sharing one registry.

Tables live in their own schema, ``torpor_registry`` (the memory store's is ``torpor``, so both
can share one database): ``sandboxes`` (one row per sandbox, the same columns as SQLite's),
``transitions`` (the append-only log) and ``schema_version``. A state change and its log entry
are one transaction, compare-and-set on the old state (``UPDATE ... WHERE state = old``), so
two nodes racing to move one sandbox cannot both win: the loser gets InvalidState. Names are
unique per tenant among sandboxes that are not stopped (a partial unique index).

Migrations are versioned (``schema_version``), each step in one transaction under an advisory
lock, so two nodes starting at once migrate once. A database newer than this torpor is refused.

A dropped connection (PostgreSQL restarted) is reopened on the next call; a call that fails
that way raises StorageError and may be retried. psycopg is imported only when this registry is
opened (the ``postgres`` extra).

The modules: :mod:`.core` (the connection, transactions and migrations; the statements on
sandboxes, transitions and usage are SQLite's, :class:`~torpor.sandbox.registry.base.SqlRegistry`),
:mod:`.schema` (one script per version), :mod:`.leases` (nodes, leases, pauses, recovery) and
:mod:`.shared` (snapshot manifests, volumes and drives, sweeps).

**Nodes and leases** (schema v2, PostgreSQL only: one machine needs neither). Each node
heartbeats (:meth:`PostgresRegistry.heartbeat`: its accelerator, CPU model, capacity), which
also renews the leases of the sandboxes it owns. A node takes a sandbox before it runs it
(:meth:`PostgresRegistry.acquire`, compare-and-set: free, its own, or a lapsed lease) and gives
it back once it is paused (:meth:`PostgresRegistry.release`); another node asking gets Conflict
naming the owner (to proxy to). :meth:`PostgresRegistry.lapsed` lists the sandboxes whose
owner stopped heartbeating, for another node to recover.

**Snapshot manifests** (schema v3): :meth:`PostgresRegistry.put_snapshot` keeps the manifest a
:class:`~torpor.sandbox.storage.snapshots.SnapshotStore` writes, so every node sees every
snapshot, and :meth:`PostgresRegistry.referenced_chunks` is the mark set of a sweep of the
shared chunk store (:func:`~torpor.sandbox.storage.retention.sweep_shared_store`).

**Pause manifests** (schema v4, ``pauses``): which node holds a sandbox's latest pause
(:meth:`PostgresRegistry.note_pause`) and the latest pause stored off-node
(:meth:`PostgresRegistry.record_durable`; a failed upload says why:
:meth:`PostgresRegistry.record_upload_error`). A sandbox row read from here carries
``durable_at`` when its current pause is the durable one. :meth:`PostgresRegistry.recover`
takes a sandbox from an owner whose lease lapsed, in one compare-and-set transaction: back to
its last durable pause (what changed since is lost, and the transition says so), else to
``error``. The manager's use of all this: :mod:`torpor.sandbox.manager.cluster`.

**Durable snapshots** (schema v6): a snapshot row also says which node saved it and when all
its chunks were pushed to the shared store (``durable_at``; ``upload_error`` while a push
fails): :meth:`PostgresRegistry.record_snapshot_durable`,
:meth:`PostgresRegistry.undurable_snapshots` (what a node resumes pushing).

**Sweeps of the shared store** (schema v7): :meth:`PostgresRegistry.exclusive` (a session
advisory lock on a connection of its own) and the ``sweeps`` log say which node swept when
(:meth:`~torpor.sandbox.manager.cluster.ClusterNode.sweep_if_due`).

**Usage** (schema v8): the same cumulative meters on each transition row and the same ledger
of stored things as SQLite's schema 2 (:mod:`torpor.sandbox.registry.meters`), so a usage
report reads the same on both. Transitions recorded before v8 carry zero meters.

**Volumes and drives** (schema v9, ``volumes`` and ``drives``): their records (the JSON a
:class:`~torpor.sandbox.storage.records.RecordStore` writes) with the columns a query needs:
tenant, name (unique in the tenant), labels, the sandbox holding a volume, the node its data is
on, and for a volume the manifest of its latest image pushed to the shared store
(:meth:`PostgresRegistry.record_volume_image`). :meth:`PostgresRegistry.record_rows`,
:meth:`PostgresRegistry.save_record`, :meth:`PostgresRegistry.remove_record`,
:meth:`PostgresRegistry.locked` (a blocking advisory lock) are what
:class:`~torpor.sandbox.manager.cluster.RegistryRecords` runs on.
"""

from __future__ import annotations

from torpor.sandbox.registry.postgres.leases import ClaimFacts, Leases, NodeInfo, PauseRecord
from torpor.sandbox.registry.postgres.schema import PG_SCHEMA_VERSION
from torpor.sandbox.registry.postgres.shared import SharedTables, SnapshotStatus

__all__ = [
    "PG_SCHEMA_VERSION",
    "ClaimFacts",
    "NodeInfo",
    "PauseRecord",
    "PostgresRegistry",
    "SnapshotStatus",
]


class PostgresRegistry(Leases, SharedTables):
    """The registry of sandboxes in PostgreSQL at ``dsn``; see the module docstring.
    Thread-safe (one connection behind a lock, reopened when it drops).

    Every method raises :class:`~torpor.errors.StorageError` when PostgreSQL fails; lookups
    raise :class:`~torpor.errors.SandboxNotFound`; a taken name raises
    :class:`~torpor.errors.Conflict`.
    """
