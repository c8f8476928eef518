"""torpor.sandbox.registry: the durable record of every sandbox and of its state changes.

* :mod:`.lifecycle` — the state machine: states, the legal transitions with a guard on every
  operation, and what a restarted manager does with each state (recovery)
* :mod:`.records` — :class:`SandboxRecord`, one row, and the pure mapping of rows to records
* :mod:`.base` — :class:`~torpor.sandbox.registry.base.SqlRegistry`: the SQL on sandboxes,
  transitions and the usage ledger, written once for both backends
* :mod:`.sqlite` — :class:`Registry`: one SQLite database (WAL, ``synchronous=FULL``) of
  sandbox rows and their transitions; a transition is a compare-and-set the lifecycle checks
* :mod:`.postgres` — :class:`~torpor.sandbox.registry.postgres.PostgresRegistry`: the same
  interface on PostgreSQL (schema ``torpor_registry``, versioned migrations), for many nodes
  sharing one registry (issue 9: the manager's in cluster mode, see
  :mod:`torpor.sandbox.manager.cluster`; snapshot manifests, sweeps and usage meters too)
* :mod:`.meters` — the usage meters each transition row carries (pure functions)
* :mod:`.usage` — usage reports and the rate card, derived from the transitions and the ledger
  of stored snapshots and volumes

Imports: torpor.config, torpor.errors, torpor.sandbox.models; psycopg only when a
PostgresRegistry is opened; for usage, torpor.sandbox.storage and torpor.sandbox.requests.
"""

from torpor.sandbox.registry.base import Move
from torpor.sandbox.registry.postgres import PostgresRegistry
from torpor.sandbox.registry.records import SandboxRecord
from torpor.sandbox.registry.sqlite import SCHEMA_VERSION, Registry

#: the registry a manager holds: SQLite on one machine (the default), PostgreSQL in a cluster
#: (the same interface for sandboxes and transitions)
AnyRegistry = Registry | PostgresRegistry

__all__ = [
    "SCHEMA_VERSION",
    "AnyRegistry",
    "Move",
    "PostgresRegistry",
    "Registry",
    "SandboxRecord",
]
