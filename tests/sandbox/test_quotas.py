"""Per-tenant quotas (``<home>/quotas.json``): over one, a typed QuotaExceeded, nothing made."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from tests.sandbox.fakes import FakeEngine
from torpor.config import Quotas, paths
from torpor.errors import InvalidArgument, QuotaExceeded, from_wire
from torpor.sandbox.manager import SandboxManager
from torpor.sandbox.models import SandboxState as S
from torpor.sandbox.storage.volumes import VolumeStore


def _quotas(home: Path, table: dict[str, dict[str, int]]) -> None:
    home.mkdir(parents=True, exist_ok=True)
    (home / "quotas.json").write_text(json.dumps(table))


def test_running_sandboxes_and_their_ram_are_bounded_per_tenant(tmp_path: Path) -> None:
    home = tmp_path / "home"
    _quotas(
        home,
        {
            "*": {"running_sandboxes": 2, "running_memory_mib": 2048},
            "big": {"running_sandboxes": 3},
        },
    )

    async def main() -> None:
        m = SandboxManager(paths(home), engine=FakeEngine())
        try:
            a = await m.create(name="a")
            await m.create(name="b")
            with pytest.raises(QuotaExceeded) as err:
                await m.create(name="c")
            assert err.value.data == {
                "tenant": "default",
                "quota": "running_sandboxes",
                "limit": 2,
                "used": 2,
            }
            assert sorted(i.name for i in await m.list()) == ["a", "b"]  # nothing made
            assert len(list(m.paths.sandboxes.iterdir())) == 2
            await m.pause(a.id)
            await m.create(name="c")  # a paused sandbox holds no RAM: room again
            with pytest.raises(QuotaExceeded):
                await m.run_command(a.id, "echo")  # waking it would be a third
            assert (await m.get(a.id)).state is S.PAUSED  # and it stays as it was
            for name in ("x", "y", "z"):
                await m.create(name=name, tenant="big")  # its own quota, its own count
            with pytest.raises(QuotaExceeded, match="running memory mib"):
                await m.create(name="w", tenant="other", memory_mib=4096)
        finally:
            await m.close(pause=False)

    asyncio.run(main())


def test_volumes_are_bounded_in_number_and_size(tmp_path: Path) -> None:
    home = tmp_path / "home"
    _quotas(home, {"*": {"volumes": 2, "volume_mib": 100}})
    store = VolumeStore(paths(home).ensure())
    store.create("one", size_mib=64)
    with pytest.raises(QuotaExceeded, match="volume mib"):
        store.create("two", size_mib=64)
    store.create("two", size_mib=16)
    with pytest.raises(QuotaExceeded) as err:
        store.create("three", size_mib=16)
    assert err.value.data["quota"] == "volumes"
    assert sorted(v.name for v in store.list()) == ["one", "two"]
    assert len(list(paths(home).volumes.glob("*.img"))) == 2  # no image left behind


def test_quota_errors_cross_the_wire_and_bad_files_are_typed(tmp_path: Path) -> None:
    err = QuotaExceeded("over", tenant="t", quota="snapshots", limit=1, used=1)
    assert err.http_status == 429
    back = from_wire(err.to_wire())
    assert isinstance(back, QuotaExceeded) and back.data["quota"] == "snapshots"
    p = paths(tmp_path / "home")
    assert Quotas.of(p, "anyone") == Quotas()  # no file: the defaults
    _quotas(p.home, {"*": {"snapshots": "many"}})  # type: ignore[dict-item]
    with pytest.raises(InvalidArgument):
        Quotas.of(p, "anyone")


def test_snapshots_are_bounded(tmp_path: Path) -> None:
    from tests.sandbox.storage_helpers import make_home, make_machine
    from torpor.sandbox.storage.snapshots import SnapshotStore, freeze

    p = make_home(tmp_path)
    _quotas(p.home, {"*": {"snapshots": 1}})
    store = SnapshotStore(p)
    m = make_machine(p, "sb1")
    store.save(freeze(m, store.frozen_root), name="one")
    with pytest.raises(QuotaExceeded) as err:
        store.save(freeze(m, store.frozen_root), name="two")
    assert err.value.data["quota"] == "snapshots"
    assert [s.name for s in store.list()] == ["one"]


def test_a_fork_over_quota_is_refused_before_its_source_pauses(tmp_path: Path) -> None:
    from torpor.sandbox.checkpoints import Checkpoints

    home = tmp_path / "home"
    _quotas(home, {"*": {"running_sandboxes": 2}})

    async def main() -> None:
        m = SandboxManager(paths(home), engine=FakeEngine())
        try:
            src = await m.create(name="src")
            with pytest.raises(QuotaExceeded):
                await Checkpoints(m).fork(src.id, count=2)  # 1 running + 2 children > 2
            assert (await m.get(src.id)).state is S.RUNNING  # untouched
            assert [i.id for i in await m.list()] == [src.id]  # no child made
        finally:
            await m.close(pause=False)

    asyncio.run(main())


def test_a_quotas_file_of_another_shape_is_typed(tmp_path: Path) -> None:
    """A quotas.json that is JSON but not the table (a list, a tenant's entry not an object,
    a value too big for a number) is InvalidArgument, never a raw TypeError (HTTP 500 on
    every create)."""
    p = paths(tmp_path / "home")
    p.home.mkdir(parents=True)
    for text in (
        "[]",
        "null",
        '{"*": 5}',
        '{"*": "ab"}',
        '{"t": [1]}',
        '{"*": {"volumes": 1e999}}',
    ):
        (p.home / "quotas.json").write_text(text)
        with pytest.raises(InvalidArgument):
            Quotas.of(p, "t")


def test_concurrent_wakes_of_compacted_sandboxes_keep_to_the_quota(tmp_path: Path) -> None:
    """A wake of a compacted sandbox waits for its RAM's rebuild to begin before it records
    ``waking``; two such wakes at once must not both pass a quota with room for one."""
    home = tmp_path / "home"

    async def main() -> None:
        m = SandboxManager(paths(home), engine=FakeEngine())
        m.compact_after_seconds = 0
        try:
            for name in ("a", "b"):
                await m.create(name=name)
                await m.pause(name)
            done = await m.compact_sweep(now=time.time() + 1, limit=2)
            assert len(done) == 2
            _quotas(home, {"*": {"running_sandboxes": 1}})
            got = await asyncio.gather(m.resume("a"), m.resume("b"), return_exceptions=True)
            assert sorted(type(g).__name__ for g in got) == ["QuotaExceeded", "SandboxInfo"]
            states = sorted(i.state.value for i in await m.list())
            assert states == ["paused", "running"]
        finally:
            await m.close(pause=False)

    asyncio.run(main())


def test_concurrent_snapshots_cannot_pass_the_quota_together(tmp_path: Path) -> None:
    """The snapshot count was checked before the names lock: two snapshots taken at once
    both saw room for one and both were listed."""
    import threading
    import time

    from tests.sandbox.storage_helpers import make_home, make_machine
    from torpor.sandbox.storage import snapshots as snapmod
    from torpor.sandbox.storage.snapshots import SnapshotStore, freeze

    p = make_home(tmp_path)
    _quotas(p.home, {"*": {"snapshots": 1}})
    store = SnapshotStore(p)
    m = make_machine(p, "sb1")
    frozen = [freeze(m, store.frozen_root) for _ in range(2)]
    errors: list[BaseException] = []

    def second() -> None:
        try:
            store.begin(frozen[1], name="two")
        except BaseException as exc:
            errors.append(exc)

    other = threading.Thread(target=second)

    def failpoint(name: str) -> None:
        if name == "capture:linked" and not other.is_alive() and not errors:
            other.start()  # the second one starts while the first one is being listed
            time.sleep(0.5)

    snapmod.failpoint = failpoint
    try:
        store.begin(frozen[0], name="one")
    finally:
        snapmod.failpoint = None
    other.join()
    assert [type(e) for e in errors] == [QuotaExceeded]
    assert [s.name for s in store.list()] == ["one"]


def test_concurrent_volume_creates_cannot_pass_the_quota_together(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The volume count and size were checked before the volumes' lock: a create that came
    while another was making its image saw room for one, and both volumes were made."""
    import subprocess
    import threading

    home = tmp_path / "home"
    _quotas(home, {"*": {"volumes": 1}})
    store = VolumeStore(paths(home).ensure())
    errors: list[BaseException] = []

    def second() -> None:
        try:
            store.create("two", size_mib=16)
        except BaseException as exc:
            errors.append(exc)

    other = threading.Thread(target=second)
    real_run = subprocess.run

    def slow_mkfs(*args: object, **kwargs: object) -> object:
        if not other.is_alive() and not errors and threading.current_thread() is not other:
            other.start()  # the second create comes while the first one makes its image
            other.join(timeout=2)
        return real_run(*args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(subprocess, "run", slow_mkfs)
    store.create("one", size_mib=16)
    monkeypatch.undo()
    other.join()
    assert [type(e) for e in errors] == [QuotaExceeded]
    assert [v.name for v in store.list()] == ["one"]
    assert len(list(paths(home).volumes.glob("*.img"))) == 1
