"""The host tier's memory: one shared-memory region, carved into slabs by the core's pools.

The region is a file under /dev/shm, mapped and then unlinked (the mapping keeps it alive; a
crashed daemon leaves no file behind). It is touched page by page at start-up, with progress in
the log, so the copy path never pays for page faults, and pinned with cudaHostRegister when CUDA
is present. Per-block checksums (xxh3-64 per block and rank, taken at store, checked at load) live
beside it.
"""

from __future__ import annotations

import logging
import os
import time

import torch

log = logging.getLogger("kvdepotd")
PROGRESS_BYTES = 1 << 30


class ArenaError(RuntimeError):
    """The arena cannot be set up as configured; the message says why."""


class HostArena:
    def __init__(self, total_bytes: int, directory: str = "/dev/shm") -> None:
        self.total_bytes = total_bytes
        self.checksums: dict[tuple[str, int, int], int] = {}  # (layout class, cell, rank) -> xxh3
        self.pinned = False
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
        self._prefault()
        self._pin()

    def _prefault(self) -> None:
        t0 = time.monotonic()
        for start in range(0, self.total_bytes, PROGRESS_BYTES):
            end = min(start + PROGRESS_BYTES, self.total_bytes)
            try:
                self.tensor[start:end].zero_()
            except RuntimeError as e:  # SIGBUS turns into this when /dev/shm runs out underneath us
                raise ArenaError(f"could not back the host tier with memory at {start / 2**30:.1f} GiB: {e}") from None
            if self.total_bytes > PROGRESS_BYTES:
                log.info("host tier: prepared %.1f of %.1f GiB", end / 2**30, self.total_bytes / 2**30)
        log.debug("host tier ready in %.2f s", time.monotonic() - t0)

    def _pin(self) -> None:
        if not torch.cuda.is_available():
            return
        err = torch.cuda.cudart().cudaHostRegister(self.base, self.total_bytes, 0)
        self.pinned = int(err) == 0
        if not self.pinned:
            log.warning("cudaHostRegister of the host tier failed (%s): copies to GPUs will be slower", err)

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.base)
            self.pinned = False
