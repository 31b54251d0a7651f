"""Parts of engines whose workers copy their blocks themselves (engine_copies: their KV memory, a
GPU pool no API can export, cannot be shared with the daemon).

The daemon still plans every op and checks every block; only the bytes between the engine's memory
and the host tier move in the worker's process, between its KV tensors and the engine's private
host memory (kvdepotd.core.disk.private_class), which it maps. A part goes through phases, the
ones on the daemon's side on the copy threads, the copy itself on the worker:

    load    verify (each block's checksum against the host bytes), an order for each batch as it
            is verified (the worker copies one while the next is checked) -> done
    store   prepare (host memory backed behind the cells) -> order -> checksum (taken from the
            host bytes the worker wrote) -> done

An order goes on the rank's worker stream (WorkerEvent.orders) and its report comes back on it
(WorkerMessage.copies_done, engine_copied). A rank without a stream gets no order (its part fails
at once), and a rank whose stream ends has its orders' parts failed: an order is never carried out
after the daemon gave its op up (the worker, for its part, finishes an order it took before it
acts on its op's end, see kvdepot.engine_copy). These parts never count as touching the engine's
memory for the daemon (HostCopyEngine.busy): only the worker does that, and it knows.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvdepotd.core.ops import OpId, OpKind
from kvdepotd.storage.checksum import xxh3_at
from kvdepotd.storage.host_arena import HostArena

# kvdepotd.transfer.host's _Part, Work and Faults (not imported: host imports this module).
_Part = Any
Work = Any
Faults = Any

PAST_DEADLINE = "the op's deadline passed before its blocks were checked"


@dataclass
class EngineCopyRank:
    """A rank registered with engine_copies: no memory of the engine's is mapped."""

    engine_id: str
    rank: int
    num_blocks: int
    device: str = "engine"
    mapped_bytes: int = 0
    warned_shrunk: bool = False

    def ring(self, op_id: int, intact: bool) -> None:
        return None


@dataclass(frozen=True, slots=True)
class CopyOrder:
    """One part for a worker to carry out (WorkerEvent.orders, as plain data)."""

    engine_id: str
    rank: int
    op_id: int
    store: bool
    step: int
    indices: tuple[int, ...]
    block_ids: tuple[int, ...]
    host_offsets: tuple[int, ...]


def engine_pass(part: _Part, work: Work, first: bool, arena: HostArena, faults: Faults, now_ms: Callable[[], float]) -> tuple[list[int], list[int], str]:
    """A daemon-side pass over `work` of an engine-copy part (on a copy thread): (failed, corrupt, message)."""
    plan = part.plan
    rank_bytes = part.layout.rank_block_bytes
    rank_off = plan.rank * rank_bytes
    if part.phase == "prepare":
        if not arena.ensure(max(w[3] for w in work) + rank_off + rank_bytes):
            return [w[0] for w in work], [], arena.error
        return [], [], ""
    failed: list[int] = []
    corrupt: list[int] = []
    deadline = plan.deadline_ms or float("inf")
    if part.phase == "verify" and first and faults.load_delay_ms:
        end = time.monotonic() + faults.load_delay_ms / 1000  # a slow load (--fault-load-delay-ms), stopped when its op ends
        while not part.cancelled and time.monotonic() < end:
            time.sleep(0.005)
    for k, (i, _bid, cell, offset) in enumerate(work):
        if part.cancelled or now_ms() >= deadline:
            return failed + [w[0] for w in work[k:]], corrupt, "" if part.cancelled else PAST_DEADLINE
        key, addr = (plan.layout_class, cell, plan.rank), arena.base + offset + rank_off
        if part.phase == "checksum":  # the worker wrote the block: its checksum, as a daemon-side store takes it
            arena.checksums[key] = xxh3_at(addr, rank_bytes)
            continue
        if faults.corrupt_loads and faults.take_corruption():
            ctypes.memset(addr, 0x5A, 64)
        if xxh3_at(addr, rank_bytes) != arena.checksums.get(key, -1):
            corrupt.append(i)
    return failed, corrupt, "checksum mismatch in the host tier" if corrupt else ""


class EngineParts:
    """HostCopyEngine's side of engine-copy parts (mixed into it; the event loop's methods)."""

    _orders: dict[tuple[OpId, int], _Part]
    on_order: Callable[[CopyOrder], bool] | None
    arenas: Any

    def _queue(self, part: _Part) -> None: ...
    def _part_done(self, part: _Part) -> None: ...

    def _order(self, part: _Part, work: Work) -> None:
        """Orders the copy of `work` (its blocks not failed) from the part's worker."""
        plan = part.plan
        if not work or part.cancelled:
            return
        rank_off = plan.rank * part.layout.rank_block_bytes
        order = CopyOrder(
            plan.engine_id, plan.rank, plan.op_id, plan.kind is OpKind.STORE, plan.step,
            tuple(w[0] for w in work), tuple(w[1] for w in work), tuple(w[3] + rank_off for w in work),
        )
        if self.on_order is None or not self.on_order(order):
            part.failed += [w[0] for w in work]
            part.message = part.message or f"rank {plan.rank}'s worker has no stream: its copy cannot be ordered"
            return
        part.outstanding += 1
        self._orders[(plan.op_id, plan.rank)] = part

    def _engine_batch(self, part: _Part, good: Work) -> None:
        """A load's batch is verified: its copy is ordered at once."""
        self._order(part, good)

    def _engine_next(self, part: _Part) -> None:
        """A daemon-side pass of the part has ended: a load waits for its orders, a store orders
        its copy, a checksum pass ends the part."""
        if part.phase == "checksum":
            self._part_done(part)
            return
        if part.phase == "prepare":
            bad = set(part.failed)
            self._order(part, tuple(w for w in part.work if w[0] not in bad))
        part.phase = "order"  # every order is out: the part ends with the last report
        self._settle(part)

    def _settle(self, part: _Part) -> None:
        if part.phase != "order" or part.outstanding:
            return  # a load still verifying (more orders to come), or orders still out
        self._orders.pop((part.plan.op_id, part.plan.rank), None)
        if part.plan.kind is OpKind.STORE and not part.cancelled:
            bad = set(part.failed)
            part.phase, part.taken, part.work = "checksum", 0, tuple(w for w in part.work if w[0] not in bad)
            if part.work:
                self._queue(part)
                return
        self._part_done(part)

    def engine_copied(self, op_id: OpId, rank: int, failed: list[int], message: str) -> None:
        """The worker's report of an order (WorkerMessage.copies_done); one it was never given is ignored."""
        part = self._orders.get((op_id, rank))
        if part is None or not part.outstanding:
            return
        part.outstanding -= 1
        mine = {w[0] for w in part.work}
        part.failed += [i for i in failed if i in mine]
        part.message = part.message or message
        self._settle(part)

    def worker_gone(self, engine_id: str, rank: int | None = None) -> None:
        """The rank's stream ended (every rank's: the engine went): its orders may never be
        reported; their parts fail now."""
        for key in [k for k, p in self._orders.items() if p.plan.engine_id == engine_id and rank in (None, k[1])]:
            part = self._orders.pop(key)
            part.outstanding = 0
            part.failed += [w[0] for w in part.work if w[0] not in set(part.failed)]
            part.message = part.message or f"rank {rank}'s worker stream ended before it reported its copy"
            if part.phase == "order":
                self._part_done(part)
