"""The disk tier's planner (G3): admission, demotion, staging reads, and the disk jobs that carry
them out; with the on-disk record format the storage writes (kvdepotd.storage.disk).

The disk tier is a second registry per layout class (Domain.disk). Host blocks reach it through a
queue of admitted blocks (seen `admit_after` times within the window, DiskConfig), written by WRITE jobs
at once (write-through) or once the host pool is past its watermark (write-back), so that host
eviction finds them on disk already. A load of a block only on disk first stages it into a fresh
host cell (a READ job); the load op is held until its reads end.

Primitives (called by the Depot on the event loop, one at a time):
    sighting(dom, hash)              a request carried the block: counts toward its admission
    consider(dom, hash, stored)      queues a host-resident block for the disk once admitted
    stage(dom, hash, parent, owner)  a host cell the block is read into for a load, or None
    is_staging(dom, hash)            a read is bringing the block into the layout class's host pool
    wait(hash, op, position)         the load's block arrives with the read staging `hash`
    job(kind, dom, items)            a disk job the storage should run
    take_jobs(domains, now_ms, flush)  jobs to run now: reads, and writes the policy lets go
    take_drops(domains)              disk cells whose entry is gone (the storage journals them)
    job_done(job_id, failed, corrupt, message) -> [(Op, rank)]   the storage's report; load parts
                                     that may run now
    restore(dom, blocks)             blocks a persistent disk tier still holds at start-up

A job is plain data: the layout class, the sizes the storage needs and, per block, its hash, host
cell with that cell's byte offset in the host tier, and disk cell. No registry or pool goes with it.
"""

from __future__ import annotations

import enum
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvdepot.hashing import BlockHash, scope_seed
from kvdepotd.core.ops import Op, OpId, OpTable
from kvdepotd.core.pool import CellId
from kvdepotd.core.registry import BlockRegistry, BlockStatus

# The record format on disk: one header per block, then its data padded to the alignment.
DISK_HEADER_BYTES = 4096
DISK_ALIGN = 4096  # O_DIRECT alignment of every offset and length on disk
DISK_MAX_RANKS = 256  # a block header holds one checksum per rank: wider engines get no disk tier
DISK_POLICIES = ("write-back", "write-through")
SEEN_CAP = 1 << 18  # hashes the admission window remembers per layout class


def disk_record_bytes(block_bytes: int) -> int:
    """Bytes one block takes on disk: its header, then its data padded to the alignment."""
    return DISK_HEADER_BYTES + -(-block_bytes // DISK_ALIGN) * DISK_ALIGN


PRIVATE_MARK = "@"  # in a layout class: the blocks of engines that copy them themselves, per namespace


def private_class(layout_class: str, namespace: str) -> str:
    """Where the blocks of engines of `namespace` that copy their blocks themselves live: a domain of
    its own, whose host memory (its own space, kvdepotd.core.pool.PrivateSpace) the engines' workers
    map, so no other namespace's block is ever within their reach."""
    return f"{layout_class}{PRIVATE_MARK}{scope_seed(0, namespace) & 0xFFFFFFFF:08x}"


def is_private(layout_class: str) -> bool:
    return PRIVATE_MARK in layout_class


def public_class(layout_class: str) -> str:
    """The layout class a block's bytes have (the same whoever copied them): what the remote
    store's keys name, so nodes share blocks whichever side copies."""
    return layout_class.split(PRIVATE_MARK, 1)[0]


@dataclass(slots=True)
class Domain:
    """One layout class: its host pool and registry (and disk ones), shared by engines of that class."""

    layout_class: str
    block_bytes: int
    world_size: int
    registry: BlockRegistry
    disk: BlockRegistry | None = None
    demote: OrderedDict[BlockHash, None] = field(default_factory=OrderedDict)  # admitted host blocks not on disk yet
    seen: OrderedDict[BlockHash, list[int]] = field(default_factory=OrderedDict)  # hash -> [sightings, window start ms]
    writes_in_flight: int = 0


class RemoteSink(Protocol):
    """Where admitted blocks go besides the disk (kvdepotd.core.remote.RemotePlanner)."""

    @property
    def enabled(self) -> bool: ...
    def wants(self, dom: Domain, h: BlockHash) -> bool: ...
    def offer(self, dom: Domain, h: BlockHash) -> None: ...


class DiskJobKind(enum.Enum):
    WRITE = "WRITE"  # host cell -> disk cell
    READ = "READ"  # disk cell -> host cell (staging for a load)


@dataclass(frozen=True, slots=True)
class DiskItem:
    hash: BlockHash
    parent: BlockHash | None
    host_cell: CellId
    host_offset: int  # where the host cell's bytes start in the host tier
    disk_cell: CellId
    owner: str = ""  # the namespace that stored it (kept in the block's header on disk)


@dataclass(frozen=True, slots=True)
class DiskJob:
    job_id: int
    kind: DiskJobKind
    layout_class: str
    block_bytes: int
    world_size: int
    disk_blocks_per_slab: int
    items: list[DiskItem]


@dataclass(frozen=True, slots=True)
class DiskConfig:
    policy: str = "write-back"
    admit_after: int = 2
    admit_window_ms: int = 600_000
    watermark: float = 0.8  # write-back: host pool fraction past which admitted blocks are written
    job_blocks: int = 32
    jobs_in_flight: int = 4  # write jobs per layout class


class DiskPlanner:
    def __init__(self, config: DiskConfig, ops: OpTable, counters: Counter[str], remote: RemoteSink | None = None) -> None:
        if config.policy not in DISK_POLICIES:
            raise ValueError(f"unknown disk policy {config.policy!r}; known: {', '.join(DISK_POLICIES)}")
        self.config = config
        self.ops = ops
        self.counters = counters
        self.jobs: dict[int, tuple[DiskJob, Domain]] = {}
        self.now_ms = 0
        self._ready: list[DiskJob] = []
        self._next_job = 1
        self._flush = False
        # (layout class, block) being read from disk -> (load, position) waiting. Keyed by the class too:
        # engines of one model with other layouts (another TP size) have the same hashes in other pools.
        self._staging: dict[tuple[str, BlockHash], list[tuple[Op, int]]] = {}
        self.remote = remote if remote is not None and remote.enabled else None  # admitted blocks go there too

    # -- admission --------------------------------------------------------------------------------
    def sighting(self, dom: Domain, h: BlockHash) -> None:
        """A request carries block `h` (stored, already cached, or loaded): counts toward admission."""
        n = self.config.admit_after
        if n <= 1 or (dom.disk is None and self.remote is None):
            return
        seen = dom.seen
        rec = seen.get(h)
        now = self.now_ms
        if rec is None or now - rec[1] > self.config.admit_window_ms:
            rec = seen[h] = [0, now]
        else:
            seen.move_to_end(h)
        rec[0] += 1
        if len(seen) > SEEN_CAP:
            seen.popitem(last=False)

    def consider(self, dom: Domain, h: BlockHash, stored: bool = False) -> None:
        """Queues a host-resident block for the disk, and offers it to the remote tier, once admitted
        (counted as a rejection when a store completes before the block is admitted)."""
        disk, remote = dom.disk, self.remote
        to_disk = disk is not None and h not in dom.demote and disk.state_of(h) is None
        to_remote = remote is not None and remote.wants(dom, h)
        if not (to_disk or to_remote):
            return
        e = dom.registry.state_of(h)
        if e is None or e.status is not BlockStatus.RESIDENT:
            return
        rec = dom.seen.get(h)
        n = self.config.admit_after
        if n <= 1 or (rec is not None and rec[0] >= n and self.now_ms - rec[1] <= self.config.admit_window_ms):
            if to_disk:
                dom.demote[h] = None
                self.counters["disk_admitted_blocks"] += 1
                if len(dom.demote) > 2 * dom.registry.pool.capacity_blocks + 1024:
                    self._prune_demote(dom)
            if to_remote:
                remote.offer(dom, h)  # type: ignore[union-attr]
        elif stored:
            self.counters["disk_rejected_blocks"] += 1

    def _prune_demote(self, dom: Domain) -> None:
        host = dom.registry
        before = len(dom.demote)
        dom.demote = OrderedDict((h, None) for h in dom.demote if (e := host.state_of(h)) is not None and e.status is BlockStatus.RESIDENT)
        self.counters["disk_write_missed_blocks"] += before - len(dom.demote)

    # -- staging reads for loads -----------------------------------------------------------------------
    def is_staging(self, dom: Domain, h: BlockHash) -> bool:
        return (dom.layout_class, h) in self._staging

    def stage(self, dom: Domain, h: BlockHash, parent: BlockHash | None, owner: str) -> DiskItem | None:
        """The read that brings `h` from disk into a fresh host cell for a load, or None when the
        disk does not hold it (or the host tier has no cell for it)."""
        disk, host = dom.disk, dom.registry
        d = disk.state_of(h) if disk is not None else None
        if d is None or d.status is not BlockStatus.RESIDENT or d.doomed:
            return None
        hcell = host.prepare_store(h, parent, owner)
        if hcell is None:
            return None
        disk.pin(h)  # type: ignore[union-attr]
        self._staging[dom.layout_class, h] = []
        return DiskItem(h, parent, hcell, host.pool.byte_offset(hcell), d.cell)

    def wait(self, dom: Domain, h: BlockHash, op: Op, pos: int) -> None:
        self._staging[dom.layout_class, h].append((op, pos))

    # -- jobs ---------------------------------------------------------------------------------------------
    def job(self, kind: DiskJobKind, dom: Domain, items: list[DiskItem]) -> None:
        assert dom.disk is not None
        job = DiskJob(self._next_job, kind, dom.layout_class, dom.block_bytes, dom.world_size, dom.disk.pool.blocks_per_slab, items)
        self._next_job += 1
        self.jobs[job.job_id] = (job, dom)
        self._ready.append(job)
        if kind is DiskJobKind.WRITE:
            dom.writes_in_flight += 1

    def take_jobs(self, domains: Sequence[Domain], now_ms: int, flush: bool = False) -> list[DiskJob]:
        self.now_ms = now_ms
        self._flush = flush
        for dom in domains:
            if dom.disk is not None and dom.demote:
                self._dispatch_writes(dom)
        ready, self._ready = self._ready, []
        return ready

    @staticmethod
    def take_drops(domains: Sequence[Domain]) -> list[tuple[str, BlockHash, CellId]]:
        out: list[tuple[str, BlockHash, CellId]] = []
        for dom in domains:
            if dom.disk is not None and dom.disk.drops:
                out += [(dom.layout_class, h, s) for h, s in dom.disk.drops]
                dom.disk.drops.clear()
        return out

    def job_done(self, job_id: int, failed: set[BlockHash], corrupt: set[BlockHash], message: str = "") -> list[tuple[Op, int]]:
        """`failed` blocks were not moved, `corrupt` ones (a subset or not) of a read had a bad
        header on disk (dropped from the disk tier). A write reads no bytes for their checksums, so
        it has no corrupt blocks: a bad host copy fails its first read."""
        job, dom = self.jobs.pop(job_id)
        host, disk = dom.registry, dom.disk
        assert disk is not None
        bad_blocks = failed | corrupt
        if job.kind is DiskJobKind.WRITE:
            dom.writes_in_flight -= 1
            for it in job.items:
                ok = it.hash not in bad_blocks
                host.unpin(it.hash)
                disk.complete_store(it.hash, ok)
                self.counters["disk_written_blocks" if ok else "disk_write_failed_blocks"] += 1
            return []
        waiting: dict[OpId, Op] = {}
        for it in job.items:
            ok = it.hash not in bad_blocks
            disk.unpin(it.hash)
            if it.hash in corrupt:
                disk.discard(it.hash)
                self.counters["disk_checksum_failures"] += 1
            host.complete_store(it.hash, ok)
            self.counters["disk_read_blocks" if ok else "disk_read_failed_blocks"] += 1
            land(self.ops, self._staging.pop((job.layout_class, it.hash)), ok, host, it.hash, message or "disk read failed", waiting)
        ready: list[tuple[Op, int]] = []
        for op in waiting.values():
            if not op.staging:
                ready += self.ops.release(op)
        return ready

    def _dispatch_writes(self, dom: Domain) -> None:
        host, disk = dom.registry, dom.disk
        assert disk is not None
        cfg = self.config
        if cfg.policy == "write-back" and not self._flush and host.pool.num_used < cfg.watermark * host.pool.capacity_blocks:
            return
        while dom.demote and dom.writes_in_flight < cfg.jobs_in_flight:
            items: list[DiskItem] = []
            while dom.demote and len(items) < cfg.job_blocks:
                h, _ = dom.demote.popitem(last=False)
                e = host.state_of(h)
                if e is None or e.status is not BlockStatus.RESIDENT or e.doomed:
                    self.counters["disk_write_missed_blocks"] += 1  # evicted from the host tier before its turn
                    continue
                if disk.state_of(h) is not None:
                    continue
                dcell = disk.prepare_store(h, e.parent, e.owner)
                if dcell is None and disk.at_share(e.owner):  # its namespace holds its disk share, none of it evictable now
                    self.counters["disk_blocks_over_share"] += 1
                    continue  # this block stays in host memory only; the others' writes go on
                if dcell is None:  # the disk is full of pinned or in-flight blocks: try again later
                    self.counters["disk_full"] += 1
                    dom.demote[h] = None
                    dom.demote.move_to_end(h, last=False)
                    break
                host.pin(h)
                items.append(DiskItem(h, e.parent, e.cell, host.pool.byte_offset(e.cell), dcell, e.owner))
            if not items:
                return
            self.job(DiskJobKind.WRITE, dom, items)
            if len(items) < cfg.job_blocks and dom.demote:
                return  # stopped by a full disk

    @staticmethod
    def restore(dom: Domain, blocks: Sequence[tuple[int, int | None, int, str]]) -> bool:
        """Blocks (hash, parent, disk cell, owner) a persistent disk tier still holds at start-up (all or none)."""
        assert dom.disk is not None, "restore without a disk tier"
        return dom.disk.restore([(BlockHash(h), None if p is None else BlockHash(p), CellId(s), o) for h, p, s, o in blocks])


def land(ops: OpTable, waiters: list[tuple[Op, int]], ok: bool, host: BlockRegistry, h: BlockHash, message: str, waiting: dict[OpId, Op]) -> None:
    """A staged block arrived in the host tier (`ok`) or did not: the loads waiting for it take a
    pin on it or fail that block; those still live are collected in `waiting` (to be released once
    nothing of theirs is staging)."""
    for op, pos in waiters:
        op.staging.discard(op.block_indices[pos])
        if op.op_id not in ops.ops:
            continue  # the load ended meanwhile: the block stays in the host tier, unpinned
        waiting[op.op_id] = op
        if ok:
            host.pin(h)  # the load's pin, released when it ends
        else:
            op.failed.add(op.block_indices[pos])
            op.tier_cells[pos] = None
            op.message = op.message or message
