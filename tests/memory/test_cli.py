"""``torpor memory``: each command is one library call; JSON output for programs."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from torpor.cli import _load, app

_load()
runner = CliRunner()


def run(home: Path, *args: str) -> str:
    result = runner.invoke(
        app,
        ["memory", "--home", str(home), "--scope", "app/a/user/u", *args],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    return result.stdout


def test_cli_round_trip(tmp_path: Path) -> None:
    home = tmp_path / "home"
    run(home, "remember", "prefers weekly summaries", "--key", "cadence")
    out = json.loads(
        run(
            home,
            "--json",
            "remember",
            "prefers daily summaries",
            "--key",
            "cadence",
            "--meta",
            '{"src": "cli"}',
        )
    )
    assert out["key"] == "cadence" and out["metadata"] == {"src": "cli"}
    run(home, "log", "user", "Can you send me summaries every week?", "--session", "s1")
    hits = json.loads(
        run(
            home,
            "--json",
            "recall",
            "how often should I send summaries?",
            "-k",
            "3",
            "--kind",
            "fact",
        )
    )
    assert [h["text"] for h in hits] == ["prefers daily summaries"] and "scores" in hits[0]
    assert "daily" in run(home, "recall", "summaries")
    hist = json.loads(run(home, "--json", "history", "cadence"))
    assert [h["text"] for h in hist] == ["prefers weekly summaries", "prefers daily summaries"]
    ctx = json.loads(run(home, "--json", "context", "summaries", "-b", "50"))
    assert ctx["tokens"] <= 50 and ctx["ids"]
    dump = tmp_path / "u.jsonl"
    run(home, "export", str(dump))
    assert json.loads(dump.read_text().splitlines()[0])["type"] == "torpor-memory"
    result = runner.invoke(
        app,
        ["memory", "--home", str(home), "--scope", "app/a/user/v", "--json", "import", str(dump)],
    )
    assert result.exit_code == 0 and json.loads(result.stdout) == {"imported": 3}
    erased = json.loads(run(home, "--json", "forget", out["id"]))
    assert erased == {"erased": 1}
    assert json.loads(run(home, "--json", "forget", "--yes"))["erased"] == 2


def test_cli_errors_are_typed(tmp_path: Path) -> None:
    from torpor.errors import InvalidArgument

    result = runner.invoke(app, ["memory", "--home", str(tmp_path), "remember", ""])
    assert result.exit_code != 0 and isinstance(result.exception, InvalidArgument)
    result = runner.invoke(app, ["memory", "--home", str(tmp_path), "forget"])
    assert result.exit_code != 0


def test_text_with_brackets_is_printed_as_written(tmp_path: Path) -> None:
    # A table cell is the user's text, not rich markup: "[/]" ended the command with a
    # MarkupError and "[x]" vanished from the listing.
    home = tmp_path / "home"
    run(home, "remember", "[x] call [/] back", "--key", "todo")
    assert "[x] call [/] back" in run(home, "recall", "call back")
    assert "[x] call [/] back" in run(home, "history", "todo")
