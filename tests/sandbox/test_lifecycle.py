"""The transition table and the guards."""

from __future__ import annotations

import pytest

from torpor.errors import InvalidState, SandboxClosed, StorageError
from torpor.sandbox.models import SandboxState as S
from torpor.sandbox.registry.lifecycle import (
    OPERATIONS,
    TRANSITIONS,
    Lifecycle,
    Recovery,
    Transition,
    can_transition,
    check_transition,
    recovery,
    require,
    require_for,
)

LEGAL = [(src, dst) for src, dsts in TRANSITIONS.items() for dst in dsts]
ILLEGAL = [(src, dst) for src in S for dst in S if dst not in TRANSITIONS[src]]


def test_table_covers_every_state() -> None:
    assert set(TRANSITIONS) == set(S)


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        pytest.param(S.CREATING, S.RUNNING, id="create"),
        pytest.param(S.RUNNING, S.PAUSING, id="pause-start"),
        pytest.param(S.PAUSING, S.PAUSED, id="pause-done"),
        pytest.param(S.PAUSED, S.WAKING, id="wake-start"),
        pytest.param(S.WAKING, S.RUNNING, id="wake-done"),
        pytest.param(S.CREATING, S.ERROR, id="create-failed"),
        pytest.param(S.PAUSING, S.ERROR, id="pause-lost"),
        pytest.param(S.WAKING, S.ERROR, id="wake-lost"),
        pytest.param(S.ERROR, S.STOPPED, id="error-kill"),
        pytest.param(S.WAKING, S.PAUSED, id="wake-rollback"),
        pytest.param(S.PAUSING, S.RUNNING, id="pause-rollback"),
    ],
)
def test_required_transitions_are_legal(src: S, dst: S) -> None:
    assert can_transition(src, dst)


@pytest.mark.parametrize("src", [s for s in S if s is not S.STOPPED])
def test_kill_is_legal_from_every_live_state(src: S) -> None:
    assert can_transition(src, S.STOPPED)


@pytest.mark.parametrize(
    ("src", "dst"), [pytest.param(a, b, id=f"{a.value}->{b.value}") for a, b in ILLEGAL]
)
def test_illegal_transitions_raise(src: S, dst: S) -> None:
    expected = SandboxClosed if src is S.STOPPED else InvalidState
    with pytest.raises(expected) as info:
        check_transition("sbx-1", src, dst)
    assert info.value.sandbox_id == "sbx-1"  # type: ignore[attr-defined]
    assert info.value.state == src.value  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        pytest.param(S.RUNNING, S.WAKING, id="wake-running"),
        pytest.param(S.PAUSED, S.PAUSING, id="pause-paused"),
        pytest.param(S.PAUSED, S.RUNNING, id="skip-waking"),
        pytest.param(S.ERROR, S.RUNNING, id="revive-error"),
        pytest.param(S.CREATING, S.PAUSED, id="create-paused"),
    ],
)
def test_shortcuts_are_illegal(src: S, dst: S) -> None:
    assert not can_transition(src, dst)


def test_require_names_what_it_needs() -> None:
    with pytest.raises(InvalidState) as info:
        require("sbx-1", S.PAUSING, [S.RUNNING, S.PAUSED])
    err = info.value
    assert not isinstance(err, SandboxClosed)
    assert err.data == {
        "sandbox_id": "sbx-1",
        "state": "pausing",
        "required": ["paused", "running"],
    }
    require("sbx-1", S.RUNNING, [S.RUNNING])  # no raise


def test_require_on_stopped_is_sandbox_closed() -> None:
    with pytest.raises(SandboxClosed):
        require_for("call", "sbx-1", S.STOPPED)
    require_for("kill", "sbx-1", S.STOPPED)  # kill is idempotent


@pytest.mark.parametrize("op", sorted(OPERATIONS))
def test_operation_guards_reject_transient_states(op: str) -> None:
    if op == "kill":
        return
    for state in (S.CREATING, S.PAUSING, S.WAKING):
        with pytest.raises(InvalidState):
            require_for(op, "sbx-1", state)


def test_lifecycle_records_the_exact_sequence() -> None:
    recorded: list[Transition] = []
    lc = Lifecycle("sbx-1", S.CREATING, record=recorded.append)
    for dst in (S.RUNNING, S.PAUSING, S.PAUSED, S.WAKING, S.RUNNING, S.STOPPED):
        lc.to(dst)
    seq = [(t.src, t.dst) for t in recorded]
    assert seq == [
        (S.CREATING, S.RUNNING),
        (S.RUNNING, S.PAUSING),
        (S.PAUSING, S.PAUSED),
        (S.PAUSED, S.WAKING),
        (S.WAKING, S.RUNNING),
        (S.RUNNING, S.STOPPED),
    ]
    assert lc.history == recorded
    assert lc.state is S.STOPPED
    with pytest.raises(SandboxClosed):
        lc.to(S.RUNNING)


def test_lifecycle_keeps_state_when_recording_fails() -> None:
    def broken(_: Transition) -> None:
        raise StorageError("disk full")

    lc = Lifecycle("sbx-1", S.RUNNING, record=broken)
    with pytest.raises(StorageError):
        lc.to(S.PAUSING)
    assert lc.state is S.RUNNING
    assert lc.history == []


def test_lifecycle_rejects_illegal_without_recording() -> None:
    recorded: list[Transition] = []
    lc = Lifecycle("sbx-1", S.PAUSED, record=recorded.append)
    with pytest.raises(InvalidState):
        lc.to(S.RUNNING)
    assert recorded == [] and lc.state is S.PAUSED


R = Recovery


@pytest.mark.parametrize(
    ("state", "has_state", "qemu_alive", "expected"),
    [
        pytest.param(S.RUNNING, False, True, R.REATTACH, id="running-alive"),
        pytest.param(S.RUNNING, False, False, R.LOST, id="running-dead"),
        pytest.param(S.PAUSED, True, False, R.KEEP, id="paused-whole"),
        pytest.param(S.PAUSED, True, True, R.KEEP, id="paused-stray-qemu"),
        pytest.param(S.PAUSED, False, False, R.LOST, id="paused-files-gone"),
        pytest.param(S.PAUSED, False, True, R.LOST, id="paused-no-state-never-trust-qemu"),
        pytest.param(S.PAUSING, True, False, R.PAUSED, id="pausing-state-saved"),
        pytest.param(S.PAUSING, True, True, R.PAUSED, id="pausing-saved-qemu-quitting"),
        pytest.param(S.PAUSING, False, True, R.REATTACH, id="pausing-not-saved-yet"),
        pytest.param(S.PAUSING, False, False, R.LOST, id="pausing-qemu-died"),
        pytest.param(S.WAKING, True, False, R.PAUSED, id="waking-not-started"),
        pytest.param(S.WAKING, True, True, R.PAUSED, id="waking-before-cont"),
        pytest.param(S.WAKING, False, True, R.REATTACH, id="waking-after-cont"),
        pytest.param(S.WAKING, False, False, R.LOST, id="waking-died-after-cont"),
        pytest.param(S.CREATING, True, True, R.UNDO_CREATE, id="creating"),
        pytest.param(S.ERROR, False, True, R.KEEP, id="error"),
        pytest.param(S.STOPPED, False, True, R.DELETE_FILES, id="stopped"),
    ],
)
def test_recovery_table(state: S, has_state: bool, qemu_alive: bool, expected: Recovery) -> None:
    assert recovery(state, has_state=has_state, qemu_alive=qemu_alive) is expected


@pytest.mark.parametrize("state", list(S))
def test_recovery_never_claims_unbacked_pause(state: S) -> None:
    # whatever the registry said, "paused" is only ever the answer when a state file exists
    for alive in (False, True):
        assert recovery(state, has_state=False, qemu_alive=alive) not in (R.PAUSED,)
