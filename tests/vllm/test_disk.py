"""The disk tier under a real vLLM: a prompt stored before the daemon restarts is a hit after it."""

from __future__ import annotations

import time

import pytest

from kvdepot.testing import DaemonProcess
from kvdepot.testing.daemon import free_port
from tests.vllm.engine import P, generate, reset
from tests.vllm.test_faults import counters, make, wait_registered

pytestmark = pytest.mark.vllm


def test_prompt_stored_before_a_daemon_restart_is_a_hit_after_it(
    fresh_llm: list, model_dir: str, expected: dict[str, list[int]], tmp_path_factory: pytest.TempPathFactory  # type: ignore[type-arg]
) -> None:
    address = f"127.0.0.1:{free_port()}"
    disk = str(tmp_path_factory.mktemp("disk-tier"))
    args = ["--host-gib", "0.25", "--disk-dir", disk, "--disk-gib", "0.5", "--disk-admit-after", "1"]
    d = DaemonProcess(tcp=address, args=args).start()
    llm = make(fresh_llm, model_dir, address)
    assert generate(llm, [P])[0] == (expected["P"], 0)
    time.sleep(0.5)  # the stores end on the worker stream
    assert d.stop() == 0  # a clean shutdown: write-back writes the host tier's blocks to disk
    assert "Traceback" not in d.log(), d.log()
    d = DaemonProcess(tcp=address, args=args).start()
    try:
        assert "recovered 3 blocks" in d.log()
        wait_registered(address)
        reset(llm)
        assert generate(llm, [P])[0] == (expected["P"], 96)  # served from disk, same output
        c = counters(address)
        assert c["lookup_disk_hit_tokens"] == 96 and c["disk_read_blocks"] == 3 and c["load_failed_blocks"] == 0
    finally:
        assert d.stop() == 0
    assert "Traceback" not in d.log(), d.log()
