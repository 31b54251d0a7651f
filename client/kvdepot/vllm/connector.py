"""KvDepotConnector: vLLM's KVConnectorBase_V1 on top of the kvdepot client.

A thin facade: vLLM's calls go to the role's side, as vLLM's own offloading connector is laid out
(reference/engines.md A1): kvdepot.vllm.scheduler (EngineCore process) and kvdepot.vllm.worker
(each worker process); kvdepot.vllm.common holds what crosses between them.

Scheduler (EngineCore process)
    get_num_new_matched_tokens  records L (vLLM's own prefix hit, the argument) and asks the daemon
                                for E under a short deadline; a miss when the daemon is slow or down
    update_state_after_alloc    commits L, E and the block table (async loads: the 2nd call only
                                brings the full table)
    build_connector_meta        at most one Step RPC per engine step, none when nothing matters
                                (a decode step that completes no block): new updates carry L and E
                                apart, so the blocks vLLM already had are never stored again
    request_finished            delays the free while an op of the request may still touch its blocks
Worker (each worker process)
    get_mem_pool_context        on a CPU: vLLM allocates its KV cache inside it, and it makes that
                                allocation on shared memory from the start (kvdepot.handles)
    register_kv_caches          shares the CPU KV tensors: memfds handed over on the daemon's
                                handoff socket when `address` is unix:PATH, /dev/shm files
                                otherwise (moved there (set_()) where they were not allocated
                                there); or exports CUDA IPC handles; tensor-parallel rank 0
                                mints the engine's key and broadcasts it; each worker joins under it
    get_handshake_metadata      the key, which vLLM hands to the scheduler before it serves
                                (set_xfer_handshake_metadata: the scheduler creates the engine)
    start_load_kv               waits for this step's synchronous loads (never past the op's deadline),
                                unless they land layer by layer (layerwise_loads, the default): then
    wait_for_layer_load         waits for its layer of them only
    wait_for_save               reports forward-done (CPU) or records an interprocess CUDA event
    get_finished / get_block_ids_with_load_errors   from the daemon's completion stream

Everything the two roles exchange rides in KvDepotMetadata (scheduler -> workers) and
KvDepotWorkerMetadata (workers -> scheduler): small, picklable, no tensors.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvdepot import handles
from kvdepot.handoff import handoff_path
from kvdepot.connector.config import ConnectorConfig
from kvdepot.connector.worker import LoadJob
from kvdepot.vllm.common import KvDepotHandshake, KvDepotMetadata, KvDepotWorkerMetadata, layout_of
from kvdepot.vllm.scheduler import SchedulerSide
from kvdepot.vllm.worker import VllmWorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvdepot.vllm")
__all__ = ["KvDepotConnector", "KvDepotMetadata", "KvDepotWorkerMetadata", "LoadJob"]


class KvDepotConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = self._kv_transfer_config
        self.cfg = ConnectorConfig.from_extra(tc.kv_connector_extra_config)
        layout, why = layout_of(vllm_config, kv_cache_config)
        if layout is None:
            log.error("kvdepot: connector disabled: %s", why)
        model = vllm_config.model_config.model
        self._sched: SchedulerSide | None = None
        self._worker: VllmWorkerSide | None = None
        self._cpu = layout is not None and getattr(vllm_config.device_config, "device_type", "") == "cpu"
        if role == KVConnectorRole.SCHEDULER:
            if tc.kv_load_failure_policy != "recompute" and not self.cfg.keep_fail_policy:
                log.info("kvdepot: kv_load_failure_policy set to 'recompute': a failed load of a cache costs a hit, not the request")
                tc.kv_load_failure_policy = "recompute"
            self._sched = SchedulerSide(self.cfg, layout, model)
        else:
            self._worker = VllmWorkerSide(self.cfg, layout, model)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped store is a future miss

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.33 and later: no. The daemon holds the KV tensors vLLM shared at registration
        (shared memory, CUDA IPC handles); after a sleep the engine's memory is another."""
        return False

    # -- scheduler role -----------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._sched is not None
        return self._sched.matched(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._sched is not None
        self._sched.allocated(request, blocks.get_block_ids(), num_external_tokens)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        if self._sched is not None:
            ours = [m for m in metadata.values() if isinstance(m, KvDepotHandshake)]
            self._sched.connect([m.engine_key for m in ours], [m.engine_copies for m in ours])

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._sched is not None
        return self._sched.build(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._sched is not None
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, KvDepotWorkerMetadata):
            self._sched.completed(meta.completed)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        return self._sched.finished(request), None

    # -- worker role -----------------------------------------------------------------------------
    def get_mem_pool_context(self) -> AbstractContextManager[Any] | None:
        if self._worker is None or not self._cpu or self.cfg.copy_mode == "engine":
            return None
        return handles.allocating_on_shared_memory(memfd=handoff_path(self.cfg.address) is not None)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._worker.handshake() if self._worker is not None else None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, KvDepotMetadata):
            self._worker.join_soon(connector_metadata.engine_key)  # a worker in a process of its own learns the key here

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self._worker is not None and isinstance(kv_connector_metadata, KvDepotMetadata):
            self._worker.preempted(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvDepotMetadata)
        self._worker.start_loads(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self._worker is not None
        self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        return  # the daemon copies computed blocks itself once the forward is reported done

    def wait_for_save(self) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvDepotMetadata)
        self._worker.forward_done(meta.step)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        meta = self._connector_metadata
        return self._worker.finished(finished_req_ids, meta.finished if isinstance(meta, KvDepotMetadata) else None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.take_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        assert self._worker is not None
        return self._worker.worker_meta()

    def shutdown(self) -> None:
        for side in (self._sched, self._worker):
            if side is not None:
                side.close()
