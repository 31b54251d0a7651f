"""The host tier's memory: one shared-memory region, carved into slabs by the core's pools.

The region is a file under /dev/shm, mapped and then unlinked (the mapping keeps it alive; a
crashed daemon leaves no file behind). It is backed by memory lazily, from the start of the region
on, a chunk at a time: the core claims slabs in address order, so the arena keeps the claimed bytes
and LOOKAHEAD more backed (`want`, from the runtime after each plan) on a thread of its own, and a
copy that writes into the region first makes sure its bytes are backed (`ensure`, almost always a
comparison). So start-up does not wait for the tier, the daemon holds only the memory its blocks
use, and the copy path neither pays for page faults nor meets a SIGBUS when /dev/shm runs out (the
chunk fails to back and the copy fails instead). Backing uses madvise(MADV_POPULATE_WRITE), which
does not write to the memory; on kernels without it the chunk is zeroed, which is as safe, because
no copy ever writes beyond the backed bytes. With CUDA, each chunk is pinned (cudaHostRegister) as
it is backed. Per-block checksums (xxh3-64 per block and rank, taken at store, checked at load)
live beside it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time

import torch

log = logging.getLogger("kvdepotd")
CHUNK = 64 << 20  # bytes backed (and pinned) at a time
LOOKAHEAD = 256 << 20  # bytes kept backed beyond what the core has claimed
MADV_POPULATE_WRITE = 23  # Linux >= 5.14


class ArenaError(RuntimeError):
    """The arena cannot be set up as configured; the message says why."""


def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


class HostArena:
    def __init__(self, total_bytes: int, directory: str = "/dev/shm") -> None:
        self.total_bytes = total_bytes
        self.checksums: dict[tuple[str, int, int], int] = {}  # (layout class, cell, rank) -> xxh3
        self.ready_bytes = 0  # [0, ready_bytes) is backed by memory (and pinned with CUDA)
        self.error = ""  # why backing more failed: copies beyond ready_bytes fail with it
        self._target = 0  # what the backing thread works towards
        self._lock = threading.Lock()  # held while backing a chunk
        self._wake = threading.Condition()
        self._closing = False
        self._pinned: list[int] = []
        self._madvise = _madvise()
        self._cuda = torch.cuda.is_available()
        if total_bytes == 0:
            self.tensor = torch.empty(0, dtype=torch.uint8)
            self.base = 0
            return
        st = os.statvfs(directory)
        free = st.f_bavail * st.f_frsize
        if free < total_bytes:
            raise ArenaError(
                f"the host tier needs {total_bytes / 2**30:.2f} GiB of shared memory but {directory} has "
                f"{free / 2**30:.2f} GiB free: lower --host-gib or enlarge {directory}"
            )
        path = os.path.join(directory, f"kvdepotd-{os.getpid()}-{time.monotonic_ns()}.arena")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, total_bytes)
            self.tensor = torch.from_file(path, shared=True, size=total_bytes, dtype=torch.uint8)
        finally:
            os.close(fd)
            os.unlink(path)
        self.base = self.tensor.data_ptr()
        self._thread = threading.Thread(target=self._back, name="kvdepot-arena", daemon=True)
        self._thread.start()
        self.want(0)

    def want(self, claimed_bytes: int) -> None:
        """The core has claimed `claimed_bytes` of the region: keep them and LOOKAHEAD more backed."""
        target = min(self.total_bytes, claimed_bytes + LOOKAHEAD)
        if target <= self._target:
            return
        with self._wake:
            self._target = target
            self._wake.notify()

    def ensure(self, end: int) -> bool:
        """Backs the region up to byte `end` before a copy writes there; False (see `error`) when
        the memory cannot be had."""
        if end <= self.ready_bytes:
            return True
        with self._lock:
            while self.ready_bytes < end:
                if not self._back_chunk():
                    return False
        return True

    def prepare_all(self) -> None:
        """Backs the whole region now (benchmarks that time copies against other buffers)."""
        if not self.ensure(self.total_bytes):
            raise ArenaError(self.error)

    def _back(self) -> None:
        while True:
            with self._wake:
                while self._target <= self.ready_bytes and not self._closing:
                    self._wake.wait()
                if self._closing:
                    return
            with self._lock:
                if self.ready_bytes < self._target and not self._back_chunk():
                    with self._wake:
                        self._target = self.ready_bytes  # wait for more demand rather than spin

    def _back_chunk(self) -> bool:
        """Backs (and pins) the next chunk; under the lock."""
        if self.error:
            return False
        start = self.ready_bytes
        n = min(CHUNK, self.total_bytes - start)
        err = 0
        if self._madvise is not None and self._madvise(self.base + start, n, MADV_POPULATE_WRITE) != 0:
            err = ctypes.get_errno()
            if err == 22:  # EINVAL: a kernel without MADV_POPULATE_WRITE; zero the chunk from now on
                self._madvise, err = None, 0
        if self._madvise is None:
            try:
                self.tensor.narrow(0, start, n).zero_()  # nothing was written there yet (see ensure)
            except RuntimeError as e:
                self.error = f"host tier: could not back {start / 2**30:.2f} GiB and on with memory: {e}"
        elif err:
            self.error = f"host tier: /dev/shm could not back {start / 2**30:.2f} GiB and on with memory ({os.strerror(err)})"
        if self.error:
            log.error("%s; stores into the rest of the tier fail until the daemon restarts with room", self.error)
            return False
        if self._cuda:
            rc = torch.cuda.cudart().cudaHostRegister(self.base + start, n, 0)
            if int(rc) == 0:
                self._pinned.append(self.base + start)
            elif not self._pinned:
                log.warning("cudaHostRegister of the host tier failed (%s): copies to GPUs will be slower", rc)
        self.ready_bytes = start + n
        return True

    def close(self) -> None:
        if self.total_bytes == 0:
            return
        with self._wake:
            self._closing = True
            self._wake.notify()
        self._thread.join()
        with self._lock:
            for ptr in self._pinned:
                torch.cuda.cudart().cudaHostUnregister(ptr)
            self._pinned.clear()
