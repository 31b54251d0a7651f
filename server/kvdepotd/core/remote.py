"""The remote tier's planner (G4): a store shared by many daemons (a Valkey cluster), which owns
its own eviction. The core cannot see what the store holds, so it keeps no registry for it: it
queues admitted host blocks for writing, remembers (boundedly) which blocks the store is known to
hold so that they are not written again, and stages the blocks a load takes from the store into
fresh host cells (READ jobs), as the disk planner does. What the store holds is asked at lookup
time by the runtime (Depot.lookup answers `remote_query`, the hashes to ask about, and
Depot.extend_lookup takes the answer).

Primitives (called by the Depot and the planners on the event loop, one at a time):
    wants(dom, hash)                 the block may go to the store (not known there, or known longer
                                     than `recheck_ms`: the write job asks the store again)
    offer(dom, hash)                 queues an admitted host block for writing, or drops it
                                     (counted by reason: the store is down, the queue is full)
    stage(dom, hash, parent, owner)  a host cell the block is read into for a load, or None
    prefetch(dom, blocks, owner)     reads blocks a Lookup found in the store into the host tier
                                     before the Step asks for them (its load then waits on the read)
    is_staging(dom, hash) / wait(dom, hash, op, position)   as for the disk tier
    take_jobs() -> [RemoteJob]       reads, and writes up to `jobs_in_flight` at once
    job_done(job_id, failed, corrupt, present, message) -> [(Op, rank)]   the store's report
    set_up(up)                       the store answers, or not (the runtime's health check)
    absent(layout_class, hashes)     the store does not hold these blocks (any more)
A job is plain data (RemoteJob), like a DiskJob: per block its hash, parent, host cell with its
byte offset, and the namespace that owns it (the key's scope and the value's header).
"""

from __future__ import annotations

import enum
from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from kvdepot.hashing import BlockHash
from kvdepotd.core.disk import DISK_MAX_RANKS, Domain, land
from kvdepotd.core.ops import Op, OpId, OpTable
from kvdepotd.core.pool import CellId
from kvdepotd.core.registry import BlockStatus

REMOTE_MAX_RANKS = DISK_MAX_RANKS  # one value holds every rank's data and checksum


@dataclass(frozen=True, slots=True)
class RemoteConfig:
    enabled: bool = False
    queue_blocks: int = 8192  # admitted blocks waiting to be written, all layout classes
    job_blocks: int = 32  # blocks per job (one pipelined batch)
    jobs_in_flight: int = 4  # write jobs at once, all layout classes
    lookup_blocks: int = 4096  # the most blocks one lookup asks the store about
    known_blocks: int = 1 << 20  # hashes remembered as held by the store
    prefetch: bool = False  # a Lookup's store hits are read into the host tier at once (remote_prefetch)
    # A block the store was known to hold this long ago is asked about again when it is next used
    # (one pipelined EXISTS in its write job; written when gone): the store may have evicted it,
    # been flushed, or lost a primary since, and nothing tells a daemon so.
    recheck_ms: int = 10_000


class RemoteJobKind(enum.Enum):
    WRITE = "WRITE"  # host cell -> store
    READ = "READ"  # store -> host cell (staging for a load)


@dataclass(frozen=True, slots=True)
class RemoteItem:
    hash: BlockHash
    parent: BlockHash | None
    host_cell: CellId
    host_offset: int
    owner: str  # the namespace: part of the key and of the value's header


@dataclass(frozen=True, slots=True)
class RemoteJob:
    job_id: int
    kind: RemoteJobKind
    layout_class: str
    block_bytes: int
    world_size: int
    items: list[RemoteItem]


Key = tuple[str, BlockHash]  # (layout class, hash)


class RemotePlanner:
    def __init__(self, config: RemoteConfig, ops: OpTable, counters: Counter[str]) -> None:
        self.config = config
        self.ops = ops
        self.counters = counters
        self.up = False  # until the runtime's first health check says otherwise
        self.queue: OrderedDict[Key, Domain] = OrderedDict()
        self.known: OrderedDict[Key, int] = OrderedDict()  # -> when the store was last seen to hold it
        self.now_ms = 0  # the Depot's clock (set with each call that carries one)
        self.jobs: dict[int, tuple[RemoteJob, Domain]] = {}
        self.writes_in_flight = 0
        self.writing: set[Key] = set()  # blocks of write jobs out
        self._ready: list[RemoteJob] = []
        self._next_job = 1
        self._staging: dict[Key, list[tuple[Op, int]]] = {}  # (layout class, block) being read -> loads waiting

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    def set_up(self, up: bool) -> None:
        self.up = up
        if not up and self.queue:  # nothing queued would be written: drop it now, counted
            self.counters["remote_dropped_store_down_blocks"] += len(self.queue)
            self.queue.clear()

    # -- writes ---------------------------------------------------------------------------------------
    def wants(self, dom: Domain, h: BlockHash) -> bool:
        if not self.config.enabled or dom.world_size > REMOTE_MAX_RANKS:
            return False
        k = (dom.layout_class, h)
        if k in self.queue or k in self.writing:
            return False
        seen = self.known.get(k)
        return seen is None or self.now_ms - seen > self.config.recheck_ms

    def offer(self, dom: Domain, h: BlockHash) -> None:
        """An admitted host-resident block: queued for the store, or dropped (counted) when the store
        is down or the queue full. Writing never waits: a dropped block stays in the lower tiers."""
        if not self.up:
            self.counters["remote_dropped_store_down_blocks"] += 1
        elif len(self.queue) >= self.config.queue_blocks:
            self.counters["remote_dropped_queue_full_blocks"] += 1
        else:
            self.queue[dom.layout_class, h] = dom
            self.counters["remote_queued_blocks"] += 1

    def _remember(self, k: Key) -> None:
        self.known[k] = self.now_ms
        self.known.move_to_end(k)
        if len(self.known) > self.config.known_blocks:
            self.known.popitem(last=False)

    def absent(self, layout_class: str, hashes: Iterable[BlockHash]) -> None:
        """The store does not hold these blocks (any more): they may be written again."""
        for h in hashes:
            self.known.pop((layout_class, h), None)

    def _dispatch_writes(self) -> None:
        cfg = self.config
        while self.queue and self.writes_in_flight < cfg.jobs_in_flight:
            items: list[RemoteItem] = []
            job_dom: Domain | None = None
            while self.queue and len(items) < cfg.job_blocks:
                (cls, h), dom = next(iter(self.queue.items()))
                if job_dom is not None and dom is not job_dom:
                    break  # one layout class per job
                del self.queue[cls, h]
                host = dom.registry
                e = host.state_of(h)
                if e is None or e.status is not BlockStatus.RESIDENT or e.doomed:
                    self.counters["remote_dropped_evicted_blocks"] += 1  # left the host tier before its turn
                    continue
                job_dom = dom
                host.pin(h)
                self.writing.add((cls, h))
                items.append(RemoteItem(h, e.parent, e.cell, host.pool.byte_offset(e.cell), e.owner))
            if job_dom is None:
                continue
            self._job(RemoteJobKind.WRITE, job_dom, items)
            self.writes_in_flight += 1

    # -- staging reads for loads --------------------------------------------------------------------
    def is_staging(self, dom: Domain, h: BlockHash) -> bool:
        return (dom.layout_class, h) in self._staging

    def stage(self, dom: Domain, h: BlockHash, parent: BlockHash | None, owner: str) -> RemoteItem | None:
        """The read that brings `h` from the store into a fresh host cell for a load, or None (no
        remote tier, the store is down, or no host cell)."""
        if not self.config.enabled or not self.up or dom.world_size > REMOTE_MAX_RANKS:
            return None
        host = dom.registry
        hcell = host.prepare_store(h, parent, owner)
        if hcell is None:
            return None
        self._staging[dom.layout_class, h] = []
        return RemoteItem(h, parent, hcell, host.pool.byte_offset(hcell), owner)

    def wait(self, dom: Domain, h: BlockHash, op: Op, pos: int) -> None:
        self._staging[dom.layout_class, h].append((op, pos))

    def prefetch(self, dom: Domain, blocks: list[tuple[BlockHash, BlockHash | None]], owner: str) -> int:
        """Reads `blocks` (hash, parent), which a Lookup just found in the store, into fresh host
        cells now, in jobs of half a job's size (as a load cuts its reads), so that the Step's load
        finds them there or on their way (it waits on the same read). A block some tier already
        has or stages is left alone; no host cell stops it. Returns how many reads it started."""
        if not self.config.prefetch:
            return 0
        host, items = dom.registry, []
        for h, parent in blocks:
            if host.state_of(h) is not None or (dom.disk is not None and dom.disk.state_of(h) is not None):
                continue
            it = self.stage(dom, h, parent, owner)
            if it is None:
                break
            items.append(it)
        n = max(1, self.config.job_blocks // 2)
        for k in range(0, len(items), n):
            self.read(dom, items[k : k + n])
        self.counters["remote_prefetched_blocks"] += len(items)
        return len(items)

    def read(self, dom: Domain, items: list[RemoteItem]) -> None:
        self._job(RemoteJobKind.READ, dom, items)

    # -- jobs -----------------------------------------------------------------------------------------
    def _job(self, kind: RemoteJobKind, dom: Domain, items: list[RemoteItem]) -> None:
        job = RemoteJob(self._next_job, kind, dom.layout_class, dom.block_bytes, dom.world_size, items)
        self._next_job += 1
        self.jobs[job.job_id] = (job, dom)
        self._ready.append(job)

    def take_jobs(self) -> list[RemoteJob]:
        if self.queue:
            self._dispatch_writes()
        ready, self._ready = self._ready, []
        return ready

    def job_done(
        self, job_id: int, failed: set[BlockHash], corrupt: set[BlockHash], present: set[BlockHash], message: str = "", forged: set[BlockHash] | None = None
    ) -> list[tuple[Op, int]]:
        """The store's report of one job. WRITE: `present` blocks were there already (not written
        again), `failed` ones were not written. READ: `failed` blocks did not arrive (missing,
        evicted, late, the store down), `corrupt` ones arrived wrong (bad header or data, or, the
        `forged` among them, a MAC that does not check out; the storage deleted them from the store)."""
        job, dom = self.jobs.pop(job_id)
        host, cls, c = dom.registry, dom.layout_class, self.counters
        forged = forged or set()
        if job.kind is RemoteJobKind.WRITE:
            self.writes_in_flight -= 1
            for it in job.items:
                host.unpin(it.hash)
                self.writing.discard((cls, it.hash))
                if it.hash in failed:
                    c["remote_write_failed_blocks"] += 1
                    continue
                if it.hash not in present and (cls, it.hash) in self.known:
                    c["remote_relearned_blocks"] += 1  # known there, but the store had lost it
                self._remember((cls, it.hash))
                c["remote_write_skipped_blocks" if it.hash in present else "remote_written_blocks"] += 1
            return []
        waiting: dict[OpId, Op] = {}
        for it in job.items:
            ok = it.hash not in failed and it.hash not in corrupt
            if ok:
                self._remember((cls, it.hash))
                c["remote_read_blocks"] += 1
            else:
                self.absent(cls, [it.hash])
                c["remote_forged_blocks" if it.hash in forged else "remote_checksum_failures" if it.hash in corrupt else "remote_read_failed_blocks"] += 1
            host.complete_store(it.hash, ok)
            land(self.ops, self._staging.pop((cls, it.hash)), ok, host, it.hash, message or "remote read failed", waiting)
        ready: list[tuple[Op, int]] = []
        for op in waiting.values():
            if not op.staging:
                ready += self.ops.release(op)
        return ready
