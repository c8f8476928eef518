"""A deleted or truncated registry is not silent: the manager refuses to start over orphaned
sandbox directories, and ``torpor doctor --repair`` gives them their rows back."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.sandbox.fakes import FakeEngine, FakeWorld
from torpor.config import paths
from torpor.errors import CorruptData
from torpor.sandbox.manager import SandboxManager
from torpor.sandbox.models import SandboxState as S


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
