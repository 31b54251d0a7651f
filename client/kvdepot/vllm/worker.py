"""The connector's worker side (each worker process): vLLM's per-layer tensors handed to the engine
neutral kvdepot.connector.worker (KvDepotConnector's docstring maps vLLM's hooks to the methods)."""

from __future__ import annotations

import torch

from kvdepot.connector.worker import WorkerSide
from kvdepot.vllm.common import KvDepotWorkerMetadata


class VllmWorkerSide(WorkerSide):
    on_failed_load = "; vLLM recomputes them"
    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.layout is None or not kv_caches:
            return
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        tensors = list(kv_caches.values())
        num_blocks = int(tensors[0].shape[1] if self.layout.kind == "vllm_flash" else tensors[0].shape[0])
        self.share(tensors, list(kv_caches), num_blocks, get_tensor_model_parallel_rank())

    def worker_meta(self) -> KvDepotWorkerMetadata | None:
        done = self.take_completed()
        return KvDepotWorkerMetadata(done) if done else None
