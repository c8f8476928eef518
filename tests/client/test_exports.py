"""The SDK's public names are where users look for them."""

from __future__ import annotations

import pytest

import torpor
import torpor.client


@pytest.mark.parametrize("name", ["Runtime", "Sandbox", "Snapshot", "Volume", "Drive"])
def test_public_names(name: str) -> None:
    assert name in torpor.client.__all__
    assert getattr(torpor, name) is getattr(torpor.client, name)


def test_sandbox_surface() -> None:
    for attr in (
        "create",
        "get_or_create",
        "get",
        "list",
        "pause",
        "resume",
        "kill",
        "info",
        "id",
        "name",
        "__enter__",
        "__exit__",
    ):
        assert hasattr(torpor.Sandbox, attr), attr


def test_async_sandbox_surface() -> None:
    import torpor.client.aio_sandbox

    assert torpor.AsyncSandbox is torpor.client.aio_sandbox.AsyncSandbox
    for attr in ("pause", "resume", "kill", "snapshot", "fork", "set", "info", "__aenter__"):
        assert hasattr(torpor.AsyncSandbox, attr), attr
    for attr in ("create", "get_or_create", "get", "list"):
        assert hasattr(torpor.client.aio_sandbox.AsyncSandboxes, attr), attr
