"""The sandbox lifecycle: an explicit table of legal transitions and a guard per operation.

::

    creating ──> running ──> pausing ──> paused ──> waking ──> running
        │           ▲           │                     │
        │           └───────────┘ (hibernate failed,  │ (wake failed before the guest ran:
        │                          machine still up)  │  the saved state is still whole)
        │                                             └──> paused
        └─> error  <── pausing / waking / running / paused
                                                          any ──> stopped (kill)
                                                          error ──> stopped

A transition is *recorded* (``record`` callback, the registry's transitions log) before the
in-memory state changes, so a crash never leaves the registry behind what callers were told.
Two rollback edges go beyond the bare cycle — ``pausing -> running`` and ``waking -> paused`` —
because a failed pause or wake that destroyed nothing should leave the sandbox usable instead of
in ``error``; ``error`` is reserved for lost state. For the same reason ``running -> error``
(QEMU died under a running guest: RAM gone) and ``paused -> error`` (the saved state files were
found missing on start) exist: the registry must never keep claiming state the files lack.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from torpor.errors import InvalidState, SandboxClosed
from torpor.sandbox.models import SandboxState

__all__ = [
    "EXPIRED",
    "OPERATIONS",
    "TRANSITIONS",
    "Lifecycle",
    "Transition",
    "can_transition",
    "check_transition",
    "event_kind",
    "require",
    "require_for",
]

log = logging.getLogger(__name__)

S = SandboxState

#: state -> the states it may move to. Everything else is an illegal transition.
TRANSITIONS: dict[SandboxState, frozenset[SandboxState]] = {
    S.CREATING: frozenset({S.RUNNING, S.ERROR, S.STOPPED}),
    S.RUNNING: frozenset({S.PAUSING, S.STOPPED, S.ERROR}),
    S.PAUSING: frozenset({S.PAUSED, S.RUNNING, S.ERROR, S.STOPPED}),
    S.PAUSED: frozenset({S.WAKING, S.STOPPED, S.ERROR}),
    S.WAKING: frozenset({S.RUNNING, S.PAUSED, S.ERROR, S.STOPPED}),
    S.ERROR: frozenset({S.STOPPED}),
    S.STOPPED: frozenset(),
}

#: operation -> the states in which it may start. In-sandbox calls accept ``paused`` because
#: they wake the sandbox first (wake-on-request); ``pause``/``resume`` are idempotent.
OPERATIONS: dict[str, frozenset[SandboxState]] = {
    "pause": frozenset({S.RUNNING, S.PAUSED}),
    "resume": frozenset({S.RUNNING, S.PAUSED}),
    "call": frozenset({S.RUNNING, S.PAUSED}),
    "kill": frozenset(set(SandboxState)),
    "snapshot": frozenset({S.RUNNING, S.PAUSED}),
}


@dataclass(frozen=True)
class Transition:
    """One recorded state change of one sandbox (``src`` is None for the first one)."""

    sandbox_id: str
    src: SandboxState | None
    dst: SandboxState
    at: float = field(default_factory=time.time)
    reason: str = ""


def can_transition(src: SandboxState, dst: SandboxState) -> bool:
    """Whether the table allows ``src -> dst``."""
    return dst in TRANSITIONS[src]


def check_transition(sandbox_id: str, src: SandboxState, dst: SandboxState) -> None:
    """Raise unless ``src -> dst`` is legal.

    Raises :class:`SandboxClosed` when ``src`` is ``stopped`` and :class:`InvalidState`
    for any other illegal move.
    """
    if can_transition(src, dst):
        return
    if src is S.STOPPED:
        raise SandboxClosed(
            f"sandbox {sandbox_id} was killed",
            sandbox_id=sandbox_id,
            state=src.value,
            required=[dst.value],
        )
    raise InvalidState(
        f"sandbox {sandbox_id}: cannot go from {src.value} to {dst.value}",
        sandbox_id=sandbox_id,
        state=src.value,
        required=sorted(s.value for s in SandboxState if dst in TRANSITIONS[s]),
    )


def require(sandbox_id: str, state: SandboxState, allowed: Iterable[SandboxState]) -> None:
    """Guard: raise unless ``state`` is one of ``allowed``.

    Raises :class:`SandboxClosed` for a stopped sandbox (unless ``stopped`` is allowed), else
    :class:`InvalidState` carrying ``sandbox_id``, ``state`` and ``required``.
    """
    allowed = frozenset(allowed)
    if state in allowed:
        return
    required = sorted(s.value for s in allowed)
    if state is S.STOPPED:
        raise SandboxClosed(
            f"sandbox {sandbox_id} was killed",
            sandbox_id=sandbox_id,
            state=state.value,
            required=required,
        )
    raise InvalidState(
        f"sandbox {sandbox_id} is {state.value}; this needs {' or '.join(required)}",
        sandbox_id=sandbox_id,
        state=state.value,
        required=required,
    )


def require_for(operation: str, sandbox_id: str, state: SandboxState) -> None:
    """The guard of a named operation from :data:`OPERATIONS` (raises like :func:`require`)."""
    require(sandbox_id, state, OPERATIONS[operation])


class Lifecycle:
    """The current state of one sandbox and the transitions it went through.

    ``record`` is called with each :class:`Transition` *before* the state changes here; if it
    raises (e.g. the registry's disk is full) the state is unchanged and the error propagates.
    """

    def __init__(
        self,
        sandbox_id: str,
        state: SandboxState,
        *,
        record: Callable[[Transition], object] | None = None,
    ) -> None:
        self.sandbox_id = sandbox_id
        self._state = state
        self._record = record
        self.history: list[Transition] = []

    @property
    def state(self) -> SandboxState:
        return self._state

    def require(self, *allowed: SandboxState) -> None:
        """Guard on the current state (see :func:`require`)."""
        require(self.sandbox_id, self._state, allowed)

    def require_for(self, operation: str) -> None:
        """Guard of a named operation (see :data:`OPERATIONS`)."""
        require_for(operation, self.sandbox_id, self._state)

    def to(self, dst: SandboxState, reason: str = "") -> Transition:
        """Move to ``dst``: check the table, record, then switch. Raises like
        :func:`check_transition`, or whatever ``record`` raises (state then unchanged)."""
        check_transition(self.sandbox_id, self._state, dst)
        step = Transition(self.sandbox_id, self._state, dst, time.time(), reason)
        if self._record is not None:
            self._record(step)
        log.info(
            "sandbox %s: %s -> %s%s",
            self.sandbox_id,
            self._state.value,
            dst.value,
            f" ({reason})" if reason else "",
        )
        self._state = dst
        self.history.append(step)
        return step


#: the reason a kill records when a pause was kept past its ``pause_retention_days``
EXPIRED = "expired"


def event_kind(src: SandboxState | None, dst: SandboxState, reason: str = "") -> str | None:
    """What a user sees of the transition ``src -> dst``: ``create``, ``pause``, ``wake``,
    ``kill``, ``expire``, ``error``, ``pause-failed``, ``wake-failed``; None for the steps in
    between (``creating``, ``pausing``, ``waking``) and for the clean-up of a failed create
    (the caller got the error)."""
    if src is None or dst in (S.PAUSING, S.WAKING):
        return None
    if dst is S.STOPPED:
        if src in (S.CREATING, S.ERROR) and reason.startswith("create failed"):
            return None
        return "expire" if reason == EXPIRED else "kill"
    if dst is S.ERROR:
        return None if src is S.CREATING else "error"
    if dst is S.RUNNING:
        return {S.CREATING: "create", S.WAKING: "wake", S.PAUSING: "pause-failed"}.get(src)
    if dst is S.PAUSED:
        return "wake-failed" if src is S.WAKING else "pause"
    return None


class Recovery(enum.StrEnum):
    """What a restarted manager does with a sandbox, from its registry state and its files."""

    KEEP = "keep"  # the files back the registry state as it is
    DELETE_FILES = "delete-files"  # killed: remove what a crash left behind
    UNDO_CREATE = "undo-create"  # nobody was handed this sandbox yet: remove it
    REATTACH = "reattach"  # take over the live QEMU (finish the pause / wake it was in)
    PAUSED = "paused"  # a whole saved state backs it: call it paused
    LOST = "lost"  # RAM is gone: error, calls raise StateLost


def recovery(state: SandboxState, *, has_state: bool, qemu_alive: bool) -> Recovery:
    """The recovery table (see ``SandboxManager.start``).

    A whole state file means the guest never ran past it (the engine deletes the state before
    ``cont``), so any leftover QEMU can be killed and the sandbox called paused at no loss.
    Without one, a live QEMU *is* the sandbox's RAM: re-attach to it. With neither, RAM is lost.
    Whatever the answer, no QEMU but a re-attached one survives recovery.
    """
    if state is S.STOPPED:
        return Recovery.DELETE_FILES
    if state is S.ERROR:
        return Recovery.KEEP
    if state is S.CREATING:
        return Recovery.UNDO_CREATE
    if has_state:
        return Recovery.KEEP if state is S.PAUSED else Recovery.PAUSED
    if qemu_alive and state is not S.PAUSED:
        return Recovery.REATTACH
    return Recovery.LOST
