"""Lifecycle controls on the real manager and registry (fake engine, no VMs): settings that
change on a live sandbox, owned disk, and the events a user follows (kept across a restart)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from tests.sandbox.fakes import FakeEngine, FakeWorld
from torpor.config import paths
from torpor.errors import InvalidArgument, SandboxClosed, SandboxNotFound
from torpor.sandbox.checkpoints import Checkpoints
from torpor.sandbox.manager import SandboxManager
from torpor.sandbox.models import SandboxState as S
from torpor.sandbox.registry.lifecycle import event_kind


def test_events_follow_the_lifecycle_and_survive_a_restart(tmp_path: Path) -> None:
    world = FakeWorld()

    async def first() -> tuple[str, str]:
        m = SandboxManager(paths(tmp_path), engine=FakeEngine(world))
        await m.start(supervise=False)
        a = await m.create(name="agent-a")
        other = await m.create(name="agent-o", tenant="other")
        mark = m.events_mark()
        await m.pause(a.id)
        assert m.events_mark() != mark  # followers see that something happened
        await m.run_code(a.id, "x = 1")  # wake on request
        await m.update(a.id, idle_pause_seconds=1)
        await m.idle_sweep(now=time.time() + 5)  # idle pause
        await m.kill(a.id)
        await m.close()
        return a.id, other.id

    a_id, other_id = asyncio.run(first())

    async def second() -> None:
        m = SandboxManager(paths(tmp_path), engine=FakeEngine(world))
        await m.start(supervise=False)
        events, nxt = await m.events()
        got = [(e.sandbox_id, e.name, e.kind, e.state, e.reason) for e in events]
        assert got == [
            (a_id, "agent-a", "create", S.RUNNING, "created"),
            (a_id, "agent-a", "pause", S.PAUSED, "pause"),
            (a_id, "agent-a", "wake", S.RUNNING, "wake on request"),
            (a_id, "agent-a", "pause", S.PAUSED, "idle"),
            (a_id, "agent-a", "kill", S.STOPPED, "kill"),
        ]  # nothing of the other tenant's sandbox
        assert [e.seq for e in events] == sorted(e.seq for e in events)
        later, again = await m.events(after=events[2].seq)
        assert [e.kind for e in later] == ["pause", "kill"] and again == nxt
        assert (await m.events(after=nxt)) == ([], nxt)
        theirs, _ = await m.events(tenant="other")
        # the first manager paused it on close
        assert [(e.sandbox_id, e.kind) for e in theirs] == [
            (other_id, "create"),
            (other_id, "pause"),
        ]
        only, _ = await m.events(sandbox="agent-a")
        assert len(only) == 5
        with pytest.raises(SandboxNotFound):
            await m.events(sandbox="agent-o")  # another tenant's name
        await m.close()

    asyncio.run(second())


def test_an_expired_pause_is_an_expire_event(tmp_path: Path) -> None:
    async def main() -> None:
        m = SandboxManager(paths(tmp_path), engine=FakeEngine())
        await m.start(supervise=False)
        info = await m.create(name="old", pause_retention_days=1)
        await m.pause(info.id)
        report = await Checkpoints(m).collect_garbage(now=time.time() + 2 * 86400)
        assert report.expired_sandboxes == [info.id]
        events, _ = await m.events()
        assert [(e.kind, e.reason) for e in events][-1] == ("expire", "expired")
        await m.close()

    asyncio.run(main())


@pytest.mark.parametrize(
    ("src", "dst", "reason", "kind"),
    [
        pytest.param(None, S.CREATING, "create", None, id="first-row"),
        pytest.param(S.CREATING, S.RUNNING, "fork", "create", id="fork"),
        pytest.param(S.PAUSING, S.RUNNING, "pause failed", "pause-failed", id="pause-rollback"),
        pytest.param(S.WAKING, S.PAUSED, "wake failed", "wake-failed", id="wake-rollback"),
        pytest.param(S.RUNNING, S.ERROR, "qemu died", "error", id="lost"),
        pytest.param(S.ERROR, S.STOPPED, "create failed", None, id="failed-create"),
        pytest.param(S.ERROR, S.STOPPED, "kill", "kill", id="kill-lost"),
        pytest.param(S.RUNNING, S.PAUSING, "idle", None, id="step"),
    ],
)
def test_event_kinds(src: S | None, dst: S, reason: str, kind: str | None) -> None:
    assert event_kind(src, dst, reason) == kind


def test_update_settings_and_owned_disk(tmp_path: Path) -> None:
    async def main() -> None:
        m = SandboxManager(paths(tmp_path), engine=FakeEngine())
        await m.start(supervise=False)
        info = await m.create(name="u1", labels={"user": "u-1"})
        await m.pause(info.id)
        new = await m.update("u1", labels={"user": "jordan@example.com", "tier": "pro"})
        assert new.labels == {"user": "jordan@example.com", "tier": "pro"}
        assert new.state is S.PAUSED  # not woken
        assert (await m.update("u1", idle_pause_seconds=600)).idle_pause_seconds == 600
        assert (await m.get("u1")).labels["tier"] == "pro"  # a field left out stays
        assert (await m.update("u1", idle_pause_seconds=0)).idle_pause_seconds is None
        with pytest.raises(InvalidArgument):
            await m.update("u1", idle_pause_seconds=-1)
        with pytest.raises(InvalidArgument):
            await m.update("u1", labels={"a=b": "c"})
        assert (await m.get("u1")).labels["tier"] == "pro"  # nothing changed by a bad call

        size = sum(
            p.stat().st_blocks * 512
            for p in (tmp_path / "sandboxes" / info.id).rglob("*")
            if p.is_file()
        )
        assert size > 0
        assert (await m.get("u1")).owned_bytes == size
        assert [i.owned_bytes for i in await m.list()] == [size]
        await m.kill("u1")
        assert (await m.get(info.id)).owned_bytes == 0
        with pytest.raises(SandboxClosed):
            await m.update(info.id, idle_pause_seconds=5)
        await m.close()

    asyncio.run(main())
