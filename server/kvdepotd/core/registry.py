"""The block registry of one layout class in one tier: hash -> entry, plus prefix-aware eviction.

Primitives (all synchronous; the caller is the Depot, on one thread):
    lookup(hashes) -> int              leading hashes that are RESIDENT (a prefix match stops at the first miss)
    match_and_pin(hashes) -> int       lookup() that also pins and touches the matched prefix
    state_of(hash) -> BlockEntry|None  resident or being stored ("in flight")
    prepare_store(hash, parent, owner) -> CellId | None
                                       allocates a cell (evicting if it must) and records the block
                                       as STORING; None when the tier is full of pinned/in-flight
                                       blocks, or the owner is at its share and none of its own
                                       blocks can go
    at_share(owner) -> bool            the owner holds its share of the pool
    owned                              owner (a namespace) -> its entries; with an owner share below
                                       1, an owner at its share evicts its own LRU leaf to store more
    complete_store(hash, success)      STORING -> RESIDENT, or drops the block and frees its cell
    pin(hash) / unpin(hash)            a pin is a count; pinned blocks are never evicted
    discard(hash)                      drops a corrupt block (at once, or when its last pin goes)
    touch(hashes)                      marks use, for LRU
    clear() -> (dropped, kept)         drops every block that is neither pinned nor in flight
    evict_one() -> bool                the policy's next evictable block goes; False when none is
    restore(blocks) -> int             RESIDENT entries at given cells (a persistent tier after restart)
    drops                              (hash, cell) of every dropped entry, when track_drops (the disk
                                       tier journals them); the owner drains it

Invariants (checked by check_invariants(), exercised by hypothesis):
    * every entry holds exactly one cell of the pool; used cells == entries
    * children[h] == number of entries whose parent is h
    * an evicted block is a leaf (no child entries), not pinned, not STORING
    * owned[o] == entries of owner o, never above the owner limit
"""

from __future__ import annotations

import enum
import heapq
from abc import ABC, abstractmethod
from dataclasses import dataclass

from kvdepot.hashing import BlockHash
from kvdepotd.core.pool import BlockPool, CellId


class BlockStatus(enum.Enum):
    STORING = "STORING"  # a store op is copying it in; not loadable, never evicted
    RESIDENT = "RESIDENT"


@dataclass(slots=True)
class BlockEntry:
    hash: BlockHash
    parent: BlockHash | None
    cell: CellId
    status: BlockStatus = BlockStatus.STORING
    pins: int = 0
    children: int = 0  # entries (in this registry) whose parent is this block
    last_use: int = 0  # logical clock; LRU order
    hits: int = 0
    owner: str = ""  # the namespace whose engine stored it (blocks are never shared across namespaces)
    doomed: bool = False  # failed its checksum: never matched again, dropped when the last pin goes

    @property
    def evictable(self) -> bool:
        return self.status is BlockStatus.RESIDENT and self.pins == 0 and self.children == 0


class EvictionPolicy(ABC):
    """Chooses which evictable block goes first.

    Contract: `offer(entry)` is called whenever an entry may have become evictable or its last use
    changed; `pop(entries)` returns the hash of one entry that is evictable *now* (it must check,
    since offers go stale) or None when there is none, and forgets it. Policies never mutate entries.
    """

    @abstractmethod
    def offer(self, entry: BlockEntry) -> None: ...

    @abstractmethod
    def pop(self, entries: dict[BlockHash, BlockEntry]) -> BlockHash | None: ...


class LeafLruPolicy(EvictionPolicy):
    """Leaves first (a parent evicted before its children would strand them), LRU among leaves.

    A heap of (last_use, hash) offers with lazy deletion: an offer is valid only if the entry still
    exists, is evictable and has the same last_use. O(log n) per offer and eviction.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, BlockHash]] = []

    def offer(self, entry: BlockEntry) -> None:
        if entry.evictable:
            heapq.heappush(self._heap, (entry.last_use, entry.hash))

    def pop(self, entries: dict[BlockHash, BlockEntry]) -> BlockHash | None:
        heap = self._heap
        while heap:
            last_use, h = heapq.heappop(heap)
            e = entries.get(h)
            if e is not None and e.evictable and e.last_use == last_use:
                return h
        return None

    def compact(self, entries: dict[BlockHash, BlockEntry]) -> None:
        self._heap = [(e.last_use, e.hash) for e in entries.values() if e.evictable]
        heapq.heapify(self._heap)

    def prune(self, entries: dict[BlockHash, BlockEntry]) -> None:
        """Drops the stale offers (compact() without a pass over every entry)."""
        self._heap = list({(u, h) for u, h in self._heap if (e := entries.get(h)) is not None and e.evictable and e.last_use == u})
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)


EVICTION_POLICIES: dict[str, type[LeafLruPolicy]] = {"leaf-lru": LeafLruPolicy}


def make_eviction_policy(name: str) -> LeafLruPolicy:
    try:
        return EVICTION_POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; known: {sorted(EVICTION_POLICIES)}") from None


class BlockRegistry:
    def __init__(self, pool: BlockPool, policy: LeafLruPolicy | None = None, track_drops: bool = False, owner_share: float = 1.0) -> None:
        """`owner_share` < 1: no owner holds more than that fraction of what the pool could hold with
        the whole tier (a tenant cannot flush the others out of it)."""
        self.pool = pool
        self.drops: list[tuple[BlockHash, CellId]] | None = [] if track_drops else None
        self.entries: dict[BlockHash, BlockEntry] = {}
        self._policy = policy or LeafLruPolicy()
        self._clock = 0
        self._child_count: dict[BlockHash, int] = {}  # parent hash -> entries naming it, present or not
        self.num_pinned = 0  # entries with pins > 0
        self.num_storing = 0
        self.evictions = 0
        self.evicted_unhit = 0  # evicted before any lookup, load or store found them: room that served nothing
        self.owned: dict[str, int] = {}
        self.owner_limit = max(1, int(owner_share * pool.max_blocks)) if owner_share < 1 else None
        self._owner_policies: dict[str, LeafLruPolicy] = {}  # per owner, when there is a limit

    # -- queries ---------------------------------------------------------------------------
    def state_of(self, h: BlockHash) -> BlockEntry | None:
        return self.entries.get(h)

    def lookup(self, hashes: list[BlockHash]) -> int:
        n = 0
        entries = self.entries
        for h in hashes:
            e = entries.get(h)
            if e is None or e.status is not BlockStatus.RESIDENT or e.doomed:
                break
            n += 1
        return n

    # -- two-phase store ---------------------------------------------------------------------
    def prepare_store(self, h: BlockHash, parent: BlockHash | None, owner: str = "") -> CellId | None:
        assert h not in self.entries, "prepare_store of a block already resident or in flight"
        if self.at_share(owner) and not self._evict_own(owner):
            return None
        cell = self.pool.allocate()
        while cell is None:
            if not self.evict_one():
                return None
            cell = self.pool.allocate()
        e = BlockEntry(hash=h, parent=parent, cell=cell, last_use=self._tick(), children=self._child_count.get(h, 0), owner=owner)
        self.entries[h] = e
        self.owned[owner] = self.owned.get(owner, 0) + 1
        self.num_storing += 1
        if parent is not None:
            self._child_count[parent] = self._child_count.get(parent, 0) + 1
            if (p := self.entries.get(parent)) is not None:
                p.children += 1
        return cell

    def complete_store(self, h: BlockHash, success: bool) -> None:
        e = self.entries[h]
        assert e.status is BlockStatus.STORING, f"complete_store of a {e.status.value} block"
        self.num_storing -= 1
        if success:
            e.status = BlockStatus.RESIDENT
            self._offer(e)
        else:
            self._drop(e)

    # -- pins and use ----------------------------------------------------------------------
    def pin(self, h: BlockHash) -> None:
        e = self.entries[h]
        if e.pins == 0:
            self.num_pinned += 1
        e.pins += 1

    def unpin(self, h: BlockHash) -> None:
        e = self.entries.get(h)
        assert e is not None and e.pins > 0, "unpin of a block that is not pinned"
        e.pins -= 1
        if e.pins == 0:
            self.num_pinned -= 1
            if e.doomed:
                self._drop(e)
                return
            e.last_use = self._tick()  # a pin is a use: LRU counts from its release
            self._offer(e)

    def discard(self, h: BlockHash) -> None:
        """Drops a block whose bytes are bad (KV can be recomputed; never repaired): now if nobody
        holds it, else as soon as the last pin goes. It is never matched again either way."""
        e = self.entries.get(h)
        if e is None or e.status is not BlockStatus.RESIDENT:
            return
        e.doomed = True
        if e.pins == 0:
            self._drop(e)

    def match_and_pin(self, hashes: list[BlockHash]) -> int:
        """lookup() that pins the matched prefix in the same pass (a long prompt's lookup is on the
        engine's critical path). The use is recorded when the pin is released (unpin)."""
        get = self.entries.get
        resident = BlockStatus.RESIDENT
        n = newly_pinned = 0
        for h in hashes:
            e = get(h)
            if e is None or e.status is not resident or e.doomed:
                break
            if not e.pins:
                newly_pinned += 1
            e.pins += 1
            e.hits += 1
            n += 1
        self.num_pinned += newly_pinned
        return n

    def touch(self, hashes: list[BlockHash]) -> None:
        for h in hashes:
            e = self.entries.get(h)
            if e is not None:
                e.last_use = self._tick()
                e.hits += 1
                if e.pins == 0:
                    self._offer(e)
        if len(self._policy) > 4 * len(self.entries) + 1024:
            self._policy.compact(self.entries)

    def clear(self) -> tuple[int, int]:
        """Drops every block that is neither pinned nor in flight (children first, so parents become leaves)."""
        dropped = 0
        while self.evict_one():
            dropped += 1
        return dropped, len(self.entries)

    def restore(self, blocks: list[tuple[BlockHash, BlockHash | None, CellId, str]]) -> bool:
        """Adds RESIDENT, unpinned entries at the given cells (all or none: False when the pool
        cannot take the cells or a hash repeats). Used once, on an empty registry, at start-up."""
        assert not self.entries, "restore into a registry that is in use"
        if len({b[0] for b in blocks}) != len(blocks) or not self.pool.take([b[2] for b in blocks]):
            return False
        for h, parent, cell, owner in blocks:
            self.entries[h] = BlockEntry(hash=h, parent=parent, cell=cell, status=BlockStatus.RESIDENT, last_use=self._tick(), owner=owner)
            self.owned[owner] = self.owned.get(owner, 0) + 1
            if parent is not None:
                self._child_count[parent] = self._child_count.get(parent, 0) + 1
        for e in self.entries.values():
            e.children = self._child_count.get(e.hash, 0)
            self._offer(e)
        return True

    def evict_one(self) -> bool:
        return self._evict_from(self._policy)

    def at_share(self, owner: str) -> bool:
        """The owner holds as many blocks as its share allows (never, without a share)."""
        return self.owner_limit is not None and self.owned.get(owner, 0) >= self.owner_limit

    def _evict_own(self, owner: str) -> bool:
        """The owner's own next evictable block goes (it is at its share); False when none can."""
        policy = self._owner_policies.get(owner)
        return policy is not None and self._evict_from(policy)

    # -- internals ---------------------------------------------------------------------------
    def _evict_from(self, policy: LeafLruPolicy) -> bool:
        """The policy's next evictable block goes; False when it has none."""
        h = policy.pop(self.entries)
        if h is None:
            return False
        e = self.entries[h]
        if e.hits == 0:
            self.evicted_unhit += 1
        self._drop(e)
        self.evictions += 1
        return True

    def _offer(self, e: BlockEntry) -> None:
        self._policy.offer(e)
        if self.owner_limit is not None:
            policy = self._owner_policies.get(e.owner)
            if policy is None:
                policy = self._owner_policies[e.owner] = LeafLruPolicy()
            policy.offer(e)
            if len(policy) > 4 * self.owned.get(e.owner, 0) + 1024:  # stale offers pile up as the global heap's do
                policy.prune(self.entries)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _drop(self, e: BlockEntry) -> None:
        assert e.pins == 0 or e.status is BlockStatus.STORING
        del self.entries[e.hash]
        left = self.owned[e.owner] - 1
        if left:
            self.owned[e.owner] = left
        else:
            del self.owned[e.owner]
            self._owner_policies.pop(e.owner, None)
        if self.drops is not None:
            self.drops.append((e.hash, e.cell))
        if e.pins:
            self.num_pinned -= 1
        self.pool.free(e.cell)
        if e.parent is not None:
            left = self._child_count[e.parent] - 1
            if left:
                self._child_count[e.parent] = left
            else:
                del self._child_count[e.parent]
            if (p := self.entries.get(e.parent)) is not None:
                p.children -= 1
                self._offer(p)

    def check_invariants(self) -> None:
        assert self.pool.num_used == len(self.entries), (self.pool.num_used, len(self.entries))
        cells = {e.cell for e in self.entries.values()}
        assert len(cells) == len(self.entries), "two entries share a cell"
        children: dict[BlockHash, int] = {}
        for e in self.entries.values():
            if e.parent is not None:
                children[e.parent] = children.get(e.parent, 0) + 1
        assert children == self._child_count, "child index drifted"
        for e in self.entries.values():
            assert e.children == children.get(e.hash, 0), f"children count of {e.hash} drifted"
            assert e.pins >= 0
        assert self.num_pinned == sum(1 for e in self.entries.values() if e.pins > 0)
        assert self.num_storing == sum(1 for e in self.entries.values() if e.status is BlockStatus.STORING)
        owned: dict[str, int] = {}
        for e in self.entries.values():
            owned[e.owner] = owned.get(e.owner, 0) + 1
        assert owned == self.owned, "owner counts drifted"
        assert self.owner_limit is None or all(n <= self.owner_limit for n in owned.values()), "an owner is past its share"
