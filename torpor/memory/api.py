"""Deprecated: the old home of :class:`~torpor.memory.Memory` and
:class:`~torpor.memory.ScopedMemory`.

Import them from :mod:`torpor.memory` (they are defined in :mod:`torpor.memory.memory` and
:mod:`torpor.memory.scoped`). Each name read from here still works and warns once per use.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

_MOVED = {"Memory": "torpor.memory.memory", "ScopedMemory": "torpor.memory.scoped"}


def __getattr__(name: str) -> Any:
    module = _MOVED.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"torpor.memory.api is deprecated: import {name} from torpor.memory",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(module), name)
