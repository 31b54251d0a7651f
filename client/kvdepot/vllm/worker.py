"""The connector's worker side (each worker process): vLLM's per-layer tensors handed to the engine
neutral kvdepot.connector.worker (KvDepotConnector's docstring maps vLLM's hooks to the methods)."""

from __future__ import annotations

from typing import Any

import torch

from kvdepot.connector.instance import mint
from kvdepot.connector.worker import WorkerSide
from kvdepot.vllm.common import KvDepotHandshake, KvDepotWorkerMetadata


class VllmWorkerSide(WorkerSide):
    on_failed_load = "; vLLM recomputes them"
    waits_per_layer = True  # each attention layer calls wait_for_layer_load; failed loads go to get_block_ids_with_load_errors

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.layer_index: dict[str, int] = {}  # layer name -> its place in the registered KV tensors (the layout's layer)

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Shares this rank's KV tensors and joins the engine under the key tensor-parallel rank 0
        mints and broadcasts to its peers here (every rank registers its caches at this point of
        vLLM's start-up). The scheduler learns the key from the workers' handshake, which vLLM
        gathers before it serves, and creates the engine; a worker's join waits for that."""
        if self.layout is None or not kv_caches:
            return
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tp_group

        tensors = list(kv_caches.values())
        self.layer_index = {name: i for i, name in enumerate(kv_caches)}
        num_blocks = int(tensors[0].shape[1] if self.layout.kind == "vllm_flash" else tensors[0].shape[0])
        rank = get_tensor_model_parallel_rank()
        shared = self.share(tensors, list(kv_caches), num_blocks, rank)
        key = get_tp_group().broadcast_object(mint("vllm", self.model) if rank == 0 else None, src=0)  # a collective: every rank
        if shared and key:
            self.join(key)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """A layer whose name was not registered (it shares another layer's cache, which has its
        own wait) waits for all of the loads."""
        if self.layer_jobs and self.layout is not None:
            index = self.layer_index.get(layer_name)
            if index is not None:
                self.wait_for_layer(index)
            else:
                self.wait_for_layer(self.layout.num_layers - 1, own=False)

    def handshake(self) -> KvDepotHandshake | None:
        return KvDepotHandshake(self.key, self.engine_copies) if self.key else None

    def worker_meta(self) -> KvDepotWorkerMetadata | None:
        done = self.take_completed()
        return KvDepotWorkerMetadata(done) if done else None
