"""Reaching a port in a sandbox from the host (``sbx.get_host(8000)`` -> ``127.0.0.1:NNNNN``).

The sandbox has no network device for this: :meth:`Forwards.expose` opens a TCP listener on
the host's loopback, and every connection accepted there becomes a tunnel over the guest
channel to ``127.0.0.1:PORT`` inside the guest (:mod:`torpor.sandbox.guest.tunnel`). So it
works with the internet off, and asking for it is checked like any call on the sandbox (its
tenant). The listener is the server host's: anyone who can connect to its loopback reaches
the port, as with ``docker run -p 127.0.0.1::8000``.

The listener outlives pauses: a connection to a paused sandbox wakes it (wake-on-request), and
a pause closes the connections open at the time (the guest's server itself keeps running).
Killing the sandbox closes its listeners; one port keeps one listener (asking again returns
the same address).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from torpor.errors import EngineError, TorporError


class _Manager(Protocol):
    """What the listeners use of the :class:`SandboxManager` that holds them."""

    async def open_tunnel(
        self,
        id_or_name: str,
        port: int,
        tunnel_id: str,
        on_data: Callable[[bytes], object],
        *,
        tenant: str = "default",
    ) -> tuple[Any, asyncio.Task[int]]: ...


__all__ = ["BIND_HOST", "Forward", "Forwards"]

log = logging.getLogger(__name__)

#: where the listeners are bound
BIND_HOST = "127.0.0.1"
#: bytes from the guest's side that may wait on the host for a client reading slower than
#: they come; past it the connection is dropped (the guest does not wait for the client)
MAX_BACKLOG = 16 << 20


@dataclass
class Forward:
    """One host listener for one port of one sandbox."""

    sandbox_id: str
    tenant: str
    port: int
    host_port: int
    server: asyncio.Server = field(repr=False)
    connections: set[asyncio.Task[None]] = field(default_factory=set, repr=False)

    @property
    def address(self) -> str:
        return f"{BIND_HOST}:{self.host_port}"


class Forwards:
    """The port listeners of one manager (``manager.forwards``)."""

    def __init__(self, manager: _Manager) -> None:
        self.manager = manager
        self._by_port: dict[tuple[str, int], Forward] = {}
        self._lock = asyncio.Lock()

    def of(self, sandbox_id: str) -> list[Forward]:
        """The listeners of a sandbox, by port."""
        return sorted(
            (f for (sid, _), f in self._by_port.items() if sid == sandbox_id),
            key=lambda f: f.port,
        )

    async def expose(self, sandbox_id: str, tenant: str, port: int) -> Forward:
        """The listener for ``port`` of the sandbox, opened on first use. Raises EngineError
        (no host port could be bound)."""
        async with self._lock:
            found = self._by_port.get((sandbox_id, port))
            if found is not None:
                return found
            holder: list[Forward] = []

            async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                fwd = holder[0]
                task = asyncio.current_task()
                assert task is not None
                fwd.connections.add(task)
                try:
                    await self._relay(fwd, reader, writer)
                finally:
                    fwd.connections.discard(task)

            try:
                server = await asyncio.start_server(accepted, BIND_HOST, 0)
            except OSError as exc:
                raise EngineError(f"cannot open a host port: {exc}", exc=exc) from exc
            host_port = int(server.sockets[0].getsockname()[1])
            fwd = Forward(sandbox_id, tenant, port, host_port, server)
            holder.append(fwd)
            self._by_port[(sandbox_id, port)] = fwd
            log.info("port %d of %s is at %s", port, sandbox_id, fwd.address)
            return fwd

    async def _relay(
        self, fwd: Forward, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        tid = "tun-" + secrets.token_hex(6)
        too_slow = asyncio.Event()

        def downstream(data: bytes) -> None:
            if too_slow.is_set():
                return
            if writer.transport.get_write_buffer_size() + len(data) > MAX_BACKLOG:
                log.info(
                    "connection to port %d of %s dropped: its client reads slower than the "
                    "guest sends (over %d bytes waiting)",
                    fwd.port,
                    fwd.sandbox_id,
                    MAX_BACKLOG,
                )
                too_slow.set()
                writer.transport.abort()  # what waits for the client goes with it
                return
            writer.write(data)

        try:
            channel, done = await self.manager.open_tunnel(
                fwd.sandbox_id, fwd.port, tid, downstream, tenant=fwd.tenant
            )
        except TorporError as exc:  # nothing listens, the sandbox is gone: refuse the client
            log.info("connection to port %d of %s refused: %s", fwd.port, fwd.sandbox_id, exc)
            writer.close()
            return

        async def upstream() -> None:
            with contextlib.suppress(TorporError, ConnectionError):
                while data := await reader.read(1 << 16):
                    await channel.tunnel_send(tid, data)
                await channel.tunnel_close(tid)

        up = asyncio.create_task(upstream())
        cut = asyncio.create_task(too_slow.wait())
        try:
            await asyncio.wait({done, cut}, return_when=asyncio.FIRST_COMPLETED)
            if not too_slow.is_set():
                with contextlib.suppress(TorporError):
                    await done
                with contextlib.suppress(ConnectionError):
                    await writer.drain()
        finally:
            up.cancel()
            cut.cancel()
            if not done.done():
                done.cancel()  # the guest drops its side
            writer.close()

    async def close_sandbox(self, sandbox_id: str) -> None:
        """Close the listeners of a sandbox and their connections (it was killed)."""
        for fwd in self.of(sandbox_id):
            self._by_port.pop((sandbox_id, fwd.port), None)
            await _close(fwd)

    async def close_all(self) -> None:
        """Close every listener (the manager is closing)."""
        forwards, self._by_port = list(self._by_port.values()), {}
        for fwd in forwards:
            await _close(fwd)


async def _close(fwd: Forward) -> None:
    fwd.server.close()
    for task in list(fwd.connections):
        task.cancel()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(fwd.server.wait_closed(), 5)
