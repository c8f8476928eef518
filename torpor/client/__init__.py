"""The torpor SDK: a sync client for a torpor server, local or remote.

``Runtime`` is the connection (local unix socket by default, started on demand);
``Sandbox`` the handle on one machine; ``Snapshot``, ``Volume`` and ``Drive`` come from
:mod:`torpor.client.checkpoints`.
"""

from __future__ import annotations

from torpor.client.aio import AsyncRuntime
from torpor.client.runtime import Runtime, default_runtime, set_default_runtime
from torpor.client.sandbox import Commands, Files, Interpreter, Sandbox, Snapshot
from torpor.client.storage import Drive, Volume

__all__ = [
    "AsyncRuntime",
    "Commands",
    "Drive",
    "Files",
    "Interpreter",
    "Runtime",
    "Sandbox",
    "Snapshot",
    "Volume",
    "default_runtime",
    "set_default_runtime",
]
