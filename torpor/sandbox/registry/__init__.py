"""torpor.sandbox.registry: the durable record of every sandbox and of its state changes.

* :mod:`.lifecycle` — the state machine: states, the legal transitions with a guard on every
  operation, and what a restarted manager does with each state (recovery)
* :mod:`.sqlite` — :class:`Registry`: one SQLite database (WAL, ``synchronous=FULL``) of
  sandbox rows and their transitions; a transition is a compare-and-set the lifecycle checks

Imports: torpor.config, torpor.errors, torpor.sandbox.models.
"""

from torpor.sandbox.registry.sqlite import SCHEMA_VERSION, Registry, SandboxRecord

__all__ = ["SCHEMA_VERSION", "Registry", "SandboxRecord"]
