"""The PostgreSQL registry's schema, ``torpor_registry``: one script per version.

Each step runs in one transaction under an advisory lock (:data:`MIGRATION_LOCK`), so two nodes
starting at once migrate once (see :class:`~torpor.sandbox.registry.postgres.core.PostgresCore`).
"""

from __future__ import annotations

__all__ = ["BOOTSTRAP", "MIGRATIONS", "MIGRATION_LOCK", "PG_SCHEMA_VERSION", "RECORD_TABLES"]

PG_SCHEMA_VERSION = 9
MIGRATION_LOCK = 0x70726567  # "preg": the advisory lock migrations take

BOOTSTRAP = """
CREATE SCHEMA IF NOT EXISTS torpor_registry;
CREATE TABLE IF NOT EXISTS torpor_registry.schema_version (
    version     INTEGER PRIMARY KEY,
    applied_at  TIMESTAMPTZ NOT NULL DEFAULT now()
);
"""

_SCHEMA_V1 = """
CREATE TABLE torpor_registry.sandboxes (
    id                   TEXT PRIMARY KEY,
    tenant               TEXT NOT NULL,
    name                 TEXT NOT NULL,
    template             TEXT NOT NULL,
    state                TEXT NOT NULL,
    labels               TEXT NOT NULL DEFAULT '{}',
    spec                 TEXT NOT NULL DEFAULT '{}',
    idle_pause_seconds   INTEGER,
    pause_retention_days INTEGER NOT NULL DEFAULT 30,
    created_at           DOUBLE PRECISION NOT NULL,
    last_active_at       DOUBLE PRECISION NOT NULL,
    paused_at            DOUBLE PRECISION,
    error                TEXT
);
CREATE UNIQUE INDEX sandboxes_live_name ON torpor_registry.sandboxes (tenant, name)
    WHERE state <> 'stopped';
CREATE INDEX sandboxes_state ON torpor_registry.sandboxes (state);
CREATE TABLE torpor_registry.transitions (
    seq        BIGSERIAL PRIMARY KEY,
    sandbox_id TEXT NOT NULL,
    src        TEXT,
    dst        TEXT NOT NULL,
    at         DOUBLE PRECISION NOT NULL,
    reason     TEXT NOT NULL DEFAULT ''
);
CREATE INDEX transitions_sandbox ON torpor_registry.transitions (sandbox_id, seq);
"""

# v2: nodes (heartbeat, capacity, accelerator, CPU model) and one owner node per sandbox that
# holds a machine, with a lease the owner renews by heartbeating
_SCHEMA_V2 = """
CREATE TABLE torpor_registry.nodes (
    id            TEXT PRIMARY KEY,
    url           TEXT NOT NULL DEFAULT '',
    accelerator   TEXT NOT NULL,
    cpu_model     TEXT NOT NULL,
    capacity_mib  INTEGER NOT NULL,
    started_at    DOUBLE PRECISION NOT NULL,
    heartbeat_at  DOUBLE PRECISION NOT NULL,
    draining      BOOLEAN NOT NULL DEFAULT false
);
ALTER TABLE torpor_registry.sandboxes ADD COLUMN owner_node TEXT;
ALTER TABLE torpor_registry.sandboxes ADD COLUMN lease_until DOUBLE PRECISION;
CREATE INDEX sandboxes_owner ON torpor_registry.sandboxes (owner_node);
"""

# v3: snapshot manifests (the body a SnapshotStore writes), so every node sees every snapshot
# and a sweep of the shared chunk store marks from all of them
_SCHEMA_V3 = """
CREATE TABLE torpor_registry.snapshots (
    id          TEXT PRIMARY KEY,
    tenant      TEXT NOT NULL,
    name        TEXT NOT NULL,
    node        TEXT,
    created_at  DOUBLE PRECISION NOT NULL,
    expires_at  DOUBLE PRECISION NOT NULL,
    manifest    TEXT NOT NULL
);
CREATE UNIQUE INDEX snapshots_name ON torpor_registry.snapshots (tenant, name);
"""

# v4: pause manifests. One row per sandbox: which node holds its latest pause's files
# (``pause_node``, ``pause_at``: the sandbox's ``paused_at`` then), and the latest pause made
# durable off-node (``manifest``, ``manifest_paused_at``, ``durable_at``); an upload that
# keeps failing says why in ``upload_error``.
_SCHEMA_V4 = """
CREATE TABLE torpor_registry.pauses (
    sandbox_id          TEXT PRIMARY KEY,
    pause_node          TEXT,
    pause_at            DOUBLE PRECISION,
    manifest            TEXT,
    manifest_paused_at  DOUBLE PRECISION,
    durable_at          DOUBLE PRECISION,
    upload_error        TEXT,
    attempts            INTEGER NOT NULL DEFAULT 0
);
"""

# v5: a node's vCPUs (its capacity beside its RAM; ``draining`` is in v2 already)
_SCHEMA_V5 = """
ALTER TABLE torpor_registry.nodes ADD COLUMN vcpus INTEGER NOT NULL DEFAULT 0;
"""

# v6: durable snapshots. A snapshot is saved into its node's chunks, then pushed to the
# shared store in the background: ``durable_at`` says when that was done, ``upload_error``
# why the last try failed (it is retried), ``attempts`` how many failed
_SCHEMA_V6 = """
ALTER TABLE torpor_registry.snapshots ADD COLUMN durable_at DOUBLE PRECISION;
ALTER TABLE torpor_registry.snapshots ADD COLUMN upload_error TEXT;
ALTER TABLE torpor_registry.snapshots ADD COLUMN attempts INTEGER NOT NULL DEFAULT 0;
CREATE INDEX snapshots_undurable ON torpor_registry.snapshots (node) WHERE durable_at IS NULL;
"""

# v7: sweeps of the shared chunk store (one node at a time, under an advisory lock): when
# each ran, on which node, and what it did; the next is due a period after the last
_SCHEMA_V7 = """
CREATE TABLE torpor_registry.sweeps (
    seq          BIGSERIAL PRIMARY KEY,
    node         TEXT NOT NULL,
    started_at   DOUBLE PRECISION NOT NULL,
    finished_at  DOUBLE PRECISION NOT NULL,
    removed      INTEGER NOT NULL,
    kept         INTEGER NOT NULL,
    freed_bytes  BIGINT NOT NULL
);
"""

# v8: usage, as SQLite's schema version 2 keeps it (see torpor.sandbox.registry.meters): the
# cumulative meters on each transition row, and the ledger of stored things (snapshots,
# volumes). Transitions recorded before v8 carry zero meters (no backfill: a cluster's usage
# counts from its upgrade)
_SCHEMA_V8 = """
ALTER TABLE torpor_registry.transitions ADD COLUMN cpu_reading DOUBLE PRECISION;
ALTER TABLE torpor_registry.transitions ADD COLUMN owned_bytes BIGINT;
ALTER TABLE torpor_registry.transitions ADD COLUMN m_vcpu DOUBLE PRECISION NOT NULL DEFAULT 0;
ALTER TABLE torpor_registry.transitions ADD COLUMN m_cpu DOUBLE PRECISION NOT NULL DEFAULT 0;
ALTER TABLE torpor_registry.transitions ADD COLUMN m_ram DOUBLE PRECISION NOT NULL DEFAULT 0;
ALTER TABLE torpor_registry.transitions ADD COLUMN m_paused DOUBLE PRECISION NOT NULL DEFAULT 0;
ALTER TABLE torpor_registry.transitions ADD COLUMN cpu_ratio DOUBLE PRECISION;
CREATE INDEX transitions_at ON torpor_registry.transitions (sandbox_id, at);
CREATE TABLE torpor_registry.stored (
    kind        TEXT NOT NULL,
    id          TEXT NOT NULL,
    tenant      TEXT NOT NULL,
    name        TEXT NOT NULL,
    labels      TEXT NOT NULL DEFAULT '{}',
    bytes       BIGINT NOT NULL,
    started_at  DOUBLE PRECISION NOT NULL,
    ended_at    DOUBLE PRECISION,
    expires_at  DOUBLE PRECISION,
    PRIMARY KEY (kind, id)
);
CREATE INDEX stored_tenant ON torpor_registry.stored (tenant);
"""

# v9: volumes and drives, shared by every node (see the module docstring): ``node`` is where
# the data is (a volume's latest image, a drive's directory), ``holder`` the sandbox a volume
# is attached to (read-write, else the first reader); ``image`` the manifest of a volume's
# latest image in the shared store and ``image_at`` when it was pushed
_SCHEMA_V9 = """
CREATE TABLE torpor_registry.volumes (
    id          TEXT PRIMARY KEY,
    tenant      TEXT NOT NULL,
    name        TEXT NOT NULL,
    size_mib    INTEGER NOT NULL,
    labels      TEXT NOT NULL DEFAULT '{}',
    holder      TEXT,
    node        TEXT,
    record      TEXT NOT NULL,
    written_at  DOUBLE PRECISION NOT NULL,
    image       TEXT,
    image_at    DOUBLE PRECISION
);
CREATE UNIQUE INDEX volumes_name ON torpor_registry.volumes (tenant, name);
CREATE TABLE torpor_registry.drives (
    id          TEXT PRIMARY KEY,
    tenant      TEXT NOT NULL,
    name        TEXT NOT NULL,
    labels      TEXT NOT NULL DEFAULT '{}',
    node        TEXT,
    record      TEXT NOT NULL,
    written_at  DOUBLE PRECISION NOT NULL
);
CREATE UNIQUE INDEX drives_name ON torpor_registry.drives (tenant, name);
"""

#: the tables of the shared records (volumes, drives) by kind
RECORD_TABLES = {"volume": "torpor_registry.volumes", "drive": "torpor_registry.drives"}

#: version -> the script that brings the schema from the previous version to it
MIGRATIONS = {
    1: _SCHEMA_V1,
    2: _SCHEMA_V2,
    3: _SCHEMA_V3,
    4: _SCHEMA_V4,
    5: _SCHEMA_V5,
    6: _SCHEMA_V6,
    7: _SCHEMA_V7,
    8: _SCHEMA_V8,
    9: _SCHEMA_V9,
}
