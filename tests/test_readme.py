"""The README runs as written: its tagged Python and shell blocks, top to bottom, in a fresh home.

A block is run when the line before its fence is ``<!-- readme: run -->``; a block that cannot
run here (``scripts/setup``, a template build that takes minutes) is simply left untagged.
Python blocks run each in a new interpreter (``python3 block.py``), shell blocks with ``bash -e``
and the ``torpor`` command of this checkout, all with one fresh ``TORPOR_HOME`` (sharing the
built templates) and no ``TORPOR_URL``: what a newcomer pasting them would get. The home's
server and any VM are stopped afterwards.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.served import stop_server_and_vms

README = Path(__file__).parents[1] / "README.md"
TAG = "<!-- readme: run -->"
_FENCE = re.compile(r"^```(\w*)\s*$")


@dataclass
class Block:
    lang: str
    code: str
    line: int  # where the fence opens, 1-based


def tagged_blocks(text: str) -> list[Block]:
    """The README's fenced blocks whose fence follows the tag line, in order."""
    lines = text.splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if fence and i > 0 and lines[i - 1].strip() == TAG:
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            out.append(Block(fence.group(1), "\n".join(lines[i + 1 : end]) + "\n", i + 1))
            i = end
        elif fence:  # skip an untagged block whole (its lines are not tags or fences)
            i = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        i += 1
    return out


def test_the_readme_has_tagged_python_and_shell_blocks() -> None:
    blocks = tagged_blocks(README.read_text())
    assert {b.lang for b in blocks} >= {"python", "bash"}, [(b.lang, b.line) for b in blocks]


def test_tagging() -> None:
    text = f"x\n{TAG}\n```python\nprint(1)\n```\n```bash\nno\n```\n{TAG}\n```bash\necho\n```\n"
    assert [(b.lang, b.code, b.line) for b in tagged_blocks(text)] == [
        ("python", "print(1)\n", 3),
        ("bash", "echo\n", 10),
    ]


@pytest.mark.qemu
def test_the_readme_runs_as_written(qemu_home: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("TORPOR_URL", "TORPOR_TOKEN")}
    env["TORPOR_HOME"] = str(qemu_home)
    env["PYTHONPATH"] = str(README.parent)  # this checkout's torpor, for python3 and torpor
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "torpor"
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} -m torpor.cli "$@"\n')
    shim.chmod(0o755)
    env["PATH"] = f"{bin_dir}:{env.get('PATH', '')}"
    work = tmp_path / "work"
    work.mkdir()
    try:
        for n, block in enumerate(tagged_blocks(README.read_text())):
            script = work / f"block{n}.{'py' if block.lang == 'python' else 'sh'}"
            script.write_text(block.code)
            argv = (
                [sys.executable, str(script)]
                if block.lang == "python"
                else ["bash", "-e", "-o", "pipefail", str(script)]
            )
            done = subprocess.run(
                argv, cwd=work, env=env, capture_output=True, text=True, timeout=1800
            )
            assert done.returncode == 0, (
                f"README block at line {block.line} ({block.lang}) failed with "
                f"{done.returncode}:\n{block.code}\n--- stdout ---\n{done.stdout[-4000:]}"
                f"\n--- stderr ---\n{done.stderr[-4000:]}"
            )
    finally:
        stop_server_and_vms(qemu_home)
