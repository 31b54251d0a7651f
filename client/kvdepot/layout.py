"""Engine KV layouts: validation and sizes, shared by the client and the daemon.

Primitives:
    KvLayout(...)                 frozen value type; validate() raises ValueError saying what is wrong
    KvLayout.block_bytes          bytes of one block over all layers, K and V, on one rank
    KvLayout.layout_class         key of the daemon pool the layout's blocks live in
    tensor_shapes(layout, n)      the shapes an engine of this kind registers for n blocks
    block_regions(layout, tensors) where one block lives in those tensors: contiguous runs, in the
                                  order they are laid out in a host-tier block

Kinds (how the engine lays out KV): "none" (no tensors: the daemon keeps the books only),
"vllm_cpu" (per layer [num_blocks, kv_heads, block_size, 2*head_size]), "vllm_flash" (per layer
[2, num_blocks, block_size, kv_heads, head_size]), "contiguous" (one tensor
[num_blocks, layers, kv_factor, block_size, kv_heads, head_size]) and "trtllm" (TensorRT-LLM's
primary pool as its connector receives it: one tensor [num_blocks, layers, kv_factor,
kv_heads * block_size * head_size]). A host-tier block keeps the engine's own per-block byte
order, so each region is one memcpy each way.

kv_factor is 2 (K and V) or 1 (K only, as MLA models keep their compressed latent); only the
one-tensor kinds may have 1, and it is part of the layout class, so K-only blocks are never
shared with K-and-V blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

DTYPE_BYTES: dict[str, int] = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

MAX_LAYERS = 1024
MAX_HEADS = 1024
MAX_HEAD_SIZE = 65536  # TensorRT-LLM's pool folds the heads: a layout from it has 1 head of heads x head_dim
MAX_BLOCK_SIZE = 4096
MAX_WORLD_SIZE = 1024
MAX_BLOCK_BYTES = 1 << 31
KINDS = ("none", "vllm_cpu", "vllm_flash", "contiguous", "trtllm")


@dataclass(frozen=True, slots=True)
class KvLayout:
    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str
    block_size: int
    world_size: int = 1
    kind: str = "none"
    kv_factor: int = 2  # 2: K and V; 1: K only (MLA)

    def validate(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"layout.kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.kv_factor not in (1, 2):
            raise ValueError(f"layout.kv_factor must be 1 (K only) or 2 (K and V), got {self.kv_factor}")
        if self.kv_factor == 1 and self.kind.startswith("vllm"):
            raise ValueError(f"a {self.kind} layout holds K and V (kv_factor 2)")
        limits = (
            ("num_layers", self.num_layers, MAX_LAYERS),
            ("num_kv_heads", self.num_kv_heads, MAX_HEADS),
            ("head_size", self.head_size, MAX_HEAD_SIZE),
            ("block_size", self.block_size, MAX_BLOCK_SIZE),
            ("world_size", self.world_size, MAX_WORLD_SIZE),
        )
        for name, value, high in limits:
            if not 1 <= value <= high:
                raise ValueError(f"layout.{name} must be in [1, {high}], got {value}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"layout.dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        if self.rank_block_bytes > MAX_BLOCK_BYTES:
            raise ValueError(f"one block would take {self.rank_block_bytes} bytes per rank, over {MAX_BLOCK_BYTES}")

    @property
    def rank_block_bytes(self) -> int:
        """Bytes of one block on one rank: layers x kv_factor x block_size x heads x head_size x dtype."""
        return self.num_layers * self.kv_factor * self.block_size * self.num_kv_heads * self.head_size * DTYPE_BYTES[self.dtype]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all ranks (what one host-tier block holds)."""
        return self.rank_block_bytes * self.world_size

    @property
    def layout_class(self) -> str:
        return (
            f"L{self.num_layers}xH{self.num_kv_heads}xD{self.head_size}x{self.dtype}"
            f"xB{self.block_size}xW{self.world_size}" + ("xK1" if self.kv_factor == 1 else "") + ("" if self.kind == "none" else f"-{self.kind}")
        )

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """A registered tensor as a view: shape and stride in elements, offset into its storage."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int = 0


@dataclass(frozen=True, slots=True)
class Region:
    """One contiguous run of a block inside a tensor: block b starts at element
    tensor.storage_offset + offset + b * block_stride and runs `length` elements."""

    tensor: int
    offset: int
    block_stride: int
    length: int


def tensor_shapes(layout: KvLayout, num_blocks: int) -> list[tuple[int, ...]]:
    L, H, D, bs = layout.num_layers, layout.num_kv_heads, layout.head_size, layout.block_size
    if layout.kind == "vllm_cpu":
        return [(num_blocks, H, bs, 2 * D)] * L
    if layout.kind == "vllm_flash":
        return [(2, num_blocks, bs, H, D)] * L
    if layout.kind == "contiguous":
        return [(num_blocks, L, layout.kv_factor, bs, H, D)]
    if layout.kind == "trtllm":
        return [(num_blocks, L, layout.kv_factor, H * bs * D)]
    raise ValueError(f"a {layout.kind!r} layout registers no tensors")


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def block_regions(layout: KvLayout, tensors: Sequence[TensorMeta], num_blocks: int) -> list[Region]:
    """Checks the tensors against the layout (ValueError says what differs) and returns the regions
    of one block in host-block order; their lengths add up to the layout's per-rank block size."""
    want = tensor_shapes(layout, num_blocks)
    if len(tensors) != len(want):
        raise ValueError(f"a {layout.kind} layout with {layout.num_layers} layers registers {len(want)} tensors, got {len(tensors)}")
    regions: list[Region] = []
    for i, (t, shape) in enumerate(zip(tensors, want)):
        if tuple(t.shape) != shape:
            raise ValueError(f"tensor {i} has shape {list(t.shape)}, the layout needs {list(shape)}")
        if len(t.stride) != len(shape):
            raise ValueError(f"tensor {i} has {len(t.stride)} strides for {len(shape)} dimensions")
        if layout.kind == "vllm_flash":
            inner = shape[2:]
            if tuple(t.stride[2:]) != _contiguous_strides(inner):
                raise ValueError(f"tensor {i}: each block's [block_size, heads, head_size] must be contiguous")
            n = inner[0] * inner[1] * inner[2]
            regions.append(Region(i, 0, t.stride[1], n))  # K
            regions.append(Region(i, t.stride[0], t.stride[1], n))  # V
        else:
            inner = shape[1:]
            if tuple(t.stride[1:]) != _contiguous_strides(inner):
                raise ValueError(f"tensor {i}: each block's {list(inner)} must be contiguous")
            n = 1
            for d in inner:
                n *= d
            regions.append(Region(i, 0, t.stride[0], n))
    total = sum(r.length for r in regions) * layout.dtype_bytes
    assert total == layout.rank_block_bytes, (total, layout.rank_block_bytes)
    return regions
