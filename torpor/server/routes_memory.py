"""Memory routes: every operation of :class:`~torpor.memory.Memory` and
:class:`~torpor.memory.ScopedMemory`, over HTTP, with the same semantics and typed errors.

The scope is a query parameter, a scope path (``?scope=app/support/user/u-42``; absent or
empty: the tenant's root); ``?tenant=`` may name the caller's own tenant (any other is an
audited AccessDenied, as ``Memory.scope(tenant=...)``)::

    GET    /v1/memory/scope                open the scope (the read check)  -> ScopeOut
    POST   /v1/memory/remember             ScopedMemory.remember            -> Fact
    POST   /v1/memory/remember_many        ScopedMemory.remember_many       -> [Fact]
    POST   /v1/memory/log                  ScopedMemory.log                 -> Episode
    POST   /v1/memory/log_many             ScopedMemory.log_many            -> [Episode]
    POST   /v1/memory/recall               ScopedMemory.recall              -> [Hit]
    POST   /v1/memory/context              ScopedMemory.context             -> ContextOut
    GET    /v1/memory/history?key=         ScopedMemory.history             -> [Fact]
    GET    /v1/memory/records/{id}         ScopedMemory.get                 -> Fact | Episode
    POST   /v1/memory/records/{id}/update  ScopedMemory.update (a new version) -> Fact
    POST   /v1/memory/get_all              ScopedMemory.get_all (one page)  -> RecordPage
    DELETE /v1/memory/records/{id}         forget one record (Memory.forget without a scope)
    DELETE /v1/memory/scope                forget the scope subtree         -> Erased
    GET    /v1/memory/profile              ScopedMemory.get_profile         -> {...}
    PUT    /v1/memory/profile              ScopedMemory.set_profile         -> Profile
    PUT    /v1/memory/policy               ScopedMemory.set_policy (retention) -> Policy
    POST   /v1/memory/verify               ScopedMemory.verify              -> [Fact]
    GET    /v1/memory/export               JSON lines, streamed as read
    POST   /v1/memory/import               JSON lines in the body           -> Imported
    POST   /v1/memory/fork                 ScopedMemory.fork                -> ScopeOut
    POST   /v1/memory/gc                   Memory.gc                        -> Purged
    GET    /v1/memory/audit                Memory.audit_log                 -> [AuditEntry]

Tokens are :mod:`torpor.server.routes_tokens`. The caller's grants apply exactly as they do to
an embedded ``Memory(token=...)`` (the local owner has every scope). The routes are plain
``def``: the stores block, so FastAPI runs them on its thread pool. Each renders its own answer
there (:func:`_json`; the model stays declared for the OpenAPI document), so a request crosses
between threads once: FastAPI would validate and render a returned model in a second trip to the
pool, and on a loaded machine each trip costs more than the rendering itself.
"""

from __future__ import annotations

import functools
import io
import threading
from collections.abc import Iterator
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from torpor.errors import InvalidArgument, PayloadTooLarge
from torpor.memory import Memory, ScopedMemory
from torpor.memory.embeddings import Embedder, resolve_embedder
from torpor.memory.models import AuditEntry, Episode, Fact, Hit, Policy, Profile, RecordPage
from torpor.server.auth import Caller
from torpor.server.deps import CallerDep
from torpor.server.schema import NDJSONResponse

__all__ = ["MAX_IMPORT_BYTES", "memory_of", "router", "tenant_memory"]

router = APIRouter(prefix="/v1/memory", tags=["memory"])

#: the largest import body (JSON lines) a server takes by default
MAX_IMPORT_BYTES = 256 << 20

ScopeQuery = Annotated[str, Query(max_length=2000, description="scope path, '' = tenant root")]
TenantQuery = Annotated[str | None, Query(max_length=200)]


class _Body(BaseModel):
    # Fields the memory layer validates itself stay loose here, so bad input gets the same
    # typed error (and message) as the embedded call, not a generic 400 from the model.
    model_config = ConfigDict(extra="forbid")


class RememberBody(_Body):
    text: Any = None
    key: Any = None
    metadata: Any = None
    source: Any = None
    durability: Any = "persistent"
    ttl: Any = None


class RememberManyBody(_Body):
    items: list[Any] = Field(max_length=100_000)


#: a time as JSON carries it, read by the memory layer as the library reads it: ISO 8601, a
#: time without an offset and a bare date (its midnight) in UTC; a number is refused there
IsoTime = Annotated[
    str | None, Field(description="ISO 8601: '2026-03-01T14:00:00Z'; no offset: UTC")
]


class LogBody(_Body):
    role: Any = None
    text: Any = None
    session: Any = None
    metadata: Any = None
    at: IsoTime = None
    durability: Any = "persistent"
    ttl: Any = None


class LogManyBody(_Body):
    turns: list[dict[str, Any]] = Field(max_length=100_000)


class RecallBody(_Body):
    query: Any = None
    k: Any = 5
    kind: Any = None
    metadata: Any = None
    since: IsoTime = None
    until: IsoTime = None
    as_of: IsoTime = None
    include_history: bool = False
    session: str | None = None
    min_similarity: float | None = None


class GetAllBody(_Body):
    filters: Any = None
    kind: Any = None
    page: Any = 1
    page_size: Any = 100


class UpdateBody(_Body):
    text: Any = None
    metadata: Any = None


class ContextBody(_Body):
    query: Any = None
    budget_tokens: Any = 500
    k_facts: Any = 20
    k_episodes: Any = 10


class ProfileBody(_Body):
    data: Any = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    merge: bool = False


class PolicyBody(_Body):
    retention_seconds: float | None = None
    cache_ttl_seconds: float | None = None


class VerifyBody(_Body):
    record_id: str | None = None


class ForkBody(_Body):
    levels: dict[str, str] = Field(default_factory=dict, max_length=4)


class ScopeOut(BaseModel):
    tenant: str
    scope: str


class ContextOut(BaseModel):
    """:class:`~torpor.memory.Context` on the wire."""

    text: str
    tokens: int
    budget_tokens: int
    ids: list[str]
    profile_used: bool


class Erased(BaseModel):
    erased: int


class Imported(BaseModel):
    imported: int


class Purged(BaseModel):
    purged: int


# -- the caller's memory -----------------------------------------------------------------------

_lock = threading.Lock()


def _embedder(state: Any) -> Embedder | None:
    with _lock:
        if not getattr(state, "memory_embedder_ready", False):
            state.memory_embedder = resolve_embedder(getattr(state, "memory_embedder", None))
            state.memory_embedder_ready = True
    embedder: Embedder | None = state.memory_embedder
    return embedder


def tenant_memory(app: Any, tenant: str) -> Memory:
    """The server's memory of ``tenant`` as its owner (one per tenant, over the app's
    backend; shared by the memory routes and the MCP tools)."""
    state = app.state
    with _lock:
        cache: dict[str, Memory] | None = getattr(state, "tenant_memories", None)
        if cache is None:
            cache = state.tenant_memories = {}
        base = cache.get(tenant)
    if base is None:
        # quotas.json lives in the served home (None for a test double: $TORPOR_HOME)
        served = getattr(getattr(state, "manager", None), "paths", None)
        base = Memory.attach(
            state.memory_backend,
            tenant,
            embedder=_embedder(state),
            reranker=getattr(state, "memory_reranker", None),
            home=None if served is None else served.home,
        )
        with _lock:
            base = cache.setdefault(tenant, base)
    return base


def memory_of(request: Request, caller: Caller) -> Memory:
    """The server's memory of ``caller`` 's tenant, seen with ``caller`` 's grants."""
    base = tenant_memory(request.app, caller.tenant)
    if caller.is_owner:
        return base
    return base.acting_as(caller.access(request.app.state.memory_backend))


def open_scope_of(request: Request, caller: Caller, scope: str, tenant: str | None) -> ScopedMemory:
    """``caller`` 's view of ``scope`` (``tenant``: the ``?tenant=`` check), as every route
    opens it. Raises what :meth:`Memory.scope_from_path` raises, and AccessDenied (audited)
    for another tenant."""
    mem = memory_of(request, caller)
    if tenant is not None:
        mem.access.require_tenant(tenant, "scope")
    return mem.scope_from_path(scope)


@functools.cache
def _adapter(model: Any) -> TypeAdapter[Any]:
    return TypeAdapter(model)


def _json(model: Any, value: Any) -> Response:
    """``value`` rendered as the JSON of ``model`` (the route's ``response_model``), on the
    calling thread (see the module docstring)."""
    body = _adapter(model).dump_json(value, by_alias=True)
    return Response(body, media_type="application/json")


# -- routes --------------------------------------------------------------------------------------


@router.get("/scope", response_model=ScopeOut)
def open_scope(
    request: Request, caller: CallerDep, scope: ScopeQuery = "", tenant: TenantQuery = None
) -> Response:
    """Open a scope: what ``Memory.scope()`` checks (a valid path the caller may read)."""
    s = open_scope_of(request, caller, scope, tenant)
    return _json(ScopeOut, ScopeOut(tenant=s.scope.tenant, scope=s.path))


@router.post("/remember", response_model=Fact)
def remember(
    body: RememberBody,
    request: Request,
    caller: CallerDep,
    scope: ScopeQuery = "",
    tenant: TenantQuery = None,
) -> Response:
    """Store a fact (with ``key``: supersede the current fact with that key)."""
    return do_remember(open_scope_of(request, caller, scope, tenant), body)


def do_remember(s: ScopedMemory, body: RememberBody) -> Response:
    """The remember route's work once its scope is open (also :mod:`torpor.server.fastpath`)."""
    [fact] = s.remember_many([body.model_dump()])
    return _json(Fact, fact)


@router.post("/remember_many", response_model=list[Fact])
def remember_many(
    body: RememberManyBody,
    request: Request,
    caller: CallerDep,
    scope: ScopeQuery = "",
    tenant: TenantQuery = None,
) -> Response:
    """Store many facts in one transaction (all or nothing)."""
    return _json(
        list[Fact], open_scope_of(request, caller, scope, tenant).remember_many(body.items)
    )


@router.post("/log", response_model=Episode)
def log_turn(
    body: LogBody,
    request: Request,
    caller: CallerDep,
    scope: ScopeQuery = "",
    tenant: TenantQuery = None,
) -> Response:
    """Append one turn to the episodic log."""
    return do_log(open_scope_of(request, caller, scope, tenant), body)


def do_log(s: ScopedMemory, body: LogBody) -> Response:
    """The log route's work once its scope is open (also :mod:`torpor.server.fastpath`)."""
    [episode] = s.log_many([body.model_dump()])
    return _json(Episode, episode)


@router.post("/log_many", response_model=list[Episode])
def log_many(
    body: LogManyBody,
    request: Request,
    caller: CallerDep,
    scope: ScopeQuery = "",
    tenant: TenantQuery = None,
) -> Response:
    """Append many turns in one transaction (all or nothing)."""
    return _json(list[Episode], open_scope_of(request, caller, scope, tenant).log_many(body.turns))


@router.post("/recall", response_model=list[Hit])
def recall(
    body: RecallBody,
    request: Request,
    caller: CallerDep,
    scope: ScopeQuery = "",
    tenant: TenantQuery = None,
) -> Response:
    """The best records for a query from this scope and its ancestors."""
    return do_recall(open_scope_of(request, caller, scope, tenant), body)


def do_recall(s: ScopedMemory, body: RecallBody) -> Response:
    """The recall route's work once its scope is open (also :mod:`torpor.server.fastpath`)."""
    return _json(list[Hit], s.recall(**body.model_dump()))


@router.post("/context", response_model=ContextOut)
def context(
    body: ContextBody,
    request: Request,
    caller: CallerDep,
    scope: ScopeQuery = "",
    tenant: TenantQuery = None,
) -> Response:
    """A prompt-ready block within a token budget."""
    return do_context(open_scope_of(request, caller, scope, tenant), body)


def do_context(s: ScopedMemory, body: ContextBody) -> Response:
    """The context route's work once its scope is open (also :mod:`torpor.server.fastpath`)."""
    c = s.context(**body.model_dump())
    return _json(
        ContextOut,
        ContextOut(
            text=c.text,
            tokens=c.tokens,
            budget_tokens=c.budget_tokens,
            ids=list(c.ids),
            profile_used=c.profile_used,
        ),
    )


@router.get("/history", response_model=list[Fact])
def history(
    request: Request,
    caller: CallerDep,
    key: Annotated[str, Query(max_length=1000)],
    scope: ScopeQuery = "",
    tenant: TenantQuery = None,
) -> Response:
    """Every version of a keyed fact in this scope, oldest first."""
    return _json(list[Fact], open_scope_of(request, caller, scope, tenant).history(key))


@router.get("/records/{record_id}", response_model=Fact | Episode)
def get_record(
    record_id: str,
    request: Request,
    caller: CallerDep,
    scope: ScopeQuery = "",
    tenant: TenantQuery = None,
) -> Response:
    """One record visible from this scope."""
    return _json(Fact | Episode, open_scope_of(request, caller, scope, tenant).get(record_id))


@router.post("/records/{record_id}/update", response_model=Fact)
def update_record(
    record_id: str,
    body: UpdateBody,
    request: Request,
    caller: CallerDep,
    scope: ScopeQuery = "",
    tenant: TenantQuery = None,
) -> Response:
    """A new version of a keyed fact (the old one stays in its history)."""
    return _json(
        Fact, open_scope_of(request, caller, scope, tenant).update(record_id, **body.model_dump())
    )


@router.post("/get_all", response_model=RecordPage)
def get_all(
    body: GetAllBody,
    request: Request,
    caller: CallerDep,
    scope: ScopeQuery = "",
    tenant: TenantQuery = None,
) -> Response:
    """One page of the current records stored in this scope, newest first."""
    return _json(
        RecordPage, open_scope_of(request, caller, scope, tenant).get_all(**body.model_dump())
    )


@router.delete("/records/{record_id}", response_model=Erased)
def forget_record(
    record_id: str,
    request: Request,
    caller: CallerDep,
    scope: Annotated[str | None, Query(max_length=2000)] = None,
    tenant: TenantQuery = None,
) -> Response:
    """Erase one record: anywhere in the tenant (``Memory.forget(id)``), or with ``scope``
    only in that scope subtree (``ScopedMemory.forget(id)``)."""
    if scope is None:
        mem = memory_of(request, caller)
        if tenant is not None:
            mem.access.require_tenant(tenant, "forget")
        return _json(Erased, Erased(erased=mem.forget(record_id)))
    return _json(
        Erased, Erased(erased=open_scope_of(request, caller, scope, tenant).forget(record_id))
    )


@router.delete("/scope", response_model=Erased)
def forget_scope(
    request: Request, caller: CallerDep, scope: ScopeQuery = "", tenant: TenantQuery = None
) -> Response:
    """Erase the whole scope subtree (records, profiles, policies)."""
    return _json(Erased, Erased(erased=open_scope_of(request, caller, scope, tenant).forget()))


@router.get("/profile", response_model=dict[str, Any])
def get_profile(
    request: Request, caller: CallerDep, scope: ScopeQuery = "", tenant: TenantQuery = None
) -> Response:
    """This scope's profile data (``{}`` when none is set)."""
    return _json(dict[str, Any], open_scope_of(request, caller, scope, tenant).get_profile())


@router.put("/profile", response_model=Profile)
def set_profile(
    body: ProfileBody,
    request: Request,
    caller: CallerDep,
    scope: ScopeQuery = "",
    tenant: TenantQuery = None,
) -> Response:
    """Replace (or merge into) the profile, checked against a JSON schema."""
    s = open_scope_of(request, caller, scope, tenant)
    return _json(Profile, s.set_profile(body.data, schema=body.json_schema, merge=body.merge))


@router.put("/policy", response_model=Policy)
def set_policy(
    body: PolicyBody,
    request: Request,
    caller: CallerDep,
    scope: ScopeQuery = "",
    tenant: TenantQuery = None,
) -> Response:
    """Set this scope's retention and the default TTL of cache records."""
    return _json(
        Policy, open_scope_of(request, caller, scope, tenant).set_policy(**body.model_dump())
    )


@router.post("/verify", response_model=list[Fact])
def verify(
    body: VerifyBody,
    request: Request,
    caller: CallerDep,
    scope: ScopeQuery = "",
    tenant: TenantQuery = None,
) -> Response:
    """Re-check the sources of one fact or of every sourced fact in this scope."""
    return _json(list[Fact], open_scope_of(request, caller, scope, tenant).verify(body.record_id))


@router.get("/export", response_class=NDJSONResponse)
def export(
    request: Request, caller: CallerDep, scope: ScopeQuery = "", tenant: TenantQuery = None
) -> StreamingResponse:
    """This scope subtree as JSON lines (``application/x-ndjson``), streamed as it is read."""
    lines = open_scope_of(request, caller, scope, tenant).export_lines()

    def body() -> Iterator[bytes]:
        for line in lines:
            yield (line + "\n").encode()

    return NDJSONResponse(body())


@router.post("/import")
async def import_(
    request: Request, caller: CallerDep, scope: ScopeQuery = "", tenant: TenantQuery = None
) -> Imported:
    """Load an export (JSON lines in the body) into this scope; all or nothing. A body over
    the server's import limit is :class:`PayloadTooLarge`, with nothing written."""
    from starlette.concurrency import run_in_threadpool

    s = await run_in_threadpool(open_scope_of, request, caller, scope, tenant)
    limit: int = getattr(request.app.state, "max_import_bytes", MAX_IMPORT_BYTES)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(
                f"import body over the {limit}-byte limit", size=size, limit=limit
            )
        chunks.append(chunk)
    try:
        text = b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidArgument(f"an import is UTF-8 JSON lines: {exc}") from None
    # lines as a file's are read (universal newlines), not str.splitlines: JSON may carry
    # U+2028, U+2029 and U+0085 unescaped inside a string
    n = await run_in_threadpool(s.import_, io.StringIO(text, newline=None))
    return Imported(imported=n)


@router.post("/fork", response_model=ScopeOut)
def fork(
    body: ForkBody,
    request: Request,
    caller: CallerDep,
    scope: ScopeQuery = "",
    tenant: TenantQuery = None,
) -> Response:
    """Copy this scope subtree to a new scope of the same tenant."""
    target = open_scope_of(request, caller, scope, tenant).fork(**body.levels)
    return _json(ScopeOut, ScopeOut(tenant=target.scope.tenant, scope=target.path))


@router.post("/gc", response_model=Purged)
def gc(request: Request, caller: CallerDep, tenant: TenantQuery = None) -> Response:
    """Purge expired records for good (needs write on the tenant's root)."""
    mem = memory_of(request, caller)
    if tenant is not None:
        mem.access.require_tenant(tenant, "gc")
    return _json(Purged, Purged(purged=mem.gc()))


@router.get("/audit", response_model=list[AuditEntry])
def audit(
    request: Request,
    caller: CallerDep,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
    tenant: TenantQuery = None,
) -> Response:
    """The tenant's newest audit entries (needs read on the tenant's root)."""
    mem = memory_of(request, caller)
    if tenant is not None:
        mem.access.require_tenant(tenant, "audit")
    mem.access.require("read", "", "audit")
    return _json(list[AuditEntry], mem.audit_log(limit))
