"""Stand-ins for the checkpoint classes until :mod:`torpor.client.checkpoints` exists.

``torpor.Snapshot``, ``torpor.Volume`` and ``torpor.Drive`` are always importable; until the
checkpoint module lands, using one raises :class:`~torpor.errors.InvalidArgument` saying so.
"""

from __future__ import annotations

from typing import Any, NoReturn

from torpor.errors import InvalidArgument

__all__ = ["Drive", "Snapshot", "Volume"]


class _NotYet:
    """A checkpoint class whose implementation is not installed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._unavailable()

    @classmethod
    def _unavailable(cls) -> NoReturn:
        raise InvalidArgument(f"torpor.{cls.__name__} is not available in this build")

    @classmethod
    def create(cls, *args: Any, **kwargs: Any) -> NoReturn:
        cls._unavailable()

    @classmethod
    def get(cls, *args: Any, **kwargs: Any) -> NoReturn:
        cls._unavailable()

    @classmethod
    def list(cls, *args: Any, **kwargs: Any) -> NoReturn:
        cls._unavailable()


class Snapshot(_NotYet):
    """A frozen copy of a whole sandbox (RAM + disk). Provided by ``torpor.client.checkpoints``."""


class Volume(_NotYet):
    """A disk that outlives sandboxes. Provided by ``torpor.client.checkpoints``."""


class Drive(_NotYet):
    """A host directory shared into sandboxes. Provided by ``torpor.client.checkpoints``."""
