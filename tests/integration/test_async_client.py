"""AsyncDepotClient against the real daemon: the same protocol and the same degrade-to-miss."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvdepot import AsyncDepotClient, StepBatch
from kvdepot.errors import NotFound
from kvdepot.messages import OpCompleted
from kvdepot.testing import DaemonProcess, free_port
from tests.integration.conftest import LAYOUT

pytestmark = pytest.mark.integration


def test_async_round_trip(daemon: DaemonProcess) -> None:
    async def main() -> None:
        c = AsyncDepotClient(daemon.unix, strict=True, deadline_s=5.0)
        assert await c.register_engine("async-model", LAYOUT, name="async")
        toks = list(range(9000, 9064))
        b = StepBatch()
        b.new("a", toks, [0, 1, 2, 3], computed=0, scheduled=64)
        res = await c.step(b)
        assert [op.kind for op in res.ops] == ["store"]
        done: asyncio.Queue[int] = asyncio.Queue()
        events = c.worker_events(0, done)
        await done.put(res.step)
        ev = await asyncio.wait_for(events.__anext__(), 5)
        assert isinstance(ev, OpCompleted) and ev.success and ev.op_id == res.ops[0].op_id
        await events.aclose()
        hit = await c.lookup("b", toks + [1])
        assert hit.matched_tokens == 64
        assert [b.state for b in (await c.slot("a")).blocks] == ["STORED"] * 4
        with pytest.raises(NotFound):
            await c.slot("nope")
        assert any(e.engine_id == c.engine_id for e in await c.engines())
        await c.unregister()
        await c.close()

    asyncio.run(main())


def test_async_client_degrades_when_daemon_is_down() -> None:
    async def main() -> None:
        c = AsyncDepotClient(f"127.0.0.1:{free_port()}", deadline_s=0.05)
        assert await c.register_engine("m", LAYOUT, keep_trying=True) == ""
        t0 = time.monotonic()
        assert (await c.lookup("r", list(range(64)))).degraded
        assert (await c.step(StepBatch())).degraded
        assert time.monotonic() - t0 < 1.0
        await c.close()

    asyncio.run(main())
