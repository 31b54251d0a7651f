"""What the daemon holds of an engine once the engine is gone: nothing. Checked in the daemon's
own memory maps and descriptor table (/proc/PID/maps, /proc/PID/fd), not in its counters."""

from __future__ import annotations

import os
import time

import pytest

from kvdepot import KvLayout
from kvdepot.testing import DaemonProcess
from tests.integration.conftest import attached_engine, close_engine

pytestmark = pytest.mark.integration

LAYOUT = KvLayout(num_layers=4, num_kv_heads=2, head_size=8, dtype="float16", block_size=16, kind="vllm_cpu")
PROMPT = list(range(7000, 7000 + 12 * 16 + 1))
ENGINE_MEMORY = "memfd:kvdepot-kv"  # the name kvdepot.handles gives an engine's KV memory


def held(pid: int) -> list[str]:
    """The daemon's mappings of, and descriptors on, engines' KV memory."""
    with open(f"/proc/{pid}/maps") as f:
        maps = [line.strip() for line in f if ENGINE_MEMORY in line]
    fds = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if ENGINE_MEMORY in target:
            fds.append(f"fd {fd} -> {target}")
    return maps + fds


def wait_released(pid: int, timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while (left := held(pid)) and time.monotonic() < end:
        time.sleep(0.05)
    assert not left, f"the daemon still holds a gone engine's memory {timeout_s} s later:\n" + "\n".join(left)


@pytest.mark.parametrize("how", ["unregistered", "lease expired"])
def test_a_gone_engines_memory_is_neither_mapped_nor_open_in_the_daemon(how: str) -> None:
    d = DaemonProcess(args=["--host-gib", "0.25", "--lease-ms", "1000"]).start()
    try:
        e = attached_engine(d, LAYOUT, "leak-model", address=d.unix, max_batched_tokens=64)
        first = e.generate(PROMPT, max_new_tokens=2).output  # stores, in several steps
        e.reset_prefix_cache()
        assert e.generate(PROMPT, max_new_tokens=2).output == first and e.stats.loaded_tokens == 12 * 16  # loads
        assert e.stats.kv_mismatched_tokens == 0
        assert held(d.proc.pid), "the check sees nothing while the engine is registered: it would prove nothing"
        if how == "unregistered":
            close_engine(e)
        else:
            e.client._closed.set()  # the engine process froze: its keeper sends no more heartbeats...
            for w in e.workers:  # ...and its worker streams are gone
                w.close()
        wait_released(d.proc.pid)
        if how != "unregistered":
            close_engine(e)
    finally:
        assert d.stop() == 0, d.log()
