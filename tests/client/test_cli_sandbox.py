"""``torpor sandbox ...`` / ``torpor run`` through the SDK against an in-process server."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
import typer
from typer.testing import CliRunner

from torpor.cli import sandbox as sandbox_cli
from torpor.client import set_default_runtime

if TYPE_CHECKING:
    from tests.client.conftest import Served


@pytest.fixture
def cli(served: Served) -> Iterator[typer.Typer]:
    app = typer.Typer()
    sandbox_cli.register(app)
    set_default_runtime(served.runtime)
    yield app
    set_default_runtime(None)


def test_sandbox_commands(cli: typer.Typer, served: Served) -> None:
    runner = CliRunner()
    r = runner.invoke(cli, ["sandbox", "create", "agent-7", "--label", "user=u-7"])
    assert r.exit_code == 0, r.output
    assert "agent-7" in r.output and "user=u-7" in r.output
    r = runner.invoke(cli, ["sandbox", "ls", "--label", "user=u-7"])
    assert "agent-7" in r.output and "running" in r.output
    assert "paused" in runner.invoke(cli, ["sandbox", "pause", "agent-7"]).output
    assert "running" in runner.invoke(cli, ["sandbox", "resume", "agent-7"]).output
    assert "agent-7" in runner.invoke(cli, ["sandbox", "get", "agent-7"]).output

    r = runner.invoke(cli, ["sandbox", "exec", "agent-7", "--", "echo", "hi", "there"])
    assert r.exit_code == 0 and r.output == "hi\nthere\n"
    assert runner.invoke(cli, ["sandbox", "exec", "agent-7", "--", "fail"]).exit_code == 3

    assert runner.invoke(cli, ["run", "agent-7", "x = 6 * 7"]).exit_code == 0
    r = runner.invoke(cli, ["run", "agent-7", "x"])
    assert r.exit_code == 0 and r.output.strip() == "42"

    assert runner.invoke(cli, ["sandbox", "kill", "agent-7"]).exit_code == 0
    assert "agent-7" not in runner.invoke(cli, ["sandbox", "ls"]).output
    assert "agent-7" in runner.invoke(cli, ["sandbox", "ls", "--all"]).output
