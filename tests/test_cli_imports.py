"""Start-up cost: a command imports what it needs, and the lazy names stay what they were.

``torpor.cli.main`` registers only the groups a command line names (:data:`torpor.cli.COMMANDS`);
``torpor.memory`` and ``torpor.sandbox.registry.usage`` load their public names on first use.
The import checks run in a new interpreter: this one has imported everything long ago.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer

import torpor.cli
import torpor.memory
import torpor.sandbox.registry.usage as usage
from torpor.cli.argv import _is_text, _subcommands, _takes_value

ROOT = Path(__file__).parents[1]


def _modules_of(typer_app: typer.Typer) -> set[str]:
    """The modules defining the callbacks of ``typer_app``, its commands and sub-groups."""
    found = set()
    if typer_app.registered_callback and typer_app.registered_callback.callback:
        found.add(typer_app.registered_callback.callback.__module__)
    for command in typer_app.registered_commands:
        assert command.callback is not None
        found.add(command.callback.__module__)
    for group in typer_app.registered_groups:
        assert group.typer_instance is not None
        found |= _modules_of(group.typer_instance)
    return found


def test_the_command_map_names_every_module_a_command_needs() -> None:
    torpor.cli._load()
    top: dict[str, set[str]] = {}
    for command in torpor.cli.app.registered_commands:
        assert command.name and command.callback
        top[command.name] = {command.callback.__module__}
    for group in torpor.cli.app.registered_groups:
        assert group.name and group.typer_instance
        top[group.name] = _modules_of(group.typer_instance)
    assert set(top) == set(torpor.cli.COMMANDS)
    for name, modules in top.items():
        assert modules <= set(torpor.cli.COMMANDS[name]), name
    assert {m for ms in torpor.cli.COMMANDS.values() for m in ms} <= set(torpor.cli.GROUPS)


def test_an_option_means_the_same_in_every_group_loaded_apart() -> None:
    """``normalize`` looks an option up anywhere in the tree it is given: an option name that
    takes a value (or JSON) in one command and not in another must live in one set of modules,
    so a partly loaded tree reads it as the whole tree does."""
    torpor.cli._load()
    root = typer.main.get_command(torpor.cli.app)
    kinds: dict[str, dict[tuple[bool, bool], set[str]]] = {}
    for name, command in _subcommands(root).items():
        stack = [command]
        while stack:
            cmd = stack.pop()
            for param in getattr(cmd, "params", []):
                if getattr(param, "param_type_name", "") != "option":
                    continue
                kind = (
                    _takes_value(param, "x"),
                    "JSON" in (param.help or "") and _is_text(param),
                )
                for opt in (*param.opts, *param.secondary_opts):
                    kinds.setdefault(opt, {}).setdefault(kind, set()).add(name)
            stack.extend(_subcommands(cmd).values())
    for opt, by_kind in kinds.items():
        if len(by_kind) > 1:
            commands = set().union(*by_kind.values())
            assert len({torpor.cli.COMMANDS[c] for c in commands}) == 1, (opt, by_kind)


@pytest.mark.parametrize(
    ("argv", "absent"),
    [
        pytest.param(["serve"], ["torpor.client", "numpy", "torpor.memory.memory"], id="serve"),
        pytest.param(["memory", "recall", "q"], ["torpor.client", "numpy"], id="memory"),
        pytest.param(["sandbox", "list"], ["numpy", "jsonschema", "torpor.memory.memory"], id="ls"),
        pytest.param(["usage"], ["numpy", "torpor.sandbox.registry.usage.report"], id="usage"),
        pytest.param(["--help"], ["numpy", "torpor.memory.memory"], id="help"),
    ],
)
def test_a_command_line_imports_only_the_groups_it_names(
    argv: list[str], absent: list[str]
) -> None:
    code = (
        "import json, sys, torpor.cli as c\n"
        f"c._load(c._groups_for({argv!r}))\n"
        "print(json.dumps({'modules': sorted(sys.modules), "
        "'commands': sorted(c.typer.main.get_command(c.app).commands)}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    got: dict[str, Any] = json.loads(out.stdout)
    assert not set(absent) & set(got["modules"]), set(absent) & set(got["modules"])
    named = [a for a in argv if a in torpor.cli.COMMANDS]
    if named:
        assert set(named) <= set(got["commands"]) < set(torpor.cli.COMMANDS)
    else:  # the root help lists every group
        assert set(got["commands"]) == set(torpor.cli.COMMANDS)


def test_the_root_help_and_an_unknown_command_still_see_every_group(tmp_path: Path) -> None:
    env = {"PYTHONPATH": str(ROOT), "TORPOR_HOME": str(tmp_path), "COLUMNS": "200"}
    helped = subprocess.run(
        [sys.executable, "-m", "torpor.cli", "--help"], env=env, capture_output=True, text=True
    )
    assert helped.returncode == 0
    for name in ("memory", "sandbox", "serve", "usage", "snapshot", "node"):
        assert name in helped.stdout
    unknown = subprocess.run(
        [sys.executable, "-m", "torpor.cli", "nosuch"], env=env, capture_output=True, text=True
    )
    assert unknown.returncode == 2 and "No such command 'nosuch'" in unknown.stderr


@pytest.mark.parametrize(
    "package", [torpor.memory, usage], ids=["torpor.memory", "torpor.sandbox.registry.usage"]
)
def test_lazy_names_are_the_defining_modules_own(package: Any) -> None:
    lazy: dict[str, str] = package._LAZY
    assert set(lazy) == set(package.__all__)
    assert dir(package) == sorted(package.__all__)
    for name, module in lazy.items():
        assert getattr(package, name) is getattr(importlib.import_module(module), name)
    with pytest.raises(AttributeError):
        _ = package.NoSuchName


def test_the_client_imports_no_memory_store() -> None:
    code = (
        "import sys, torpor.client, torpor.memory.models\n"
        "print(sorted({'numpy', 'jsonschema', 'torpor.memory.memory',"
        " 'torpor.sandbox.registry.usage.report'} & set(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"
