"""The remote tier under a real vLLM: two nodes' daemons share a real 3-primary Valkey cluster; a
prompt a vLLM engine computed on node A is served from the store to a fresh vLLM engine on node B,
with the same tokens as vLLM without kvdepot."""

from __future__ import annotations

import time

import pytest

from kvdepot.testing import DaemonProcess
from kvdepot.testing.valkey import ValkeyCluster, remote_args
from tests.vllm.engine import P, Q, generate
from tests.vllm.test_faults import counters, make

pytestmark = pytest.mark.vllm


def wait_counter(address: str, name: str, at_least: int, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while counters(address)[name] < at_least:
        assert time.monotonic() < end, f"{name} never reached {at_least}"
        time.sleep(0.05)


def test_a_prompt_computed_on_node_a_is_served_on_node_b_from_the_store(
    fresh_llm: list, model_dir: str, expected: dict[str, list[int]]  # type: ignore[type-arg]
) -> None:
    with ValkeyCluster(primaries=3) as vc:
        args = ["--host-gib", "0.25", *remote_args(vc.url), "--disk-admit-after", "1"]
        with DaemonProcess(args=args) as a, DaemonProcess(args=args) as b:
            on_a = make(fresh_llm, model_dir, a.tcp)
            assert generate(on_a, [P])[0] == (expected["P"], 0)
            wait_counter(a.tcp, "remote_written_blocks", 3)
            on_a.llm_engine.engine_core.shutdown()
            fresh_llm.remove(on_a)

            on_b = make(fresh_llm, model_dir, b.tcp)
            assert generate(on_b, [P])[0] == (expected["P"], 96)  # all 3 blocks from the store, same output
            c = counters(b.tcp)
            assert c["lookup_remote_hit_tokens"] == 96 and c["remote_read_blocks"] == 3
            assert c["load_failed_blocks"] == 0 and c["remote_checksum_failures"] == 0
            assert generate(on_b, [Q])[0] == (expected["Q"], 64)  # vLLM's own prefix cache now
            assert counters(b.tcp)["remote_written_blocks"] == 0  # b writes back nothing the store holds
            assert len(vc.keys("kvdepot:*")) == 3
        for d in (a, b):
            assert "Traceback" not in d.log(), d.log()
