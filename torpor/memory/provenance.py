"""Provenance: read the content a :class:`SourceRef` cites, hash it, and re-check it later.

Reading goes through a resolver seam so the sandbox and volume layers can plug in::

    register_resolver("sandbox", my_reader)    # my_reader(ref) -> bytes (the whole file)

Built in: ``host`` (a bare absolute ``path``: a file on this machine) and ``url`` (an HTTP
GET with a short timeout). ``sandbox`` and ``volume`` sources default to the SDK's resolvers
(:mod:`torpor.client.sources`) on the default runtime: the local server, started on demand,
or ``$TORPOR_URL``. A sandbox file is read through the sandbox (waking it when paused); a
volume file is read from the volume's disk image on the server, with no sandbox running (a
volume attached to a running sandbox shows what the guest has flushed: ``sync``, or a pause).
The client is imported on first use only, so ``torpor.memory`` alone never loads it. A
resolver returns the whole file; :func:`cite` cuts the cited line(s) or byte range out of it.

Who may cite what: ``host``, ``sandbox`` and ``volume`` sources are read with this process's
own rights (on a server: the home owner's, whatever tenant asks), so only the owner may cite
them (:data:`OWNER_ONLY`); a caller with a token cites ``url`` sources, fetched only from
public addresses (``public_only``: no loopback, private or link-local host, at any redirect).

A fact is ``verified`` only when the cited content exists (and contains ``ref.quote`` when
one is given); its SHA-256 is stored. :func:`check` re-reads it: a different hash or a
missing source marks the fact ``stale`` and unverified.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torpor.errors import AccessDenied, NotFound, PathNotFound, TorporError
from torpor.memory.models import SourceRef

log = logging.getLogger(__name__)

__all__ = [
    "OWNER_ONLY",
    "Resolver",
    "Verification",
    "check",
    "check_public",
    "cite",
    "public_address",
    "read_source",
    "refusal",
    "register_resolver",
]

#: source kinds read with this process's own rights: the home owner's to cite, not a token's
OWNER_ONLY = frozenset({"host", "sandbox", "volume"})
#: redirects a public-only fetch follows (each one checked)
MAX_REDIRECTS = 5

#: ``resolver(ref) -> bytes`` of the whole file; raises :class:`NotFound` when it is missing.
Resolver = Callable[[SourceRef], bytes]

_lock = threading.Lock()
_resolvers: dict[str, Resolver] = {}


def register_resolver(kind: str, resolver: Resolver | None) -> None:
    """Install (or with None remove) the reader for ``kind``: ``sandbox``, ``volume``,
    ``host`` or ``url``."""
    with _lock:
        if resolver is None:
            _resolvers.pop(kind, None)
        else:
            _resolvers[kind] = resolver


def source_kind(ref: SourceRef) -> str:
    """``url``, ``sandbox``, ``volume`` or ``host``."""
    if ref.url:
        return "url"
    if ref.sandbox:
        return "sandbox"
    if ref.volume:
        return "volume"
    return "host"


def _read_host(ref: SourceRef) -> bytes:
    path = Path(ref.path or "")
    try:
        return path.read_bytes()
    except FileNotFoundError as exc:
        raise PathNotFound(f"no such file {path}", kind="path", name=str(path), exc=exc) from exc
    except OSError as exc:
        raise PathNotFound(
            f"cannot read {path}: {exc}", kind="path", name=str(path), exc=exc
        ) from exc


def public_address(address: str) -> bool:
    """Whether the IP ``address`` is public: global, and so is any IPv4 address it carries
    (IPv4-mapped or -compatible, NAT64, 6to4, Teredo), which would reach a private host."""
    ip = ipaddress.ip_address(address.split("%")[0])
    if not ip.is_global:
        return False
    if isinstance(ip, ipaddress.IPv6Address):
        packed = ip.packed
        carried = [ip.ipv4_mapped, ip.sixtofour, ip.teredo[1] if ip.teredo else None]
        # IPv4-compatible (::a.b.c.d) and NAT64 carry it in the low 32 bits
        if packed[:12] == bytes(12) or any(ip in net for net in _NAT64):
            carried.append(ipaddress.IPv4Address(packed[12:]))
        return all(v4 is None or v4.is_global for v4 in carried)
    return True


#: NAT64 prefixes (RFC 6052, RFC 8215): the IPv4 address is the low 32 bits
_NAT64 = ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48")


def _public_addresses(url: str) -> tuple[str, list[str]]:
    """``url``'s host and the addresses it resolves to, all public. Raises
    :class:`AccessDenied` when one is not (:func:`public_address`); no addresses when the
    host does not resolve (fetching it fails on its own)."""
    import httpx

    try:
        host = httpx.URL(url).host
    except httpx.InvalidURL:
        return "", []
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return host, []
    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    for address in addresses:
        if not public_address(address):
            raise AccessDenied(
                f"{url}: {host} is not a public address ({address})", tenant="", scope=""
            )
    return host, addresses


def check_public(url: str) -> None:
    """Raise :class:`AccessDenied` when ``url``'s host is, or resolves to, an address that is
    not public (loopback, private, link-local such as a cloud's metadata service...). A host
    that does not resolve passes: fetching it fails on its own."""
    _public_addresses(url)


def refusal(ref: SourceRef) -> str | None:
    """Why a caller with a token may not have ``ref`` read, or None when it may: a source this
    process reads with its own rights (:data:`OWNER_ONLY`), or a URL whose host is not
    public (:func:`check_public`)."""
    kind = source_kind(ref)
    if kind in OWNER_ONLY:
        return (
            f"a {kind} source ({ref.location}) is read with the server's own rights: only the "
            "home's owner cites one, not a token"
        )
    try:
        check_public(ref.url or "")
    except AccessDenied as exc:
        return exc.message
    return None


def _read_url(ref: SourceRef, public_only: bool = False) -> bytes:
    import httpx

    url = ref.url or ""
    try:
        with httpx.Client(timeout=5.0, follow_redirects=not public_only) as client:
            for _ in range(MAX_REDIRECTS + 1):
                if not public_only:
                    resp = client.get(url)
                    break
                # connect to the address checked, not to one the client would look up again
                # (DNS rebinding): the host goes in the Host header and TLS's server name
                host, addresses = _public_addresses(url)
                resp = _get_pinned(client, httpx.URL(url), host, addresses)
                location = resp.headers.get("location")
                if not (resp.is_redirect and location):
                    break
                url = str(httpx.URL(url).join(location))
    except AccessDenied as exc:
        raise NotFound(f"cannot fetch {ref.url}: {exc}", kind="url", name=ref.url) from exc
    except httpx.HTTPError as exc:
        raise NotFound(f"cannot fetch {ref.url}: {exc}", kind="url", name=ref.url, exc=exc) from exc
    if resp.status_code != 200:
        raise NotFound(f"{ref.url} answered {resp.status_code}", kind="url", name=ref.url)
    return resp.content


def _get_pinned(client: Any, url: Any, host: str, addresses: list[str]) -> Any:
    """GET ``url`` (an ``httpx.URL``) from the first of ``addresses`` (those ``host``
    resolved to, checked) that takes the connection, the host in the ``Host`` header and the
    TLS server name; no addresses: as it is (it fails on its own). Raises httpx's errors."""
    import httpx

    headers = {"Host": url.netloc.decode("ascii")}
    for i, address in enumerate(addresses):
        try:
            return client.get(
                url.copy_with(host=address), headers=headers, extensions={"sni_hostname": host}
            )
        except (httpx.ConnectError, httpx.ConnectTimeout):
            if i == len(addresses) - 1:
                raise
    return client.get(url)


def read_source(ref: SourceRef, *, public_only: bool = False) -> bytes:
    """The whole file (or document) ``ref`` names, through the resolver registered for its
    kind or the built-in one (``public_only``: the built-in URL reader fetches from public
    addresses only). Raises :class:`NotFound` (or a subclass) when it cannot be read, and any
    other :class:`TorporError` the resolver raises (for a sandbox or volume:
    :class:`~torpor.errors.ServerUnavailable` without a server)."""
    kind = source_kind(ref)
    with _lock:
        resolver = _resolvers.get(kind)
    if resolver is None:
        if kind == "url":
            return _read_url(ref, public_only)
        resolver = _default_resolver(kind)
    return resolver(ref)


def _default_resolver(kind: str) -> Resolver:
    """The built-in reader of ``kind``. Sandboxes and volumes go through the SDK, imported
    here and not at module load: the memory layer stands alone until a source needs a server."""
    if kind == "host":
        return _read_host
    if kind == "url":
        return _read_url
    from torpor.client import sources

    if kind == "sandbox":
        return sources.sandbox_resolver()
    return sources.volume_resolver()


def cite(content: bytes, ref: SourceRef) -> bytes:
    """The part of ``content`` that ``ref`` cites. Raises :class:`NotFound` when the line
    or byte range lies outside the content."""
    if ref.line is not None or ref.lines is not None:
        first, last = (ref.line, ref.line) if ref.line is not None else ref.lines  # type: ignore[misc]
        lines = content.splitlines()
        if last > len(lines):
            raise NotFound(
                f"{ref.location}: the file has {len(lines)} lines", kind="line", name=ref.location
            )
        return b"\n".join(lines[first - 1 : last])
    if ref.start is not None and ref.end is not None:
        if ref.end > len(content):
            raise NotFound(
                f"{ref.location}: the file has {len(content)} bytes",
                kind="range",
                name=ref.location,
            )
        return content[ref.start : ref.end]
    return content


@dataclass(frozen=True)
class Verification:
    """The outcome of reading a source: ``verified``, the cited content's ``sha256`` (None when
    unreadable) and ``reason`` when not verified."""

    verified: bool
    sha256: str | None
    reason: str = ""


def _normalize(text: bytes) -> str:
    return " ".join(text.decode("utf-8", "replace").split()).casefold()


def check(ref: SourceRef, *, public_only: bool = False) -> Verification:
    """Read and hash the content ``ref`` cites (``public_only``: see :func:`read_source`);
    never raises for an unreadable source."""
    try:
        cited = cite(read_source(ref, public_only=public_only), ref)
    except TorporError as exc:
        log.info("source %s not verified: %s", ref.location, exc)
        return Verification(False, None, str(exc))
    digest = hashlib.sha256(cited).hexdigest()
    if not cited.strip():
        return Verification(False, digest, "the cited content is empty")
    if ref.quote is not None and _normalize(ref.quote.encode()) not in _normalize(cited):
        return Verification(False, digest, "the cited content does not contain the quote")
    return Verification(True, digest)
