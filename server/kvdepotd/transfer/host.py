"""The host-tier copy engine: engine KV blocks <-> the host arena, on worker threads.

A part (one op on one rank) is cut into chunks of blocks that run on a small thread pool: as many
chunks as threads, at most 32 blocks each (fewer hand-offs than the earlier 8-block chunks: 0.65-0.69
of a memcpy in bench/host_tier.py against 0.60-0.68). A CPU block is one strided torch copy when its
runs are evenly spaced in one storage, else one ctypes.memmove per run; both release the GIL, so
the threads copy at once. CUDA copies go through a dedicated stream and are synchronized before the
part reports. Stores checksum each (block, rank) with xxh3 after copying; loads check it before
copying and report a mismatch as a corrupt block (the engine recomputes, the tier drops it).
Engines of layout kind "none" have no tensors: their parts end at once (bookkeeping only).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from kvdepot.layout import KvLayout
from kvdepotd.core.ops import Op, OpKind
from kvdepotd.core.pool import SlotId
from kvdepotd.storage.checksum import xxh3_at as _xxh3_at
from kvdepotd.storage.host_arena import HostArena
from kvdepotd.transfer.base import CopyEngine, PartDone
from kvdepotd.transfer.mapping import RankMapping

log = logging.getLogger("kvdepotd")
_memmove = ctypes.memmove
Work = list[tuple[int, int, SlotId]]  # (block index, engine block id, host slot)


@dataclass
class Faults:
    """Fault injection for tests (kvdepotd --fault-*): slow loads, corrupt host bytes."""

    load_delay_ms: int = 0
    corrupt_loads: int = 0  # blocks still to corrupt before they are checked
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take_corruption(self) -> bool:
        with self.lock:
            if self.corrupt_loads <= 0:
                return False
            self.corrupt_loads -= 1
            return True


@dataclass
class _Part:
    op: Op
    rank: int
    chunks_left: int
    failed: list[int] = field(default_factory=list)
    corrupt: list[int] = field(default_factory=list)
    message: str = ""


class HostCopyEngine(CopyEngine):
    def __init__(
        self, on_done: Callable[[list[PartDone]], None], arena: HostArena, threads: int = 2, chunk_blocks: int = 32, faults: Faults | None = None
    ) -> None:
        super().__init__(on_done)
        self.arena = arena
        self.faults = faults or Faults()
        self.layouts: dict[str, KvLayout] = {}
        self.mappings: dict[tuple[str, int], RankMapping] = {}
        self.chunk_blocks = chunk_blocks  # the most blocks one task copies (so an op cannot hold a thread long)
        self.threads = threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvdepot-copy")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, torch.cuda.Stream] = {}
        self._events: dict[tuple[str, int], tuple[int, bytes]] = {}  # (engine, rank) -> last (step, CUDA event handle)

    # -- engines and their tensors --------------------------------------------------------------
    def add_engine(self, engine_id: str, layout: KvLayout) -> None:
        self.layouts[engine_id] = layout

    def add_mapping(self, mapping: RankMapping) -> None:
        self.mappings[(mapping.engine_id, mapping.rank)] = mapping

    @property
    def mapped_bytes(self) -> int:
        return sum(m.mapped_bytes for m in self.mappings.values())

    def forget_engine(self, engine_id: str) -> None:
        """Unmaps the engine's tensors (running copies keep theirs alive until they end)."""
        self.layouts.pop(engine_id, None)
        for key in [k for k in self.mappings if k[0] == engine_id]:
            del self.mappings[key]
            self._events.pop(key, None)

    def note_forward_event(self, engine_id: str, rank: int, step: int, handle: bytes) -> None:
        """A GPU worker's end-of-forward event for `step`; stores of that step wait on it (CPU
        mappings have nothing to wait for and ignore it)."""
        m = self.mappings.get((engine_id, rank))
        if m is not None and m.device != "cpu":
            self._events[(engine_id, rank)] = (step, handle)

    # -- parts ------------------------------------------------------------------------------------
    def submit(self, parts: list[tuple[Op, int]]) -> None:
        now: list[PartDone] = []
        for op, rank in parts:
            layout = self.layouts.get(op.engine_id)
            if layout is None or layout.kind == "none":
                now.append(PartDone(op.op_id, rank, sorted(op.failed), op.message))
                continue
            mapping = self.mappings.get((op.engine_id, rank))
            if mapping is None:
                now.append(PartDone(op.op_id, rank, list(op.block_indices), f"rank {rank} has not registered its KV caches"))
                continue
            self._start(op, rank, mapping, layout)
        if now:
            self.on_done(now)

    def _start(self, op: Op, rank: int, mapping: RankMapping, layout: KvLayout) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        work: Work = [
            (i, bid, slot) for i, bid, slot in zip(op.block_indices, op.block_ids, op.tier_slots) if slot is not None and i not in op.failed
        ]
        n = min(self.chunk_blocks, max(1, -(-len(work) // self.threads)))  # a small op still uses every thread
        chunks = [work[k : k + n] for k in range(0, len(work), n)] or [[]]
        part = _Part(op, rank, len(chunks), failed=sorted(op.failed), message=op.message)
        loop = self._loop

        def finished(fut: Future[tuple[list[int], list[int], str]]) -> None:
            loop.call_soon_threadsafe(self._chunk_done, part, fut)

        for chunk in chunks:
            self._pool.submit(self._copy, op, layout, mapping, rank, chunk, self._forward_event(op, rank)).add_done_callback(finished)

    def _chunk_done(self, part: _Part, fut: Future[tuple[list[int], list[int], str]]) -> None:
        try:
            failed, corrupt, message = fut.result()
        except Exception as e:  # a bug in a copy: its blocks fail, the daemon serves on
            log.exception("copy of op %d failed", part.op.op_id)
            failed, corrupt, message = list(part.op.block_indices), [], f"copy failed: {e}"
        part.failed += failed
        part.corrupt += corrupt
        part.message = part.message or message
        part.chunks_left -= 1
        if part.chunks_left == 0:
            self.on_done([PartDone(part.op.op_id, part.rank, part.failed, part.message, part.corrupt)])

    # -- the copies (worker threads) ------------------------------------------------------------------
    def _forward_event(self, op: Op, rank: int) -> bytes | None:
        """The handle of the event a GPU store must wait on: the one reported for its step or later."""
        if op.kind is not OpKind.STORE:
            return None
        got = self._events.get((op.engine_id, rank))
        return got[1] if got is not None and got[0] >= op.step else None

    def _copy(self, op: Op, layout: KvLayout, m: RankMapping, rank: int, work: Work, event: bytes | None = None) -> tuple[list[int], list[int], str]:
        kind, pool = op.kind, op.registry.pool
        if event is not None and m.device != "cpu":  # the forward may still be running on the GPU
            self._stream(m).wait_event(torch.cuda.Event.from_ipc_handle(torch.device(m.device), event))
        failed: list[int] = []
        corrupt: list[int] = []
        message = ""
        rank_bytes = layout.rank_block_bytes
        rank_off = rank * rank_bytes
        cls = layout.layout_class
        arena = self.arena
        on_gpu = m.device != "cpu"
        faults = self.faults
        if kind is OpKind.LOAD and faults.load_delay_ms:
            time.sleep(faults.load_delay_ms / 1000)
        for i, bid, slot in work:
            if rank not in op.parts_left:  # the op ended (its deadline passed): touch no more engine blocks
                break
            if bid >= m.num_blocks:
                failed.append(i)
                message = message or f"engine block {bid} is outside the {m.num_blocks} registered blocks"
                continue
            hoff = pool.byte_offset(slot) + rank_off
            key = (cls, slot, rank)
            if kind is OpKind.STORE:
                if on_gpu:
                    self._device_copy(m, bid, hoff, to_host=True)
                elif m.uniform is not None:  # one strided copy (torch releases the GIL and vectorizes)
                    arena.tensor.narrow(0, hoff, rank_bytes).view(m.uniform[4], m.uniform[3]).copy_(m.block_view(bid))
                else:
                    host = arena.base + hoff
                    for r in m.runs:
                        _memmove(host + r.host_offset, r.address + bid * r.block_stride, r.nbytes)
                arena.checksums[key] = _xxh3_at(arena.base + hoff, rank_bytes)
                arena.verified.discard(key)
            else:
                injected = bool(faults.corrupt_loads) and faults.take_corruption()
                if injected:
                    ctypes.memset(arena.base + hoff, 0x5A, 64)
                want = arena.checksums.get(key)
                if key in arena.verified and not injected:
                    arena.verified.discard(key)  # read from disk for this load and checked there a moment ago
                elif want is None or _xxh3_at(arena.base + hoff, rank_bytes) != want:
                    corrupt.append(i)
                    message = message or "checksum mismatch in the host tier"
                    continue
                if on_gpu:
                    self._device_copy(m, bid, hoff, to_host=False)
                elif m.uniform is not None:
                    m.block_view(bid).copy_(arena.tensor.narrow(0, hoff, rank_bytes).view(m.uniform[4], m.uniform[3]))
                else:
                    host = arena.base + hoff
                    for r in m.runs:
                        _memmove(r.address + bid * r.block_stride, host + r.host_offset, r.nbytes)
        return failed, corrupt, message

    def _device_copy(self, m: RankMapping, bid: int, hoff: int, to_host: bool) -> None:
        """One block between a CUDA KV cache and the (pinned) host arena, on the rank's stream."""
        stream = self._stream(m)
        host = self.arena.tensor
        with torch.cuda.stream(stream):
            for r in m.runs:
                dev = m.storage_bytes[r.storage].narrow(0, r.storage_offset + bid * r.block_stride, r.nbytes)
                h = host.narrow(0, hoff + r.host_offset, r.nbytes)
                (h.copy_(dev, non_blocking=True) if to_host else dev.copy_(h, non_blocking=True))
        stream.synchronize()

    def _stream(self, m: RankMapping) -> torch.cuda.Stream:
        stream = self._streams.get(m.device)
        if stream is None:
            stream = self._streams[m.device] = torch.cuda.Stream(device=m.device)
        return stream

    async def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=False)
