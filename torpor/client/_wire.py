"""A lean sender for one-shot calls over the local unix socket.

:meth:`Runtime.do <torpor.client.Runtime.do>` over the local socket sends through
:class:`SocketWire`: ``httpcore`` (the transport under ``httpx``) with the request line built
here, once per call. ``httpx.Client`` parses the base URL and the merged URL three times per
request, merges cookies and builds its own request and response models: about 0.4 ms of CPU
per call on this project's machine, a fifth of the 2 ms a recall over the socket may add to the
embedded call (issue 8, ``bench/service.py``). Streams, uploads and TCP servers (proxies from
the environment, TLS) keep ``httpx``.

The answer is the status, the headers and the body, read whole; errors are ``httpcore``'s, which
the runtime translates as it translates ``httpx``'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote, urlencode

import httpcore

__all__ = ["Answer", "SocketWire", "query_string"]

#: characters a call's path keeps as they are (its segments are already quoted by the calls)
_PATH_SAFE = "/%:@!$&'()*+,;=-._~"


def _text(value: Any) -> str:
    # as httpx renders a query parameter
    if value is True:
        return "true"
    if value is False:
        return "false"
    return "" if value is None else str(value)


def query_string(params: Mapping[str, Any] | Sequence[tuple[str, Any]] | None) -> str:
    """``params`` (a mapping, or ``(name, value)`` pairs, as httpx takes them) as a query
    string (a list or tuple value repeats its name), or ``""``."""
    if not params:
        return ""
    items = params.items() if isinstance(params, Mapping) else params
    pairs = [
        (str(k), _text(each))
        for k, v in items
        for each in (v if isinstance(v, (list, tuple)) else (v,))
    ]
    return urlencode(pairs)


class Answer:
    """A whole answer: ``status``, ``headers`` (lower-case names) and ``content``."""

    __slots__ = ("content", "headers", "status")

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], content: bytes) -> None:
        self.status = status
        self.headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in headers}
        self.content = content


class SocketWire:
    """HTTP/1.1 over one unix socket with a pool of kept-alive connections (thread-safe)."""

    def __init__(self, socket_path: str, headers: Mapping[str, str], timeout: float | None) -> None:
        self._pool = httpcore.ConnectionPool(uds=socket_path)
        self._headers = [(b"host", b"torpor")] + [
            (k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()
        ]
        self._timeout = timeout

    def send(
        self,
        method: str,
        path: str,
        params: Mapping[str, Any] | Sequence[tuple[str, Any]] | None,
        content: bytes | None,
        content_type: str | None,
        timeout: float | str | None,
    ) -> Answer:
        """Send one request and read its answer. ``timeout``: seconds (None: no limit;
        ``"default"``: the wire's, with 10 s to connect, as the runtime's ``httpx`` client).
        Raises ``httpcore`` errors (ConnectError, TimeoutException, ...)."""
        query = query_string(params)
        target = quote(path, safe=_PATH_SAFE) + ("?" + query if query else "")
        headers = list(self._headers)
        if content is not None:
            headers.append((b"content-length", str(len(content)).encode()))
            if content_type is not None:
                headers.append((b"content-type", content_type.encode("latin-1")))
        elif method in ("POST", "PUT", "PATCH"):
            headers.append((b"content-length", b"0"))
        if timeout == "default":
            t: float | None = self._timeout
            limits = {"connect": 10.0, "read": t, "write": t, "pool": t}
        else:
            t = timeout if timeout is None else float(timeout)
            limits = {"connect": t, "read": t, "write": t, "pool": t}
        url = httpcore.URL(scheme=b"http", host=b"torpor", port=None, target=target.encode())
        response = self._pool.request(
            method.encode(), url, headers=headers, content=content, extensions={"timeout": limits}
        )
        return Answer(response.status, response.headers, response.content)

    def close(self) -> None:
        """Close every connection of the pool."""
        self._pool.close()
