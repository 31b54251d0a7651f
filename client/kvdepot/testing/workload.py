"""A steady engine workload against a running daemon, to watch it work (kvdepotd status, a
dashboard) or to check a deployment end to end:

    python -m kvdepot.testing.workload ADDRESS [--seconds 30] [--engines 1] [--token-file F]

Each engine is a FakeEngine with real KV memory (handed over as memfds on a unix: address) that
serves rounds of prompts sharing long prefixes, dropping its own prefix cache between rounds, so
the daemon stores blocks and then serves them back (loads). Every position's KV is checked when a
request finishes. At the end it prints one JSON line: rounds, tokens computed and loaded, failed
loads, KV mismatches (must be 0); it exits 1 when any KV was wrong or nothing was loaded.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from typing import Any

from kvdepot.auth import read_token
from kvdepot.client import DepotClient
from kvdepot.layout import KvLayout
from kvdepot.testing.fake_engine import FakeEngine

# kind: the engine's KV memory is real (a layout without one moves no bytes, and its checks prove nothing)
LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_size=32, dtype="float16", block_size=16, kind="vllm_cpu")


def run_engine(address: str, seconds: float, index: int, token: str, model: str, out: dict[str, Any]) -> None:
    rng = random.Random(index)
    with DepotClient(address, token=token) as client:
        client.register_engine(model, LAYOUT, name=f"workload-{index}")
        eng = FakeEngine(client, layout=LAYOUT, num_blocks=512, block_size=LAYOUT.block_size)
        for w in eng.workers:
            w.attached.wait(5)
        prefixes = [[rng.randrange(1, 30000) for _ in range(160)] for _ in range(4)]
        rounds = 0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for p in prefixes:
                eng.add_request(p + [rng.randrange(1, 30000) for _ in range(rng.randrange(8, 40))], max_new_tokens=4)
            eng.run_until_done()
            eng.reset_prefix_cache()
            rounds += 1
        st = eng.stats
        out[f"workload-{index}"] = {
            "rounds": rounds, "computed_tokens": st.computed_tokens, "loaded_tokens": st.loaded_tokens,
            "failed_load_blocks": st.failed_load_blocks, "kv_mismatched_tokens": st.kv_mismatched_tokens, "degraded_steps": st.degraded_steps,
        }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvdepot.testing.workload", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("address", help="the daemon: HOST:PORT or unix:PATH")
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--engines", type=int, default=1)
    p.add_argument("--model", default="workload-model")
    p.add_argument("--token-file", default="", help="a namespace token, for a daemon with tokens")
    args = p.parse_args(argv)
    token = read_token(args.token_file) if args.token_file else ""
    out: dict[str, Any] = {}
    errors: list[BaseException] = []

    def guarded(i: int) -> None:
        try:
            run_engine(args.address, args.seconds, i, token, args.model, out)
        except BaseException as e:  # reported below: one engine's failure fails the run
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(args.engines)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        print(f"workload: {errors[0]!r}", file=sys.stderr)
        return 1
    print(json.dumps(out))
    bad = any(v["kv_mismatched_tokens"] or not v["loaded_tokens"] for v in out.values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
