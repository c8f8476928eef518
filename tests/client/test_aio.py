"""The async client (``torpor.AsyncRuntime``): the memory API as coroutines, the same calls and
the same typed errors as the sync client, through a real server on a unix socket."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Iterator
from pathlib import Path

import pytest

import torpor
from tests.memory.conftest import Api
from torpor.errors import AccessDenied, InvalidArgument, PayloadTooLarge, RecordNotFound
from torpor.memory import Context, Fact, Hit


@pytest.fixture
def api() -> Iterator[Api]:
    a = Api("remote", "sqlite", None)
    yield a
    a.close()


def test_async_memory_round_trip(api: Api, tmp_path: Path) -> None:
    async def main() -> None:
        async with torpor.AsyncRuntime(home=api.home, autostart=False) as rt:
            assert (await rt.health())["tenant"] == "default"
            u = await rt.memory.scope(app="support", user="u-42")
            f = await u.remember("prefers weekly summaries", key="summary_cadence")
            assert isinstance(f, Fact) and f.scope == "app/support/user/u-42"
            await u.remember("prefers daily summaries", key="summary_cadence")
            await u.log("user", "can you send summaries?", session="s1")
            await u.remember_many([f"note {i}" for i in range(50)])
            await u.log_many([{"role": "user", "text": f"turn {i}"} for i in range(5)])
            hits = await u.recall("how often summaries", k=3, kind="fact")
            assert [h.text for h in hits] == ["prefers daily summaries"]
            assert all(isinstance(h, Hit) for h in hits)
            ctx = await u.context("write Jordan an update", budget_tokens=200)
            assert isinstance(ctx, Context) and ctx.tokens <= 200
            assert [x.text for x in await u.history("summary_cadence")] == [
                "prefers weekly summaries",
                "prefers daily summaries",
            ]
            assert (await u.get(f.id)).text == "prefers weekly summaries"
            page = await u.get_all(kind="fact", page_size=10)
            assert page.total == 51 and len(page.items) == 10 and page.has_more
            v = await rt.memory.scope(app="support", user="v")
            old = await v.remember("plan basic", key="plan")
            newer = await v.update(old.id, "plan pro")
            assert newer.key == "plan" and [f.text for f in await v.history("plan")] == [
                "plan basic",
                "plan pro",
            ]
            assert await v.delete_all() == 2
            await u.set_profile({"plan": "pro"})
            assert await u.get_profile() == {"plan": "pro"}
            assert (await u.set_policy(cache_ttl_seconds=60)).cache_ttl_seconds == 60
            path = tmp_path / "u.jsonl"
            n = await u.export(path)
            assert n == len(path.read_text().splitlines()) >= 58
            w = await rt.memory.scope(app="support", user="w")
            assert await w.import_(path) == 58
            buf = io.StringIO()
            assert await w.export(buf) == n
            x = await u.fork(app="support", user="x")
            assert [h.text for h in await x.recall("daily", k=5)] == ["prefers daily summaries"]
            # many requests at once on one connection pool
            many = await asyncio.gather(*(u.recall(f"note {i}", k=1) for i in range(20)))
            assert all(len(h) == 1 for h in many)
            # the same typed errors
            with pytest.raises(InvalidArgument):
                await u.remember("")
            with pytest.raises(PayloadTooLarge):
                await u.remember("x" * 40_000)
            with pytest.raises(RecordNotFound):
                await u.history("never")
            with pytest.raises(InvalidArgument):
                await rt.memory.scope(app="bad name!")
            assert await rt.memory.forget(f.id) == 1
            assert await rt.memory.forget(x) >= 1
            assert await rt.memory.gc() >= 0
            assert any(e.action == "forget.scope" for e in await rt.memory.audit_log())
        # the sync client sees what the async one wrote
        sync = api.runtime.memory.scope(app="support", user="u-42")
        assert [h.text for h in sync.recall("summaries", kind="fact")] == [
            "prefers daily summaries"
        ]

    asyncio.run(main())


def test_async_token_grants(api: Api) -> None:
    token = api.runtime.tokens.create(grants=[("write", "app/a/user/u")]).token

    async def main() -> None:
        async with torpor.AsyncRuntime(home=api.home, token=token, autostart=False) as rt:
            u = await rt.memory.scope(app="a", user="u")
            await u.remember("mine")
            with pytest.raises(AccessDenied):
                await rt.memory.scope(app="a", user="v")
            with pytest.raises(AccessDenied):
                await rt.memory.scope()

    asyncio.run(main())


def test_a_failed_async_export_leaves_an_existing_file_as_it_was(api: Api, tmp_path: Path) -> None:
    """The async export opened the file for writing before the first line came, so one that
    failed (here: its token revoked) left an existing backup empty; the sync one did not."""
    new = api.runtime.tokens.create(grants=[("write", "app/a/user/u")])

    async def main() -> None:
        async with torpor.AsyncRuntime(home=api.home, token=new.token, autostart=False) as rt:
            u = await rt.memory.scope(app="a", user="u")
            await u.remember("u's plan")
            backup = tmp_path / "u.jsonl"
            assert await u.export(backup) == 2
            before = backup.read_text()
            api.runtime.tokens.revoke(new.info.id)
            with pytest.raises(AccessDenied):
                await u.export(backup)
            assert backup.read_text() == before
            assert [p.name for p in tmp_path.iterdir()] == ["u.jsonl"]  # no temporary file

    asyncio.run(main())
