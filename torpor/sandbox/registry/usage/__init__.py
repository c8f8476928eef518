"""What sandboxes, snapshots and volumes used, and what it costs (torpor.sandbox.registry.usage).

Usage comes from the transitions the registry records (no separate metering engine): each
transition row carries the sandbox's cumulative meters (:mod:`torpor.sandbox.registry.meters`),
so a window's usage is the difference of two readings; snapshots and volumes are priced by
their bytes over the time they were stored (the registry's ledger of stored things).

* :mod:`.rates` — :class:`RateCard`: prices, defaults overridden by ``<home>/rates.json``
* :mod:`.models` — the query (:func:`parse_query`) and the report's shapes
* :mod:`.report` — :func:`build`: read the registry and the stores, group, price; and what
  each pause's or snapshot's retention will cost until it expires

It lives with the registry because it is derived from it (and reads the snapshot and volume
stores below it). Imports: torpor.config, torpor.errors, the registry, torpor.sandbox.storage,
torpor.sandbox.requests, torpor.sandbox.models.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torpor._lazy import lazy_exports

if TYPE_CHECKING:  # the real names, for type checkers; at run time each loads on first use
    from torpor.sandbox.registry.usage.models import (
        Costs,
        RetentionCost,
        RetentionSpec,
        UsageLine,
        UsageReport,
        parse_query,
    )
    from torpor.sandbox.registry.usage.rates import RateCard
    from torpor.sandbox.registry.usage.report import build

__all__ = [
    "Costs",
    "RateCard",
    "RetentionCost",
    "RetentionSpec",
    "UsageLine",
    "UsageReport",
    "build",
    "parse_query",
]

# Loaded lazily: the client and the CLI need the shapes (``models``), not :func:`build`, which
# pulls in the snapshot and volume stores.
_LAZY = {
    "Costs": "torpor.sandbox.registry.usage.models",
    "RateCard": "torpor.sandbox.registry.usage.rates",
    "RetentionCost": "torpor.sandbox.registry.usage.models",
    "RetentionSpec": "torpor.sandbox.registry.usage.models",
    "UsageLine": "torpor.sandbox.registry.usage.models",
    "UsageReport": "torpor.sandbox.registry.usage.models",
    "build": "torpor.sandbox.registry.usage.report",
    "parse_query": "torpor.sandbox.registry.usage.models",
}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals(), __all__)
