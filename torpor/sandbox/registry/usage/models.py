"""What a usage query takes and what a usage report holds (pydantic; the HTTP API's shapes).

A query names a grouping (``by``) and a window (``since``, ``until``); :func:`parse_query`
checks them once for every entry point (library, HTTP, SDK, CLI) and raises
:class:`~torpor.errors.InvalidArgument` for a bad grouping, an unparsable time, an empty or
reversed window, or a window that starts in the future.
"""

from __future__ import annotations

from datetime import UTC, date, datetime
from typing import Literal

from pydantic import BaseModel, Field

from torpor.errors import InvalidArgument
from torpor.sandbox.registry.usage.rates import RateCard
from torpor.sandbox.requests import RetentionDays, Spec

__all__ = [
    "Costs",
    "RetentionCost",
    "RetentionSpec",
    "UsageLine",
    "UsageQuery",
    "UsageReport",
    "parse_query",
    "parse_time",
]

#: the longest grouping text accepted (``label:`` + a label key)
_MAX_BY = 300


class RetentionSpec(Spec):
    """``POST .../retention``: keep a pause (or a snapshot) ``days`` days (1-365), counted from
    when it was paused (or taken)."""

    days: RetentionDays


class Costs(BaseModel):
    """Money per kind of usage, in the rate card's currency (not rounded: round when shown)."""

    cpu: float = 0.0
    memory: float = 0.0
    paused: float = 0.0
    snapshots: float = 0.0
    volumes: float = 0.0
    total: float = 0.0


class UsageLine(BaseModel):
    """The usage of one group (a tenant, a sandbox, the sandboxes with one label value) over
    the window. ``key`` is None for things without the grouping label (an unlabelled volume:
    the tenant's shared storage)."""

    key: str | None
    name: str | None = None
    sandboxes: int = 0
    snapshots: int = 0
    volumes: int = 0
    #: vCPUs allocated x hours up, and vCPU-hours used (QEMU CPU time; allocated where unread)
    vcpu_hours: float = 0.0
    cpu_hours: float = 0.0
    ram_gib_hours: float = 0.0
    paused_gb_months: float = 0.0
    snapshot_gb_months: float = 0.0
    volume_gib_hours: float = 0.0
    cost: Costs = Field(default_factory=Costs)


class RetentionCost(BaseModel):
    """What keeping one pause or snapshot until it expires will cost, from now."""

    kind: Literal["sandbox", "snapshot"]
    id: str
    name: str
    key: str | None
    bytes: int
    retention_days: int
    expires_at: datetime
    cost_per_day: float
    projected_cost: float


class UsageReport(BaseModel):
    """A usage report: one line per group, their total, the rates used, and what each
    retention still to run will cost."""

    by: str
    tenant: str | None
    since: datetime
    until: datetime
    rates: RateCard
    lines: list[UsageLine] = Field(default_factory=list)
    total: UsageLine
    retention: list[RetentionCost] = Field(default_factory=list)


class UsageQuery(BaseModel):
    """A checked usage query (see :func:`parse_query`)."""

    by: str
    label: str | None
    since: datetime
    until: datetime


def parse_time(value: datetime | date | str | float | None, what: str) -> datetime | None:
    """``value`` as an aware UTC datetime: a datetime (naive means UTC), a date (its
    midnight), an ISO 8601 text (``2026-11-01``, ``2026-11-01T08:00:00Z``) or unix seconds.
    Raises InvalidArgument for anything else."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise InvalidArgument(f"{what} must be a time, not {value!r}", field=what)
    if isinstance(value, int | float):
        try:
            return datetime.fromtimestamp(float(value), UTC)
        except (OverflowError, OSError, ValueError) as exc:
            raise InvalidArgument(f"{what} {value!r} is out of range", field=what) from exc
    if isinstance(value, str):
        text = value.strip()
        try:
            parsed = datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith("Z") else text)
        except ValueError as exc:
            raise InvalidArgument(
                f"{what} {value!r} is not an ISO 8601 date or time (e.g. 2026-11-01 or "
                "2026-11-01T08:00:00Z)",
                field=what,
            ) from exc
        value = parsed
    if isinstance(value, datetime):
        try:  # 0001-01-01T00:00+01:00 is before year 1 in UTC
            return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
        except OverflowError as exc:
            raise InvalidArgument(f"{what} {value!r} is out of range", field=what) from exc
    if isinstance(value, date):
        return datetime(value.year, value.month, value.day, tzinfo=UTC)
    raise InvalidArgument(f"{what} must be a time, not {type(value).__name__}", field=what)


def parse_query(
    by: str = "tenant",
    since: datetime | date | str | float | None = None,
    until: datetime | date | str | float | None = None,
    *,
    now: datetime | None = None,
) -> UsageQuery:
    """Check a usage query. ``by``: ``tenant``, ``sandbox`` or ``label:KEY``; ``since``
    defaults to the start of the current month (UTC), ``until`` to now (a later ``until`` is
    cut to now: usage is metered, not forecast). Raises InvalidArgument."""
    now = now or datetime.now(UTC)
    if not isinstance(by, str) or len(by) > _MAX_BY:
        raise InvalidArgument("by must be 'tenant', 'sandbox' or 'label:KEY'", field="by")
    label: str | None = None
    if by.startswith("label:"):
        label = by[len("label:") :]
        if not label:
            raise InvalidArgument("by 'label:' needs a label key, e.g. label:user", field="by")
    elif by not in ("tenant", "sandbox"):
        raise InvalidArgument(
            f"by must be 'tenant', 'sandbox' or 'label:KEY', not {by!r}", field="by", value=by
        )
    start = parse_time(since, "since") or now.replace(
        day=1, hour=0, minute=0, second=0, microsecond=0
    )
    end = parse_time(until, "until") or now
    if start > now:
        raise InvalidArgument(
            f"since {start.isoformat()} is in the future (now is {now.isoformat()})",
            field="since",
        )
    end = min(end, now)
    if end <= start:
        raise InvalidArgument(
            f"until ({end.isoformat()}) must be after since ({start.isoformat()})",
            field="until",
        )
    return UsageQuery(by=by, label=label, since=start, until=end)
