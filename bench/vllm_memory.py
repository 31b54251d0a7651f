"""A vLLM CPU engine's memory and start with and without kvdepot, side by side.

Run in the vLLM venv (scripts/bootstrap-vllm):  .venv-vllm/bin/python bench/vllm_memory.py
Each start is a fresh process (the engine in-process, VLLM_ENABLE_V1_MULTIPROCESSING=0) with a
--kv-gib KV cache: the seconds until LLM() returned, then one request served to show it works, and
the machine's memory it took at its peak (`peak_mib`: MemTotal - MemAvailable sampled every 20 ms,
over the level before it started; shared memory counts, whether or not a process has touched it,
as it counts against a container's limit; the process's own ru_maxrss does not see shared memory
it has not touched). Cases, alternated --repeat times:
    plain        no connector
    memfd        kvdepot at the daemon's unix: address (the KV cache on memfds handed over)
    file         kvdepot at its TCP address (the KV cache on /dev/shm files)
    before_*     the same, with the connector of --before (a checkout, e.g. a git worktree of an
                 earlier commit), which copied the cache onto shared memory after vLLM allocated it
Reports medians and peak_over_plain_mib per case, and start_ratio (memfd over plain). Targets
(issue 43): peak memory equal to plain vLLM (within a tenth of the cache), where copying the cache
showed +kv_gib; the start no slower. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def one(model: str, address: str) -> dict[str, Any]:
    import logging

    logging.disable(logging.WARNING)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kw: dict[str, Any] = {}
    if address:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvDepotConnector", kv_connector_module_path="kvdepot.vllm", kv_role="kv_both", kv_connector_extra_config={"address": address}
        )
    t0 = time.perf_counter()
    llm = LLM(model=model, dtype="float32", max_model_len=1024, enforce_eager=True, block_size=32, max_num_seqs=4, seed=0, **kw)
    start_s = time.perf_counter() - t0
    out = llm.generate([{"prompt_token_ids": list(range(10, 110))}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    return {"start_s": round(start_s, 2), "maxrss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}


def used_mib() -> float:
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) for line in f}
    return (info["MemTotal"] - info["MemAvailable"]) / 1024


def measured(cmd: list[str], env: dict[str, str]) -> dict[str, Any]:
    """Runs `cmd`, sampling the machine's used memory meanwhile: its result and peak_mib."""
    base = used_mib()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = base
    while proc.poll() is None:
        peak = max(peak, used_mib())
        time.sleep(0.02)
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {err[-2000:]}")
    return {**json.loads(out.strip().splitlines()[-1]), "peak_mib": round(peak - base)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--kv-gib", type=int, default=2, help="the KV cache in GiB (VLLM_CPU_KVCACHE_SPACE takes whole GiB)")
    ap.add_argument("--before", default="", help="a checkout whose connector is measured too (its client/ goes first on PYTHONPATH)")
    ap.add_argument("--one", nargs=2, metavar=("MODEL", "ADDRESS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], args.one[1] if args.one[1] != "-" else "")), flush=True)
        return

    from kvdepot.testing import DaemonProcess
    from kvdepot.testing.tiny_llama import build_tiny_llama

    work = tempfile.mkdtemp(prefix="kvdepot-bench-")
    model = build_tiny_llama(os.path.join(work, "model"), layers=8, hidden=512, heads=8, kv_heads=8, head_dim=64, intermediate=1024)
    env = {**os.environ, **ENV, "VLLM_CPU_KVCACHE_SPACE": str(args.kv_gib)}
    got: dict[str, list[dict[str, Any]]] = {}
    with DaemonProcess(args=["--host-gib", "1"]) as d:
        cases = {"plain": ("-", ""), "memfd": (d.unix, ""), "file": (d.tcp, "")}
        if args.before:
            cases.update(before_memfd=(d.unix, args.before), before_file=(d.tcp, args.before))
        for _ in range(args.repeat):
            for name, (address, tree) in cases.items():
                e = dict(env)
                if tree:
                    e["PYTHONPATH"] = os.path.join(os.path.abspath(tree), "client") + os.pathsep + e.get("PYTHONPATH", "")
                time.sleep(1)  # the last engine's memory given back
                got.setdefault(name, []).append(measured([sys.executable, __file__, "--one", model, address], e))
    res: dict[str, Any] = {"bench": "vllm_memory", "kv_gib": args.kv_gib, "repeat": args.repeat, "runs": got}
    plain_peak = statistics.median(r["peak_mib"] for r in got["plain"])
    for name, runs in got.items():
        res[name] = {"start_s": statistics.median(r["start_s"] for r in runs), "peak_mib": statistics.median(r["peak_mib"] for r in runs)}
        res[name]["peak_over_plain_mib"] = round(res[name]["peak_mib"] - plain_peak)
    res["start_ratio"] = round(res["memfd"]["start_s"] / res["plain"]["start_s"], 2)  # kvdepot's engine over the plain one
    res["targets_met"] = all(res[c]["peak_over_plain_mib"] < 0.1 * args.kv_gib * 1024 for c in ("memfd", "file")) and res["start_ratio"] <= 1.05
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
