"""GPU smoke check: a CUDA KV cache registered through cuda_ipc from a separate process, stored to
and loaded from the daemon's (pinned) host tier byte-exact; prints D2H and H2D GB/s as one JSON line.

    python bench/gpu_smoke.py [--blocks 256]

Needs an NVIDIA GPU and a CUDA build of torch; on a machine without one it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from kvdepot import DepotClient, KvLayout, StepBatch
from kvdepot.handles import export_cuda_tensors
from kvdepot.messages import OpCompleted
from kvdepot.testing import DaemonProcess


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=256)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"bench": "gpu_smoke", "skipped": "no CUDA device on this machine"}))
        return 0
    nb = args.blocks
    lay = KvLayout(num_layers=32, num_kv_heads=8, head_size=128, dtype="float16", block_size=16, kind="vllm_flash")
    nbytes = nb * lay.block_bytes
    d = DaemonProcess(args=["--log-level", "info", "--host-gib", f"{(2 * nbytes + (64 << 20)) / 2**30:.3f}"]).start(timeout_s=300)
    try:
        c = DepotClient(d.tcp, strict=True, deadline_s=60.0)
        c.register_engine("gpu-smoke", lay)
        w = c.worker(0)
        assert w.attached.wait(20)
        g = torch.Generator(device="cuda").manual_seed(0)
        kv = [torch.randn(2, nb + 1, 16, 8, 128, device="cuda", generator=g).half() for _ in range(lay.num_layers)]
        original = [t.clone() for t in kv]
        torch.cuda.synchronize()
        w.register_kv_caches(export_cuda_tensors(kv, nb + 1)[0])

        def wait_op(op_id: int) -> None:
            evs = w.wait(lambda es: any(isinstance(e, OpCompleted) and e.op_id == op_id for e in es), 120)
            ev = next(e for e in evs if isinstance(e, OpCompleted) and e.op_id == op_id)
            assert ev.success, ev.message

        toks = list(range(nb * 16 + 1))
        b = StepBatch()
        b.new("store", toks, list(range(nb + 1)), computed=0, scheduled=len(toks))
        res = c.step(b)
        [store] = [op for op in res.ops if op.kind == "store"]
        done = torch.cuda.Event(interprocess=True)
        done.record()  # the end of this step's "forward": the daemon's stream waits on it
        t0 = time.perf_counter()
        w.forward_done(res.step, done)
        wait_op(store.op_id)
        d2h = nbytes / (time.perf_counter() - t0) / 1e9
        for t in kv:
            t.zero_()
        torch.cuda.synchronize()
        assert c.lookup("load", toks).matched_tokens == nb * 16
        b = StepBatch()
        b.new("load", toks, list(range(nb + 1)), computed=nb * 16, scheduled=1, loaded=nb * 16)
        t0 = time.perf_counter()
        res = c.step(b)
        [load] = [op for op in res.ops if op.kind == "load"]
        wait_op(load.op_id)
        h2d = nbytes / (time.perf_counter() - t0) / 1e9
        exact = all(torch.equal(a[:, :nb], o[:, :nb]) for a, o in zip(kv, original))
        print(json.dumps({"bench": "gpu_smoke", "device": torch.cuda.get_device_name(), "bytes": nbytes,
                          "byte_exact": exact, "d2h_gbps": round(d2h, 2), "h2d_gbps": round(h2d, 2)}))
        c.close()
        return 0 if exact else 1
    finally:
        d.stop()


if __name__ == "__main__":
    sys.exit(main())
