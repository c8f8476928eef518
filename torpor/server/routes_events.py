"""Lifecycle events: what happened to the tenant's sandboxes, for a user to follow.

::

    GET /v1/events?after=SEQ&sandbox=ID_OR_NAME&wait=SECONDS   -> EventPage

Events (``create``, ``pause``, ``wake``, ``kill``, ``expire``, ``error`` ...) are read from the
registry's transitions log, so a restarted server still has its history. Following is a long
poll: with ``wait`` the answer is held until an event after ``after`` exists or ``wait`` seconds
pass (an empty page then); the caller asks again with ``after=next``. A bounded wait, rather
than an endless stream, lets a stopping server finish its requests and a client lose nothing
between two polls.
"""

from __future__ import annotations

import asyncio
import time
from typing import Annotated

from fastapi import APIRouter, Query

from torpor.sandbox.models import EventPage
from torpor.server.deps import Manager, Tenant

__all__ = ["MAX_WAIT", "POLL_INTERVAL", "QUERY_INTERVAL", "router"]

router = APIRouter(prefix="/v1/events", tags=["events"])

#: the longest a follow request is held (seconds)
MAX_WAIT = 30.0
#: how often a held request checks the manager's cheap "anything new?" mark (seconds)
POLL_INTERVAL = 0.05
#: how often it queries the registry even when the mark did not move (seconds)
QUERY_INTERVAL = 1.0


@router.get("")
async def list_events(
    manager: Manager,
    tenant: Tenant,
    after: Annotated[
        int, Query(ge=0, le=2**63 - 1, description="only events with a larger seq")
    ] = 0,
    sandbox: Annotated[str | None, Query(description="only this sandbox's (id or name)")] = None,
    wait: Annotated[
        float, Query(ge=0, le=MAX_WAIT, description="hold the answer until an event comes")
    ] = 0.0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 500,
) -> EventPage:
    """The tenant's lifecycle events after ``after``, oldest first, and ``next`` (the ``after``
    of the next call)."""
    mark = getattr(manager, "events_mark", None)  # a manager without one is queried each time
    deadline = time.monotonic() + wait
    while True:
        seen = mark() if mark is not None else None
        events, nxt = await manager.events(tenant=tenant, after=after, sandbox=sandbox, limit=limit)
        if events or time.monotonic() >= deadline:
            return EventPage(events=events, next=nxt)
        after = nxt
        queried = time.monotonic()
        while time.monotonic() < deadline:
            await asyncio.sleep(min(POLL_INTERVAL, max(0.0, deadline - time.monotonic())))
            moved = mark is None or mark() != seen
            if moved or time.monotonic() - queried >= QUERY_INTERVAL:
                break
