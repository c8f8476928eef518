"""The connection to a torpor server: local (unix socket, started on demand) or remote.

::

    rt = torpor.Runtime()                                    # local: <home>/server.sock
    rt = torpor.Runtime(url="https://torpor.example", token="...")   # remote, one tenant
    sbx = torpor.Sandbox.create(runtime=rt)

Without ``runtime=``, SDK calls use :func:`default_runtime`, built once per process from
``$TORPOR_URL`` / ``$TORPOR_TOKEN`` (remote) or ``$TORPOR_HOME`` (local).

Every error the server sends is rebuilt as the same :mod:`torpor.errors` class; a server that
cannot be reached is :class:`~torpor.errors.ServerUnavailable`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import date, datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol, Self, TypeVar

import httpcore
import httpx

from torpor.client._local import ensure_local_server
from torpor.client._wire import Answer, SocketWire
from torpor.client.calls import Call, decode, unsendable
from torpor.client.sandbox_calls import at
from torpor.config import Paths, paths
from torpor.errors import (
    InvalidArgument,
    OperationTimeout,
    PayloadTooLarge,
    ServerUnavailable,
    TorporError,
    from_wire,
)
from torpor.sandbox.models import DrainReport, EventPage, NodeStatus, SandboxEvent
from torpor.sandbox.registry.usage import UsageReport, parse_query
from torpor.sandbox.requests import MAX_TIMEOUT

if TYPE_CHECKING:
    from torpor.client.memory import RemoteMemory
    from torpor.client.tokens import Tokens

T = TypeVar("T")

__all__ = [
    "DEFAULT_TIMEOUT",
    "Runtime",
    "default_runtime",
    "error_of",
    "failed",
    "seconds",
    "set_default_runtime",
]

log = logging.getLogger(__name__)

#: Seconds a follower of events waits before asking a server that could not be reached again.
RECONNECT_DELAY = 0.5

#: Seconds to wait for an answer when the call has no timeout of its own. Generous: a call may
#: first wake a paused sandbox, and under TCG a cold template boot takes a while.
DEFAULT_TIMEOUT = 300.0


def seconds(timeout: float | None) -> float | None:
    """A client's ``timeout``, checked: seconds, more than 0 and at most a year
    (:data:`~torpor.sandbox.requests.MAX_TIMEOUT`), or None for no limit. Raises
    :class:`InvalidArgument` (0, a negative number, NaN, infinity, not a number)."""
    if timeout is None:
        return None
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not 0 < timeout <= MAX_TIMEOUT
    ):
        raise InvalidArgument(
            f"a timeout is seconds, more than 0 and at most {MAX_TIMEOUT:.0f}, or None for no "
            f"limit, not {timeout!r}",
            field="timeout",
        )
    return float(timeout)


def failed(status: int) -> bool:
    """Whether an answer of ``status`` is no success: a torpor server answers 2xx; anything
    else (an error, a redirect the client does not follow) is :func:`error_of`'s."""
    return not 200 <= status < 300


#: what an error answer without torpor's wire form (a proxy's page) means, by its status
_BY_STATUS: dict[int, type[TorporError]] = {
    413: PayloadTooLarge,
    502: ServerUnavailable,
    503: ServerUnavailable,
}


def error_of(response: httpx.Response) -> TorporError:
    """The typed error an answer that :func:`failed` stands for (its wire form; a body that
    is not one is a plain :class:`TorporError`: :class:`PayloadTooLarge` for 413,
    :class:`ServerUnavailable` for 502/503)."""
    try:
        payload = response.json()["error"]
        if not isinstance(payload, dict):
            raise TypeError(payload)
        return from_wire(payload)
    except (ValueError, KeyError, TypeError):
        moved = response.headers.get("location")
        said = response.text[:500] or (
            f"a redirect to {moved[:200]}, not followed" if moved else ""
        )
        kind = _BY_STATUS.get(response.status_code, TorporError)
        return kind(f"HTTP {response.status_code}: {said}", status=response.status_code)


def target(
    url: str | None, token: str | None, home: str | os.PathLike[str] | None
) -> tuple[str | None, Paths | None, dict[str, str]]:
    """Which server a client talks to (shared by :class:`Runtime` and the async client):
    ``url`` (else ``$TORPOR_URL`` when no ``home`` is given) with ``token`` (else
    ``$TORPOR_TOKEN``), or the local server of ``home``; returns the URL, the local home's
    paths (None for a URL) and the request headers."""
    url = url or (os.environ.get("TORPOR_URL") if home is None else None)
    token = token or os.environ.get("TORPOR_TOKEN") if url else token
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return url, None if url else paths(home), headers


class SandboxesAPI(Protocol):
    """What ``Runtime.sandboxes`` is (:class:`torpor.client.sandbox.Sandboxes`): the
    :class:`~torpor.client.sandbox.Sandbox` constructors bound to one runtime."""

    def create(self, **options: Any) -> Any: ...

    def get_or_create(self, name: str, **options: Any) -> Any: ...

    def get(self, id_or_name: str) -> Any: ...

    def list(self, labels: Any = None, *, include_stopped: bool = False) -> Any: ...


#: makes ``Runtime.sandboxes``: set by :mod:`torpor.client.sandbox` when it is imported
#: (importing that module from here would be an import cycle: it imports this one)
sandboxes_factory: Callable[[Runtime], SandboxesAPI] | None = None


class Runtime:
    """A sync client for one torpor server.

    ``url``: a remote server (``http(s)://host:port``); ``token``: its bearer token.
    With neither (nor ``$TORPOR_URL``), the local server of ``home`` (default ``$TORPOR_HOME``)
    is used over its unix socket and started if it is not running (``autostart``).
    ``timeout``: seconds to wait for an answer when a call has none of its own (None: no
    limit); InvalidArgument when it is not more than 0 and at most a year.
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
            transport = httpx.HTTPTransport(uds=str(self.paths.socket))
            self._http = httpx.Client(
                transport=transport, base_url="http://torpor", headers=headers, timeout=limits
            )
            # one-shot calls (do) skip httpx's models: see torpor.client._wire
            self._wire: SocketWire | None = SocketWire(str(self.paths.socket), headers, timeout)
        else:
            self._wire = None
            assert url is not None
            # TCP_NODELAY: a POST's body must not wait behind its headers for a delayed ACK
            nodelay = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
            self._http = httpx.Client(
                transport=httpx.HTTPTransport(socket_options=nodelay),
                base_url=url.rstrip("/"),
                headers=headers,
                timeout=limits,
            )
        self._started = False
        self._start_lock = threading.Lock()

    def __repr__(self) -> str:
        where = self.url or (self.paths.socket if self.paths else "?")
        return f"Runtime({where})"

    # -- plumbing -----------------------------------------------------------------------------

    def _where(self) -> str:
        return self.url or f"the local server at {self.paths.socket if self.paths else '?'}"

    def _start_local(self) -> None:
        assert self.paths is not None
        with self._start_lock:
            ensure_local_server(self.paths)
            self._started = True

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            return self._http.request(method, path, **kwargs)
        except UnicodeEncodeError as exc:
            raise unsendable(method, path, exc) from None
        except (httpx.ConnectError, httpx.RemoteProtocolError) as exc:
            raise ServerUnavailable(f"cannot reach {self._where()}: {exc}", exc=exc) from exc
        except httpx.TimeoutException as exc:
            raise OperationTimeout(
                f"{method} {path}: no answer from {self._where()} in time", exc=exc
            ) from exc
        except httpx.HTTPError as exc:
            raise ServerUnavailable(f"{method} {path} failed: {exc}", exc=exc) from exc

    @staticmethod
    def _error(response: httpx.Response) -> TorporError:
        return error_of(response)

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """Send one request (``kwargs`` as for :meth:`httpx.Client.request`), checked.

        Starts the local server if it is not running. Raises the server's error as its
        :mod:`torpor.errors` class, :class:`ServerUnavailable` when the server is unreachable,
        :class:`OperationTimeout` when it does not answer in time.
        """
        try:
            response = self._send(method, path, **kwargs)
        except ServerUnavailable as exc:
            # A refused or missing socket means the request was never delivered: safe to start
            # the server and send it again.
            if not (self.autostart and isinstance(exc.exc, httpx.ConnectError)):
                raise
            self._start_local()
            response = self._send(method, path, **kwargs)
        if failed(response.status_code):
            raise self._error(response)
        return response

    def json(self, method: str, path: str, **kwargs: Any) -> Any:
        """:meth:`request`, returning the decoded JSON body."""
        return decode(self.request(method, path, **kwargs).content)

    def do(self, call: Call[T]) -> T:
        """Send one :class:`~torpor.client.calls.Call` and read its answer (raises like
        :meth:`request`)."""
        if self._wire is None:
            return call.read(self.request(call.method, call.path, **call.request_kwargs()))
        content, content_type = call.payload()
        try:
            answer = self._on_wire(call, content, content_type)
        except ServerUnavailable as exc:
            # as request(): a refused or missing socket means nothing was delivered
            if not (self.autostart and isinstance(exc.exc, httpcore.ConnectError)):
                raise
            self._start_local()
            answer = self._on_wire(call, content, content_type)
        if failed(answer.status):
            raise self._error(
                httpx.Response(answer.status, headers=answer.headers, content=answer.content)
            )
        return call.read_content(answer.content, answer.headers.get("content-type"))

    def _on_wire(self, call: Call[Any], content: bytes | None, content_type: str | None) -> Answer:
        assert self._wire is not None
        method, path = call.method, call.path
        try:
            return self._wire.send(method, path, call.params, content, content_type, call.timeout)
        except UnicodeEncodeError as exc:
            raise unsendable(method, path, exc) from None
        except (httpcore.ConnectError, httpcore.RemoteProtocolError) as exc:
            raise ServerUnavailable(f"cannot reach {self._where()}: {exc}", exc=exc) from exc
        except httpcore.TimeoutException as exc:
            raise OperationTimeout(
                f"{method} {path}: no answer from {self._where()} in time", exc=exc
            ) from exc
        except (httpcore.NetworkError, httpcore.ProtocolError) as exc:
            raise ServerUnavailable(f"{method} {path} failed: {exc}", exc=exc) from exc

    @contextmanager
    def stream_events(
        self, method: str, path: str, **kwargs: Any
    ) -> Iterator[Iterator[dict[str, Any]]]:
        """Send a request whose answer is NDJSON and yield its events one by one.

        Raises like :meth:`request`; starts the local server if the connection is refused
        (nothing was sent then, so sending again is safe).
        """
        with self.stream_lines(method, path, **kwargs) as lines:
            yield (decode(line) for line in lines if line.strip())

    @contextmanager
    def stream_lines(self, method: str, path: str, **kwargs: Any) -> Iterator[Iterator[str]]:
        """Send a request and yield its answer's lines as they arrive (raises like
        :meth:`stream_events`)."""
        with contextlib.ExitStack() as stack:
            for attempt in (1, 2):
                try:
                    response = stack.enter_context(self._http.stream(method, path, **kwargs))
                    break
                except UnicodeEncodeError as exc:
                    raise unsendable(method, path, exc) from None
                except httpx.ConnectError as exc:
                    if attempt == 2 or not self.autostart:
                        raise ServerUnavailable(
                            f"cannot reach {self._where()}: {exc}", exc=exc
                        ) from exc
                    self._start_local()
                except httpx.TimeoutException as exc:
                    raise OperationTimeout(f"{method} {path}: no answer in time", exc=exc) from exc
                except httpx.HTTPError as exc:
                    raise ServerUnavailable(f"{method} {path} failed: {exc}", exc=exc) from exc
            if failed(response.status_code):
                response.read()
                raise self._error(response)
            try:
                yield response.iter_lines()
            except httpx.TimeoutException as exc:
                raise OperationTimeout(f"{method} {path}: no answer in time", exc=exc) from exc
            except httpx.HTTPError as exc:
                raise ServerUnavailable(f"{method} {path} failed: {exc}", exc=exc) from exc

    # -- public -------------------------------------------------------------------------------

    @functools.cached_property
    def memory(self) -> RemoteMemory:
        """The server's memory, with :class:`torpor.Memory` 's API
        (``rt.memory.scope(app=..., user=...)``; :mod:`torpor.client.memory`)."""
        from torpor.client.memory import RemoteMemory

        return RemoteMemory(self)

    @functools.cached_property
    def sandboxes(self) -> SandboxesAPI:
        """This server's sandboxes: ``rt.sandboxes.get_or_create(name)``, ``create``,
        ``get``, ``list`` (:class:`torpor.client.sandbox.Sandboxes`)."""
        if sandboxes_factory is None:  # torpor.client.sandbox sets it when imported
            raise RuntimeError("torpor.client.sandbox is not imported")
        return sandboxes_factory(self)

    @functools.cached_property
    def tokens(self) -> Tokens:
        """The server's tokens: create, list, revoke (:mod:`torpor.client.tokens`)."""
        from torpor.client.tokens import Tokens

        return Tokens(self)

    def health(self) -> dict[str, Any]:
        """The server's identity: ``{"ok", "pid", "version", "tenant", "home"}``."""
        result: dict[str, Any] = self.json("GET", "/v1/health")
        return result

    def nodes(self) -> list[NodeStatus]:
        """Every node with its health and load (one row, ``local``, without a cluster).
        Raises AccessDenied without an admin token."""
        return [NodeStatus.model_validate(n) for n in self.json("GET", "/v1/nodes")]

    def drain_node(self, name: str, *, timeout: float = 300.0) -> DrainReport:
        """Drain node ``name``: it takes no new sandbox, pauses what it runs and gives each
        sandbox up once its pause is durable (waiting up to ``timeout`` seconds). Raises
        AccessDenied without an admin token, NotFound, Conflict (the node is not alive),
        InvalidArgument (no cluster)."""
        body = self.json(
            "POST",
            at("/v1/nodes", name, "/drain"),  # quoted: ".." would name another path
            params={"timeout": timeout},
            timeout=timeout + 60.0,
        )
        return DrainReport.model_validate(body)

    def usage(
        self,
        by: str = "tenant",
        since: datetime | date | str | None = None,
        until: datetime | date | str | None = None,
    ) -> UsageReport:
        """What this tenant's sandboxes, snapshots and volumes used over ``[since, until)``
        (default: this month so far) and what it costs, one line per ``by`` group
        (``tenant``, ``sandbox`` or ``label:KEY``), with what each retention still to run will
        cost. Raises InvalidArgument for a bad grouping or window."""
        query = parse_query(by, since, until)  # checked here too: a typed error, no round trip
        params = {"by": query.by, "since": query.since.isoformat()}
        if until is not None:
            params["until"] = query.until.isoformat()
        return UsageReport.model_validate(self.json("GET", "/v1/usage", params=params))

    def events(
        self,
        *,
        after: int = 0,
        sandbox: str | None = None,
        follow: bool = False,
        wait: float = 10.0,
    ) -> Iterator[SandboxEvent]:
        """This tenant's sandbox lifecycle events (``create``, ``pause``, ``wake``, ``kill``,
        ``expire``, ``error`` ...), oldest first, from ``seq`` ``after`` on; only those of
        ``sandbox`` (id or name) if given. With ``follow`` the iterator then waits for new
        ones (long polls of ``wait`` seconds) until the caller stops it, across a restart of
        the server too (the history is kept in its registry: nothing is lost or repeated).

        Raises like :meth:`request` (:class:`~torpor.errors.SandboxNotFound` for an unknown
        ``sandbox``)."""
        while True:
            params: dict[str, Any] = {"after": after}
            if sandbox is not None:
                params["sandbox"] = sandbox
            if follow:
                params["wait"] = wait
            try:
                page = EventPage.model_validate(
                    self.json("GET", "/v1/events", params=params, timeout=wait + 30.0)
                )
            except ServerUnavailable:
                if not follow:
                    raise
                # a restarting server: its registry keeps the events, so ask again from the
                # same place once it is back (nothing is lost or repeated)
                time.sleep(RECONNECT_DELAY)
                continue
            yield from page.events
            if not page.events and page.next == after and not follow:
                return
            after = page.next

    def close(self) -> None:
        """Close the connection pool (the local server keeps running)."""
        self._http.close()
        if self._wire is not None:
            self._wire.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


_default: Runtime | None = None
_default_lock = threading.Lock()


def default_runtime() -> Runtime:
    """The process-wide runtime used when a call gets no ``runtime=`` (built on first use)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Runtime()
        return _default


def set_default_runtime(runtime: Runtime | None) -> None:
    """Replace (or with None, forget) the process-wide runtime."""
    global _default
    with _default_lock:
        _default = runtime
