"""torpor.sandbox.manager: the one owner of every sandbox of a torpor home.

* :mod:`.sandboxes` — :class:`SandboxManager`: create, get, list, pause, resume, kill, the idle
  supervisor, start and close; with the two parts it is made of:
* :mod:`.calls` — :class:`~.calls.SandboxCalls`: the calls that run inside a sandbox (commands,
  code, terminals, files, ports), with wake-on-request
* :mod:`.nodes` — :class:`~.nodes.NodeOperations`: this node's part in a cluster (join at start,
  drain, stale directories) and the list of nodes
* :mod:`.core` — the manager's state and the steps its operations are made of (pause, wake,
  boot), and :class:`~.core.Held`, the part of it the checkpoint component may use
* :mod:`.recovery` — recovery after a restart: each registry row brought in line with its
  sandbox directory
* :mod:`.cluster` — cluster mode (``torpor serve --cluster``): the node's heartbeat and leases
  on the PostgreSQL registry, placement, pauses made durable in the shared store, wake
  anywhere, recovery of a lost node's sandboxes (a package, one module per part of
  :class:`~.cluster.ClusterNode`)

Imports: the registry, the engine, models; never checkpoints (which sit on top of it).
"""

from torpor.sandbox.manager.core import SYNC_TIMEOUT, Held, StepHook
from torpor.sandbox.manager.sandboxes import SandboxManager

__all__ = ["SYNC_TIMEOUT", "Held", "SandboxManager", "StepHook"]
