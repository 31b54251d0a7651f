"""What the TensorRT-LLM connector costs the engine per step: its scheduler side's
build_connector_meta for a batch of decoding requests, as TensorRT-LLM calls it every iteration
(a real daemon process over loopback; the requests' admission and prefill are not timed).

Prints one JSON line:
  decode{N}_p50_ms / _p99_ms    build_connector_meta for N generation requests, one token each, a
                                block completing every block_size steps (the connector sends an
                                update only then: most steps cost no round trip)
  decode{N}_rpc_share           the share of steps that sent a Step
  registration_ms_p50 / _max    a two-rank engine's start: both workers built, their pools
                                registered, the scheduler's engine made and joined, until every
                                rank's memory is mapped (the connector's whole share of start-up)

    python bench/trtllm_connector.py [--requests 256] [--steps 512] [--registrations 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from kvdepot.connector.config import ConnectorConfig
from kvdepot.connector.instance import Instance
from kvdepot.layout import KvLayout
from kvdepot.testing import DaemonProcess
from kvdepot.testing.trtllm import KvCacheConfig, LlmRequest, RequestData, SchedulerOutput, TorchLlmArgs
from kvdepot.testing.trtllm_executor import StandInExecutor
from kvdepot.trtllm.common import TrtllmMeta
from kvdepot.trtllm.scheduler import SchedulerSide

BS = 16


def registrations(d: DaemonProcess, n: int) -> list[float]:
    """Milliseconds from building a two-rank engine to every rank mapped (memfds at unix:)."""
    os.environ["KVDEPOT_ADDRESS"] = d.unix
    lay = KvLayout(num_layers=2, num_kv_heads=1, head_size=1024, dtype="float16", block_size=BS, world_size=2, kind="trtllm")
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        ex = StandInExecutor(lay, 256, TorchLlmArgs(model=f"bench-reg-{i}", kv_cache_config=KvCacheConfig(tokens_per_block=BS), tensor_parallel_size=2))
        c = ex.scheduler.side.client
        while c is None or not c.engine_id or len(next(e for e in c.engines() if e.engine_id == c.engine_id).mapped_ranks) < 2:
            time.sleep(0.001)
        out.append((time.perf_counter() - t0) * 1000)
        ex.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--steps", type=int, default=512)
    ap.add_argument("--registrations", type=int, default=5)
    args = ap.parse_args()
    n = args.requests
    d = DaemonProcess(args=["--host-gib", "0.25"]).start()
    try:
        instance = Instance.of(args)  # the layout rank 0's worker would have published
        instance.publish(KvLayout(num_layers=2, num_kv_heads=1, head_size=1024, dtype="float16", block_size=BS))  # kind "none": the daemon plans every store, moves no bytes
        side = SchedulerSide(ConnectorConfig(address=d.tcp, step_timeout_ms=2000, lookup_timeout_ms=2000), "bench-model", instance, BS)
        reqs, tables, blocks = [], {}, iter(range(10**9))
        new = SchedulerOutput()
        for i in range(n):
            prompt = list(range(i * 1000, i * 1000 + 100))
            r = LlmRequest(i + 1, prompt, 10**6)
            assert side.matched(r, 0) == (0, False)
            tables[r.request_id] = [next(blocks) for _ in range(7)]
            side.allocated(r, tables[r.request_id])
            new.new_requests.append(RequestData(r.request_id, prompt, tables[r.request_id], 0, 100))
            reqs.append(r)
        side.build(new, TrtllmMeta())  # prefill: admission, not timed
        assert side.client is not None
        steps_before = side.client.stats().counters["steps"]
        times = []
        for _ in range(args.steps):
            so = SchedulerOutput()
            for r in reqs:
                r.add_new_token(7, 0)
                L = len(r.get_tokens(0))
                nb = [next(blocks)] if L > len(tables[r.request_id]) * BS else []
                tables[r.request_id] += nb
                so.cached_requests.append(RequestData(r.request_id, [7], nb, L - 1, 1))
            t0 = time.perf_counter()
            side.build(so, TrtllmMeta())
            times.append((time.perf_counter() - t0) * 1000)
        rpcs = side.client.stats().counters["steps"] - steps_before
        times.sort()
        side.close()
        reg = registrations(d, args.registrations)
        print(json.dumps({
            "bench": "trtllm_connector", f"decode{n}_p50_ms": round(statistics.median(times), 3),
            f"decode{n}_p99_ms": round(times[int(len(times) * 0.99) - 1], 3), f"decode{n}_rpc_share": round(rpcs / len(times), 3),
            "steps": len(times), "registration_ms_p50": round(statistics.median(reg), 1), "registration_ms_max": round(max(reg), 1),
        }))
    finally:
        d.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
