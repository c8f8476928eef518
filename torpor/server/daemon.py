"""Running the server process: one per home, on a private unix socket, and on TCP with tokens.

A server holds an exclusive ``flock`` on ``<home>/server.pid`` for its whole life and writes its
pid there, so two servers never own one home (the second one fails with
:class:`~torpor.errors.Conflict`), and ``torpor server status/stop`` find the owner. The lock
dies with the process, so a SIGKILLed server leaves nothing that blocks the next one: a stale
socket file is removed by the next owner.

The unix socket is created here rather than by uvicorn so it is ``0600`` from the first moment
(uvicorn would make it world-writable).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path
from types import FrameType
from typing import IO, Any

from torpor.config import Paths, paths, server_pid
from torpor.errors import Conflict, InvalidArgument, ServerUnavailable, StorageError
from torpor.server.auth import TokenStore

__all__ = ["bind_unix_socket", "serve", "server_pid", "stop_server"]

log = logging.getLogger(__name__)


def _lock(p: Paths) -> IO[str]:
    """Take the home's server lock and write our pid. Raises :class:`Conflict` if it is held."""
    file = p.server_pid
    try:
        handle = open(file, "a+")  # noqa: SIM115 - held for the life of the process
    except OSError as exc:
        raise StorageError(f"cannot open {file}: {exc}", exc=exc, path=str(file)) from exc
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        owner = handle.read().strip()
        handle.close()
        raise Conflict(
            f"another torpor server (pid {owner or '?'}) owns {p.home}; stop it with "
            "`torpor server stop` (running sandboxes are paused, nothing is lost)",
            pid=int(owner) if owner.isdecimal() else None,
            home=str(p.home),
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle


def _unlock(p: Paths, lock: IO[str]) -> None:
    """Give up the home's server lock and remove the pid file (we never served)."""
    with contextlib.suppress(OSError):
        p.server_pid.unlink()
    lock.close()


def stop_server(home: str | os.PathLike[str] | None = None, *, timeout: float = 30.0) -> int | None:
    """Ask the server that owns ``home`` to stop (SIGTERM) and wait until it has.

    Returns its pid, or None if none was running. Raises :class:`ServerUnavailable` if it is
    still running after ``timeout`` seconds.
    """
    pid = server_pid(home)
    if pid is None:
        return None
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while server_pid(home) is not None:
        if time.monotonic() > deadline:
            raise ServerUnavailable(f"server pid {pid} did not stop within {timeout} s", pid=pid)
        time.sleep(0.05)
    return pid


def bind_unix_socket(path: Path) -> socket.socket:
    """A listening unix socket at ``path``, mode 0600, replacing a stale socket file."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # born 0600: no window in which another user could connect
    try:
        sock.bind(str(path))
    except OSError as exc:
        sock.close()
        raise StorageError(f"cannot bind {path}: {exc}", exc=exc, path=str(path)) from exc
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(128)
    return sock


def _embedder_spec(spec: str | None) -> str | None:
    """``None``/``"default"`` -> the default model; ``"none"`` -> lexical only."""
    if spec is None:
        return "default"
    return None if spec.lower() in ("none", "") else spec


def _cluster_config(
    dsn: str,
    store: str | None,
    node: str | None,
    url: str | None,
    host: str | None,
    port: int,
) -> Any:
    """The :class:`~torpor.sandbox.manager.cluster.ClusterConfig` of ``torpor serve
    --cluster``. Raises InvalidArgument when the store is missing or a value is bad."""
    from torpor.sandbox.manager.cluster import ClusterConfig, default_url

    store = store or os.environ.get("TORPOR_STORE")
    if not store:
        raise InvalidArgument(
            "--cluster needs --store s3://bucket/prefix (or $TORPOR_STORE): the nodes share "
            "their pauses there"
        )
    return ClusterConfig(
        dsn=dsn,
        store=store,
        node=node or os.environ.get("TORPOR_NODE") or socket.gethostname().split(".")[0],
        url=url or os.environ.get("TORPOR_NODE_URL") or default_url(host, port),
        lease_seconds=ClusterConfig.lease_from_env(),
        heartbeat_seconds=ClusterConfig.lease_from_env() / 5,
    )


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    # uvicorn shuts down gracefully on SIGTERM/SIGINT, then re-raises the signal; exit
    # cleanly at that point (a traceback for Ctrl-C would suggest something went wrong).
    raise SystemExit(0)


def serve(
    home: str | os.PathLike[str] | None = None,
    *,
    socket_path: Path | None = None,
    host: str | None = None,
    port: int = 8765,
    token_file: Path | None = None,
    manager: Any = None,
    memory: str | None = None,
    embedder: str | None = None,
    reranker: str | None = None,
    log_level: str = "info",
    cluster: str | None = None,
    store: str | None = None,
    node: str | None = None,
    url: str | None = None,
) -> None:
    """Run the server in this process until SIGTERM/SIGINT.

    Listens on ``socket_path`` (default ``paths(home).socket``), where a tokenless request is
    the home's trusted owner, and also on ``host:port`` when ``host`` is given, where every
    request needs a bearer token from the token store (``torpor token create``).
    ``token_file``: a deprecated token file, imported into the store at start. ``memory``: the
    memory store's backend (``"sqlite"``, the default, or a PostgreSQL DSN; default
    ``$TORPOR_MEMORY_BACKEND``). ``embedder``: the memory routes' embedder (``"default"``:
    the local model if installed; ``"none"``: lexical only; or a model name; default
    ``$TORPOR_EMBEDDER`` or ``"default"``). ``reranker``: their cross-encoder reranker
    (``"default"``: the packaged one, ``torpor[rerank]``; a model folder; default
    ``$TORPOR_RERANKER`` or none). ``manager`` defaults to a
    :class:`~torpor.sandbox.manager.SandboxManager` on ``home``. ``$TORPOR_FAST_MEMORY=0``
    sends every request through FastAPI's routing (no :mod:`torpor.server.fastpath`).

    Cluster mode (``cluster``: a PostgreSQL DSN, default ``$TORPOR_CLUSTER``): the sandbox
    registry is that database's, pauses are made durable in ``store`` (``s3://bucket/prefix``,
    default ``$TORPOR_STORE``), this node is called ``node`` (default ``$TORPOR_NODE``, else
    the host name) and advertises ``url`` (default ``http://<host>:<port>``); the memory store
    defaults to the same database. See :mod:`torpor.sandbox.manager.cluster`.

    Raises :class:`Conflict` when another server owns ``home``, :class:`InvalidArgument` for a
    bad token file or an incomplete cluster configuration.
    """
    import uvicorn

    from torpor.server.app import create_app

    # What the server and its QEMU children create (RAM files, disks, state, the registry) is
    # for the home's owner only, whatever umask it was started with.
    os.umask(0o077)
    p = paths(home).ensure()
    tokens = TokenStore.load(token_file) if token_file is not None else None
    lock = _lock(p)
    sock_file = socket_path or p.socket
    cluster = cluster or os.environ.get("TORPOR_CLUSTER") or None
    if cluster is not None:
        memory = memory or cluster  # the memory store (and its tokens) on the same database
    if manager is None:
        from torpor.sandbox.manager import SandboxManager

        try:
            config = (
                None if cluster is None else _cluster_config(cluster, store, node, url, host, port)
            )
            manager = SandboxManager(p, cluster=config)
        except BaseException:
            _unlock(p, lock)
            raise

    cleanup: list[Any] = []
    local = bind_unix_socket(sock_file)
    ino = sock_file.stat().st_ino

    def remove_socket() -> None:
        # Only our own socket: a successor may already have bound a new one.
        with contextlib.suppress(FileNotFoundError):
            if sock_file.stat().st_ino == ino:
                sock_file.unlink()

    cleanup.append(remove_socket)
    sockets = [local]
    if host is not None:
        # IPPROTO_TCP named, not left 0: asyncio sets TCP_NODELAY only on sockets that say so
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Accepted sockets inherit it: without it a response's body waits behind its headers
        # for the client's delayed ACK (40 ms per request on Linux).
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.bind((host, port))
            sock.listen(128)
        except OSError as exc:
            sock.close()
            local.close()
            remove_socket()
            _unlock(p, lock)  # no pid file of a server that never ran
            in_use = exc.errno == errno.EADDRINUSE
            raise (Conflict if in_use else StorageError)(
                f"cannot listen on {host} port {port}: "
                + (
                    "it is in use (another torpor serve? pick another --port)"
                    if in_use
                    else str(exc)
                ),
                exc=exc,
                host=host,
                port=port,
            ) from exc
        sockets.append(sock)

    app = create_app(
        manager,
        tokens=tokens,
        memory=memory or os.environ.get("TORPOR_MEMORY_BACKEND") or "sqlite",
        memory_embedder=_embedder_spec(embedder or os.environ.get("TORPOR_EMBEDDER")),
        memory_reranker=reranker or os.environ.get("TORPOR_RERANKER"),
        require_token=host is not None,
        on_shutdown=cleanup,
        # the hot memory routes' short way (torpor.server.fastpath); "0": FastAPI's routing for
        # every request (the benchmark's baseline, bench/service.py --baseline)
        fast_memory=os.environ.get("TORPOR_FAST_MEMORY", "1") != "0",
    )
    # The stock asyncio loop, not uvloop: qemu.qmp relies on asyncio's own socket objects.
    config = uvicorn.Config(
        app,
        log_level=log_level,
        lifespan="on",
        access_log=False,
        loop="asyncio",
        timeout_graceful_shutdown=10,
    )
    server = uvicorn.Server(config)
    where = str(sock_file) + ("" if host is None else f" and {host}:{sockets[-1].getsockname()[1]}")
    log.info("torpor server pid %d for %s listening on %s", os.getpid(), p.home, where)
    previous = {sig: signal.signal(sig, _exit_on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=sockets)
        if not server.started:
            raise ServerUnavailable("the server failed to start; see the log above")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for callback in cleanup:
            callback()
        for each in sockets:
            each.close()
        lock.close()
        sys.stdout.flush()
