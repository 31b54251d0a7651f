"""Engine KV layouts: validation and sizes, shared by the client and the daemon.

Primitives:
    KvLayout(...)                 frozen value type; validate() raises ValueError saying what is wrong
    KvLayout.block_bytes          bytes of one block over all layers, K and V, on one rank
    KvLayout.layout_class         key of the daemon pool the layout's blocks live in
"""

from __future__ import annotations

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
MAX_HEAD_SIZE = 4096
MAX_BLOCK_SIZE = 4096
MAX_WORLD_SIZE = 1024
MAX_BLOCK_BYTES = 1 << 31


@dataclass(frozen=True, slots=True)
class KvLayout:
    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str
    block_size: int
    world_size: int = 1

    def validate(self) -> None:
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
        """Bytes of one block on one rank: layers x (K, V) x block_size x heads x head_size x dtype."""
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_size * DTYPE_BYTES[self.dtype]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all ranks (what one host-tier block holds)."""
        return self.rank_block_bytes * self.world_size

    @property
    def layout_class(self) -> str:
        return (
            f"L{self.num_layers}xH{self.num_kv_heads}xD{self.head_size}x{self.dtype}"
            f"xB{self.block_size}xW{self.world_size}"
        )
