"""The house keeps its shape: import layering (import-linter contracts in pyproject.toml) and no
import cycle anywhere in the package, type-checking imports included."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append(
                        (child, iter(sorted(graph.find_modules_directly_imported_by(child))))
                    )
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycles() -> None:
    graph = grimp.build_graph("torpor", exclude_type_checking_imports=False)
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = grimp.ImportGraph()
    for name in ("a", "a.x", "a.y", "a.z"):
        graph.add_module(name)
    graph.add_import(importer="a.x", imported="a.y")
    graph.add_import(importer="a.y", imported="a.x")
    graph.add_import(importer="a.y", imported="a.z")
    assert _cycles(graph) == [["a.x", "a.y"]]


def test_import_layers_hold() -> None:
    lint = shutil.which("lint-imports") or pytest.fail("import-linter is not installed")
    proc = subprocess.run(
        [lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "broken" in proc.stdout and " 0 broken" in proc.stdout, proc.stdout


def test_the_sandbox_package_shows_its_layers() -> None:
    """A newcomer opening torpor/sandbox sees its layers, not a flat list of modules."""
    entries = sorted(
        p.name
        for p in (ROOT / "torpor" / "sandbox").iterdir()
        if p.name != "__pycache__" and p.name != "__init__.py"
    )
    assert len(entries) <= 10, entries
