"""Engine-side copy: a worker whose KV memory the daemon cannot map copies its blocks itself.

Where a rank's KV memory cannot be shared with the daemon (a GPU pool from an allocator whose
memory neither torch nor the CUDA driver API can export, or `copy_mode: engine`), the engine
registers with engine_copies: the daemon keeps its blocks in host memory of their own, one region
per namespace and layout (no other namespace's block is in it), hands that memory to the worker
(HandoffRequest.fetch_arena), and sends each part of a load or store as a CopyOrder on the rank's
stream. The daemon still plans every op and checks every block (a load's checksums before its
order, a store's after its report); this copies, on a thread of its own and, on a GPU, on a CUDA
stream of its own with the host memory pinned for DMA:

    EngineCopier(tensors, layout, num_blocks, report)   the rank's KV tensors, in layer order
    .map_arena(fd, size)       the engine's host memory (again after a daemon restart)
    .submit(orders)            carried out in order; report(op_id, failed indices, message) after each
    .note_forward(step, event) (GPU) a store of `step` waits for this event on the copy stream
    .busy(op_id)               an order of the op is queued or copying: the engine must not act on
                               the op's end yet (kvdepot.connector.worker defers it)
    .close()

A block is the concatenation of its regions (kvdepot.layout.block_regions), as the daemon's own
copies lay it out, so the bytes are the same whoever copies them.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import mmap
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvdepot.layout import KvLayout, TensorMeta, block_regions
from kvdepot.v1 import kvdepot_pb2 as pb

log = logging.getLogger("kvdepot")
PIN_CHUNK = 64 << 20  # host memory is pinned (cudaHostRegister) this much at a time, as orders reach it
Report = Callable[[int, list[int], str], None]


class EngineCopier:
    def __init__(self, tensors: Sequence[torch.Tensor], layout: KvLayout, num_blocks: int, report: Report) -> None:
        metas = [TensorMeta(tuple(t.shape), tuple(t.stride()), int(t.storage_offset())) for t in tensors]
        regions = block_regions(layout, metas, num_blocks)  # ValueError: the tensors are not the layout's
        esize = layout.dtype_bytes
        self.device = tensors[0].device
        self.num_blocks = num_blocks
        self.rank_bytes = layout.rank_block_bytes
        self._bytes = [torch.empty(0, dtype=torch.uint8, device=self.device).set_(t.untyped_storage(), 0, (t.untyped_storage().nbytes(),)) for t in tensors]  # type: ignore[call-overload]
        # Per region: (tensor, byte offset of block 0, bytes between blocks, bytes, offset in the host block).
        self._runs: list[tuple[int, int, int, int, int]] = []
        host = 0
        for r in regions:
            t = tensors[r.tensor]
            self._runs.append((r.tensor, (int(t.storage_offset()) + r.offset) * esize, r.block_stride * esize, r.length * esize, host))
            host += r.length * esize
        self.report = report
        self._host: torch.Tensor | None = None
        self._mm: mmap.mmap | None = None
        self._pinned: set[int] = set()
        self._stream: Any = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None
        self._events: collections.OrderedDict[int, Any] = collections.OrderedDict()  # step -> the forward's event
        self._queue: collections.deque[pb.CopyOrder] = collections.deque()
        self._pending: collections.Counter[int] = collections.Counter()  # op id -> orders queued or copying
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvdepot-engine-copy", daemon=True)
        self._thread.start()

    def map_arena(self, fd: int, size: int) -> None:
        """Maps the engine's host memory (the descriptor is the caller's to close)."""
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        with self._cond:
            self._unpin()
            self._mm, self._host = mm, torch.frombuffer(mm, dtype=torch.uint8)

    def note_forward(self, step: int, event: Any) -> None:
        with self._cond:
            self._events[step] = event
            while len(self._events) > 64:
                self._events.popitem(last=False)

    def submit(self, orders: Sequence[pb.CopyOrder]) -> None:
        with self._cond:
            for o in orders:
                self._queue.append(o)
                self._pending[o.op_id] += 1
            self._cond.notify_all()

    def busy(self, op_id: int) -> bool:
        with self._cond:
            return self._pending[op_id] > 0

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(5)
        with self._cond:
            self._unpin()

    # -- the copy thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        if self._stream is not None:
            torch.cuda.set_device(self.device)  # this thread's copies and pins are the rank's device's, not device 0's
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                order = self._queue.popleft()
                host = self._host
                event = self._events_after(order.step) if order.store else None
            try:
                failed, message = self._copy(order, host, event)
            except Exception as e:  # a bug or a device error: the blocks fail (the engine recomputes), the worker goes on
                log.exception("kvdepot: engine-side copy of op %d failed", order.op_id)
                failed, message = list(order.indices), f"engine-side copy failed: {e}"
            with self._cond:  # done before the report: the op's end may come back at once
                self._pending[order.op_id] -= 1
                if self._pending[order.op_id] <= 0:
                    del self._pending[order.op_id]
                self._cond.notify_all()
            self.report(order.op_id, failed, message)

    def _events_after(self, step: int) -> Any:
        return next((e for s, e in self._events.items() if s >= step), None)

    def _copy(self, order: pb.CopyOrder, host: torch.Tensor | None, event: Any) -> tuple[list[int], str]:
        if host is None:
            return list(order.indices), "the engine's host memory is not mapped here"
        failed: list[int] = []
        todo: list[tuple[int, int]] = []
        for i, bid, hoff in zip(order.indices, order.block_ids, order.host_offsets):
            if bid >= self.num_blocks or hoff + self.rank_bytes > host.numel():
                failed.append(i)
            else:
                todo.append((bid, hoff))
        if self._stream is None:
            self._copy_cpu(todo, host, order.store)
        else:
            self._copy_cuda(todo, host, order.store, event)
        return failed, "a block outside this rank's memory" if failed else ""

    def _copy_cpu(self, todo: list[tuple[int, int]], host: torch.Tensor, to_host: bool) -> None:
        hbase, move = host.data_ptr(), ctypes.memmove
        bases = [b.data_ptr() for b in self._bytes]
        for bid, hoff in todo:
            for t, first, stride, n, at in self._runs:
                e, h = bases[t] + first + bid * stride, hbase + hoff + at
                (move(h, e, n) if to_host else move(e, h, n))

    def _copy_cuda(self, todo: list[tuple[int, int]], host: torch.Tensor, to_host: bool, event: Any) -> None:
        for _, hoff in todo:
            self._pin(host, hoff)
        with torch.cuda.stream(self._stream):
            if event is not None:
                self._stream.wait_event(event)  # the forward that computed the blocks has ended
            for bid, hoff in todo:
                for t, first, stride, n, at in self._runs:
                    dev, h = self._bytes[t].narrow(0, first + bid * stride, n), host.narrow(0, hoff + at, n)
                    (h.copy_(dev, non_blocking=True) if to_host else dev.copy_(h, non_blocking=True))
        self._stream.synchronize()

    def _pin(self, host: torch.Tensor, hoff: int) -> None:
        """Pins the chunks the block lies in, once (unpinned host memory would be copied through a staging buffer)."""
        for chunk in range(hoff // PIN_CHUNK, (hoff + self.rank_bytes - 1) // PIN_CHUNK + 1):
            if chunk in self._pinned:
                continue
            lo = chunk * PIN_CHUNK
            n = min(PIN_CHUNK, host.numel() - lo)
            if int(torch.cuda.cudart().cudaHostRegister(host.data_ptr() + lo, n, 1)) == 0:  # 1: cudaHostRegisterPortable
                self._pinned.add(chunk)

    def _unpin(self) -> None:
        if self._host is not None and self._stream is not None:
            for chunk in self._pinned:
                torch.cuda.cudart().cudaHostUnregister(self._host.data_ptr() + chunk * PIN_CHUNK)
        self._pinned.clear()

