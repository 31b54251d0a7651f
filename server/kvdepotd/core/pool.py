"""Fixed-slab pool accounting for one tier.

Primitives:
    SlabBudget(total_bytes, slab_bytes)   the tier's byte budget, handed out in slabs
    PrivateSpace(budget)                  slabs counted against a budget, placed in memory of their own
    BlockPool(layout_class, block_bytes, budget)
        allocate() -> CellId | None      O(1); None when neither a free cell nor a new slab is left
        take(cells) -> bool              marks given cells used (recovery of a persistent tier)
        free(cell)                       O(1); freeing a free cell asserts (no double free)
        byte_offset(cell) -> int         where the cell's bytes start in the tier
        num_cells / num_free / num_used / capacity_blocks / max_blocks

A slab holds `blocks_per_slab` blocks of one layout class, so all blocks of a pool have one size:
no fragmentation, and a cell id maps to (slab, offset) by division. Slabs are claimed lazily, so
several layout classes share one budget. Slabs are not returned to the budget (classes are few
and long-lived). Eviction is not the pool's business: the registry frees cells.
"""

from __future__ import annotations

from typing import NewType

CellId = NewType("CellId", int)


class SlabBudget:
    """A tier's byte budget. Accounting only: the bytes themselves live in storage/."""

    def __init__(self, total_bytes: int, slab_bytes: int) -> None:
        if total_bytes < 0 or slab_bytes <= 0:
            raise ValueError(f"bad tier size: total {total_bytes}, slab {slab_bytes}")
        self.total_bytes = total_bytes
        self.slab_bytes = slab_bytes
        self.used_bytes = 0
        self._next_offset = 0  # the tier's own memory: slabs of private spaces take none of it

    @property
    def free_bytes(self) -> int:
        return self.total_bytes - self.used_bytes

    def slab_size_for(self, block_bytes: int) -> tuple[int, int]:
        """(blocks per slab, slab bytes) for a block size; a block larger than a slab gets a slab of
        its own, and a tier smaller than a slab is one slab."""
        per_slab = max(1, min(self.slab_bytes, self.total_bytes) // block_bytes)
        return per_slab, per_slab * block_bytes

    def claim(self, nbytes: int) -> int | None:
        """Byte offset of a new slab of `nbytes` in the tier, or None when the budget is spent."""
        if not self.reserve(nbytes):
            return None
        offset = self._next_offset
        self._next_offset += nbytes
        return offset

    def reserve(self, nbytes: int) -> bool:
        """Counts `nbytes` against the budget without a place in the tier's own memory (a slab of a
        private space: PrivateSpace). False when the budget is spent."""
        if nbytes > self.free_bytes:
            return False
        self.used_bytes += nbytes
        return True


class PrivateSpace:
    """Slabs counted against a tier's budget but placed in memory of their own (an engine's private
    host memory, kvdepotd.core.disk.private_class): offsets from 0 in that memory."""

    def __init__(self, budget: SlabBudget) -> None:
        self._budget = budget
        self._next_offset = 0

    @property
    def total_bytes(self) -> int:
        return self._budget.total_bytes

    @property
    def free_bytes(self) -> int:
        return self._budget.free_bytes

    def slab_size_for(self, block_bytes: int) -> tuple[int, int]:
        return self._budget.slab_size_for(block_bytes)

    def claim(self, nbytes: int) -> int | None:
        if not self._budget.reserve(nbytes):
            return None
        offset = self._next_offset
        self._next_offset += nbytes
        return offset


class BlockPool:
    """Cells of one layout class in one tier."""

    def __init__(self, layout_class: str, block_bytes: int, budget: SlabBudget | PrivateSpace) -> None:
        self.layout_class = layout_class
        self.block_bytes = block_bytes
        self._budget = budget
        self.blocks_per_slab, self._slab_bytes = budget.slab_size_for(block_bytes)
        self.num_slabs = 0
        self._slab_offsets: list[int] = []  # tier byte offset of each slab
        self._free: list[CellId] = []
        self._is_free: bytearray = bytearray()  # per cell: 1 = free; guards double free

    @property
    def num_cells(self) -> int:
        return self.num_slabs * self.blocks_per_slab

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_cells - len(self._free)

    @property
    def capacity_blocks(self) -> int:
        """Cells this pool has plus those it could still claim from the budget."""
        return self.num_cells + (self._budget.free_bytes // self._slab_bytes) * self.blocks_per_slab

    @property
    def max_blocks(self) -> int:
        """Cells this pool would have with the whole tier to itself."""
        return (self._budget.total_bytes // self._slab_bytes) * self.blocks_per_slab

    def allocate(self) -> CellId | None:
        if not self._free and not self._grow():
            return None
        cell = self._free.pop()
        self._is_free[cell] = 0
        return cell

    def free(self, cell: CellId) -> None:
        assert 0 <= cell < self.num_cells and not self._is_free[cell], f"double free of cell {cell}"
        self._is_free[cell] = 1
        self._free.append(cell)

    def take(self, cells: list[CellId]) -> bool:
        """Marks `cells` used, claiming slabs up to the highest one; False (nothing taken) when the
        budget cannot hold that many slabs or a cell is already used."""
        if not cells:
            return True
        need = max(cells) // self.blocks_per_slab + 1
        while self.num_slabs < need:
            if not self._grow():
                return False
        if len(set(cells)) != len(cells) or any(s < 0 or not self._is_free[s] for s in cells):
            return False
        for s in cells:
            self._is_free[s] = 0
        self._free = [s for s in self._free if self._is_free[s]]
        return True

    def byte_offset(self, cell: CellId) -> int:
        """Where the cell's bytes start in the tier (slab offset + index * block size)."""
        slab, index = divmod(cell, self.blocks_per_slab)
        return self._slab_offsets[slab] + index * self.block_bytes

    def _grow(self) -> bool:
        offset = self._budget.claim(self._slab_bytes)
        if offset is None:
            return False
        self._slab_offsets.append(offset)
        first = self.num_cells
        self.num_slabs += 1
        self._is_free.extend(b"\x01" * self.blocks_per_slab)
        # Reversed so that pop() hands out low cell ids first (easier to read in tests and logs).
        self._free.extend(CellId(i) for i in range(self.num_cells - 1, first - 1, -1))
        return True
