"""Stand-ins for TensorRT-LLM's KV cache connector API, for integrators and tests where
`tensorrt_llm` cannot be imported (its wheel needs CUDA at import; PyPI has only a stub).

Written from `tensorrt_llm/_torch/pyexecutor/kv_cache_connector.py` (later
`.../connectors/kv_cache_connector.py`), field for field and method for method:
RequestData, SchedulerOutput, KvCacheConnectorScheduler and KvCacheConnectorWorker (the two
abstract bases a connector subclasses) as the newest release recorded in
tests/trtllm/trtllm_api_record.json has them, plus the few engine objects a connector reads:
LlmRequest (the C++ binding's request_id, get_tokens, context positions, multimodal and salt
fields, lora_task_id), the LLM arguments (kv_cache_config, kv_connector_config,
scheduler_config, parallel sizes, ...), mpi_rank() and mpi_broadcast().
tests/trtllm/test_conformance.py holds them to that record (transcribed from TensorRT-LLM's
sources at named commits), and compares them with the real module wherever it imports.

kvdepot.testing.trtllm_executor replays TensorRT-LLM's scheduling loop over these.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

# -- the connector API (kv_cache_connector.py) ---------------------------------------------------


@dataclass
class RequestData:
    """One request in a SchedulerOutput: deltas since its last emission (the first emission of a
    request carries its whole prompt and every block)."""

    request_id: int
    new_tokens: list[int]
    new_block_ids: list[int]
    computed_position: int  # tokens with valid KV (a new request's synchronous connector load not counted)
    num_scheduled_tokens: int
    block_hashes: list[int] = field(default_factory=list)  # newer releases
    priorities: list[int] | None = None  # newer releases
    cache_salt: str | None = None  # newer releases (one release had cache_salt_id: int)
    new_block_ids_by_layer_group: list[list[int]] = field(default_factory=list)  # newer releases: one list per layer group


@dataclass
class SchedulerOutput:
    new_requests: list[RequestData] = field(default_factory=list)
    cached_requests: list[RequestData] = field(default_factory=list)
    attention_dp_rank: int | None = None  # newest releases: the owner of the block ids under attention DP


def _flat_form_unavailable(flat: str, grouped: str) -> Callable[..., Any]:
    def unavailable(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} implements {grouped}, not {flat}")

    unavailable.__name__ = unavailable.__qualname__ = flat
    return unavailable


def _satisfy_flat_abstracts(cls: type, base: type, pairs: dict[str, str]) -> None:
    """A subclass that overrides the per-layer-group form of a callback needs no flat form (the
    newest release's __init_subclass__ does this, before ABCMeta collects the abstract methods)."""
    for flat, grouped in pairs.items():
        if getattr(cls, grouped, None) is getattr(base, grouped):
            continue
        if getattr(getattr(cls, flat, None), "__isabstractmethod__", False):
            setattr(cls, flat, _flat_form_unavailable(flat, grouped))


class KvCacheLayout:
    """The newest releases' description of the KV cache pools (register_kv_cache_layout): one
    layer group of one region is one pool tensor, as register_kv_caches has always received."""

    def __init__(self, groups: list[list[torch.Tensor]]) -> None:
        self.groups = groups  # per layer group, its regions (each a pool tensor here)

    def as_single_pool_tensor(self) -> torch.Tensor | None:
        return self.groups[0][0] if len(self.groups) == 1 and len(self.groups[0]) == 1 else None


class KvCacheConnectorWorker(ABC):
    supports_attention_dp: bool = False

    def __init__(self, llm_args: Any):
        self._llm_args = llm_args
        self._metadata: object = None
        super().__init__()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _satisfy_flat_abstracts(cls, KvCacheConnectorWorker, {"register_kv_caches": "register_kv_cache_layout"})

    def bind_connector_meta(self, metadata: object) -> None:
        self._metadata = metadata

    def get_connector_meta(self) -> object:
        return self._metadata

    def _clear_connector_meta(self) -> None:
        self._metadata = None

    def register_forward_pass_callable(self) -> Callable[..., Any] | None:
        """Called once; the callable it returns runs at the end of each forward pass, on the forward's stream."""
        return None

    @abstractmethod
    def register_kv_caches(self, kv_cache_tensor: torch.Tensor) -> None: ...

    def register_kv_cache_layout(self, layout: KvCacheLayout) -> None:
        """Called instead of register_kv_caches by the newest releases' cache manager; a cache one
        pool tensor describes goes to register_kv_caches, any other cannot be registered this way."""
        tensor = layout.as_single_pool_tensor()
        if tensor is None:
            raise NotImplementedError(f"{type(self).__name__} does not implement register_kv_cache_layout, and this KV cache is not one pool tensor")
        self.register_kv_caches(tensor)

    @abstractmethod
    def start_load_kv(self, stream: Any) -> None: ...

    @abstractmethod
    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None: ...

    @abstractmethod
    def save_kv_layer(self, layer_idx: int, stream: Any) -> None: ...

    @abstractmethod
    def wait_for_save(self, stream: Any) -> None: ...

    @abstractmethod
    def get_finished(self, finished_gen_req_ids: list[int], started_loading_req_ids: list[int]) -> tuple[list[int], list[int]]: ...


class KvCacheConnectorScheduler(ABC):
    supports_attention_dp: bool = False

    def __init__(self, llm_args: Any):
        self._llm_args = llm_args
        super().__init__()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _satisfy_flat_abstracts(
            cls, KvCacheConnectorScheduler,
            {"request_finished": "request_finished_by_layer_group", "update_state_after_alloc": "update_state_after_alloc_by_layer_group"},
        )

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> object: ...

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]: ...

    @abstractmethod
    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool: ...

    def request_finished_by_layer_group(self, request: Any, cache_block_ids_by_layer_group: list[list[int]]) -> bool:
        if len(cache_block_ids_by_layer_group) != 1:
            raise NotImplementedError(f"{type(self).__name__} does not implement request_finished_by_layer_group")
        return self.request_finished(request, cache_block_ids_by_layer_group[0])

    @abstractmethod
    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None: ...

    def update_state_after_alloc_by_layer_group(self, request: Any, block_ids_by_layer_group: list[list[int]]) -> None:
        if len(block_ids_by_layer_group) != 1:
            raise NotImplementedError(f"{type(self).__name__} does not implement update_state_after_alloc_by_layer_group")
        self.update_state_after_alloc(request, block_ids_by_layer_group[0])

    def wait_for_initialization(self) -> None:
        """Called once on rank 0 after every rank registered its KV caches, before the engine serves."""


# -- the engine objects a connector reads ---------------------------------------------------------


class LlmRequestState(enum.Enum):
    CONTEXT_INIT = "CONTEXT_INIT"
    GENERATION_IN_PROGRESS = "GENERATION_IN_PROGRESS"
    GENERATION_COMPLETE = "GENERATION_COMPLETE"
    DISAGG_GENERATION_TRANS_IN_PROGRESS = "DISAGG_GENERATION_TRANS_IN_PROGRESS"  # parked: its KV loads asynchronously
    DISAGG_CONTEXT_TRANS_IN_PROGRESS = "DISAGG_CONTEXT_TRANS_IN_PROGRESS"  # finished: its KV still saving


class LlmRequest:
    """The part of TensorRT-LLM's LlmRequest a connector reads (beam width 1): the C++ binding's
    attributes (get_num_new_matched_tokens gets the binding's object, which has no py_* ones; a
    release binds cache_salt_id, the newest passes cache_salt), None where unset."""

    def __init__(
        self, request_id: int, prompt: list[int], max_new_tokens: int, *, cache_salt: str | None = None,
        cache_salt_id: int | None = None, lora_task_id: int | None = None,
    ):
        self.request_id = request_id
        self._tokens = list(prompt)
        self.prompt_len = len(prompt)
        self.py_orig_prompt_len = len(prompt)  # a replayed request's context grows; this does not
        self.max_new_tokens = max_new_tokens
        self.cache_salt = cache_salt
        self.cache_salt_id = cache_salt_id
        self.lora_task_id = lora_task_id
        self.multimodal_hashes: list[list[int]] | None = None
        self.multimodal_positions: list[int] | None = None
        self.multimodal_lengths: list[int] | None = None
        self.prompt_embedding_table: torch.Tensor | None = None
        # The Python subclass's, newer releases; KVCacheManagerV2 sets what it took, and the older
        # cache manager sets it on the C++ binding's object only: here it stays 0, as it does there.
        self.py_num_connector_matched_tokens = 0
        self.state = LlmRequestState.CONTEXT_INIT
        self.context_current_position = 0
        self.context_chunk_size = len(prompt)
        self.is_generation_only_request = False

    def get_tokens(self, beam: int) -> list[int]:
        assert beam == 0, "beam width 1"
        return list(self._tokens)

    def add_new_token(self, token: int, beam: int) -> None:
        self._tokens.append(token)

    @property
    def context_remaining_length(self) -> int:
        return self.prompt_len - self.context_current_position


@dataclass
class KvCacheConfig:
    tokens_per_block: int = 32
    enable_block_reuse: bool = True
    enable_partial_reuse: bool = False


@dataclass
class KvCacheConnectorConfig:
    """llm_args.kv_connector_config: the newest releases' fields (older ones have the three class
    fields only, all required)."""

    connector: str | None = None  # a preset name (lmcache, kvbm) that fills the three below
    connector_module: str | None = None
    connector_scheduler_class: str | None = None
    connector_worker_class: str | None = None
    server_url: str | None = None  # "e.g. 'tcp://localhost:5555'": for connectors with a server of their own


@dataclass
class SchedulerConfig:
    capacity_scheduler_policy: str = "GUARANTEED_NO_EVICT"


@dataclass
class TorchLlmArgs:
    model: str = "model"
    backend: str = "pytorch"
    kv_cache_config: KvCacheConfig = field(default_factory=KvCacheConfig)
    kv_connector_config: KvCacheConnectorConfig | None = None
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    max_beam_width: int = 1
    enable_attention_dp: bool = False


_rank = 0
_broadcast: Any = None


def mpi_rank() -> int:
    """This process's rank (the stand-in executor sets it around each rank's calls)."""
    return _rank


def mpi_broadcast(obj: Any, root: int = 0) -> Any:
    """tensorrt_llm._utils.mpi_broadcast for ranks the stand-in executor calls one after another,
    root first: the root's object, to every rank."""
    global _broadcast
    if _rank == root:
        _broadcast = obj
    return _broadcast


def set_rank(rank: int) -> None:
    global _rank
    _rank = rank
