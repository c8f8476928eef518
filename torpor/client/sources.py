"""Reading files that memory facts cite, out of sandboxes and volumes, through the SDK.

A fact may cite ``SourceRef(sandbox="agent-u-42", path="/workspace/ledger.csv", line=3)`` or
``SourceRef(volume="memory-u-42", path="/facts.md")``; torpor checks such a citation by reading
the file instead of trusting it. The memory layer reads sources through resolvers
(:func:`torpor.memory.register_resolver`); this module holds the ones for sandboxes and volumes.
:func:`torpor.memory.provenance.read_source` uses them with the default runtime (the local
server, started on demand) when nothing else is registered; register your own to read through
another server::

    torpor.memory.register_resolver("sandbox", sandbox_resolver(rt))
    torpor.memory.register_resolver("volume", volume_resolver(rt))

The sandbox resolver wakes a paused sandbox to read the file and pauses it again after (checking
a fact never leaves an agent's machine running). The volume
resolver reads the volume's disk image on the server, with no sandbox running; a volume that a
sandbox has attached shows what the guest has flushed (``sync`` in the guest, or a pause).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Protocol

from torpor.client.runtime import Runtime
from torpor.client.sandbox import Sandbox
from torpor.client.storage import Volume
from torpor.errors import PathNotFound, TorporError
from torpor.sandbox.models import SandboxState

__all__ = ["CitesSandbox", "CitesVolume", "sandbox_resolver", "volume_resolver"]


class CitesSandbox(Protocol):
    """What a resolver needs from a source reference (``torpor.memory.SourceRef`` fits)."""

    @property
    def sandbox(self) -> str | None: ...

    @property
    def path(self) -> str | None: ...


class CitesVolume(Protocol):
    """What the volume resolver needs from a source reference (``SourceRef`` fits)."""

    @property
    def volume(self) -> str | None: ...

    @property
    def path(self) -> str | None: ...


def _cited(kind: str, where: str | None, path: str | None) -> tuple[str, str]:
    """The ``kind`` (sandbox, volume) and path a reference cites. Raises PathNotFound when it
    lacks either."""
    if not where or not path:
        raise PathNotFound(
            f"a {kind} source needs a {kind} and a path", kind="path", name=f"{where}:{path}"
        )
    return where, path


def sandbox_resolver(runtime: Runtime | None = None) -> Callable[[CitesSandbox], bytes]:
    """A resolver returning the whole file a reference cites in a sandbox.

    ``runtime``: the server to ask (None: the default runtime at call time). The resolver
    raises :class:`~torpor.errors.SandboxNotFound` or :class:`~torpor.errors.PathNotFound`
    (both :class:`~torpor.errors.NotFound`) when the sandbox or file is missing,
    :class:`~torpor.errors.ServerUnavailable` without a server.
    """

    def read(ref: CitesSandbox) -> bytes:
        sandbox, path = _cited("sandbox", ref.sandbox, ref.path)
        sbx = Sandbox.get(sandbox, runtime=runtime)
        was_paused = sbx.info.state is SandboxState.PAUSED
        try:
            return sbx.files.read(path)  # a paused sandbox wakes for the read ...
        finally:
            if was_paused:  # ... and goes back to sleep: checking a fact is not using it
                with contextlib.suppress(TorporError):
                    sbx.pause()

    return read


def volume_resolver(runtime: Runtime | None = None) -> Callable[[CitesVolume], bytes]:
    """A resolver returning the whole file a reference cites in a volume (path inside it).

    ``runtime``: the server to ask (None: the default runtime at call time). The resolver
    raises :class:`~torpor.errors.VolumeNotFound` or :class:`~torpor.errors.PathNotFound`
    when the volume or file is missing, :class:`~torpor.errors.InvalidArgument` for a
    directory or link, :class:`~torpor.errors.ServerUnavailable` without a server.
    """

    def read(ref: CitesVolume) -> bytes:
        volume, path = _cited("volume", ref.volume, ref.path)
        return Volume.get(volume, runtime=runtime).read_file(path)

    return read
