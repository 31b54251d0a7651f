"""The Depot: the daemon's whole state and the one place that changes it. Pure and synchronous.

Primitives (called by the service on the event loop, one at a time; `now_ms` is passed in):
    register_engine / heartbeat / unregister_engine      engine lifecycle with a lease
    lookup(...)  -> LookupResult      tokens beyond the engine's own hit the tiers hold; pins them
    step(...)    -> StepPlan          applies slot updates, finishes, preemptions; returns new ops
    forward_done(engine, rank, step)  a worker's forward for `step` ended: its stores may start
    take_ready() -> [(Op, rank)]      op parts the copy engine should run now
    complete_part(op_id, rank, failed_indices, message)   the copy engine's report for one part
    expire(now_ms)                    ends ops, pins and leases past their deadlines
    reclaim() -> int                  evicts ahead of need down to a small reserve of free host
                                      slots, so a Step's stores find one without evicting (the
                                      service calls it off the engine's path)
    part_copied(op_id, rank)          a late-checked load's bytes reached the engine on one rank
    take_events() -> [OpCompleted | RequestReleased | LoadCopied]      what the workers must be told
    clear(), stats(), slot_blocks(), block_info()          admin and inspection

The disk tier (G3, when config.disk_bytes > 0) is a second registry per layout class. Lookups
mix tiers (host preferred); a load of a block only on disk first stages it into a fresh host
slot (a READ disk job; the load op is held until it ends). Host blocks reach the disk through a
queue of admitted blocks (seen `disk_admit_after` times within the window), written by WRITE disk
jobs: at once (write-through) or once the host pool is past its watermark (write-back), so that
host eviction finds them already on disk. take_disk_jobs / disk_job_done are the storage's side;
take_disk_drops lists disk slots whose entry is gone (the storage journals their removal).

Two-phase everywhere: a store allocates and marks the block STORING (never evicted, never
allocated twice) and complete_part makes it RESIDENT or drops it; a lookup pins, the load op takes
the pins over, and its completion unpins. Every op ends exactly once (ops.py).
"""

from __future__ import annotations

import enum
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvdepot.hashing import BlockHash, block_hashes, salt_hash, scope_seed
from kvdepot.layout import KvLayout
from kvdepotd.core.errors import DepotError, FailedPrecondition, InvalidRequest, NotFound
from kvdepotd.core.ops import EngineId, Op, OpId, OpKind, OpTable, RequestId
from kvdepotd.core.pool import BlockPool, SlabArena, SlotId
from kvdepotd.core.registry import BlockEntry, BlockRegistry, BlockStatus, make_eviction_policy
from kvdepotd.core.rows import RowPass, check_columns
from kvdepotd.core.slots import MAX_ID_LEN, BlockState, Phase, Slot, SlotUpdate, StepColumns, UpdateStyle

MAX_LEASE_MS = 3_600_000
# Every counter the core keeps (exported as kvdepot_<name>_total, at 0 until it first moves).
COUNTERS = (
    "engines_registered", "engines_unregistered", "leases_expired",
    "lookups", "lookup_hit_tokens", "pins_expired",
    "steps", "steps_repeated", "slots_created", "slots_released", "preemptions", "preempted_unknown",
    "store_blocks_planned", "store_blocks_already_cached", "store_blocks_tier_full", "store_blocks_over_share", "stored_blocks", "store_failed_blocks", "store_blocks_cancelled",
    "load_blocks_planned", "loaded_blocks", "load_failed_blocks", "checksum_failures",
    "ops_expired", "cleared_blocks", "evictions",
    "lookup_disk_hit_tokens", "disk_admitted_blocks", "disk_rejected_blocks", "disk_written_blocks",
    "disk_write_failed_blocks", "disk_read_blocks", "disk_read_failed_blocks", "disk_checksum_failures",
    "disk_full", "disk_evictions", "disk_write_missed_blocks",
)
DISK_HEADER_BYTES = 4096  # one header per block on disk, before its data
DISK_ALIGN = 4096  # O_DIRECT alignment of every offset and length on disk
DISK_MAX_RANKS = 500  # a block header holds one checksum per rank: wider engines get no disk tier
DISK_POLICIES = ("write-back", "write-through")
SEEN_CAP = 1 << 18  # hashes the admission window remembers per layout class


def disk_record_bytes(block_bytes: int) -> int:
    """Bytes one block takes on disk: its header, then its data padded to the alignment."""
    return DISK_HEADER_BYTES + -(-block_bytes // DISK_ALIGN) * DISK_ALIGN


@dataclass(frozen=True, slots=True)
class DepotConfig:
    host_bytes: int
    slab_bytes: int = 64 << 20
    lease_ms: int = 30_000
    pin_ms: int = 30_000
    max_pin_ms: int = 600_000
    op_timeout_ms: int = 30_000
    max_tokens: int = 1 << 21
    step_cache: int = 16
    eviction_policy: str = "leaf-lru"
    disk_bytes: int = 0
    disk_slab_bytes: int = 256 << 20
    disk_policy: str = "write-back"
    disk_admit_after: int = 2
    disk_admit_window_ms: int = 600_000
    disk_watermark: float = 0.8  # write-back: host pool fraction past which admitted blocks are written
    disk_job_blocks: int = 32
    disk_jobs_in_flight: int = 4  # write jobs per layout class
    # reclaim() keeps this many host slots of each layout class free: 1/64 of the pool, at most 256
    # (a few steps' worth of stores), so eviction leaves the Step path at the cost of that margin.
    free_reserve_fraction: float = 1 / 64
    free_reserve_max: int = 256
    namespace_host_share: float = 1.0  # < 1: most of a host pool one namespace may hold (BlockRegistry owner_share)
    # Op ids must not repeat across daemon restarts: a worker that kept a completion of the old
    # daemon's op 7 would take the new daemon's op 7 as done. The service starts them from the clock.
    first_op_id: int = 1


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


class DiskJobKind(enum.Enum):
    WRITE = "WRITE"  # host slot -> disk slot
    READ = "READ"  # disk slot -> host slot (staging for a load)


@dataclass(slots=True)
class DiskItem:
    hash: BlockHash
    parent: BlockHash | None
    host_slot: SlotId
    disk_slot: SlotId


@dataclass(slots=True)
class DiskJob:
    job_id: int
    kind: DiskJobKind
    domain: Domain
    items: list[DiskItem]


@dataclass(slots=True)
class LookupPin:
    hashes: list[BlockHash]
    deadline_ms: int
    on_disk: list[bool]  # per hash: pinned in the disk tier (else the host tier)
    # The hash chain the lookup computed from block 0 (over `tokens`, with `seed`): the request's
    # first Step reuses it when it carries the same tokens, instead of hashing the prompt again.
    tokens: bytes = b""
    seed: int = 0
    chain: list[BlockHash] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class LookupResult:
    matched_tokens: int
    host_tokens: int
    disk_tokens: int
    pin_deadline_ms: int
    total_blocks: int


@dataclass(slots=True)
class StepPlan:
    step: int
    ops: list[Op] = field(default_factory=list)
    delay_free: list[RequestId] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class OpCompleted:
    engine_id: EngineId
    op: Op


@dataclass(frozen=True, slots=True)
class RequestReleased:
    engine_id: EngineId
    request_id: RequestId


@dataclass(frozen=True, slots=True)
class LoadCopied:
    """A check_late load's bytes are in the engine's blocks on every rank (its OpCompleted follows)."""

    engine_id: EngineId
    op_id: OpId


Event = OpCompleted | RequestReleased | LoadCopied


@dataclass(frozen=True, slots=True)
class PoolStats:
    layout_class: str
    tier: str  # "host" or "disk"
    block_bytes: int  # of the layout class (a disk record adds its header and padding)
    capacity_blocks: int
    used_blocks: int
    pinned_blocks: int
    in_flight_blocks: int


@dataclass(frozen=True, slots=True)
class DepotStats:
    """What GetStats and the metrics export, read in one walk (Depot.stats)."""

    engines: int
    slots: int
    ops_in_flight: int
    pools: list[PoolStats]
    counters: dict[str, int]
    namespace_engines: dict[str, int]
    namespace_slots: dict[str, int]
    namespace_host_blocks: dict[str, int]  # host-tier blocks each namespace holds, all layout classes
    host_bytes: int
    disk_bytes: int
    disk_used_bytes: int


@dataclass(slots=True)
class Engine:
    engine_id: EngineId
    name: str
    model: str
    layout: KvLayout
    namespace: str
    style: UpdateStyle
    lease_ms: int
    lease_expires_ms: int
    domain: Domain
    key: str = ""
    late_load_checks: bool = False  # its loads report LoadCopied before their checksums are checked
    slots: dict[RequestId, Slot] = field(default_factory=dict)
    pins: dict[RequestId, LookupPin] = field(default_factory=dict)
    last_step: int = -1
    responses: OrderedDict[int, StepPlan] = field(default_factory=OrderedDict)

    def seed(self, cache_salt: str, lora_name: str) -> int:
        return scope_seed(salt_hash(cache_salt, lora_name), self.namespace, self.model)


class Depot:
    def __init__(self, config: DepotConfig) -> None:
        self.config = config
        make_eviction_policy(config.eviction_policy)  # fail early on an unknown name
        if config.disk_policy not in DISK_POLICIES:
            raise ValueError(f"unknown disk policy {config.disk_policy!r}; known: {', '.join(DISK_POLICIES)}")
        self.host_arena = SlabArena(config.host_bytes, config.slab_bytes)
        self.disk_arena = SlabArena(config.disk_bytes, config.disk_slab_bytes)
        self.disk_jobs: dict[int, DiskJob] = {}
        self._disk_ready: list[DiskJob] = []
        self._next_job = 1
        self._now_ms = 0
        self._flush = False
        self._staging: dict[BlockHash, list[tuple[Op, int]]] = {}  # block being read from disk -> (load, position) waiting
        self.domains: dict[str, Domain] = {}
        self.engines: dict[EngineId, Engine] = {}
        self.by_key: dict[tuple[str, str], EngineId] = {}  # (namespace, engine key): keys are a namespace's own
        self.ops = OpTable(config.first_op_id)
        self.counters: Counter[str] = Counter()
        self._ready: list[tuple[Op, int]] = []
        self._events: list[Event] = []
        self._slot_epoch: dict[tuple[EngineId, RequestId], int] = {}

    # -- engines -------------------------------------------------------------------------------
    def register_engine(
        self,
        engine_id: EngineId,
        *,
        name: str,
        model: str,
        layout: KvLayout,
        namespace: str,
        style: UpdateStyle,
        lease_ms: int,
        now_ms: int,
        key: str = "",
        late_load_checks: bool = False,
    ) -> tuple[Engine, bool]:
        """A new engine under `engine_id`, or, when `key` names a live engine, that engine (joined:
        its lease is renewed) and True."""
        try:
            layout.validate()
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        if not model:
            raise InvalidRequest("model must name the model (blocks are shared only within one model)")
        for label, text in (("engine name", name), ("model", model), ("namespace", namespace), ("engine key", key)):
            if len(text) > MAX_ID_LEN:
                raise InvalidRequest(f"{label} is longer than {MAX_ID_LEN} characters")
        if lease_ms < 0 or lease_ms > MAX_LEASE_MS:
            raise InvalidRequest(f"lease_ms must be in [0, {MAX_LEASE_MS}], got {lease_ms}")
        lease = lease_ms or self.config.lease_ms
        if key and (joined := self.by_key.get((namespace, key))) is not None:
            eng = self.engines[joined]
            if (eng.model, eng.layout, eng.style) != (model, layout, style):
                raise FailedPrecondition(
                    f"engine key {key!r} belongs to engine {eng.engine_id} registered with model {eng.model!r}, "
                    f"layout {eng.layout}, style {eng.style.value}: this registration differs"
                )
            eng.lease_expires_ms = max(eng.lease_expires_ms, now_ms + lease)
            return eng, True
        domain = self._domain(layout)
        eng = Engine(engine_id, name, model, layout, namespace, style, lease, now_ms + lease, domain, key, late_load_checks)
        self.engines[engine_id] = eng
        if key:
            self.by_key[namespace, key] = engine_id
        self.counters["engines_registered"] += 1
        return eng, False

    def renew_lease(self, engine_id: EngineId, now_ms: int) -> int:
        """Any call from an engine proves it alive (heartbeats matter only while it is idle); returns
        the new expiry."""
        eng = self.engine(engine_id)
        eng.lease_expires_ms = now_ms + eng.lease_ms
        return eng.lease_expires_ms

    def unregister_engine(self, engine_id: EngineId, reason: str = "engine unregistered") -> int:
        eng = self.engine(engine_id)
        for op in [op for op in self.ops.ops.values() if op.engine_id == engine_id]:
            ended = self.ops.end(op, reason)
            if ended is not None:
                self._op_ended(ended)
        for rid in list(eng.pins):
            self._release_pin(eng, rid)
        released = len(eng.slots)
        for rid in list(eng.slots):
            self._release_slot(eng, rid)
        self.ops.forget_engine(engine_id)
        del self.engines[engine_id]
        if eng.key:
            del self.by_key[eng.namespace, eng.key]
        self._events = [e for e in self._events if e.engine_id != engine_id]
        self.counters["engines_unregistered"] += 1
        return released

    def capacity_blocks(self, engine_id: EngineId) -> int:
        return self.engine(engine_id).domain.registry.pool.capacity_blocks

    # -- lookup --------------------------------------------------------------------------------
    def lookup(
        self,
        engine_id: EngineId,
        request_id: RequestId,
        tokens: bytes,
        *,
        cache_salt: str,
        lora_name: str,
        device_matched_tokens: int,
        pin_ms: int,
        now_ms: int,
    ) -> LookupResult:
        eng = self.engine(engine_id)
        bs = eng.layout.block_size
        n = len(tokens) // 4
        L = device_matched_tokens
        if not request_id or len(request_id) > MAX_ID_LEN:
            raise InvalidRequest(f"request id must have 1 to {MAX_ID_LEN} characters")
        if n > self.config.max_tokens:
            raise InvalidRequest(f"{n} tokens is over the limit of {self.config.max_tokens}")
        if L > n:
            raise InvalidRequest(f"device_matched_tokens {L} exceeds the prompt's {n} tokens")
        if pin_ms < 0 or pin_ms > self.config.max_pin_ms:
            raise InvalidRequest(f"pin_ms must be in [0, {self.config.max_pin_ms}], got {pin_ms}")
        self.counters["lookups"] += 1
        self._now_ms = now_ms
        self._release_pin(eng, request_id)  # a repeated lookup replaces the earlier answer
        first = L // bs
        # The last prompt token is always recomputed (the engine needs its logits), so never offer it.
        offerable = max(0, (n - 1) // bs - first) if n else 0
        hit: list[BlockHash] = []
        on_disk: list[bool] = []
        chain: list[BlockHash] = []
        seed = eng.seed(cache_salt, lora_name)
        if L % bs == 0 and offerable:
            hit, on_disk, chain = self._match(eng, tokens, seed, first, offerable)
        deadline = now_ms + (pin_ms or self.config.pin_ms)
        if hit:
            eng.pins[request_id] = LookupPin(hit, deadline, on_disk, tokens, seed, chain)
        matched = len(hit) * bs
        disk = sum(on_disk) * bs
        self.counters["lookup_hit_tokens"] += matched
        self.counters["lookup_disk_hit_tokens"] += disk
        return LookupResult(matched, matched - disk, disk, deadline if hit else 0, n // bs)

    def _match(self, eng: Engine, tokens: bytes, seed: int, first: int, limit: int) -> tuple[list[BlockHash], list[bool], list[BlockHash]]:
        """Resident blocks from `first` on, stopping at the first block no tier holds, pinned in
        the tier they are taken from (host first); hashes in growing chunks so a miss early in a
        long prompt costs little. Also returns every hash computed, from block 0 on (the chain)."""
        dom = eng.domain
        bs = eng.layout.block_size
        chain = block_hashes(tokens, bs, seed, limit=first) if first else []
        prev = chain[-1] if chain else None
        out: list[BlockHash] = []
        on_disk: list[bool] = []
        chunk = 32
        while len(out) < limit:
            hs = block_hashes(tokens, bs, seed, start_block=first + len(out), prev=prev, limit=min(chunk, limit - len(out)))
            if not hs:
                break
            chain += hs
            n = self._match_tiers(dom, hs, on_disk)
            out += hs[:n]
            if n < len(hs):
                break
            prev = hs[-1]
            chunk *= 4
        return out, on_disk, chain

    @staticmethod
    def _match_tiers(dom: Domain, hs: list[BlockHash], on_disk: list[bool]) -> int:
        """Pins the leading blocks of `hs` some tier holds; runs of host blocks go in one pass."""
        host, disk = dom.registry, dom.disk
        i = 0
        while i < len(hs):
            n = host.match_and_pin(hs[i:] if i else hs)
            on_disk += [False] * n
            i += n
            if disk is None:
                break
            start = i
            while i < len(hs):
                h = hs[i]
                e = disk.state_of(h)
                if e is None or e.status is not BlockStatus.RESIDENT or e.doomed or host.lookup([h]):
                    break
                disk.pin(h)
                e.hits += 1
                on_disk.append(True)
                i += 1
            if i == start:
                break
        return i

    # -- step ----------------------------------------------------------------------------------
    def step(
        self,
        engine_id: EngineId,
        step: int,
        updates: StepColumns | list[SlotUpdate],
        finished: list[RequestId],
        preempted: list[RequestId],
        now_ms: int,
    ) -> StepPlan:
        eng = self.engine(engine_id)
        self._now_ms = now_ms
        if (cached := eng.responses.get(step)) is not None:
            self.counters["steps_repeated"] += 1
            return cached  # rule 5: a repeated step is answered the same and changes nothing
        if step <= eng.last_step:
            raise FailedPrecondition(f"step {step} is older than the engine's last step {eng.last_step}")
        cols = updates if isinstance(updates, StepColumns) else StepColumns.of(updates)
        check_columns(cols, finished, preempted)
        rows = RowPass(eng.slots, eng.layout.block_size, eng.style, self.config.max_tokens)
        try:
            rows.run(cols, step)
        except DepotError:
            rows.undo()
            raise
        slow, touched = rows.slow, rows.touched
        plan = StepPlan(step)
        for rid in preempted:
            self._preempt(eng, rid)
        for u in slow:
            self._apply(eng, u, step, now_ms, plan)
        for slot in touched:
            self._plan_store(eng, slot, slot.store_candidates(slot.computed), step, now_ms, plan)
        for rid in finished:
            self._finish(eng, rid, plan)
        eng.last_step = step
        eng.responses[step] = plan
        while len(eng.responses) > self.config.step_cache:
            eng.responses.popitem(last=False)
        self.counters["steps"] += 1
        return plan

    def _apply(self, eng: Engine, u: SlotUpdate, step: int, now_ms: int, plan: StepPlan) -> None:
        slot = eng.slots.get(u.request_id)
        C, S = u.computed_tokens, u.scheduled_tokens
        if slot is None:
            slot = Slot(u.request_id, eng.seed(u.cache_salt, u.lora_name), eng.layout.block_size)
            eng.slots[u.request_id] = slot
            self.counters["slots_created"] += 1
        if u.is_new and not self._continues(slot, u):
            if slot.last_step >= 0:
                self._cancel_waiting_stores(eng, slot, "request restarted")
                self._bump_epoch(eng, slot)
            pin = eng.pins.get(slot.request_id)
            if pin is not None and pin.seed == slot.seed:
                slot.append_tokens(u.new_tokens, known=pin.chain, known_over=pin.tokens)
            else:
                slot.append_tokens(u.new_tokens)
            loads = slot.start_device_state(u.device_matched_tokens, u.loaded_tokens, list(u.new_block_ids))
            if loads:
                self._plan_load(eng, slot, loads, step, now_ms, plan)
            else:
                self._release_pin(eng, slot.request_id)
        else:
            slot.append_tokens(u.new_tokens)
            if u.is_new:  # the same request again, e.g. scheduled after its async load: a fuller table
                slot.block_table = list(u.new_block_ids)
            else:
                slot.block_table += u.new_block_ids
            if C < slot.computed:
                slot.rewind(C)  # rule 6: the engine's numbers win
        slot.computed = C + S
        slot.last_step = step
        self._plan_store(eng, slot, slot.store_candidates(C + S), step, now_ms, plan)

    @staticmethod
    def _continues(slot: Slot, u: SlotUpdate) -> bool:
        """A new update for a slot that is already running with the same L and E and a block table
        that extends the known one (vLLM schedules a request as new after its async load)."""
        return (
            slot.phase is Phase.ACTIVE
            and slot.last_step >= 0
            and u.device_matched_tokens == slot.device_matched
            and u.loaded_tokens == slot.loaded
            and list(u.new_block_ids[: len(slot.block_table)]) == slot.block_table
        )

    def _plan_load(self, eng: Engine, slot: Slot, targets: range, step: int, now_ms: int, plan: StepPlan) -> None:
        """Rule 2: load targets are in flight from the daemon. The op takes its own pins (blocks
        the lookup pinned are still resident); a target no tier holds fails at once (recompute)."""
        dom = eng.domain
        reg, disk = dom.registry, dom.disk
        idx = list(targets)
        hashes = [slot.hashes[i] for i in idx]
        tier_slots: list[SlotId | None] = []
        failed: set[int] = set()
        staged: dict[int, DiskItem] = {}  # position -> the read this load starts
        waits: dict[int, BlockHash] = {}  # position -> a block staging for this load (its own read or another's)
        for pos, (i, h) in enumerate(zip(idx, hashes)):
            self._sighting(dom, h)
            e = reg.state_of(h)
            if e is not None and e.status is BlockStatus.RESIDENT and not e.doomed:
                reg.pin(h)
                tier_slots.append(e.slot)
                self._consider(dom, h)
                continue
            if e is not None and h in self._staging:  # another load is staging it: wait for the same read
                tier_slots.append(e.slot)
                waits[pos] = h
                continue
            d = disk.state_of(h) if disk is not None and e is None else None
            if d is not None and d.status is BlockStatus.RESIDENT and not d.doomed:
                parent = slot.hashes[i - 1] if i else None
                hslot = reg.prepare_store(h, parent, eng.namespace)  # staged through the host tier
                if hslot is not None:
                    disk.pin(h)  # type: ignore[union-attr]
                    tier_slots.append(hslot)
                    staged[pos] = DiskItem(h, parent, hslot, d.slot)
                    self._staging[h] = []
                    waits[pos] = h
                    continue
            tier_slots.append(None)
            failed.add(i)
        self._release_pin(eng, slot.request_id)
        reg.touch(hashes)
        if disk is not None:
            disk.touch([it.hash for it in staged.values()])
        # With blocks to stage, the load is cut into ops of a read job's size: each starts copying into
        # the engine as soon as its own blocks arrived, while the next ones are still being read.
        n = max(1, self.config.disk_job_blocks // 2) if waits else len(idx)
        for k in range(0, len(idx), n):
            part = range(k, min(k + n, len(idx)))
            op = self._new_op(eng, slot, OpKind.LOAD, idx[k : k + n], hashes[k : k + n], tier_slots[k : k + n], step, now_ms)
            op.failed = {idx[p] for p in part if idx[p] in failed}
            if op.failed:
                op.message = "blocks not resident in any tier"
            if mine := [p for p in part if p in waits]:
                op.staging = {idx[p] for p in mine}
                op.from_disk = set(op.staging)
                op.held = True
                for p in mine:
                    self._staging[waits[p]].append((op, p - k))
            if items := [staged[p] for p in part if p in staged]:
                self._disk_job(DiskJobKind.READ, dom, items)
            self._add_op(eng, slot, op, plan)
        self.counters["load_blocks_planned"] += len(idx)

    def _plan_store(self, eng: Engine, slot: Slot, candidates: list[int], step: int, now_ms: int, plan: StepPlan) -> None:
        """Rule 3: check the registry before allocating; resident or in-flight hashes are skipped."""
        if not candidates:
            return
        dom = eng.domain
        reg, disk = dom.registry, dom.disk
        idx: list[int] = []
        tier_slots: list[SlotId | None] = []
        for i in candidates:
            h = slot.hashes[i]
            if disk is not None:
                self._sighting(dom, h)
            if reg.state_of(h) is not None or (disk is not None and disk.state_of(h) is not None):
                slot.states[i] = BlockState.ALREADY_CACHED
                reg.touch([h])
                if disk is not None:
                    disk.touch([h])
                    self._consider(dom, h)
                self.counters["store_blocks_already_cached"] += 1
                continue
            tslot = reg.prepare_store(h, slot.hashes[i - 1] if i else None, eng.namespace)
            if tslot is None:
                slot.states[i] = BlockState.NOT_STORED
                self.counters["store_blocks_over_share" if reg.at_share(eng.namespace) else "store_blocks_tier_full"] += 1
                continue
            slot.states[i] = BlockState.STORING
            idx.append(i)
            tier_slots.append(tslot)
        if idx:
            hashes = [slot.hashes[i] for i in idx]
            self.counters["store_blocks_planned"] += len(idx)
            self._add_op(eng, slot, self._new_op(eng, slot, OpKind.STORE, idx, hashes, tier_slots, step, now_ms), plan)

    def _new_op(
        self,
        eng: Engine,
        slot: Slot,
        kind: OpKind,
        idx: list[int],
        hashes: list[BlockHash],
        tier_slots: list[SlotId | None],
        step: int,
        now_ms: int,
    ) -> Op:
        return Op(
            op_id=self.ops.new_id(),
            kind=kind,
            engine_id=eng.engine_id,
            request_id=slot.request_id,
            block_indices=idx,
            block_ids=[slot.block_table[i] for i in idx],
            hashes=hashes,
            tier_slots=tier_slots,
            step=step,
            deadline_ms=now_ms + self.config.op_timeout_ms,
            planned_ms=now_ms,
            world_size=eng.layout.world_size,
            registry=eng.domain.registry,
            epoch=self._slot_epoch.get((eng.engine_id, slot.request_id), 0),
            check_late=kind is OpKind.LOAD and eng.late_load_checks,
        )

    def _add_op(self, eng: Engine, slot: Slot, op: Op, plan: StepPlan) -> None:
        slot.ops.add(op.op_id)
        plan.ops.append(op)
        self._ready += self.ops.add(op)

    def _preempt(self, eng: Engine, rid: RequestId) -> None:
        slot = eng.slots.get(rid)
        if slot is None or slot.phase is not Phase.ACTIVE:
            self.counters["preempted_unknown"] += 1
            return
        self._cancel_waiting_stores(eng, slot, "request preempted")
        self._bump_epoch(eng, slot)
        slot.preempt()
        self.counters["preemptions"] += 1

    def _finish(self, eng: Engine, rid: RequestId, plan: StepPlan) -> None:
        self._release_pin(eng, rid)
        slot = eng.slots.get(rid)
        if slot is None or slot.phase is Phase.FINISHING:
            return  # never scheduled, or already finishing: finishing is idempotent
        if slot.ops:
            slot.phase = Phase.FINISHING
            plan.delay_free.append(rid)
        else:
            self._release_slot(eng, rid)

    def _cancel_waiting_stores(self, eng: Engine, slot: Slot, reason: str) -> None:
        """Stores whose forward no rank reported yet read engine blocks that are about to be reused."""
        for op_id in list(slot.ops):
            op = self.ops.ops.get(op_id)
            if op is not None and op.kind is OpKind.STORE and self.ops.is_waiting_forward(op):
                op.cancelled = True
                ended = self.ops.end(op, reason)
                if ended is not None:
                    self._op_ended(ended)

    def _bump_epoch(self, eng: Engine, slot: Slot) -> None:
        key = (eng.engine_id, slot.request_id)
        self._slot_epoch[key] = self._slot_epoch.get(key, 0) + 1

    # -- workers and the copy engine ------------------------------------------------------------
    def engine_rank(self, engine_id: EngineId, rank: int) -> Engine:
        """The engine, after checking that `rank` is one of its workers."""
        eng = self.engine(engine_id)
        if not 0 <= rank < eng.layout.world_size:
            raise InvalidRequest(f"rank {rank} is outside the engine's world size {eng.layout.world_size}")
        return eng

    def forward_done(self, engine_id: EngineId, rank: int, step: int) -> None:
        """Stores of `step` and before may start on `rank`, except those of a request whose load of
        the same or an earlier step had not ended when the forward ran: that forward read blocks
        the load had not written, so what it computed after them is wrong and is never stored."""
        eng = self.engine_rank(engine_id, rank)
        for op, r in self.ops.forward_done(engine_id, rank, step):
            slot = eng.slots.get(op.request_id)
            if slot is not None and self._load_open(slot, op.step):
                slot.taint = min(slot.taint, op.block_indices[0]) if slot.taint >= 0 else op.block_indices[0]
                ended = self.ops.end(op, "its request's load had not ended when the forward ran")
                if ended is not None:
                    self._op_ended(ended)
                continue
            self._ready.append((op, r))

    def _load_open(self, slot: Slot, step: int) -> bool:
        return any((o := self.ops.ops.get(i)) is not None and o.kind is OpKind.LOAD and o.step <= step for i in slot.ops)

    def reclaim(self) -> int:
        """Evicts host blocks (prefix-aware, LRU, as a store would) until each host pool has its
        reserve of free slots or nothing more is evictable; returns how many it evicted."""
        cfg = self.config
        evicted = 0
        for dom in self.domains.values():
            reg, pool = dom.registry, dom.registry.pool
            reserve = min(cfg.free_reserve_max, int(pool.capacity_blocks * cfg.free_reserve_fraction))
            while pool.capacity_blocks - pool.num_used < reserve and reg.evict_one():
                evicted += 1
        return evicted

    def take_ready(self) -> list[tuple[Op, int]]:
        ready, self._ready = self._ready, []
        return [(op, r) for op, r in ready if op.op_id in self.ops.ops]

    def part_copied(self, op_id: OpId, rank: int) -> None:
        """A check_late load's part has copied its bytes into the engine (its checksums are being
        checked); the engine hears once every rank has."""
        op = self.ops.part_copied(op_id, rank)
        if op is not None:
            self._events.append(LoadCopied(op.engine_id, op.op_id))

    def complete_part(
        self, op_id: OpId, rank: int, failed: list[int] | None = None, message: str = "", corrupt: list[int] | None = None
    ) -> None:
        """`failed`: block indices this part could not copy; `corrupt`: those whose tier bytes
        failed their checksum (they are dropped from the tier as well)."""
        op = self.ops.finish_part(op_id, rank, failed, message, corrupt)
        if op is not None:
            self._op_ended(op)

    def _op_ended(self, op: Op) -> None:
        epoch = op.epoch
        reg = op.registry
        eng = self.engines.get(op.engine_id)
        slot = eng.slots.get(op.request_id) if eng is not None else None
        current = slot is not None and self._slot_epoch.get((op.engine_id, op.request_id), 0) == epoch
        kind = op.kind
        for i, h, s in zip(op.block_indices, op.hashes, op.tier_slots):
            ok = i not in op.failed
            if kind is OpKind.STORE:
                reg.complete_store(h, ok)
                if ok:
                    self.counters["stored_blocks"] += 1
                elif op.cancelled:  # the engine was about to reuse the blocks: not a failure of the tier
                    self.counters["store_blocks_cancelled"] += 1
                else:
                    self.counters["store_failed_blocks"] += 1
                if ok and eng is not None and eng.domain.disk is not None:
                    self._consider(eng.domain, h, stored=True)
                if slot is not None and slot.states[i] is BlockState.STORING:
                    slot.states[i] = BlockState.STORED if ok else BlockState.STORE_FAILED
                    slot.stored_blocks += ok
            else:
                if s is not None and i not in op.staging:  # a block still staging is pinned once it arrives
                    reg.unpin(h)
                if i in op.corrupt:
                    reg.discard(h)
                    if i in op.from_disk:  # read from disk for this load a moment ago: the disk's copy is bad
                        self._discard_on_disk(reg, h)
                    else:
                        self.counters["checksum_failures"] += 1
                self.counters["loaded_blocks" if ok else "load_failed_blocks"] += 1
                if current and slot is not None and slot.states[i] is BlockState.LOADING:
                    slot.states[i] = BlockState.LOADED if ok else BlockState.LOAD_FAILED
        if kind is OpKind.LOAD and op.failed and current and slot is not None and eng is not None:
            # What the engine computes over the failed blocks is wrong until it rewinds (rule 6).
            first = min(op.failed)
            slot.taint = min(slot.taint, first) if slot.taint >= 0 else first
            self._cancel_waiting_stores(eng, slot, "its request's load failed")
        if op.message == "deadline exceeded":
            self.counters["ops_expired"] += 1
        if eng is None:
            return
        self._events.append(OpCompleted(eng.engine_id, op))
        if slot is not None:
            slot.ops.discard(op.op_id)
            if slot.phase is Phase.FINISHING and not slot.ops:
                self._release_slot(eng, slot.request_id)
                self._events.append(RequestReleased(eng.engine_id, slot.request_id))

    def _discard_on_disk(self, reg: BlockRegistry, h: BlockHash) -> None:
        for dom in self.domains.values():
            if dom.registry is reg and dom.disk is not None:
                dom.disk.discard(h)
                self.counters["disk_checksum_failures"] += 1

    def take_events(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    # -- time ------------------------------------------------------------------------------------
    def expire(self, now_ms: int) -> list[EngineId]:
        """Ends ops, pins and leases past their deadlines; returns the engines whose lease expired
        (unregistered here: the runtime closes their channels and mappings)."""
        self._now_ms = now_ms
        expired: list[EngineId] = []
        for op in self.ops.expired(now_ms):
            ended = self.ops.end(op, "deadline exceeded")
            if ended is not None:
                self._op_ended(ended)
        for eng in list(self.engines.values()):
            for rid in [rid for rid, p in eng.pins.items() if p.deadline_ms <= now_ms]:
                self._release_pin(eng, rid)
                self.counters["pins_expired"] += 1
            if eng.lease_expires_ms <= now_ms:
                self.counters["leases_expired"] += 1
                self.unregister_engine(eng.engine_id, "engine lease expired")
                expired.append(eng.engine_id)
        return expired

    # -- admin and inspection --------------------------------------------------------------------
    def clear(self, host: bool = True, disk: bool = True) -> tuple[int, int]:
        dropped = kept = 0
        for d in self.domains.values():
            for reg in ([d.registry] if host else []) + ([d.disk] if disk and d.disk is not None else []):
                a, b = reg.clear()
                dropped += a
                kept += b
        self.counters["cleared_blocks"] += dropped
        return dropped, kept

    def slot(self, engine_id: EngineId, request_id: RequestId) -> Slot:
        slot = self.engine(engine_id).slots.get(request_id)
        if slot is None:
            raise NotFound(f"engine {engine_id} has no request {request_id}")
        return slot

    def block_info(self, engine_id: EngineId, h: BlockHash) -> tuple[BlockEntry | None, BlockEntry | None]:
        """The block's host entry and disk entry."""
        dom = self.engine(engine_id).domain
        return dom.registry.state_of(h), dom.disk.state_of(h) if dom.disk is not None else None

    def stats(self) -> DepotStats:
        pools: list[PoolStats] = []
        ns_engines: Counter[str] = Counter()
        ns_slots: Counter[str] = Counter()
        ns_blocks: Counter[str] = Counter()
        for e in self.engines.values():
            ns_engines[e.namespace] += 1
            ns_slots[e.namespace] += len(e.slots)
        for dom in self.domains.values():
            ns_blocks.update(dom.registry.owned)
            for tier, reg in (("host", dom.registry), ("disk", dom.disk)):
                if reg is not None:
                    pool = reg.pool
                    pools.append(PoolStats(dom.layout_class, tier, dom.block_bytes, pool.capacity_blocks, pool.num_used, reg.num_pinned, reg.num_storing))
        return DepotStats(
            engines=len(self.engines),
            slots=sum(ns_slots.values()),
            ops_in_flight=len(self.ops.ops),
            pools=pools,
            counters=self.all_counters(),
            namespace_engines=dict(ns_engines),
            namespace_slots=dict(ns_slots),
            namespace_host_blocks=dict(ns_blocks),
            host_bytes=self.host_arena.total_bytes,
            disk_bytes=self.disk_arena.total_bytes,
            disk_used_bytes=self.disk_arena.used_bytes,
        )

    def all_counters(self) -> dict[str, int]:
        out = {name: self.counters.get(name, 0) for name in COUNTERS}
        out["evictions"] = sum(d.registry.evictions for d in self.domains.values())
        out["disk_evictions"] = sum(d.disk.evictions for d in self.domains.values() if d.disk is not None)
        return out

    def check_invariants(self) -> None:
        for d in self.domains.values():
            d.registry.check_invariants()
            if d.disk is not None:
                d.disk.check_invariants()
        assert self.by_key == {(e.namespace, e.key): i for i, e in self.engines.items() if e.key}, "engine keys out of step"
        host_pins: Counter[BlockHash] = Counter()
        disk_pins: Counter[BlockHash] = Counter()
        for eng in self.engines.values():
            for p in eng.pins.values():
                for h, on_disk in zip(p.hashes, p.on_disk):
                    (disk_pins if on_disk else host_pins)[h] += 1
            for slot in eng.slots.values():
                for op_id in slot.ops:
                    assert op_id in self.ops.ops, f"slot {slot.request_id} holds ended op {op_id}"
        for op in self.ops.ops.values():
            if op.kind is OpKind.LOAD:
                host_pins.update(h for i, h, s in zip(op.block_indices, op.hashes, op.tier_slots) if s is not None and i not in op.staging)
        for job in self.disk_jobs.values():
            (host_pins if job.kind is DiskJobKind.WRITE else disk_pins).update(it.hash for it in job.items)
        pins: Counter[BlockHash] = Counter()
        dpins: Counter[BlockHash] = Counter()
        for d in self.domains.values():
            pins.update({h: e.pins for h, e in d.registry.entries.items() if e.pins})
            if d.disk is not None:
                dpins.update({h: e.pins for h, e in d.disk.entries.items() if e.pins})
        assert pins == host_pins, "a host pin leaked or went missing"
        assert dpins == disk_pins, "a disk pin leaked or went missing"

    # -- internals -------------------------------------------------------------------------------
    def engine(self, engine_id: EngineId) -> Engine:
        eng = self.engines.get(engine_id)
        if eng is None:
            raise NotFound(f"engine {engine_id!r} is not registered (or its lease expired): register again")
        return eng

    def _domain(self, layout: KvLayout) -> Domain:
        return self.domain_for(layout.layout_class, layout.block_bytes, layout.world_size)

    def domain_for(self, layout_class: str, block_bytes: int, world_size: int) -> Domain:
        d = self.domains.get(layout_class)
        if d is None:
            policy = self.config.eviction_policy
            pool = BlockPool(layout_class, block_bytes, self.host_arena)
            registry = BlockRegistry(pool, make_eviction_policy(policy), owner_share=self.config.namespace_host_share)
            d = Domain(layout_class, block_bytes, world_size, registry)
            if self.config.disk_bytes and world_size <= DISK_MAX_RANKS:
                dpool = BlockPool(layout_class, disk_record_bytes(block_bytes), self.disk_arena)
                d.disk = BlockRegistry(dpool, make_eviction_policy(policy), track_drops=True)
            self.domains[layout_class] = d
        elif d.block_bytes != block_bytes:
            raise FailedPrecondition(f"layout class {layout_class} has {d.block_bytes}-byte blocks, not {block_bytes}")
        return d

    def _release_pin(self, eng: Engine, rid: RequestId) -> None:
        pin = eng.pins.pop(rid, None)
        if pin is not None:
            dom = eng.domain
            for h, d in zip(pin.hashes, pin.on_disk):
                (dom.disk if d else dom.registry).unpin(h)  # type: ignore[union-attr]

    # -- the disk tier ---------------------------------------------------------------------------------
    def restore_disk(self, layout_class: str, block_bytes: int, world_size: int, blocks: Sequence[tuple[int, int | None, int]]) -> bool:
        """Blocks (hash, parent, disk slot) a persistent disk tier still holds at start-up (all or none)."""
        dom = self.domain_for(layout_class, block_bytes, world_size)
        assert dom.disk is not None, "restore_disk without a disk tier"
        return dom.disk.restore([(BlockHash(h), None if p is None else BlockHash(p), SlotId(s)) for h, p, s in blocks])

    def take_disk_jobs(self, now_ms: int, flush: bool = False) -> list[DiskJob]:
        """Disk jobs the storage should run now: staging reads planned by loads, and writes of
        admitted host blocks the policy lets go now (all of them when `flush`: a clean shutdown)."""
        self._now_ms = now_ms
        self._flush = flush
        for dom in self.domains.values():
            if dom.disk is not None and dom.demote:
                self._dispatch_writes(dom)
        ready, self._disk_ready = self._disk_ready, []
        return ready

    def take_disk_drops(self) -> list[tuple[str, BlockHash, SlotId]]:
        out: list[tuple[str, BlockHash, SlotId]] = []
        for dom in self.domains.values():
            if dom.disk is not None and dom.disk.drops:
                out += [(dom.layout_class, h, s) for h, s in dom.disk.drops]
                dom.disk.drops.clear()
        return out

    def disk_job_done(self, job_id: int, failed: set[BlockHash], corrupt: set[BlockHash], message: str = "") -> None:
        """The storage's report of one job: `failed` blocks were not moved, `corrupt` ones (a subset
        or not) of a read had a bad header on disk (dropped from the disk tier). A write reads no
        bytes for their checksums, so it has no corrupt blocks: a bad host copy fails its first read."""
        job = self.disk_jobs.pop(job_id)
        dom = job.domain
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
            return
        waiting: dict[OpId, Op] = {}
        for it in job.items:
            ok = it.hash not in bad_blocks
            disk.unpin(it.hash)
            if it.hash in corrupt:
                disk.discard(it.hash)
                self.counters["disk_checksum_failures"] += 1
            host.complete_store(it.hash, ok)
            self.counters["disk_read_blocks" if ok else "disk_read_failed_blocks"] += 1
            for op, pos in self._staging.pop(it.hash):
                op.staging.discard(op.block_indices[pos])
                if op.op_id not in self.ops.ops:
                    continue  # the load ended meanwhile: the block stays in the host tier, unpinned
                waiting[op.op_id] = op
                if ok:
                    host.pin(it.hash)  # the load's pin, released when it ends
                else:
                    op.failed.add(op.block_indices[pos])
                    op.tier_slots[pos] = None
                    op.message = op.message or message or "disk read failed"
        for op in waiting.values():
            if not op.staging:
                self._ready += self.ops.release(op)

    def _disk_job(self, kind: DiskJobKind, dom: Domain, items: list[DiskItem]) -> None:
        job = DiskJob(self._next_job, kind, dom, items)
        self._next_job += 1
        self.disk_jobs[job.job_id] = job
        self._disk_ready.append(job)
        if kind is DiskJobKind.WRITE:
            dom.writes_in_flight += 1

    def _dispatch_writes(self, dom: Domain) -> None:
        host, disk = dom.registry, dom.disk
        assert disk is not None
        cfg = self.config
        if cfg.disk_policy == "write-back" and not self._flush and host.pool.num_used < cfg.disk_watermark * host.pool.capacity_blocks:
            return
        while dom.demote and dom.writes_in_flight < cfg.disk_jobs_in_flight:
            items: list[DiskItem] = []
            while dom.demote and len(items) < cfg.disk_job_blocks:
                h, _ = dom.demote.popitem(last=False)
                e = host.state_of(h)
                if e is None or e.status is not BlockStatus.RESIDENT or e.doomed:
                    self.counters["disk_write_missed_blocks"] += 1  # evicted from the host tier before its turn
                    continue
                if disk.state_of(h) is not None:
                    continue
                dslot = disk.prepare_store(h, e.parent)
                if dslot is None:  # the disk is full of pinned or in-flight blocks: try again later
                    self.counters["disk_full"] += 1
                    dom.demote[h] = None
                    dom.demote.move_to_end(h, last=False)
                    break
                host.pin(h)
                items.append(DiskItem(h, e.parent, e.slot, dslot))
            if not items:
                return
            self._disk_job(DiskJobKind.WRITE, dom, items)
            if len(items) < cfg.disk_job_blocks and dom.demote:
                return  # stopped by a full disk

    def _sighting(self, dom: Domain, h: BlockHash) -> None:
        """A request carries block `h` (stored, already cached, or loaded): counts toward admission."""
        n = self.config.disk_admit_after
        if n <= 1 or dom.disk is None:
            return
        seen = dom.seen
        rec = seen.get(h)
        now = self._now_ms
        if rec is None or now - rec[1] > self.config.disk_admit_window_ms:
            rec = seen[h] = [0, now]
        else:
            seen.move_to_end(h)
        rec[0] += 1
        if len(seen) > SEEN_CAP:
            seen.popitem(last=False)

    def _consider(self, dom: Domain, h: BlockHash, stored: bool = False) -> None:
        """Queues a host-resident block for the disk once admitted (counted as a rejection when a
        store completes before the block is admitted)."""
        disk = dom.disk
        if disk is None or h in dom.demote or disk.state_of(h) is not None:
            return
        e = dom.registry.state_of(h)
        if e is None or e.status is not BlockStatus.RESIDENT:
            return
        rec = dom.seen.get(h)
        n = self.config.disk_admit_after
        if n <= 1 or (rec is not None and rec[0] >= n and self._now_ms - rec[1] <= self.config.disk_admit_window_ms):
            dom.demote[h] = None
            self.counters["disk_admitted_blocks"] += 1
            if len(dom.demote) > 2 * dom.registry.pool.capacity_blocks + 1024:
                self._prune_demote(dom)
        elif stored:
            self.counters["disk_rejected_blocks"] += 1

    def _prune_demote(self, dom: Domain) -> None:
        host = dom.registry
        before = len(dom.demote)
        dom.demote = OrderedDict((h, None) for h in dom.demote if (e := host.state_of(h)) is not None and e.status is BlockStatus.RESIDENT)
        self.counters["disk_write_missed_blocks"] += before - len(dom.demote)

    def _release_slot(self, eng: Engine, rid: RequestId) -> None:
        del eng.slots[rid]
        self._slot_epoch.pop((eng.engine_id, rid), None)
        self.counters["slots_released"] += 1
