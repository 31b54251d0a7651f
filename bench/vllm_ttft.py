"""TTFT and decode throughput of a real vLLM (CPU build) with and without kvdepot, side by side.

Run in the vLLM venv (scripts/bootstrap-vllm):  .venv-vllm/bin/python bench/vllm_ttft.py
Prints one JSON line. Bench model: random Llama, 8 layers, hidden 512, 8 heads of 64, built
locally. Prompts of about 2000 and 3500 tokens, one output token, median of --repeat runs after a
warm-up. Cases, per prompt size:
    ttft_recompute_ms            no connector, nothing cached (vLLM computes the whole prompt)
    ttft_local_hit_ms            no connector, the prompt is in vLLM's own prefix cache
    ttft_daemon_hit_ms           kvdepot, after reset_prefix_cache(): the prompt comes from the daemon
    ttft_daemon_hit_whole_ms     the same from a second kvdepot engine with layerwise_loads off (its
                                 forward waits for the whole load): layerwise_over_whole says what
                                 layer-by-layer loads gain
    ttft_cold_with_connector_ms  kvdepot, nothing cached (lookup miss + stores)
    ttft_example_connector_ms    vLLM's ExampleConnector after reset_prefix_cache()
    ttft_local_hit_with_connector_ms  kvdepot, the prompt still in vLLM's own prefix cache: the same
                                 engine's local hit, so daemon_hit_over_own_local_hit (reported, not
                                 judged) is free of the speed two engine instances differ by
and decode_tps_ratio: output tokens/s of 8 requests generating 256 tokens each, with the connector
and a running daemon over without the connector (a decode step that completes no block must not
wait on the daemon), the median over --decode-repeat rounds of the two engines back to back.
Targets: daemon hit <= 1.5x local hit and >= 5x faster than recompute; cold overhead <= 5%;
decode_tps_ratio >= 0.95. --busy N runs every measured case beside N processes that each keep a
core busy (a host shared with other work: the daemon's copy threads and the engines compete
with them for the cores). Every engine runs with vLLM's default CPU binding for an engine without a
connector (--omp-bind auto, --reserved-cpus 1; see main()).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

os.environ.update(
    HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", TOKENIZERS_PARALLELISM="false",
)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BLOCK = 32
KV_BLOCKS = 320  # each engine's KV space: 10240 tokens (enough for the longest prompt and the decode batch)
IDLE_S = 1.2  # longer than vLLM's message-queue busy loop (1 s): see settle()


def prompt(size: int, variant: int) -> list[int]:
    """A random prompt per (size, variant): no two share even their first block."""
    rng = random.Random(size * 1_000_003 + variant)
    return [rng.randrange(3, 500) for _ in range(size)]


def engine(model: str, dtype: str, **kw: Any) -> Any:
    from vllm import LLM

    return LLM(
        model=model, dtype=dtype, max_model_len=4096, max_num_batched_tokens=4096, enforce_eager=True, block_size=BLOCK,
        max_num_seqs=8, seed=0, num_gpu_blocks_override=KV_BLOCKS, **kw,
    )


def close(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()
    gc.collect()


def settle() -> None:
    """Lets the engines used before go idle: vLLM's worker and EngineCore processes keep polling
    their shared-memory message queues (sched_yield in a loop) for 1 s after their last message,
    so on two cores an engine used just before takes CPU from the one being measured, and from the
    daemon's copy threads (docs/performance.md has what that did to a daemon hit)."""
    time.sleep(IDLE_S)


def reset(llm: Any) -> None:
    """Empties the engine's prefix cache. vLLM refuses while a finished request still holds blocks
    (a connector's delayed free), and a "hit after reset" that found the cache full would be timed
    as a connector hit while it was a local one: retry for a while, then fail the benchmark."""
    for _ in range(50):
        if llm.reset_prefix_cache():
            return
        time.sleep(0.1)
    raise RuntimeError("reset_prefix_cache() kept failing: a measured hit would not come from the connector")


def ttft_ms(llm: Any, toks: list[int]) -> tuple[float, list[int]]:
    from vllm import SamplingParams

    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": toks}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    return (time.perf_counter() - t0) * 1000, list(out[0].outputs[0].token_ids)


def decode_tps(llm: Any, variant: int) -> float:
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": prompt(96, variant * 8 + i)} for i in range(8)]
    sp = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def median(xs: list[float]) -> float:
    return round(statistics.median(xs), 2)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The four engines run at once, each in vLLM's own multiprocess topology (EngineCore and a
    worker process), and every case is measured interleaved with the others, prompt by prompt, so
    machine noise hits all of them alike."""
    from vllm.config import KVTransferConfig

    from kvdepot import DepotClient
    from kvdepot.testing import DaemonProcess
    from kvdepot.testing.tiny_llama import build_tiny_llama

    # On tmpfs: ExampleConnector writes every prompt's KV (62 or 109 MiB) to files, and on a disk
    # the kernel flushes them some 30 s later, in the middle of other cases' measurements.
    work = tempfile.mkdtemp(prefix="kvdepot-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    model = build_tiny_llama(os.path.join(work, "model"), layers=8, hidden=512, heads=8, kv_heads=8, head_dim=64, intermediate=1024)
    R, SIZES = args.repeat, args.sizes
    res: dict[str, Any] = {"bench": "vllm_ttft", "model": f"llama 8x512, 8 heads of 64, {args.dtype}", "block_size": BLOCK, "repeat": R}
    res["omp_bind"] = args.omp_bind + (f", {args.reserved_cpus} reserved" if args.omp_bind == "auto" else "")
    cases = (
        "ttft_recompute_ms", "ttft_local_hit_ms", "ttft_daemon_hit_ms", "ttft_cold_with_connector_ms", "ttft_example_connector_ms",
        "ttft_local_hit_with_connector_ms", "ttft_daemon_hit_whole_ms",
    )
    daemon = DaemonProcess(args=["--host-gib", "3"]).start()
    engines: list[Any] = []
    busy: list[subprocess.Popen[bytes]] = []
    try:
        plain = engine(model, args.dtype)
        engines.append(plain)
        kv = KVTransferConfig(kv_connector="KvDepotConnector", kv_connector_module_path="kvdepot.vllm", kv_role="kv_both",
                              kv_connector_extra_config={"address": daemon.unix})
        depot = engine(model, args.dtype, kv_transfer_config=kv)
        engines.append(depot)
        whole_kv = KVTransferConfig(kv_connector="KvDepotConnector", kv_connector_module_path="kvdepot.vllm", kv_role="kv_both",
                                    kv_connector_extra_config={"address": daemon.unix, "layerwise_loads": False})
        whole = engine(model, args.dtype, kv_transfer_config=whole_kv)
        engines.append(whole)
        ex_kv = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                                 kv_connector_extra_config={"shared_storage_path": os.path.join(work, "example-store")})
        example = engine(model, args.dtype, kv_transfer_config=ex_kv)
        engines.append(example)
        for e in engines:  # warm-up that also touches every KV block once (first touches fault pages in)
            for w in range(-(-KV_BLOCKS * BLOCK // max(SIZES))):
                ttft_ms(e, prompt(max(SIZES), 10_000 + w))
            reset(e)
        for e in engines:  # and one hit each (local, or through its connector): first loads run code for the first time
            toks = prompt(min(SIZES), 20_000)
            ttft_ms(e, toks)
            time.sleep(0.2)
            if e is not plain:
                reset(e)
            ttft_ms(e, toks)
            reset(e)
        busy += [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
        res["busy_processes"] = args.busy
        same = True
        for size in SIZES:
            got: dict[str, list[float]] = {k: [] for k in cases}
            for v in range(R):
                toks = prompt(size, v)  # new to every engine and to the daemon
                order = [(plain, "ttft_recompute_ms"), (depot, "ttft_cold_with_connector_ms")]
                outs = {}
                for e, case in order if v % 2 == 0 else order[::-1]:  # alternate who goes first
                    settle()
                    t, outs[case] = ttft_ms(e, toks)
                    got[case].append(t)
                want = outs["ttft_recompute_ms"]
                same = same and outs["ttft_cold_with_connector_ms"] == want
                settle()  # (the stores of the cold run land meanwhile)
                got["ttft_local_hit_ms"].append(ttft_ms(plain, toks)[0])
                settle()
                t, out = ttft_ms(depot, toks)
                got["ttft_local_hit_with_connector_ms"].append(t)
                same = same and out == want
                reset(depot)
                hits = [(depot, "ttft_daemon_hit_ms"), (whole, "ttft_daemon_hit_whole_ms")]
                for e, case in hits if v % 2 == 0 else hits[::-1]:  # both from the daemon, alternating who goes first
                    settle()
                    t, out = ttft_ms(e, toks)
                    got[case].append(t)
                    same = same and out == want
                    reset(e)
                ttft_ms(example, toks)
                reset(example)
                settle()
                got["ttft_example_connector_ms"].append(ttft_ms(example, toks)[0])
                reset(example)
            for k in cases:
                res.setdefault(k, {})[str(size)] = median(got[k])
                res.setdefault("runs", {}).setdefault(k, {})[str(size)] = [round(x, 1) for x in got[k]]
        res["outputs_identical"] = same
        decode_tps(plain, 100)
        decode_tps(depot, 100)
        plain_tps, kv_tps = [], []
        for k in range(args.decode_repeat):  # interleaved, alternating who goes first, each batch new to both
            if k % 2:
                settle()
                kv_tps.append(decode_tps(depot, 200 + k))
            settle()
            plain_tps.append(decode_tps(plain, 200 + k))
            if not k % 2:
                settle()
                kv_tps.append(decode_tps(depot, 200 + k))
        with DepotClient(daemon.tcp, strict=True) as c:
            counters = dict(c.stats().counters)
        res["daemon"] = {k: counters[k] for k in ("steps", "stored_blocks", "loaded_blocks", "load_failed_blocks", "checksum_failures")}
    finally:
        for p in busy:
            p.kill()
        for e in engines:
            close(e)
        daemon.stop()
        shutil.rmtree(work, ignore_errors=True)

    res["decode_tps_plain"] = median(plain_tps)
    res["decode_tps_kvdepot"] = median(kv_tps)
    # Each round's two batches ran back to back, so their ratio is free of the machine's slower
    # drifts: the median of the rounds' ratios, not the ratio of medians over the whole minute.
    pairs = [k / p for k, p in zip(kv_tps, plain_tps)]
    res["decode_tps_ratios"] = [round(r, 3) for r in pairs]
    res["decode_tps_ratio"] = round(statistics.median(pairs), 3)
    checks = {}
    for size in map(str, SIZES):
        hit, loc, rec = res["ttft_daemon_hit_ms"][size], res["ttft_local_hit_ms"][size], res["ttft_recompute_ms"][size]
        checks[size] = {
            "daemon_hit_over_local_hit": round(hit / loc, 2),
            "recompute_over_daemon_hit": round(rec / hit, 2),
            "cold_overhead": round(res["ttft_cold_with_connector_ms"][size] / rec - 1, 3),
            "daemon_hit_over_own_local_hit": round(hit / res["ttft_local_hit_with_connector_ms"][size], 2),
            "layerwise_over_whole": round(hit / res["ttft_daemon_hit_whole_ms"][size], 2),
        }
    res["ratios"] = checks
    res["targets_met"] = {
        "daemon_hit_le_1.5x_local": all(c["daemon_hit_over_local_hit"] <= 1.5 for c in checks.values()),
        "daemon_hit_ge_5x_faster_than_recompute": all(c["recompute_over_daemon_hit"] >= 5 for c in checks.values()),
        "cold_overhead_le_5pct": all(c["cold_overhead"] <= 0.05 for c in checks.values()),
        "decode_tps_ratio_ge_0.95": res["decode_tps_ratio"] >= 0.95,
    }
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=5, help="measured runs per case (median); default 5")
    # 9 rounds: one round's ratio can be far off on a small shared machine (a batch taking twice as
    # long now and then), and a median of 5 still fell on either side of the 0.95 target.
    ap.add_argument("--decode-repeat", type=int, default=9, help="measured decode rounds (a batch on each engine); default 9")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="weights and KV cache; default float32")
    ap.add_argument("--omp-bind", default="auto", help="VLLM_CPU_OMP_THREADS_BIND for every engine: auto (vLLM's default, the default), nobind, or core lists")
    ap.add_argument("--reserved-cpus", type=int, default=1, help="with --omp-bind auto: cores kept from every engine's OpenMP threads; default 1")
    ap.add_argument("--sizes", default="2000,3500", help="prompt sizes in tokens; default 2000,3500")
    ap.add_argument("--busy", type=int, default=0, help="processes keeping a core busy each while measuring; default 0")
    args = ap.parse_args()
    args.sizes = tuple(int(x) for x in args.sizes.split(","))
    # Every engine gets the CPUs vLLM's default gives an engine without a connector: its automatic
    # OpenMP binding keeps one core from the worker's OpenMP threads for the EngineCore process, which
    # polls its message queues in a busy loop while the worker computes (here the worker's thread on
    # core 0, core 1 for the rest). With a kv_transfer_config vLLM wants a second core kept, for the
    # connector; on two cores it cannot, gives up keeping any and runs OpenMP on both, beside that
    # busy loop, the frontend and the daemon. One kept core for every engine compares like with
    # like; "nobind" (OpenMP threads free on every core, every engine) oversubscribes the cores and
    # made the figures far noisier (docs/performance.md).
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args.omp_bind
    if args.omp_bind == "auto":
        os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(args.reserved_cpus)
    import logging

    logging.disable(logging.WARNING)
    print(json.dumps(run(args)), flush=True)


if __name__ == "__main__":
    main()
