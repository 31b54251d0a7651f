"""What the connector's two roles share: the metadata that crosses the process boundary (small,
picklable, no tensors), the engine's layout as both derive it, and the client connection."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvdepot.client import DepotClient
from kvdepot.errors import DepotError
from kvdepot.layout import KvLayout
from kvdepot.vllm.config import ConnectorConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger("kvdepot.vllm")
_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


@dataclass
class LoadJob:
    """Loads into one request's blocks: the targets vLLM counts on, and the daemon's ops for them.
    A target no successful op covered is a failed block (vLLM recomputes it)."""

    request_id: str
    targets: list[int]
    ops: dict[int, tuple[int, ...]]  # op id -> engine block ids
    deadline_ms: int  # unix ms after which no op of this job can still write (daemon deadline)
    is_async: bool


@dataclass
class KvDepotMetadata(KVConnectorMetadata):
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


def connect(cfg: ConnectorConfig, layout: KvLayout, model: str, key: str, name: str) -> DepotClient | None:
    client = DepotClient(cfg.address, deadline_s=cfg.step_timeout_ms / 1000, tls=cfg.tls(), token=cfg.token)
    try:
        engine_id = client.register_engine(
            model, layout, name=name, namespace=cfg.namespace, engine_key=key, late_load_checks=cfg.late_checks_for(layout), keep_trying=True
        )
    except DepotError as e:
        log.error("kvdepot: the daemon at %s refused the engine (%s); the connector stays off", cfg.address, e)
        client.close()
        return None
    if engine_id:  # else the client warned, naming the address, and keeps trying in the background
        log.info("kvdepot: %s connected to %s as engine %s", name, cfg.address, engine_id)
    return client
