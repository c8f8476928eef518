"""How a node joins a cluster (:class:`ClusterConfig`, from ``torpor serve --cluster``),
the URL it advertises, and the mark of a request another node proxied here (:data:`PROXIED`).
"""

from __future__ import annotations

import os
import socket
from contextvars import ContextVar
from dataclasses import dataclass

from torpor.config import check_name
from torpor.errors import InvalidArgument

__all__ = ["CLUSTER_ENV", "LEASE_ENV", "NODE_ENV", "PROXIED", "ClusterConfig", "default_url"]

#: the registry's DSN, the node's name (the store is ``$TORPOR_STORE``)
CLUSTER_ENV = "TORPOR_CLUSTER"
NODE_ENV = "TORPOR_NODE"
LEASE_ENV = "TORPOR_LEASE_SECONDS"

#: the node a request came from when another node proxied it here (set by the server's proxy):
#: placement then wakes the sandbox here instead of sending it on again
PROXIED: ContextVar[str | None] = ContextVar("torpor_proxied_by", default=None)


@dataclass(frozen=True)
class ClusterConfig:
    """How a node joins a cluster: the registry (a PostgreSQL DSN), the shared chunk store
    (``s3://bucket/prefix``), its name and the URL other nodes and clients reach it at.
    A lease lasts ``lease_seconds`` and is renewed every ``heartbeat_seconds``."""

    dsn: str
    store: str
    node: str
    url: str = ""
    lease_seconds: float = 15.0
    heartbeat_seconds: float = 3.0

    def __post_init__(self) -> None:
        check_name(self.node, "node name")
        if not self.dsn.startswith(("postgres://", "postgresql://")):
            raise InvalidArgument(f"--cluster must be a PostgreSQL DSN, not {self.dsn!r}")
        if not self.store.startswith("s3://"):
            raise InvalidArgument(
                f"--store must be s3://bucket/prefix in cluster mode, not {self.store!r} "
                "(a local directory cannot be shared between nodes)"
            )
        if not 0 < self.heartbeat_seconds < self.lease_seconds:
            raise InvalidArgument("the heartbeat must be shorter than the lease, both > 0")

    @classmethod
    def lease_from_env(cls) -> float:
        """``$TORPOR_LEASE_SECONDS`` (default 15). Raises InvalidArgument."""
        raw = os.environ.get(LEASE_ENV, "").strip()
        try:
            value = float(raw) if raw else 15.0
        except ValueError as exc:
            raise InvalidArgument(f"{LEASE_ENV} must be seconds, not {raw!r}") from exc
        if value < 2:
            raise InvalidArgument(f"{LEASE_ENV} must be at least 2 seconds, not {raw!r}")
        return value


def default_url(host: str | None, port: int) -> str:
    """The URL a node advertises when none is given: its host (its name when it listens on
    every address) and port."""
    if host is None:
        return ""
    name = socket.gethostname() if host in ("0.0.0.0", "::", "") else host
    return f"http://[{name}]:{port}" if ":" in name else f"http://{name}:{port}"
