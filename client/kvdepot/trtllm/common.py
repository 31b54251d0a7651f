"""What the connector's two roles share: the metadata TensorRT-LLM broadcasts from the scheduler
(rank 0) to every worker (small, picklable, no tensors), the engine's layout, and the settings."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from kvdepot.connector import config
from kvdepot.trtllm import api
from kvdepot.connector.config import ConnectorConfig
from kvdepot.connector.worker import LoadJob
from kvdepot.handles import _DTYPES
from kvdepot.layout import KvLayout

log = logging.getLogger("kvdepot.trtllm")
STYLE = "trtllm"  # the daemon reads computed_position as TensorRT-LLM means it (docs/protocol.md)


@dataclass
class TrtllmMeta:
    """One step's instructions, built on rank 0 and broadcast by TensorRT-LLM to every rank."""

    engine_key: str = ""  # the engine's key at the daemon, minted by the scheduler: each rank's worker joins it
    step: int = 0  # the client's step number when stores wait on this step's forward (else 0)
    loads: list[LoadJob] = field(default_factory=list)
    ops: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # request -> (op id, deadline ms) planned this step
    held: dict[str, bool] = field(default_factory=dict)  # request whose ops are unknown (a Step went unanswered) -> True
    forget: list[str] = field(default_factory=list)  # finished with no op running: the workers drop what they kept
    preempted_ops: dict[str, list[int]] = field(default_factory=dict)  # ops of a re-admitted request's old blocks


def settings(llm_args: Any) -> ConnectorConfig:
    """KVDEPOT_* variables and $KVDEPOT_CONNECTOR_CONFIG (kvdepot.connector.config.from_env); the
    address defaults to kv_connector_config.server_url where the release has that field. Loads
    cannot be checked after the forward (TensorRT-LLM has no way to hear of a failed load)."""
    server_url = getattr(getattr(llm_args, "kv_connector_config", None), "server_url", None)
    defaults: dict[str, Any] = {"engine_name": "trtllm", "late_load_checks": "false"}
    if server_url and "KVDEPOT_ADDRESS" not in os.environ:
        defaults["address"] = server_url
    cfg = config.from_env(os.environ, **defaults)
    if cfg.late_load_checks == "true":
        raise ValueError("kvdepot: late_load_checks cannot be on with TensorRT-LLM: it has no way to hear that a checked load failed")
    cfg = dataclasses.replace(cfg, late_load_checks="false")  # "auto" too
    if cfg.load_async and not keeps_cancelled_loads():
        log.warning(
            "kvdepot: load_async is off: this TensorRT-LLM frees a request cancelled while it loads asynchronously without "
            "waiting for the load, which would then write into another request's blocks (its newest releases wait)"
        )
        cfg = dataclasses.replace(cfg, load_async=False)
    return cfg


def keeps_cancelled_loads() -> bool:
    """TensorRT-LLM keeps a request cancelled during an async load allocated until the load is
    reported (its connector manager's has_pending_transfers; the stand-ins do too)."""
    return hasattr(api.api.KvCacheConnectorManager, "has_pending_transfers") if api.real else True


def model_of(llm_args: Any) -> str:
    return str(getattr(llm_args, "model", "") or "model")


def check_args(llm_args: Any) -> str:
    """Why kvdepot cannot serve this engine, or "": the limits of TensorRT-LLM's connector API that
    its releases enforce unevenly, and kvdepot's own (docs/trtllm.md lists them)."""
    kv = getattr(llm_args, "kv_cache_config", None)
    policy = getattr(getattr(llm_args, "scheduler_config", None), "capacity_scheduler_policy", None)
    if getattr(llm_args, "backend", "pytorch") not in (None, "pytorch"):
        return f"the connector API needs the PyTorch backend, not {llm_args.backend!r}"
    if kv is not None and getattr(kv, "enable_block_reuse", True) is False:
        return (
            "kv_cache_config.enable_block_reuse is false: TensorRT-LLM then never asks a connector for a match, so "
            "nothing could be loaded (set kv_cache_config.enable_block_reuse: true; kvdepot adds tiers below that cache)"
        )
    if policy is not None and str(getattr(policy, "name", policy)).rsplit(".", 1)[-1] != "GUARANTEED_NO_EVICT":
        return f"the capacity scheduler policy is {policy}; TensorRT-LLM's connector API needs GUARANTEED_NO_EVICT"
    if int(getattr(llm_args, "pipeline_parallel_size", 1) or 1) != 1:
        return "pipeline parallelism is not supported (TensorRT-LLM's connector API refuses it too)"
    if int(getattr(llm_args, "max_beam_width", 1) or 1) != 1:
        return "beam width must be 1"
    if getattr(llm_args, "enable_attention_dp", False):
        return "attention data parallelism is not supported (each rank would own its own requests and blocks)"
    return ""


def layout_of(pool: torch.Tensor, llm_args: Any) -> KvLayout:
    """The layout of TensorRT-LLM's primary pool [num_blocks, layers, kv_factor, heads *
    tokens_per_block * head_dim]: the pool folds heads and head_dim, so the layout has one head of
    heads * head_dim (the bytes of a block are what count; the model's name keeps different
    models apart). Raises ValueError saying what does not fit."""
    if pool.dim() != 4:
        raise ValueError(f"the KV pool has shape {list(pool.shape)}; TensorRT-LLM's is [blocks, layers, kv_factor, elements]")
    if pool.dtype not in _DTYPES:
        raise ValueError(f"KV cache dtype {pool.dtype} cannot be shared")
    tpb = int(llm_args.kv_cache_config.tokens_per_block)
    _, layers, kv_factor, per_block = (int(d) for d in pool.shape)
    if per_block % tpb:
        raise ValueError(f"a block's {per_block} elements per layer are not a multiple of tokens_per_block {tpb}")
    layout = KvLayout(
        num_layers=layers, num_kv_heads=1, head_size=per_block // tpb, dtype=_DTYPES[pool.dtype], block_size=tpb,
        world_size=int(getattr(llm_args, "tensor_parallel_size", 1) or 1), kind="trtllm", kv_factor=kv_factor,
    )
    layout.validate()
    return layout
