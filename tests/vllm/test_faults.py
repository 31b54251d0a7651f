"""The connector when things go wrong, and in vLLM's other modes: async loads, preemption under a
tiny KV space, no daemon at start, the daemon killed during a load, a corrupted block. In every
case vLLM's greedy output equals the run without the connector and nothing raises."""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any

import pytest
from vllm import LLM

from kvdepot import DepotClient
from kvdepot.errors import Unavailable
from kvdepot.testing import DaemonProcess
from kvdepot.testing.daemon import free_port
from tests.vllm.engine import LONG, LONG_TOKENS, P, Q, connector_of, engine_args, generate, kv_config, reset

pytestmark = pytest.mark.vllm


def counters(address: str) -> dict[str, int]:
    with DepotClient(address, strict=True, deadline_s=5.0) as c:
        return dict(c.stats().counters)


def wait_registered(address: str, timeout_s: float = 20.0) -> None:
    """Until the connector's scheduler registered with the daemon at `address` and its worker
    handed over its KV caches (after a start or a restart of the daemon)."""
    end = time.monotonic() + timeout_s
    while True:
        try:  # the process's gRPC connection to the address may still be backing off from the restart
            with DepotClient(address, strict=True, deadline_s=5.0) as c:
                s = c.stats()
            if s.engines >= 1 and s.mapped_ranks >= 1:
                return
        except Unavailable:
            pass
        assert time.monotonic() < end, "the connector did not register with the daemon"
        time.sleep(0.1)


def make(fresh_llm: list, model_dir: str, address: str, **kw: Any) -> LLM:  # type: ignore[type-arg]
    extra = kw.pop("extra", {})
    llm = LLM(**engine_args(model_dir, kv_transfer_config=kv_config(address, **extra), **kw))
    fresh_llm.append(llm)
    return llm


def test_async_loads(fresh_llm: list, model_dir: str, expected: dict[str, list[int]]) -> None:  # type: ignore[type-arg]
    with DaemonProcess(args=["--host-gib", "0.25"]) as d:
        llm = make(fresh_llm, model_dir, d.tcp, extra={"load_async": True})
        assert generate(llm, [P])[0] == (expected["P"], 0)
        reset(llm)
        assert generate(llm, [P])[0] == (expected["P"], 96)  # loaded while parked in WAITING_FOR_REMOTE_KVS
        reset(llm)
        assert generate(llm, [Q])[0][0] == expected["Q"]
        assert generate(llm, [P])[0] == (expected["P"], 96)  # mixed: local 64, async external 32
        assert connector_of(llm)._sched.admissions[-1][1:] == (64, 32, 96)
        c = counters(d.tcp)
        assert c["loaded_blocks"] == 3 + 2 + 1 and c["load_failed_blocks"] == 0


def test_preemption_under_a_tiny_kv_space(fresh_llm: list, model_dir: str, expected: dict[str, list[int]]) -> None:  # type: ignore[type-arg]
    with DaemonProcess(args=["--host-gib", "0.25"]) as d:
        llm = make(fresh_llm, model_dir, d.tcp, num_gpu_blocks_override=20)
        outs = generate(llm, LONG, LONG_TOKENS)
        assert [o for o, _ in outs] == [expected[f"L{i}"] for i in range(len(LONG))]
        c = counters(d.tcp)
        assert c["preemptions"] > 0  # vLLM preempted, the daemon was told
        # (a store the preemption overtook is cancelled, not failed: the Step can outrun the forward-done)
        assert c["load_failed_blocks"] == 0 and c["store_failed_blocks"] == 0
        reset(llm)
        outs = generate(llm, LONG, LONG_TOKENS)
        assert [o for o, _ in outs] == [expected[f"L{i}"] for i in range(len(LONG))]


def test_no_daemon_at_start_then_it_comes(fresh_llm: list, model_dir: str, expected: dict[str, list[int]], caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[type-arg]
    address = f"127.0.0.1:{free_port()}"
    llm = make(fresh_llm, model_dir, address)
    for _ in range(2):
        assert generate(llm, [P])[0][0] == expected["P"]
        reset(llm)
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
    with DaemonProcess(tcp=address) as d:
        deadline = time.monotonic() + 10
        while not connector_of(llm)._sched.client.engine_id and time.monotonic() < deadline:
            time.sleep(0.05)
        assert connector_of(llm)._sched.client.engine_id  # the keeper registered in the background
        # The worker registers its KV caches and attaches on its own link, after its own back-off:
        # until it has, the stores of the next request wait for it (and vLLM keeps their blocks).
        wait_registered(d.tcp)
        assert generate(llm, [P])[0] == (expected["P"], 0)
        reset(llm)
        assert generate(llm, [P])[0] == (expected["P"], 96)


def test_daemon_killed_during_a_load(fresh_llm: list, model_dir: str, expected: dict[str, list[int]], caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[type-arg]
    caplog.set_level(logging.INFO, logger="kvdepot.vllm")
    d = DaemonProcess(args=["--host-gib", "0.25", "--fault-load-delay-ms", "3000"]).start()
    llm = make(fresh_llm, model_dir, d.tcp)
    assert generate(llm, [P])[0][0] == expected["P"]
    reset(llm)
    result: list[Any] = []
    t = threading.Thread(target=lambda: result.append(generate(llm, [P])[0]))
    t.start()
    time.sleep(1.0)  # the load is sleeping in the daemon's copy thread
    assert t.is_alive()
    d.stop(signal.SIGKILL)
    t.join(30)
    assert not t.is_alive()
    out, cached = result[0]
    assert out == expected["P"]  # the failed load was recomputed
    assert "3 of 3 blocks not loaded; vLLM recomputes them" in caplog.text
    # The engine keeps serving without a daemon.
    assert generate(llm, [Q])[0][0] == expected["Q"]


def test_a_forward_that_waits_for_no_layer_reads_no_half_loaded_block(
    fresh_llm: list, model_dir: str, expected: dict[str, list[int]], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,  # type: ignore[type-arg]
) -> None:
    """With layerwise_loads (the default) start_load_kv does not wait: each attention layer waits
    for its own layer of the step's loads. A forward that skips those waits (here all of them)
    would read blocks the daemon is still loading (each load is held 500 ms): its loads count as
    failed, vLLM recomputes them and its output is right; the worker says so and waits for whole
    loads from then on, so the next hit is served from the daemon again."""
    from kvdepot.vllm.worker import VllmWorkerSide

    caplog.set_level(logging.INFO, logger="kvdepot.vllm")
    monkeypatch.setattr(VllmWorkerSide, "wait_for_layer_load", lambda self, name: None)
    with DaemonProcess(args=["--host-gib", "0.25", "--fault-load-delay-ms", "500"]) as d:
        llm = make(fresh_llm, model_dir, d.unix)
        assert generate(llm, [P])[0] == (expected["P"], 0)
        reset(llm)
        assert generate(llm, [P])[0][0] == expected["P"]
        assert "the forward did not wait for layers [0, 1" in caplog.text
        reset(llm)
        assert generate(llm, [P])[0] == (expected["P"], 96)


@pytest.mark.parametrize("late", ["false", "true"])
def test_corrupted_block_is_caught_and_recomputed(fresh_llm: list, model_dir: str, expected: dict[str, list[int]], late: str) -> None:  # type: ignore[type-arg]
    """late: the forward runs on the corrupt block before its check fails; vLLM drops that output."""
    with DaemonProcess(args=["--host-gib", "0.25", "--fault-corrupt-loads", "1"]) as d:
        llm = make(fresh_llm, model_dir, d.tcp, extra={"late_load_checks": late})
        assert generate(llm, [P])[0][0] == expected["P"]
        reset(llm)
        assert generate(llm, [P])[0][0] == expected["P"]
        c = counters(d.tcp)
        assert c["checksum_failures"] == 1 and c["load_failed_blocks"] == 1
        # The bad block was dropped and stored again from the recompute: the next hit is whole.
        reset(llm)
        assert generate(llm, [P])[0] == (expected["P"], 96)
