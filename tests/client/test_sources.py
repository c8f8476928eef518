"""The SDK's source resolvers refuse a reference that lacks its sandbox/volume or its path
before asking any server."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from torpor.client.sources import sandbox_resolver, volume_resolver
from torpor.errors import PathNotFound


@dataclass(frozen=True)
class Ref:
    sandbox: str | None = None
    volume: str | None = None
    path: str | None = None


@pytest.mark.parametrize(
    ("resolver", "ref", "message", "name"),
    [
        pytest.param(
            sandbox_resolver,
            Ref(path="/a.txt"),
            "a sandbox source needs a sandbox and a path",
            "None:/a.txt",
            id="sandbox-without-sandbox",
        ),
        pytest.param(
            sandbox_resolver,
            Ref(sandbox="s", path=""),
            "a sandbox source needs a sandbox and a path",
            "s:",
            id="sandbox-empty-path",
        ),
        pytest.param(
            volume_resolver,
            Ref(volume="v"),
            "a volume source needs a volume and a path",
            "v:None",
            id="volume-without-path",
        ),
        pytest.param(
            volume_resolver,
            Ref(volume="", path="/f"),
            "a volume source needs a volume and a path",
            ":/f",
            id="volume-empty-volume",
        ),
    ],
)
def test_incomplete_reference_is_path_not_found(
    resolver: Any, ref: Ref, message: str, name: str
) -> None:
    # no runtime is reached: a server-less call would be ServerUnavailable, not PathNotFound
    read = resolver()
    with pytest.raises(PathNotFound, match=message) as info:
        read(ref)
    assert info.value.data == {"kind": "path", "name": name}
