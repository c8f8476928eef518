"""``rt.memory``: the memory store of a torpor server, with the embedded API's shape.

::

    rt = torpor.Runtime(url="http://127.0.0.1:8765", token=tok)   # or the local socket
    u = rt.memory.scope(app="support", user="u-42")               # as torpor.Memory().scope()
    u.remember("prefers daily summaries", key="summary_cadence")  # -> Fact
    u.recall("how often should I send summaries?", k=3)            # -> [Hit]

:class:`RemoteMemory` mirrors :class:`~torpor.memory.Memory` and :class:`RemoteScope` mirrors
:class:`~torpor.memory.ScopedMemory`: the same methods, arguments, models (``Fact``,
``Episode``, ``Hit``, ``Profile``, ``Policy``, ``Context``) and typed errors, answered by
:mod:`torpor.server.routes_memory`. The server's token (its tenant and grants) decides what
may be read or written. What only an embedded store has (``store``, ``backend``) is not here;
``tokens`` is :attr:`Runtime.tokens <torpor.client.Runtime.tokens>`.

Requests are built and answers parsed by pure functions (:func:`call_remember` ...), each
returning a :class:`~torpor.client.calls.Call`, so a client on another transport (async)
shares them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from datetime import datetime, timedelta
from pathlib import Path
from typing import IO, Any, TypeVar
from urllib.parse import quote

from pydantic import BaseModel, TypeAdapter

from torpor.client.calls import Call, decode, encode, url_text
from torpor.client.tokens import Connection, Tokens
from torpor.errors import InvalidArgument
from torpor.memory._lines import write_lines
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

__all__ = ["Call", "RemoteMemory", "RemoteScope", "encode"]

T = TypeVar("T")

_FACTS = TypeAdapter(list[Fact])
_EPISODES = TypeAdapter(list[Episode])
_HITS = TypeAdapter(list[Hit])
_RECORD: TypeAdapter[Fact | Episode] = TypeAdapter(Fact | Episode)
_AUDIT = TypeAdapter(list[AuditEntry])


def scope_params(scope: str, tenant: str | None = None) -> dict[str, Any]:
    """The query parameters naming a scope (and a tenant) for the memory routes."""
    return {"scope": scope} if tenant is None else {"scope": scope, "tenant": tenant}


# -- the calls (shared by every client) ---------------------------------------------------------


def call_open(path: str, tenant: str | None) -> Call[dict[str, Any]]:
    return Call("GET", "/v1/memory/scope", scope_params(path, tenant))


def _plain(item: Any) -> Any:
    # a mapping travels as a dict; anything else as it is, for the server to refuse typed
    return dict(item) if isinstance(item, Mapping) else item


def call_remember_many(path: str, items: Iterable[Any]) -> Call[list[Fact]]:
    return Call(
        "POST",
        "/v1/memory/remember_many",
        scope_params(path),
        {"items": [_plain(i) for i in items]},
        _FACTS.validate_python,
    )


def call_log_many(path: str, turns: Iterable[Any]) -> Call[list[Episode]]:
    return Call(
        "POST",
        "/v1/memory/log_many",
        scope_params(path),
        {"turns": [_plain(t) for t in turns]},
        _EPISODES.validate_python,
    )


def call_remember(path: str, text: Any, **fields: Any) -> Call[Fact]:
    item = {"text": text, **fields}
    return Call("POST", "/v1/memory/remember", scope_params(path), item, Fact.model_validate)


def call_log(path: str, role: Any, text: Any, **fields: Any) -> Call[Episode]:
    turn = {"role": role, "text": text, **fields}
    return Call("POST", "/v1/memory/log", scope_params(path), turn, Episode.model_validate)


def call_recall(path: str, query: Any, k: Any, **fields: Any) -> Call[list[Hit]]:
    """Raises InvalidArgument for a ``kind`` that is not a kind or a list (or tuple) of them,
    as the library does."""
    kind = fields.get("kind")
    if kind is not None and not isinstance(kind, str):
        if not isinstance(kind, (list, tuple)):
            raise InvalidArgument(f"kind must be 'fact', 'episode' or a list of them, not {kind!r}")
        fields["kind"] = list(kind)
    body = {"query": query, "k": k, **fields}
    return Call("POST", "/v1/memory/recall", scope_params(path), body, _HITS.validate_python)


def call_context(path: str, query: Any, **fields: Any) -> Call[Context]:
    body = {"query": query, **fields}
    return Call("POST", "/v1/memory/context", scope_params(path), body, lambda d: Context(**d))


def call_get_profile(path: str) -> Call[dict[str, Any]]:
    return Call("GET", "/v1/memory/profile", scope_params(path), None, dict)


def call_set_profile(
    path: str, data: Any, schema: type[BaseModel] | Mapping[str, Any] | None, merge: bool
) -> Call[Profile]:
    if isinstance(schema, type) and issubclass(schema, BaseModel):
        json_schema: Any = schema.model_json_schema()  # a pydantic schema travels as JSON
    else:
        json_schema = None if schema is None else dict(schema)
    body = {"data": data, "schema": json_schema, "merge": merge}
    return Call("PUT", "/v1/memory/profile", scope_params(path), body, Profile.model_validate)


def call_set_policy(path: str, **fields: Any) -> Call[Policy]:
    return Call("PUT", "/v1/memory/policy", scope_params(path), fields, Policy.model_validate)


def call_verify(path: str, record_id: str | None) -> Call[list[Fact]]:
    body = {"record_id": record_id}
    return Call("POST", "/v1/memory/verify", scope_params(path), body, _FACTS.validate_python)


def call_fork(scope: Scope, levels: dict[str, str]) -> Call[Scope]:
    target = Scope(tenant=scope.tenant, **levels) if levels else scope
    return Call(
        "POST", "/v1/memory/fork", scope_params(scope.path), {"levels": levels}, lambda _: target
    )


def import_body(src: str | Path | IO[str] | IO[bytes] | Iterable[str | bytes]) -> bytes:
    """The body of an import: a file's bytes, or the lines of a stream or iterable (text, or
    bytes as a binary file gives them, as the library reads them). Raises InvalidArgument
    for a file that cannot be read and a line that is neither (or not UTF-8 text)."""
    if isinstance(src, (str, Path)):
        try:
            return Path(src).read_bytes()
        except OSError as exc:
            raise InvalidArgument(f"cannot read {src}: {exc}", exc=exc) from exc
    parts: list[bytes] = []
    for line in src:
        if isinstance(line, str):
            try:
                raw = line.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise InvalidArgument(f"an import is UTF-8 JSON lines: {exc}") from None
        elif isinstance(line, (bytes, bytearray, memoryview)):
            raw = bytes(line)
        else:
            raise InvalidArgument(f"an import line is text or bytes, not {type(line).__name__}")
        parts.append(raw if raw.endswith(b"\n") else raw + b"\n")
    return b"".join(parts)


def call_history(path: str, key: str) -> Call[list[Fact]]:
    return Call(
        "GET",
        "/v1/memory/history",
        {**scope_params(path), "key": key},
        None,
        _FACTS.validate_python,
    )


def call_get(path: str, record_id: str) -> Call[Fact | Episode]:
    return Call(
        "GET",
        f"/v1/memory/records/{_id(record_id)}",
        scope_params(path),
        None,
        _RECORD.validate_python,
    )


def call_get_all(path: str, filters: Any, kind: Any, page: Any, page_size: Any) -> Call[RecordPage]:
    body = {"filters": filters, "kind": kind, "page": page, "page_size": page_size}
    return Call("POST", "/v1/memory/get_all", scope_params(path), body, RecordPage.model_validate)


def call_update(path: str, record_id: str, text: Any, metadata: Any) -> Call[Fact]:
    return Call(
        "POST",
        f"/v1/memory/records/{_id(record_id)}/update",
        scope_params(path),
        {"text": text, "metadata": metadata},
        Fact.model_validate,
    )


def call_forget(path: str | None, record_id: str | None) -> Call[int]:
    if record_id is None:
        return Call(
            "DELETE", "/v1/memory/scope", scope_params(path or ""), None, lambda d: int(d["erased"])
        )
    params = {} if path is None else scope_params(path)
    return Call(
        "DELETE", f"/v1/memory/records/{_id(record_id)}", params, None, lambda d: int(d["erased"])
    )


def _id(record_id: object) -> str:
    """``record_id`` as one path segment, quoted (a ``%`` in it is its own, not an escape
    the server would decode into another id). Raises InvalidArgument for one that is none
    (empty, with ``/``, ``.`` or ``..``: a URL would collapse it into another route; a lone
    surrogate: no URL carries it)."""
    if (
        not isinstance(record_id, str)
        or record_id in ("", ".", "..")
        or "/" in record_id
        or not url_text(record_id)
    ):
        raise InvalidArgument(f"a record id is a non-empty string, not {record_id!r}")
    return quote(record_id, safe="")


# -- the sync client ------------------------------------------------------------------------------


class RemoteScope:
    """The records of one scope of a server's memory (see the module docstring). Made by
    :meth:`RemoteMemory.scope`."""

    def __init__(self, memory: RemoteMemory, scope: Scope) -> None:
        self.memory = memory
        self.scope = scope
        self.path = scope.path

    def __repr__(self) -> str:
        return f"RemoteScope({self.scope})"

    def do(self, call: Call[T]) -> T:
        """Send one :class:`Call` through the memory's runtime."""
        return self.memory.do(call)

    # -- writes
    def remember(
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
        return self.do(
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

    def remember_many(self, items: Iterable[str | Mapping[str, Any]]) -> list[Fact]:
        """As :meth:`ScopedMemory.remember_many <torpor.memory.ScopedMemory.remember_many>`:
        one request, one transaction."""
        return self.do(call_remember_many(self.path, items))

    def log(
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
        return self.do(
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

    def log_many(self, turns: Iterable[Mapping[str, Any]]) -> list[Episode]:
        """As :meth:`ScopedMemory.log_many <torpor.memory.ScopedMemory.log_many>`."""
        return self.do(call_log_many(self.path, turns))

    # -- reads
    def recall(
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
        return self.do(
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

    def context(
        self, query: str, budget_tokens: int = 500, *, k_facts: int = 20, k_episodes: int = 10
    ) -> Context:
        """As :meth:`ScopedMemory.context <torpor.memory.ScopedMemory.context>`."""
        call = call_context(
            self.path, query, budget_tokens=budget_tokens, k_facts=k_facts, k_episodes=k_episodes
        )
        return self.do(call)

    def history(self, key: str) -> list[Fact]:
        """As :meth:`ScopedMemory.history <torpor.memory.ScopedMemory.history>`."""
        if not isinstance(key, str):
            raise InvalidArgument("key must be a string")
        return self.do(call_history(self.path, key))

    def get(self, record_id: str) -> Fact | Episode:
        """As :meth:`ScopedMemory.get <torpor.memory.ScopedMemory.get>`."""
        return self.do(call_get(self.path, record_id))

    def get_all(
        self,
        *,
        filters: Mapping[str, Any] | None = None,
        kind: str | None = None,
        page: int = 1,
        page_size: int = 100,
    ) -> RecordPage:
        """As :meth:`ScopedMemory.get_all <torpor.memory.ScopedMemory.get_all>`."""
        return self.do(call_get_all(self.path, filters, kind, page, page_size))

    def update(
        self, record_id: str, text: str, *, metadata: Mapping[str, Any] | None = None
    ) -> Fact:
        """As :meth:`ScopedMemory.update <torpor.memory.ScopedMemory.update>`."""
        return self.do(call_update(self.path, record_id, text, metadata))

    def delete_all(self) -> int:
        """As :meth:`ScopedMemory.delete_all <torpor.memory.ScopedMemory.delete_all>`."""
        return self.do(call_forget(self.path, None))

    # -- profile and policy
    def get_profile(self) -> dict[str, Any]:
        """As :meth:`ScopedMemory.get_profile <torpor.memory.ScopedMemory.get_profile>`."""
        return self.do(call_get_profile(self.path))

    def set_profile(
        self,
        data: Mapping[str, Any],
        *,
        schema: type[BaseModel] | Mapping[str, Any] | None = None,
        merge: bool = False,
    ) -> Profile:
        """As :meth:`ScopedMemory.set_profile <torpor.memory.ScopedMemory.set_profile>` (a
        pydantic ``schema`` travels as its JSON schema)."""
        return self.do(call_set_profile(self.path, data, schema, merge))

    def set_policy(
        self, *, retention_seconds: float | None = None, cache_ttl_seconds: float | None = None
    ) -> Policy:
        """As :meth:`ScopedMemory.set_policy <torpor.memory.ScopedMemory.set_policy>`."""
        call = call_set_policy(
            self.path, retention_seconds=retention_seconds, cache_ttl_seconds=cache_ttl_seconds
        )
        return self.do(call)

    # -- erase, verify, move
    def forget(self, record_id: str | None = None) -> int:
        """As :meth:`ScopedMemory.forget <torpor.memory.ScopedMemory.forget>`."""
        return self.do(call_forget(self.path, record_id))

    def verify(self, record_id: str | None = None) -> list[Fact]:
        """As :meth:`ScopedMemory.verify <torpor.memory.ScopedMemory.verify>` (sources are
        read where the server runs)."""
        return self.do(call_verify(self.path, record_id))

    def export_lines(self) -> Iterator[str]:
        """This scope subtree as JSON lines, streamed from the server."""
        with self.memory.runtime.stream_lines(
            "GET", "/v1/memory/export", params=scope_params(self.path)
        ) as lines:
            yield from lines

    def export(self, dest: str | Path | IO[str]) -> int:
        """As :meth:`ScopedMemory.export <torpor.memory.ScopedMemory.export>`: streamed, never
        held whole in memory."""
        return write_lines(self.export_lines(), dest)

    def import_(self, src: str | Path | IO[str] | Iterable[str]) -> int:
        """As :meth:`ScopedMemory.import_ <torpor.memory.ScopedMemory.import_>`."""
        response = self.memory.runtime.request(
            "POST",
            "/v1/memory/import",
            params=scope_params(self.path),
            content=import_body(src),
            headers={"content-type": "application/x-ndjson"},
        )
        return int(decode(response.content)["imported"])

    def fork(self, **levels: str) -> RemoteScope:
        """As :meth:`ScopedMemory.fork <torpor.memory.ScopedMemory.fork>`."""
        return RemoteScope(self.memory, self.do(call_fork(self.scope, levels)))


class RemoteMemory:
    """A server's memory for the runtime's caller: :class:`~torpor.memory.Memory` 's shape
    (see the module docstring). Made by :attr:`Runtime.memory <torpor.client.Runtime.memory>`.
    """

    def __init__(self, runtime: Connection) -> None:
        self.runtime = runtime
        self._tenant: str | None = None

    def __repr__(self) -> str:
        return f"RemoteMemory({self.runtime!r})"

    def do(self, call: Call[T]) -> T:
        """Send one :class:`Call` and parse its answer (raises the server's typed error)."""
        return self.runtime.do(call)

    @property
    def tenant(self) -> str:
        """The caller's tenant (asked of the server once)."""
        if self._tenant is None:
            self._tenant = str(self.runtime.health()["tenant"])
        return self._tenant

    @property
    def tokens(self) -> Tokens:
        """The server's tokens (:attr:`Runtime.tokens <torpor.client.Runtime.tokens>`)."""
        return Tokens(self.runtime)

    def scope(
        self,
        *,
        app: str | None = None,
        user: str | None = None,
        agent: str | None = None,
        session: str | None = None,
        tenant: str | None = None,
    ) -> RemoteScope:
        """As :meth:`Memory.scope <torpor.memory.Memory.scope>`: checked by the server (a
        valid scope the caller may read). Raises :class:`InvalidArgument`,
        :class:`AccessDenied`."""
        scope = Scope(tenant="default", app=app, user=user, agent=agent, session=session)
        return self.scope_from_path(scope.path, tenant=tenant)

    def scope_from_path(self, path: str, *, tenant: str | None = None) -> RemoteScope:
        """As :meth:`Memory.scope_from_path <torpor.memory.Memory.scope_from_path>`."""
        if not isinstance(path, str):
            raise InvalidArgument(f"a scope path is a string, not {path!r}")
        opened = self.do(call_open(path, tenant))
        self._tenant = str(opened["tenant"])
        return RemoteScope(self, Scope.from_path(str(opened["scope"]), tenant=self._tenant))

    def forget(self, target: str | RemoteScope) -> int:
        """As :meth:`Memory.forget <torpor.memory.Memory.forget>`: a record id (anywhere in
        the tenant) or a whole scope."""
        if isinstance(target, RemoteScope):
            return target.forget()
        if not isinstance(target, str):
            raise InvalidArgument("forget() takes a record id or a scope")
        return self.do(call_forget(None, target))

    def gc(self) -> int:
        """As :meth:`Memory.gc <torpor.memory.Memory.gc>`."""
        return self.do(Call("POST", "/v1/memory/gc", {}, None, lambda d: int(d["purged"])))

    def audit_log(self, limit: int = 100) -> list[AuditEntry]:
        """The tenant's newest audit entries (needs read on the tenant's root)."""
        return self.do(
            Call("GET", "/v1/memory/audit", {"limit": limit}, None, _AUDIT.validate_python)
        )

    def close(self) -> None:
        """Nothing to release: the :class:`Runtime` owns the connection."""

    def __enter__(self) -> RemoteMemory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
