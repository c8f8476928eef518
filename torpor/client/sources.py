"""Reading files that memory facts cite, out of sandboxes, through the SDK.

A fact may cite ``SourceRef(sandbox="agent-u-42", path="/workspace/ledger.csv", line=3)``;
torpor checks such a citation by reading the file instead of trusting it. The memory layer
reads sources through resolvers (:func:`torpor.memory.register_resolver`); this module is the
one for sandboxes::

    torpor.memory.register_resolver("sandbox", sandbox_resolver())

It wakes a paused sandbox to read the file, like any other call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from torpor.client.runtime import Runtime
from torpor.client.sandbox import Sandbox
from torpor.errors import PathNotFound

__all__ = ["CitesSandbox", "sandbox_resolver"]


class CitesSandbox(Protocol):
    """What a resolver needs from a source reference (``torpor.memory.SourceRef`` fits)."""

    @property
    def sandbox(self) -> str | None: ...

    @property
    def path(self) -> str | None: ...


def sandbox_resolver(runtime: Runtime | None = None) -> Callable[[CitesSandbox], bytes]:
    """A resolver returning the whole file a reference cites in a sandbox.

    The resolver raises :class:`~torpor.errors.SandboxNotFound` or
    :class:`~torpor.errors.PathNotFound` (both :class:`~torpor.errors.NotFound`) when the
    sandbox or file is missing, :class:`~torpor.errors.ServerUnavailable` without a server.
    """

    def read(ref: CitesSandbox) -> bytes:
        if not ref.sandbox or not ref.path:
            raise PathNotFound("a sandbox source needs a sandbox and a path", kind="path",
                               name=f"{ref.sandbox}:{ref.path}")
        return Sandbox.get(ref.sandbox, runtime=runtime).files.read(ref.path)

    return read
