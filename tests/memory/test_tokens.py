"""The one token table, on every backend: sandbox rights, admin, expiry, list, revoke by id,
adopting a legacy token (tokens are the server's identity: tests/server/test_identity.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from torpor.errors import AccessDenied, InvalidArgument
from torpor.memory import Memory
from torpor.memory.access import TokenManager, hash_token
from torpor.memory.backends import MemoryBackend
from torpor.memory.models import Grant


def test_token_fields_round_trip(backend: MemoryBackend) -> None:
    tm = TokenManager(backend)
    later = datetime.now(UTC) + timedelta(hours=1)
    secret = tm.issue(
        "acme",
        [("write", "app/a/user/u")],
        name="agent",
        sandboxes={"user": "u"},
        admin=True,
        expires_at=later,
    )
    info = tm.lookup(secret)
    assert info is not None and info.tenant == "acme" and info.name == "agent"
    assert info.grants == [Grant(mode="write", prefix="app/a/user/u")]
    assert info.sandboxes == {"user": "u"} and info.admin
    assert info.expires_at is not None and abs((info.expires_at - later).total_seconds()) < 1e-3
    plain = tm.issue("acme", [])
    assert tm.lookup(plain).sandboxes is None  # type: ignore[union-attr]
    assert tm.lookup(plain).admin is False  # type: ignore[union-attr]
    assert [t.id for t in tm.list("acme")] == [info.id, tm.lookup(plain).id]  # type: ignore[union-attr]
    assert tm.list("globex") == []
    assert tm.find("acme", info.id) == info and tm.find("globex", info.id) is None
    assert tm.revoke_id("acme", info.id) and tm.lookup(secret) is None
    assert not tm.revoke_id("globex", tm.lookup(plain).id)  # type: ignore[union-attr]
    assert [t.revoked for t in tm.list("acme")] == [True, False]


def test_expired_and_bad_tokens(backend: MemoryBackend) -> None:
    tm = TokenManager(backend)
    past = tm.issue("acme", [], expires_at=datetime.now(UTC) - timedelta(seconds=1))
    assert tm.lookup(past) is None and len(tm.list("acme")) == 1
    bads: list[Any] = [
        lambda: tm.issue("acme", [], sandboxes={"user": 3}),  # type: ignore[dict-item]
        lambda: tm.issue("acme", [], expires_at=datetime(2030, 1, 1)),
        lambda: tm.issue("acme", [("admin", "")]),
    ]
    for bad in bads:
        with pytest.raises(InvalidArgument):
            bad()


def test_adopt_keeps_a_revoked_token_revoked(backend: MemoryBackend) -> None:
    tm = TokenManager(backend)
    legacy = "x" * 32
    assert tm.adopt(legacy, "acme", name="file")
    info = backend.get_token(hash_token(legacy))
    assert info is not None and info.admin and info.sandboxes == {}
    tm.revoke(legacy)
    assert not tm.adopt(legacy, "acme", name="file")
    assert tm.lookup(legacy) is None


def test_a_token_holding_a_lone_surrogate_is_unknown(
    backend: MemoryBackend, backend_spec: str, home: Path
) -> None:
    tm = TokenManager(backend)
    assert tm.lookup("\ud800") is None and not tm.revoke("\ud800")
    with pytest.raises(AccessDenied):
        Memory(str(home), token="tk-\ud800", embedder=None, backend=backend_spec)
    assert [e.allowed for e in backend.audit_log(None, 10)] == [False]
