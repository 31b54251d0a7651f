"""FakeKv: real KV tensors in an engine layout, written by a fake "forward" with a deterministic
function of (token, position, layer, K/V, head, dim, rank), so any block that comes back from the
daemon can be checked byte for byte.

Layouts (kvdepot.layout): vllm_cpu keeps every layer as a view into one shared storage, as vLLM's
CPU backend does; vllm_flash has one tensor per layer; contiguous one tensor for all layers;
trtllm TensorRT-LLM's pool [blocks, layers, kv_factor, heads * block_size * head_size] (each
layer's K or V heads-major, [heads, block_size, head_size], as TensorRT-LLM keeps a block).
kv_factor 1 (K only) writes and checks K alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvdepot import handles
from kvdepot.layout import KvLayout
from kvdepot.v1 import kvdepot_pb2 as pb

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
POISON = -1.0  # what fresh blocks hold: a load that did not happen shows up


class FakeKv:
    def __init__(self, layout: KvLayout, num_blocks: int, device: str = "cpu", alloc: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None) -> None:
        """`alloc(shape, dtype)`: where a TensorRT-LLM pool's memory comes from (another allocator
        than torch's: bench/gpu_trtllm.py); its tensor is filled here."""
        self.alloc = alloc
        self.layout = layout
        self.num_blocks = num_blocks
        self.dtype = TORCH_DTYPES[layout.dtype]
        self.device = torch.device(device)  # cuda: the pool an engine exports with CUDA IPC handles
        self.ranks: list[list[torch.Tensor]] = [self._alloc() for _ in range(layout.world_size)]
        self.requests: list[pb.RegisterKvCachesRequest] = []
        self.paths: list[str] = []
        self.fds: list[list[int]] = []

    def _alloc(self) -> list[torch.Tensor]:
        L, H, D, bs, nb, dt = self.layout.num_layers, self.layout.num_kv_heads, self.layout.head_size, self.layout.block_size, self.num_blocks, self.dtype
        if self.layout.kind == "vllm_cpu":
            whole = torch.full((L, nb, H, bs, 2 * D), POISON, dtype=dt, device=self.device)
            return [whole[l] for l in range(L)]  # views into one storage
        if self.layout.kind == "vllm_flash":
            return [torch.full((2, nb, bs, H, D), POISON, dtype=dt, device=self.device) for _ in range(L)]
        if self.layout.kind == "contiguous":
            return [torch.full((nb, L, self.layout.kv_factor, bs, H, D), POISON, dtype=dt, device=self.device)]
        if self.layout.kind == "trtllm":
            shape = (nb, L, self.layout.kv_factor, H * bs * D)
            return [self.alloc(shape, dt).fill_(POISON) if self.alloc is not None else torch.full(shape, POISON, dtype=dt, device=self.device)]
        raise ValueError(f"FakeKv needs a layout with tensors, not {self.layout.kind!r}")

    def share(self, memfd: bool = False) -> list[pb.RegisterKvCachesRequest]:
        """Moves every rank's tensors onto /dev/shm files (or sealed memfds: their descriptors are
        in `fds`, per rank) and returns their registrations."""
        for tensors in self.ranks:
            if memfd:
                req, fds = handles.share_cpu_tensors_memfd(tensors, self.num_blocks)
                self.fds.append(fds)
            else:
                req, paths = handles.share_cpu_tensors(tensors, self.num_blocks)
                self.paths += paths
            self.requests.append(req)
        return self.requests

    def close(self) -> None:
        handles.remove_shm_files(self.paths)
        self.paths = []
        for fds in self.fds:
            handles.close_fds(fds)
        self.fds = []

    # -- values ---------------------------------------------------------------------------------
    def expected(self, tokens: list[int], positions: range, rank: int) -> torch.Tensor:
        """[n, layers, kv_factor, heads, head_size] values the forward writes for these positions."""
        L, H, D = self.layout.num_layers, self.layout.num_kv_heads, self.layout.head_size
        tok = torch.tensor([tokens[p] for p in positions], dtype=torch.int64).view(-1, 1, 1, 1, 1)
        pos = torch.tensor(list(positions), dtype=torch.int64).view(-1, 1, 1, 1, 1)
        layer = torch.arange(L).view(1, L, 1, 1, 1)
        kvf = self.layout.kv_factor
        kv = torch.arange(kvf).view(1, 1, kvf, 1, 1)
        head = torch.arange(H).view(1, 1, 1, H, 1)
        dim = torch.arange(D).view(1, 1, 1, 1, D)
        v = (tok * 31 + pos * 7 + layer * 13 + kv * 5 + head * 3 + dim + rank * 11) % 251
        return (v.to(torch.float32) / 8).to(self.dtype).to(self.device)  # multiples of 1/8 below 32: exact in fp16

    def _index(self, table: list[int], positions: range) -> tuple[torch.Tensor, torch.Tensor]:
        bs = self.layout.block_size
        blk = torch.tensor([table[p // bs] for p in positions], dtype=torch.int64, device=self.device)
        off = torch.tensor([p % bs for p in positions], dtype=torch.int64, device=self.device)
        return blk, off

    def write(self, table: list[int], tokens: list[int], positions: range) -> None:
        if not len(positions):
            return
        blk, off = self._index(table, positions)
        D = self.layout.head_size
        for rank, tensors in enumerate(self.ranks):
            val = self.expected(tokens, positions, rank)  # [n, L, 2, H, D]
            for l in range(self.layout.num_layers):
                if self.layout.kind == "vllm_cpu":
                    tensors[l][blk, :, off, :D] = val[:, l, 0]
                    tensors[l][blk, :, off, D:] = val[:, l, 1]
                elif self.layout.kind == "vllm_flash":
                    tensors[l][0, blk, off] = val[:, l, 0]
                    tensors[l][1, blk, off] = val[:, l, 1]
                else:
                    pool = self._blocks_view(tensors[0])
                    for kv in range(self.layout.kv_factor):
                        pool[blk, l, kv, off] = val[:, l, kv]

    def read(self, table: list[int], positions: range, rank: int) -> torch.Tensor:
        blk, off = self._index(table, positions)
        D = self.layout.head_size
        tensors = self.ranks[rank]
        per_layer = []
        for l in range(self.layout.num_layers):
            if self.layout.kind == "vllm_cpu":
                k, v = tensors[l][blk, :, off, :D], tensors[l][blk, :, off, D:]
            elif self.layout.kind == "vllm_flash":
                k, v = tensors[l][0, blk, off], tensors[l][1, blk, off]
            else:
                pool = self._blocks_view(tensors[0])
                per_layer.append(torch.stack([pool[blk, l, kv, off] for kv in range(self.layout.kv_factor)], dim=1))
                continue
            per_layer.append(torch.stack([k, v], dim=1))
        return torch.stack(per_layer, dim=1)

    def _blocks_view(self, t: torch.Tensor) -> torch.Tensor:
        """The one-tensor pool as [blocks, layers, kv, block_size, heads, head_size] (a view: the
        trtllm kind's last dimension is heads-major, [heads, block_size, head_size])."""
        if self.layout.kind == "contiguous":
            return t
        nb, L, kvf = t.shape[:3]
        return t.view(nb, L, kvf, self.layout.num_kv_heads, self.layout.block_size, self.layout.head_size).transpose(3, 4)

    def mismatches(self, table: list[int], tokens: list[int], end: int) -> list[int]:
        """Positions in [0, end) whose KV differs from what the forward writes (any rank)."""
        if end == 0:
            return []
        positions = range(end)
        bad: set[int] = set()
        for rank in range(len(self.ranks)):
            diff = (self.read(table, positions, rank) != self.expected(tokens, positions, rank)).flatten(1).any(dim=1)
            bad.update(int(i) for i in diff.nonzero().flatten())
        return sorted(bad)

    def poison(self, blocks: list[int]) -> None:
        if not blocks:
            return
        idx = torch.tensor(blocks, dtype=torch.int64, device=self.device)
        for tensors in self.ranks:
            for l, t in enumerate(tensors):
                if self.layout.kind == "vllm_cpu":
                    t[idx] = POISON
                elif self.layout.kind == "vllm_flash":
                    t[:, idx] = POISON
                else:
                    t[idx] = POISON
