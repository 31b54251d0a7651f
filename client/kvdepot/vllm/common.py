"""What the connector's two roles share: the metadata that crosses the process boundary (small,
picklable, no tensors) and the engine's layout as both derive it."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata, KVConnectorMetadata, KVConnectorWorkerMetadata

from kvdepot.connector.worker import LoadJob
from kvdepot.layout import KvLayout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger("kvdepot.vllm")
__all__ = ["KvDepotHandshake", "KvDepotMetadata", "KvDepotWorkerMetadata", "LoadJob", "layout_of"]
_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


@dataclass
class KvDepotHandshake(KVConnectorHandshakeMetadata):
    """What each worker tells the scheduler once its KV caches are registered (vLLM gathers it
    before the engine serves): the engine's key, which tensor-parallel rank 0 minted and
    broadcast to its peers (kvdepot.connector.instance)."""

    engine_key: str = ""
    engine_copies: bool = False  # the worker copies its blocks itself (kvdepot.engine_copy)


@dataclass
class KvDepotMetadata(KVConnectorMetadata):
    engine_key: str = ""  # the engine's key at the daemon: a worker that did not join it yet joins it
    step: int = 0  # the client's step number when stores wait on this step's forward (else 0)
    loads: list[LoadJob] = field(default_factory=list)
    finished: dict[str, bool] = field(default_factory=dict)  # delayed request -> the daemon still holds it
    preempted_ops: dict[str, list[int]] = field(default_factory=dict)  # ops that may still read freed blocks


@dataclass
class KvDepotWorkerMetadata(KVConnectorWorkerMetadata):
    completed: set[int] = field(default_factory=set)  # op ids that ended (every rank hears of each)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KvDepotWorkerMetadata):
            return KvDepotWorkerMetadata(self.completed | other.completed)
        return self


def layout_of(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> tuple[KvLayout | None, str]:
    """The engine's KvLayout, the same in every process (both roles derive it from kv_cache_config),
    or None and the reason when kvdepot cannot serve this model."""
    from vllm.platforms import current_platform
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        return None, f"the model has {len(groups)} KV cache groups; kvdepot serves plain attention models (one group)"
    spec = groups[0].kv_cache_spec
    if type(spec) is not FullAttentionSpec or isinstance(spec, MLAAttentionSpec) or getattr(spec, "sliding_window", None):
        return None, f"KV cache spec {type(spec).__name__} is not plain full attention"
    if spec.dtype not in _DTYPES:
        return None, f"KV cache dtype {spec.dtype} is not supported (float16, bfloat16, float32)"
    pc = vllm_config.parallel_config
    if pc.pipeline_parallel_size != 1:
        return None, "pipeline parallelism is not supported yet"
    layout = KvLayout(
        num_layers=len(groups[0].layer_names),
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        dtype=_DTYPES[spec.dtype],
        block_size=spec.block_size,
        world_size=pc.tensor_parallel_size,
        kind="vllm_cpu" if current_platform.is_cpu() else "vllm_flash",
    )
    try:
        layout.validate()
    except ValueError as e:
        return None, str(e)
    return layout, ""
