"""Lazy public names for a package's ``__init__`` (PEP 562).

``import torpor`` (and ``torpor.memory``, the usage package) must stay cheap: the CLI and the
client import them for a few names, not for numpy, the store or QEMU's driver. A package lists
its public names with the module that defines each; the first access imports that module and
keeps the value in the package's namespace, so later accesses cost nothing.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, names: Mapping[str, str], namespace: dict[str, Any], public: Iterable[str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``: ``names`` maps a public name to the
    module that defines it, ``namespace`` is the package's ``globals()``, ``public`` its
    ``__all__``. An unknown name raises :class:`AttributeError` (so ``from package import
    submodule`` falls back to importing the submodule)."""
    listed = sorted(public)

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return listed

    return __getattr__, __dir__
