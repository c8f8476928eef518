"""Provenance: host files now, pluggable resolvers for sandboxes and volumes later."""

from __future__ import annotations

import http.server
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.memory.conftest import Api
from torpor.errors import AccessDenied, InvalidArgument, PathNotFound
from torpor.memory import Memory, SourceRef, provenance, register_resolver
from torpor.memory.provenance import check


@pytest.fixture
def ledger(tmp_path: Path) -> Path:
    p = tmp_path / "ledger.csv"
    p.write_text("date,event\n2026-03-01,signup\n2026-03-03,upgraded to Pro\n")
    return p


@pytest.fixture
def sandbox_files() -> Iterator[dict[str, bytes]]:
    files: dict[str, bytes] = {}

    def read(ref: SourceRef) -> bytes:
        try:
            return files[f"{ref.sandbox}:{ref.path}"]
        except KeyError:
            raise PathNotFound("missing", kind="path", name=ref.path) from None

    register_resolver("sandbox", read)
    yield files
    register_resolver("sandbox", None)


def test_line_source_verified_then_stale(mem: Memory, ledger: Path) -> None:
    u = mem.scope(app="a", user="u")
    f = u.remember(
        "upgraded to Pro on the 3rd",
        source=SourceRef(path=str(ledger), line=3, quote="upgraded to pro"),
    )
    assert f.verified and f.source_hash and not f.stale
    assert u.verify(f.id)[0].verified
    ledger.write_text("date,event\n2026-03-01,signup\n2026-03-03,downgraded\n")
    [again] = u.verify()
    assert again.stale and not again.verified
    stored = u.get(f.id)
    assert stored.stale and not stored.verified  # type: ignore[union-attr]


def test_missing_line_file_or_quote_is_unverified(mem: Memory, ledger: Path) -> None:
    u = mem.scope(app="a")
    assert not u.remember("x", source=SourceRef(path=str(ledger), line=99)).verified
    assert not u.remember("x", source=SourceRef(path=str(ledger) + ".gone")).verified
    assert not u.remember(
        "x", source=SourceRef(path=str(ledger), line=3, quote="Enterprise")
    ).verified
    ok = u.remember("x", source=SourceRef(path=str(ledger), start=0, end=10))
    assert ok.verified
    ledger.unlink()
    assert u.verify(ok.id)[0].stale


def test_sandbox_sources_need_a_resolver(mem: Memory, sandbox_files: dict[str, bytes]) -> None:
    u = mem.scope(app="a", user="u-42")
    ref = SourceRef(sandbox="agent-u-42", path="/workspace/ledger.csv", line=2)
    assert not u.remember("upgraded", source=ref).verified
    sandbox_files["agent-u-42:/workspace/ledger.csv"] = b"h\nupgraded to Pro on the 3rd\n"
    f = u.remember("upgraded to Pro on the 3rd", source=ref)
    assert f.verified
    sandbox_files["agent-u-42:/workspace/ledger.csv"] = b"h\nchanged\n"
    assert u.verify(f.id)[0].stale


def test_unverified_says_why(mem: Memory, sandbox_files: dict[str, bytes]) -> None:
    """``verified=False`` comes with a ``reason`` (issue 11, item 6); a verified fact has none."""
    u = mem.scope(app="a", user="u-7")
    ref = SourceRef(sandbox="agent-u-7", path="/workspace/notes.md", quote="blue")
    missing = u.remember("likes blue", source=ref)
    assert not missing.verified and missing.reason and "missing" in missing.reason
    sandbox_files["agent-u-7:/workspace/notes.md"] = b"likes green\n"
    wrong = u.remember("likes blue", source=ref)
    assert not wrong.verified and wrong.reason and "quote" in wrong.reason
    sandbox_files["agent-u-7:/workspace/notes.md"] = b"likes blue\n"
    ok = u.remember("likes blue", source=ref)
    assert ok.verified and ok.reason is None
    sandbox_files["agent-u-7:/workspace/notes.md"] = b"likes blue, and red\n"
    changed = u.verify(ok.id)[0]
    assert changed.stale and not changed.verified and changed.reason
    assert "changed" in changed.reason


def test_volume_source_without_a_server_is_unverified(tmp_path: Path) -> None:
    """Volume sources default to the SDK's resolver; no server to ask: unverified, no raise.
    (A runtime that does not auto-start, so no server is left behind; the real reads are
    tested in test_provenance_sandbox.py.)"""
    from torpor.client.runtime import Runtime, set_default_runtime

    set_default_runtime(Runtime(home=tmp_path, autostart=False))
    try:
        outcome = check(SourceRef(volume="v1", path="/data/x"))
    finally:
        set_default_runtime(None)
    assert not outcome.verified and "cannot reach" in outcome.reason


def test_a_token_cannot_read_host_files_through_a_source(api: Api, tmp_path: Path) -> None:
    """A host file is read with this process's rights (the server's), not a token's: a token
    holder citing one learned any file the server can read (a one-byte range's hash, whether
    a quote is in it, its size). Host sources are the home owner's alone."""
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret\n")
    owner = api.mem.scope(app="a", user="u")  # type: ignore[attr-defined]
    cited = owner.remember("the secret", source={"path": str(secret)})
    assert cited.verified  # the owner still cites host files
    u = api.as_token([("write", "app/a/user/u")]).scope(app="a", user="u")  # type: ignore[attr-defined]
    with pytest.raises(AccessDenied):
        u.remember("x", source={"path": str(secret), "start": 0, "end": 1})
    with pytest.raises(AccessDenied):
        u.remember_many(["y", {"text": "x", "source": {"path": str(secret), "quote": "s3c"}}])
    assert u.get_all().total == 1  # nothing written
    secret.write_text("changed\n")
    with pytest.raises(AccessDenied):
        u.verify(cited.id)
    assert u.verify() == []  # left as it was: not re-read for the token
    assert not owner.get(cited.id).stale


def test_a_token_cites_no_sandbox_volume_or_private_url(api: Api, tmp_path: Path) -> None:
    """A sandbox or volume source is read through the server's own socket, as the home's
    owner: a token citing one read another tenant's machine (and woke it). A URL is fetched
    by the server: a token's may not name a loopback, private or link-local host."""
    page = _serve({"/": (200, b"internal page\n")})
    url = f"http://127.0.0.1:{page.server_port}/"
    u = api.as_token([("write", "app/a/user/u")]).scope(app="a", user="u")  # type: ignore[attr-defined]
    for source in (
        {"sandbox": "agent-u-43", "path": "/workspace/notes.md"},
        {"volume": "memory-u-43", "path": "/facts.md"},
        {"url": url},
        {"url": "http://169.254.169.254/latest/meta-data/"},
    ):
        with pytest.raises(AccessDenied):
            u.remember("x", source=source)
    assert u.get_all().total == 0
    owner = api.mem.scope(app="a", user="u")  # type: ignore[attr-defined]
    assert owner.remember("an internal page", source={"url": url}).verified  # the owner may


def test_a_tokens_verify_leaves_the_owners_internal_url_facts_as_they_are(api: Api) -> None:
    """A token's verify fetches public addresses only, so an owner's fact citing an internal
    page (an intranet wiki) was re-checked as unreachable: marked stale and unverified by any
    token that may write the scope. It is left as it is, as a host file's fact is."""
    page = _serve({"/": (200, b"the internal runbook\n")})
    url = f"http://127.0.0.1:{page.server_port}/"
    owner = api.mem.scope(app="a", user="u")  # type: ignore[attr-defined]
    cited = owner.remember("the runbook", source={"url": url})
    assert cited.verified
    u = api.as_token([("write", "app/a/user/u")]).scope(app="a", user="u")  # type: ignore[attr-defined]
    with pytest.raises(AccessDenied):
        u.verify(cited.id)
    assert u.verify() == []  # not re-read for the token
    after = owner.get(cited.id)
    assert after.verified and not after.stale
    page.shutdown()


def _serve(
    pages: dict[str, tuple[int, bytes, str | None] | tuple[int, bytes]], host: str = "127.0.0.1"
) -> Any:
    """An HTTP server on ``host`` answering ``pages`` (path -> status, body[, Location])."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status, body, *where = pages.get(self.path, (404, b""))
            self.send_response(status)
            if where and where[0]:
                self.send_header("Location", where[0])
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer((host, 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_a_public_only_fetch_checks_every_redirect(monkeypatch: pytest.MonkeyPatch) -> None:
    secret_host = "127.0.0.2"
    secret = _serve({"/secret": (200, b"metadata token\n")}, secret_host)
    hop = _serve({"/": (302, b"", f"http://{secret_host}:{secret.server_port}/secret")})

    ref = SourceRef(url=f"http://127.0.0.1:{hop.server_port}/")
    assert check(ref).verified  # followed as the owner's
    # 127.0.0.1 stands for a public host, the redirect's 127.0.0.2 for a private one
    monkeypatch.setattr(provenance, "public_address", lambda a: a == "127.0.0.1")
    outcome = check(ref, public_only=True)
    assert not outcome.verified and "127.0.0.2 is not a public address" in (outcome.reason or "")
    monkeypatch.undo()
    hosts = ["127.0.0.1", "10.1.2.3", "169.254.169.254", "[::1]", "localhost", "192.168.0.1"]
    # IPv6 forms of a private IPv4 address: IPv4-mapped and -compatible, NAT64, 6to4, Teredo
    hosts += ["[::ffff:127.0.0.1]", "[::127.0.0.1]", "[64:ff9b::a9fe:a9fe]", "[2002:7f00:1::]"]
    hosts += ["[2001:0:4136:e378:8000:63bf:80ff:fffe]"]  # Teredo's client: 127.0.0.1
    for host in hosts:
        with pytest.raises(AccessDenied):
            provenance.check_public(f"http://{host}/x")
    provenance.check_public("http://8.8.8.8/x")  # a public address passes


def test_a_public_only_fetch_tries_each_address_it_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A name with two addresses, the first refusing connections (an IPv6 route that is
    down, say): the fetch goes on to the next, as a client resolving it itself would."""
    page = _serve({"/": (200, b"the public page\n")})
    real = socket.getaddrinfo

    def two(host: Any, port: Any, *args: Any, **kw: Any) -> Any:
        if host != "two.example":
            return real(host, port, *args, **kw)
        return [*real("127.0.0.3", port, *args, **kw), *real("127.0.0.1", port, *args, **kw)]

    monkeypatch.setattr(socket, "getaddrinfo", two)
    monkeypatch.setattr(provenance, "public_address", lambda a: a in ("127.0.0.1", "127.0.0.3"))
    ref = SourceRef(url=f"http://two.example:{page.server_port}/", quote="public page")
    assert check(ref, public_only=True).verified
    page.shutdown()


def test_a_public_only_fetch_connects_to_the_address_it_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """DNS rebinding: a name that resolves to a public address when it is checked and to a
    loopback one when the HTTP client looks it up again. The fetch connects to the address
    it checked, never to one looked up after."""
    secret = _serve({"/": (200, b"metadata token\n")})
    real = socket.getaddrinfo
    lookups: list[str] = []

    def rebinding(host: Any, port: Any, *args: Any, **kw: Any) -> Any:
        if host != "rebind.example":
            return real(host, port, *args, **kw)
        lookups.append(host)
        address = "8.8.8.8" if len(lookups) == 1 else "127.0.0.1"
        return real(address, port, *args, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    ref = SourceRef(url=f"http://rebind.example:{secret.server_port}/", quote="metadata")
    outcome = check(ref, public_only=True)
    assert not outcome.verified
    secret.shutdown()


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"path": "rel/path"},
        {"url": "ftp://x"},
        {"url": "https://x", "path": "/a"},
        {"sandbox": "s", "volume": "v", "path": "/a"},
        {"path": "/a", "line": 0},
        {"path": "/a", "line": 1, "start": 0, "end": 2},
        {"path": "/a", "start": 5, "end": 2},
        {"path": "/a", "start": 5},
        {"path": "/a", "lines": (3, 1)},
        {"path": "/a", "colour": "red"},
    ],
)
def test_malformed_sourceref(kw: dict[str, object]) -> None:
    with pytest.raises(InvalidArgument):
        SourceRef(**kw)  # type: ignore[arg-type]
