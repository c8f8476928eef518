"""A deleted or truncated registry is not silent: the manager refuses to start over orphaned
sandbox directories, and ``torpor doctor --repair`` gives them their rows back."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.sandbox.fakes import FakeEngine, FakeWorld
from torpor.config import paths
from torpor.errors import CorruptData
from torpor.sandbox.manager import SandboxManager
from torpor.sandbox.models import SandboxState as S
from torpor.sandbox.registry import Registry
from torpor.sandbox.registry.repair import repair


def _lose_registry(home: Path, how: str) -> None:
    db = paths(home).registry
    for extra in (db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")):
        extra.unlink(missing_ok=True)
    if how == "deleted":
        db.unlink()
    else:
        db.write_bytes(b"")


@pytest.mark.parametrize("how", ["deleted", "truncated"])
def test_a_lost_registry_refuses_to_start_then_is_repaired(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    home = tmp_path / "home"
    world = FakeWorld()

    async def before() -> tuple[str, str]:
        m = SandboxManager(paths(home), engine=FakeEngine(world))
        paused = await m.create(name="agent-u-1")
        await m.write_file(paused.id, "/workspace/notes.md", "kept")
        await m.pause(paused.id)
        crashed = await m.create(name="agent-u-2")
        await m.close(pause=False)  # its QEMU is gone with the manager: RAM lost
        return paused.id, crashed.id

    paused_id, crashed_id = asyncio.run(before())
    _lose_registry(home, how)

    async def start() -> SandboxManager:
        m = SandboxManager(paths(home), engine=FakeEngine(world))
        try:
            await m.start(supervise=False)
        except BaseException:
            await m.close(pause=False)
            raise
        return m

    with pytest.raises(CorruptData, match="doctor --repair") as err:
        asyncio.run(start())
    assert sorted(err.value.data["orphans"]) == sorted([paused_id, crashed_id])
    assert (paths(home).sandboxes / paused_id / "state").exists()  # nothing touched

    monkeypatch.setenv("TORPOR_HOME", str(home))
    from torpor.cli import _load, app

    _load()
    result = CliRunner().invoke(app, ["doctor", "--repair"])
    assert result.exit_code == 0, result.output
    assert "2 sandbox row(s) rebuilt" in result.output

    async def after() -> None:
        m = await start()
        try:
            assert (await m.get(paused_id)).state is S.PAUSED
            assert (await m.get(crashed_id)).state is S.ERROR
            assert await m.read_file(paused_id, "/workspace/notes.md") == b"kept"  # woken
        finally:
            await m.close(pause=False)

    asyncio.run(after())
    again = CliRunner().invoke(app, ["doctor", "--repair"])
    assert "nothing to repair" in again.output


def test_a_rebuilt_pause_is_not_expired_by_the_lost_retention(tmp_path: Path) -> None:
    """A rebuilt paused sandbox whose pause is older than the default retention (its lost row
    kept it longer) is not expired at once: GC would delete the disk the repair saved."""
    home = paths(tmp_path / "home").ensure()
    directory = home.sandboxes / "sbx-0123456789ab"
    directory.mkdir(parents=True)
    (directory / "machine.json").write_text(json.dumps({"template": "python", "vcpus": 2}))
    (directory / "ram").write_bytes(b"")
    (directory / "state").write_bytes(b"QEVM")
    paused = time.time() - 40 * 86400  # paused 40 days ago; the default retention is 30
    os.utime(directory / "state", (paused, paused))
    registry = Registry(home.registry)
    try:
        (made,) = repair(home, registry)
        rec = registry.get(made.id)
        assert rec.state is S.PAUSED and rec.paused_at == pytest.approx(paused)
        assert rec.expires_at is not None and rec.expires_at > time.time()
    finally:
        registry.close()


@pytest.mark.parametrize(
    "machine_json",
    ["[1, 2]", '{"vcpus": "two"}', '{"memory_mib": null}', '{"vcpus": -4}', '{"template": 3}'],
)
def test_repair_takes_a_machine_json_that_says_wrong_for_unknown(
    tmp_path: Path, machine_json: str
) -> None:
    """A machine.json that reads as JSON but not as a machine (an escaped QEMU can rewrite
    it) is one that says nothing: the row is rebuilt with the defaults, not a raw
    AttributeError / ValueError that stops the repair and so the server's start."""
    home = paths(tmp_path / "home").ensure()
    directory = home.sandboxes / "sbx-0123456789ab"
    directory.mkdir(parents=True)
    (directory / "machine.json").write_text(machine_json)
    registry = Registry(home.registry)
    try:
        (made,) = repair(home, registry)
        rec = registry.get(made.id)
        assert rec.state is S.ERROR and rec.template == "python"
        assert (rec.vcpus, rec.memory_mib) == (1, 512)
    finally:
        registry.close()
