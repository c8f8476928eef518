"""torpor.sandbox.registry: the durable record of every sandbox and of its state changes.

* :mod:`.lifecycle` — the state machine: states, the legal transitions with a guard on every
  operation, and what a restarted manager does with each state (recovery)
* :mod:`.sqlite` — :class:`Registry`: one SQLite database (WAL, ``synchronous=FULL``) of
  sandbox rows and their transitions; a transition is a compare-and-set the lifecycle checks
* :mod:`.postgres` — :class:`~torpor.sandbox.registry.postgres.PostgresRegistry`: the same
  interface on PostgreSQL (schema ``torpor_registry``, versioned migrations), for many nodes
  sharing one registry (issue 9; not wired to the manager yet)

Imports: torpor.config, torpor.errors, torpor.sandbox.models; psycopg only when a
PostgresRegistry is opened.
"""

from torpor.sandbox.registry.sqlite import SCHEMA_VERSION, Registry, SandboxRecord

__all__ = ["SCHEMA_VERSION", "Registry", "SandboxRecord"]
