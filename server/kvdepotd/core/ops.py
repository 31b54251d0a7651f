"""Ops: one load or store of a set of blocks for one request, run on every rank of its engine.

Primitives:
    Op                        the record; `parts_left` are ranks still to run, `failed` block indices
    Part                      one op on one rank as a copy thread runs it: plain data (Depot.take_ready)
    OpTable.new_id() -> OpId                  ids increase from the first (never reused across restarts)
    OpTable.add(op) -> list[(op, rank)]       parts ready to run at once (loads; stores whose forward is done)
    OpTable.release(op) -> list[(op, rank)]   a held load whose disk blocks reached the host tier: all its parts
    OpTable.forward_done(engine, rank, step) -> list[(op, rank)]   store parts that may start now
    OpTable.finish_part(op_id, rank, failed) -> Op | None          the op when its last part ended
    OpTable.part_copied(op_id, rank) -> Op | None    a check_late load when every rank has copied
    OpTable.expired(now_ms) -> list[Op]      ops past their deadline (their unfinished parts count as failed)
    OpTable.end(op, message) -> Op | None    ends an op now (None: it had ended already)
    OpTable.is_waiting_forward(op) -> bool   no rank has started it (a store can still be cancelled)
    OpTable.forget_engine(engine)            drops an unregistered engine's forward-done state

Every op ends exactly once: all parts reported, its deadline, or cancellation. A part reported
for an op that already ended (late completion, daemon restart of a worker) is ignored.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NewType

from kvdepot.hashing import BlockHash
from kvdepotd.core.pool import CellId

OpId = NewType("OpId", int)
EngineId = NewType("EngineId", str)
RequestId = NewType("RequestId", str)


class OpKind(enum.Enum):
    LOAD = "LOAD"
    STORE = "STORE"


@dataclass(slots=True)
class Op:
    op_id: OpId
    kind: OpKind
    engine_id: EngineId
    request_id: RequestId
    block_indices: list[int]
    block_ids: list[int]  # engine block ids, same order
    hashes: list[BlockHash]
    tier_cells: list[CellId | None]  # host cells (None for blocks that failed up front)
    step: int
    deadline_ms: int
    world_size: int
    layout_class: str  # its blocks live in this layout class's tiers (which outlive the engine)
    epoch: int = 0  # the slot's device-state generation when planned (see Depot._bump_epoch)
    planned_ms: int = 0  # the clock of the Step that planned it
    parts_left: set[int] = field(default_factory=set)  # ranks not yet reported
    started: set[int] = field(default_factory=set)  # ranks handed to the copy engine
    failed: set[int] = field(default_factory=set)  # block indices that failed on some rank
    corrupt: set[int] = field(default_factory=set)  # of those, the ones whose tier bytes were bad
    message: str = ""
    staging: set[int] = field(default_factory=set)  # block indices still being read from disk into the host tier
    from_disk: set[int] = field(default_factory=set)  # block indices read from disk for it (their data is checked by its copy)
    held: bool = False  # a load waits for its staging before any part starts
    cancelled: bool = False  # ended by the engine: a store before its forward was reported (the request went back), a load of a finished request
    check_late: bool = False  # a load that reports its bytes copied before its checksums are checked
    copied: set[int] = field(default_factory=set)  # ranks whose part copied its bytes (check_late loads)

    @property
    def success(self) -> bool:
        return not self.failed

    def failed_block_ids(self) -> list[int]:
        return [b for i, b in zip(self.block_indices, self.block_ids) if i in self.failed]


@dataclass(slots=True)
class Part:
    """One op on one rank, as the copy engine runs it: no core object goes to a copy thread. Its
    cancellation (the op ended while it ran) is the runtime's flag, not a field here. Read-only by
    convention: one is made per part on the engine's path, and a frozen dataclass is slower to build."""

    op_id: OpId
    kind: OpKind
    engine_id: EngineId
    rank: int
    layout_class: str
    step: int
    check_late: bool
    indices: tuple[int, ...]  # every block index of the op
    work: tuple[tuple[int, int, CellId, int], ...]  # to copy: (block index, engine block id, host cell, its byte offset in the host tier)
    failed: tuple[int, ...]  # block indices that failed before any copy
    message: str
    # The op's deadline (wall-clock ms, as the engine keeps it): no engine block is touched at or
    # after it, even by a daemon that was frozen past it and resumes mid-copy. 0: none.
    deadline_ms: int = 0


class OpTable:
    def __init__(self, first_id: int = 1) -> None:
        self.ops: dict[OpId, Op] = {}
        self._next_id = first_id
        self._forward_done: dict[tuple[EngineId, int], int] = {}  # (engine, rank) -> last step done
        self._waiting: dict[EngineId, list[Op]] = {}  # store ops waiting for some rank's forward

    def new_id(self) -> OpId:
        op_id = OpId(self._next_id)
        self._next_id += 1
        return op_id

    def add(self, op: Op) -> list[tuple[Op, int]]:
        op.parts_left = set(range(op.world_size))
        self.ops[op.op_id] = op
        if op.kind is OpKind.LOAD:
            return [] if op.held else self._start(op, list(range(op.world_size)))
        ready = [r for r in range(op.world_size) if self._forward_done.get((op.engine_id, r), -1) >= op.step]
        if len(ready) < op.world_size:
            self._waiting.setdefault(op.engine_id, []).append(op)
        return self._start(op, ready)

    def forward_done(self, engine_id: EngineId, rank: int, step: int) -> list[tuple[Op, int]]:
        key = (engine_id, rank)
        if step <= self._forward_done.get(key, -1):
            return []
        self._forward_done[key] = step
        waiting = self._waiting.get(engine_id)
        if not waiting:
            return []
        ready: list[tuple[Op, int]] = []
        keep: list[Op] = []
        for op in waiting:
            if op.op_id not in self.ops:
                continue
            if op.step <= step and rank not in op.started:
                ready += self._start(op, [rank])
            if len(op.started) < op.world_size:
                keep.append(op)
        self._waiting[engine_id] = keep
        return ready

    def release(self, op: Op) -> list[tuple[Op, int]]:
        if op.op_id not in self.ops or not op.held:
            return []
        op.held = False
        return self._start(op, list(range(op.world_size)))

    def is_waiting_forward(self, op: Op) -> bool:
        """True while no rank has started the op (it can still be cancelled without touching bytes)."""
        return not op.started

    def part_copied(self, op_id: OpId, rank: int) -> Op | None:
        op = self.ops.get(op_id)
        if op is None or not op.check_late or rank not in op.parts_left or rank in op.copied:
            return None
        op.copied.add(rank)
        return op if len(op.copied) == op.world_size else None

    def finish_part(
        self, op_id: OpId, rank: int, failed: list[int] | None = None, message: str = "", corrupt: list[int] | None = None
    ) -> Op | None:
        op = self.ops.get(op_id)
        if op is None or rank not in op.parts_left:
            return None
        op.parts_left.discard(rank)
        if failed:
            op.failed.update(failed)
            op.message = op.message or message
        if corrupt:
            op.corrupt.update(corrupt)
            op.failed.update(corrupt)
        if op.parts_left:
            return None
        del self.ops[op_id]
        return op

    def end(self, op: Op, message: str) -> Op | None:
        """Ends an op now: every block of every unfinished part fails. None if it had ended already."""
        if self.ops.pop(op.op_id, None) is None:
            return None
        if op.parts_left:
            op.failed.update(op.block_indices)
            op.parts_left.clear()
            op.message = op.message or message
        return op

    def expired(self, now_ms: int) -> list[Op]:
        return [op for op in self.ops.values() if op.deadline_ms <= now_ms]

    def forget_engine(self, engine_id: EngineId) -> None:
        self._waiting.pop(engine_id, None)
        for key in [k for k in self._forward_done if k[0] == engine_id]:
            del self._forward_done[key]

    @staticmethod
    def _start(op: Op, ranks: list[int]) -> list[tuple[Op, int]]:
        op.started.update(ranks)
        return [(op, r) for r in ranks]
