"""SandboxManager on the fake engine (state logic) and on real QEMU (marked ``qemu``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.sandbox.fakes import FakeEngine, FakeMachine, FakeWorld
from tests.sandbox.procs import procs_on
from torpor.config import paths
from torpor.errors import (
    Conflict,
    EngineError,
    GuestError,
    InvalidArgument,
    InvalidName,
    PathNotFound,
    SandboxClosed,
    SandboxNotFound,
    StateLost,
    StorageError,
    TemplateNotFound,
)
from torpor.sandbox.manager import SandboxManager, core
from torpor.sandbox.models import SandboxState as S
from torpor.sandbox.vm.exits import settle_exit

T = TypeVar("T")

CREATE = [(None, "creating"), ("creating", "running")]
PAUSE = [("running", "pausing"), ("pausing", "paused")]
WAKE = [("paused", "waking"), ("waking", "running")]


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


class Crash(BaseException):
    """Stands in for the manager process dying at a step (nothing below catches it)."""


def crash_at(step: str) -> Callable[[str, str], None]:
    def hook(name: str, sandbox_id: str) -> None:
        if name == step:
            raise Crash(step)

    return hook


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "home"


def manager(home: Path, world: FakeWorld | None = None) -> tuple[SandboxManager, FakeEngine]:
    engine = FakeEngine(world)
    return SandboxManager(paths(home), engine=engine), engine


def with_manager(home: Path, body: Callable[[SandboxManager, FakeEngine], Awaitable[T]]) -> T:
    async def main() -> T:
        mgr, engine = manager(home)
        try:
            return await body(mgr, engine)
        finally:
            await mgr.close(pause=False)

    return run(main())


# -- create / pause / wake ------------------------------------------------------------------


def test_create_pause_wake_exact_transitions(home: Path) -> None:
    async def body(mgr: SandboxManager, engine: FakeEngine) -> None:
        info = await mgr.create(name="agent", labels={"user": "u-42"})
        assert info.state is S.RUNNING and info.name == "agent" and not info.reused
        assert mgr.transitions(info.id) == CREATE
        assert engine.calls[:3] == ["clone", "wake", "connect"]  # a fork, never a cold boot
        proc = engine.world.processes[mgr.directory(info.id)]
        assert len(proc.refreshes) == 1 and len(proc.refreshes[0][0] or b"") == 64

        paused = await mgr.pause("agent")
        assert paused.state is S.PAUSED
        assert mgr.transitions(info.id) == CREATE + PAUSE
        status = engine.inspect(mgr.directory(info.id))
        assert status.qemu_pid is None and status.has_state  # no process, only files

        woken = await mgr.resume(info.id)
        assert woken.state is S.RUNNING
        assert mgr.transitions(info.id) == CREATE + PAUSE + WAKE
        new_proc = engine.world.processes[mgr.directory(info.id)]
        # a plain wake sets the clock only: its random state is no other guest's
        assert len(new_proc.refreshes) == 1 and new_proc.refreshes[0][0] is None
        assert new_proc.refreshes[0][1] is not None

    with_manager(home, body)


def test_pause_and_resume_are_idempotent(home: Path) -> None:
    async def body(mgr: SandboxManager, engine: FakeEngine) -> None:
        info = await mgr.create()
        await mgr.resume(info.id)
        await mgr.pause(info.id)
        await mgr.pause(info.id)
        assert mgr.transitions(info.id) == CREATE + PAUSE

    with_manager(home, body)


def test_wake_on_request_keeps_ram(home: Path) -> None:
    async def body(mgr: SandboxManager, engine: FakeEngine) -> None:
        info = await mgr.create(name="agent")
        await mgr.run_code("agent", "x = 41")
        await mgr.write_file("agent", "/workspace/a.txt", "hello")
        await mgr.pause("agent")
        before = (await mgr.get("agent")).last_active_at
        result = await mgr.run_code("agent", "x + 1")
        assert result.text == "42"
        assert await mgr.read_file("agent", "/workspace/a.txt") == b"hello"
        assert mgr.transitions(info.id)[-2:] == WAKE
        assert (await mgr.get("agent")).last_active_at >= before
        assert mgr.registry.transitions(info.id)[-2].reason == "wake on request"

    with_manager(home, body)


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda m, i: m.run_command(i, "echo hi"), id="run_command"),
        pytest.param(lambda m, i: m.run_code(i, "1"), id="run_code"),
        pytest.param(lambda m, i: m.write_file(i, "/f", b"x"), id="write_file"),
        pytest.param(lambda m, i: m.list_dir(i, "/"), id="list_dir"),
        pytest.param(lambda m, i: m.exists(i, "/f"), id="exists"),
        pytest.param(lambda m, i: m.make_dir(i, "/d"), id="make_dir"),
    ],
)
def test_every_call_wakes_a_paused_sandbox(home: Path, call: Callable[..., Awaitable[Any]]) -> None:
    async def body(mgr: SandboxManager, engine: FakeEngine) -> None:
        info = await mgr.create()
        await mgr.pause(info.id)
        await call(mgr, info.id)
        assert (await mgr.get(info.id)).state is S.RUNNING

    with_manager(home, body)


def test_concurrent_calls_on_paused_sandbox_wake_it_once(home: Path) -> None:
    async def body(mgr: SandboxManager, engine: FakeEngine) -> None:
        info = await mgr.create()
        await mgr.pause(info.id)
        results = await asyncio.gather(*(mgr.run_command(info.id, f"echo {n}") for n in range(8)))
        assert sorted(r.stdout for r in results) == sorted(f"{n}\n" for n in range(8))
        assert mgr.transitions(info.id).count(("paused", "waking")) == 1

    with_manager(home, body)


def test_pause_waits_for_calls_in_flight(home: Path) -> None:
    async def body(mgr: SandboxManager, engine: FakeEngine) -> None:
        info = await mgr.create()
        slow = asyncio.create_task(mgr.run_command(info.id, "sleep 0.2"))
        await asyncio.sleep(0.05)
        await mgr.pause(info.id)
        assert (await slow).exit_code == 0  # the command finished before the machine paused
        assert (await mgr.get(info.id)).state is S.PAUSED

    with_manager(home, body)


def test_the_guest_flush_runs_beside_the_pausing_record_and_ends_before_the_save(
    home: Path,
) -> None:
    async def body(mgr: SandboxManager, engine: FakeEngine) -> None:
        info = await mgr.create()
        channel = mgr.live(info.id).channel
        assert channel is not None
        seen: list[str] = []
        release = asyncio.Event()

        async def sync() -> None:  # the guest takes its time to flush
            seen.append(f"flush sent while {mgr.registry.get(info.id).state.value}")
            await release.wait()
            seen.append("flushed")

        async def close() -> None:
            seen.append("channel closed")

        channel.sync = sync  # type: ignore[method-assign]
        channel.close = close  # type: ignore[method-assign]
        pause = asyncio.create_task(mgr.pause(info.id))
        while mgr.registry.get(info.id).state is not S.PAUSING:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.05)
        assert not pause.done() and not (mgr.directory(info.id) / "state").exists()
        release.set()
        assert (await pause).state is S.PAUSED
        assert seen == ["flush sent while running", "flushed", "channel closed"]

    with_manager(home, body)


def test_a_guest_that_never_flushes_does_not_hold_the_pause(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(core, "SYNC_TIMEOUT", 0.05)

    async def body(mgr: SandboxManager, engine: FakeEngine) -> None:
        info = await mgr.create()
        await mgr.run_code(info.id, "v = 'ram'")
        channel = mgr.live(info.id).channel
        assert channel is not None

        async def sync() -> None:
            await asyncio.Event().wait()  # hung

        channel.sync = sync  # type: ignore[method-assign]
        assert (await mgr.pause(info.id)).state is S.PAUSED
        assert (await mgr.run_code(info.id, "v")).text == "'ram'"

    with_manager(home, body)


def test_a_failed_touch_leaks_no_call_in_flight(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The registry cannot record activity (a full disk): the call fails, typed, and holds
    nothing, so pause and close still finish (the in-flight count once leaked and hung them)."""

    async def body(mgr: SandboxManager, engine: FakeEngine) -> None:
        info = await mgr.create()
        real = mgr.registry.touch

        def full_disk(sandbox_id: str) -> None:
            raise StorageError("database or disk is full")

        monkeypatch.setattr(mgr.registry, "touch", full_disk)
        with pytest.raises(StorageError):
            await mgr.run_command(info.id, "echo hi")
        monkeypatch.setattr(mgr.registry, "touch", real)
        assert mgr.live(info.id).busy == 0
        await asyncio.wait_for(mgr.pause(info.id), 30)  # a leak would wait here for ever
        assert (await mgr.get(info.id)).state is S.PAUSED

    with_manager(home, body)


def test_kill_is_not_stuck_behind_a_draining_pause(home: Path) -> None:
    async def body(mgr: SandboxManager, engine: FakeEngine) -> None:
        info = await mgr.create()
        stuck = asyncio.create_task(mgr.run_command(info.id, "sleep 3600"))
        await asyncio.sleep(0.05)
        pausing = asyncio.create_task(mgr.pause(info.id))  # waits for the stuck call
        await asyncio.sleep(0.05)
        assert not pausing.done()
        # a hang guard, not a timing assertion: kill must not wait for the hour-long call
        killed = await asyncio.wait_for(mgr.kill(info.id), 30)
        assert killed.state is S.STOPPED
        with pytest.raises(GuestError):
            await stuck
        with pytest.raises((StateLost, SandboxClosed)):
            await pausing
        assert engine.world.processes == {} and not mgr.directory(info.id).exists()

    with_manager(home, body)


# -- get_or_create --------------------------------------------------------------------------


def test_get_or_create_concurrent_callers_get_one(home: Path) -> None:
    async def body(mgr: SandboxManager, engine: FakeEngine) -> None:
        infos = await asyncio.gather(*(mgr.get_or_create("agent-u-42") for _ in range(10)))
        assert len({i.id for i in infos}) == 1
        assert sorted(i.reused for i in infos) == [False] + [True] * 9
        assert engine.calls.count("clone") == 1

    with_manager(home, body)


def test_get_or_create_reuses_and_wakes_paused(home: Path) -> None:
    async def body(mgr: SandboxManager, engine: FakeEngine) -> None:
        first = await mgr.get_or_create("agent", idle_pause_seconds=600)
        await mgr.run_code("agent", "notes = ['weekly']")
        await mgr.pause("agent")
        again = await mgr.get_or_create("agent")
        assert again.id == first.id and again.reused and again.state is S.RUNNING
        assert (await mgr.run_code("agent", "notes")).text == "['weekly']"
        await mgr.kill("agent")
        fresh = await mgr.get_or_create("agent")
        assert fresh.id != first.id and not fresh.reused

    with_manager(home, body)


# -- bad input: typed errors, nothing half-made, sandbox still usable -----------------------


def test_get_or_create_applies_what_can_change_and_refuses_what_cannot(home: Path) -> None:
    async def body(mgr: SandboxManager, engine: FakeEngine) -> None:
        first = await mgr.get_or_create("agent-u-7", labels={"user": "u-7"}, idle_pause_seconds=600)
        await mgr.pause(first.id)
        again = await mgr.get_or_create(
            "agent-u-7", labels={"tier": "pro"}, idle_pause_seconds=60, pause_retention_days=90
        )
        assert again.id == first.id and again.reused
        assert again.labels == {"user": "u-7", "tier": "pro"}  # updated, not replaced
        assert again.idle_pause_seconds == 60 and again.pause_retention_days == 90
        fixed: list[tuple[str, object]] = [("vcpus", 2), ("memory_mib", 1024), ("template", "x")]
        for field, value in fixed:
            with pytest.raises(Conflict) as err:
                await mgr.get_or_create("agent-u-7", labels={"x": "y"}, **{field: value})  # type: ignore[arg-type]
            assert err.value.data["field"] == field
        same = await mgr.get_or_create("agent-u-7")  # nothing given: nothing changes
        assert same.labels == {"user": "u-7", "tier": "pro"}  # the refused calls changed nothing
        assert same.idle_pause_seconds == 60 and same.pause_retention_days == 90
        assert [i.id for i in await mgr.list()] == [first.id]  # never a second sandbox

    with_manager(home, body)


def test_bad_input(home: Path) -> None:
    async def body(mgr: SandboxManager, engine: FakeEngine) -> None:
        ok = await mgr.create(name="ok")
        with pytest.raises(TemplateNotFound):
            await mgr.create(template="nope")
        with pytest.raises(InvalidName):
            await mgr.create(template="Bad Name")
        with pytest.raises(InvalidName):
            await mgr.create(name="Not Valid")
        with pytest.raises(InvalidName):
            await mgr.get_or_create("../x")
        with pytest.raises(InvalidArgument):
            await mgr.create(memory_mib=1)
        with pytest.raises(InvalidArgument):
            await mgr.create(idle_pause_seconds=0)
        with pytest.raises(InvalidArgument):
            await mgr.create(labels={"n": 1})
        with pytest.raises(Conflict):
            await mgr.create(name="ok")
        with pytest.raises(SandboxNotFound):
            await mgr.get("ghost")
        with pytest.raises(SandboxNotFound):
            await mgr.run_command("ghost", "echo")
        with pytest.raises(SandboxNotFound):
            await mgr.get(ok.id, tenant="someone-else")
        with pytest.raises(PathNotFound):
            await mgr.read_file("ok", "/nope")
        # nothing half-made; the good sandbox still works
        assert [i.id for i in await mgr.list(include_stopped=True)] == [ok.id]
        assert sorted(p.name for p in mgr.paths.sandboxes.iterdir()) == [ok.id]
        assert (await mgr.run_command("ok", "echo fine")).stdout == "fine\n"

    with_manager(home, body)


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda m, s: m.remove(s, "/"), id="remove-root"),
        pytest.param(lambda m, s: m.remove(s, "/usr"), id="remove-system-dir"),
        pytest.param(lambda m, s: m.remove(s, "/usr/lib/"), id="remove-under-system-dir"),
        pytest.param(lambda m, s: m.remove(s, "//etc"), id="remove-double-slash"),
        pytest.param(lambda m, s: m.remove(s, "usr"), id="remove-relative"),
        pytest.param(lambda m, s: m.write_file(s, "/workspace/a\x00b", "x"), id="write-nul"),
        pytest.param(lambda m, s: m.read_file(s, "/etc/pass\x00wd"), id="read-nul"),
        pytest.param(lambda m, s: m.exists(s, ""), id="exists-empty"),
        pytest.param(lambda m, s: m.list_dir(s, "/" + "a" * 5000), id="list-too-long"),
        pytest.param(lambda m, s: m.make_dir(s, "/x\x00"), id="mkdir-nul"),
    ],
)
def test_a_bad_guest_path_is_refused_before_the_guest_sees_it(
    home: Path, call: Callable[[SandboxManager, str], Awaitable[Any]]
) -> None:
    async def body(mgr: SandboxManager, engine: FakeEngine) -> None:
        info = await mgr.create()
        await mgr.write_file(info.id, "/workspace/mine.txt", "kept")
        await mgr.pause(info.id)
        with pytest.raises(InvalidArgument):
            await call(mgr, info.id)
        assert (await mgr.get(info.id)).state is S.PAUSED  # not even woken for it
        await mgr.remove(info.id, "/workspace/mine.txt")  # the agent's own files: fine
        assert not await mgr.exists(info.id, "/workspace/mine.txt")

    with_manager(home, body)


def test_killed_sandbox_is_closed(home: Path) -> None:
    async def body(mgr: SandboxManager, engine: FakeEngine) -> None:
        info = await mgr.create(name="gone")
        await mgr.pause(info.id)
        killed = await mgr.kill(info.id)
        assert killed.state is S.STOPPED
        assert not mgr.directory(info.id).exists()
        for call in (
            mgr.run_command(info.id, "echo"),
            mgr.pause(info.id),
            mgr.resume(info.id),
            mgr.read_file(info.id, "/f"),
        ):
            with pytest.raises(SandboxClosed):
                await call
        assert (await mgr.kill(info.id)).state is S.STOPPED  # idempotent
        assert await mgr.list() == []
        assert (await mgr.get("gone")).state is S.STOPPED
        assert mgr.transitions(info.id)[-1] == ("paused", "stopped")

    with_manager(home, body)


def test_a_wake_cut_short_is_settled_by_the_next_call(home: Path) -> None:
    async def body(mgr: SandboxManager, engine: FakeEngine) -> None:
        mgr.on_step = crash_at("wake:begin")  # leaves the registry in "waking"
        info = await mgr.create()
        await mgr.pause(info.id)
        with pytest.raises(Crash):
            await mgr.resume(info.id)
        mgr.on_step = None
        assert (await mgr.get(info.id)).state is S.WAKING
        # under the sandbox's lock no wake is under way: the row is settled from the machine
        # (its state file is whole -> paused), then the call goes on as usual
        paused = await mgr.pause(info.id)
        assert paused.state is S.PAUSED
        assert mgr.registry.transitions(info.id)[-1].reason == "recovered: saved state is whole"
        assert (await mgr.run_command(info.id, "echo back")).stdout == "back\n"

    with_manager(home, body)


@pytest.mark.parametrize(
    ("operation", "step"),
    [("resume", "wake"), ("resume", "connect"), ("pause", "hibernate")],
)
def test_a_step_cancelled_midway_is_settled_by_the_next_call(
    home: Path, monkeypatch: pytest.MonkeyPatch, operation: str, step: str
) -> None:
    """A caller's timeout cancels a wake while QEMU loads the state or the guest is being
    reached (or a pause while QEMU saves): the row is left ``waking`` / ``pausing`` with the
    machine half-way. The next call settles it from where the machine is, as after a
    crash, instead of refusing the sandbox (and counting it as running) until a restart."""

    async def body(mgr: SandboxManager, engine: FakeEngine) -> None:
        await mgr.create(name="agent")
        await mgr.run_code("agent", "x = 41")
        if operation == "resume":
            await mgr.pause("agent")
        entered = asyncio.Event()
        target: Any = engine if step == "connect" else FakeMachine
        real = getattr(target, step)

        async def slow(*args: Any, **kw: Any) -> Any:
            result = await real(*args, **kw)
            entered.set()
            await asyncio.sleep(3600)
            return result

        monkeypatch.setattr(target, step, slow)
        task = asyncio.ensure_future(getattr(mgr, operation)("agent"))
        await entered.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        monkeypatch.setattr(target, step, real)
        assert (await mgr.get("agent")).state in (S.WAKING, S.PAUSING)
        assert (await mgr.run_code("agent", "x + 1")).text == "42"  # settled, then served
        assert (await mgr.get("agent")).state is S.RUNNING
        await mgr.pause("agent")
        assert (await mgr.get("agent")).state is S.PAUSED

    with_manager(home, body)


# -- failures inside the engine -------------------------------------------------------------


def test_failed_create_leaves_nothing(home: Path) -> None:
    async def body(mgr: SandboxManager, engine: FakeEngine) -> None:
        engine.faults["connect"] = 1
        with pytest.raises(GuestError):
            await mgr.create(name="agent")
        assert await mgr.list() == []
        assert list(mgr.paths.sandboxes.iterdir()) == []
        assert engine.world.processes == {}
        info = await mgr.create(name="agent")  # the name was freed
        assert info.state is S.RUNNING

    with_manager(home, body)


def test_wake_failure_before_cont_stays_paused(home: Path) -> None:
    async def body(mgr: SandboxManager, engine: FakeEngine) -> None:
        info = await mgr.create()
        await mgr.run_code(info.id, "x = 7")
        await mgr.pause(info.id)
        engine.faults["wake"] = 1
        with pytest.raises(EngineError, match="stays paused"):
            await mgr.run_code(info.id, "x")
        assert (await mgr.get(info.id)).state is S.PAUSED
        assert (await mgr.run_code(info.id, "x")).text == "7"  # RAM intact

    with_manager(home, body)


def test_wake_failure_after_cont_is_state_lost(home: Path) -> None:
    async def body(mgr: SandboxManager, engine: FakeEngine) -> None:
        info = await mgr.create()
        await mgr.pause(info.id)
        engine.faults["wake:after-cont"] = 1
        with pytest.raises(StateLost) as err:
            await mgr.resume(info.id)
        assert "RAM and processes since" in err.value.data["lost"]
        assert "disk kept" in err.value.data["lost"]
        got = await mgr.get(info.id)
        assert got.state is S.ERROR and got.error == err.value.data["lost"]
        with pytest.raises(StateLost):
            await mgr.run_command(info.id, "echo")
        assert (await mgr.kill(info.id)).state is S.STOPPED  # error -> stopped

    with_manager(home, body)


def test_refused_pause_rolls_back_to_running(home: Path) -> None:
    async def body(mgr: SandboxManager, engine: FakeEngine) -> None:
        info = await mgr.create()
        await mgr.run_code(info.id, "x = 1")
        engine.faults["hibernate:refused"] = 1
        with pytest.raises(EngineError):
            await mgr.pause(info.id)
        assert (await mgr.get(info.id)).state is S.RUNNING
        assert (await mgr.run_code(info.id, "x")).text == "1"
        assert mgr.transitions(info.id)[-2:] == [("running", "pausing"), ("pausing", "running")]
        assert (await mgr.pause(info.id)).state is S.PAUSED  # and a retry works

    with_manager(home, body)


def test_guest_silent_after_wake_is_paused_again(home: Path) -> None:
    async def body(mgr: SandboxManager, engine: FakeEngine) -> None:
        info = await mgr.create()
        await mgr.run_code(info.id, "x = 'safe'")
        await mgr.pause(info.id)
        engine.faults["connect"] = 1  # QEMU runs, the agent does not answer
        with pytest.raises(GuestError, match="paused again"):
            await mgr.resume(info.id)
        assert (await mgr.get(info.id)).state is S.PAUSED
        assert engine.world.processes == {}
        assert (await mgr.run_code(info.id, "x")).text == "'safe'"
        assert mgr.transitions(info.id)[-4:] == [
            ("paused", "waking"),
            ("waking", "paused"),
            ("paused", "waking"),
            ("waking", "running"),
        ]

    with_manager(home, body)


@pytest.mark.parametrize(
    ("fault", "outcome"),
    [
        pytest.param("hibernate:before-save", S.ERROR, id="before-save"),
        pytest.param("hibernate:after-save", S.PAUSED, id="after-save"),
    ],
)
def test_qemu_dies_during_pause(home: Path, fault: str, outcome: S) -> None:
    async def body(mgr: SandboxManager, engine: FakeEngine) -> None:
        info = await mgr.create()
        await mgr.run_code(info.id, "x = 'kept'")
        engine.faults[fault] = 1
        if outcome is S.ERROR:
            with pytest.raises(StateLost):
                await mgr.pause(info.id)
        else:
            assert (await mgr.pause(info.id)).state is S.PAUSED
            assert (await mgr.run_code(info.id, "x")).text == "'kept'"
        assert mgr.transitions(info.id)[2:4] == [("running", "pausing"), ("pausing", outcome.value)]

    with_manager(home, body)


def test_qemu_dies_while_running(home: Path) -> None:
    async def body(mgr: SandboxManager, engine: FakeEngine) -> None:
        info = await mgr.create()
        engine.crash(mgr.directory(info.id))
        with pytest.raises(StateLost) as err:  # the call that saw it die says what was lost
            await mgr.run_command(info.id, "echo")
        assert isinstance(err.value.__cause__, GuestError)
        assert (await mgr.get(info.id)).state is S.ERROR
        with pytest.raises(StateLost):
            await mgr.run_command(info.id, "echo")

    with_manager(home, body)


@pytest.mark.parametrize(
    ("operation", "dst", "then"),
    [
        pytest.param("pause", S.PAUSED, S.PAUSED, id="pause"),
        pytest.param("resume", S.RUNNING, S.RUNNING, id="wake"),
    ],
)
def test_a_step_whose_registry_write_failed_is_settled_by_the_next_call(
    home: Path, monkeypatch: pytest.MonkeyPatch, operation: str, dst: S, then: S
) -> None:
    """The registry goes away (PostgreSQL restarting) just as a pause or wake records its end:
    the caller gets the typed StorageError, the row is left ``pausing`` / ``waking``, and the
    next call on the sandbox settles it from where the machine is, losing nothing (it used to
    answer InvalidState until a restart)."""

    async def body(mgr: SandboxManager, engine: FakeEngine) -> None:
        await mgr.create(name="agent")
        await mgr.run_code("agent", "x = 41")
        if operation == "resume":
            await mgr.pause("agent")
        real = mgr.registry.set_state
        failed: list[S] = []

        def flaky(sandbox_id: str, src: S, to: S, **kw: Any) -> Any:
            if to is dst and not failed:
                failed.append(to)
                raise StorageError("cannot connect to the registry database (a test)")
            return real(sandbox_id, src, to, **kw)

        monkeypatch.setattr(mgr.registry, "set_state", flaky)
        with pytest.raises(StorageError):
            await getattr(mgr, operation)("agent")
        assert failed and (await mgr.get("agent")).state in (S.PAUSING, S.WAKING)
        assert (await mgr.run_code("agent", "x + 1")).text == "42"  # settled, then served
        assert (await mgr.get("agent")).state is S.RUNNING
        await mgr.pause("agent")
        assert (await mgr.get("agent")).state is S.PAUSED

    with_manager(home, body)


# -- idle pause -----------------------------------------------------------------------------


def test_idle_sweep(home: Path) -> None:
    async def body(mgr: SandboxManager, engine: FakeEngine) -> None:
        idle = await mgr.create(idle_pause_seconds=5)
        never = await mgr.create()
        busy = await mgr.create(idle_pause_seconds=5)
        t0 = (await mgr.get(idle.id)).last_active_at.timestamp()
        assert await mgr.idle_sweep(now=t0 + 1) == []
        slow = asyncio.create_task(mgr.run_command(busy.id, "sleep 0.2"))
        await asyncio.sleep(0.05)
        assert await mgr.idle_sweep(now=t0 + 100) == [idle.id]  # busy one skipped
        await slow
        assert await mgr.idle_sweep(now=t0 + 1000) == [busy.id]
        assert (await mgr.get(never.id)).state is S.RUNNING
        assert mgr.registry.transitions(idle.id)[-1].reason == "idle"
        # a call wakes it and restarts the idle clock
        await mgr.run_command(idle.id, "echo")
        assert await mgr.idle_sweep() == []

    with_manager(home, body)


def test_the_supervisor_trims_the_logs_of_running_sandboxes(home: Path) -> None:
    async def body(mgr: SandboxManager, engine: FakeEngine) -> None:
        running = await mgr.create()
        paused = await mgr.create()
        await mgr.pause(paused.id)
        task = asyncio.create_task(mgr.supervise(interval=0.01))
        await asyncio.sleep(0.1)
        task.cancel()
        trimmed = set(engine.world.trimmed)
        assert mgr.directory(running.id) in trimmed
        assert mgr.directory(paused.id) not in trimmed  # no QEMU writes its console

    with_manager(home, body)


def test_supervisor_pauses_idle_sandboxes(home: Path) -> None:
    async def body(mgr: SandboxManager, engine: FakeEngine) -> None:
        await mgr.start(interval=0.05)
        info = await mgr.create(idle_pause_seconds=1)
        mgr.registry.touch(info.id, 0.0)  # idle since 1970
        for _ in range(100):
            if (await mgr.get(info.id)).state is S.PAUSED:
                break
            await asyncio.sleep(0.02)
        assert (await mgr.get(info.id)).state is S.PAUSED

    with_manager(home, body)


# -- tenants, labels, close -----------------------------------------------------------------


def test_list_labels_and_tenants(home: Path) -> None:
    async def body(mgr: SandboxManager, engine: FakeEngine) -> None:
        a = await mgr.create(name="a", labels={"user": "u1"})
        await mgr.create(name="b", labels={"user": "u2"})
        c = await mgr.create(name="a", labels={"user": "u1"}, tenant="acme")
        assert [i.id for i in await mgr.list({"user": "u1"})] == [a.id]
        assert [i.id for i in await mgr.list({"user": "u1"}, tenant="acme")] == [c.id]
        assert (await mgr.get("a", tenant="acme")).id == c.id
        with pytest.raises(SandboxNotFound):
            await mgr.run_command(c.id, "echo")  # default tenant cannot reach acme's id

    with_manager(home, body)


def test_close_pauses_running_sandboxes(home: Path) -> None:
    async def main() -> None:
        mgr, engine = manager(home)
        info = await mgr.create()
        await mgr.close()
        assert engine.world.processes == {}
        mgr2, _ = manager(home, engine.world)
        assert (await mgr2.get(info.id)).state is S.PAUSED
        await mgr2.close()

    run(main())


# -- restart: reconcile the registry with the directories -----------------------------------


def test_restart_reattaches_running_and_keeps_paused(home: Path) -> None:
    async def main() -> None:
        world = FakeWorld()
        a, _ = manager(home, world)
        up = await a.create(name="up")
        down = await a.create(name="down")
        await a.run_code("up", "x = 1")
        await a.run_code("down", "y = 2")
        await a.pause("down")
        # manager A dies without closing; its QEMU processes live on
        b, engine = manager(home, world)
        await b.start(supervise=False)
        assert (await b.get("up")).state is S.RUNNING
        assert (await b.get("down")).state is S.PAUSED
        assert "attach" in engine.calls
        assert (await b.run_code("up", "x")).text == "1"
        assert (await b.run_code("down", "y")).text == "2"
        assert b.transitions(up.id) == CREATE
        assert b.transitions(down.id) == CREATE + PAUSE + WAKE
        await b.close()

    run(main())


def test_restart_without_start_attaches_on_first_use(home: Path) -> None:
    async def main() -> None:
        world = FakeWorld()
        a, _ = manager(home, world)
        info = await a.create()
        await a.run_code(info.id, "x = 'still here'")
        b, engine = manager(home, world)  # start() forgotten
        await b.pause(info.id)  # must hibernate the live machine, not lose it
        assert (await b.run_code(info.id, "x")).text == "'still here'"
        assert "attach" in engine.calls
        await b.close()

    run(main())


def test_restart_with_silent_guest_saves_ram(home: Path) -> None:
    async def main() -> None:
        world = FakeWorld()
        a, _ = manager(home, world)
        info = await a.create()
        await a.run_code(info.id, "x = 'saved'")
        b, engine = manager(home, world)
        engine.faults["connect"] = 1  # QEMU alive, its agent does not answer the new manager
        await b.start(supervise=False)
        assert (await b.get(info.id)).state is S.PAUSED  # hibernated, not killed
        assert (await b.run_code(info.id, "x")).text == "'saved'"
        await b.close()

    run(main())


def test_restart_finishes_an_interrupted_kill(home: Path) -> None:
    async def main() -> None:
        world = FakeWorld()
        a, _ = manager(home, world)
        info = await a.create()
        # the kill was recorded, then the process died before QEMU and the files were gone
        a.registry.set_state(info.id, S.RUNNING, S.STOPPED, reason="kill")
        b, _ = manager(home, world)
        await b.start(supervise=False)
        assert not b.directory(info.id).exists()
        assert world.processes == {}
        await b.close()

    run(main())


def test_restart_marks_dead_running_sandbox_lost(home: Path) -> None:
    async def main() -> None:
        world = FakeWorld()
        a, engine = manager(home, world)
        info = await a.create()
        await a.write_file(info.id, "/kept.txt", "disk")
        engine.crash(a.directory(info.id))  # QEMU dies with the manager
        b, _ = manager(home, world)
        await b.start(supervise=False)
        got = await b.get(info.id)
        assert got.state is S.ERROR and got.error and "disk kept" in got.error
        assert (b.directory(info.id) / "disk" / "kept.txt").read_text() == "disk"
        with pytest.raises(StateLost):
            await b.run_code(info.id, "1")
        await b.close()

    run(main())


@pytest.mark.parametrize(
    ("step", "qemu_dies", "state", "ram_kept"),
    [
        pytest.param("pause:begin", False, S.PAUSED, True, id="pause-begin"),
        pytest.param("pause:begin", True, S.ERROR, False, id="pause-begin-qemu-dead"),
        pytest.param("pause:saved", False, S.PAUSED, True, id="pause-saved"),
        pytest.param("wake:begin", False, S.PAUSED, True, id="wake-begin"),
        pytest.param("wake:woken", False, S.RUNNING, True, id="wake-woken"),
        pytest.param("wake:woken", True, S.ERROR, False, id="wake-woken-qemu-dead"),
        pytest.param("create:woken", False, S.STOPPED, False, id="create-woken"),
    ],
)
def test_restart_resolves_half_done_steps(
    home: Path, step: str, qemu_dies: bool, state: S, ram_kept: bool
) -> None:
    async def main() -> None:
        world = FakeWorld()
        a, engine = manager(home, world)
        if step.startswith("create"):
            a.on_step = crash_at(step)
            with pytest.raises(Crash):
                await a.create(name="x")
            sandbox_id = a.registry.list()[0].id
        else:
            sandbox_id = (await a.create(name="x")).id
            await a.run_code("x", "v = 'ram'")
            if step.startswith("wake"):
                await a.pause("x")
            a.on_step = crash_at(step)
            with pytest.raises(Crash):
                await (a.pause("x") if step.startswith("pause") else a.resume("x"))
        if qemu_dies:
            engine.crash(a.directory(sandbox_id))
        b, _ = manager(home, world)
        await b.start(supervise=False)
        got = await b.get(sandbox_id)
        assert got.state is state
        if ram_kept:
            assert (await b.run_code(sandbox_id, "v")).text == "'ram'"
        elif state is S.ERROR:
            with pytest.raises(StateLost):
                await b.run_code(sandbox_id, "v")
        await b.close()

    run(main())


# -- the same on real QEMU ------------------------------------------------------------------


@pytest.mark.qemu
def test_qemu_lifecycle_keeps_ram_and_holds_nothing_paused(qemu_home: Path) -> None:
    async def main() -> None:
        mgr = SandboxManager(paths(qemu_home))
        try:
            info = await mgr.create(name="agent", labels={"user": "u-42"})
            assert mgr.transitions(info.id) == CREATE
            await mgr.run_code("agent", "notes = ['prefers weekly summaries']")
            await mgr.write_file("agent", "/workspace/ledger.csv", "a,b\n1,2\n")
            await mgr.run_command("agent", "nohup sleep 1000 >/dev/null 2>&1 &", background=True)
            await mgr.pause("agent")
            directory = mgr.directory(info.id)
            assert mgr.engine.inspect(directory).has_state  # durable when the pause returns
            await settle_exit(directory.resolve())  # QEMU, told to quit, exits on its own time
            assert procs_on(directory) == []  # no QEMU, so no RAM and no CPU
            assert mgr.engine.inspect(directory).has_state
            result = await mgr.run_code("agent", "notes")  # wake on request
            assert result.text == "['prefers weekly summaries']"
            assert mgr.transitions(info.id) == CREATE + PAUSE + WAKE
            assert await mgr.read_file("agent", "/workspace/ledger.csv") == b"a,b\n1,2\n"
            ps = await mgr.run_command("agent", "pgrep -f 'sleep 1000'")
            assert ps.exit_code == 0  # the process survived hibernation
            await mgr.kill("agent")
            assert not directory.exists() and procs_on(directory) == []
            with pytest.raises(SandboxClosed):
                await mgr.run_code(info.id, "notes")
        finally:
            await mgr.close()

    run(main())


@pytest.mark.qemu
def test_qemu_get_or_create_and_fresh_randomness(qemu_home: Path) -> None:
    async def main() -> None:
        mgr = SandboxManager(paths(qemu_home))
        try:
            infos = await asyncio.gather(*(mgr.get_or_create("shared") for _ in range(3)))
            assert len({i.id for i in infos}) == 1
            assert sorted(i.reused for i in infos) == [False, True, True]
            other = await mgr.create()
            code = "import random; random.random()"
            a = (await mgr.run_code("shared", code)).text
            b = (await mgr.run_code(other.id, code)).text
            assert a != b  # clones of one snapshot were reseeded
            for sandbox in ("shared", other.id):
                await mgr.kill(sandbox)
        finally:
            await mgr.close()

    run(main())


@pytest.mark.qemu
def test_qemu_bad_input(qemu_home: Path) -> None:
    async def main() -> None:
        mgr = SandboxManager(paths(qemu_home))
        try:
            with pytest.raises(TemplateNotFound):
                await mgr.create(template="no-such-template")
            with pytest.raises(InvalidName):
                await mgr.create(template="No Such")
            with pytest.raises(InvalidArgument):
                await mgr.create(memory_mib=2048)  # the template's snapshot is 512 MiB
            with pytest.raises(SandboxNotFound):
                await mgr.run_command("ghost", "true")
            assert await mgr.list(include_stopped=True) == []
            assert list(mgr.paths.sandboxes.iterdir()) == []
        finally:
            await mgr.close()

    run(main())


@pytest.mark.qemu
def test_qemu_restart_reattaches_running_keeps_paused(qemu_home: Path) -> None:
    async def first() -> tuple[str, str]:
        mgr = SandboxManager(paths(qemu_home))
        up = await mgr.create(name="up")
        down = await mgr.create(name="down")
        await mgr.run_code("up", "x = 'up'")
        await mgr.run_code("down", "y = 'down'")
        await mgr.pause("down")
        await mgr.close(pause=False)  # the server goes away; QEMU of "up" keeps running
        return up.id, down.id

    async def second(up: str, down: str) -> None:
        mgr = SandboxManager(paths(qemu_home))
        try:
            await mgr.start(supervise=False)
            assert (await mgr.get(up)).state is S.RUNNING
            assert (await mgr.get(down)).state is S.PAUSED
            assert (await mgr.run_code(up, "x")).text == "'up'"
            assert (await mgr.run_code(down, "y")).text == "'down'"
        finally:
            for sandbox in (up, down):
                await mgr.kill(sandbox)
            await mgr.close()

    up, down = run(first())
    run(second(up, down))


@pytest.mark.qemu
def test_qemu_idle_pause_then_wake_on_request(qemu_home: Path) -> None:
    async def main() -> None:
        mgr = SandboxManager(paths(qemu_home))
        try:
            await mgr.start(interval=0.1)  # the supervisor runs idle_sweep
            info = await mgr.get_or_create("agent-u-42", idle_pause_seconds=600)
            await mgr.run_code("agent-u-42", "notes = ['prefers weekly summaries']")
            mgr.registry.touch(info.id, time.time() - 601)  # ten idle minutes later
            for _ in range(300):
                if (await mgr.get(info.id)).state is S.PAUSED:
                    break
                await asyncio.sleep(0.05)
            assert (await mgr.get(info.id)).state is S.PAUSED
            assert mgr.registry.transitions(info.id)[-1].reason == "idle"
            again = await mgr.get_or_create("agent-u-42")
            assert again.reused and again.id == info.id and again.state is S.RUNNING
            result = await mgr.run_code("agent-u-42", "notes")
            assert result.text == "['prefers weekly summaries']"
            await mgr.kill(info.id)
        finally:
            await mgr.close()

    run(main())
