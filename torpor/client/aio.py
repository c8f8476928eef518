"""Async clients: :class:`AsyncRuntime`, its memory and its sandboxes
(:mod:`torpor.client.aio_sandbox`), on ``httpx.AsyncClient``.

::

    async with torpor.AsyncRuntime(url="http://127.0.0.1:8765", token=tok) as rt:
        u = await rt.memory.scope(app="support", user="u-42")
        await u.remember("prefers daily summaries", key="summary_cadence")
        hits = await u.recall("how often should I send summaries?", k=3)

The async memory has the sync one's methods (:mod:`torpor.client.memory`), each a coroutine;
both send the same :class:`~torpor.client.memory.Call` s, built and parsed by the same
functions, so only the sending differs. Errors are the same typed ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import socket
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any, Self, TypeVar

import httpx
from pydantic import BaseModel

from torpor.client._local import ensure_local_server
from torpor.client.calls import Call, decode, unsendable
from torpor.client.memory import (
    call_context,
    call_forget,
    call_fork,
    call_get,
    call_get_all,
    call_get_profile,
    call_history,
    call_log,
    call_log_many,
    call_open,
    call_recall,
    call_remember,
    call_remember_many,
    call_set_policy,
    call_set_profile,
    call_update,
    call_verify,
    import_body,
    scope_params,
)
from torpor.client.runtime import DEFAULT_TIMEOUT, error_of, failed, seconds, target
from torpor.errors import InvalidArgument, OperationTimeout, ServerUnavailable
from torpor.memory._lines import ExportFile
from torpor.memory.context import Context
from torpor.memory.models import (
    AuditEntry,
    Episode,
    Fact,
    Hit,
    Policy,
    Profile,
    RecordPage,
    Scope,
)

if TYPE_CHECKING:
    from torpor.client.aio_sandbox import AsyncSandboxes

__all__ = ["AsyncRemoteMemory", "AsyncRemoteScope", "AsyncRuntime"]

T = TypeVar("T")


class AsyncRuntime:
    """An async client for one torpor server: the same arguments as
    :class:`~torpor.client.Runtime` (local socket, started on demand, or ``url`` + ``token``).
    """

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        home: str | os.PathLike[str] | None = None,
        *,
        timeout: float | None = DEFAULT_TIMEOUT,
        autostart: bool = True,
    ) -> None:
        timeout = seconds(timeout)
        url, self.paths, headers = target(url, token, home)
        self.url = url
        self.autostart = autostart and url is None
        limits = httpx.Timeout(timeout, connect=10.0)
        if self.paths is not None:
            transport = httpx.AsyncHTTPTransport(uds=str(self.paths.socket))
            base = "http://torpor"
        else:
            assert url is not None
            nodelay = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
            transport = httpx.AsyncHTTPTransport(socket_options=nodelay)
            base = url.rstrip("/")
        self._http = httpx.AsyncClient(
            transport=transport, base_url=base, headers=headers, timeout=limits
        )

    def __repr__(self) -> str:
        return f"AsyncRuntime({self.url or (self.paths.socket if self.paths else '?')})"

    def _where(self) -> str:
        return self.url or f"the local server at {self.paths.socket if self.paths else '?'}"

    async def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            return await self._http.request(method, path, **kwargs)
        except UnicodeEncodeError as exc:
            raise unsendable(method, path, exc) from None
        except (httpx.ConnectError, httpx.RemoteProtocolError) as exc:
            raise ServerUnavailable(f"cannot reach {self._where()}: {exc}", exc=exc) from exc
        except httpx.TimeoutException as exc:
            raise OperationTimeout(f"{method} {path}: no answer in time", exc=exc) from exc
        except httpx.HTTPError as exc:
            raise ServerUnavailable(f"{method} {path} failed: {exc}", exc=exc) from exc

    async def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """As :meth:`Runtime.request <torpor.client.Runtime.request>`, awaited."""
        try:
            response = await self._send(method, path, **kwargs)
        except ServerUnavailable as exc:
            if not (self.autostart and isinstance(exc.exc, httpx.ConnectError)):
                raise
            assert self.paths is not None
            await asyncio.to_thread(ensure_local_server, self.paths)
            response = await self._send(method, path, **kwargs)
        if failed(response.status_code):
            raise error_of(response)
        return response

    async def json(self, method: str, path: str, **kwargs: Any) -> Any:
        """:meth:`request`, returning the decoded JSON body."""
        return decode((await self.request(method, path, **kwargs)).content)

    async def do(self, call: Call[T]) -> T:
        """Send one :class:`~torpor.client.calls.Call` and read its answer (as
        :meth:`Runtime.do <torpor.client.Runtime.do>`: only this line differs)."""
        return call.read(await self.request(call.method, call.path, **call.request_kwargs()))

    @asynccontextmanager
    async def stream_lines(
        self, method: str, path: str, **kwargs: Any
    ) -> AsyncIterator[AsyncIterator[str]]:
        """Send a request and yield its answer's lines as they arrive (as
        :meth:`Runtime.stream_lines <torpor.client.Runtime.stream_lines>`: raises like
        :meth:`request`, and starts the local server if the connection is refused, nothing
        having been sent then)."""
        try:
            async with contextlib.AsyncExitStack() as stack:
                for attempt in (1, 2):
                    try:
                        stream = self._http.stream(method, path, **kwargs)
                        response = await stack.enter_async_context(stream)
                        break
                    except UnicodeEncodeError as exc:
                        raise unsendable(method, path, exc) from None
                    except httpx.ConnectError as exc:
                        if attempt == 2 or not self.autostart:
                            raise ServerUnavailable(
                                f"cannot reach {self._where()}: {exc}", exc=exc
                            ) from exc
                        assert self.paths is not None
                        await asyncio.to_thread(ensure_local_server, self.paths)
                if failed(response.status_code):
                    await response.aread()
                    raise error_of(response)
                yield response.aiter_lines()
        except httpx.TimeoutException as exc:
            raise OperationTimeout(f"{method} {path}: no answer in time", exc=exc) from exc
        except httpx.HTTPError as exc:
            raise ServerUnavailable(f"{method} {path} failed: {exc}", exc=exc) from exc

    async def health(self) -> dict[str, Any]:
        """The server's identity: ``{"ok", "pid", "version", "tenant", "home"}``."""
        result: dict[str, Any] = await self.json("GET", "/v1/health")
        return result

    @functools.cached_property
    def sandboxes(self) -> AsyncSandboxes:
        """The server's sandboxes, async (``await rt.sandboxes.get_or_create(name)`` ->
        :class:`~torpor.client.aio_sandbox.AsyncSandbox`)."""
        from torpor.client.aio_sandbox import AsyncSandboxes

        return AsyncSandboxes(self)

    @functools.cached_property
    def memory(self) -> AsyncRemoteMemory:
        """The server's memory, async (``await rt.memory.scope(app=..., user=...)``)."""
        return AsyncRemoteMemory(self)

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


class AsyncRemoteScope:
    """:class:`~torpor.client.memory.RemoteScope`, async. Made by
    :meth:`AsyncRemoteMemory.scope`."""

    def __init__(self, memory: AsyncRemoteMemory, scope: Scope) -> None:
        self.memory = memory
        self.scope = scope
        self.path = scope.path

    def __repr__(self) -> str:
        return f"AsyncRemoteScope({self.scope})"

    async def do(self, call: Call[T]) -> T:
        """Send one :class:`Call` through the memory's runtime."""
        return await self.memory.do(call)

    async def remember(
        self,
        text: str,
        *,
        key: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        source: Any = None,
        durability: str = "persistent",
        ttl: float | timedelta | None = None,
    ) -> Fact:
        """As :meth:`ScopedMemory.remember <torpor.memory.ScopedMemory.remember>`."""
        return await self.do(
            call_remember(
                self.path,
                text,
                key=key,
                metadata=metadata,
                source=source,
                durability=durability,
                ttl=ttl,
            )
        )

    async def remember_many(self, items: Iterable[str | Mapping[str, Any]]) -> list[Fact]:
        """As :meth:`ScopedMemory.remember_many <torpor.memory.ScopedMemory.remember_many>`."""
        return await self.do(call_remember_many(self.path, items))

    async def log(
        self,
        role: str,
        text: str,
        *,
        session: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        at: datetime | None = None,
        durability: str = "persistent",
        ttl: float | timedelta | None = None,
    ) -> Episode:
        """As :meth:`ScopedMemory.log <torpor.memory.ScopedMemory.log>`."""
        return await self.do(
            call_log(
                self.path,
                role,
                text,
                session=session,
                metadata=metadata,
                at=at,
                durability=durability,
                ttl=ttl,
            )
        )

    async def log_many(self, turns: Iterable[Mapping[str, Any]]) -> list[Episode]:
        """As :meth:`ScopedMemory.log_many <torpor.memory.ScopedMemory.log_many>`."""
        return await self.do(call_log_many(self.path, turns))

    async def recall(
        self,
        query: str,
        k: int = 5,
        *,
        kind: str | Iterable[str] | None = None,
        metadata: Mapping[str, Any] | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        as_of: datetime | None = None,
        include_history: bool = False,
        session: str | None = None,
        min_similarity: float | None = None,
    ) -> list[Hit]:
        """As :meth:`ScopedMemory.recall <torpor.memory.ScopedMemory.recall>`."""
        return await self.do(
            call_recall(
                self.path,
                query,
                k,
                kind=kind,
                metadata=metadata,
                since=since,
                until=until,
                as_of=as_of,
                include_history=include_history,
                session=session,
                min_similarity=min_similarity,
            )
        )

    async def context(
        self, query: str, budget_tokens: int = 500, *, k_facts: int = 20, k_episodes: int = 10
    ) -> Context:
        """As :meth:`ScopedMemory.context <torpor.memory.ScopedMemory.context>`."""
        return await self.do(
            call_context(
                self.path,
                query,
                budget_tokens=budget_tokens,
                k_facts=k_facts,
                k_episodes=k_episodes,
            )
        )

    async def history(self, key: str) -> list[Fact]:
        """As :meth:`ScopedMemory.history <torpor.memory.ScopedMemory.history>`."""
        if not isinstance(key, str):
            raise InvalidArgument("key must be a string")
        return await self.do(call_history(self.path, key))

    async def get(self, record_id: str) -> Fact | Episode:
        """As :meth:`ScopedMemory.get <torpor.memory.ScopedMemory.get>`."""
        return await self.do(call_get(self.path, record_id))

    async def get_all(
        self,
        *,
        filters: Mapping[str, Any] | None = None,
        kind: str | None = None,
        page: int = 1,
        page_size: int = 100,
    ) -> RecordPage:
        """As :meth:`ScopedMemory.get_all <torpor.memory.ScopedMemory.get_all>`."""
        return await self.do(call_get_all(self.path, filters, kind, page, page_size))

    async def update(
        self, record_id: str, text: str, *, metadata: Mapping[str, Any] | None = None
    ) -> Fact:
        """As :meth:`ScopedMemory.update <torpor.memory.ScopedMemory.update>`."""
        return await self.do(call_update(self.path, record_id, text, metadata))

    async def delete_all(self) -> int:
        """As :meth:`ScopedMemory.delete_all <torpor.memory.ScopedMemory.delete_all>`."""
        return await self.do(call_forget(self.path, None))

    async def get_profile(self) -> dict[str, Any]:
        """As :meth:`ScopedMemory.get_profile <torpor.memory.ScopedMemory.get_profile>`."""
        return await self.do(call_get_profile(self.path))

    async def set_profile(
        self,
        data: Mapping[str, Any],
        *,
        schema: type[BaseModel] | Mapping[str, Any] | None = None,
        merge: bool = False,
    ) -> Profile:
        """As :meth:`ScopedMemory.set_profile <torpor.memory.ScopedMemory.set_profile>`."""
        return await self.do(call_set_profile(self.path, data, schema, merge))

    async def set_policy(
        self, *, retention_seconds: float | None = None, cache_ttl_seconds: float | None = None
    ) -> Policy:
        """As :meth:`ScopedMemory.set_policy <torpor.memory.ScopedMemory.set_policy>`."""
        return await self.do(
            call_set_policy(
                self.path, retention_seconds=retention_seconds, cache_ttl_seconds=cache_ttl_seconds
            )
        )

    async def forget(self, record_id: str | None = None) -> int:
        """As :meth:`ScopedMemory.forget <torpor.memory.ScopedMemory.forget>`."""
        return await self.do(call_forget(self.path, record_id))

    async def verify(self, record_id: str | None = None) -> list[Fact]:
        """As :meth:`ScopedMemory.verify <torpor.memory.ScopedMemory.verify>`."""
        return await self.do(call_verify(self.path, record_id))

    async def export_lines(self) -> AsyncIterator[str]:
        """This scope subtree as JSON lines, streamed from the server."""
        runtime = self.memory.runtime
        async with runtime.stream_lines(
            "GET", "/v1/memory/export", params=scope_params(self.path)
        ) as it:
            async for line in it:
                yield line

    async def export(self, dest: str | Path | IO[str]) -> int:
        """As :meth:`ScopedMemory.export <torpor.memory.ScopedMemory.export>` (streamed;
        the file is written off the event loop, a thousand lines at a time; a path whole or
        not at all, as :class:`~torpor.memory._lines.ExportFile` says). Raises
        InvalidArgument (the destination cannot be written) and the server's errors."""
        if not isinstance(dest, (str, Path)):
            try:
                return await self._write(dest)
            except OSError as exc:
                raise InvalidArgument(f"cannot write {dest}: {exc}", exc=exc) from exc
        target = await asyncio.to_thread(ExportFile, dest)
        fh = await asyncio.to_thread(target.open)
        try:
            n = await self._write(fh)
        except OSError as exc:
            await asyncio.to_thread(target.discard)
            raise target.failure(exc) from exc
        except BaseException:
            await asyncio.to_thread(target.discard)
            raise
        await asyncio.to_thread(target.commit)
        return n

    async def _write(self, out: IO[str]) -> int:
        n, buf = 0, []
        async for line in self.export_lines():
            buf.append(line + "\n")
            if len(buf) >= 1000:
                await asyncio.to_thread(out.write, "".join(buf))
                n, buf = n + len(buf), []
        if buf:
            await asyncio.to_thread(out.write, "".join(buf))
        return n + len(buf)

    async def import_(self, src: str | Path | IO[str] | Iterable[str]) -> int:
        """As :meth:`ScopedMemory.import_ <torpor.memory.ScopedMemory.import_>`."""
        response = await self.memory.runtime.request(
            "POST",
            "/v1/memory/import",
            params=scope_params(self.path),
            content=await asyncio.to_thread(import_body, src),
            headers={"content-type": "application/x-ndjson"},
        )
        return int(decode(response.content)["imported"])

    async def fork(self, **levels: str) -> AsyncRemoteScope:
        """As :meth:`ScopedMemory.fork <torpor.memory.ScopedMemory.fork>`."""
        return AsyncRemoteScope(self.memory, await self.do(call_fork(self.scope, levels)))


class AsyncRemoteMemory:
    """:class:`~torpor.client.memory.RemoteMemory`, async. Made by
    :attr:`AsyncRuntime.memory`."""

    def __init__(self, runtime: AsyncRuntime) -> None:
        self.runtime = runtime

    def __repr__(self) -> str:
        return f"AsyncRemoteMemory({self.runtime!r})"

    async def do(self, call: Call[T]) -> T:
        """Send one :class:`Call` and parse its answer (raises the server's typed error)."""
        data = await self.runtime.json(call.method, call.path, **call.request_kwargs())
        return call.parse(data)

    async def scope(
        self,
        *,
        app: str | None = None,
        user: str | None = None,
        agent: str | None = None,
        session: str | None = None,
        tenant: str | None = None,
    ) -> AsyncRemoteScope:
        """As :meth:`Memory.scope <torpor.memory.Memory.scope>` (checked by the server)."""
        scope = Scope(tenant="default", app=app, user=user, agent=agent, session=session)
        return await self.scope_from_path(scope.path, tenant=tenant)

    async def scope_from_path(self, path: str, *, tenant: str | None = None) -> AsyncRemoteScope:
        """As :meth:`Memory.scope_from_path <torpor.memory.Memory.scope_from_path>`."""
        if not isinstance(path, str):
            raise InvalidArgument(f"a scope path is a string, not {path!r}")
        opened = await self.do(call_open(path, tenant))
        owner = str(opened["tenant"])
        return AsyncRemoteScope(self, Scope.from_path(str(opened["scope"]), tenant=owner))

    async def forget(self, target: str | AsyncRemoteScope) -> int:
        """As :meth:`Memory.forget <torpor.memory.Memory.forget>`."""
        if isinstance(target, AsyncRemoteScope):
            return await target.forget()
        if not isinstance(target, str):
            raise InvalidArgument("forget() takes a record id or a scope")
        return await self.do(call_forget(None, target))

    async def gc(self) -> int:
        """As :meth:`Memory.gc <torpor.memory.Memory.gc>`."""
        return await self.do(Call("POST", "/v1/memory/gc", {}, None, lambda d: int(d["purged"])))

    async def audit_log(self, limit: int = 100) -> list[AuditEntry]:
        """The tenant's newest audit entries (needs read on the tenant's root)."""
        rows = await self.runtime.json("GET", "/v1/memory/audit", params={"limit": limit})
        return [AuditEntry.model_validate(r) for r in rows]
