"""One TensorRT-LLM instance (the stand-in executor and the connector) in a process of its own,
driven over stdin for tests of several instances started with the same environment:

    serve START N     runs the prompt range(START, START + N); prints {"rid", "matched", "bad_kv"}
    reset             drops the engine's own prefix cache
    quit              closes the connector and exits
    exit              exits without a word to the connector (TensorRT-LLM calls no shutdown hook)

Run as `python -m tests.trtllm.instance_proc MODEL WORLD_SIZE` from the repository root.
"""

from __future__ import annotations

import json
import sys

from kvdepot.testing.trtllm import KvCacheConfig, TorchLlmArgs
from kvdepot.testing.trtllm_executor import StandInExecutor
from tests.trtllm.conftest import BS, layout, prompt


def main() -> None:
    model, world = sys.argv[1], int(sys.argv[2])
    args = TorchLlmArgs(model=model, kv_cache_config=KvCacheConfig(tokens_per_block=BS), tensor_parallel_size=world)
    ex = StandInExecutor(layout(world), 64, args)
    print(json.dumps({"ready": True, "key": ex.scheduler.side.key}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "serve":
            r = ex.add(prompt(int(cmd[2]), start=int(cmd[1])))
            ex.run()
            print(json.dumps({"rid": r.request_id, "matched": ex.matched[r.request_id], "bad_kv": len(ex.bad_kv[r.request_id])}), flush=True)
        elif cmd[0] == "reset":
            ex.reset_prefix_cache()
            print(json.dumps({"reset": True}), flush=True)
        elif cmd[0] == "quit":
            break
        elif cmd[0] == "exit":
            return
    ex.close()


if __name__ == "__main__":
    main()
