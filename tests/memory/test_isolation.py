"""Isolation: tokens, grants, audited refusals, and a property test that nothing leaks."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torpor.errors import AccessDenied
from torpor.memory import Fact, Memory
from torpor.memory.models import Scope, path_within


def test_token_maps_to_tenant_and_grants(home: Path, backend_spec: str) -> None:
    admin = Memory(str(home), tenant="acme", embedder=None, backend=backend_spec)
    admin.scope(app="support", user="u-42").remember("acme secret plan")
    admin.scope(app="support", user="u-43").remember("other user plan")
    admin.scope(app="support").remember("shared support plan")
    tok = admin.tokens.issue("acme", grants=[("write", "app/support/user/u-42")])
    m = Memory(str(home), token=tok, embedder=None, backend=backend_spec)
    assert m.tenant == "acme"
    u = m.scope(app="support", user="u-42")
    assert [h.text for h in u.recall("plan")] == ["acme secret plan"]  # no grant on the app
    u.remember("written with a token")
    with pytest.raises(AccessDenied):
        m.scope(app="support", user="u-43")
    with pytest.raises(AccessDenied):
        m.scope(app="support").remember("nope")
    with pytest.raises(AccessDenied):
        m.scope(app="support", user="u-42", tenant="other")
    with pytest.raises(AccessDenied):
        m.gc()
    denied = [e for e in admin.audit_log() if not e.allowed]
    assert len(denied) >= 3 and {e.action for e in denied} >= {"scope", "gc"}
    assert any(e.tenant == "other" for e in admin.backend.audit_log("other"))
    m.close()
    admin.close()


def test_read_grant_cannot_write(home: Path, backend_spec: str) -> None:
    admin = Memory(str(home), tenant="acme", embedder=None, backend=backend_spec)
    tok = admin.tokens.issue("acme", grants=[("read", "app/x")])
    m = Memory(str(home), token=tok, embedder=None, backend=backend_spec)
    s = m.scope(app="x", user="y")
    assert s.recall("anything") == []
    with pytest.raises(AccessDenied):
        s.remember("no")
    with pytest.raises(AccessDenied):
        s.forget()
    with pytest.raises(AccessDenied):
        s.set_profile({"a": 1})
    m.close()
    admin.close()


def test_the_audit_log_needs_read_on_the_tenants_root(home: Path, backend_spec: str) -> None:
    """As ``GET /v1/audit``: the log names every user's scopes and actions."""
    admin = Memory(str(home), tenant="acme", embedder=None, backend=backend_spec)
    admin.forget(admin.scope(app="y", user="other"))
    tok = admin.tokens.issue("acme", grants=[("write", "app/x")])
    m = Memory(str(home), token=tok, embedder=None, backend=backend_spec)
    with pytest.raises(AccessDenied):
        m.audit_log()
    assert [e.action for e in admin.audit_log(1)] == ["audit"]  # the refusal, audited
    m.close()
    admin.close()


def test_verify_by_id_needs_write_on_the_records_own_scope(home: Path, backend_spec: str) -> None:
    """``verify(id)`` from a writable scope reads an ancestor's fact; re-marking it is a write
    to that ancestor, which a token that may only read it cannot do."""
    admin = Memory(str(home), embedder=None, backend=backend_spec)
    src = home.parent / "src.txt"
    src.write_text("the sky is blue\n")
    fact = admin.scope().remember("sky is blue", source={"path": str(src)})
    assert fact.verified
    tok = admin.tokens.issue("default", [("read", ""), ("write", "app/a/user/u")])
    m = Memory(str(home), token=tok, embedder=None, backend=backend_spec)
    src.write_text("the sky is green\n")  # verify would now mark it stale
    for scope in (m.scope(), m.scope(app="a", user="u")):
        with pytest.raises(AccessDenied):
            scope.verify(fact.id)
    stored = admin.scope().get(fact.id)
    assert isinstance(stored, Fact) and stored.verified and not stored.stale
    assert not admin.scope().verify(fact.id)[0].verified  # the owner's verify does mark it
    m.close()
    admin.close()


def test_bad_or_revoked_or_foreign_token(home: Path, backend_spec: str) -> None:
    admin = Memory(str(home), tenant="acme", embedder=None, backend=backend_spec)
    with pytest.raises(AccessDenied):
        Memory(str(home), token="tpr_forged", embedder=None, backend=backend_spec)
    tok = admin.tokens.issue("acme", grants=[("read", "")])
    with pytest.raises(AccessDenied):
        Memory(str(home), token=tok, tenant="globex", embedder=None, backend=backend_spec)
    assert admin.tokens.revoke(tok)
    with pytest.raises(AccessDenied):
        Memory(str(home), token=tok, embedder=None, backend=backend_spec)
    assert any(e.action == "connect" and not e.allowed for e in admin.backend.audit_log(None))
    admin.close()


def test_sqlite_tenant_is_its_own_file(home: Path) -> None:
    a = Memory(str(home), tenant="acme", embedder=None)
    b = Memory(str(home), tenant="globex", embedder=None)
    a.scope(app="x").remember("acme only")
    b.scope(app="x").remember("globex only")
    assert (home / "memory" / "acme.db").exists() and (home / "memory" / "globex.db").exists()
    assert [h.text for h in b.scope(app="x").recall("only")] == ["globex only"]
    a.close()
    b.close()


_RUNS = itertools.count()
NAMES = st.sampled_from(["a", "b", "c"])
LEVELS = st.fixed_dictionaries({}, optional={"app": NAMES, "user": NAMES, "session": NAMES})


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    writes=st.lists(
        st.tuples(
            st.sampled_from(["t1", "t2"]),
            LEVELS,
            st.sampled_from(["apple pie", "apple tart", "banana bread", "cherry apple"]),
        ),
        min_size=1,
        max_size=12,
    ),
    grant=st.tuples(st.sampled_from(["read", "write"]), LEVELS),
    query_scope=LEVELS,
    query=st.sampled_from(["apple", "banana", "bread pie", "cherry"]),
)
def test_random_scopes_never_leak(
    tmp_path_factory: pytest.TempPathFactory,
    backend_spec: str,
    writes: list[tuple[str, dict[str, str], str]],
    grant: tuple[str, dict[str, str]],
    query_scope: dict[str, str],
    query: str,
) -> None:
    home = tmp_path_factory.mktemp("iso")
    # fresh tenant names per example: a server backend keeps data between examples
    run = next(_RUNS)
    names = {"t1": f"p{run}-t1", "t2": f"p{run}-t2"}
    owners = {
        t: Memory(str(home), tenant=names[t], embedder=None, backend=backend_spec)
        for t in ("t1", "t2")
    }
    m: Memory | None = None
    try:
        written: dict[str, tuple[str, str]] = {}
        for tenant, levels, text in writes:
            f = owners[tenant].scope(**levels).remember(text)
            written[f.id] = (tenant, f.scope)
        prefix = Scope(**grant[1]).path
        tok = owners["t1"].tokens.issue(names["t1"], grants=[(grant[0], prefix)])
        m = Memory(str(home), token=tok, embedder=None, backend=backend_spec)
        target = Scope(**query_scope)
        try:
            s = m.scope(**query_scope)
        except AccessDenied:
            assert not path_within(target.path, prefix)
            assert any(not e.allowed for e in owners["t1"].audit_log())
        else:
            assert path_within(target.path, prefix)
            for hit in s.recall(query, k=50, include_history=True):
                tenant, scope = written[hit.id]  # KeyError = a record from elsewhere
                assert tenant == "t1"
                assert path_within(scope, prefix)
                assert scope in target.ancestors()
    finally:
        for o in (*owners.values(), *([m] if m else [])):
            o.close()


def test_a_refused_tenant_no_store_can_encode_is_audited(home: Path, backend_spec: str) -> None:
    m = Memory(str(home), tenant="acme", embedder=None, backend=backend_spec)
    for bad in ("x\ud800", "y\x00"):
        with pytest.raises(AccessDenied):
            m.scope(app="a", tenant=bad)
        with pytest.raises(AccessDenied):
            Memory(str(home), token="nope", tenant=bad, embedder=None, backend=backend_spec)
    refused = [e for e in m.backend.audit_log(None, 10) if not e.allowed]
    assert len(refused) == 4 and {e.action for e in refused} == {"scope", "connect"}
    m.close()
