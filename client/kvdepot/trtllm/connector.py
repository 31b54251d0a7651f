"""KvDepotScheduler and KvDepotWorker: the classes TensorRT-LLM loads through
`kv_connector_config` (connector_module: kvdepot.trtllm). Thin facades over the two sides,
kvdepot.trtllm.scheduler (rank 0) and kvdepot.trtllm.worker (every rank); they subclass
TensorRT-LLM's own bases where it imports, kvdepot.testing.trtllm's stand-ins elsewhere."""

from __future__ import annotations

import logging
from typing import Any

import torch

from kvdepot.connector.instance import Instance
from kvdepot.trtllm.api import KvCacheConnectorScheduler, KvCacheConnectorWorker, mpi_rank
from kvdepot.trtllm.common import TrtllmMeta, check_args, model_of, settings
from kvdepot.trtllm.scheduler import SchedulerSide
from kvdepot.trtllm.worker import TrtllmWorkerSide

log = logging.getLogger("kvdepot.trtllm")


class KvDepotScheduler(KvCacheConnectorScheduler):
    def __init__(self, llm_args: Any) -> None:
        super().__init__(llm_args)
        if why := check_args(llm_args):
            log.error("kvdepot: connector disabled: %s", why)
        tpb = int(llm_args.kv_cache_config.tokens_per_block)
        self.side = SchedulerSide(settings(llm_args), model_of(llm_args), Instance.of(llm_args), tpb, enabled=not why)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return self.side.matched(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
        self.side.allocated(request, block_ids)

    def build_connector_meta(self, scheduler_output: Any) -> TrtllmMeta:
        meta = TrtllmMeta()
        self.side.build(scheduler_output, meta)
        return meta

    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
        return self.side.finished(request, cache_block_ids)

    # KVCacheManagerV2 with several layer groups calls these instead: the worker refused such a cache
    # at registration, so the scheduler never connected and nothing reaches the daemon.
    def update_state_after_alloc_by_layer_group(self, request: Any, block_ids_by_layer_group: list[list[int]]) -> None:
        if len(block_ids_by_layer_group) == 1:
            self.side.allocated(request, block_ids_by_layer_group[0])

    def request_finished_by_layer_group(self, request: Any, cache_block_ids_by_layer_group: list[list[int]]) -> bool:
        return self.side.finished(request, [b for ids in cache_block_ids_by_layer_group for b in ids])

    def wait_for_initialization(self) -> None:
        """Newer releases, once every rank registered its pool: the engine serves once the daemon
        has mapped them all (before, every lookup would be a miss)."""
        self.side.wait_mapped()

    def shutdown(self) -> None:
        self.side.close()


class KvDepotWorker(KvCacheConnectorWorker):
    def __init__(self, llm_args: Any) -> None:
        super().__init__(llm_args)
        self.side = TrtllmWorkerSide(settings(llm_args), llm_args, Instance.of(llm_args))

    def register_kv_caches(self, kv_cache_tensor: torch.Tensor) -> None:
        self.side.register(kv_cache_tensor, mpi_rank())

    def register_kv_cache_layout(self, layout: Any) -> None:
        """Newer releases' cache managers: one pool tensor is served as always; a cache that is not
        one pool (several layer groups or regions: variable sliding windows, block scales) is
        refused here, said once, and the engine runs without kvdepot."""
        pool = layout.as_single_pool_tensor()
        why = "" if pool is not None else (
            f"the KV cache is not one pool ({len(layout.groups)} layer groups): kvdepot serves one pool of whole blocks, "
            "so it stays off for this model"
        )
        self.side.register(pool, mpi_rank(), why)

    def bind_connector_meta(self, metadata: object) -> None:
        super().bind_connector_meta(metadata)
        self.side.bound(metadata)

    def start_load_kv(self, stream: Any) -> None:
        self.side.before_forward(self._metadata)

    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
        # start_load_kv already waited for the step's synchronous loads, checked: TensorRT-LLM cannot
        # drop a forward's output when a loaded block turns out bad, and a block's checksum covers
        # all its layers, so no layer may be read before the whole block is in and checked.
        return

    def save_kv_layer(self, layer_idx: int, stream: Any) -> None:
        return  # the daemon copies computed blocks itself once the forward is reported done

    def wait_for_save(self, stream: Any) -> None:
        self.side.after_forward(self._metadata, stream)

    def get_finished(self, finished_gen_req_ids: list[int], started_loading_req_ids: list[int]) -> tuple[list[int], list[int]]:
        return self.side.finished_ids(self._metadata, finished_gen_req_ids, started_loading_req_ids)

    def shutdown(self) -> None:
        self.side.close()
