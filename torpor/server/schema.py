"""The API's contract as served: ``/openapi.json`` with its error responses, and ``/docs``.

FastAPI documents every operation's success answer and a ``422`` validation error. torpor never
answers 422 (a request it cannot parse is an ``InvalidArgument``, 400) and every refusal has one
body, ``{"error": {"type", "message", "data"}}`` (:meth:`torpor.errors.TorporError.to_wire`).
:func:`install` makes the document say so: each operation's ``422`` is replaced by a
``default`` response with the :class:`ErrorBody` schema, so a client generator, or a
schemathesis run (``tests/server/test_schemathesis.py``), holds every error to that shape.

``/docs`` is a page rendered here from the same document: each operation's method, path and
summary, grouped by tag, and a link to ``/openapi.json``. It needs nothing from a network,
unlike FastAPI's default docs page (Swagger UI loaded from a CDN), useless on a server with no
way out; no package on PyPI ships those assets in a form worth a runtime dependency for one
page. Any Swagger UI or Redoc a user has can be pointed at ``/openapi.json``.
"""

from __future__ import annotations

import html
import json
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from pydantic import BaseModel, Field

__all__ = [
    "ErrorBody",
    "EscapedJSONResponse",
    "NDJSONResponse",
    "WireError",
    "docs_page",
    "install",
    "openapi_document",
]

_METHODS = ("get", "put", "post", "patch", "delete")


class WireError(BaseModel):
    """A typed error: the :class:`~torpor.errors.TorporError` subclass's name, its message and
    the data it carries (``sandbox_id``, ``state``, ``field`` ...)."""

    type: str = Field(description="the error class, e.g. SandboxNotFound (see torpor.errors)")
    message: str
    data: dict[str, Any] = Field(default_factory=dict)


class ErrorBody(BaseModel):
    """The body of every error answer."""

    error: WireError


class EscapedJSONResponse(JSONResponse):
    """JSON that may carry a lone surrogate: a file name that is not UTF-8 as Python reads it
    (one per bad byte), or a caller's text quoted in an error. UTF-8 cannot encode one, JSON
    can (``"\\udce9"``): such a body is written with every non-ASCII character escaped
    instead of failing (a 500). A route returns one itself, past FastAPI's own encoding."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, allow_nan=False, separators=(",", ":")).encode()


class NDJSONResponse(StreamingResponse):
    """A stream of JSON lines, documented as ``application/x-ndjson`` (a route's
    ``response_class``)."""

    media_type = "application/x-ndjson"


def openapi_document(app: FastAPI) -> dict[str, Any]:
    """The app's OpenAPI document with torpor's error responses (see the module docstring)."""
    document = get_openapi(
        title=app.title,
        version=app.version,
        description=app.description,
        routes=app.routes,
    )
    schemas: dict[str, Any] = document.setdefault("components", {}).setdefault("schemas", {})
    for model in (WireError, ErrorBody):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas[model.__name__] = schema
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    error = {
        "description": "a typed error (InvalidArgument 400, Unauthenticated 401, "
        "AccessDenied 403, NotFound 404, Conflict 409, PayloadTooLarge 413 ...)",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}},
    }
    for operations in document.get("paths", {}).values():
        for method in _METHODS:
            operation = operations.get(method)
            if operation is None:
                continue
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            responses["default"] = error
    return document


def docs_page(document: dict[str, Any]) -> str:
    """``/docs``: the operations of ``document`` as one self-contained HTML page."""
    groups: dict[str, list[str]] = {}
    for path, operations in document.get("paths", {}).items():
        for method in _METHODS:
            operation = operations.get(method)
            if operation is None:
                continue
            tag = (operation.get("tags") or ["other"])[0]
            summary = operation.get("description") or operation.get("summary") or ""
            first = summary.strip().split("\n\n")[0]
            groups.setdefault(tag, []).append(
                f"<tr><td><code>{method.upper()}</code></td><td><code>{html.escape(path)}"
                f"</code></td><td>{html.escape(first)}</td></tr>"
            )
    info = document.get("info", {})
    title = html.escape(f"{info.get('title', 'API')} {info.get('version', '')}".strip())
    sections = "".join(
        f"<h2>{html.escape(tag)}</h2><table>{''.join(rows)}</table>"
        for tag, rows in sorted(groups.items())
    )
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>{title}</title><style>body{{font-family:sans-serif;margin:2em}}"
        "td{padding:2px 10px;vertical-align:top}code{white-space:nowrap}</style></head><body>"
        f"<h1>{title}</h1><p>The whole contract: <a href='/openapi.json'>/openapi.json</a> "
        "(OpenAPI 3.1; point any Swagger UI or Redoc at it). Send "
        "<code>Authorization: Bearer &lt;token&gt;</code>; every error is "
        '<code>{"error": {"type", "message", "data"}}</code>.</p>'
        f"{sections}</body></html>"
    )


def install(app: FastAPI) -> None:
    """Serve :func:`openapi_document` at ``/openapi.json`` and :func:`docs_page` at ``/docs``
    (neither needs a token: the contract is no secret)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_document(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return HTMLResponse(docs_page(app.openapi()))
