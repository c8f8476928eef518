"""torpor.sandbox.usage: what sandboxes, snapshots and volumes used, and what it costs.

Usage comes from the transitions the registry records (no separate metering engine): each
transition row carries the sandbox's cumulative meters (:mod:`torpor.sandbox.registry.meters`),
so a window's usage is the difference of two readings; snapshots and volumes are priced by
their bytes over the time they were stored (the registry's ledger of stored things).

* :mod:`.rates` — :class:`RateCard`: prices, defaults overridden by ``<home>/rates.json``
* :mod:`.models` — the query (:func:`parse_query`) and the report's shapes
* :mod:`.report` — :func:`build`: read the registry and the stores, group, price; and what
  each pause's or snapshot's retention will cost until it expires

Imports: torpor.config, torpor.errors, torpor.sandbox.registry, torpor.sandbox.storage,
torpor.sandbox.requests, torpor.sandbox.models.
"""

from torpor.sandbox.usage.models import (
    Costs,
    RetentionCost,
    RetentionSpec,
    UsageLine,
    UsageReport,
    parse_query,
)
from torpor.sandbox.usage.rates import RateCard
from torpor.sandbox.usage.report import build

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
