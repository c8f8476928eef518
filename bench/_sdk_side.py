"""The lifecycle benchmark's steps through the public SDK (``bench/lifecycle.py``): a
``torpor serve`` of a home of its own, each step right after the engine's own, timed and split
with the server's own timings (``TORPOR_SERVER_TIMING``)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

Samples = dict[str, list[float]]

__all__ = ["SDK_ONLY", "SDK_PAIRS", "WARM_GAP", "Samples", "SdkSide"]

#: (engine step, the same through the SDK and the server): the SDK/server path's cost
SDK_PAIRS = [
    ("create", "sdk_create"),
    ("interpreter", "sdk_interpreter"),
    ("pause", "sdk_pause"),
    ("wake", "sdk_wake"),
    ("wake_and_call", "sdk_wake_and_call"),
]
#: SDK steps measured paired only (client time minus the engine's inside the server)
SDK_ONLY = (
    "sdk_call_wakes",
    "sdk_get_or_create_and_call",
    "sdk_snapshot",
    "sdk_restore",
    "sdk_fork",
)
#: seconds between a pause and the wake within its linger window (an agent's next turn
#: comes seconds later; this is the short end, so the window never runs out)
WARM_GAP = 0.3


def _serve(home: Path, linger: float = 0.0) -> subprocess.Popen[bytes]:
    """``torpor serve`` on ``home`` (its unix socket only), as the SDK's local server, writing
    each request's timings to ``home/server-timing.jsonl`` (:mod:`torpor.server.timing`),
    keeping a pause's QEMU for ``linger`` seconds (``TORPOR_LINGER_SECONDS``)."""
    env = {**os.environ, "TORPOR_HOME": str(home), "TORPOR_SERVER_TIMING": str(_timing(home))}
    env["TORPOR_LINGER_SECONDS"] = str(linger)
    for var in ("TORPOR_URL", "TORPOR_TOKEN"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "torpor.cli", "serve", "--embedder", "none"]
    return subprocess.Popen(
        [*cmd, "--log-level", "warning"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _timing(home: Path) -> Path:
    return home / "server-timing.jsonl"


#: an SDK step's key -> its engine step's (SDK_PAIRS)
SDK_ENGINE = {sdk: engine for engine, sdk in SDK_PAIRS}


class SdkSide:
    """The same steps through the public SDK, against a ``torpor serve`` of another home (the
    unix socket), each right after the engine's own (so load hits both alike): what the
    server and the client add to the engine's numbers."""

    KEYS = (
        "sdk_create",
        "sdk_interpreter",
        "sdk_pause",
        "sdk_wake",
        "sdk_wake_and_call",
        *SDK_ONLY,
    )

    def __init__(
        self, home: Path, template: str, memory_mib: int, samples: Samples, linger: float = 0.0
    ) -> None:
        from torpor.client import Runtime, Sandbox

        self.template, self.memory_mib = template, memory_mib
        for key in self.KEYS if not linger else ("sdk_warm_wake", "sdk_warm_wake_and_call"):
            samples[key] = []
        self.samples = samples
        self.home = home
        self.proc = _serve(home, linger)
        self.rt = Runtime(home=home, autostart=False)
        deadline = time.monotonic() + 120
        while True:
            try:
                self.rt.health()
                break
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise
                time.sleep(0.05)
        self.sbx = Sandbox.create(template, name="sdk", memory_mib=memory_mib, runtime=self.rt)
        self.sbx.interpreter.run("0")

    def _begin(self) -> tuple[float, int]:
        """The start of a timed SDK step: the time, and how many requests the server had
        timed by then (the lines after it are the step's requests)."""
        return time.perf_counter(), len(_timing(self.home).read_text().splitlines())

    def _add(self, key: str, begun: tuple[float, int]) -> None:
        """Record the SDK step ``key`` (``begun`` by :meth:`_begin`), and how its time splits,
        from the server's lines for its requests (each written before its answer leaves): the
        engine's operations inside the server, the rest of the server (routing, auth,
        models, JSON), the client and the socket. Its time minus the engine's is what the SDK
        and the server add, paired request by request."""
        t0, seen = begun
        total = time.perf_counter() - t0
        self.samples[key].append(total)
        mine = [json.loads(x) for x in _timing(self.home).read_text().splitlines()[seen:]]
        if not mine:
            return
        engine = sum(x["engine_ms"] for x in mine) / 1000
        app = sum(x["app_ms"] for x in mine) / 1000
        for part, value in (
            ("server: the engine's operation", engine),
            ("server: the rest (routing, auth, models, JSON)", app - engine),
            ("the client and the socket", total - app),
        ):
            self.samples.setdefault(f"{key}: {part}", []).append(value)
        self.samples.setdefault(f"sdk_added: {key}", []).append(total - engine)

    def create(self, i: int) -> None:
        from torpor.client import Sandbox

        begun = self._begin()
        made = Sandbox.create(
            self.template, name=f"s{i}", memory_mib=self.memory_mib, runtime=self.rt
        )
        self._add("sdk_create", begun)
        made.kill()

    def interpreter(self) -> None:
        begun = self._begin()
        self.sbx.interpreter.run("1 + 1")
        self._add("sdk_interpreter", begun)

    def wakes(self) -> None:
        """Pause, then wake three ways: resume + a call (as the engine's wake and
        wake_and_call), a call alone (wake-on-request), get_or_create + a call (what an
        agent's session starts with, DESIGN.md)."""
        from torpor.client import Sandbox

        begun = self._begin()
        self.sbx.pause()
        self._add("sdk_pause", begun)
        begun = self._begin()
        self.sbx.resume()
        self._add("sdk_wake", begun)
        self.sbx.interpreter.run("1")
        self._add("sdk_wake_and_call", begun)
        self.sbx.pause()
        begun = self._begin()
        self.sbx.interpreter.run("1")
        self._add("sdk_call_wakes", begun)
        self.sbx.pause()
        begun = self._begin()
        Sandbox.get_or_create("sdk", runtime=self.rt).interpreter.run("1")
        self._add("sdk_get_or_create_and_call", begun)

    def warm_wakes(self) -> None:
        """Pause, then resume + a call within the server's linger window (its pause's QEMU
        is kept: ``linger`` given to the constructor)."""
        self.sbx.pause()
        time.sleep(WARM_GAP)
        begun = self._begin()
        self.sbx.resume()
        self._add("sdk_warm_wake", begun)
        self.sbx.interpreter.run("1")
        self._add("sdk_warm_wake_and_call", begun)

    def checkpoints(self, i: int) -> None:
        """Snapshot the running sandbox, restore it, fork it (one child): paired only (the
        engine's own figures for these are ``bench/snapshots.py``'s)."""
        begun = self._begin()
        snap = self.sbx.snapshot(name=f"sdk-{i}")
        self._add("sdk_snapshot", begun)
        begun = self._begin()
        restored = snap.restore()
        self._add("sdk_restore", begun)
        restored.kill()
        begun = self._begin()
        children = self.sbx.fork()
        self._add("sdk_fork", begun)
        for child in children:
            child.kill()
        with contextlib.suppress(Exception):  # (its chunk-store save may still run)
            snap.delete()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.sbx.kill()
        self.rt.close()
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
