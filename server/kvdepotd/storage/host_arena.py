"""The host tier's memory: one shared-memory region, carved into slabs by the core's pools.

The region is a file under /dev/shm, mapped and then unlinked (the mapping keeps it alive; a
crashed daemon leaves no file behind). It is backed by memory lazily, from the start of the region
on, as copies write into it: a copy first makes sure its bytes are backed (`ensure`, almost always
a comparison), and a thread of its own keeps LOOKAHEAD bytes beyond the furthest write backed, so
the copies seldom back memory themselves (they never wait for that thread). (The core claims slabs in address order, so writes move forward
through the region.) So start-up does not wait for the tier, the daemon holds only the memory its
blocks use (none for engines that move no bytes), and the copy path neither pays for page faults
nor meets a SIGBUS when /dev/shm runs out (the piece fails to back and the copy fails instead).

Backing uses madvise(MADV_POPULATE_WRITE), which does not write to the memory; on kernels without
it a piece is allocated in the region's file (posix_fallocate), which is as safe: no copy ever
writes beyond the backed bytes, and the file has the memory for every one of them. It goes
PIECE bytes per call: the kernel holds the process's memory-map lock for a call, and an event loop
that maps memory meanwhile waits for it (docs/performance.md). The thread runs at BACKING_NICE: the
kernel's page clearing is work the engine and the event loop come before (not SCHED_IDLE: see
`_lower_priority`). With CUDA, each CHUNK is
pinned (cudaHostRegister) once it is backed. Per-block checksums (xxh3-64 per block and rank, taken
at store, checked at load) live beside it.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import threading
import time
from typing import Any

from kvdepotd.core.disk import is_private
from kvdepotd.storage.lazy_torch import cuda_present, torch

log = logging.getLogger("kvdepotd")
PIECE = 2 << 20  # bytes backed per call (the memory-map lock is held that long)
CHUNK = 64 << 20  # bytes pinned at a time with CUDA
LOOKAHEAD = 256 << 20  # bytes kept backed beyond the furthest write
BACKING_NICE = 10  # the backing thread's priority below the daemon's, as the store threads'
MADV_POPULATE_WRITE = 23  # Linux >= 5.14


class ArenaError(RuntimeError):
    """The arena cannot be set up as configured; the message says why."""


def _bind_madvise() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise = _bind_madvise()


def populate_write(addr: int, nbytes: int) -> int:
    """madvise(MADV_POPULATE_WRITE) over [addr, addr + nbytes): every page backed and mapped
    writable, nothing written. 0, or the errno: EINVAL for a kernel before 5.14, ENOMEM or EFAULT
    when the memory cannot be had. The kernel holds the process's memory-map lock for the call:
    keep `nbytes` to PIECE or so."""
    if _madvise is None:
        return errno.ENOSYS
    return 0 if _madvise(addr, nbytes, MADV_POPULATE_WRITE) == 0 else ctypes.get_errno()


def allocate(fd: int, offset: int, nbytes: int) -> int:
    """posix_fallocate of the region's file: the pages reserved, or the errno (ENOSPC when the
    memory cannot be had, where a write would have met SIGBUS). For kernels before 5.14."""
    try:
        os.posix_fallocate(fd, offset, nbytes)
    except OSError as e:
        return e.errno or errno.EIO
    return 0


class HostArena:
    def __init__(self, total_bytes: int, directory: str = "/dev/shm", private: bool = False) -> None:
        """`private`: the memory of one private domain (engines that copy their blocks themselves,
        kvdepotd.core.disk.private_class): a memfd the daemon hands to their workers (`fd`), sealed
        so that no holder can shrink or grow it; the daemon pins none of it (the workers do)."""
        self.total_bytes = total_bytes
        self.fd = -1
        self._file = -1  # the region's file (the memfd, or the unlinked file under /dev/shm)
        self.checksums: dict[tuple[str, int, int], int] = {}  # (layout class, cell, rank) -> xxh3
        self.ready_bytes = 0  # [0, ready_bytes) is backed by memory (and pinned with CUDA)
        self.error = ""  # why backing more failed: copies beyond ready_bytes fail with it
        self._target = 0  # what the backing thread works towards
        self._lock = threading.Lock()  # held while a piece is marked backed (and its chunk pinned), never while backing it
        self._wake = threading.Condition()
        self._closing = False
        self._pinned: list[tuple[int, int]] = []  # (address, bytes) registered with CUDA
        self._populate = True  # until the kernel says it has no MADV_POPULATE_WRITE
        self._cuda = not private and total_bytes > 0 and cuda_present()
        self._mmap: mmap.mmap | None = None
        self._tensor: Any = None
        if total_bytes == 0:
            self.base = 0
            return
        if private:
            self.fd = os.memfd_create("kvdepotd-private-arena", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            os.ftruncate(self.fd, total_bytes)  # sparse: memory is taken as blocks arrive, as in the main arena
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self._file = self.fd
            self._mmap = mmap.mmap(self.fd, total_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            self.base = ctypes.addressof(ctypes.c_char.from_buffer(self._mmap))
            self._thread = threading.Thread(target=self._back, name="kvdepot-arena-private", daemon=True)
            self._thread.start()
            return
        st = os.statvfs(directory)
        free = st.f_bavail * st.f_frsize
        if free < total_bytes:
            raise ArenaError(
                f"the host tier needs {total_bytes / 2**30:.2f} GiB of shared memory but {directory} has "
                f"{free / 2**30:.2f} GiB free: lower --host-gib or enlarge {directory}"
            )
        path = os.path.join(directory, f"kvdepotd-{os.getpid()}-{time.monotonic_ns()}.arena")
        self._file = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(self._file, total_bytes)
            self._mmap = mmap.mmap(self._file, total_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self._file)
            raise
        finally:
            os.unlink(path)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self._mmap))
        self._thread = threading.Thread(target=self._back, name="kvdepot-arena", daemon=True)
        self._thread.start()
        self.want(0)

    @property
    def tensor(self) -> Any:
        """A torch uint8 tensor over the region (made at first use: torch is imported then)."""
        if self._tensor is None:
            t = torch()
            self._tensor = t.empty(0, dtype=t.uint8) if self._mmap is None else t.frombuffer(self._mmap, dtype=t.uint8)
        return self._tensor

    def want(self, upto: int) -> None:
        """Has the thread back the region up to byte `upto` and LOOKAHEAD beyond, in the background."""
        target = min(self.total_bytes, upto + LOOKAHEAD)
        if target <= self._target:
            return
        with self._wake:
            self._target = target
            self._wake.notify()

    def ensure(self, end: int) -> bool:
        """Backs the region up to byte `end` before a copy writes there (and has the thread stay
        LOOKAHEAD ahead); False (see `error`) when the memory cannot be had."""
        self.want(end)
        while self.ready_bytes < end:  # on the copy's own thread: it never waits for the backing thread
            if not self._back_piece():
                return False
        return True

    def prepare_all(self) -> None:
        """Backs the whole region now (benchmarks that time copies against other buffers)."""
        if not self.ensure(self.total_bytes):
            raise ArenaError(self.error)

    def _back(self) -> None:
        self._lower_priority()
        while True:
            with self._wake:
                while self._target <= self.ready_bytes and not self._closing:
                    self._wake.wait()
                if self._closing:
                    return
            if not self._back_piece():
                with self._wake:
                    self._target = self.ready_bytes  # wait for more demand rather than spin

    def _lower_priority(self) -> None:
        """BACKING_NICE, not SCHED_IDLE: a Python thread holds the GIL between its calls, and one
        the kernel starved while holding it (SCHED_IDLE on cores an engine keeps busy) would stall
        every thread of the daemon, the event loop and the copies with it."""
        try:  # Linux: this thread's own nice value (only ever raised: no privilege needed)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + BACKING_NICE)
        except (OSError, AttributeError):
            pass

    def _back_piece(self) -> bool:
        """Backs the piece at ready_bytes (and pins the chunk it completes). The backing thread and
        copies may back one piece at once: both succeed (backing is idempotent), and ready_bytes
        only grows, over memory that is all backed."""
        if self.error:
            return False
        start = self.ready_bytes
        n = min(PIECE, self.total_bytes - start)
        err = populate_write(self.base + start, n) if self._populate else 0
        if err in (errno.EINVAL, errno.ENOSYS):  # a kernel without MADV_POPULATE_WRITE: zero the pieces from now on
            self._populate, err = False, 0
        if not self._populate:
            err = allocate(self._file, start, n)
            if err:
                self.error = f"host tier: could not back {start / 2**30:.2f} GiB and on with memory ({os.strerror(err)})"
        elif err:
            self.error = f"host tier: /dev/shm could not back {start / 2**30:.2f} GiB and on with memory ({os.strerror(err)})"
        if self.error:
            log.error("%s; stores into the rest of the tier fail until the daemon restarts with room", self.error)
            return False
        end = start + n
        with self._lock:
            if end <= self.ready_bytes:
                return True  # another thread backed it meanwhile (and pinned its chunk)
            if self._cuda and (end % CHUNK == 0 or end == self.total_bytes):
                lo = (start // CHUNK) * CHUNK
                rc = torch().cuda.cudart().cudaHostRegister(self.base + lo, end - lo, 0)
                if int(rc) == 0:
                    self._pinned.append((self.base + lo, end - lo))
                elif not self._pinned:
                    log.warning("cudaHostRegister of the host tier failed (%s): copies to GPUs will be slower", rc)
            self.ready_bytes = end
        return True

    def close(self) -> None:
        if self.total_bytes == 0:
            return
        with self._wake:
            self._closing = True
            self._wake.notify()
        self._thread.join()
        with self._lock:
            for ptr, _ in self._pinned:
                torch().cuda.cudart().cudaHostUnregister(ptr)
            self._pinned.clear()
        if self._file >= 0:
            os.close(self._file)
            self._file = self.fd = -1


class Arenas:
    """The host tier's memory: the main arena, and one of its own for each private domain (made at
    first use; its slabs count against the same budget, kvdepotd.core.pool.PrivateSpace)."""

    def __init__(self, main: HostArena) -> None:
        self.main = main
        self._private: dict[str, HostArena] = {}
        self._lock = threading.Lock()

    def of(self, layout_class: str) -> HostArena:
        if not is_private(layout_class):
            return self.main
        with self._lock:
            arena = self._private.get(layout_class)
            if arena is None:
                arena = self._private[layout_class] = HostArena(self.main.total_bytes, private=True)
            return arena

    @property
    def ready_bytes(self) -> int:
        return self.main.ready_bytes + sum(a.ready_bytes for a in list(self._private.values()))

    def close(self) -> None:
        self.main.close()
        with self._lock:
            for a in self._private.values():
                a.close()
            self._private.clear()
