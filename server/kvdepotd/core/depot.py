"""The Depot: the daemon's whole state and the one place that changes it. Pure and synchronous.

Primitives (called by the runtime on the event loop, one at a time; `now_ms` is passed in):
    register_engine / renew_lease / unregister_engine     engine lifecycle with a lease
    shorten_lease(id, until_ms)       the lease ends by then unless renewed (its worker streams ended)
    leave_engine(id) -> bool          one process of an engine leaves; True when it was the last
    engine(id) / engine_rank(id, rank) / capacity_blocks(id)   an engine (NotFound, InvalidRequest)
    domain_for(layout_class, block_bytes, world_size)      a layout class's pools, made on first use
    lookup(...)  -> LookupResult      tokens beyond the engine's own hit the tiers hold; pins them
    step(...)    -> StepPlan          applies slot updates, finishes, preemptions; returns new ops
    forward_done(engine, rank, step)  a worker's forward for `step` ended: its stores may start
    rank_mapped(engine, rank)         a rank's KV memory is mapped; until every rank's is, lookups
                                      miss and nothing is stored (Engine.mapped_in_full)
    take_ready() -> [Part]            op parts the copy engine should run now (plain data)
    take_cancels() -> [OpId]          ops whose running parts should stop (a finished request's loads)
    part_copied(op_id, rank)          a late-checked load's bytes reached the engine on one rank
    complete_part(op_id, rank, failed, message, corrupt)   the copy engine's report for one part
    take_disk_jobs / disk_job_done / take_disk_drops / restore_disk   the disk tier (disk.py);
                                      disk_jobs: how many are out
    extend_lookup(...) -> LookupResult   a lookup's match extended by what the remote store holds
    set_remote_up / take_remote_jobs / remote_job_done   the remote tier (remote.py); remote_jobs
    expire(now_ms) -> [EngineId]      ends ops, pins and leases past their deadlines; who expired
    reclaim() -> int                  evicts ahead of need down to a small reserve of free host
                                      cells, so a Step's stores find one without evicting (the
                                      runtime calls it off the engine's path)
    take_events() -> [OpCompleted | RequestReleased | LoadCopied]      what the workers must be told
    clear(), stats(), all_counters(), slot(), block_info()     admin and inspection
    check_invariants()                what must hold between calls (tests)

Lookups mix tiers (host preferred). Two-phase everywhere: a store allocates and marks the block
STORING (never evicted, never allocated twice) and complete_part makes it RESIDENT or drops it; a
lookup pins, the load op takes the pins over, and its completion unpins. Every op ends exactly
once (ops.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from kvdepot.hashing import BlockHash
from kvdepot.layout import KvLayout
from kvdepotd.core import audit, lookup
from kvdepotd.core.disk import DISK_MAX_RANKS, DiskJob, DiskPlanner, Domain, disk_record_bytes, is_private, private_class
from kvdepotd.core.errors import DepotError, FailedPrecondition, InvalidRequest, NotFound, ResourceExhausted, not_registered
from kvdepotd.core.ops import EngineId, Op, OpId, OpKind, OpTable, Part, RequestId
from kvdepotd.core.plan import OpPlanner
from kvdepotd.core.pool import BlockPool, CellId, PrivateSpace, SlabBudget
from kvdepotd.core.remote import REMOTE_MAX_RANKS, RemoteJob, RemotePlanner
from kvdepotd.core.records import (
    MAX_LEASE_MS,
    DepotConfig,
    DepotStats,
    Engine,
    Event,
    LoadCopied,
    LookupPin,
    LookupResult,
    OpCompleted,
    PoolStats,
    RequestReleased,
    StepPlan,
)
from kvdepotd.core.registry import BlockEntry, BlockRegistry, make_eviction_policy
from kvdepotd.core.rows import RowPass, check_columns
from kvdepotd.core.slots import MAX_ID_LEN, BlockState, Phase, Slot, SlotUpdate, StepColumns, UpdateStyle

__all__ = [
    "Depot", "DepotConfig", "DepotStats", "Engine", "Event", "LoadCopied", "LookupResult", "OpCompleted", "PoolStats", "RequestReleased", "StepPlan",
]


class Depot:
    def __init__(self, config: DepotConfig) -> None:
        self.config = config
        make_eviction_policy(config.eviction_policy)  # fail early on an unknown name
        self.host_budget = SlabBudget(config.host_bytes, config.slab_bytes)
        self.disk_budget = SlabBudget(config.disk_bytes, config.disk_slab_bytes)
        self.domains: dict[str, Domain] = {}
        self.engines: dict[EngineId, Engine] = {}
        self.by_key: dict[tuple[str, str], EngineId] = {}  # (namespace, engine key): keys are a namespace's own
        self.ops = OpTable(config.first_op_id)
        self.counters: Counter[str] = Counter()
        self.remote = RemotePlanner(config.remote, self.ops, self.counters)
        self.disk = DiskPlanner(config.disk, self.ops, self.counters, self.remote)
        self._ready: list[tuple[Op, int]] = []
        self._cancels: list[OpId] = []  # ops whose running parts should stop (take_cancels)
        self._events: list[Event] = []
        self._slot_epoch: dict[tuple[EngineId, RequestId], int] = {}
        self.planner = OpPlanner(config, self.ops, self.disk, self.remote, self.counters, self._slot_epoch)

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
        join: bool = False,
        engine_copies: bool = False,
    ) -> tuple[Engine, bool]:
        """A new engine under `engine_id`, or, when `key` names a live engine, that engine (joined:
        its lease is renewed) and True. `join`: never a new engine (NotFound when `key` names none).
        `engine_copies`: its workers copy its blocks themselves, into host memory of its namespace's
        own (private_class), which they map."""
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
        if join and (not key or (namespace, key) not in self.by_key):
            raise NotFound(
                "no live engine has this engine key: a join needs the key its engine's scheduler registered with"
                + ("" if key else " (engine_key is empty)")
            )
        if key and (joined := self.by_key.get((namespace, key))) is not None:
            eng = self.engines[joined]
            if (eng.model, eng.layout, eng.style, eng.engine_copies) != (model, layout, style, engine_copies):
                raise FailedPrecondition(
                    f"engine key {key!r} belongs to engine {eng.engine_id} registered with model {eng.model!r}, "
                    f"layout {eng.layout}, style {eng.style.value}, engine_copies {eng.engine_copies}: this registration differs"
                )
            eng.lease_expires_ms = max(eng.lease_expires_ms, now_ms + lease)
            eng.processes += 1
            return eng, True
        if engine_copies and layout.kind == "none":
            raise InvalidRequest("engine_copies is for engines whose workers copy KV bytes; layout kind 'none' has none")
        cls = private_class(layout.layout_class, namespace) if engine_copies else layout.layout_class
        domain = self.domain_for(cls, layout.block_bytes, layout.world_size)
        eng = Engine(
            engine_id, name, model, layout, namespace, style, lease, now_ms + lease, domain, key, late_load_checks, registered_ms=now_ms,
            engine_copies=engine_copies,
        )
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

    def shorten_lease(self, engine_id: EngineId, until_ms: int) -> None:
        """The engine's lease ends at `until_ms` at the latest (its workers' streams all ended);
        any call of the engine renews it in full."""
        eng = self.engine(engine_id)
        eng.lease_expires_ms = min(eng.lease_expires_ms, until_ms)

    def leave_engine(self, engine_id: EngineId) -> bool:
        """A process of the engine unregisters: True when it was the last one, and the engine should
        go; while processes that joined it under its key remain, nothing ends."""
        eng = self.engine(engine_id)
        eng.processes -= 1
        return eng.processes <= 0

    def unregister_engine(self, engine_id: EngineId, reason: str = "engine unregistered") -> int:
        eng = self.engine(engine_id)
        for op in [op for op in self.ops.ops.values() if op.engine_id == engine_id]:
            self._end(op, reason)
        for rid in list(eng.pins):
            eng.release_pin(rid)
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
        load_cap: int = -1,
    ) -> LookupResult:
        """`load_cap` >= 0: offer at most that many blocks (lookup.lookup)."""
        eng = self.engine(engine_id)
        self._check_pin_caps(eng, request_id, len(tokens) // 4)
        self.disk.now_ms = self.remote.now_ms = now_ms
        remote = self.remote.up and eng.layout.world_size <= REMOTE_MAX_RANKS
        return lookup.lookup(
            eng, request_id, tokens, cache_salt, lora_name, device_matched_tokens, pin_ms, now_ms, self.config, self.counters, remote,
            eng.mapped_in_full, load_cap,
        )

    def extend_lookup(self, engine_id: EngineId, request_id: RequestId, pin: LookupPin | None, res: LookupResult, found: int) -> LookupResult:
        """The remote store holds the first `found` blocks of `res.remote_query` (lookup.extend);
        `pin` is the one the lookup left (Engine.pins), so that a pin replaced meanwhile is not
        extended. The store asked stops at the first block it does not hold: what comes after is
        not known to be there either (a flush, an eviction or a lost primary takes many), so every
        block from there on may be written again."""
        eng = self.engine(engine_id)
        q = res.remote_query
        self.counters["remote_lookups"] += 1
        self.counters["remote_lookup_hits"] += found > 0
        if found < len(q):
            self.remote.absent(eng.domain.layout_class, q[found:])
        if pin is None:
            return res
        out = lookup.extend(eng, request_id, pin, found, res, self.counters)
        if found and out.remote_tokens and q[0] in pin.chain:  # the chain runs from block 0: it has every parent
            at = pin.chain.index(q[0])
            parents = [pin.chain[at - 1] if at else None, *q[: found - 1]]
            self.remote.prefetch(eng.domain, list(zip(q[:found], parents)), eng.namespace)
        return out

    def _check_pin_caps(self, eng: Engine, request_id: RequestId, tokens: int) -> None:
        """Raises ResourceExhausted, naming the cap, when the lookup's pin would take the engine or its
        namespace past one (a repeated lookup replaces its request's own pin)."""
        caps = self.config.caps
        own = eng.pins.get(request_id)
        peers = [e for e in self.engines.values() if e.namespace == eng.namespace]
        if own is None:
            if len(eng.pins) >= caps.pins_per_engine:
                raise ResourceExhausted(
                    f"engine {eng.engine_id} holds {len(eng.pins)} lookup pins, the most one engine may (max_pins_per_engine): "
                    "requests release theirs when they start or finish, or after pin_ms"
                )
            if (n := sum(len(e.pins) for e in peers)) >= caps.pins_per_namespace:
                raise ResourceExhausted(f"namespace {eng.namespace!r} holds {n} lookup pins, the most one namespace may (max_pins_per_namespace)")
        held = sum(e.pin_tokens for e in peers) - (len(own.tokens) >> 2 if own is not None else 0)
        if held + tokens > caps.pin_tokens_per_namespace:
            raise ResourceExhausted(
                f"namespace {eng.namespace!r} pins hold {held} prompt tokens; {tokens} more is over the most one namespace's may "
                f"({caps.pin_tokens_per_namespace}, max_pin_tokens_per_namespace)"
            )

    def _check_slot_tokens(self, eng: Engine, tokens: int) -> None:
        """Raises ResourceExhausted, naming the cap, when the tokens a step carries (at most what
        its slots grow by: a new row resends its whole sequence) would take the namespace's slots
        past max_slot_tokens_per_namespace. Checked before anything of the step is applied."""
        if not tokens:
            return
        cap = self.config.caps.slot_tokens_per_namespace
        held = sum(e.slot_tokens for e in self.engines.values() if e.namespace == eng.namespace)
        if held + tokens > cap:
            raise ResourceExhausted(
                f"namespace {eng.namespace!r} holds {held} tokens in request slots; a step of {tokens} more is over the most one "
                f"namespace may ({cap}, max_slot_tokens_per_namespace): finish requests first"
            )

    def _check_slot_caps(self, eng: Engine, new: int) -> None:
        caps = self.config.caps
        if len(eng.slots) + new > caps.slots_per_engine:
            raise ResourceExhausted(
                f"engine {eng.engine_id} holds {len(eng.slots)} request slots; {new} new ones are over the most one engine may "
                f"({caps.slots_per_engine}, max_slots_per_engine): finish requests first"
            )
        n = sum(len(e.slots) for e in self.engines.values() if e.namespace == eng.namespace)
        if n + new > caps.slots_per_namespace:
            raise ResourceExhausted(
                f"namespace {eng.namespace!r} holds {n} request slots; {new} new ones are over the most one namespace may "
                f"({caps.slots_per_namespace}, max_slots_per_namespace)"
            )

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
        self.disk.now_ms = self.remote.now_ms = now_ms
        if (cached := eng.responses.get(step)) is not None:
            self.counters["steps_repeated"] += 1
            return cached  # rule 5: a repeated step is answered the same and changes nothing
        if step <= eng.last_step:
            raise FailedPrecondition(f"step {step} is older than the engine's last step {eng.last_step}")
        cols = updates if isinstance(updates, StepColumns) else StepColumns.of(updates)
        check_columns(cols, finished, preempted)
        self._check_slot_tokens(eng, len(cols.tokens) >> 2)
        rows = RowPass(eng.slots, eng.layout.block_size, eng.style, self.config.max_tokens)
        try:
            rows.run(cols, step)
            if new := sum(1 for u in rows.slow if u.request_id not in eng.slots):
                self._check_slot_caps(eng, new)
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
            self._store(eng, slot, slot.store_candidates(slot.computed), step, now_ms, plan)
        eng.slot_tokens += rows.added
        for u in slow:  # the general path's rows: their slots' tokens counted here
            if (grown := eng.slots.get(u.request_id)) is not None:
                n = len(grown.tokens) >> 2
                eng.slot_tokens += n - grown.counted
                grown.counted = n
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
        fresh = u.new_tokens[len(slot.tokens) :] if u.is_new else u.new_tokens  # a new row carries the whole sequence
        if u.is_new and not self._continues(slot, u):
            if slot.last_step >= 0:
                self._cancel_waiting_stores(eng, slot, "request restarted")
                self._bump_epoch(eng, slot)
            pin = eng.pins.get(slot.request_id)
            if pin is not None and pin.seed == slot.seed:
                slot.append_tokens(fresh, known=pin.chain, known_over=pin.tokens)
            else:
                slot.append_tokens(fresh)
            loads = slot.start_device_state(u.device_matched_tokens, u.loaded_tokens, list(u.new_block_ids))
            if loads:
                for op in self.planner.load(eng, slot, loads, step, now_ms):
                    self._add_op(slot, op, plan)
            else:
                eng.release_pin(slot.request_id)
        else:
            slot.append_tokens(fresh)
            if u.is_new:  # the same request again, e.g. scheduled after its async load: a fuller table
                slot.block_table = list(u.new_block_ids)
            else:
                slot.block_table += u.new_block_ids
            if C < slot.computed:
                slot.rewind(C)  # rule 6: the engine's numbers win
        slot.computed = C + S
        slot.last_step = step
        self._store(eng, slot, slot.store_candidates(C + S), step, now_ms, plan)

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

    def _store(self, eng: Engine, slot: Slot, candidates: list[int], step: int, now_ms: int, plan: StepPlan) -> None:
        if not candidates:  # most rows of a decode step: no call further down
            return
        if not eng.mapped_in_full:  # a rank's copy would fail: the block would be stored in part
            for i in candidates:
                slot.states[i] = BlockState.NOT_STORED
            self.counters["store_blocks_unmapped"] += len(candidates)
            return
        op = self.planner.store(eng, slot, candidates, step, now_ms)
        if op is not None:
            self._add_op(slot, op, plan)

    def _add_op(self, slot: Slot, op: Op, plan: StepPlan) -> None:
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
        eng.release_pin(rid)
        slot = eng.slots.get(rid)
        if slot is None or slot.phase is Phase.FINISHING:
            return  # never scheduled, or already finishing: finishing is idempotent
        for op_id in slot.ops:  # a load into a finished (cancelled) request's blocks is of no use
            op = self.ops.ops.get(op_id)
            if op is not None and op.kind is OpKind.LOAD and not op.cancelled:
                # Not ended here: a copy may be writing one of its blocks. Its parts copy nothing
                # more (take_ready hands them out empty; take_cancels stops those running), and it
                # ends when they have reported, so the engine is told it may free the blocks only
                # once nothing writes into them (delay_free until then).
                op.cancelled = True
                op.failed.update(op.block_indices)
                op.message = op.message or "its request finished"
                self._cancels.append(op.op_id)
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
                self._end(op, reason)

    def _bump_epoch(self, eng: Engine, slot: Slot) -> None:
        key = (eng.engine_id, slot.request_id)
        self._slot_epoch[key] = self._slot_epoch.get(key, 0) + 1

    # -- workers and the copy engine ------------------------------------------------------------
    def rank_mapped(self, engine_id: EngineId, rank: int) -> None:
        """The daemon mapped `rank`'s KV memory: once every rank's is, the engine gets hits and its
        blocks are stored."""
        self.engine_rank(engine_id, rank).mapped.add(rank)

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
                self._end(op, "its request's load had not ended when the forward ran")
                continue
            self._ready.append((op, r))

    def _load_open(self, slot: Slot, step: int) -> bool:
        return any((o := self.ops.ops.get(i)) is not None and o.kind is OpKind.LOAD and o.step <= step for i in slot.ops)

    def reclaim(self) -> int:
        """Evicts host blocks (prefix-aware, LRU, as a store would) until each host pool has its
        reserve of free cells or nothing more is evictable; returns how many it evicted."""
        cfg = self.config
        evicted = 0
        for dom in self.domains.values():
            reg, pool = dom.registry, dom.registry.pool
            reserve = min(cfg.free_reserve_max, int(pool.capacity_blocks * cfg.free_reserve_fraction))
            while pool.capacity_blocks - pool.num_used < reserve and reg.evict_one():
                evicted += 1
        return evicted

    def take_ready(self) -> list[Part]:
        """Op parts the copy engine should run now, as plain data (see ops.Part)."""
        ready, self._ready = self._ready, []
        live = self.ops.ops
        parts: list[Part] = []
        last: Op | None = None  # an op's ranks come one after another: its blocks are read once
        work: tuple[tuple[int, int, CellId, int], ...] = ()
        indices: tuple[int, ...] = ()
        failed: tuple[int, ...] = ()
        for op, rank in ready:
            if op.op_id not in live:
                continue
            if op is not last:
                last = op
                pool = self.domains[op.layout_class].registry.pool
                bad = op.failed
                work = tuple([(i, b, c, pool.byte_offset(c)) for i, b, c in zip(op.block_indices, op.block_ids, op.tier_cells) if c is not None and i not in bad])
                indices = tuple(op.block_indices)
                failed = tuple(sorted(bad)) if bad else ()
            parts.append(Part(op.op_id, op.kind, op.engine_id, rank, op.layout_class, op.step, op.check_late, indices, work, failed, op.message, op.deadline_ms))
        return parts

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

    def _end(self, op: Op, reason: str) -> None:
        """Ends an op before all its parts reported (once: an op that ended already is left)."""
        ended = self.ops.end(op, reason)
        if ended is not None:
            self._op_ended(ended)

    def _op_ended(self, op: Op) -> None:
        epoch = op.epoch
        dom = self.domains[op.layout_class]
        eng = self.engines.get(op.engine_id)
        slot = eng.slots.get(op.request_id) if eng is not None else None
        current = slot is not None and self._slot_epoch.get((op.engine_id, op.request_id), 0) == epoch
        self.planner.settle(op, dom, slot, current, stored_by_live_engine=eng is not None)
        if op.kind is OpKind.LOAD and op.failed and current and slot is not None and eng is not None:
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

    def take_cancels(self) -> list[OpId]:
        """Ops whose parts the copy engine should stop (they report what they did not copy)."""
        out, self._cancels = self._cancels, []
        return out

    def take_events(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    # -- time ------------------------------------------------------------------------------------
    def expire(self, now_ms: int) -> list[EngineId]:
        """Ends ops, pins and leases past their deadlines; returns the engines whose lease expired
        (unregistered here: the runtime closes their channels and mappings)."""
        self.disk.now_ms = self.remote.now_ms = now_ms
        expired: list[EngineId] = []
        for op in self.ops.expired(now_ms):
            self._end(op, "deadline exceeded")
        for eng in list(self.engines.values()):
            for rid in [rid for rid, p in eng.pins.items() if p.deadline_ms <= now_ms]:
                eng.release_pin(rid)
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
        """The block's host entry and disk entry, where the engine's namespace stored them: a hash
        can be computed by anyone who knows (or guesses) a prompt and another namespace's name, so
        another namespace's block is not there for this engine (None), as it is not for its lookups."""
        eng = self.engine(engine_id)
        dom = eng.domain
        host, disk = dom.registry.state_of(h), dom.disk.state_of(h) if dom.disk is not None else None
        return (host if host is not None and host.owner == eng.namespace else None), (disk if disk is not None and disk.owner == eng.namespace else None)

    def stats(self) -> DepotStats:
        return audit.stats(
            self.engines, self.domains, self.ops.ops, self.counters, self.host_budget, self.disk_budget, len(self.remote.queue), len(self.remote.jobs)
        )

    def all_counters(self) -> dict[str, int]:
        return audit.all_counters(self.counters, self.domains)

    def check_invariants(self) -> None:
        audit.check_invariants(
            self.engines, self.domains, self.by_key, self.ops.ops, [job for job, _ in self.disk.jobs.values()], [job for job, _ in self.remote.jobs.values()]
        )

    # -- internals -------------------------------------------------------------------------------
    def engine(self, engine_id: EngineId) -> Engine:
        eng = self.engines.get(engine_id)
        if eng is None:
            raise NotFound(not_registered(engine_id))
        return eng

    def domain_for(self, layout_class: str, block_bytes: int, world_size: int) -> Domain:
        d = self.domains.get(layout_class)
        if d is None:
            policy = self.config.eviction_policy
            space = PrivateSpace(self.host_budget) if is_private(layout_class) else self.host_budget
            pool = BlockPool(layout_class, block_bytes, space)
            registry = BlockRegistry(pool, make_eviction_policy(policy), owner_share=self.config.namespace_host_share)
            d = Domain(layout_class, block_bytes, world_size, registry)
            if self.config.disk_bytes and world_size <= DISK_MAX_RANKS:
                dpool = BlockPool(layout_class, disk_record_bytes(block_bytes), self.disk_budget)
                d.disk = BlockRegistry(dpool, make_eviction_policy(policy), track_drops=True, owner_share=self.config.namespace_disk_share)
            self.domains[layout_class] = d
        elif d.block_bytes != block_bytes:
            raise FailedPrecondition(f"layout class {layout_class} has {d.block_bytes}-byte blocks, not {block_bytes}")
        return d

    # -- the remote tier -------------------------------------------------------------------------------
    def set_remote_up(self, up: bool) -> None:
        """The runtime's health check: the store answers (lookups ask it, blocks are written) or not."""
        self.remote.set_up(up)

    @property
    def remote_jobs(self) -> int:
        return len(self.remote.jobs)

    def take_remote_jobs(self) -> list[RemoteJob]:
        """Store jobs to run now: reads planned by loads, and writes of admitted host blocks."""
        return self.remote.take_jobs()

    def remote_job_done(
        self, job_id: int, failed: set[BlockHash], corrupt: set[BlockHash], present: set[BlockHash], message: str = "", forged: set[BlockHash] | None = None
    ) -> None:
        """The store's report of one job (RemotePlanner.job_done)."""
        self._ready += self.remote.job_done(job_id, failed, corrupt, present, message, forged)

    # -- the disk tier ---------------------------------------------------------------------------------
    def restore_disk(self, layout_class: str, block_bytes: int, world_size: int, blocks: Sequence[tuple[int, int | None, int, str]]) -> bool:
        """Blocks (hash, parent, disk cell, owner) a persistent disk tier still holds at start-up (all or none)."""
        return self.disk.restore(self.domain_for(layout_class, block_bytes, world_size), blocks)

    @property
    def disk_jobs(self) -> int:
        """Disk jobs handed out and not reported yet."""
        return len(self.disk.jobs)

    def take_disk_jobs(self, now_ms: int, flush: bool = False) -> list[DiskJob]:
        """Disk jobs the storage should run now: staging reads planned by loads, and writes of
        admitted host blocks the policy lets go now (all of them when `flush`: a clean shutdown)."""
        return self.disk.take_jobs(list(self.domains.values()), now_ms, flush)

    def take_disk_drops(self) -> list[tuple[str, BlockHash, CellId]]:
        return self.disk.take_drops(list(self.domains.values()))

    def disk_job_done(self, job_id: int, failed: set[BlockHash], corrupt: set[BlockHash], message: str = "") -> None:
        """The storage's report of one job (DiskPlanner.job_done)."""
        self._ready += self.disk.job_done(job_id, failed, corrupt, message)

    def _release_slot(self, eng: Engine, rid: RequestId) -> None:
        eng.slot_tokens -= eng.slots.pop(rid).counted
        self._slot_epoch.pop((eng.engine_id, rid), None)
        self.counters["slots_released"] += 1
