"""Starting the local server on demand, as Docker's and Ollama's clients do.

With no URL the SDK talks to ``<home>/server.sock``. If nothing answers there, the first caller
starts ``python -m torpor.cli serve`` as a detached daemon (its own session, stdio to
``<home>/server.log``) and waits until it answers. An ``flock`` on ``<home>/server.start.lock``
makes N processes that arrive at once start exactly one server: the others wait on the lock,
then find it running.
"""

from __future__ import annotations

import fcntl
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from torpor._tail import log_tail
from torpor.config import Paths
from torpor.errors import ServerUnavailable

__all__ = ["ensure_local_server", "is_alive"]

log = logging.getLogger(__name__)

#: Servers this process started (they outlive it; the handles only avoid ResourceWarnings).
_children: list[subprocess.Popen[bytes]] = []


def is_alive(socket_path: Path, *, timeout: float = 2.0) -> bool:
    """True when a torpor server answers ``/v1/health`` on ``socket_path``."""
    if not socket_path.exists():
        return False
    try:
        transport = httpx.HTTPTransport(uds=str(socket_path))
        with httpx.Client(transport=transport, base_url="http://torpor", timeout=timeout) as c:
            return c.get("/v1/health").status_code == 200
    except httpx.HTTPError:
        return False


def _same_torpor() -> dict[str, str]:
    """The child's ``PYTHONPATH`` when this process runs torpor from a source tree (a checkout
    on ``sys.path``, not an installed copy): that tree first, so the server it starts runs
    this code, not whatever copy (or none) the interpreter would find from the server's home.
    An installed torpor needs nothing (the same interpreter finds it)."""
    root = Path(__file__).resolve().parents[2]  # the folder holding the ``torpor`` package
    if root.name in ("site-packages", "dist-packages"):
        return {}
    rest = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": os.pathsep.join([str(root), *([rest] if rest else [])])}


def ensure_local_server(p: Paths, *, timeout: float = 120.0) -> None:
    """Make sure a server answers on ``p.socket``, starting one if needed.

    Raises :class:`ServerUnavailable` if the server exits or does not answer within
    ``timeout`` seconds (the message carries the end of its log).
    """
    p.home.mkdir(parents=True, exist_ok=True)
    with open(p.home / "server.start.lock", "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # other starters queue here
        if is_alive(p.socket):
            return
        log_file = p.home / "server.log"
        env = {**os.environ, "TORPOR_HOME": str(p.home), **_same_torpor()}
        log.info("starting a local torpor server for %s", p.home)
        with open(log_file, "ab") as out:
            proc = subprocess.Popen(  # our own interpreter and module
                [sys.executable, "-m", "torpor.cli", "serve", "--socket", str(p.socket)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                env=env,
                cwd=p.home,
                start_new_session=True,
                close_fds=True,
            )
        _children.append(proc)  # keep the handle: no "still running" warning when it is GC'd
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if is_alive(p.socket):
                log.info("local torpor server pid %d is up", proc.pid)
                return
            if proc.poll() is not None:
                # It may have lost the race to a server started by hand: that one will answer.
                from torpor.config import server_pid

                if server_pid(p.home) is None:
                    raise ServerUnavailable(
                        f"the local torpor server exited with code {proc.returncode}:\n"
                        f"{log_tail(log_file, 15)}",
                        log=str(log_file),
                    )
            time.sleep(0.1)
        raise ServerUnavailable(
            f"the local torpor server did not answer within {timeout:.0f} s:\n"
            f"{log_tail(log_file, 15)}",
            log=str(log_file),
        )
