"""The disk copy engine: host arena <-> disk slab files, on its own thread pool.

    submit(jobs)    DiskJobs from the Depot (WRITE: host cell -> disk cell; READ: disk cell -> the
                    host cell a load waits on); returns at once
    on_done         (job id, failed hashes, corrupt hashes, message), called on the event loop
    forget(drops)   the removal of dropped disk blocks: queued on the event loop (no I/O there),
                    journaled and synced by a disk thread
    close()         waits for running jobs, then syncs and closes the files

Reads are issued in order by one reader thread (one sequential stream, as the disk likes it) and
checked on the pool's threads, so checking a chunk overlaps reading the next. Neither side reads a
block's bytes for its checksum, which would be one more pass over memory per byte moved:
  write   the header gets the checksums the host tier took when the block left the engine. A host
          copy that went bad since is written with the checksum it should have, so its first read
          fails the check (it is dropped, never served).
  read    the header is checked here (it must say what the journal says); its data checksums go to
          the host tier, and the load that staged the block checks the data as it copies it into
          the engine (kvdepotd.transfer.host). A mismatch there drops the block from both tiers.
`kvdepotd check-disk` and recovery use ClassStore.read(), which checks the data too.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from kvdepotd.core.disk import DiskJob, DiskJobKind
from kvdepotd.storage.checksum import xxh3_at
from kvdepotd.storage.disk import ClassStore
from kvdepotd.storage.disk_dir import DiskStore
from kvdepotd.storage.host_arena import Arenas

log = logging.getLogger("kvdepotd")
DoneFn = Callable[[int, set[int], set[int], str], None]
Result = tuple[set[int], set[int], str]


class DiskCopyEngine:
    def __init__(self, on_done: DoneFn, arenas: Arenas, store: DiskStore, threads: int = 2, observe: Callable[[str, int, float], None] | None = None) -> None:
        self.on_done = on_done
        self.arenas = arenas
        self.store = store
        self.observe = observe or (lambda kind, nbytes, seconds: None)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvdepot-disk")
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kvdepot-disk-read")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._class_lock = threading.Lock()
        self._closed = False

    def submit(self, jobs: list[DiskJob]) -> None:
        if not jobs:
            return
        if self._closed:  # a late RPC during shutdown: its jobs fail, nothing touches the files
            for job in jobs:
                self.on_done(job.job_id, {it.hash for it in job.items}, set(), "the daemon is shutting down")
            return
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        loop = self._loop
        for job in jobs:

            def finished(fut: Future[Result], job: DiskJob = job) -> None:
                loop.call_soon_threadsafe(self._done, job, fut)

            if job.kind is DiskJobKind.WRITE:
                self._pool.submit(self._write, job).add_done_callback(finished)
            else:
                self._reader.submit(self._read, job, finished)

    def forget(self, drops: Sequence[tuple[str, int, int]]) -> None:
        """Queues the removals (no I/O on the event loop) and has a disk thread journal them."""
        queued: set[str] = set()
        for layout_class, h, cell in drops:
            store = self.store.classes.get(layout_class)
            if store is not None and store.forget(cell, h):
                queued.add(layout_class)
        for layout_class in queued:
            if not self._closed:  # else close() flushes them
                self._pool.submit(self.store.classes[layout_class].flush_removes)

    def _done(self, job: DiskJob, fut: Future[Result]) -> None:
        try:
            failed, corrupt, message = fut.result()
        except Exception as e:  # a bug or an I/O error we did not expect: the job's blocks fail
            log.exception("disk %s job %d failed", job.kind.value.lower(), job.job_id)
            failed, corrupt, message = {it.hash for it in job.items}, set(), f"disk I/O failed: {e}"
        self.on_done(job.job_id, failed, corrupt, message)

    def _class(self, job: DiskJob) -> ClassStore:
        store = self.store.classes.get(job.layout_class)
        if store is None:
            with self._class_lock:
                store = self.store.classes.get(job.layout_class)
                if store is None:
                    store = self.store.new_class(job.layout_class, job.block_bytes, job.world_size, job.disk_blocks_per_slab)
        return store

    # -- the jobs (disk threads) ------------------------------------------------------------------
    def _observe(self, job: DiskJob, store: ClassStore, out: Result, t0: float) -> Result:
        moved = len(job.items) - len(out[0] | out[1])
        self.observe(job.kind.value.lower(), moved * store.block_bytes, time.perf_counter() - t0)
        return out

    def _write(self, job: DiskJob) -> Result:
        t0 = time.perf_counter()
        store = self._class(job)
        arena = self.arenas.of(job.layout_class)
        rb, cls = store.rank_bytes, job.layout_class
        blocks = []
        for it in job.items:
            addr = arena.base + it.host_offset
            sums = [arena.checksums.get((cls, it.host_cell, r)) for r in range(store.world_size)]
            # Every host block has its checksums (its store or its disk read took them); one without
            # would be hashed here rather than written unchecked.
            blocks.append((it.disk_cell, it.hash, it.parent, addr, [s if s is not None else int(xxh3_at(addr + r * rb, rb)) for r, s in enumerate(sums)], it.owner))
        failed = store.write(blocks) if blocks else set()
        store.maybe_compact()
        return self._observe(job, store, (failed, set(), "disk write failed" if failed else ""), t0)

    def _read(self, job: DiskJob, finished: Callable[[Future[Result]], None]) -> None:
        """The reader thread: the I/O, then the check on the pool (the reader goes on to the next job)."""
        t0 = time.perf_counter()
        try:
            store = self._class(job)
            arena = self.arenas.of(job.layout_class)
            if not arena.ensure(max(it.host_offset for it in job.items) + store.block_bytes):
                raise OSError(arena.error)
            failed, got = store.read_raw([(it.disk_cell, it.hash, arena.base + it.host_offset) for it in job.items])
        except Exception as e:  # reported through the same path as a failing check
            fut: Future[Result] = Future()
            fut.set_exception(e)
            finished(fut)
            return
        self._pool.submit(self._check, job, store, failed, got, t0).add_done_callback(finished)

    def _check(self, job: DiskJob, store: ClassStore, failed: set[int], got: list[tuple[int, int, int, bytes]], t0: float) -> Result:
        arena, cls = self.arenas.of(job.layout_class), job.layout_class
        corrupt, sums = store.check(got, data=False)
        if corrupt:
            store.flush_removes()
        for it in job.items:
            ranks = sums.get(it.hash)
            if ranks is not None:
                for r, s in enumerate(ranks):
                    arena.checksums[(cls, it.host_cell, r)] = s
        message = "checksum mismatch in the disk tier" if corrupt else ("disk read failed" if failed else "")
        return self._observe(job, store, (failed, corrupt, message), t0)

    async def close(self) -> None:
        self._closed = True
        await asyncio.to_thread(self._reader.shutdown, wait=True)  # first: it hands checks to the pool
        await asyncio.to_thread(self._pool.shutdown, wait=True)
        self.store.close()
