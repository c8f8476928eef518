"""The torpor SDK: a sync client for a torpor server, local or remote.

``Runtime`` is the connection (local unix socket by default, started on demand);
``Sandbox`` the handle on one machine; ``Snapshot``, ``Volume`` and ``Drive`` the stored
resources (:mod:`torpor.client.storage`). ``AsyncRuntime`` and the ``Async*`` handles are the
same, awaited (:mod:`torpor.client.aio`, :mod:`torpor.client.aio_sandbox`,
:mod:`torpor.client.aio_storage`).
"""

from __future__ import annotations

from torpor.client.aio import AsyncRuntime
from torpor.client.aio_sandbox import AsyncSandbox, AsyncSnapshot
from torpor.client.aio_storage import AsyncDrive, AsyncVolume
from torpor.client.runtime import Runtime, default_runtime, set_default_runtime
from torpor.client.sandbox import Commands, Files, Interpreter, Sandbox, Snapshot
from torpor.client.storage import Drive, Volume

__all__ = [
    "AsyncDrive",
    "AsyncRuntime",
    "AsyncSandbox",
    "AsyncSnapshot",
    "AsyncVolume",
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
