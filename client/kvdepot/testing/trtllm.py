"""Stand-ins for TensorRT-LLM's KV cache connector API, for integrators and tests where
`tensorrt_llm` cannot be imported (its wheel needs CUDA at import; PyPI has only a stub).

Written from `tensorrt_llm/_torch/pyexecutor/kv_cache_connector.py` (later
`.../connectors/kv_cache_connector.py`), field for field and method for method:
RequestData, SchedulerOutput, KvCacheConnectorScheduler and KvCacheConnectorWorker (the two
abstract bases a connector subclasses), plus the few engine objects a connector reads:
LlmRequest (request_id, get_tokens, context positions, cache_salt, lora_task_id), the LLM
arguments (kv_cache_config.tokens_per_block, tensor_parallel_size, ...) and mpi_rank().
tests/trtllm/test_conformance.py compares them with the real module wherever it imports.

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
    cache_salt: str | None = None  # newer releases


@dataclass
class SchedulerOutput:
    new_requests: list[RequestData] = field(default_factory=list)
    cached_requests: list[RequestData] = field(default_factory=list)


class KvCacheConnectorWorker(ABC):
    def __init__(self, llm_args: Any):
        self._llm_args = llm_args
        self._metadata: object = None
        super().__init__()

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
    def __init__(self, llm_args: Any):
        self._llm_args = llm_args
        super().__init__()

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> object: ...

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]: ...

    @abstractmethod
    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool: ...

    @abstractmethod
    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None: ...


# -- the engine objects a connector reads ---------------------------------------------------------


class LlmRequestState(enum.Enum):
    CONTEXT_INIT = "CONTEXT_INIT"
    GENERATION_IN_PROGRESS = "GENERATION_IN_PROGRESS"
    GENERATION_COMPLETE = "GENERATION_COMPLETE"
    DISAGG_GENERATION_TRANS_IN_PROGRESS = "DISAGG_GENERATION_TRANS_IN_PROGRESS"  # parked: its KV loads asynchronously
    DISAGG_CONTEXT_TRANS_IN_PROGRESS = "DISAGG_CONTEXT_TRANS_IN_PROGRESS"  # finished: its KV still saving


class LlmRequest:
    """The part of TensorRT-LLM's LlmRequest a connector reads (beam width 1)."""

    def __init__(self, request_id: int, prompt: list[int], max_new_tokens: int, *, cache_salt: str | None = None, lora_task_id: int | None = None):
        self.request_id = request_id
        self._tokens = list(prompt)
        self.prompt_len = len(prompt)
        self.py_orig_prompt_len = len(prompt)  # a replayed request's context grows; this does not
        self.max_new_tokens = max_new_tokens
        self.cache_salt = cache_salt
        self.lora_task_id = lora_task_id
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


@dataclass
class KvCacheConnectorConfig:
    connector_module: str
    connector_scheduler_class: str
    connector_worker_class: str


@dataclass
class TorchLlmArgs:
    model: str = "model"
    backend: str = "pytorch"
    kv_cache_config: KvCacheConfig = field(default_factory=KvCacheConfig)
    kv_connector_config: KvCacheConnectorConfig | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    max_beam_width: int = 1


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
