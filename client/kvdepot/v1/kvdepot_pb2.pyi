from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_HOST: _ClassVar[Tier]
    TIER_DISK: _ClassVar[Tier]
    TIER_REMOTE: _ClassVar[Tier]

class UpdateStyle(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    UPDATE_STYLE_UNSPECIFIED: _ClassVar[UpdateStyle]
    UPDATE_STYLE_VLLM: _ClassVar[UpdateStyle]
    UPDATE_STYLE_TRTLLM: _ClassVar[UpdateStyle]

class KvLayoutKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_LAYOUT_KIND_UNSPECIFIED: _ClassVar[KvLayoutKind]
    KV_LAYOUT_KIND_VLLM_CPU: _ClassVar[KvLayoutKind]
    KV_LAYOUT_KIND_VLLM_FLASH: _ClassVar[KvLayoutKind]
    KV_LAYOUT_KIND_CONTIGUOUS: _ClassVar[KvLayoutKind]
    KV_LAYOUT_KIND_TRTLLM: _ClassVar[KvLayoutKind]

class OpKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OP_KIND_UNSPECIFIED: _ClassVar[OpKind]
    OP_KIND_LOAD: _ClassVar[OpKind]
    OP_KIND_STORE: _ClassVar[OpKind]
TIER_UNSPECIFIED: Tier
TIER_HOST: Tier
TIER_DISK: Tier
TIER_REMOTE: Tier
UPDATE_STYLE_UNSPECIFIED: UpdateStyle
UPDATE_STYLE_VLLM: UpdateStyle
UPDATE_STYLE_TRTLLM: UpdateStyle
KV_LAYOUT_KIND_UNSPECIFIED: KvLayoutKind
KV_LAYOUT_KIND_VLLM_CPU: KvLayoutKind
KV_LAYOUT_KIND_VLLM_FLASH: KvLayoutKind
KV_LAYOUT_KIND_CONTIGUOUS: KvLayoutKind
KV_LAYOUT_KIND_TRTLLM: KvLayoutKind
OP_KIND_UNSPECIFIED: OpKind
OP_KIND_LOAD: OpKind
OP_KIND_STORE: OpKind

class KvLayout(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_size", "dtype", "block_size", "world_size", "kind", "kv_factor")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    KV_FACTOR_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str
    block_size: int
    world_size: int
    kind: KvLayoutKind
    kv_factor: int
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_size: _Optional[int] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., world_size: _Optional[int] = ..., kind: _Optional[_Union[KvLayoutKind, str]] = ..., kv_factor: _Optional[int] = ...) -> None: ...

class RegisterEngineRequest(_message.Message):
    __slots__ = ("engine_name", "model", "layout", "namespace", "update_style", "lease_ms", "engine_key", "late_load_checks", "join", "engine_copies")
    ENGINE_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    UPDATE_STYLE_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_KEY_FIELD_NUMBER: _ClassVar[int]
    LATE_LOAD_CHECKS_FIELD_NUMBER: _ClassVar[int]
    JOIN_FIELD_NUMBER: _ClassVar[int]
    ENGINE_COPIES_FIELD_NUMBER: _ClassVar[int]
    engine_name: str
    model: str
    layout: KvLayout
    namespace: str
    update_style: UpdateStyle
    lease_ms: int
    engine_key: str
    late_load_checks: bool
    join: bool
    engine_copies: bool
    def __init__(self, engine_name: _Optional[str] = ..., model: _Optional[str] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., namespace: _Optional[str] = ..., update_style: _Optional[_Union[UpdateStyle, str]] = ..., lease_ms: _Optional[int] = ..., engine_key: _Optional[str] = ..., late_load_checks: _Optional[bool] = ..., join: _Optional[bool] = ..., engine_copies: _Optional[bool] = ...) -> None: ...

class RegisterEngineResponse(_message.Message):
    __slots__ = ("engine_id", "lease_ms", "block_bytes", "host_capacity_blocks", "joined", "lanes")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    JOINED_FIELD_NUMBER: _ClassVar[int]
    LANES_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    lease_ms: int
    block_bytes: int
    host_capacity_blocks: int
    joined: bool
    lanes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, engine_id: _Optional[str] = ..., lease_ms: _Optional[int] = ..., block_bytes: _Optional[int] = ..., host_capacity_blocks: _Optional[int] = ..., joined: _Optional[bool] = ..., lanes: _Optional[_Iterable[str]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("engine_id",)
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    def __init__(self, engine_id: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("lease_expires_unix_ms",)
    LEASE_EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    lease_expires_unix_ms: int
    def __init__(self, lease_expires_unix_ms: _Optional[int] = ...) -> None: ...

class UnregisterEngineRequest(_message.Message):
    __slots__ = ("engine_id",)
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    def __init__(self, engine_id: _Optional[str] = ...) -> None: ...

class UnregisterEngineResponse(_message.Message):
    __slots__ = ("released_slots",)
    RELEASED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    released_slots: int
    def __init__(self, released_slots: _Optional[int] = ...) -> None: ...

class CpuShmHandle(_message.Message):
    __slots__ = ("path", "offset", "size", "handoff_id")
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    path: str
    offset: int
    size: int
    handoff_id: str
    def __init__(self, path: _Optional[str] = ..., offset: _Optional[int] = ..., size: _Optional[int] = ..., handoff_id: _Optional[str] = ...) -> None: ...

class CudaIpcHandle(_message.Message):
    __slots__ = ("device", "handle", "size", "offset", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    device: int
    handle: bytes
    size: int
    offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    def __init__(self, device: _Optional[int] = ..., handle: _Optional[bytes] = ..., size: _Optional[int] = ..., offset: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ...) -> None: ...

class CudaDriverHandle(_message.Message):
    __slots__ = ("device", "size", "offset", "ipc_handle", "chunks", "mapped_size")
    class Chunk(_message.Message):
        __slots__ = ("offset", "size", "handoff_id")
        OFFSET_FIELD_NUMBER: _ClassVar[int]
        SIZE_FIELD_NUMBER: _ClassVar[int]
        HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
        offset: int
        size: int
        handoff_id: str
        def __init__(self, offset: _Optional[int] = ..., size: _Optional[int] = ..., handoff_id: _Optional[str] = ...) -> None: ...
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    MAPPED_SIZE_FIELD_NUMBER: _ClassVar[int]
    device: int
    size: int
    offset: int
    ipc_handle: bytes
    chunks: _containers.RepeatedCompositeFieldContainer[CudaDriverHandle.Chunk]
    mapped_size: int
    def __init__(self, device: _Optional[int] = ..., size: _Optional[int] = ..., offset: _Optional[int] = ..., ipc_handle: _Optional[bytes] = ..., chunks: _Optional[_Iterable[_Union[CudaDriverHandle.Chunk, _Mapping]]] = ..., mapped_size: _Optional[int] = ...) -> None: ...

class KvStorage(_message.Message):
    __slots__ = ("cpu_shm", "cuda_ipc", "cuda_driver")
    CPU_SHM_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    CUDA_DRIVER_FIELD_NUMBER: _ClassVar[int]
    cpu_shm: CpuShmHandle
    cuda_ipc: CudaIpcHandle
    cuda_driver: CudaDriverHandle
    def __init__(self, cpu_shm: _Optional[_Union[CpuShmHandle, _Mapping]] = ..., cuda_ipc: _Optional[_Union[CudaIpcHandle, _Mapping]] = ..., cuda_driver: _Optional[_Union[CudaDriverHandle, _Mapping]] = ...) -> None: ...

class KvTensor(_message.Message):
    __slots__ = ("name", "storage", "storage_offset", "shape", "stride", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STORAGE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    storage: int
    storage_offset: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    stride: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, name: _Optional[str] = ..., storage: _Optional[int] = ..., storage_offset: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ..., stride: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class RegisterKvCachesRequest(_message.Message):
    __slots__ = ("engine_id", "rank", "num_blocks", "storages", "tensors", "doorbell_handoff_id", "engine_copies", "layer_rings")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STORAGES_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    DOORBELL_HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_COPIES_FIELD_NUMBER: _ClassVar[int]
    LAYER_RINGS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    rank: int
    num_blocks: int
    storages: _containers.RepeatedCompositeFieldContainer[KvStorage]
    tensors: _containers.RepeatedCompositeFieldContainer[KvTensor]
    doorbell_handoff_id: str
    engine_copies: bool
    layer_rings: bool
    def __init__(self, engine_id: _Optional[str] = ..., rank: _Optional[int] = ..., num_blocks: _Optional[int] = ..., storages: _Optional[_Iterable[_Union[KvStorage, _Mapping]]] = ..., tensors: _Optional[_Iterable[_Union[KvTensor, _Mapping]]] = ..., doorbell_handoff_id: _Optional[str] = ..., engine_copies: _Optional[bool] = ..., layer_rings: _Optional[bool] = ...) -> None: ...

class RegisterKvCachesResponse(_message.Message):
    __slots__ = ("mapped_bytes",)
    MAPPED_BYTES_FIELD_NUMBER: _ClassVar[int]
    mapped_bytes: int
    def __init__(self, mapped_bytes: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("engine_id", "request_id", "tokens", "tokens_u32le", "cache_salt", "lora_name", "device_matched_tokens", "pin_ms")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_U32LE_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PIN_MS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    request_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    tokens_u32le: bytes
    cache_salt: str
    lora_name: str
    device_matched_tokens: int
    pin_ms: int
    def __init__(self, engine_id: _Optional[str] = ..., request_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., tokens_u32le: _Optional[bytes] = ..., cache_salt: _Optional[str] = ..., lora_name: _Optional[str] = ..., device_matched_tokens: _Optional[int] = ..., pin_ms: _Optional[int] = ...) -> None: ...

class TierTokens(_message.Message):
    __slots__ = ("tier", "tokens")
    TIER_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    tokens: int
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., tokens: _Optional[int] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("matched_tokens", "by_tier", "pin_deadline_unix_ms", "total_blocks")
    MATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BY_TIER_FIELD_NUMBER: _ClassVar[int]
    PIN_DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    matched_tokens: int
    by_tier: _containers.RepeatedCompositeFieldContainer[TierTokens]
    pin_deadline_unix_ms: int
    total_blocks: int
    def __init__(self, matched_tokens: _Optional[int] = ..., by_tier: _Optional[_Iterable[_Union[TierTokens, _Mapping]]] = ..., pin_deadline_unix_ms: _Optional[int] = ..., total_blocks: _Optional[int] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("engine_id", "step", "request_ids", "is_new", "device_matched_tokens", "loaded_tokens", "computed_tokens", "scheduled_tokens", "num_new_tokens", "new_tokens", "num_new_block_ids", "new_block_ids", "cache_salt", "lora_name", "finished", "preempted", "new_tokens_u32le")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    IS_NEW_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOADED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_U32LE_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    step: int
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    is_new: _containers.RepeatedScalarFieldContainer[bool]
    device_matched_tokens: _containers.RepeatedScalarFieldContainer[int]
    loaded_tokens: _containers.RepeatedScalarFieldContainer[int]
    computed_tokens: _containers.RepeatedScalarFieldContainer[int]
    scheduled_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_new_tokens: _containers.RepeatedScalarFieldContainer[int]
    new_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: _containers.RepeatedScalarFieldContainer[str]
    lora_name: _containers.RepeatedScalarFieldContainer[str]
    finished: _containers.RepeatedScalarFieldContainer[str]
    preempted: _containers.RepeatedScalarFieldContainer[str]
    new_tokens_u32le: bytes
    def __init__(self, engine_id: _Optional[str] = ..., step: _Optional[int] = ..., request_ids: _Optional[_Iterable[str]] = ..., is_new: _Optional[_Iterable[bool]] = ..., device_matched_tokens: _Optional[_Iterable[int]] = ..., loaded_tokens: _Optional[_Iterable[int]] = ..., computed_tokens: _Optional[_Iterable[int]] = ..., scheduled_tokens: _Optional[_Iterable[int]] = ..., num_new_tokens: _Optional[_Iterable[int]] = ..., new_tokens: _Optional[_Iterable[int]] = ..., num_new_block_ids: _Optional[_Iterable[int]] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[_Iterable[str]] = ..., lora_name: _Optional[_Iterable[str]] = ..., finished: _Optional[_Iterable[str]] = ..., preempted: _Optional[_Iterable[str]] = ..., new_tokens_u32le: _Optional[bytes] = ...) -> None: ...

class Op(_message.Message):
    __slots__ = ("op_id", "kind", "request_id", "block_ids", "block_indices", "step", "deadline_unix_ms")
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDICES_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    op_id: int
    kind: OpKind
    request_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    block_indices: _containers.RepeatedScalarFieldContainer[int]
    step: int
    deadline_unix_ms: int
    def __init__(self, op_id: _Optional[int] = ..., kind: _Optional[_Union[OpKind, str]] = ..., request_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., block_indices: _Optional[_Iterable[int]] = ..., step: _Optional[int] = ..., deadline_unix_ms: _Optional[int] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("step", "ops", "delay_free")
    STEP_FIELD_NUMBER: _ClassVar[int]
    OPS_FIELD_NUMBER: _ClassVar[int]
    DELAY_FREE_FIELD_NUMBER: _ClassVar[int]
    step: int
    ops: _containers.RepeatedCompositeFieldContainer[Op]
    delay_free: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, step: _Optional[int] = ..., ops: _Optional[_Iterable[_Union[Op, _Mapping]]] = ..., delay_free: _Optional[_Iterable[str]] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("lookup", "step", "hello")
    LOOKUP_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    HELLO_FIELD_NUMBER: _ClassVar[int]
    lookup: LookupRequest
    step: StepRequest
    hello: Hello
    def __init__(self, lookup: _Optional[_Union[LookupRequest, _Mapping]] = ..., step: _Optional[_Union[StepRequest, _Mapping]] = ..., hello: _Optional[_Union[Hello, _Mapping]] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("token",)
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token: str
    def __init__(self, token: _Optional[str] = ...) -> None: ...

class HandoffRequest(_message.Message):
    __slots__ = ("token", "fds", "fetch_arena", "cuda_fds")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    FDS_FIELD_NUMBER: _ClassVar[int]
    FETCH_ARENA_FIELD_NUMBER: _ClassVar[int]
    CUDA_FDS_FIELD_NUMBER: _ClassVar[int]
    token: str
    fds: int
    fetch_arena: FetchArena
    cuda_fds: int
    def __init__(self, token: _Optional[str] = ..., fds: _Optional[int] = ..., fetch_arena: _Optional[_Union[FetchArena, _Mapping]] = ..., cuda_fds: _Optional[int] = ...) -> None: ...

class FetchArena(_message.Message):
    __slots__ = ("engine_id",)
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    def __init__(self, engine_id: _Optional[str] = ...) -> None: ...

class HandoffResponse(_message.Message):
    __slots__ = ("ids", "arena_bytes")
    IDS_FIELD_NUMBER: _ClassVar[int]
    ARENA_BYTES_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[str]
    arena_bytes: int
    def __init__(self, ids: _Optional[_Iterable[str]] = ..., arena_bytes: _Optional[int] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("lookup", "step", "hello")
    LOOKUP_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    HELLO_FIELD_NUMBER: _ClassVar[int]
    lookup: LookupResponse
    step: StepResponse
    hello: WhoAmIResponse
    def __init__(self, lookup: _Optional[_Union[LookupResponse, _Mapping]] = ..., step: _Optional[_Union[StepResponse, _Mapping]] = ..., hello: _Optional[_Union[WhoAmIResponse, _Mapping]] = ...) -> None: ...

class WorkerMessage(_message.Message):
    __slots__ = ("attach", "forward_done", "copies_done")
    class Attach(_message.Message):
        __slots__ = ("engine_id", "rank")
        ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
        RANK_FIELD_NUMBER: _ClassVar[int]
        engine_id: str
        rank: int
        def __init__(self, engine_id: _Optional[str] = ..., rank: _Optional[int] = ...) -> None: ...
    class ForwardDone(_message.Message):
        __slots__ = ("step", "cuda_event")
        STEP_FIELD_NUMBER: _ClassVar[int]
        CUDA_EVENT_FIELD_NUMBER: _ClassVar[int]
        step: int
        cuda_event: bytes
        def __init__(self, step: _Optional[int] = ..., cuda_event: _Optional[bytes] = ...) -> None: ...
    class CopiesDone(_message.Message):
        __slots__ = ("op_id", "failed", "message")
        OP_ID_FIELD_NUMBER: _ClassVar[int]
        FAILED_FIELD_NUMBER: _ClassVar[int]
        MESSAGE_FIELD_NUMBER: _ClassVar[int]
        op_id: int
        failed: _containers.RepeatedScalarFieldContainer[int]
        message: str
        def __init__(self, op_id: _Optional[int] = ..., failed: _Optional[_Iterable[int]] = ..., message: _Optional[str] = ...) -> None: ...
    ATTACH_FIELD_NUMBER: _ClassVar[int]
    FORWARD_DONE_FIELD_NUMBER: _ClassVar[int]
    COPIES_DONE_FIELD_NUMBER: _ClassVar[int]
    attach: WorkerMessage.Attach
    forward_done: WorkerMessage.ForwardDone
    copies_done: WorkerMessage.CopiesDone
    def __init__(self, attach: _Optional[_Union[WorkerMessage.Attach, _Mapping]] = ..., forward_done: _Optional[_Union[WorkerMessage.ForwardDone, _Mapping]] = ..., copies_done: _Optional[_Union[WorkerMessage.CopiesDone, _Mapping]] = ...) -> None: ...

class CopyOrder(_message.Message):
    __slots__ = ("op_id", "store", "step", "indices", "block_ids", "host_offsets")
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    HOST_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    op_id: int
    store: bool
    step: int
    indices: _containers.RepeatedScalarFieldContainer[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    host_offsets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, op_id: _Optional[int] = ..., store: _Optional[bool] = ..., step: _Optional[int] = ..., indices: _Optional[_Iterable[int]] = ..., block_ids: _Optional[_Iterable[int]] = ..., host_offsets: _Optional[_Iterable[int]] = ...) -> None: ...

class WorkerEvent(_message.Message):
    __slots__ = ("attached", "completed", "released", "copied", "orders")
    class Attached(_message.Message):
        __slots__ = ("rank",)
        RANK_FIELD_NUMBER: _ClassVar[int]
        rank: int
        def __init__(self, rank: _Optional[int] = ...) -> None: ...
    class OpCompleted(_message.Message):
        __slots__ = ("op_id", "kind", "request_id", "success", "failed_block_ids", "message")
        OP_ID_FIELD_NUMBER: _ClassVar[int]
        KIND_FIELD_NUMBER: _ClassVar[int]
        REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
        SUCCESS_FIELD_NUMBER: _ClassVar[int]
        FAILED_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
        MESSAGE_FIELD_NUMBER: _ClassVar[int]
        op_id: int
        kind: OpKind
        request_id: str
        success: bool
        failed_block_ids: _containers.RepeatedScalarFieldContainer[int]
        message: str
        def __init__(self, op_id: _Optional[int] = ..., kind: _Optional[_Union[OpKind, str]] = ..., request_id: _Optional[str] = ..., success: _Optional[bool] = ..., failed_block_ids: _Optional[_Iterable[int]] = ..., message: _Optional[str] = ...) -> None: ...
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    COPIED_FIELD_NUMBER: _ClassVar[int]
    ORDERS_FIELD_NUMBER: _ClassVar[int]
    attached: WorkerEvent.Attached
    completed: _containers.RepeatedCompositeFieldContainer[WorkerEvent.OpCompleted]
    released: _containers.RepeatedScalarFieldContainer[str]
    copied: _containers.RepeatedScalarFieldContainer[int]
    orders: _containers.RepeatedCompositeFieldContainer[CopyOrder]
    def __init__(self, attached: _Optional[_Union[WorkerEvent.Attached, _Mapping]] = ..., completed: _Optional[_Iterable[_Union[WorkerEvent.OpCompleted, _Mapping]]] = ..., released: _Optional[_Iterable[str]] = ..., copied: _Optional[_Iterable[int]] = ..., orders: _Optional[_Iterable[_Union[CopyOrder, _Mapping]]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PoolStats(_message.Message):
    __slots__ = ("layout_class", "tier", "block_bytes", "capacity_blocks", "used_blocks", "pinned_blocks", "in_flight_blocks")
    LAYOUT_CLASS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    layout_class: str
    tier: Tier
    block_bytes: int
    capacity_blocks: int
    used_blocks: int
    pinned_blocks: int
    in_flight_blocks: int
    def __init__(self, layout_class: _Optional[str] = ..., tier: _Optional[_Union[Tier, str]] = ..., block_bytes: _Optional[int] = ..., capacity_blocks: _Optional[int] = ..., used_blocks: _Optional[int] = ..., pinned_blocks: _Optional[int] = ..., in_flight_blocks: _Optional[int] = ...) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("engines", "slots", "ops_in_flight", "pools", "counters", "host_bytes", "uptime_s", "mapped_engine_bytes", "mapped_ranks", "disk_bytes", "disk_dir", "disk_recovered_blocks", "disk_recovery_dropped_blocks", "disk_recovery_s", "remote", "remote_up", "remote_queue_blocks", "remote_jobs", "oldest_op_age_ms", "oldest_ops", "recent_failures")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    OPS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    HOST_BYTES_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    MAPPED_ENGINE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAPPED_RANKS_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_DIR_FIELD_NUMBER: _ClassVar[int]
    DISK_RECOVERED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DISK_RECOVERY_DROPPED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DISK_RECOVERY_S_FIELD_NUMBER: _ClassVar[int]
    REMOTE_FIELD_NUMBER: _ClassVar[int]
    REMOTE_UP_FIELD_NUMBER: _ClassVar[int]
    REMOTE_QUEUE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_JOBS_FIELD_NUMBER: _ClassVar[int]
    OLDEST_OP_AGE_MS_FIELD_NUMBER: _ClassVar[int]
    OLDEST_OPS_FIELD_NUMBER: _ClassVar[int]
    RECENT_FAILURES_FIELD_NUMBER: _ClassVar[int]
    engines: int
    slots: int
    ops_in_flight: int
    pools: _containers.RepeatedCompositeFieldContainer[PoolStats]
    counters: _containers.ScalarMap[str, int]
    host_bytes: int
    uptime_s: float
    mapped_engine_bytes: int
    mapped_ranks: int
    disk_bytes: int
    disk_dir: str
    disk_recovered_blocks: int
    disk_recovery_dropped_blocks: int
    disk_recovery_s: float
    remote: str
    remote_up: bool
    remote_queue_blocks: int
    remote_jobs: int
    oldest_op_age_ms: int
    oldest_ops: _containers.RepeatedCompositeFieldContainer[OpInFlight]
    recent_failures: _containers.RepeatedCompositeFieldContainer[RecentFailure]
    def __init__(self, engines: _Optional[int] = ..., slots: _Optional[int] = ..., ops_in_flight: _Optional[int] = ..., pools: _Optional[_Iterable[_Union[PoolStats, _Mapping]]] = ..., counters: _Optional[_Mapping[str, int]] = ..., host_bytes: _Optional[int] = ..., uptime_s: _Optional[float] = ..., mapped_engine_bytes: _Optional[int] = ..., mapped_ranks: _Optional[int] = ..., disk_bytes: _Optional[int] = ..., disk_dir: _Optional[str] = ..., disk_recovered_blocks: _Optional[int] = ..., disk_recovery_dropped_blocks: _Optional[int] = ..., disk_recovery_s: _Optional[float] = ..., remote: _Optional[str] = ..., remote_up: _Optional[bool] = ..., remote_queue_blocks: _Optional[int] = ..., remote_jobs: _Optional[int] = ..., oldest_op_age_ms: _Optional[int] = ..., oldest_ops: _Optional[_Iterable[_Union[OpInFlight, _Mapping]]] = ..., recent_failures: _Optional[_Iterable[_Union[RecentFailure, _Mapping]]] = ...) -> None: ...

class OpInFlight(_message.Message):
    __slots__ = ("op_id", "kind", "engine_id", "request_id", "blocks", "age_ms", "state")
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    AGE_MS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    op_id: int
    kind: OpKind
    engine_id: str
    request_id: str
    blocks: int
    age_ms: int
    state: str
    def __init__(self, op_id: _Optional[int] = ..., kind: _Optional[_Union[OpKind, str]] = ..., engine_id: _Optional[str] = ..., request_id: _Optional[str] = ..., blocks: _Optional[int] = ..., age_ms: _Optional[int] = ..., state: _Optional[str] = ...) -> None: ...

class RecentFailure(_message.Message):
    __slots__ = ("unix_s", "kind", "engine_id", "message")
    UNIX_S_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    unix_s: float
    kind: str
    engine_id: str
    message: str
    def __init__(self, unix_s: _Optional[float] = ..., kind: _Optional[str] = ..., engine_id: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class EngineInfo(_message.Message):
    __slots__ = ("engine_id", "engine_name", "model", "layout", "namespace", "update_style", "slots", "lease_expires_unix_ms", "attached_ranks", "last_step", "mapped_ranks")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    UPDATE_STYLE_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_RANKS_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    MAPPED_RANKS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    engine_name: str
    model: str
    layout: KvLayout
    namespace: str
    update_style: UpdateStyle
    slots: int
    lease_expires_unix_ms: int
    attached_ranks: _containers.RepeatedScalarFieldContainer[int]
    last_step: int
    mapped_ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, engine_id: _Optional[str] = ..., engine_name: _Optional[str] = ..., model: _Optional[str] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., namespace: _Optional[str] = ..., update_style: _Optional[_Union[UpdateStyle, str]] = ..., slots: _Optional[int] = ..., lease_expires_unix_ms: _Optional[int] = ..., attached_ranks: _Optional[_Iterable[int]] = ..., last_step: _Optional[int] = ..., mapped_ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class ListEnginesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListEnginesResponse(_message.Message):
    __slots__ = ("engines",)
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    engines: _containers.RepeatedCompositeFieldContainer[EngineInfo]
    def __init__(self, engines: _Optional[_Iterable[_Union[EngineInfo, _Mapping]]] = ...) -> None: ...

class SlotSummary(_message.Message):
    __slots__ = ("request_id", "state", "tokens", "computed_tokens", "device_matched_tokens", "loaded_tokens", "stored_blocks", "ops_in_flight", "last_step")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOADED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    OPS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    state: str
    tokens: int
    computed_tokens: int
    device_matched_tokens: int
    loaded_tokens: int
    stored_blocks: int
    ops_in_flight: int
    last_step: int
    def __init__(self, request_id: _Optional[str] = ..., state: _Optional[str] = ..., tokens: _Optional[int] = ..., computed_tokens: _Optional[int] = ..., device_matched_tokens: _Optional[int] = ..., loaded_tokens: _Optional[int] = ..., stored_blocks: _Optional[int] = ..., ops_in_flight: _Optional[int] = ..., last_step: _Optional[int] = ...) -> None: ...

class ListSlotsRequest(_message.Message):
    __slots__ = ("engine_id",)
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    def __init__(self, engine_id: _Optional[str] = ...) -> None: ...

class ListSlotsResponse(_message.Message):
    __slots__ = ("slots",)
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    slots: _containers.RepeatedCompositeFieldContainer[SlotSummary]
    def __init__(self, slots: _Optional[_Iterable[_Union[SlotSummary, _Mapping]]] = ...) -> None: ...

class BlockState(_message.Message):
    __slots__ = ("index", "hash", "state", "engine_block_id", "has_engine_block")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    HAS_ENGINE_BLOCK_FIELD_NUMBER: _ClassVar[int]
    index: int
    hash: int
    state: str
    engine_block_id: int
    has_engine_block: bool
    def __init__(self, index: _Optional[int] = ..., hash: _Optional[int] = ..., state: _Optional[str] = ..., engine_block_id: _Optional[int] = ..., has_engine_block: _Optional[bool] = ...) -> None: ...

class GetSlotRequest(_message.Message):
    __slots__ = ("engine_id", "request_id")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    request_id: str
    def __init__(self, engine_id: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class GetSlotResponse(_message.Message):
    __slots__ = ("summary", "blocks")
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    summary: SlotSummary
    blocks: _containers.RepeatedCompositeFieldContainer[BlockState]
    def __init__(self, summary: _Optional[_Union[SlotSummary, _Mapping]] = ..., blocks: _Optional[_Iterable[_Union[BlockState, _Mapping]]] = ...) -> None: ...

class GetBlockRequest(_message.Message):
    __slots__ = ("engine_id", "hash")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    hash: int
    def __init__(self, engine_id: _Optional[str] = ..., hash: _Optional[int] = ...) -> None: ...

class GetBlockResponse(_message.Message):
    __slots__ = ("found", "tiers", "state", "pins", "hits", "has_parent", "parent", "children")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PINS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    HAS_PARENT_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    CHILDREN_FIELD_NUMBER: _ClassVar[int]
    found: bool
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    state: str
    pins: int
    hits: int
    has_parent: bool
    parent: int
    children: int
    def __init__(self, found: _Optional[bool] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ..., state: _Optional[str] = ..., pins: _Optional[int] = ..., hits: _Optional[int] = ..., has_parent: _Optional[bool] = ..., parent: _Optional[int] = ..., children: _Optional[int] = ...) -> None: ...

class ClearRequest(_message.Message):
    __slots__ = ("tier",)
    TIER_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class ClearResponse(_message.Message):
    __slots__ = ("dropped_blocks", "kept_blocks")
    DROPPED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KEPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    dropped_blocks: int
    kept_blocks: int
    def __init__(self, dropped_blocks: _Optional[int] = ..., kept_blocks: _Optional[int] = ...) -> None: ...

class WhoAmIRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WhoAmIResponse(_message.Message):
    __slots__ = ("tokens_required", "namespace", "admin")
    TOKENS_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    ADMIN_FIELD_NUMBER: _ClassVar[int]
    tokens_required: bool
    namespace: str
    admin: bool
    def __init__(self, tokens_required: _Optional[bool] = ..., namespace: _Optional[str] = ..., admin: _Optional[bool] = ...) -> None: ...
