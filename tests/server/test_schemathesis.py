"""The schema is the contract: schemathesis against a live server.

A real server (uvicorn on TCP, the real SandboxManager and engine on a temporary home, the
embedded memory store, a bearer token with every right of its tenant) is fuzzed over its own
``/openapi.json``, every operation with a few generated requests. Every answer must be:

* no 5xx;
* what the document says (status code documented, body valid against the response schema,
  content type as declared: schemathesis's response conformance checks);
* for every error, the typed JSON body ``{"error": {"type", "message", "data"}}`` whose
  ``type`` is a :mod:`torpor.errors` class with that HTTP status.

The home has no template, so every route that would boot a VM fails fast with
TemplateNotFound (a typed 404) instead of booting: the routes stay in the run, no VM starts.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import (  # noqa: E402
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from torpor import errors  # noqa: E402
from torpor.config import paths  # noqa: E402
from torpor.sandbox.manager import SandboxManager  # noqa: E402
from torpor.server.app import create_app  # noqa: E402

#: generated requests per operation (about 70 operations: the whole run stays under a minute);
#: ``TORPOR_SCHEMATHESIS_EXAMPLES=200`` makes a longer hunt, with a fresh seed each run
EXAMPLES = int(os.environ.get("TORPOR_SCHEMATHESIS_EXAMPLES", "6"))


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    home: Path = tmp_path_factory.mktemp("home")
    app = create_app(
        SandboxManager(paths(home)), supervise=False, require_token=True, memory_embedder=None
    )
    token = app.state.identity.tokens.issue(
        "acme", [("write", "")], sandboxes={}, admin=True, name="schemathesis"
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    server = uvicorn.Server(uvicorn.Config(app, lifespan="on", log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", token
    server.should_exit = True
    thread.join(30)
    sock.close()


@pytest.fixture(scope="module")
def api(live: tuple[str, str]) -> Any:
    url, token = live
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", timeout=30)
    schema.config.update(base_url=url, headers={"Authorization": f"Bearer {token}"})
    return schema


schema = schemathesis.pytest.from_fixture("api")


def _typed_error(response: Any) -> None:
    """An error answer is the typed body, with the status of its class."""
    if response.status_code < 400:
        return
    body = response.json()
    assert set(body) == {"error"}, body
    wire = body["error"]
    assert isinstance(wire.get("message"), str) and isinstance(wire.get("data"), dict), body
    kind = getattr(errors, wire["type"], None)
    assert isinstance(kind, type) and issubclass(kind, errors.TorporError), body
    rebuilt = errors.from_wire(wire)
    assert type(rebuilt) is kind
    assert (
        rebuilt.http_status == response.status_code
        or kind is errors.TorporError
        or (kind is errors.InvalidArgument and 400 <= response.status_code < 500)
    ), (response.status_code, body)


@schema.parametrize()  # type: ignore[untyped-decorator]
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize="TORPOR_SCHEMATHESIS_EXAMPLES" not in os.environ,
    suppress_health_check=list(HealthCheck),
    database=None,
)
def test_api_keeps_its_contract(case: Any) -> None:
    response = case.call_and_validate(
        checks=[
            not_a_server_error,
            status_code_conformance,
            content_type_conformance,
            response_schema_conformance,
        ],
        timeout=30,
    )
    _typed_error(response)
