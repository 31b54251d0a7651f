"""Where a daemon hit's time goes on a real vLLM (CPU build): the forward, the forward's waits for
loaded layers, and the daemon's copy, against the same engine's own local hit.

Run in the vLLM venv against the compiled build:
    PYTHONPATH=$(scripts/build-compiled) .venv-vllm/bin/python bench/hit_breakdown.py
Prints one JSON line. One engine with the connector, in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0,
so this script can time the connector's hooks in the worker), the bench model of vllm_ttft.py, a
3500-token prompt new each round. Per round: the local hit (the prompt still in vLLM's prefix
cache), then two daemon hits (after reset_prefix_cache()), one with the forward waiting layer by
layer (layerwise_loads on), one waiting for the whole load in start_load_kv (off), alternating
which goes first. Per hit, medians over --repeat rounds:
    ttft_ms              generate() of one token, end to end
    execute_ms           the worker's execute_model (the longest of the generate's steps): the
                         forward, with the waits for loaded layers inside it, and the hooks around it
    wait_ms              of that, blocked on loads (start_load_kv, wait_for_layer_load)
    first_layer_wait_ms  the wait before layer 0 (before the forward computes anything)
    copy_ms, queued_ms   the daemon's copy of the load (first block to last) and its wait for a copy
                         thread (kvdepot_host_copy_*_seconds, from /metrics)
    outside_ms           ttft_ms - execute_ms: scheduling, the Lookup and Step, sampling, output
A daemon hit computes the prompt's last partial block (vLLM loads whole blocks), a local hit only
its last token: their forwards differ by more than the load.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from typing import Any

# In-process, and vllm_ttft.py's CPU binding: OpenMP on one core, the other kept (for the daemon here).
os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND="auto", VLLM_CPU_NUM_OF_RESERVED_CPU="1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vllm_ttft import engine, prompt, reset, settle, ttft_ms  # noqa: E402  (sets vLLM's environment first)

SIZE = 3500


class Clock:
    """The connector's worker hooks, timed: per forward, its length and the time blocked on loads."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Before a generate(): its longest forward (vLLM may run steps without one) and its waits."""
        self.execute_ms = 0.0
        self.wait_ms = 0.0
        self.first_wait_ms = 0.0

    def install(self, runner: Any) -> None:
        from kvdepot.connector.worker import WorkerSide

        clock = self
        execute, wait_layer, start_loads = runner.execute_model, WorkerSide.wait_for_layer, WorkerSide.start_loads

        def execute_model(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return execute(*a, **kw)
            finally:
                clock.execute_ms = max(clock.execute_ms, (time.perf_counter() - t) * 1000)

        def timed(fn: Any, first: bool) -> Any:
            def run(side: Any, arg: Any) -> None:
                t = time.perf_counter()
                fn(side, arg)
                ms = (time.perf_counter() - t) * 1000
                clock.wait_ms += ms
                if first or arg == 0:
                    clock.first_wait_ms += ms
            return run

        runner.execute_model = execute_model
        WorkerSide.wait_for_layer = timed(wait_layer, False)  # type: ignore[method-assign]
        WorkerSide.start_loads = timed(start_loads, True)  # type: ignore[method-assign]


def copy_seconds(metrics: str) -> tuple[float, float]:
    text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5).read().decode()

    def total(name: str) -> float:
        m = re.search(rf'^{name}_sum{{op="load"}} (\S+)$', text, re.M)
        return float(m.group(1)) if m else 0.0

    return total("kvdepot_host_copy_duration_seconds"), total("kvdepot_host_copy_queued_seconds")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=5, help="rounds (medians); default 5")
    args = ap.parse_args()
    import logging

    logging.disable(logging.WARNING)
    from vllm.config import KVTransferConfig

    from kvdepot.testing import DaemonProcess
    from kvdepot.testing.daemon import free_port
    from kvdepot.testing.tiny_llama import build_tiny_llama

    work = tempfile.mkdtemp(prefix="kvdepot-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    model = build_tiny_llama(os.path.join(work, "model"), layers=8, hidden=512, heads=8, kv_heads=8, head_dim=64, intermediate=1024)
    metrics = f"127.0.0.1:{free_port()}"
    daemon = DaemonProcess(args=["--host-gib", "2", "--metrics-listen", metrics]).start()
    clock = Clock()
    cases = ("local_hit", "layerwise_hit", "whole_hit")
    got: dict[str, dict[str, list[float]]] = {c: {} for c in cases}
    llm = None
    try:
        kv = KVTransferConfig(kv_connector="KvDepotConnector", kv_connector_module_path="kvdepot.vllm", kv_role="kv_both",
                              kv_connector_extra_config={"address": daemon.unix})
        llm = engine(model, "float32", kv_transfer_config=kv)
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        side = get_kv_transfer_group()._worker  # the worker's connector (in this process)
        clock.install(llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner)
        assert side is not None and side.layerwise, "layerwise_loads is off: nothing to compare"
        for v in range(-1, args.repeat):  # round -1 warms every path up
            toks = prompt(SIZE, 500 + v)
            ttft_ms(llm, toks)  # cold: computed, stored
            settle()
            clock.reset()
            t, _ = ttft_ms(llm, toks)
            one(got, "local_hit", t, clock, (0.0, 0.0), v)
            hits = ["layerwise_hit", "whole_hit"]
            for case in hits if v % 2 == 0 else hits[::-1]:
                reset(llm)
                settle()
                side.layerwise = case == "layerwise_hit"
                before = copy_seconds(metrics)
                clock.reset()
                t, _ = ttft_ms(llm, toks)
                after = copy_seconds(metrics)
                one(got, case, t, clock, (after[0] - before[0], after[1] - before[1]), v)
            side.layerwise = True
            reset(llm)
    finally:
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        daemon.stop()
    out: dict[str, Any] = {"bench": "hit_breakdown", "prompt_tokens": SIZE, "repeat": args.repeat}
    for case, figures in got.items():
        out[case] = {k: round(statistics.median(xs), 2) for k, xs in figures.items()}
    out["runs"] = {case: {k: [round(x, 1) for x in xs] for k, xs in figures.items()} for case, figures in got.items()}
    print(json.dumps(out))


def one(got: dict[str, dict[str, list[float]]], case: str, ttft: float, clock: Clock, copy: tuple[float, float], round_: int) -> None:
    if round_ < 0:
        return
    row = {
        "ttft_ms": ttft, "execute_ms": clock.execute_ms, "wait_ms": clock.wait_ms, "first_layer_wait_ms": clock.first_wait_ms,
        "copy_ms": copy[0] * 1000, "queued_ms": copy[1] * 1000, "outside_ms": ttft - clock.execute_ms,
    }
    for k, x in row.items():
        got[case].setdefault(k, []).append(x)


if __name__ == "__main__":
    main()
