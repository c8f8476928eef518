"""torpor's demo: an agent's machine that survives its process.

Session 1 (this process) gives user u-42's agent a sandbox, leaves state in it — an
interpreter variable, a file, a running web server — and pauses it: the whole machine
hibernates to disk. Session 2 (a separate OS process, as if days later) asks for the same
sandbox by name, which wakes it with its RAM intact: the variable is still there, the file too,
and the web server answers without having been restarted. Then the agent remembers a fact
that cites the file it came from, and recalls it.

Inside its VM the agent also has its own memory, with no credential in the guest: the guest
agent serves ``localhost:7777`` and relays each call to the server, which scopes it to the
``memory_scope`` the sandbox was created with. The agent remembers a preference from inside
its VM in session 1; in session 2 the host recalls it, and so does the agent again.

Run:  python examples/demo.py      (after `bash scripts/setup`; the local torpor server starts
                                    by itself on first use and keeps running, like Docker's)
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import sys
import time

import torpor
import torpor.memory
from torpor.client.sources import sandbox_resolver

NAME = "agent-u-42"
NOTES = "['prefers weekly summaries']"
MEMORY_MD = "# u-42\n- prefers weekly summaries\n- upgraded to Pro on the 3rd\n"
#: the agent's own memory from inside its VM: ``python3 /opt/ask.py TOOL '{json args}'``
ASK_PY = """import json, sys, urllib.request as u
req = u.Request("http://127.0.0.1:7777/v1/memory/" + sys.argv[1], data=sys.argv[2].encode(),
                headers={"Content-Type": "application/json"})
print(u.urlopen(req, timeout=300).read().decode())
"""
PROBE = (
    'python3 -c "import urllib.request as u; '
    "print(u.urlopen('http://127.0.0.1:8000/memory.md', timeout=5).status)\""
)


class Clock:
    """Named wall-clock laps, printed as a table at the end."""

    def __init__(self) -> None:
        self.laps: list[tuple[str, float]] = []
        self._t = time.perf_counter()

    def lap(self, what: str) -> None:
        now = time.perf_counter()
        self.laps.append((what, now - self._t))
        print(f"  {what:<44} {(now - self._t) * 1000:8.0f} ms", flush=True)
        self._t = now


def ask(sbx: torpor.Sandbox, tool: str, **args: object) -> dict[str, object]:
    """Call the in-sandbox memory endpoint from inside the VM, as the agent would."""
    out = sbx.commands.run(f"python3 /opt/ask.py {tool} {shlex.quote(json.dumps(args))}")
    if out.exit_code != 0:
        raise SystemExit(f"localhost:7777/{tool} failed in the sandbox: {out.stderr}")
    answer: dict[str, object] = json.loads(out.stdout)
    return answer


def first_session() -> None:
    """Create the sandbox, leave state in it, pause it."""
    print(f"session 1 (pid {os.getpid()}): a new sandbox for user u-42")
    clock = Clock()
    # start from scratch so the demo can be run again and again
    with contextlib.suppress(torpor.SandboxNotFound, torpor.SandboxClosed):
        torpor.Sandbox.get(NAME).kill()
    clock.lap("local server up, old sandbox removed")

    sbx = torpor.Sandbox.get_or_create(
        NAME,
        idle_pause_seconds=600,
        labels={"user": "u-42"},
        memory_scope={"app": "demo", "user": "u-42"},  # its memory at localhost:7777
    )
    assert not sbx.info.reused
    clock.lap(f"create {sbx.id} (a fork of the booted template)")

    sbx.interpreter.run(f"import json\nnotes = {NOTES}")
    clock.lap("interpreter: notes = [...]")
    sbx.files.write("/workspace/memory.md", MEMORY_MD)
    clock.lap("write /workspace/memory.md")
    sbx.commands.run("python3 -m http.server 8000 --directory /workspace", background=True)
    for _ in range(100):  # until the server listens
        if sbx.commands.run(PROBE).stdout.strip() == "200":
            break
        time.sleep(0.2)
    else:
        raise SystemExit("the web server in the sandbox did not start")
    clock.lap("background http.server answers 200")
    sbx.files.write("/opt/ask.py", ASK_PY)
    ask(sbx, "remember", text="prefers weekly summaries", key="summary_cadence")
    clock.lap("remember from inside the VM (localhost:7777)")

    sbx.pause()
    clock.lap("pause (hibernate RAM + processes to disk)")
    assert sbx.info.state.value == "paused"
    print("  paused; this process exits now.\n", flush=True)


def second_session() -> None:
    """In a new OS process: wake the sandbox by name and find everything where it was."""
    print(f"session 2 (pid {os.getpid()}): the same agent comes back")
    clock = Clock()
    sbx = torpor.Sandbox.get_or_create(NAME)
    clock.lap("get_or_create -> wake from disk")
    assert sbx.info.reused, "expected the existing sandbox"

    notes = sbx.interpreter.run("notes").results[0].data["text/plain"]
    clock.lap("interpreter: notes")
    assert notes == NOTES, notes
    text = sbx.files.read_text("/workspace/memory.md")
    clock.lap("read /workspace/memory.md")
    assert text == MEMORY_MD, text
    status = sbx.commands.run(PROBE).stdout.strip()
    clock.lap("GET the http.server started in session 1")
    assert status == "200", status

    print(f"  reused:   {sbx.info.reused}")
    print(f"  notes:    {notes}")
    print(f"  file:     {text.splitlines()[1]}")
    print(f"  http:     {status} from the server started before the pause")

    # Knowledge layer: a fact the agent learned, citing the line of the file it came from.
    # torpor reads the cited line to check the citation instead of trusting it.
    torpor.memory.register_resolver("sandbox", sandbox_resolver())
    u = torpor.Memory().scope(app="demo", user="u-42")
    clock.lap("open the memory store (user u-42's scope)")
    fact = u.remember(
        "upgraded to Pro on the 3rd",
        key="plan",
        source=torpor.SourceRef(sandbox=NAME, path="/workspace/memory.md", line=3),
    )
    clock.lap("remember a fact citing memory.md line 3")
    hits = u.recall("which plan did they upgrade to?", k=1)
    clock.lap("recall it")
    assert fact.verified, "the citation should check out"
    assert hits and hits[0].id == fact.id, hits
    hit = hits[0]
    print(f"  memory:   {hit.text!r} (source verified: {fact.verified})")
    cadence = u.recall("how often should summaries be sent?", k=1)
    clock.lap("host recalls what the agent remembered in its VM")
    assert cadence and cadence[0].text == "prefers weekly summaries", cadence
    inside = ask(sbx, "recall", query="which plan did they upgrade to?", k=1)
    clock.lap("recall from inside the VM (localhost:7777)")
    found = inside["hits"][0]["record"]["text"]  # type: ignore[index]
    assert found == fact.text, inside
    print(f"  in-VM:    remembered {cadence[0].text!r} in session 1; recalls {found!r} now")

    sbx.pause()
    clock.lap("pause again")
    report = sbx.runtime.usage(by="label:user")  # metered from the registry's transitions
    clock.lap("usage report")
    for line in report.lines:
        print(
            f"  usage:    user={line.key}: {line.cpu_hours * 3600:.1f} vCPU-s used of "
            f"{line.vcpu_hours * 3600:.1f} allocated, {line.ram_gib_hours:.4f} GiB-h RAM, "
            f"${line.cost.total:.6f} this month"
        )
    print(
        f"\nok: the sandbox {NAME} is paused on disk; wake it with "
        f"`torpor sandbox exec {NAME} -- cat /workspace/memory.md`"
    )


def main() -> None:
    if sys.argv[1:] == ["--second"]:
        second_session()
        return
    first_session()
    subprocess.run([sys.executable, __file__, "--second"], check=True)


if __name__ == "__main__":
    main()
