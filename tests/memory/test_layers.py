"""The modules of ``torpor.memory`` import each other without a cycle.

Every import counts, as a layering linter counts them: module level, under ``TYPE_CHECKING``
and inside functions. ``from package import name`` is an import of ``package.name`` when that
is a module. A cycle that never breaks at runtime still means two modules that can only be
understood (and changed) together.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import torpor.memory

ROOT = Path(torpor.memory.__file__).parent


def module_name(path: Path, root: Path) -> str:
    parts = ["torpor", "memory", *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module name -> the ``torpor.memory`` modules it imports, for every module under
    ``root`` (the folder of the ``torpor.memory`` package)."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.add(sub if sub in files else base)
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules, the first repeated at the end), or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_graph_sees_type_checking_and_function_level_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "memory"
    (pkg / "backends").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from torpor.memory.a import A\n")
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from torpor.memory.b import B\n"
    )
    (pkg / "b.py").write_text("def f():\n    from torpor.memory import a\n")
    (pkg / "backends" / "__init__.py").write_text("")
    (pkg / "backends" / "c.py").write_text("from ..a import A\nfrom . import d\n")
    (pkg / "backends" / "d.py").write_text("")
    graph = import_graph(pkg)
    assert graph["torpor.memory.a"] == {"torpor.memory.b"}
    assert graph["torpor.memory.b"] == {"torpor.memory.a"}
    assert graph["torpor.memory.backends.c"] == {"torpor.memory.a", "torpor.memory.backends.d"}
    assert find_cycle(graph) == ["torpor.memory.a", "torpor.memory.b", "torpor.memory.a"]


@pytest.mark.parametrize(
    "module",
    [
        pytest.param("torpor.memory.memory", id="memory"),
        pytest.param("torpor.memory.scoped", id="scoped"),
        pytest.param("torpor.memory.backends.postgres", id="postgres"),
        pytest.param("torpor.memory.backends._pg_store", id="pg_store"),
    ],
)
def test_graph_covers_the_modules_that_had_cycles(module: str) -> None:
    assert module in import_graph(ROOT)


def test_memory_imports_form_a_dag() -> None:
    assert find_cycle(import_graph(ROOT)) is None
