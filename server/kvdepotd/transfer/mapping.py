"""A worker rank's KV tensors as the daemon sees them: mapped storages and, per block, the
contiguous runs (address, bytes) to copy, in host-block order.

Handles are validated before anything is mapped: a cpu_shm path must be a regular file directly
under /dev/shm that only its owner can read (mode 0600), owned by the daemon's own user (or the
handle names a sealed memfd handed over on the handoff socket, see kvdepotd.handoff); the views
must fit in their storages, and the shapes must match the engine's layout. A bad handle is
INVALID_ARGUMENT, never a crash: every address the copy engine will touch is checked here, once.

Only the registered range of a file is mapped (and pre-faulted, and counted in mapped_bytes),
never the rest of it, and neither the range nor the file may be larger than `max_bytes`
(max_rank_gib): a worker cannot make the daemon commit memory it did not register. A file
registered by path can still be shrunk by its owner; the copies guard against that
(RankMapping.shrunk, the native copy's SIGBUS guard); a sealed memfd cannot shrink at all.
"""

from __future__ import annotations

import ctypes
import io
import mmap
import os
import socket
import stat
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvdepot.layout import KvLayout, TensorMeta, block_regions
from kvdepotd.core.errors import FailedPrecondition, InvalidRequest
from kvdepotd.storage.host_arena import PIECE, populate_write
from kvdepotd.storage.lazy_torch import torch as _torch
from kvdepotd.transfer import blockcopy
from kvdepotd.transfer.cuda_import import CudaDriverStorage, open_storage

if TYPE_CHECKING:
    import torch

SHM_DIR = "/dev/shm"
MAX_TENSORS = 4096


@dataclass(frozen=True, slots=True)
class ShmStorage:
    """CPU memory: a file under /dev/shm by path, or a memfd handed over (handoff_id)."""

    path: str
    handoff_id: str
    offset: int
    size: int


@dataclass(frozen=True, slots=True)
class CudaStorage:
    """torch's CUDA storage sharing fields (UntypedStorage._share_cuda_())."""

    device: int
    handle: bytes
    size: int
    offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One KV tensor as a view into a storage (several layers may share one)."""

    name: str
    storage: int
    storage_offset: int  # in elements
    shape: tuple[int, ...]
    stride: tuple[int, ...]  # in elements
    dtype: str


@dataclass(frozen=True, slots=True)
class RankSpec:
    """What a worker registers for its rank (RegisterKvCaches, as kvdepotd.convert reads it)."""

    rank: int
    num_blocks: int
    storages: list[ShmStorage | CudaStorage | CudaDriverStorage | None]  # None: a storage without a handle
    tensors: list[TensorSpec]


@dataclass(frozen=True, slots=True)
class Run:
    """Block b of this run is at address + b * block_stride, `nbytes` long, and lands at
    `host_offset` inside the rank's part of a host block."""

    address: int
    block_stride: int
    nbytes: int
    host_offset: int
    storage: int  # which mapped storage, and the run's byte offset in it (for device copies)
    storage_offset: int


@dataclass
class RankMapping:
    engine_id: str
    rank: int
    num_blocks: int
    runs: list[Run]
    storages: list[Storage]  # kept alive: the mappings live as long as these do
    mapped_bytes: int
    device: str  # "cpu" or "cuda:N"
    # When a block's runs are equally long, equally spaced and in one storage (vLLM CPU's layer
    # views of one storage; the contiguous layout), one strided tensor copy moves the whole block:
    # (storage, byte offset of run 0 of block 0, gap between runs, run bytes, runs).
    uniform: tuple[int, int, int, int, int] | None = None
    # CPU memory with the native block copy built: the runs as blockcopy.pack gives them to
    # copy_block (they tile the host block in order).
    packed: bytes | None = None
    # With `packed`: the runs of each layer's slice of the block, packed the same way (a host block
    # is its layers one after the other, in every layout), for loads copied layer by layer.
    layers: tuple[bytes, ...] = ()
    # The worker's doorbell (a unix datagram socket it handed over, non-blocking): each load's op id
    # goes out on it the moment this rank's part is copied (HostCopyEngine). Closed when the last
    # reference goes, like the storages, so a copy still running never sends on a reused descriptor.
    doorbell: socket.socket | None = None
    layer_rings: bool = False  # the worker waits per layer: its loads are copied layer by layer and rung (HostCopyEngine)
    # Files registered by path, which their owner may shrink, with where the registered range ends
    # (closed when the mapping goes, like the storages).
    files: list[tuple[io.FileIO, int]] = field(default_factory=list)
    warned_shrunk: bool = False
    _tensors: list[torch.Tensor] | None = None

    @property
    def storage_bytes(self) -> list[torch.Tensor]:
        """A uint8 tensor over each storage, on its device: made at first use, for the copies that
        go through torch (GPU memory; CPU memory without the native block copy), so that a daemon
        whose engines map only CPU memory never imports torch."""
        if self._tensors is None:
            torch = _torch()
            self._tensors = [
                torch.frombuffer(s.keep, dtype=torch.uint8) if isinstance(s.keep, mmap.mmap)
                else torch.empty(0, dtype=torch.uint8, device=self.device).set_(s.keep, 0, (s.nbytes,))
                for s in self.storages
            ]
        return self._tensors

    def shrunk(self) -> bool:
        """A file registered by path no longer reaches the end of its registered range: a copy
        into it would fault (SIGBUS). The native copy catches that itself; the other copy paths ask
        this first (a shrink between the question and the copy is not caught: build the native copy)."""
        try:
            return any(os.fstat(f.fileno()).st_size < end for f, end in self.files)
        except (OSError, ValueError):
            return True

    def ring(self, op_id: int, intact: bool) -> None:
        """Tells the worker that `op_id`'s bytes are in its blocks, and whether every one of them was
        copied and matched its checksum already; best effort, never blocks (a full or closed socket
        drops it: the worker stream's report follows anyway)."""
        if self.doorbell is not None:
            try:
                self.doorbell.send(op_id.to_bytes(8, "little") + bytes([intact]))
            except OSError:
                pass

    def ring_layers(self, op_id: int, layers: int) -> None:
        """Tells the worker that `op_id`'s first `layers` layers are in its blocks (not yet checked:
        the part's own ring says whether they were); best effort, like ring()."""
        if self.doorbell is not None:
            try:
                self.doorbell.send(op_id.to_bytes(8, "little") + b"\x02" + layers.to_bytes(2, "little"))
            except OSError:
                pass

    def block_view(self, bid: int) -> torch.Tensor:
        """The block as a [runs, run bytes] strided uint8 view (only when `uniform`)."""
        assert self.uniform is not None
        storage, first, gap, nbytes, nruns = self.uniform
        block_stride = self.runs[0].block_stride
        return self.storage_bytes[storage].as_strided((nruns, nbytes), (gap, 1), first + bid * block_stride)


@dataclass(frozen=True, slots=True)
class Storage:
    """One mapped storage: what keeps the mapping alive (the mmap of CPU memory, torch's storage
    of GPU memory), where it starts and how long it is."""

    keep: object
    address: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class _Opened:
    storage: Storage
    start: int  # the address where the registered range starts
    file: io.FileIO | None  # a file its owner may shrink (registered by path), kept open to check it
    end: int  # where the registered range ends in that file


def _open_cpu_shm(h: ShmStorage, fds: Mapping[str, int], max_bytes: int) -> _Opened:
    if h.handoff_id:  # a memfd handed over (kvdepotd.handoff checked its seal): it cannot shrink
        return _map_range(fds[h.handoff_id], h, max_bytes, "the memory handed over", keep=False)
    path = os.path.realpath(h.path)
    if os.path.dirname(path) != SHM_DIR:
        raise InvalidRequest(f"cpu_shm path {h.path!r} is not a file directly under {SHM_DIR}")
    try:  # checked on the descriptor itself, so the file cannot be swapped between check and map
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise InvalidRequest(f"cpu_shm path {h.path!r} cannot be opened: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidRequest(f"cpu_shm path {h.path!r} is not a regular file")
        if st.st_mode & 0o077:
            raise InvalidRequest(f"cpu_shm path {h.path!r} has mode {oct(st.st_mode & 0o777)}; it must be 0600")
        if st.st_uid != os.geteuid():  # a daemon running as root must not read or write other users' memory
            raise InvalidRequest(
                f"cpu_shm path {h.path!r} belongs to uid {st.st_uid}; the daemon runs as uid {os.geteuid()} and maps only its own user's files"
            )
        return _map_range(fd, h, max_bytes, f"the file {h.path!r}", keep=True)
    except BaseException:
        os.close(fd)
        raise


def _map_range(fd: int, h: ShmStorage, max_bytes: int, what: str, keep: bool) -> _Opened:
    """Maps [h.offset, h.offset + h.size) of `fd` (from the page it starts in). `keep`: the mapping
    keeps `fd` open to check its size (else `fd` stays the caller's to close)."""
    size = os.fstat(fd).st_size
    if h.size == 0 or h.offset + h.size > size:
        raise InvalidRequest(f"cpu_shm storage [{h.offset}, {h.offset + h.size}) does not fit the {size}-byte {what}")
    if size > max_bytes:
        raise InvalidRequest(
            f"{what} is {size / 2**30:.2f} GiB, over the {max_bytes / 2**30:.2f} GiB one rank may register (max_rank_gib): "
            "register memory of the KV cache's own size"
        )
    lo = h.offset - h.offset % mmap.ALLOCATIONGRANULARITY
    try:
        mm = mmap.mmap(fd, h.offset + h.size - lo, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=lo)
    except OSError as e:
        raise InvalidRequest(f"{what} cannot be mapped for writing: {e.strerror}") from None
    address = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    return _Opened(Storage(mm, address, len(mm)), address + h.offset - lo, io.FileIO(fd, "r+", closefd=True) if keep else None, h.offset + h.size)


def _open_cuda_driver(h: CudaDriverStorage, fds: Mapping[str, int]) -> _Opened:
    storage = open_storage(h, fds).untyped_storage()  # keeps the mapping alive
    return _Opened(Storage(storage, storage.data_ptr(), storage.nbytes()), storage.data_ptr(), None, 0)


def _open(s: ShmStorage | CudaStorage | CudaDriverStorage, fds: Mapping[str, int], max_bytes: int) -> _Opened:
    if isinstance(s, ShmStorage):
        return _open_cpu_shm(s, fds, max_bytes)
    return _open_cuda_ipc(s) if isinstance(s, CudaStorage) else _open_cuda_driver(s, fds)


def _open_cuda_ipc(h: CudaStorage) -> _Opened:
    torch = _torch()
    if not torch.cuda.is_available():
        raise FailedPrecondition("this daemon has no CUDA device: it cannot map cuda_ipc handles")
    if h.device >= torch.cuda.device_count():
        raise InvalidRequest(f"cuda_ipc device {h.device} does not exist here ({torch.cuda.device_count()} devices)")
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            h.device, h.handle, h.size, h.offset, h.ref_counter_handle, h.ref_counter_offset, h.event_handle, h.event_sync_required
        )
        return _Opened(Storage(storage, storage.data_ptr(), storage.nbytes()), storage.data_ptr(), None, 0)
    except RuntimeError as e:
        raise InvalidRequest(f"cuda_ipc handle does not open: {e}") from None


def map_rank(engine_id: str, layout: KvLayout, req: RankSpec, fds: Mapping[str, int] | None = None, max_bytes: int = 1 << 62) -> RankMapping:
    """`fds`: the descriptors of the handoff ids the request names (the caller claimed and closes
    them). `max_bytes`: the most one rank may register, and the largest file behind a storage."""
    fds = fds or {}
    if layout.kind == "none":
        raise FailedPrecondition("the engine registered layout kind 'none': it has no KV tensors to map")
    if not req.storages or not req.tensors or len(req.tensors) > MAX_TENSORS:
        raise InvalidRequest(f"register 1 to {MAX_TENSORS} tensors over at least one storage")
    if req.num_blocks == 0:
        raise InvalidRequest("num_blocks must be positive")
    metas: list[TensorMeta] = []
    for i, t in enumerate(req.tensors):
        if t.dtype != layout.dtype:
            raise InvalidRequest(f"tensor {i} ({t.name}) is {t.dtype!r}, the engine's layout says {layout.dtype!r}")
        if t.storage >= len(req.storages):
            raise InvalidRequest(f"tensor {i} ({t.name}) names storage {t.storage} of {len(req.storages)}")
        metas.append(TensorMeta(t.shape, t.stride, t.storage_offset))
    try:
        regions = block_regions(layout, metas, req.num_blocks)
    except ValueError as e:
        raise InvalidRequest(str(e)) from None
    kinds = {type(s) for s in req.storages}
    if type(None) in kinds or (ShmStorage in kinds and len(kinds) != 1):
        raise InvalidRequest("every storage needs a handle, and all in host memory (cpu_shm) or all on a GPU (cuda_ipc, cuda_driver)")
    sizes = [s.size for s in req.storages if s is not None]
    if isinstance(req.storages[0], ShmStorage) and sum(sizes) > max_bytes:
        raise InvalidRequest(f"the rank registers {sum(sizes) / 2**30:.2f} GiB, over the {max_bytes / 2**30:.2f} GiB one rank may (max_rank_gib)")
    esize = layout.dtype_bytes
    for r in regions:  # every byte the copy engine may touch must lie inside its storage
        t = req.tensors[r.tensor]
        last = (t.storage_offset + r.offset + (req.num_blocks - 1) * r.block_stride + r.length) * esize
        if last > sizes[t.storage]:
            raise InvalidRequest(f"tensor {r.tensor} ({t.name}) reaches byte {last}, past its {sizes[t.storage]}-byte storage")
    opened: list[_Opened] = []
    try:
        for s in req.storages:
            opened.append(_open(s, fds, max_bytes))  # type: ignore[arg-type]
    except BaseException:
        for o in opened:
            if o.file is not None:
                o.file.close()
        raise
    runs: list[Run] = []
    host_off = 0
    for r in regions:
        t = req.tensors[r.tensor]
        o = opened[t.storage]
        base = o.start + (t.storage_offset + r.offset) * esize
        runs.append(Run(base, r.block_stride * esize, r.length * esize, host_off, t.storage, base - o.storage.address))
        host_off += r.length * esize
    first = req.storages[0]
    device = "cpu" if isinstance(first, ShmStorage) else f"cuda:{first.device}"  # type: ignore[union-attr]
    packed: bytes | None = None
    layers: tuple[bytes, ...] = ()
    if device == "cpu" and blockcopy.available:
        packed = blockcopy.pack([(r.address, r.block_stride, r.nbytes) for r in runs])
        layers = tuple(blockcopy.pack(lr) for lr in layer_runs(runs, layout.num_layers))
    mapped = sum(o.storage.nbytes for o in opened) if device == "cpu" else sum(sizes)
    files = [(o.file, o.end) for o in opened if o.file is not None]
    m = RankMapping(
        engine_id, req.rank, req.num_blocks, runs, [o.storage for o in opened], mapped, device, _uniform(runs), packed, layers, files=files,
    )
    if packed is None:
        m.storage_bytes  # noqa: B018 (its copies go through torch: imported and made here, on the registration's thread, not in a copy)
    return m


def layer_runs(runs: list[Run], num_layers: int) -> list[list[tuple[int, int, int]]]:
    """Per layer, the (address, block stride, bytes) runs of its slice of the block: the runs tile
    the host block in order, and layer l is its l-th equal slice (a run that spans layers, as a
    contiguous layout's one run does, is cut at their edges)."""
    total = sum(r.nbytes for r in runs)
    size = total // num_layers
    out: list[list[tuple[int, int, int]]] = [[] for _ in range(num_layers)]
    for r in runs:
        at = 0
        while at < r.nbytes:
            layer = (r.host_offset + at) // size
            n = min(r.nbytes - at, (layer + 1) * size - (r.host_offset + at))
            out[layer].append((r.address + at, r.block_stride, n))
            at += n
    return out


def populate(m: RankMapping, stop: threading.Event | None = None) -> bool:
    """Faults a CPU mapping's pages in ahead of its first copy (the daemon's first touch of each
    4-KiB page of engine memory otherwise costs a page fault inside that copy). Blocks the calling
    thread for as long as the kernel takes: call it off the event loop. It goes 2 MiB at a time
    because the kernel holds the process's memory-map lock while it works, and any thread that maps
    memory meanwhile (the event loop allocating a large buffer) waits for it: one call over a whole
    mapping can hold a Step past its deadline. False where the kernel
    cannot (before Linux 5.14, not Linux, or a GPU mapping), or once `stop` is set (the daemon is
    shutting down and must not wait for this): copies fault pages in as before."""
    if m.device != "cpu":
        return False
    for storage in m.storages:
        addr = storage.address
        start, end = addr - addr % mmap.PAGESIZE, addr + storage.nbytes
        for lo in range(start, end, PIECE):
            if (stop is not None and stop.is_set()) or populate_write(lo, min(PIECE, end - lo)) != 0:
                return False
    return True


def _uniform(runs: list[Run]) -> tuple[int, int, int, int, int] | None:
    first = runs[0]
    gap = runs[1].storage_offset - first.storage_offset if len(runs) > 1 else first.nbytes
    for k, r in enumerate(runs):
        if (r.storage, r.nbytes, r.block_stride, r.host_offset) != (first.storage, first.nbytes, first.block_stride, k * first.nbytes):
            return None
        if r.storage_offset != first.storage_offset + k * gap or gap < first.nbytes:
            return None
    return first.storage, first.storage_offset, gap, first.nbytes, len(runs)
