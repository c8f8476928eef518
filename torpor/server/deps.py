"""What every route needs: the engine's manager and the caller's tenant.

Routers (this package's ``routes_*`` modules, and others added later) depend on these two
functions, so a route stays "parse, one manager call, render".
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Request

from torpor.server.auth import TokenStore

__all__ = ["Manager", "Tenant", "get_manager", "get_tenant"]


def get_manager(request: Request) -> Any:
    """The :class:`~torpor.sandbox.manager.SandboxManager` this app serves."""
    return request.app.state.manager


def get_tenant(request: Request) -> str:
    """The tenant the request acts for. Raises :class:`~torpor.errors.AccessDenied`."""
    tokens: TokenStore = request.app.state.tokens
    return tokens.tenant_for(request.headers.get("authorization"))


# The manager is typed loosely on purpose: the server also runs against test doubles and
# against managers that CHECKPOINTS extends; each route calls one documented method.
Manager = Annotated[Any, Depends(get_manager)]
Tenant = Annotated[str, Depends(get_tenant)]
