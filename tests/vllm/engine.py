"""How the vLLM tests run an engine: one set of settings for the connector runs and the plain
baseline, the prompts they share, and the baseline itself (run without the connector, in its own
process: `python -m tests.vllm.engine MODEL_DIR`, prints JSON)."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # in-process: the test can look at the connector's state
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
BLOCK = 32
MAX_TOKENS = 8
P = list(range(10, 110))  # 100 tokens: 3 full blocks
Q = P[:70]  # shares 2 blocks with P
SHARED = list(range(200, 264))  # a 64-token prefix, then 8 different tails
BATCH = [SHARED + [300 + 10 * i + k for k in range(36)] for i in range(8)]
LONG = [[400 + 7 * i + k % 90 for k in range(150)] for i in range(4)]  # preemption: 4 long requests
LONG_TOKENS = 120
PROMPTS = {"P": P, "Q": Q, **{f"B{i}": b for i, b in enumerate(BATCH)}, **{f"L{i}": p for i, p in enumerate(LONG)}}


def engine_args(model: str, **kw: Any) -> dict[str, Any]:
    args: dict[str, Any] = dict(
        model=model, dtype="float32", max_model_len=512, enforce_eager=True, block_size=BLOCK, max_num_seqs=8, seed=0,
        distributed_executor_backend="uni",
    )
    args.update(kw)
    return args


def kv_config(address: str, **extra: Any) -> Any:
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="KvDepotConnector", kv_connector_module_path="kvdepot.vllm", kv_role="kv_both",
        kv_connector_extra_config={"address": address, **extra},
    )


def generate(llm: Any, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[tuple[list[int], int]]:
    """Greedy outputs and vLLM's count of cached prompt tokens (its own hit plus the daemon's)."""
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.num_cached_tokens or 0) for o in outs]


def reset(llm: Any) -> None:
    """reset_prefix_cache(), which vLLM refuses while a finished request still holds blocks for the
    connector (its stores were still running when it finished). An in-process engine only hears
    that they ended when it steps, so each retry runs a one-token request (no full block: the
    daemon stores nothing for it)."""
    for _ in range(20):
        if llm.reset_prefix_cache():
            return
        generate(llm, [[7]], max_tokens=1)
    raise AssertionError("reset_prefix_cache() kept failing: blocks are still held")


def connector_of(llm: Any) -> Any:
    """The scheduler-side KvDepotConnector of an in-process engine."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


def baseline(model: str) -> dict[str, list[int]]:
    from vllm import LLM

    llm = LLM(**engine_args(model))
    out = {name: generate(llm, [p])[0][0] for name, p in PROMPTS.items() if not name.startswith("L")}
    out.update({f"L{i}": o for i, (o, _) in enumerate(generate(llm, LONG, LONG_TOKENS))})
    return out


if __name__ == "__main__":
    os.environ.update(ENV)
    print("BASELINE " + json.dumps(baseline(sys.argv[1])))
