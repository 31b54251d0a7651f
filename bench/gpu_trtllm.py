"""GPU check of the TensorRT-LLM connector: TensorRT-LLM's loop (kvdepot.testing.trtllm_executor)
with its KV pool on the GPU, exported to the daemon with CUDA IPC handles, stores waiting on an
interprocess CUDA event recorded at the end of each forward. A prompt is computed and stored,
the engine's own prefix cache dropped, and the prompt run again with the daemon's blocks loaded
(synchronously, then asynchronously; K and V, then K only); every position's KV must be right
and the output the same. Prints one JSON line with the figures.

    python bench/gpu_trtllm.py [--blocks 512] [--prompt 4000] [--device cuda|cpu]

Needs an NVIDIA GPU and a CUDA build of torch; without one it says so and exits 0 (`--device
cpu` runs the same check on CPU shared memory, which CI does to keep the script working).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from kvdepot.layout import KvLayout
from kvdepot.testing import DaemonProcess
from kvdepot.testing.trtllm import KvCacheConfig, TorchLlmArgs
from kvdepot.testing.trtllm_executor import StandInExecutor


def run(d: DaemonProcess, device: str, blocks: int, prompt_len: int, load_async: bool, kv_factor: int) -> dict[str, object]:
    os.environ["KVDEPOT_ADDRESS"] = d.tcp
    os.environ["KVDEPOT_LOAD_ASYNC"] = str(load_async).lower()
    os.environ["KVDEPOT_ENGINE_KEY"] = f"gpu-trtllm-{load_async}-{kv_factor}"
    tpb = 32
    lay = KvLayout(num_layers=8, num_kv_heads=8, head_size=128, dtype="float16", block_size=tpb, kind="trtllm", kv_factor=kv_factor)
    args = TorchLlmArgs(model=f"gpu-trtllm-k{kv_factor}", kv_cache_config=KvCacheConfig(tokens_per_block=tpb))
    ex = StandInExecutor(lay, blocks, args, device=device)
    try:
        prompt = [(i * 7919) % 30000 + 1 for i in range(prompt_len)]
        t0 = time.perf_counter()
        cold = ex.add(prompt, 4)
        ex.run(timeout_s=300)
        t_cold = time.perf_counter() - t0
        time.sleep(0.5)  # the stores end
        ex.reset_prefix_cache()
        t0 = time.perf_counter()
        warm = ex.add(prompt, 4)
        ex.run(timeout_s=300)
        t_warm = time.perf_counter() - t0
        L, E, is_async = ex.matched[warm.request_id]
        ok = ex.bad_kv[cold.request_id] == [] and ex.bad_kv[warm.request_id] == []
        same = ex.done[warm.request_id].get_tokens(0) == ex.done[cold.request_id].get_tokens(0)
        loaded_gib = E // tpb * lay.rank_block_bytes / 2**30
        return {
            "async": load_async, "kv_factor": kv_factor, "loaded_tokens": E, "async_load": is_async, "kv_right": ok, "same_output": same,
            "cold_s": round(t_cold, 3), "warm_s": round(t_warm, 3), "loaded_gib": round(loaded_gib, 3),
            "load_failures": ex.workers[0].side.load_failures,
        }
    finally:
        ex.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=512)
    ap.add_argument("--prompt", type=int, default=4000)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"bench": "gpu_trtllm", "skipped": "no CUDA device on this machine"}))
        return 0
    d = DaemonProcess(args=["--log-level", "info", "--host-gib", "2"]).start(timeout_s=300)
    try:
        runs = [run(d, args.device, args.blocks, args.prompt, a, k) for a, k in ((False, 2), (True, 2), (False, 1))]
    finally:
        rc = d.stop()
    good = rc == 0 and all(r["kv_right"] and r["same_output"] and r["loaded_tokens"] and not r["load_failures"] for r in runs)
    print(json.dumps({"bench": "gpu_trtllm", "device": args.device, "ok": good, "runs": runs}))
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
