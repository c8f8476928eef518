"""The HTTP API's contract, pinned: the OpenAPI document the app builds must equal the committed
``tests/server/openapi.json``. A change to a route or a request model
(:mod:`torpor.sandbox.requests`) shows up here as a diff to review; once it is meant, regenerate
the file with::

    TORPOR_UPDATE_OPENAPI=1 python3 -m pytest -q -p no:cacheprovider tests/server/test_openapi.py
"""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path
from typing import Any

from fake_manager import FakeManager

from torpor.server.app import create_app

PINNED = Path(__file__).with_name("openapi.json")
REGENERATE = (
    "TORPOR_UPDATE_OPENAPI=1 python3 -m pytest -q -p no:cacheprovider tests/server/test_openapi.py"
)


def _document() -> dict[str, Any]:
    document: dict[str, Any] = create_app(FakeManager(), supervise=False).openapi()
    return document


def _text(document: dict[str, Any]) -> str:
    return json.dumps(document, indent=2, sort_keys=True) + "\n"


def test_openapi_document_is_pinned() -> None:
    current = _text(_document())
    if os.environ.get("TORPOR_UPDATE_OPENAPI") == "1":
        PINNED.write_text(current)
    pinned = PINNED.read_text() if PINNED.exists() else ""
    if current != pinned:
        diff = "".join(
            list(
                difflib.unified_diff(
                    pinned.splitlines(keepends=True),
                    current.splitlines(keepends=True),
                    "tests/server/openapi.json (pinned)",
                    "app.openapi() (now)",
                )
            )[:80]
        )
        raise AssertionError(
            f"the OpenAPI document changed; if that is meant, regenerate the pinned copy with\n"
            f"    {REGENERATE}\nand commit it. The first lines of the diff:\n{diff}"
        )


def test_one_create_endpoint_takes_the_whole_spec() -> None:
    document = _document()
    creates = [
        path
        for path, ops in document["paths"].items()
        if "post" in ops and path.endswith("/sandboxes")
    ]
    assert creates == ["/v1/sandboxes"]
    body = document["paths"]["/v1/sandboxes"]["post"]["requestBody"]["content"]
    assert body["application/json"]["schema"] == {"$ref": "#/components/schemas/SandboxSpec"}
    spec = document["components"]["schemas"]["SandboxSpec"]["properties"]
    assert {"template", "memory_mib", "labels", "snapshot", "volumes", "drives"} <= set(spec)


def test_docs_page_works_offline() -> None:
    from fastapi.testclient import TestClient

    app = create_app(FakeManager(), supervise=False)
    with TestClient(app) as client:
        page = client.get("/docs")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        document = client.get("/openapi.json").json()
    assert "/openapi.json" in page.text
    for path in document["paths"]:
        assert f"<code>{path}</code>" in page.text, path
    # nothing loaded from elsewhere: no script, stylesheet or image from another host
    assert "<script" not in page.text and "src=" not in page.text and "://" not in page.text


def test_every_operation_documents_the_typed_error() -> None:
    document = _document()
    assert "HTTPValidationError" not in document["components"]["schemas"]
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            assert "422" not in responses, (method, path)
            error = responses["default"]["content"]["application/json"]["schema"]
            assert error == {"$ref": "#/components/schemas/ErrorBody"}, (method, path)
