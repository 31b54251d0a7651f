"""Crash safety of the disk tier: SIGKILL at many points during heavy writes, then restart.

After every kill, every block the journal lists must read back checksum-valid (checked on the
files, with the daemon dead), the restarted daemon must serve within a bounded time, and prompts
written in earlier rounds must load byte-exact from disk (never a corrupt block). A clean
shutdown at the end must lose nothing. Slow (a daemon start per round): its own CI stage.
"""

from __future__ import annotations

import random
import signal
import threading
import time

import pytest

from kvdepot import DepotClient, KvLayout
from kvdepot.testing import DaemonProcess, FakeEngine
from kvdepotd.storage.disk_dir import verify
from tests.integration.conftest import attached_engine, close_engine

pytestmark = [pytest.mark.integration, pytest.mark.crash]

# 64 KiB blocks (16 layers x 4 heads x 16 x fp16 x 16 tokens x K,V): heavy enough that kills land mid-I/O.
LAYOUT = KvLayout(num_layers=16, num_kv_heads=4, head_size=16, dtype="float16", block_size=16, kind="vllm_cpu")
KILL_POINTS = [0.01 + 0.045 * k for k in range(22)]  # seconds after the first block reached the disk
START_BOUND_S = 20.0
PROMPT_BLOCKS = 12


def daemon(disk_dir: str) -> tuple[DaemonProcess, float]:
    t0 = time.monotonic()
    d = DaemonProcess(
        args=["--disk-dir", disk_dir, "--disk-gib", "0.5", "--disk-slab-mib", "4", "--host-gib", "0.03",
              "--disk-policy", "write-through", "--disk-admit-after", "1"]
    ).start(timeout_s=START_BOUND_S)
    return d, time.monotonic() - t0


def engine(d: DaemonProcess, strict: bool) -> FakeEngine:
    # A dead daemon releases nothing: held blocks are let go after 3 s.
    return attached_engine(d, LAYOUT, "crash-model", strict=strict, deadline_s=2.0, num_blocks=1024, release_timeout_s=3.0)


def prompt(round_no: int, k: int) -> list[int]:
    rng = random.Random(round_no * 100_003 + k)
    return [rng.randrange(1, 30_000) for _ in range(PROMPT_BLOCKS * 16 + 1)]


close = close_engine


@pytest.mark.timeout(900)
def test_sigkill_during_heavy_writes_never_loses_the_index_or_serves_a_corrupt_block(tmp_path_factory: pytest.TempPathFactory) -> None:
    disk_dir = str(tmp_path_factory.mktemp("crash"))
    written: list[tuple[int, int]] = []  # (round, k) of prompts whose blocks were written before a kill
    reported = 0  # blocks the daemons reported written (the disk is large enough that none is evicted)
    starts: list[float] = []
    for round_no, delay in enumerate(KILL_POINTS):
        d, took = daemon(disk_dir)
        starts.append(took)
        e = engine(d, strict=False)
        c = e.client
        # Prompts of earlier rounds that the disk still lists come back byte-exact.
        for r, k in written[-3:]:
            e.reset_prefix_cache()
            e.generate(prompt(r, k), max_new_tokens=1)
        assert e.stats.kv_mismatched_tokens == 0, f"round {round_no}: a corrupt block was served"
        assert c.stats().counters["disk_checksum_failures"] == 0
        stop = threading.Event()
        done: list[int] = []

        def writer(round_no: int = round_no) -> None:
            k = 0
            while not stop.is_set():
                e.generate(prompt(round_no, k), max_new_tokens=1)
                done.append(k)
                k += 1

        base = c.stats().counters["disk_written_blocks"]
        t = threading.Thread(target=writer)
        t.start()
        end = time.monotonic() + 10
        while c.stats().counters["disk_written_blocks"] == base:  # the writes are under way
            assert time.monotonic() < end, "no block reached the disk"
            time.sleep(0.002)
        time.sleep(delay)
        before = c.stats().counters["disk_written_blocks"] - base
        d.stop(signal.SIGKILL)
        stop.set()
        t.join(30)
        assert not t.is_alive(), "the engine hung after the daemon died"
        close(e)
        if before >= PROMPT_BLOCKS and done:
            written.append((round_no, done[0]))  # its blocks were written (and listed) before the kill
        reported += before
        result = verify(disk_dir)
        assert result["bad"] == 0 and not result["problems"], f"round {round_no} (killed after {delay:.2f} s): {result}"
        assert result["blocks"] >= reported, f"round {round_no}: blocks reported written are missing from the index"
        print(f"round {round_no}: killed {delay:.2f} s into the writes, {before} blocks written, start {took:.2f} s, {result}")
    assert len(written) >= len(KILL_POINTS) // 2, "too few rounds wrote a whole prompt before the kill"

    # After the last kill: recovery, then a clean shutdown that loses nothing.
    d, took = daemon(disk_dir)
    starts.append(took)
    c = DepotClient(d.tcp, strict=True, deadline_s=5.0)
    listed = c.stats().disk_recovered_blocks
    assert listed > 0
    c.close()
    assert d.stop() == 0
    d, took = daemon(disk_dir)
    c = DepotClient(d.tcp, strict=True, deadline_s=5.0)
    s = c.stats()
    assert (s.disk_recovered_blocks, s.disk_recovery_dropped_blocks) == (listed, 0)
    c.close()
    e = engine(d, strict=True)
    for r, k in written:
        e.generate(prompt(r, k), max_new_tokens=1)
    assert e.stats.kv_mismatched_tokens == 0 and e.stats.failed_load_blocks == 0
    assert e.stats.loaded_tokens > 0
    close(e)
    assert d.stop() == 0
    assert "Traceback" not in d.log(), d.log()
    print(f"\nstart-up after a kill: max {max(starts):.2f} s; rounds with writes before the kill: {len(written)}")
