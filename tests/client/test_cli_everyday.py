"""The CLI and SDK a person or a script uses every day, end to end over a real server and the
real manager and registry (the manager's fake engine: no VMs): lifecycle controls, events,
``--json``/``-q`` anywhere, exit codes, and one clean line for common mistakes."""

from __future__ import annotations

import io
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import torpor
from tests.client.conftest import _run
from tests.sandbox.fakes import FakeEngine
from torpor.cli import main
from torpor.client import Runtime, Sandbox, set_default_runtime
from torpor.config import paths
from torpor.errors import InvalidArgument
from torpor.sandbox.manager import SandboxManager
from torpor.server.app import create_app
from torpor.server.daemon import bind_unix_socket


@dataclass
class Home:
    path: Path
    runtime: Runtime


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Home]:
    """A real manager (fake engine) served on the home's socket; the CLI and SDK use it."""
    h = tmp_path / "h"
    monkeypatch.setenv("TORPOR_HOME", str(h))
    monkeypatch.delenv("TORPOR_URL", raising=False)
    manager = SandboxManager(paths(h), engine=FakeEngine())
    app = create_app(manager, supervise=False)
    sock = bind_unix_socket(paths(h).socket)
    for _ in _run(app, sock):
        rt = Runtime(home=h, autostart=False)
        set_default_runtime(rt)
        yield Home(h, rt)
        set_default_runtime(None)
        rt.close()


@dataclass
class Ran:
    code: int
    out: str
    err: str

    def json(self) -> object:
        return json.loads(self.out)


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> Ran:
    capsys.readouterr()
    try:
        main(list(args))
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    got = capsys.readouterr()
    return Ran(code, got.out, got.err)


def test_json_and_quiet_in_any_position(home: Home, capsys: pytest.CaptureFixture[str]) -> None:
    made = cli(capsys, "sandbox", "create", "agent-7", "--label", "user=u-7", "--json")
    assert made.code == 0, made.err
    info = made.json()
    assert (
        isinstance(info, dict) and info["name"] == "agent-7" and info["labels"] == {"user": "u-7"}
    )
    sid = info["id"]
    for args in (
        ["--json", "sandbox", "ls"],
        ["sandbox", "--json", "ls"],
        ["sandbox", "ls", "--json"],
        ["sandbox", "ls", "--label", "user=u-7", "--json"],
    ):
        r = cli(capsys, *args)
        assert r.code == 0, (args, r.err)
        listed = r.json()
        assert isinstance(listed, list) and [i["id"] for i in listed] == [sid], args
        assert listed[0]["owned_bytes"] > 0
    assert cli(capsys, "-q", "sandbox", "ls").out == sid + "\n"
    assert cli(capsys, "sandbox", "get", "agent-7", "-q").out == sid + "\n"
    again = cli(capsys, "sandbox", "create", "agent-7", "--get-or-create", "-q")
    assert again.code == 0 and again.out == sid + "\n"  # the same id every day
    taken = cli(capsys, "sandbox", "create", "agent-7")
    assert taken.code == 1 and "Conflict" in taken.err and "Traceback" not in taken.err
    assert cli(capsys, "--version").out.startswith("torpor ")
    assert "Usage" in cli(capsys, "sandbox", "ls", "-h").out


def test_a_table_never_cuts_an_id(home: Home, capsys: pytest.CaptureFixture[str]) -> None:
    ids = [
        Sandbox.create(name=f"a-rather-long-sandbox-name-{i}", labels={"user": "x" * 40}).id
        for i in range(2)
    ]
    out = cli(capsys, "sandbox", "ls").out  # captured: not a terminal, 80 columns
    for sid in ids:
        assert sid in out
    assert "a-rather-long-sandbox-name-0" in out


def test_set_changes_labels_and_idle_pause(home: Home, capsys: pytest.CaptureFixture[str]) -> None:
    sbx = Sandbox.create(name="u1", labels={"user": "u-1", "tier": "free"})
    sbx.pause()
    info = sbx.set(labels={"user": "jordan@example.com"}, idle_pause_seconds=600)
    assert info.labels == {"user": "jordan@example.com"} and info.idle_pause_seconds == 600
    assert info.state.value == "paused"  # not woken
    r = cli(
        capsys,
        "sandbox",
        "set",
        "u1",
        "--label",
        "tier=pro",
        "--unlabel",
        "user",
        "--idle-pause",
        "0",
        "--json",
    )
    assert r.code == 0, r.err
    got = r.json()
    assert isinstance(got, dict)
    assert got["labels"] == {"tier": "pro"} and got["idle_pause_seconds"] is None
    shown = cli(capsys, "sandbox", "get", "u1").out
    assert "tier=pro" in shown and "never" in shown and "disk owned" in shown
    assert "deleted at" in shown  # paused: when its pause expires
    with pytest.raises(InvalidArgument):
        sbx.set(idle_pause_seconds=-5)


def test_events_follow_pause_wake_kill(home: Home, capsys: pytest.CaptureFixture[str]) -> None:
    sbx = Sandbox.create(name="ev")
    seen: list[tuple[str, str]] = []
    done = threading.Event()

    def follow() -> None:
        for event in home.runtime.events(follow=True, wait=1.0):
            seen.append((event.kind, event.name))
            if event.kind == "kill":
                done.set()
                return

    t = threading.Thread(target=follow, daemon=True)
    t.start()
    sbx.pause()
    sbx.commands.run("echo hi")  # wakes it
    sbx.kill()
    assert done.wait(30), seen
    assert seen == [("create", "ev"), ("pause", "ev"), ("wake", "ev"), ("kill", "ev")]
    r = cli(capsys, "events", "ev", "--json")
    lines = [json.loads(line) for line in r.out.splitlines()]
    assert [e["kind"] for e in lines] == ["create", "pause", "wake", "kill"]
    assert lines[2]["reason"] == "wake on request" and lines[0]["sandbox_id"] == sbx.id
    plain = cli(capsys, "events").out
    assert "pause" in plain and sbx.id in plain
    assert [e.kind for e in sbx.events()] == ["create", "pause", "wake", "kill"]


def test_exec_timeout_exits_124_and_run_reads_files_and_stdin(
    home: Home, capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    Sandbox.create(name="x")
    r = cli(capsys, "sandbox", "exec", "x", "--timeout", "0.2", "--", "sleep", "30")
    assert r.code == 124 and "timed out" in r.err
    r = cli(capsys, "sandbox", "exec", "x", "--json", "--", "echo", "hi")
    assert r.code == 0 and r.json() == {"exit_code": 0, "stdout": "hi\n", "stderr": "", "pid": None}
    script = tmp_path / "a.py"
    script.write_text("y = 20\n")
    assert cli(capsys, "run", "x", "--file", str(script)).code == 0
    monkeypatch.setattr("sys.stdin", io.StringIO("y + 1\n"))
    r = cli(capsys, "run", "x", "-")
    assert r.code == 0 and r.out.strip() == "21"
    r = cli(capsys, "run", "x", "y * 2", "--json")
    got = r.json()
    assert isinstance(got, dict) and got["results"][0]["data"]["text/plain"] == "40"
    r = cli(capsys, "run", "x")
    assert r.code == 1 and "one of them" in r.err


def test_create_with_env(home: Home, capsys: pytest.CaptureFixture[str]) -> None:
    r = cli(capsys, "sandbox", "create", "envy", "--env", "TORPOR_TEST_TOKEN=abc=1", "--json")
    assert r.code == 0, r.err
    assert "abc=1" not in r.out  # not in the info
    r = cli(capsys, "sandbox", "exec", "envy", "--", "printenv", "TORPOR_TEST_TOKEN")
    assert r.code == 0 and r.out == "abc=1\n"
    bad = cli(capsys, "sandbox", "create", "envy2", "--env", "NOEQUALS")
    assert bad.code == 1 and "--env 'NOEQUALS' is not KEY=VALUE" in bad.err


def test_logs(home: Home, capsys: pytest.CaptureFixture[str]) -> None:
    sbx = Sandbox.create(name="lg")
    (home.path / "sandboxes" / sbx.id / "console.log").write_text("boot\nready\n")
    sbx.pause()
    r = cli(capsys, "sandbox", "logs", "lg", "-n", "1")
    assert r.code == 0 and r.out == "ready\n"
    assert Sandbox.get("lg").info.state.value == "paused"  # reading logs does not wake it


def test_common_mistakes_are_one_line(home: Home, capsys: pytest.CaptureFixture[str]) -> None:
    r = cli(capsys, "memory", "--scope", "app/a/user/u", "remember", "x", "--meta", "{bad")
    assert r.code == 1 and "--meta takes JSON" in r.err and "Traceback" not in r.err
    # a group option after the command is moved where it belongs
    r = cli(capsys, "memory", "remember", "prefers tea", "--scope", "app/a/user/u", "--json")
    assert r.code == 0, r.err
    r = cli(capsys, "memory", "recall", "tea", "--json", "--scope", "app/a/user/u")
    assert r.code == 0, r.err and "prefers tea" in r.out
    r = cli(capsys, "sandbox", "create", "--template", "pyton")
    assert r.code == 1 and "TemplateNotFound" in r.err and "Traceback" not in r.err
    r = cli(capsys, "sandbox", "create", "Bad Name")
    assert r.code == 1 and r.err.count("\n") == 1, r.err


def test_port_in_use_is_one_line_and_leaves_no_pid(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    h = tmp_path / "other"
    monkeypatch.setenv("TORPOR_HOME", str(h))
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"tokens": {"t" * 32: "acme"}}))
    try:
        r = cli(
            capsys, "serve", "--host", "127.0.0.1", "--port", str(port), "--token-file", str(tokens)
        )
    finally:
        busy.close()
    assert r.code == 1 and f"port {port}" in r.err and "Traceback" not in r.err
    assert not paths(h).server_pid.exists()
    time.sleep(0)  # nothing left running


def test_a_narrow_terminal_wraps_other_columns_not_ids() -> None:
    from rich.console import Console

    from torpor.cli.output import table

    ids = ["sbx-0123456789ab", "sbx-ba9876543210"]
    rows = [[i, "a label that is much too long for the width", "running"] for i in ids]
    narrow = Console(width=40, force_terminal=True, color_system=None, record=True)
    narrow.print(table(["id", "labels", "state"], rows, ids=["id", "state"]))
    text = narrow.export_text()
    assert all(len(line) <= 40 for line in text.splitlines())
    for sid in ids:
        assert sid in text  # whole, on one line


def test_stored_things_print_json_and_ids(home: Home, capsys: pytest.CaptureFixture[str]) -> None:
    r = cli(capsys, "volume", "create", "vol-a", "--size-mib", "16", "--json")
    assert r.code == 0, r.err
    vol = r.json()
    assert isinstance(vol, dict) and vol["name"] == "vol-a" and vol["size_mib"] == 16
    assert cli(capsys, "--json", "volume", "ls").json() == [vol]
    assert cli(capsys, "volume", "ls", "-q").out == vol["id"] + "\n"
    d = cli(capsys, "drive", "create", "dr-a", "-q")
    assert d.code == 0 and len(d.out.split()) == 1, d.err
    drives = cli(capsys, "drive", "ls", "--json").json()
    assert isinstance(drives, list) and [x["id"] for x in drives] == [d.out.strip()]
    assert cli(capsys, "snapshot", "ls", "--json").json() == []
    assert cli(capsys, "template", "ls", "--json").json() == []
    verify = cli(capsys, "storage", "verify", "--json")
    assert verify.code == 0 and verify.json() == {"chunks": 0, "bad_chunks": [], "affected": {}}
    gc = cli(capsys, "gc", "--dry-run", "--json").json()
    assert isinstance(gc, dict) and gc["dry_run"] is True


def test_docs_name_every_sandbox_command() -> None:
    """docs/cli.md lists every command of the sandbox-side groups (the groups other areas add
    are documented with them)."""
    import typer

    from torpor.cli import _load, app

    _load()
    doc = (Path(__file__).parents[2] / "docs" / "cli.md").read_text()
    commands = getattr(typer.main.get_command(app), "commands", {})
    missing = [name for name in ("run", "events", "gc", "serve", "doctor") if name not in doc]
    for group in ("sandbox", "snapshot", "volume", "drive", "template", "server"):
        missing += [f"{group} {sub}" for sub in commands[group].commands if sub not in doc]
    assert missing == []


def test_doctor_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from types import SimpleNamespace

    from torpor.sandbox.vm import accel

    monkeypatch.setenv("TORPOR_HOME", str(tmp_path / "h"))
    probe = SimpleNamespace(accel="tcg", reason="no /dev/kvm (stub)")
    monkeypatch.setattr(accel, "probe", lambda force=False: probe)
    r = cli(capsys, "doctor", "--json")
    assert r.code == 0, r.err
    got = r.json()
    assert isinstance(got, dict)
    assert got["accel"] == "tcg" and got["templates"] == [] and got["home"] == str(tmp_path / "h")


def test_a_follower_continues_across_a_server_restart(tmp_path: Path) -> None:
    from tests.sandbox.fakes import FakeWorld

    h = tmp_path / "h"
    world = FakeWorld()
    seen: list[tuple[int, str, str]] = []
    done = threading.Event()

    def follow() -> None:
        rt = Runtime(home=h, autostart=False)
        for e in rt.events(follow=True, wait=1.0):
            seen.append((e.seq, e.kind, e.name))
            if e.name == "second" and e.kind == "create":
                done.set()
                return

    reader = threading.Thread(target=follow, daemon=True)

    def serve_once(name: str) -> None:
        manager = SandboxManager(paths(h), engine=FakeEngine(world))
        sock = bind_unix_socket(paths(h).socket)
        for _ in _run(create_app(manager, supervise=False), sock):
            Sandbox.create(name=name, runtime=Runtime(home=h, autostart=False))
            if not reader.is_alive():
                reader.start()
            time.sleep(1.5)  # the follower reads, then the server goes away under it

    serve_once("first")  # its close pauses "first"
    time.sleep(1.0)  # the follower meets a refused connection
    serve_once("second")
    assert done.wait(30), seen
    kinds = [(k, n) for _, k, n in seen]
    assert kinds == [("create", "first"), ("pause", "first"), ("create", "second")]
    assert [s for s, _, _ in seen] == sorted({s for s, _, _ in seen})  # in order, no repeats


def test_volumes_and_drives_carry_labels(home: Home, capsys: pytest.CaptureFixture[str]) -> None:
    made = cli(
        capsys, "volume", "create", "v-7", "--size-mib", "16", "--label", "user=u-7", "--json"
    )
    assert made.code == 0, made.err
    info = made.json()
    assert isinstance(info, dict) and info["labels"] == {"user": "u-7"}
    assert cli(capsys, "volume", "create", "v-8", "--size-mib", "16", "-q").code == 0
    listed = cli(capsys, "volume", "ls", "--label", "user=u-7", "--json").json()
    assert isinstance(listed, list) and [v["name"] for v in listed] == ["v-7"]
    assert "user=u-7" in cli(capsys, "volume", "ls").out
    bad = cli(capsys, "volume", "ls", "--label", "nokey")
    assert bad.code != 0 and "Traceback" not in bad.err
    assert cli(capsys, "drive", "create", "d-7", "-l", "team=a", "-l", "user=u-7", "-q").code == 0
    drives = cli(capsys, "drive", "ls", "--label", "team=a", "--json").json()
    assert isinstance(drives, list) and [d["labels"] for d in drives] == [
        {"team": "a", "user": "u-7"}
    ]
    # the SDK: the same, sync
    vol = torpor.Volume.create("v-9", 16, labels={"user": "u-9"}, runtime=home.runtime)
    assert [v.id for v in torpor.Volume.list({"user": "u-9"}, runtime=home.runtime)] == [vol.id]
    assert [d.name for d in torpor.Drive.list({"user": "u-7"}, runtime=home.runtime)] == ["d-7"]


@pytest.mark.parametrize(
    "args",
    [
        ["token", "create", "--write", "app//u-42"],  # a grant that would match no scope
        ["sandbox", "create", "a1", "--volume", "v1:/data:readonly"],  # not read-only: refused
        ["sandbox", "create", "a1", "--volume", "v1:/data:ro:x"],
        ["sandbox", "create", "a1", "--drive", "d1:/shared:ro"],
        ["memory", "-s", "app/a/user/u", "remember", "hi", "--source", "[1]"],
        ["memory", "-s", "app/a/user/u", "remember", "hi", "--source", '"x"'],
    ],
)
def test_a_mistake_is_one_typed_line_and_does_nothing(
    home: Home, capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    """Each of these was accepted (a token that grants nothing, a volume mounted read-write
    for a mode typo) or ended in an untyped error with the traceback hint."""
    made = cli(capsys, *args)
    assert made.code == 1, made.out
    assert made.err.startswith("error: InvalidArgument") and "TORPOR_DEBUG" not in made.err
    assert Sandbox.list(runtime=home.runtime) == []
    assert [t for t in home.runtime.tokens.list() if t.grants] == []


def test_run_file_that_is_a_directory_is_refused(
    home: Home, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert cli(capsys, "sandbox", "create", "a1").code == 0
    made = cli(capsys, "run", "a1", "--file", str(tmp_path))
    assert made.code != 0 and "Traceback" not in made.err and "TORPOR_DEBUG" not in made.err
    assert "directory" in made.err
    bad = tmp_path / "latin1.py"
    bad.write_bytes(b"x = '\xe9'\n")
    made = cli(capsys, "run", "a1", "--file", str(bad))
    assert made.code == 1 and made.err.startswith("error: InvalidArgument: cannot read")


def test_labels_with_brackets_are_printed_as_written(
    home: Home, capsys: pytest.CaptureFixture[str]
) -> None:
    # A label is the user's text, not rich markup: "[/]" ended `sandbox ls` with a
    # MarkupError and "[pro]" vanished from the table.
    Sandbox.create(name="b1", labels={"tier": "[pro]", "note": "[/]"})
    for args in (["sandbox", "ls"], ["sandbox", "get", "b1"]):
        r = cli(capsys, *args)
        assert r.code == 0, (args, r.err)
        assert "tier=[pro]" in r.out and "note=[/]" in r.out, args


def test_server_status_shows_the_local_server_whatever_torpor_url_says(
    home: Home,
    tcp_served: tuple[object, str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # `server status` checked the local pid file but asked $TORPOR_URL's server the rest:
    # one status of two servers (the remote's home, tenant and sandboxes under a local pid).
    import fcntl

    Sandbox.create(name="here")
    pid_file = paths(home.path).server_pid
    with open(pid_file, "w") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        held.write(f"{os.getpid()}\n")
        held.flush()
        monkeypatch.setenv("TORPOR_URL", tcp_served[1])
        monkeypatch.setenv("TORPOR_TOKEN", "a" * 32)
        r = cli(capsys, "server", "status", "--json")
    assert r.code == 0, r.err
    status = r.json()
    assert isinstance(status, dict)
    assert (status["home"], status["tenant"], status["sandboxes"]) == (str(home.path), "default", 1)


def test_token_commands_act_as_the_token_given_on_the_local_server(
    home: Home, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Without --url, --token (or $TORPOR_TOKEN) was dropped: the command ran as the home's
    # owner, in tenant default, rather than as the (narrower) token it was given.
    admin = home.runtime.tokens.create(tenant="acme", grants=[("write", "")], admin=True)
    made = cli(capsys, "token", "create", "--write", "app/a", "--token", admin.token, "--json")
    assert made.code == 0, made.err
    new = made.json()
    assert isinstance(new, dict) and new["info"]["tenant"] == "acme"
    monkeypatch.setenv("TORPOR_TOKEN", admin.token)
    listed = cli(capsys, "token", "ls", "--json").json()
    assert isinstance(listed, list) and {t["tenant"] for t in listed} == {"acme"}
