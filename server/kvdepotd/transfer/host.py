"""The host-tier copy engine: engine KV blocks <-> the host arena, on worker threads.

Parts (one op on one rank) wait in two queues, each served by its own threads: a load is on the
engine's critical path (the request cannot run until it lands), a store is background work. Load
threads run at the daemon's priority; store threads at `store_nice` (10 by default), so a store
gives the CPU to the engine and to loads and takes what they leave (a cold prefill's stores
otherwise slow the engine's next step on a machine with few cores), and a store never waits
behind loads nor a load behind stores. Each copy thread takes a few blocks at a time (about 8 MiB, fewer near a part's end) from
the first waiting part of its queue, so the threads share one large op to its last block instead of
one finishing its fixed chunk while the other still has a whole one to go.

Every block moved gets an xxh3 checksum per (block, rank): a store takes it, a load compares it
after copying and reports a mismatch as a corrupt block (the engine recomputes, the tier drops
it; the engine reads a load's blocks only once the op reports, so bytes that fail have done no
harm). A CPU block is one call into the native block copy where it is built, which hashes each
piece as it copies it (kvdepotd.transfer.blockcopy); else one strided torch copy when its runs
are evenly spaced in one storage, or one ctypes.memmove per run, and then one hash of the arena's
bytes. All of them release the GIL, so the threads copy at once. CUDA copies go through a
dedicated stream and are synchronized before the part reports. A load of an engine with late
load checks is copied in one pass, reported (`on_copied`, the engine may go on), then checked in a
second pass; where the native copy checked it on the way, both reports go at once. Either way, the
moment a load's part is copied the copy thread rings the worker's doorbell where it handed one over
(RankMapping.ring): the worker's wait ends without the hops through the event loop and gRPC, and
the reports follow. A load into such memory, with the native copy, is copied layer by layer
(Layered): every block's layer 0, then layer 1, ..., each block's checksum fed layer by layer, and
the doorbell hears as each layer has landed on every block, so a worker whose engine waits per
layer lets the forward start on layer 0 while the rest is still copied. Engines of
layout kind "none" have no tensors: their parts end at once (bookkeeping only).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvdepot.layout import KvLayout
from kvdepotd.core.ops import OpId, OpKind, Part
from kvdepotd.core.pool import CellId
from kvdepotd.storage.checksum import States
from kvdepotd.storage.checksum import xxh3_at as _xxh3_at
from kvdepotd.storage.host_arena import Arenas
from kvdepotd.storage.lazy_torch import torch
from kvdepotd.transfer import blockcopy
from kvdepotd.transfer.base import Copied, CopyEngine, PartDone
from kvdepotd.transfer.engine_copy import CopyOrder, EngineCopyRank, EngineParts, engine_pass
from kvdepotd.transfer.mapping import RankMapping

log = logging.getLogger("kvdepotd")
_memmove = ctypes.memmove
Work = tuple[tuple[int, int, CellId, int], ...]  # (block index, engine block id, host cell, its byte offset in the arena)
GRAIN_BYTES = 8 << 20  # what a copy thread takes from a part at a time (a few ms of copying)
MAX_GRAIN_BLOCKS = 64
RATE_MIN_BYTES = 1 << 20  # a load this large or larger updates the load rate (smaller ones time mostly overheads)
LAYERED_MIN_BYTES = 1 << 20  # a layer of a part smaller than this is copied with the rest of its blocks, not on its own
MAX_LAYER_RINGS = 8  # a layered part rings the doorbell at most this often (its socket holds a few hundred datagrams)


@dataclass
class Faults:
    """Fault injection for tests (kvdepotd --fault-*): slow loads, corrupt host bytes."""

    load_delay_ms: int = 0
    corrupt_loads: int = 0  # blocks still to corrupt before they are checked
    store_delay_ms: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take_corruption(self) -> bool:
        with self.lock:
            if self.corrupt_loads <= 0:
                return False
            self.corrupt_loads -= 1
            return True


@dataclass(eq=False)  # one part is one object: the live list removes it by identity
class _Part:
    plan: Part
    mapping: RankMapping | EngineCopyRank
    layout: KvLayout
    work: Work
    event: bytes | None  # the CUDA event a GPU store waits on
    queued_at: float = field(default_factory=time.monotonic)
    started_at: float = 0.0  # when a copy thread took its first blocks
    taken: int = 0  # work[:taken] has been handed to threads (in the current pass)
    cancelled: bool = False  # the op ended (set on the event loop, read by the copy threads)
    running: int = 0  # batches being copied now
    checking: bool = False  # a late-checked load in its second pass (its bytes are in the engine)
    failed: list[int] = field(default_factory=list)
    corrupt: list[int] = field(default_factory=list)
    message: str = ""
    phase: str = ""  # an engine-copy part's (kvdepotd.transfer.engine_copy); "" for the daemon's own copies
    outstanding: int = 0  # an engine-copy part's orders its worker has not reported yet
    ended_at: float = 0.0  # when its copy thread finished its last blocks
    layered: Layered | None = None  # a load copied layer by layer (its work is then taken in batches of one column's layer)

    @property
    def batches(self) -> int:
        """What `taken` counts up to: blocks, or a layered load's (layer, column) batches."""
        return len(self.work) if self.layered is None else self.layered.batches


@dataclass(eq=False)
class Layered:
    """A load copied layer by layer: every block's layer 0 first, then layer 1, ..., so the worker
    (told on its doorbell as each layer lands on every block) may run a layer's forward while the
    next layers are still being copied. The part's blocks are cut into columns, one batch being one
    column's layer; a column's layer waits for its layer before (each block's checksum is taken
    through its layers in order, into its own xxh3 state), and layer l has landed once every column
    is past it."""

    layers: int
    bounds: list[tuple[int, int]]  # each column's [start, end) in the part's work
    states: States
    done: list[int]  # per column: layers copied
    rung: int = 0  # layers reported to the worker
    bad: set[int] = field(default_factory=set)  # block indices that failed: skipped in later layers

    @property
    def batches(self) -> int:
        return self.layers * len(self.bounds)


PAST_DEADLINE = "the op's deadline passed before its copy was done (was the daemon stalled?): no more engine blocks are touched"
SHRUNK = "the engine's KV memory file is smaller than it registered (truncated): nothing is copied to or from it"


def _warn_shrunk(m: RankMapping) -> str:
    """Logs (once per mapping) that an engine shrank the memory it registered; SHRUNK."""
    if not m.warned_shrunk:
        m.warned_shrunk = True
        log.warning("engine %s rank %d: %s (the engine truncated its KV file: register again)", m.engine_id, m.rank, SHRUNK)
    return SHRUNK


class HostCopyEngine(EngineParts, CopyEngine):
    def __init__(
        self,
        on_done: Callable[[list[PartDone]], None],
        arenas: Arenas,
        threads: int = 2,
        faults: Faults | None = None,
        on_copied: Callable[[int, int], None] | None = None,
        store_nice: int = 10,
        clock_ms: Callable[[], float] = lambda: time.time() * 1000,
        on_order: Callable[[CopyOrder], bool] | None = None,
    ) -> None:
        """`clock_ms`: the clock ops' deadlines are in (the runtime's: wall-clock milliseconds).
        `on_order`: sends an engine-copy part's order to its worker; False when it has no stream."""
        super().__init__(on_done)
        self.on_order = on_order
        self._orders: dict[tuple[OpId, int], _Part] = {}
        self.clock_ms = clock_ms
        self.on_copied = on_copied  # (op id, rank): a late-checked load's bytes are in the engine
        self.arenas = arenas
        self.faults = faults or Faults()
        self.layouts: dict[str, KvLayout] = {}
        self.mappings: dict[tuple[str, int], RankMapping | EngineCopyRank] = {}
        self.threads = threads  # per queue: `threads` copy loads, as many copy stores
        self.store_nice = store_nice
        self._cond = threading.Condition()
        self._loads: deque[_Part] = deque()
        self._stores: deque[_Part] = deque()
        self._closing = False
        self._workers: list[threading.Thread] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, Any] = {}  # device -> torch.cuda.Stream
        self._events: dict[tuple[str, int], tuple[int, bytes]] = {}  # (engine, rank) -> last (step, CUDA event handle)
        self._live: dict[OpId, list[_Part]] = {}  # parts queued or copying, by op (the event loop's)
        self.load_rate = 0.0  # bytes/s of the latest CPU loads' copies (a moving average; 0 until one of RATE_MIN_BYTES ran)
        self.load_rate_at = 0.0  # when it was last updated (monotonic)

    # -- engines and their tensors --------------------------------------------------------------
    def add_engine(self, engine_id: str, layout: KvLayout) -> None:
        self.layouts[engine_id] = layout

    def add_mapping(self, mapping: RankMapping | EngineCopyRank) -> None:
        self.mappings[(mapping.engine_id, mapping.rank)] = mapping

    @property
    def mapped_bytes(self) -> int:
        return sum(m.mapped_bytes for m in self.mappings.values())

    def forget_engine(self, engine_id: str) -> None:
        """Unmaps the engine's tensors (running copies keep theirs alive until they end) and cancels
        its parts."""
        for parts in self._live.values():
            for p in parts:
                if p.plan.engine_id == engine_id:
                    p.cancelled = True
        self.worker_gone(engine_id)
        self.layouts.pop(engine_id, None)
        for key in [k for k in self.mappings if k[0] == engine_id]:
            del self.mappings[key]
            self._events.pop(key, None)

    def note_forward_event(self, engine_id: str, rank: int, step: int, handle: bytes) -> None:
        """A GPU worker's end-of-forward event for `step`; stores of that step wait on it (CPU
        mappings have nothing to wait for and ignore it)."""
        m = self.mappings.get((engine_id, rank))
        if isinstance(m, RankMapping) and m.device != "cpu":
            self._events[(engine_id, rank)] = (step, handle)

    # -- parts ------------------------------------------------------------------------------------
    def submit(self, parts: list[Part]) -> None:
        now: list[PartDone] = []
        for p in parts:
            layout = self.layouts.get(p.engine_id)
            if layout is None or layout.kind == "none":
                now.append(PartDone(p.op_id, p.rank, list(p.failed), p.message))
                continue
            mapping = self.mappings.get((p.engine_id, p.rank))
            if mapping is None:
                now.append(PartDone(p.op_id, p.rank, list(p.indices), f"rank {p.rank} has not registered its KV caches"))
                continue
            self._start(p, mapping, layout)
        if now:
            self.on_done(now)

    def load_backlog_bytes(self) -> int:
        """Bytes of the loads waiting for, or not yet taken by, a copy thread."""
        with self._cond:
            return sum((p.batches - p.taken) * len(p.work) * p.layout.rank_block_bytes // max(1, p.batches) for p in self._loads)

    def cancel(self, op_id: OpId) -> None:
        """The op ended: its parts touch no further engine block (a block being copied finishes)."""
        for p in self._live.get(op_id, ()):
            p.cancelled = True

    def busy(self, op_id: OpId) -> bool:
        """A part of the op is queued or copying: it may still touch the engine's blocks (an
        engine-copy part never does: its worker copies)."""
        return any(not p.phase for p in self._live.get(op_id, ()))

    def _start(self, plan: Part, mapping: RankMapping | EngineCopyRank, layout: KvLayout) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        if self._closing:
            self.on_done([PartDone(plan.op_id, plan.rank, list(plan.indices), "the daemon is shutting down")])
            return
        if not plan.work:
            self.on_done([PartDone(plan.op_id, plan.rank, list(plan.failed), plan.message)])
            return
        part = _Part(plan, mapping, layout, plan.work, self._forward_event(plan), failed=list(plan.failed), message=plan.message)
        if isinstance(mapping, EngineCopyRank):
            part.phase = "verify" if plan.kind is OpKind.LOAD else "prepare"
        elif (
            plan.kind is OpKind.LOAD and mapping.layer_rings and mapping.doorbell is not None and len(mapping.layers) > 1
            and len(plan.work) * layout.rank_block_bytes // len(mapping.layers) >= LAYERED_MIN_BYTES
        ):
            part.layered = self._layered(part, mapping)
        self._live.setdefault(plan.op_id, []).append(part)
        self._queue(part)

    def _layered(self, part: _Part, m: RankMapping) -> Layered:
        """Columns of about GRAIN_BYTES of one layer, as many as the load threads at least."""
        n, layer_bytes = len(part.work), part.layout.rank_block_bytes // len(m.layers)
        cols = min(n, self.threads * max(1, -(-n * layer_bytes // (GRAIN_BYTES * self.threads))))
        edges = [n * c // cols for c in range(cols + 1)]
        return Layered(len(m.layers), list(zip(edges, edges[1:])), States(n), [0] * cols)

    def _queue(self, part: _Part) -> None:
        queue, kind = (self._loads, "load") if part.plan.kind is OpKind.LOAD else (self._stores, "store")
        with self._cond:
            queue.append(part)
            started = sum(t.name.startswith(f"kvdepot-{kind}_") for t in self._workers)
            for k in range(started, self.threads):  # the queue's threads start with its first part
                t = threading.Thread(target=self._run, args=(queue,), name=f"kvdepot-{kind}_{k}", daemon=True)
                self._workers.append(t)
                t.start()
            self._cond.notify_all()

    def _take(self, queue: deque[_Part]) -> tuple[_Part, Work, bool, tuple[int, int] | None] | None:
        """The next blocks to copy (under the lock) from the first part of `queue`, whether they
        are the part's first, and for a layered load which (layer, column) they are (None: whole
        blocks); None once closing with nothing left."""
        while True:
            while not queue:
                if self._closing:
                    return None
                self._cond.wait()
            part = queue[0]
            if part.layered is None:
                return self._take_blocks(queue, part)
            lay = part.layered
            layer, col = divmod(part.taken, len(lay.bounds))
            if lay.done[col] == layer:  # else the column's layer before is still being copied: wait for it
                first = part.taken == 0
                if first:
                    part.started_at = time.monotonic()
                part.taken += 1
                part.running += 1
                if part.taken == lay.batches:
                    queue.popleft()
                start, end = lay.bounds[col]
                return part, part.work[start:end], first, (layer, col)
            self._cond.wait()

    def _take_blocks(self, queue: deque[_Part], part: _Part) -> tuple[_Part, Work, bool, None]:
        left = len(part.work) - part.taken
        grain = max(1, min(MAX_GRAIN_BLOCKS, GRAIN_BYTES // part.layout.rank_block_bytes))
        n = max(1, min(grain, -(-left // self.threads)))  # near the end, the rest is shared by every thread
        first = part.taken == 0
        if first and not part.checking:
            part.started_at = time.monotonic()
        batch = part.work[part.taken : part.taken + n]
        part.taken += len(batch)
        part.running += 1
        if part.taken == len(part.work):
            queue.popleft()
        return part, batch, first, None

    def _run(self, queue: deque[_Part]) -> None:
        if queue is self._stores and self.store_nice:
            try:  # Linux: a thread's own nice value (only ever raised: no privilege needed)
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + self.store_nice)
            except (OSError, AttributeError) as e:
                log.warning("store copy thread: cannot lower its priority (%s); stores run like loads", e)
        while self._run_one(queue):
            pass  # the batch's part, and the engine mapping it holds, go with each call's frame

    def _run_one(self, queue: deque[_Part]) -> bool:
        """Copies one batch; False once closing. A thread waiting for work holds nothing of its
        last batch: a gone engine's mapping must not stay open (and its memory mapped) in an idle
        thread's locals until the thread copies something else."""
        with self._cond:
            got = self._take(queue)
        if got is None:
            return False
        part, batch, first, at = got
        try:
            if at is not None:
                failed, corrupt, message = self._copy_layer(part, batch, first, at)
            else:
                failed, corrupt, message = self._copy(part, batch, first)
        except Exception as e:  # a bug in a copy: its blocks fail, the daemon serves on
            log.exception("copy of op %d failed", part.plan.op_id)
            failed, corrupt, message = [w[0] for w in batch], [], f"copy failed: {e}"
        if at is not None:  # booked with the column's progress
            self._layer_landed(part, at, failed, corrupt, message)
            failed, corrupt, message = [], [], ""
        assert self._loop is not None
        if part.phase == "verify":  # its copy is ordered now, before the part's last batch is checked
            bad = {*failed, *corrupt}
            self._loop.call_soon_threadsafe(self._engine_batch, part, tuple(w for w in batch if w[0] not in bad))
        with self._cond:
            part.failed += failed
            part.corrupt += corrupt
            part.message = part.message or message
            part.running -= 1
            if part.running or part.taken < part.batches:
                return True
            part.ended_at = time.monotonic()
            if part.phase:  # an engine-copy part's pass: what comes next is the event loop's
                self._loop.call_soon_threadsafe(self._engine_next, part)
                return True
            rung = part.checking  # a late-checked load in its check pass rang when its copy pass ended
            late = part.plan.check_late and not part.checking
            check_next = late and getattr(part.mapping, "packed", None) is None  # copied: the engine may go on; now check
            if check_next:
                part.checking, part.taken = True, 0
                self._loads.append(part)
                self._cond.notify_all()
        if part.plan.kind is OpKind.LOAD and not rung:  # straight to the worker, ahead of the event loop's report
            part.mapping.ring(part.plan.op_id, intact=not (check_next or part.failed or part.corrupt))
        if late:
            self._loop.call_soon_threadsafe(self._part_copied, part)
        if not check_next:
            self._loop.call_soon_threadsafe(self._part_done, part)
        return True

    def _layer_landed(self, part: _Part, at: tuple[int, int], failed: list[int], corrupt: list[int], message: str) -> None:
        """Books a layered load's batch: its failures, and its column's progress; rings the worker
        once a layer has landed on every column (the last one's ring is the part's own)."""
        lay = part.layered
        assert lay is not None and isinstance(part.mapping, RankMapping)
        layer, col = at
        with self._cond:
            failed = [i for i in failed if i not in lay.bad]  # (a batch that raised names its blocks failed before again)
            if failed:  # a layer that did not land everywhere: no more rings, the part's own report says what failed
                lay.rung = lay.layers
            lay.bad.update(failed, corrupt)
            part.failed += failed
            part.corrupt += corrupt
            part.message = part.message or message
            lay.done[col] = layer + 1
            landed = min(lay.done)
            ring = landed if landed < lay.layers and landed >= lay.rung + -(-lay.layers // MAX_LAYER_RINGS) else 0
            lay.rung = max(lay.rung, ring)
            self._cond.notify_all()  # a thread may be waiting for this column's layer
        if ring:
            part.mapping.ring_layers(part.plan.op_id, ring)

    def _part_copied(self, part: _Part) -> None:
        if self.on_copied is not None:
            self.on_copied(part.plan.op_id, part.plan.rank)

    def _part_done(self, part: _Part) -> None:
        now = time.monotonic()
        plan = part.plan
        if part.layered is not None:
            part.layered.states.close()
        live = self._live.get(plan.op_id)
        if live is not None:
            live.remove(part)
            if not live:
                del self._live[plan.op_id]
        bad = {*part.failed, *part.corrupt}
        nbytes = part.layout.rank_block_bytes * sum(1 for w in part.work if w[0] not in bad)
        kind = "load" if plan.kind is OpKind.LOAD else "store"
        copied = Copied(kind, nbytes, part.started_at - part.queued_at, (part.ended_at or now) - part.started_at)
        if kind == "load" and nbytes >= RATE_MIN_BYTES and copied.copy_s > 0 and isinstance(part.mapping, RankMapping) and part.mapping.device == "cpu":
            rate = nbytes / copied.copy_s  # timed on the copy thread: the event loop's delays are not the copy's
            self.load_rate = rate if not self.load_rate else 0.7 * self.load_rate + 0.3 * rate
            self.load_rate_at = now
        self.on_done([PartDone(plan.op_id, plan.rank, part.failed, part.message, part.corrupt, copied)])

    # -- the copies (worker threads) ------------------------------------------------------------------
    def _forward_event(self, plan: Part) -> bytes | None:
        """The handle of the event a GPU store must wait on: the one reported for its step or later."""
        if plan.kind is not OpKind.STORE:
            return None
        got = self._events.get((plan.engine_id, plan.rank))
        return got[1] if got is not None and got[0] >= plan.step else None

    def _copy(self, part: _Part, work: Work, first: bool) -> tuple[list[int], list[int], str]:
        """Copies (and checks) `work` of a part. A late-checked load runs in two passes over its
        blocks, one that only copies (`part.checking` False), then one that only checks, unless
        the native copy checks it on the way."""
        if part.phase:
            return engine_pass(part, work, first, self.arenas.of(part.plan.layout_class), self.faults, self.clock_ms)
        plan, m, rank = part.plan, part.mapping, part.plan.rank
        assert isinstance(m, RankMapping)
        if part.event is not None and m.device != "cpu":  # the forward may still be running on the GPU
            self._stream(m).wait_event(torch().cuda.Event.from_ipc_handle(torch().device(m.device), part.event))
        store = plan.kind is OpKind.STORE
        copy = store or not part.checking
        check = not store and (part.checking or not plan.check_late or m.packed is not None)
        failed: list[int] = []
        corrupt: list[int] = []
        message = ""
        rank_bytes = part.layout.rank_block_bytes
        rank_off = rank * rank_bytes
        cls = plan.layout_class
        arena, faults = self.arenas.of(cls), self.faults
        if first and copy and (delay := faults.store_delay_ms if store else faults.load_delay_ms):  # once per op, in its first batch
            end = time.monotonic() + delay / 1000
            while not part.cancelled and time.monotonic() < end:  # a slow copy that still stops when its op ends
                time.sleep(0.005)
        if store and not arena.ensure(max(w[3] for w in work) + rank_off + rank_bytes):  # memory behind the cells
            return [w[0] for w in work], [], arena.error
        if m.files and m.packed is None and m.shrunk():  # the native copy catches this itself, race and all
            _warn_shrunk(m)
            return [w[0] for w in work], [], SHRUNK
        deadline, clock = plan.deadline_ms or float("inf"), self.clock_ms
        k = 0
        try:
            for k, (i, bid, cell, offset) in enumerate(work):
                if part.cancelled:  # the op ended (its deadline passed, its engine went): touch no more engine blocks
                    failed += [w[0] for w in work[k:]]
                    break
                if clock() >= deadline:  # the same, seen from here: the loop may not have run since (a frozen daemon resumed)
                    failed += [w[0] for w in work[k:]]
                    message = message or PAST_DEADLINE
                    break
                if bid >= m.num_blocks:
                    failed.append(i)
                    message = message or f"engine block {bid} is outside the {m.num_blocks} registered blocks"
                    continue
                hoff = offset + rank_off
                key = (cls, cell, rank)
                if store:
                    got = self._move(m, bid, hoff, rank_bytes, to_host=True, want_hash=True)
                    assert got is not None
                    arena.checksums[key] = got
                    continue
                if copy and faults.corrupt_loads and faults.take_corruption():
                    ctypes.memset(arena.base + hoff, 0x5A, 64)
                want = arena.checksums.get(key, -1) if check else None  # -1, which no xxh3 is: a block without one fails
                if copy:
                    got = self._move(m, bid, hoff, rank_bytes, to_host=False, want_hash=want is not None)
                else:
                    got = _xxh3_at(arena.base + hoff, rank_bytes) if want is not None else None
                if got != want:
                    corrupt.append(i)
                    message = message or "checksum mismatch in the host tier"
        except OSError:  # only a copy raises it: the engine shrank its file under it (the native copy's SIGBUS guard)
            failed += [w[0] for w in work[k:]]
            message = _warn_shrunk(m)
        return failed, corrupt, message

    def _copy_layer(self, part: _Part, work: Work, first: bool, at: tuple[int, int]) -> tuple[list[int], list[int], str]:
        """One layer of a column of a layered load (native copy), each block's bytes going into its
        xxh3 state; after the last layer the states are the blocks' checksums, checked here."""
        plan, m, lay = part.plan, part.mapping, part.layered
        assert isinstance(m, RankMapping) and lay is not None
        layer, col = at
        rank_bytes = part.layout.rank_block_bytes
        base = self.arenas.of(plan.layout_class).base + plan.rank * rank_bytes + layer * (rank_bytes // lay.layers)
        arena, faults = self.arenas.of(plan.layout_class), self.faults
        if first and faults.load_delay_ms:
            end = time.monotonic() + faults.load_delay_ms / 1000
            while not part.cancelled and time.monotonic() < end:
                time.sleep(0.005)
        with self._cond:
            todo = [(k, w) for k, w in enumerate(work) if w[0] not in lay.bad]
        if part.cancelled or self.clock_ms() >= (plan.deadline_ms or float("inf")):
            return [w[0] for _, w in todo], [], "" if part.cancelled else PAST_DEADLINE
        failed = [w[0] for _, w in todo if w[1] >= m.num_blocks]
        message = f"engine block {max(w[1] for _, w in todo)} is outside the {m.num_blocks} registered blocks" if failed else ""
        todo = [(k, w) for k, w in todo if w[1] < m.num_blocks]
        if layer == 0 and faults.corrupt_loads:
            for _, w in todo:
                if faults.take_corruption():
                    ctypes.memset(arena.base + w[3] + plan.rank * rank_bytes, 0x5A, 64)
        start = lay.bounds[col][0]
        states = lay.states.addresses
        try:
            blockcopy.copy_blocks(
                m.layers[layer], blockcopy.int64s([w[1] for _, w in todo]), blockcopy.int64s([base + w[3] for _, w in todo]), False,
                b"".join(states[8 * (start + k) : 8 * (start + k + 1)] for k, _ in todo),
            )
        except OSError:  # the engine shrank its file under the copy (the native copy's SIGBUS guard)
            return failed + [w[0] for _, w in todo], [], _warn_shrunk(m)
        corrupt: list[int] = []
        if layer == lay.layers - 1:
            for k, w in todo:
                if lay.states.digest(start + k) != arena.checksums.get((plan.layout_class, w[2], plan.rank), -1):
                    corrupt.append(w[0])
            message = message or ("checksum mismatch in the host tier" if corrupt else "")
        return failed, corrupt, message

    def _move(self, m: RankMapping, bid: int, hoff: int, nbytes: int, to_host: bool, want_hash: bool) -> int | None:
        """One block between the engine's tensors and the host arena, either way; with `want_hash`,
        the xxh3 of its bytes."""
        if m.packed is not None:
            return blockcopy.copy_block(m.packed, bid, self.arenas.main.base + hoff, to_host, want_hash)
        if m.device != "cpu":
            self._device_copy(m, bid, hoff, to_host)
        elif m.uniform is not None:  # one strided copy (torch releases the GIL and vectorizes)
            host, dev = self.arenas.main.tensor.narrow(0, hoff, nbytes).view(m.uniform[4], m.uniform[3]), m.block_view(bid)
            (host.copy_(dev) if to_host else dev.copy_(host))
        else:
            base = self.arenas.main.base + hoff
            for r in m.runs:
                h, e = base + r.host_offset, r.address + bid * r.block_stride
                (_memmove(h, e, r.nbytes) if to_host else _memmove(e, h, r.nbytes))
        return _xxh3_at(self.arenas.main.base + hoff, nbytes) if want_hash else None

    def _device_copy(self, m: RankMapping, bid: int, hoff: int, to_host: bool) -> None:
        """One block between a CUDA KV cache and the (pinned) host arena, on the rank's stream."""
        stream = self._stream(m)
        host = self.arenas.main.tensor
        with torch().cuda.stream(stream):
            for r in m.runs:
                dev = m.storage_bytes[r.storage].narrow(0, r.storage_offset + bid * r.block_stride, r.nbytes)
                h = host.narrow(0, hoff + r.host_offset, r.nbytes)
                (h.copy_(dev, non_blocking=True) if to_host else dev.copy_(h, non_blocking=True))
        stream.synchronize()

    def _stream(self, m: RankMapping) -> Any:
        stream = self._streams.get(m.device)
        if stream is None:
            stream = self._streams[m.device] = torch().cuda.Stream(device=m.device)
        return stream

    async def close(self) -> None:
        """Copies what is queued, then stops the threads."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        for t in self._workers:
            await asyncio.to_thread(t.join)
