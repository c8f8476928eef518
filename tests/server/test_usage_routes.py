"""Usage and retention over HTTP, on the real SandboxManager and snapshot store (fake engine:
no VMs), and through the CLI against a served app: what each route meters and changes, tenant
isolation, typed errors for bad input, and GC honouring a retention changed after the fact."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.sandbox.fakes import FakeEngine
from tests.sandbox.storage_helpers import make_home, make_machine
from torpor.config import paths
from torpor.sandbox.checkpoints import Checkpoints
from torpor.sandbox.manager import SandboxManager
from torpor.sandbox.models import SandboxState
from torpor.sandbox.registry.usage import UsageReport
from torpor.sandbox.storage.snapshots import SnapshotStore, freeze
from torpor.server.app import create_app
from torpor.server.auth import TokenStore

A = {"Authorization": "Bearer " + "a" * 32}
B = {"Authorization": "Bearer " + "b" * 32}


@pytest.fixture
def manager(tmp_path: Path) -> SandboxManager:
    return SandboxManager(paths(tmp_path / "home"), engine=FakeEngine())


@pytest.fixture
def client(manager: SandboxManager) -> Iterator[TestClient]:
    tokens = TokenStore({"a" * 32: "acme", "b" * 32: "globex"})
    with TestClient(create_app(manager, tokens=tokens, supervise=False)) as c:
        yield c


def _since() -> str:
    return (datetime.now(UTC) - timedelta(hours=1)).isoformat()


def test_usage_meters_a_pause_cycle(client: TestClient, manager: SandboxManager) -> None:
    body = {"labels": {"user": "u-42"}, "vcpus": 2, "memory_mib": 1024}
    sid = client.put("/v1/sandboxes/by-name/agent-u-42", json=body, headers=A).json()["id"]
    client.post("/v1/sandboxes", json={"name": "other", "labels": {"user": "u-7"}}, headers=A)
    client.post("/v1/sandboxes", json={"name": "theirs"}, headers=B)
    time.sleep(0.2)
    assert client.post(f"/v1/sandboxes/{sid}/pause", headers=A).json()["state"] == "paused"
    r = client.get("/v1/usage", params={"by": "label:user", "since": _since()}, headers=A)
    assert r.status_code == 200, r.text
    report = UsageReport.model_validate(r.json())
    assert report.tenant == "acme" and report.by == "label:user"
    lines = {line.key: line for line in report.lines}
    assert set(lines) == {"u-42", "u-7"}  # globex's sandbox is not in acme's report
    mine = lines["u-42"]
    assert mine.sandboxes == 1 and mine.vcpu_hours > 0
    # the fake engine has no QEMU process to read: used CPU counts as allocated
    assert mine.cpu_hours == pytest.approx(mine.vcpu_hours)
    assert mine.ram_gib_hours == pytest.approx(mine.vcpu_hours / 2, rel=1e-6)  # 1 GiB vs 2 vCPU
    assert mine.cost.total > 0
    owned = manager.owned_bytes(sid)
    assert owned > 0  # the fake machine's files in the sandbox dir
    (kept,) = report.retention
    assert kept.id == sid and kept.bytes == owned and kept.retention_days == 30
    assert report.total.cost.total == pytest.approx(sum(x.cost.total for x in report.lines))


@pytest.mark.parametrize(
    "params",
    [
        pytest.param({"by": "user"}, id="bad-by"),
        pytest.param({"by": "label:"}, id="empty-label"),
        pytest.param({"since": "2999-01-01"}, id="future-since"),
        pytest.param({"since": "2026-11-20", "until": "2026-11-10"}, id="reversed"),
        pytest.param({"since": "yesterday"}, id="unparsable"),
        pytest.param({"by": "x" * 400}, id="too-long"),
    ],
)
def test_bad_usage_queries_are_typed_errors(client: TestClient, params: dict[str, str]) -> None:
    r = client.get("/v1/usage", params=params, headers=A)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "InvalidArgument"


def test_sandbox_retention_after_the_fact(client: TestClient) -> None:
    sid = client.post("/v1/sandboxes", json={"name": "keep-me"}, headers=A).json()["id"]
    running = client.post(f"/v1/sandboxes/{sid}/retention", json={"days": 90}, headers=A)
    assert running.status_code == 200, running.text
    assert running.json()["pause_retention_days"] == 90 and running.json()["expires_at"] is None
    paused = client.post(f"/v1/sandboxes/{sid}/pause", headers=A).json()
    at = datetime.fromisoformat(paused["paused_at"])
    assert datetime.fromisoformat(paused["expires_at"]) - at == timedelta(days=90)
    shorter = client.post("/v1/sandboxes/keep-me/retention", json={"days": 2}, headers=A).json()
    assert datetime.fromisoformat(shorter["expires_at"]) - at == timedelta(days=2)
    assert shorter["state"] == "paused"  # changing retention does not wake it
    for bad in (0, 366, "ten", None, 1.5):
        r = client.post(f"/v1/sandboxes/{sid}/retention", json={"days": bad}, headers=A)
        assert r.status_code == 400 and r.json()["error"]["type"] == "InvalidArgument", bad
    r = client.post(f"/v1/sandboxes/{sid}/retention", json={"days": 5, "extra": 1}, headers=A)
    assert r.status_code == 400
    # another tenant cannot see or change it
    r = client.post(f"/v1/sandboxes/{sid}/retention", json={"days": 365}, headers=B)
    assert r.status_code == 404 and r.json()["error"]["type"] == "SandboxNotFound"
    assert client.get(f"/v1/sandboxes/{sid}", headers=A).json()["pause_retention_days"] == 2
    client.delete(f"/v1/sandboxes/{sid}", headers=A)
    r = client.post(f"/v1/sandboxes/{sid}/retention", json={"days": 5}, headers=A)
    assert r.status_code == 409 and r.json()["error"]["type"] == "SandboxClosed"


def test_gc_honours_a_changed_pause_retention(tmp_path: Path) -> None:
    async def main() -> None:
        m = SandboxManager(paths(tmp_path / "home"), engine=FakeEngine())
        cp = Checkpoints(m)
        longer = await m.create(name="longer", pause_retention_days=1)
        shorter = await m.create(name="shorter", pause_retention_days=30)
        for s in (longer, shorter):
            await m.pause(s.id)
        await m.set_retention("longer", 60)
        await m.set_retention(shorter.id, 1)
        report = await cp.collect_garbage(now=time.time() + 2 * 86400)
        assert report.expired_sandboxes == [shorter.id]
        assert (await m.get(longer.id)).state is SandboxState.PAUSED
        report = await cp.collect_garbage(now=time.time() + 61 * 86400)
        assert report.expired_sandboxes == [longer.id]
        await m.close()

    asyncio.run(main())


def test_snapshot_retention_after_the_fact_and_gc(tmp_path: Path) -> None:
    from torpor.errors import InvalidArgument, SnapshotNotFound
    from torpor.sandbox.storage.retention import collect_garbage

    p = make_home(tmp_path)
    store = SnapshotStore(p)
    snap = store.save(freeze(make_machine(p, "sb1"), store.frozen_root), name="s", tenant="t")
    assert snap.retention_days == 7
    longer = store.set_retention("s", 100, tenant="t")
    assert longer.expires_at - longer.created_at == timedelta(days=100)
    assert store.get(snap.id, tenant="t").retention_days == 100  # the manifest still checks
    in_30_days = datetime.now(UTC) + timedelta(days=30)
    assert collect_garbage(p, now=in_30_days).expired_snapshots == []  # 7 days would have gone
    with pytest.raises(InvalidArgument):
        store.set_retention("s", 0, tenant="t")
    with pytest.raises(SnapshotNotFound):
        store.set_retention("s", 5, tenant="other")
    store.set_retention("s", 1, tenant="t")
    assert collect_garbage(p, now=in_30_days).expired_snapshots == [snap.id]


def test_snapshot_retention_route(client: TestClient, manager: SandboxManager) -> None:
    sid = client.post("/v1/sandboxes", json={"name": "snappy"}, headers=A).json()["id"]
    r = client.post(
        f"/v1/sandboxes/{sid}/snapshots", json={"name": "before", "wait": True}, headers=A
    )
    assert r.status_code == 201, r.text
    r = client.post("/v1/snapshots/before/retention", json={"days": 45}, headers=A)
    assert r.status_code == 200, r.text
    assert r.json()["retention_days"] == 45
    assert (
        client.post("/v1/snapshots/before/retention", json={"days": 45}, headers=B).status_code
        == 404
    )
    report = client.get("/v1/usage", params={"since": _since()}, headers=A).json()
    kinds = {item["kind"] for item in report["retention"]}
    assert "snapshot" in kinds
    assert report["total"]["snapshots"] == 1


def test_cli_usage_json_and_csv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``torpor usage`` against a served home: the table, --json and --csv agree."""
    from typer.testing import CliRunner

    from tests.client.conftest import _run
    from torpor.cli import _load, app
    from torpor.client import Snapshot
    from torpor.client.runtime import Runtime, set_default_runtime
    from torpor.server.daemon import bind_unix_socket

    home = tmp_path / "h"
    home.mkdir()
    manager = SandboxManager(paths(home), engine=FakeEngine())
    sock = bind_unix_socket(home / "server.sock")
    _load()
    for _ in _run(create_app(manager, supervise=False), sock):
        rt = Runtime(home=home, autostart=False)
        set_default_runtime(rt)
        try:
            runner = CliRunner()
            assert (
                runner.invoke(app, ["sandbox", "create", "agent-u-1", "-l", "user=u-1"]).exit_code
                == 0
            )
            assert runner.invoke(app, ["sandbox", "pause", "agent-u-1"]).exit_code == 0
            out = runner.invoke(app, ["sandbox", "retention", "agent-u-1", "90"])
            assert out.exit_code == 0, out.output
            assert "90 days" in out.output
            bad = runner.invoke(app, ["sandbox", "retention", "agent-u-1", "400"])
            assert bad.exit_code != 0
            snap = runner.invoke(app, ["snapshot", "create", "agent-u-1", "--name", "s1"])
            assert snap.exit_code == 0, snap.output
            deadline = time.monotonic() + 30  # usage bills a snapshot once it is stored
            while Snapshot.get("s1", runtime=rt).info.status != "stored":
                assert time.monotonic() < deadline, "the snapshot was never stored"
                time.sleep(0.05)
            kept = runner.invoke(app, ["snapshot", "retention", "s1", "20"])
            assert kept.exit_code == 0 and "20 days" in kept.output, kept.output
            assert Snapshot.get("s1", runtime=rt).info.retention_days == 20
            since = _since()
            as_json = runner.invoke(
                app, ["usage", "--by", "label:user", "--since", since, "--json"]
            )
            assert as_json.exit_code == 0, as_json.output
            report = json.loads(as_json.output)
            assert [line["key"] for line in report["lines"]] == ["u-1"]
            days = {item["kind"]: item["retention_days"] for item in report["retention"]}
            assert days == {"sandbox": 90, "snapshot": 20}
            as_csv = runner.invoke(app, ["usage", "--by", "label:user", "--since", since, "--csv"])
            rows = list(csv.DictReader(io.StringIO(as_csv.output)))
            assert [r["key"] for r in rows] == ["u-1", "total"]
            assert float(rows[0]["vcpu_hours"]) == pytest.approx(report["lines"][0]["vcpu_hours"])
            table = runner.invoke(app, ["usage", "--by", "label:user", "--since", since])
            assert table.exit_code == 0 and "u-1" in table.output and "TOTAL" in table.output
            wrong = runner.invoke(app, ["usage", "--by", "person"])
            assert wrong.exit_code != 0
            assert rt.usage(by="sandbox", since=since).lines[0].name == "agent-u-1"
        finally:
            set_default_runtime(None)
            rt.close()


def test_a_deleted_volume_stops_costing(client: TestClient, manager: SandboxManager) -> None:
    r = client.post("/v1/volumes", json={"name": "vol-a", "size_mib": 64}, headers=A)
    assert r.status_code == 201, r.text
    vid = r.json()["id"]
    report = client.get("/v1/usage", params={"since": _since()}, headers=A).json()
    assert report["total"]["volumes"] == 1 and report["total"]["volume_gib_hours"] > 0
    assert client.delete(f"/v1/volumes/{vid}", headers=A).status_code == 204
    asyncio.run(Checkpoints(manager).collect_garbage())  # the periodic GC pass ends it
    (row,) = manager.registry.stored(kind="volume")
    assert row["id"] == vid and row["ended_at"] is not None
    ended = row["ended_at"]
    time.sleep(0.1)
    later = client.get("/v1/usage", params={"since": _since()}, headers=A).json()
    hours = later["total"]["volume_gib_hours"]
    assert hours == pytest.approx(64 / 1024 * (ended - row["started_at"]) / 3600)
