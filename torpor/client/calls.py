"""One request and how to read its answer: what the sync and the async clients share.

A :class:`Call` is built by a pure function (:mod:`torpor.client.memory`'s ``call_*``,
:mod:`torpor.client.sandbox_calls`) and sent by a runtime's ``do``::

    call = sandbox_calls.pause(sandbox_id)
    info = runtime.do(call)                 # Runtime: httpx.Client
    info = await async_runtime.do(call)     # AsyncRuntime: httpx.AsyncClient

so a sync and an async client differ only in the line that sends: building the request (path,
parameters, JSON body, timeout) and reading the answer (JSON into models, raw bytes, nothing)
are written once.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta
from typing import Any, Generic, Literal, TypeVar

import httpx
from pydantic import BaseModel

from torpor.errors import InvalidArgument, ServerUnavailable

__all__ = ["DEFAULT", "Call", "encode", "unsendable", "url_text"]

T = TypeVar("T")

#: a :attr:`Call.timeout` that keeps the runtime's own
DEFAULT: Literal["default"] = "default"


def _default(value: object) -> object:
    if isinstance(value, (datetime, date)):  # a date: its midnight, as the library reads it
        return value.isoformat()
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON")


def decode(content: bytes | str) -> Any:
    """An answer's JSON (a body, or one line of an NDJSON stream). Raises
    :class:`ServerUnavailable` when it is not JSON: what answered is no torpor server (a
    captive portal's or a proxy's page) or the answer was cut."""
    try:
        return json.loads(content)
    except (ValueError, RecursionError) as exc:
        shown = (
            content[:200] if isinstance(content, str) else content[:200].decode(errors="replace")
        )
        raise ServerUnavailable(f"the server's answer is not JSON: {shown!r}", exc=exc) from None


def url_text(value: str) -> bool:
    """Whether ``value`` can go into a URL (a path segment, a query parameter): it encodes
    as UTF-8 (no lone surrogate)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def unsendable(method: str, path: str, exc: UnicodeEncodeError) -> InvalidArgument:
    """The error of a request whose URL cannot be encoded (a parameter with a lone
    surrogate)."""
    return InvalidArgument(f"{method} {path}: a parameter is not UTF-8 text ({exc.reason})")


def encode(body: object) -> bytes:
    """A request body as JSON: times as ISO 8601, durations in seconds, models dumped. ASCII
    escapes keep a lone surrogate intact for the server to refuse, as the embedded store does.
    Raises :class:`InvalidArgument` for a value JSON cannot hold."""
    try:
        return json.dumps(body, default=_default, ensure_ascii=True, allow_nan=False).encode()
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidArgument(f"not JSON: {exc}") from None


@dataclass
class Call(Generic[T]):
    """One request and how to read its answer.

    ``body``: sent as JSON; ``content``: sent as raw bytes instead
    (``application/octet-stream``). ``answer``: what ``parse`` receives — the decoded JSON
    (``"json"``), the raw bytes (``"bytes"``), the text (``"text"``) or None (``"none"``: a
    204). ``timeout``: seconds for this request (None: no limit; :data:`DEFAULT`: the
    runtime's).
    """

    method: str
    path: str
    params: Any = field(default_factory=dict)
    body: object = None
    parse: Callable[[Any], T] = field(default=lambda data: data)
    content: bytes | None = None
    answer: Literal["json", "bytes", "text", "none"] = "json"
    timeout: float | Literal["default"] | None = DEFAULT

    def payload(self) -> tuple[bytes | None, str | None]:
        """The body to send and its content type (``(None, None)`` for none). Raises
        :class:`InvalidArgument` for a body JSON cannot hold."""
        if self.content is not None:
            return self.content, "application/octet-stream"
        if self.body is not None:
            return encode(self.body), "application/json"
        return None, None

    def request_kwargs(self) -> dict[str, Any]:
        """The ``httpx`` keyword arguments of this call."""
        kwargs: dict[str, Any] = {"params": self.params}
        content, content_type = self.payload()
        if content is not None:
            kwargs["content"] = content
            kwargs["headers"] = {"content-type": content_type}
        if self.timeout != DEFAULT:
            kwargs["timeout"] = self.timeout
        return kwargs

    def read(self, response: httpx.Response) -> T:
        """The answer of a successful ``response`` (already read), parsed."""
        return self.read_content(response.content, response.headers.get("content-type"))

    def read_content(self, content: bytes, content_type: str | None = None) -> T:
        """The answer of a successful request from its body (and its content type, whose
        charset decodes a text answer; UTF-8 without one), parsed."""
        if self.answer == "json":
            return self.parse(decode(content))
        if self.answer == "bytes":
            return self.parse(content)
        if self.answer == "text":
            return self.parse(content.decode(_charset(content_type), errors="replace"))
        return self.parse(None)


def _charset(content_type: str | None) -> str:
    for part in (content_type or "").split(";")[1:]:
        name, _, value = part.strip().partition("=")
        if name.lower() == "charset" and value:
            value = value.strip('"')
            try:
                codecs.lookup(value)
            except LookupError:
                break
            return value
    return "utf-8"
