"""What every route needs: the engine's manager and the caller.

Routers (this package's ``routes_*`` modules, and others added later) depend on these
functions, so a route stays "parse, one manager call, render":

* :data:`CallerDep` — who is calling (:class:`~torpor.server.auth.Caller`: tenant, actor,
  memory grants, sandbox label selector); memory and token routes check its grants.
* :data:`Tenant` — the caller's tenant, *after* the caller's sandbox rights were checked
  against the route. Every sandbox-layer route takes ``Tenant``, so none can skip the check.

What a token restricted to some sandboxes (a label selector such as ``{"user": "u-42"}``)
reaches:

* **sandboxes** carrying those labels: a route under ``/v1/sandboxes/{id_or_name}`` answers
  SandboxNotFound (audited) for any other; what it creates (create, get-or-create, fork,
  restore) carries them;
* **snapshots of those sandboxes**: a snapshot belongs to the labels its source sandbox had
  when it was taken (``SnapshotInfo.carried.labels``); a route under
  ``/v1/snapshots/{id_or_name}`` answers SnapshotNotFound (audited) for any other, and the
  list shows only those;
* **volumes and drives carrying those labels** (given at create, as a sandbox's): a route
  under ``/v1/volumes/{id_or_name}`` or ``/v1/drives/{id_or_name}`` answers VolumeNotFound or
  DriveNotFound (audited) for any other, the lists show only those, what it creates carries
  them, and it attaches or mounts at create only those (into its own sandboxes). A volume or
  drive without labels (the tenant's shared storage: a volume read-only in many sandboxes, a
  drive for hand-offs between agents) needs rights on every sandbox (``{}``); the tenant's
  admin mounts it into a user's sandbox, which keeps it across pause and wake;
* nothing else tenant-wide (usage, events, GC).
"""

from __future__ import annotations

from typing import Annotated, Any, Protocol, TypeVar

from fastapi import Depends, Request
from starlette.concurrency import run_in_threadpool

from torpor.errors import SandboxNotFound, SnapshotNotFound
from torpor.memory.models import Scope
from torpor.sandbox.checkpoints import Checkpoints
from torpor.sandbox.requests import MemoryScope, ScopeGrant
from torpor.sandbox.storage.snapshots import SnapshotInfo
from torpor.server.auth import Caller, Identity

__all__ = [
    "CallerDep",
    "IdentityDep",
    "Manager",
    "Tenant",
    "checkpoints_of",
    "get_caller",
    "get_identity",
    "get_manager",
    "get_tenant",
    "over_socket",
    "visible_shared",
    "visible_snapshot",
    "within_selector",
]


def get_manager(request: Request) -> Any:
    """The :class:`~torpor.sandbox.manager.SandboxManager` this app serves."""
    return request.app.state.manager


def get_identity(request: Request) -> Identity:
    """The app's :class:`~torpor.server.auth.Identity` (tokens, audit log)."""
    identity: Identity = request.app.state.identity
    return identity


def over_socket(request: Request) -> bool:
    """True when the request came over a unix socket (uvicorn reports no port for one)."""
    server: Any = request.scope.get("server")
    return server is not None and server[1] is None


async def get_caller(request: Request) -> Caller:
    """Who the request acts for. Raises :class:`~torpor.errors.AccessDenied` (audited).

    The local owner (no token, where none is required) is answered at once; any other
    request reads the token table (or writes the audit entry of a refusal) on the thread
    pool, never on the event loop. The table is read on every request, so a revoke takes
    effect on the next one.
    """
    identity = get_identity(request)
    authorization = request.headers.get("authorization")
    trusted = over_socket(request)
    if not authorization and (trusted or not identity.require_token):
        return identity.caller(None, trusted=trusted)  # no lookup, no I/O: not worth a thread
    return await run_in_threadpool(identity.caller, authorization, trusted=trusted)


# The dependencies below are ``async`` though they do no I/O: FastAPI runs a plain ``def``
# dependency on its thread pool, and a trip there and back costs more than the call itself
# (milliseconds on a loaded machine, on every request).


async def _identity(request: Request) -> Identity:
    return get_identity(request)


CallerDep = Annotated[Caller, Depends(get_caller)]
IdentityDep = Annotated[Identity, Depends(_identity)]


def _action(request: Request) -> str:
    route = request.scope.get("route")
    return f"{request.method} {getattr(route, 'path', request.url.path)}"


async def get_tenant(request: Request, caller: CallerDep) -> str:
    """The tenant a sandbox-layer request acts for, once the caller's sandbox rights allow
    this route and its sandbox (see the module docstring).

    Raises :class:`~torpor.errors.AccessDenied` (audited) for a caller without the rights,
    :class:`~torpor.errors.SandboxNotFound` (audited) for a sandbox outside its selector.
    """
    route = getattr(request.scope.get("route"), "path", request.url.path)
    if route == "/v1/health" or not caller.restricted:
        return caller.tenant
    identity = get_identity(request)
    if caller.sandboxes is None:
        raise identity.deny(caller, _action(request), "", "this token has no sandbox rights")
    target = request.path_params.get("id_or_name")
    if route.startswith("/v1/snapshots"):
        if target is not None:
            await visible_snapshot(request, caller, target)
        return caller.tenant
    for kind in ("volume", "drive"):
        if route.startswith(f"/v1/{kind}s"):
            if target is not None:
                visible_shared(request, caller, kind, target)
            return caller.tenant
    if not route.startswith("/v1/sandboxes"):
        raise identity.deny(
            caller,
            _action(request),
            "",
            f"this token reaches only sandboxes, snapshots, volumes and drives labelled "
            f"{caller.sandboxes}; tenant-wide resources need rights on every sandbox",
        )
    if target is not None:
        info = await get_manager(request).get(target, tenant=caller.tenant)
        if info.tenant != caller.tenant or not caller.sees(info.labels):
            identity.audit(
                caller, _action(request), f"sandbox:{target}", allowed=False, labels=info.labels
            )
            raise SandboxNotFound(f"no sandbox {target!r}", kind="sandbox", name=target)
    return caller.tenant


def checkpoints_of(request: Request, manager: Any) -> Checkpoints:
    """The app's :class:`Checkpoints` (made on first use around the app's manager)."""
    cp = getattr(request.app.state, "checkpoints", None)
    if cp is None or cp.manager is not manager:
        cp = Checkpoints(manager)
        request.app.state.checkpoints = cp
    return cp


async def visible_snapshot(request: Request, caller: Caller, target: str) -> SnapshotInfo:
    """The snapshot ``target`` if ``caller`` may reach it: the owner or a token with every
    sandbox's rights always; a restricted token only when the snapshot's source sandbox
    carried its labels. Raises :class:`~torpor.errors.SnapshotNotFound` (audited when the
    snapshot exists but is another's)."""
    cp = checkpoints_of(request, get_manager(request))
    # on the thread pool: a look-up by name reads and hashes every manifest of the home
    info = await run_in_threadpool(cp.get_snapshot, target, tenant=caller.tenant)
    if info.tenant != caller.tenant or (caller.restricted and not caller.sees(info.carried.labels)):
        get_identity(request).audit(
            caller,
            _action(request),
            f"snapshot:{target}",
            allowed=False,
            labels=info.carried.labels,
        )
        raise SnapshotNotFound(f"no snapshot {target!r}", kind="snapshot", name=target)
    return info


def visible_shared(request: Request, caller: Caller, kind: str, target: str) -> Any:
    """The volume or drive (``kind``) ``target`` if ``caller`` may reach it: the owner or a
    token with every sandbox's rights always; a restricted token only when it carries the
    token's labels. Raises :class:`~torpor.errors.VolumeNotFound` /
    :class:`~torpor.errors.DriveNotFound` (audited when it exists but is out of reach)."""
    cp = checkpoints_of(request, get_manager(request))
    store = cp.volumes if kind == "volume" else cp.drives
    info = store.get(target, tenant=caller.tenant)
    if caller.restricted and not caller.sees(info.labels):
        get_identity(request).audit(
            caller, _action(request), f"{kind}:{target}", allowed=False, labels=info.labels
        )
        raise store.not_found(f"{kind} {target!r} not found", kind=kind, name=target)
    return info


# The manager is typed loosely on purpose: the server also runs against test doubles and
# against managers that CHECKPOINTS extends; each route calls one documented method.
async def _manager(request: Request) -> Any:
    return get_manager(request)


Manager = Annotated[Any, Depends(_manager)]
Tenant = Annotated[str, Depends(get_tenant)]


class _Labelled(Protocol):
    labels: dict[str, str] | None

    def model_copy(self: L, *, update: dict[str, Any] | None = None, deep: bool = False) -> L: ...


L = TypeVar("L", bound=_Labelled)


def _bound(
    scope: MemoryScope, caller: Caller, identity: Identity, action: str, target: str
) -> MemoryScope:
    """``scope`` bound by a restricted ``caller``: write on it (read for a read-only binding),
    and its ``grants`` within the caller's, the caller's own when it names none and may not
    read the whole tenant, so the guest, answered as the tenant, reads no ancestor the caller
    could not. Raises AccessDenied (audited)."""
    access = caller.access(identity.backend)
    path = Scope(tenant=caller.tenant, **scope.levels()).path
    mode = "read" if scope.read_only else "write"
    if not access.allows(mode, path):
        raise identity.deny(caller, action, target, f"memory scope {path!r} needs {mode}")
    if scope.grants is None:
        if access.allows("read", ""):  # it may read every ancestor: nothing to keep
            return scope
        own = [ScopeGrant(mode=g.mode, prefix=g.prefix) for g in caller.grants or ()]
        return scope.model_copy(update={"grants": own})
    for g in scope.grants:
        if not access.allows(g.mode, g.prefix):
            raise identity.deny(
                caller, action, target, f"a binding's grant {g.mode} on {g.prefix!r} needs it"
            )
    return scope


def within_selector(
    body: L,
    caller: Caller,
    identity: Identity,
    action: str,
    name: str | None,
    kind: str = "sandbox",
) -> L:
    """``body`` (a request that labels what it makes: a sandbox's create, get-or-create,
    fork, relabel; a volume's or drive's create) with the caller's label selector added to
    its labels, so what a restricted caller makes always carries them. Raises
    :class:`~torpor.errors.AccessDenied` (audited) for labels that contradict the selector,
    and for a ``memory_scope`` the caller's memory grants do not cover: the sandbox's guest
    is answered there at ``localhost:7777``, so binding it is doing it (write; read for a
    read-only binding). The binding keeps the caller's grants (see :func:`_bound`)."""
    scope = getattr(body, "memory_scope", None)
    if scope is not None and caller.grants is not None:
        bound = _bound(scope, caller, identity, action, f"{kind}:{name or ''}")
        body = body.model_copy(update={"memory_scope": bound})
    selector = caller.sandboxes or {}
    if not selector:
        return body
    labels = dict(body.labels or {})
    if any(labels.get(k, v) != v for k, v in selector.items()):
        raise identity.deny(
            caller, action, f"{kind}:{name or ''}", f"labels {labels} are outside {selector}"
        )
    return body.model_copy(update={"labels": {**labels, **selector}})
