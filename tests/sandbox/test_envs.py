"""Environment variables and secrets given at create (``envs=``): every command and the
interpreter get them, the sandbox's info never shows them (real manager and registry, fake
engine; the guest side is covered by the qemu test in tests/client/test_readme.py)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.sandbox.fakes import FakeEngine, FakeWorld
from torpor.config import paths
from torpor.errors import InvalidArgument
from torpor.sandbox.manager import SandboxManager
from torpor.server.app import create_app

SECRET = "s3cr3t-value-\u00e9"


@pytest.fixture(autouse=True)
def _clean_env() -> object:
    # the fake engine's interpreter runs in this process: undo what it set
    yield
    for key in ("TORPOR_TEST_API_KEY", "TORPOR_TEST_OTHER"):
        os.environ.pop(key, None)


def test_envs_reach_commands_and_the_interpreter_and_stay_secret(tmp_path: Path) -> None:
    world = FakeWorld()

    async def first() -> str:
        m = SandboxManager(paths(tmp_path), engine=FakeEngine(world))
        await m.start(supervise=False)
        info = await m.create(name="e", envs={"TORPOR_TEST_API_KEY": SECRET})
        assert SECRET not in info.model_dump_json() and "envs" not in info.model_dump()
        got = await m.run_command(info.id, "printenv TORPOR_TEST_API_KEY")
        assert got.stdout == SECRET + "\n"
        mine = await m.run_command(
            info.id, "printenv TORPOR_TEST_API_KEY", env={"TORPOR_TEST_API_KEY": "mine"}
        )
        assert mine.stdout == "mine\n"  # a command's own env wins
        out = await m.run_code(info.id, "import os\nos.environ['TORPOR_TEST_API_KEY']")
        assert out.results[0].data["text/plain"] == repr(SECRET)
        names = await m.run_code(info.id, "sorted(k for k in dir() if 'torpor' in k)")
        assert names.results[0].data["text/plain"] == "[]"  # nothing left behind
        for listed in await m.list():
            assert SECRET not in listed.model_dump_json()
        # get_or_create applies new ones
        await m.get_or_create("e", envs={"TORPOR_TEST_OTHER": "2"})
        got = await m.run_command(info.id, "printenv TORPOR_TEST_OTHER")
        assert got.stdout == "2\n"
        await m.close()
        return info.id

    sid = asyncio.run(first())

    async def after_restart() -> None:
        m = SandboxManager(paths(tmp_path), engine=FakeEngine(world))
        await m.start(supervise=False)
        got = await m.run_command(sid, "printenv TORPOR_TEST_OTHER")  # wakes it
        assert got.stdout == "2\n"
        await m.close()

    asyncio.run(after_restart())


def test_envs_over_http_are_not_echoed(tmp_path: Path) -> None:
    manager = SandboxManager(paths(tmp_path), engine=FakeEngine())
    with TestClient(create_app(manager, supervise=False)) as c:
        r = c.post("/v1/sandboxes", json={"name": "h", "envs": {"TORPOR_TEST_API_KEY": SECRET}})
        assert r.status_code == 201, r.text
        assert SECRET not in r.text
        assert SECRET not in c.get("/v1/sandboxes/h").text
        assert SECRET not in c.get("/v1/sandboxes").text
        bad = c.post("/v1/sandboxes", json={"envs": {"A=B": "x"}})
        assert bad.status_code == 400 and SECRET not in bad.text


def test_bad_envs_are_refused_before_anything_is_made(tmp_path: Path) -> None:
    async def main() -> None:
        m = SandboxManager(paths(tmp_path), engine=FakeEngine())
        await m.start(supervise=False)
        with pytest.raises(InvalidArgument):
            await m.create(name="x", envs={"": "v"})
        assert await m.list() == []
        await m.close()

    asyncio.run(main())
