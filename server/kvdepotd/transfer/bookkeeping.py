"""The copy engine for engines that registered no KV tensors: it moves no bytes.

The control plane (which blocks to load and store, when, and what each op's outcome means for the
slots and the tier) is complete without block bytes; this engine lets it run end to end: a part
ends as soon as it may start, and blocks that failed up front (a load target no tier holds) are
reported failed. It is what tests of the control plane and benchmarks of the protocol use; the
data-plane engine (engine tensors mapped through cpu_shm / cuda_ipc handles) replaces it per engine.
"""

from __future__ import annotations

from kvdepotd.core.ops import Op
from kvdepotd.transfer.base import CopyEngine, PartDone


class BookkeepingCopyEngine(CopyEngine):
    def submit(self, parts: list[tuple[Op, int]]) -> None:
        if parts:
            self.on_done([PartDone(op.op_id, rank, sorted(op.failed), op.message) for op, rank in parts])
