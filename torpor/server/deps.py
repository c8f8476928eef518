"""What every route needs: the engine's manager and the caller.

Routers (this package's ``routes_*`` modules, and others added later) depend on these
functions, so a route stays "parse, one manager call, render":

* :data:`CallerDep` — who is calling (:class:`~torpor.server.auth.Caller`: tenant, actor,
  memory grants, sandbox label selector); memory and token routes check its grants.
* :data:`Tenant` — the caller's tenant, *after* the caller's sandbox rights were checked
  against the route: a route under ``/v1/sandboxes/{id_or_name}`` answers NotFound (audited)
  for a sandbox outside the caller's label selector; other sandbox-layer routes (snapshots,
  volumes, drives, GC ...) act on the whole tenant, so they need a caller with rights on every
  sandbox. Every sandbox-layer route takes ``Tenant``, so none can skip the check.
"""

from __future__ import annotations

from typing import Annotated, Any, Protocol, TypeVar

from fastapi import Depends, Request
from starlette.concurrency import run_in_threadpool

from torpor.errors import SandboxNotFound
from torpor.server.auth import Caller, Identity

__all__ = [
    "CallerDep",
    "IdentityDep",
    "Manager",
    "Tenant",
    "get_caller",
    "get_identity",
    "get_manager",
    "get_tenant",
    "over_socket",
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
    if not route.startswith("/v1/sandboxes"):
        raise identity.deny(
            caller,
            _action(request),
            "",
            f"this token reaches only sandboxes labelled {caller.sandboxes}; "
            "tenant-wide resources need rights on every sandbox",
        )
    target = request.path_params.get("id_or_name")
    if target is not None:
        info = await get_manager(request).get(target, tenant=caller.tenant)
        if info.tenant != caller.tenant or not caller.sees(info.labels):
            identity.audit(
                caller, _action(request), f"sandbox:{target}", allowed=False, labels=info.labels
            )
            raise SandboxNotFound(f"no sandbox {target!r}", kind="sandbox", name=target)
    return caller.tenant


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


def within_selector(
    body: L, caller: Caller, identity: Identity, action: str, name: str | None
) -> L:
    """``body`` (a request that labels new sandboxes: create, get-or-create, fork) with the
    caller's label selector added to its labels, so a restricted caller's sandboxes always
    carry them. Raises :class:`~torpor.errors.AccessDenied` (audited) for labels that
    contradict the selector."""
    selector = caller.sandboxes or {}
    if not selector:
        return body
    labels = dict(body.labels or {})
    if any(labels.get(k, v) != v for k, v in selector.items()):
        raise identity.deny(
            caller, action, f"sandbox:{name or ''}", f"labels {labels} are outside {selector}"
        )
    return body.model_copy(update={"labels": {**labels, **selector}})
