"""Type aliases shared by every layer (engine, manager, server, SDK), declared once.

Their bounds, where they have any, are in :mod:`torpor.sandbox.requests`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["Env", "Labels", "OutputCallback"]

#: called with each decoded chunk of stdout/stderr as it comes; may return an awaitable
OutputCallback = Callable[[str], Any]

#: the labels of a sandbox or snapshot: ``{"user": "u-42"}``
Labels = dict[str, str]

#: environment variables for a command: ``{"LANG": "C.UTF-8"}``
Env = dict[str, str]
