"""Options where a user puts them: move each option to the command that defines it.

``torpor --json sandbox ls``, ``torpor sandbox ls --json`` and ``torpor memory recall q
--scope app/a/user/u`` all mean what they say, although ``--json`` belongs to ``ls`` and
``--scope`` to the ``memory`` group: :func:`normalize` walks the command line along the command
tree (from the click description typer builds of it; read by attribute,
as typer may carry its own copy of click) and moves an option found under a command that does
not define it to the nearest command on the path that does. Nothing after ``--`` is touched (a
command's own arguments), and an option no command on the path defines is left for click to
report.

It also checks the value of an option whose help says it takes JSON, so a typo is one line
naming the option rather than a traceback from deep in a command.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, get_args

from torpor.errors import InvalidArgument

__all__ = ["normalize"]


@dataclass
class _Level:
    command: Any  # a click command or group
    at: int  # index in the output where this command's own options go (after its name)
    tokens: list[str] = field(default_factory=list)


def _subcommands(command: Any) -> dict[str, Any]:
    found = getattr(command, "commands", None)
    return found if isinstance(found, dict) else {}


def _option(command: Any, token: str) -> Any:
    name = token.split("=", 1)[0]
    for param in getattr(command, "params", []):
        if getattr(param, "param_type_name", "") == "option" and name in (
            *param.opts,
            *param.secondary_opts,
        ):
            return param
    return None


def _takes_value(option: Any, token: str) -> bool:
    return not option.is_flag and not option.count and "=" not in token


def _anywhere(root: Any, token: str) -> Any:
    """The first option called ``token`` anywhere in the tree (to know if it takes a value)."""
    stack = [root]
    while stack:
        command = stack.pop()
        found = _option(command, token)
        if found is not None:
            return found
        stack.extend(_subcommands(command).values())
    return None


def _is_text(option: Any) -> bool:
    """Whether the option takes a string (not a path, not a number)."""
    descriptor = getattr(option, "type_descriptor", None)  # typer's own click
    if descriptor is not None:
        ann = descriptor.annotation
        return ann is str or str in get_args(ann)
    return getattr(getattr(option, "type", None), "name", "") == "text"  # click's


def _check_json(option: Any, token: str, value: str) -> None:
    if "JSON" not in (option.help or "") or not _is_text(option):
        return  # not a JSON option (a path to a JSON file is a path)
    try:
        json.loads(value)
    except json.JSONDecodeError as exc:
        name = token.split("=", 1)[0]
        raise InvalidArgument(
            f"{name} takes JSON, and {value!r} is not JSON ({exc.msg} at character "
            f'{exc.pos}); quote it for the shell, e.g. {name} \'{{"key": "value"}}\'',
            option=name,
        ) from None


def normalize(root: Any, args: list[str]) -> list[str]:
    """``args`` (without the program name) with every option moved to the command on the
    path that defines it. Raises InvalidArgument for a JSON option whose value is not JSON."""
    levels = [_Level(root, 0)]
    floating: list[list[str]] = []
    rest: list[str] = []
    i = 0
    while i < len(args):
        token = args[i]
        level = levels[-1]
        if token == "--":
            rest = args[i:]
            break
        if token.startswith("-") and token != "-":
            option = _option(level.command, token) or _anywhere(root, token)
            group = [token]
            if option is not None and _takes_value(option, token) and i + 1 < len(args):
                group.append(args[i + 1])
                i += 1
            if option is not None:
                value = group[1] if len(group) > 1 else token.partition("=")[2]
                if value:
                    _check_json(option, token, value)
            if option is not None and _option(level.command, token) is None:
                floating.append(group)
            else:
                level.tokens.extend(group)
        elif token in _subcommands(level.command):
            levels.append(_Level(_subcommands(level.command)[token], 0))
            level.tokens.append(token)
        else:
            level.tokens.append(token)
        i += 1
    for group in floating:
        # the deepest command on the path that defines it, else leave it where it was
        owner = next((lv for lv in reversed(levels) if _option(lv.command, group[0])), levels[-1])
        owner.tokens[:0] = group
    out: list[str] = []
    for level in levels:
        out.extend(level.tokens)
    return out + rest
