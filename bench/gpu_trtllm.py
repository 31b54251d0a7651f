"""The TensorRT-LLM connector with its KV pool from each kind of allocator, each through its path:
TensorRT-LLM's loop (kvdepot.testing.trtllm_executor) with the pool on a GPU, a prompt computed and
stored, the engine's own prefix cache dropped, and the prompt run again with the daemon's blocks
loaded; every position's KV must be right and the output the same. Prints one JSON line.

    python bench/gpu_trtllm.py [--blocks 512] [--prompt 4000] [--device cuda|cpu]

Pools (--device cuda), and the path each must take (docs/trtllm.md, "GPU pools and who copies"):
    torch         torch's caching allocator                 torch's CUDA IPC handles
    cudamalloc    raw cudaMalloc (TensorRT-LLM's default)   the CUDA driver's legacy IPC handle
    vmm           cuMemCreate + cuMemMap, exportable as     the CUDA driver's file descriptors,
                  POSIX file descriptors (its sleep mode)    handed over (the daemon at unix:)
    async_pool    cudaMallocAsync's default pool            engine-side copy (nothing exports it)
    torch/engine  torch's, copy_mode engine                 engine-side copy, beside the first
plus synchronous and asynchronous loads and a K-only pool on torch's. Each run says the path it
took ("via"), whether the KV was right, and the load's GB/s (a rank's blocks over the time its
start_load_kv waited). The non-torch pools need cuda-bindings (pip install cuda-bindings).

--device cpu runs the same loop on CPU shared memory, the daemon copying and then the engine
copying (copy_mode engine): their GB/s side by side, which CI records. Without a GPU, --device
cuda says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from kvdepot.cuda_export import primary_context
from kvdepot.layout import KvLayout
from kvdepot.testing import DaemonProcess
from kvdepot.testing.trtllm import KvCacheConfig, TorchLlmArgs
from kvdepot.testing.trtllm_executor import StandInExecutor

TPB = 32
Alloc = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


class _Device:
    """Device memory as __cuda_array_interface__ (torch keeps this object, so `keep`, alive)."""

    def __init__(self, ptr: int, nbytes: int, keep: Any = None) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3, "strides": None}
        self.keep = keep


def _wrap(ptr: int, shape: tuple[int, ...], dtype: torch.dtype, keep: Any = None) -> torch.Tensor:
    n = 1
    for d in shape:
        n *= d
    raw = torch.as_tensor(_Device(ptr, n * dtype.itemsize, keep), device="cuda")
    return raw.view(dtype).view(shape)


def _ok(res: Any) -> Any:
    err, *rest = res
    if int(err) != 0:
        raise RuntimeError(f"CUDA call failed: {err}")
    return rest[0] if len(rest) == 1 else rest


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def alloc_cudamalloc(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """cudaMalloc's kind of memory (the driver's cuMemAlloc: the runtime calls the same), as
    TensorRT-LLM's buffer manager allocates its pool."""
    from cuda.bindings import driver as cu

    primary_context(torch.cuda.current_device())
    return _wrap(int(_ok(cu.cuMemAlloc(_nbytes(shape, dtype)))), shape, dtype)  # freed at exit: a bench


def alloc_async_pool(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The device's default stream-ordered pool (cudaMallocAsync)."""
    from cuda.bindings import driver as cu

    primary_context(torch.cuda.current_device())
    stream = torch.cuda.current_stream()
    ptr = int(_ok(cu.cuMemAllocAsync(_nbytes(shape, dtype), stream.cuda_stream)))
    stream.synchronize()
    return _wrap(ptr, shape, dtype)


def alloc_vmm(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Virtual memory in two physical allocations, exportable as POSIX file descriptors."""
    from cuda.bindings import driver as cu

    dev = torch.cuda.current_device()
    primary_context(dev)
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = dev
    prop.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    gran = int(_ok(cu.cuMemGetAllocationGranularity(prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)))
    half = -(-(_nbytes(shape, dtype) + 1) // 2 // gran) * gran
    base = int(_ok(cu.cuMemAddressReserve(2 * half, 0, 0, 0)))
    for k in range(2):
        handle = _ok(cu.cuMemCreate(half, prop, 0))
        _ok(cu.cuMemMap(base + k * half, half, 0, handle, 0))
        _ok(cu.cuMemRelease(handle))
    desc = cu.CUmemAccessDesc()
    desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = dev
    desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    _ok(cu.cuMemSetAccess(base, 2 * half, [desc], 1))
    return _wrap(base, shape, dtype)


POOLS: dict[str, tuple[Alloc | None, str]] = {  # name -> (allocator, the path it must take)
    "torch": (None, "cuda_ipc"),
    "cudamalloc": (alloc_cudamalloc, "cuda_driver ipc"),
    "vmm": (alloc_vmm, "cuda_driver descriptors"),
    "async_pool": (alloc_async_pool, "engine copies"),
}


def via(ex: StandInExecutor) -> str:
    side = ex.workers[0].side
    if side.engine_copies:
        return "engine copies"
    s = side.kv_request.storages[0]
    which = s.WhichOneof("handle")
    if which == "cuda_driver":
        return "cuda_driver ipc" if s.cuda_driver.ipc_handle else "cuda_driver descriptors"
    return str(which)


def timed_loads(ex: StandInExecutor) -> list[float]:
    """Wraps every rank's start_load_kv to keep how long each call waited."""
    waits: list[float] = []
    for w in ex.workers:
        real = w.start_load_kv

        def timed(stream: Any, real: Any = real) -> None:
            t0 = time.perf_counter()
            real(stream)
            waits.append(time.perf_counter() - t0)

        w.start_load_kv = timed  # type: ignore[method-assign]
    return waits


def run(d: DaemonProcess, device: str, blocks: int, prompt_len: int, *, load_async: bool = False, kv_factor: int = 2,
        pool: str = "torch", copy_mode: str = "auto") -> dict[str, object]:
    os.environ["KVDEPOT_ADDRESS"] = d.unix
    os.environ["KVDEPOT_LOAD_ASYNC"] = str(load_async).lower()
    os.environ["KVDEPOT_COPY_MODE"] = copy_mode
    lay = KvLayout(num_layers=8, num_kv_heads=8, head_size=128, dtype="float16", block_size=TPB, kind="trtllm", kv_factor=kv_factor)
    model = f"gpu-trtllm-{pool}-{copy_mode}-k{kv_factor}-{load_async}"
    ex = StandInExecutor(lay, blocks, TorchLlmArgs(model=model, kv_cache_config=KvCacheConfig(tokens_per_block=TPB)), device=device, pool_alloc=POOLS[pool][0])
    try:
        prompt = [(i * 7919) % 30000 + 1 for i in range(prompt_len)]
        t0 = time.perf_counter()
        cold = ex.add(prompt, 4)
        ex.run(timeout_s=300)
        t_cold = time.perf_counter() - t0
        time.sleep(0.5)  # the stores end
        ex.reset_prefix_cache()
        waits = timed_loads(ex)
        t0 = time.perf_counter()
        warm = ex.add(prompt, 4)
        ex.run(timeout_s=300)
        t_warm = time.perf_counter() - t0
        L, E, is_async = ex.matched[warm.request_id]
        ok = ex.bad_kv[cold.request_id] == [] and ex.bad_kv[warm.request_id] == []
        same = ex.done[warm.request_id].get_tokens(0) == ex.done[cold.request_id].get_tokens(0)
        moved = E // TPB * lay.rank_block_bytes
        waited = max(waits, default=0.0)
        return {
            "pool": pool, "copy_mode": copy_mode, "via": via(ex), "async": load_async, "kv_factor": kv_factor, "loaded_tokens": E,
            "async_load": is_async, "kv_right": ok, "same_output": same, "cold_s": round(t_cold, 3), "warm_s": round(t_warm, 3),
            "loaded_mib": round(moved / 2**20, 1), "load_gbps": round(moved / waited / 1e9, 2) if waited and not load_async else None,
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
    runs: list[dict[str, object]] = []
    try:
        plan: list[dict[str, Any]] = [{}, {"load_async": True}, {"kv_factor": 1}, {"copy_mode": "engine"}]
        if args.device == "cuda":
            plan += [{"pool": p} for p in POOLS if p != "torch"]
        for kw in plan:
            try:
                runs.append(run(d, args.device, args.blocks, args.prompt, **kw))
            except Exception as e:  # e.g. no cuda-bindings for a pool: said, and the others go on
                runs.append({**kw, "error": f"{type(e).__name__}: {e}"})
    finally:
        rc = d.stop()
    for r in runs:  # each pool went the way docs/trtllm.md says
        want = "engine copies" if r.get("copy_mode") == "engine" else POOLS[str(r.get("pool", "torch"))][1] if args.device == "cuda" else "cpu_shm"
        r["path_as_documented"] = r.get("via") == want
    good = rc == 0 and all(r.get("kv_right") and r.get("same_output") and r.get("loaded_tokens") and not r.get("load_failures") and r["path_as_documented"] for r in runs)
    daemon_gbps = next((r["load_gbps"] for r in runs if r.get("copy_mode", "auto") == "auto" and r.get("pool", "torch") == "torch" and not r.get("async")), None)
    engine_gbps = next((r["load_gbps"] for r in runs if r.get("copy_mode") == "engine"), None)
    print(json.dumps({"bench": "gpu_trtllm", "device": args.device, "ok": good, "daemon_copy_load_gbps": daemon_gbps, "engine_copy_load_gbps": engine_gbps, "runs": runs}))
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
