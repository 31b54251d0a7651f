"""FakeEngine drives the real daemon process exactly as an engine would."""

from __future__ import annotations

import signal
import time

import pytest

from kvdepot import DepotClient
from kvdepot.testing import DaemonProcess, FakeEngine
from tests.integration.conftest import LAYOUT

pytestmark = pytest.mark.integration


def engine(daemon: DaemonProcess, **kw: int) -> FakeEngine:
    c = DepotClient(daemon.tcp, strict=True, deadline_s=5.0)
    c.register_engine("fake-model", LAYOUT, name="fake")
    e = FakeEngine(c, block_size=16, **kw)
    assert e.workers[0].attached.wait(5)
    return e


def test_repeated_prompt_after_reset_is_served_by_the_daemon(daemon: DaemonProcess) -> None:
    e = engine(daemon)
    p = list(range(1000, 1200))
    first = e.generate(p, max_new_tokens=4)
    e.reset_prefix_cache()
    computed = e.stats.computed_tokens
    second = e.generate(p, max_new_tokens=4)
    assert second.output == first.output
    assert e.stats.loaded_tokens == 192  # 12 full blocks of 200 (the last token is recomputed)
    assert e.stats.computed_tokens - computed == 200 - 192 + 3
    e.check()
    e.client.close()


def test_mixed_local_and_daemon_hit_stores_nothing_twice(daemon: DaemonProcess) -> None:
    """The engine holds the first 32 tokens itself; the daemon supplies the next 48."""
    e = engine(daemon)
    p = list(range(5000, 5080)) + [1, 2, 3]  # 83 tokens: 5 full blocks
    e.generate(p[:32] + [9] * 20, max_new_tokens=1)  # the engine's own cache now holds p's first 32
    engine(daemon).generate(p, max_new_tokens=1)  # another engine of the same model stores the rest
    planned = e.client.stats().counters["store_blocks_planned"]
    rid = e.add_request(p, max_new_tokens=3)
    e.step()
    assert (e.stats.local_hit_tokens, e.stats.loaded_tokens) == (32 + 0, 48)
    states = [b.state for b in e.client.slot(rid).blocks]
    assert states == ["DEVICE_HIT", "DEVICE_HIT", "LOADED", "LOADED", "LOADED"]
    e.run_until_done()
    assert e.client.stats().counters["store_blocks_planned"] == planned  # nothing stored twice
    e.check()


def test_preemption_under_tiny_kv_space(daemon: DaemonProcess) -> None:
    e = engine(daemon, num_blocks=12, max_batched_tokens=64)
    prompts = [list(range(i * 1000, i * 1000 + 70)) for i in range(1, 4)]
    for p in prompts:
        e.add_request(p, max_new_tokens=40)
    e.run_until_done()
    assert e.stats.preemptions > 0
    assert all(len(r.output) == 40 for r in e.done.values())
    e.check()


def test_abort_while_running(daemon: DaemonProcess) -> None:
    e = engine(daemon, max_batched_tokens=32)
    rid = e.add_request(list(range(300, 400)), max_new_tokens=10)
    e.step()
    e.step()
    e.abort(rid)
    e.run_until_done()
    e.check()
    assert not e.held


def test_daemon_not_running_at_engine_start() -> None:
    from kvdepot.testing import free_port

    c = DepotClient(f"127.0.0.1:{free_port()}", deadline_s=0.05)
    assert c.register_engine("m", LAYOUT, keep_trying=True) == ""
    e = FakeEngine(c)
    t0 = time.monotonic()
    r = e.generate(list(range(100)), max_new_tokens=8)
    assert len(r.output) == 8 and time.monotonic() - t0 < 5
    assert e.stats.loaded_tokens == 0
    e.check()
    c.close()


def test_daemon_killed_mid_run_every_request_completes() -> None:
    d = DaemonProcess().start()
    c = DepotClient(d.tcp, deadline_s=0.2)
    c.register_engine("m", LAYOUT)
    e = FakeEngine(c, max_batched_tokens=64, load_timeout_s=0.5, release_timeout_s=1.0)
    for i in range(6):
        e.add_request(list(range(i * 50, i * 50 + 150)), max_new_tokens=30)
    for _ in range(5):
        e.step()
    d.stop(signal.SIGKILL)
    e.run_until_done()
    assert len(e.done) == 6 and all(len(r.output) == 30 for r in e.done.values())
    assert e.stats.degraded_steps > 0
    e.check()
    # The daemon comes back: the keeper re-registers and the engine gets hits again.
    d2 = DaemonProcess(tcp=d.tcp).start()
    deadline = time.monotonic() + 10
    while c.epoch < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert c.epoch == 2
    p = list(range(7000, 7100))
    first = e.generate(p, max_new_tokens=2)
    e.reset_prefix_cache()
    assert e.generate(p, max_new_tokens=2).output == first.output
    assert e.stats.loaded_tokens == 96
    c.close()
    assert d2.stop() == 0


def test_a_long_lived_engine_counts_each_call_s_steps() -> None:
    """run_until_done(max_steps) bounds the steps of that call: an engine past 10,000 steps in its
    life still runs requests."""
    from kvdepot.testing import free_port

    c = DepotClient(f"127.0.0.1:{free_port()}", deadline_s=0.05)
    e = FakeEngine(c, use_depot=False)
    e.steps = 50_000
    assert len(e.generate(list(range(40)), max_new_tokens=3).output) == 3
    e.add_request(list(range(40)), max_new_tokens=100)
    with pytest.raises(RuntimeError, match="still pending after 5 steps"):
        e.run_until_done(max_steps=5)
    c.close()
