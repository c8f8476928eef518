"""The rate card: what a unit of usage costs, with defaults an operator overrides per home.

``<home>/rates.json`` holds any of :class:`RateCard`'s fields (``{"cpu_vcpu_hour": 0.03}``);
the rest keep their defaults. Units are the ones hosted sandbox and storage offers publish:

* CPU per vCPU-hour, billed on the CPU the machine **used** (``cpu_basis="used"``, the QEMU
  process's CPU time, allocation where no reading exists) or on the vCPUs **allocated** while
  it was up (``cpu_basis="allocated"``); the report shows both quantities either way;
* memory per GiB-hour of guest RAM while up;
* paused storage and snapshots per GB-month (GB = 10^9 bytes, month = 30 days = 720 hours);
* volumes per GiB-hour of their size.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from torpor.config import Paths
from torpor.errors import InvalidArgument
from torpor.sandbox.requests import invalid_argument

__all__ = ["GB", "GIB", "MONTH_HOURS", "RateCard"]

#: a GB of storage, as storage is priced (decimal)
GB = 10**9
#: a GiB, as RAM and volume sizes are given
GIB = 1024**3
#: hours in the month storage is priced by (30 days)
MONTH_HOURS = 720.0


class RateCard(BaseModel):
    """Prices of usage (defaults: the issue's published card). Raises InvalidArgument (through
    :meth:`of`) for a negative price, an unknown field or a bad basis."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    currency: str = Field(default="USD", min_length=1, max_length=8)
    cpu_vcpu_hour: float = Field(default=0.025, ge=0)
    memory_gib_hour: float = Field(default=0.0075, ge=0)
    paused_gb_month: float = Field(default=0.08, ge=0)
    snapshot_gb_month: float = Field(default=0.08, ge=0)
    volume_gib_hour: float = Field(default=0.000153, ge=0)
    cpu_basis: Literal["used", "allocated"] = "used"

    @classmethod
    def of(cls, paths: Paths) -> RateCard:
        """The rate card of the home of ``paths``: ``rates.json`` over the defaults. Raises
        InvalidArgument for a file that is not a JSON object of these fields."""
        file = paths.home / "rates.json"
        try:
            table = json.loads(file.read_text())
        except FileNotFoundError:
            return cls()
        except (OSError, ValueError) as exc:
            raise InvalidArgument(f"cannot read {file}: {exc}", path=str(file)) from exc
        if not isinstance(table, dict):
            raise InvalidArgument(f"{file} must hold a JSON object of rates", path=str(file))
        try:
            return cls.model_validate(table)
        except ValidationError as exc:
            raise invalid_argument(exc.errors(), f"bad rate in {file}") from exc
