"""The public surface of ``torpor``: a short ordered list, every name real, imports cheap."""

from __future__ import annotations

import subprocess
import sys

import torpor
import torpor.errors

EXPECTED = [
    "Runtime",
    "Sandbox",
    "Snapshot",
    "Volume",
    "Drive",
    "Memory",
    "SourceRef",
    "AsyncRuntime",
    "AsyncSandbox",
    "AsyncSnapshot",
    "AsyncVolume",
    "AsyncDrive",
]


def test_public_names_in_order() -> None:
    assert torpor.__all__[: len(EXPECTED)] == EXPECTED
    assert torpor.__all__[-1] == "__version__"


def test_every_public_name_resolves() -> None:
    for name in torpor.__all__:
        assert getattr(torpor, name) is not None, name


def test_every_error_is_exported_and_under_the_root() -> None:
    exported = {
        n
        for n in torpor.__all__
        if n.endswith(
            (
                "Error",
                "Argument",
                "Name",
                "Large",
                "Violation",
                "Found",
                "Conflict",
                "State",
                "Closed",
                "Timeout",
                "Denied",
                "Exceeded",
                "Unavailable",
                "Data",
                "Lost",
                "Unauthenticated",
            )
        )
    }
    assert exported == set(torpor.errors.__all__) - {"from_wire"}
    for name in exported:
        assert issubclass(getattr(torpor, name), torpor.TorporError)


def test_import_is_cheap() -> None:
    """``import torpor`` must not pull the server, QEMU or model stacks in."""
    code = (
        "import sys, torpor; heavy = {'fastapi', 'uvicorn', 'torch', 'qemu', 'httpx', "
        "'sentence_transformers'} & set(sys.modules); print(sorted(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
