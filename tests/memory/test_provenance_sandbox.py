"""Provenance against real sources: files in sandboxes and on volumes, read through a server.

No resolver is registered here: facts citing ``sandbox=`` or ``volume=`` are checked by the
built-in defaults (:mod:`torpor.client.sources` on the default runtime). The server runs
in-process on the home's unix socket, the way the SDK finds a local server. The ``qemu`` tests
boot one sandbox each (created from the template's booted snapshot, then killed); the first test
runs the same path without a VM (the manager's fake engine), for the volume route.
"""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import uvicorn

import torpor
from torpor.client.runtime import Runtime, set_default_runtime
from torpor.config import paths
from torpor.errors import InvalidArgument, PathNotFound, VolumeNotFound
from torpor.memory import Memory, ScopedMemory, SourceRef
from torpor.memory.provenance import check
from torpor.sandbox.manager import SandboxManager
from torpor.sandbox.storage.volume_files import needs_recovery
from torpor.server.app import create_app
from torpor.server.daemon import bind_unix_socket

LEDGER = "date,event\n2026-03-01,signup\n2026-03-03,upgraded to Pro\n"


@contextmanager
def serve(manager: Any, home: Path) -> Iterator[Runtime]:
    """``manager`` behind a uvicorn server on ``<home>/server.sock`` (in a thread), and a
    Runtime on it that is also the process's default runtime (what the resolvers use)."""
    app = create_app(manager, supervise=False)
    sock: socket.socket = bind_unix_socket(home / "server.sock")
    server = uvicorn.Server(uvicorn.Config(app, lifespan="on", log_level="warning", loop="asyncio"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    rt = Runtime(home=home, autostart=False)
    set_default_runtime(rt)
    try:
        yield rt
    finally:
        set_default_runtime(None)
        try:
            for info in torpor.Sandbox.list(runtime=rt):
                # killed, not paused on shutdown: no VM or RAM file outlives the test
                torpor.Sandbox.get(info.id, runtime=rt).kill()
        finally:
            rt.close()
            server.should_exit = True
            thread.join(300)
            sock.close()


def _scope(home: Path) -> ScopedMemory:
    return Memory(str(home), embedder=None).scope(app="support", user="u-42")


def _mkfs(image: Path, files: dict[str, str]) -> None:
    """Refill a volume image with ``files`` (what a sandbox would have written)."""
    tree = image.with_suffix(".tree")
    for name, text in files.items():
        (tree / name.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        (tree / name.lstrip("/")).write_text(text)
    subprocess.run(
        ["mkfs.ext4", "-q", "-F", "-m", "0", "-d", str(tree), str(image)],
        check=True,
        capture_output=True,
    )


def test_volume_sources_over_http_without_a_vm(tmp_path: Path) -> None:
    """The volume route, Volume.read_file and the default volume resolver, on the real
    manager with its fake engine: no sandbox ever runs."""
    from tests.sandbox.fakes import FakeEngine

    home = tmp_path / "home"
    manager = SandboxManager(paths(home).ensure(), engine=FakeEngine())
    with serve(manager, home) as rt:
        vol = torpor.Volume.create("memory-u-42", size_mib=16, runtime=rt)
        _mkfs(home / "volumes" / f"{vol.id}.img", {"/notes dir/facts.md": LEDGER})
        assert vol.read_file("/notes dir/facts.md") == LEDGER.encode()
        with pytest.raises(PathNotFound):
            vol.read_file("/notes dir/nope.md")
        with pytest.raises(InvalidArgument):
            vol.read_file("/notes dir")
        with pytest.raises(VolumeNotFound):
            torpor.Volume.get("nope", runtime=rt)

        u = _scope(home)
        ref = SourceRef(
            volume="memory-u-42", path="/notes dir/facts.md", line=3, quote="upgraded to Pro"
        )
        fact = u.remember("upgraded to Pro on the 3rd", source=ref)
        assert fact.verified and fact.source_hash and not fact.stale
        assert not check(ref.model_copy(update={"line": 2})).verified  # the line says signup
        assert not check(SourceRef(volume="memory-u-42", path="/gone.md")).verified
        assert not check(SourceRef(volume="no-such-volume", path="/facts.md")).verified
        _mkfs(home / "volumes" / f"{vol.id}.img", {"/notes dir/facts.md": "downgraded\n"})
        [again] = u.verify(fact.id)
        assert again.stale and not again.verified


@pytest.mark.qemu
def test_sandbox_file_citations(qemu_home: Path) -> None:
    """A fact citing a line of a sandbox file: verified; a wrong line, path or sandbox is not;
    a paused sandbox is woken to re-check and paused again; a changed file makes the fact
    stale."""
    with serve(SandboxManager(paths(qemu_home)), qemu_home) as rt:
        sbx = torpor.Sandbox.create(name="agent-u-42", runtime=rt)
        sbx.files.write("/workspace/ledger.csv", LEDGER)
        u = _scope(qemu_home)
        ref = SourceRef(
            sandbox="agent-u-42", path="/workspace/ledger.csv", line=3, quote="upgraded to Pro"
        )
        fact = u.remember("upgraded to Pro on the 3rd", key="plan", source=ref)
        assert fact.verified and fact.source_hash and not fact.stale

        wrong_line = u.remember("upgraded to Pro", source=ref.model_copy(update={"line": 2}))
        assert not wrong_line.verified
        assert not u.remember(
            "x", source=SourceRef(sandbox="agent-u-42", path="/workspace/nope.csv")
        ).verified
        assert not u.remember(
            "x", source=SourceRef(sandbox="agent-u-99", path="/workspace/ledger.csv")
        ).verified

        sbx.pause()
        [same] = u.verify(fact.id)  # wakes the sandbox to read the file, then pauses it again
        assert same.verified and not same.stale
        assert torpor.Sandbox.get("agent-u-42", runtime=rt).info.state.value == "paused"

        sbx.files.write("/workspace/ledger.csv", LEDGER.replace("upgraded to Pro", "downgraded"))
        [changed] = u.verify(fact.id)
        assert changed.stale and not changed.verified
        stored = u.get(fact.id)
        assert stored is not None and stored.stale and not stored.verified  # type: ignore[union-attr]


@pytest.mark.qemu
def test_volume_file_citations(qemu_home: Path) -> None:
    """A file a sandbox wrote to a volume (then ``sync``): verified while the sandbox runs
    (the image is read as the guest flushed it), stale after the guest changes it, and
    readable with no sandbox running once the sandbox is killed."""
    with serve(SandboxManager(paths(qemu_home)), qemu_home) as rt:
        vol = torpor.Volume.create("memory-u-42", size_mib=16, runtime=rt)
        sbx = torpor.Sandbox.create(volumes=[{"volume": vol.id, "path": "/memory"}], runtime=rt)
        path = "/memory/notes dir/facts.md"
        sbx.files.write(path, LEDGER)
        assert sbx.commands.run("sync").exit_code == 0
        u = _scope(qemu_home)
        ref = SourceRef(
            volume="memory-u-42", path="/notes dir/facts.md", line=3, quote="upgraded to Pro"
        )
        live = u.remember("upgraded to Pro on the 3rd", source=ref)
        assert live.verified and not live.stale
        assert not u.remember("x", source=ref.model_copy(update={"line": 2})).verified

        sbx.files.write(path, LEDGER.replace("upgraded to Pro", "downgraded"))
        assert sbx.commands.run("sync").exit_code == 0
        [changed] = u.verify(live.id)
        assert changed.stale and not changed.verified

        sbx.kill()  # no sandbox runs from here on; the volume keeps what was synced
        assert torpor.Sandbox.list(runtime=rt) == []
        image = qemu_home / "volumes" / f"{vol.id}.img"
        assert needs_recovery(image)  # killed with the volume mounted: a journal to replay
        after = u.remember(
            "downgraded on the 3rd", source=ref.model_copy(update={"quote": "downgraded"})
        )
        assert after.verified
        assert not needs_recovery(image)  # replayed before the read, as an attach would
        assert not u.remember(
            "x", source=SourceRef(volume="memory-u-42", path="/notes dir/gone.md")
        ).verified
        assert not u.remember(
            "x", source=SourceRef(volume="memory-u-99", path="/notes dir/facts.md")
        ).verified
