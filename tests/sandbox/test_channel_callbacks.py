"""The channel's stream callbacks: an async callback's task is held until it ends, and its
failure is logged, never lost (ruff RUF006)."""

from __future__ import annotations

import asyncio
import gc
import logging

import pytest

from torpor.sandbox.vm.channel import _Pending


def test_an_async_callback_is_held_and_its_failure_logged(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[str] = []

    async def callback(text: str) -> None:
        await asyncio.sleep(0.01)
        seen.append(text)
        raise RuntimeError("callback broke")

    async def main() -> _Pending:
        loop = asyncio.get_running_loop()
        pending = _Pending(op="exec", future=loop.create_future(), last_activity=0.0)
        pending.callbacks["stdout"] = callback
        pending.on_output("stdout", b"hello")
        assert len(pending.tasks) == 1  # held by the pending op, not only by the loop
        gc.collect()
        await asyncio.gather(*pending.tasks, return_exceptions=True)
        await asyncio.sleep(0)
        return pending

    with caplog.at_level(logging.ERROR, logger="torpor.sandbox.vm.channel"):
        pending = asyncio.run(main())
    assert seen == ["hello"]
    assert not pending.tasks  # released once done
    assert any("output callback failed" in r.getMessage() for r in caplog.records)
