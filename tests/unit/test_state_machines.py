"""Hypothesis state machines over the registry/pool and over the whole Depot.

Invariants: free + used = slots; no double free; children counts exact; pinned and in-flight blocks
are never evicted; pins never leak; no block is stored twice; every op ends exactly once.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvdepot.hashing import BlockHash, tokens_to_bytes
from kvdepotd.core.depot import Depot, DepotConfig, OpCompleted, RequestReleased
from kvdepotd.core.disk import DiskConfig, DiskJob, disk_record_bytes
from kvdepotd.core.errors import DepotError, FailedPrecondition
from kvdepotd.core.ops import OpKind, RequestId
from kvdepotd.core.pool import BlockPool, SlabBudget
from kvdepotd.core.registry import BlockRegistry, BlockStatus
from kvdepotd.core.remote import RemoteConfig, RemoteJob, RemoteJobKind
from kvdepotd.core.slots import UpdateStyle
from tests.unit.sim import BS, Sim, layout, prompt

HASHES = st.integers(min_value=1, max_value=24).map(BlockHash)


class RegistryMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.reg = BlockRegistry(BlockPool("c", 100, SlabBudget(total_bytes=800, slab_bytes=300)))
        self.pins: dict[BlockHash, int] = {}

    @rule(h=HASHES, parent=st.none() | HASHES)
    def store(self, h: BlockHash, parent: BlockHash | None) -> None:
        if h in self.reg.entries or parent == h:
            return
        pinned_before = {k for k, v in self.pins.items() if v}
        storing_before = {k for k, e in self.reg.entries.items() if e.status is BlockStatus.STORING}
        slot = self.reg.prepare_store(h, parent)
        if slot is None:
            assert self.reg.pool.num_free == 0
            return
        for k in pinned_before | storing_before:
            assert k in self.reg.entries, "a pinned or in-flight block was evicted"

    @rule(h=HASHES, ok=st.booleans())
    def complete(self, h: BlockHash, ok: bool) -> None:
        e = self.reg.entries.get(h)
        if e is not None and e.status is BlockStatus.STORING:
            self.reg.complete_store(h, ok)

    @rule(h=HASHES)
    def pin(self, h: BlockHash) -> None:
        e = self.reg.entries.get(h)
        if e is not None and e.status is BlockStatus.RESIDENT:
            self.reg.pin(h)
            self.pins[h] = self.pins.get(h, 0) + 1

    @rule(h=HASHES)
    def unpin(self, h: BlockHash) -> None:
        if self.pins.get(h):
            self.reg.unpin(h)
            self.pins[h] -= 1

    @rule(hs=st.lists(HASHES, max_size=4))
    def touch(self, hs: list[BlockHash]) -> None:
        self.reg.touch(hs)

    @rule()
    def clear(self) -> None:
        self.reg.clear()
        for k, e in self.reg.entries.items():
            assert e.pins or e.status is BlockStatus.STORING or e.children

    @invariant()
    def consistent(self) -> None:
        self.reg.check_invariants()
        pool = self.reg.pool
        assert pool.num_free + pool.num_used == pool.num_cells <= 8
        for h, n in self.pins.items():
            if n:
                assert self.reg.entries[h].pins == n


TestRegistry = RegistryMachine.TestCase
TestRegistry.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class SharedRegistryMachine(RegistryMachine):
    """The same with owners (namespaces) capped at half of what the pool could hold (3 of 6 slots):
    an owner at its share only ever evicts its own blocks, and is refused when none of them can go."""

    def __init__(self) -> None:
        super().__init__()
        self.reg = BlockRegistry(BlockPool("c", 100, SlabBudget(total_bytes=800, slab_bytes=300)), owner_share=0.5)
        assert self.reg.owner_limit == 3

    @rule(h=HASHES, parent=st.none() | HASHES)
    def store(self, h: BlockHash, parent: BlockHash | None) -> None:
        self.store_owned(h, parent, "")

    @rule(h=HASHES, parent=st.none() | HASHES, owner=st.sampled_from(["a", "b"]))
    def store_owned(self, h: BlockHash, parent: BlockHash | None, owner: str) -> None:
        if h in self.reg.entries or parent == h:
            return
        others = {k for k, e in self.reg.entries.items() if e.owner != owner}
        held = {k for k, e in self.reg.entries.items() if e.pins or e.status is BlockStatus.STORING}
        at_share = self.reg.owned.get(owner, 0) >= 3
        slot = self.reg.prepare_store(h, parent, owner)
        if slot is None:
            assert at_share or self.reg.pool.num_free == 0
            return
        assert held <= set(self.reg.entries), "a pinned or in-flight block was evicted"
        if at_share:
            assert others <= set(self.reg.entries), "an owner at its share evicted another owner's block"


TestSharedRegistry = SharedRegistryMachine.TestCase
TestSharedRegistry.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class DepotMachine(RuleBasedStateMachine):
    """An engine double with up to three requests over a few shared prompts and a small host tier."""

    def __init__(self) -> None:
        super().__init__()
        block = layout().block_bytes  # reclaim() keeps 2 of the 6 host slots free
        self.sim = Sim(UpdateStyle.VLLM, depot=Depot(DepotConfig(host_bytes=6 * block, slab_bytes=4 * block, free_reserve_fraction=1 / 3)))
        self.reqs: dict[str, dict] = {}  # rid -> {tokens, sent, computed, table, running}
        self.next_block = 0
        self.released: list[str] = []
        self.delayed: dict[str, int] = {}  # rid -> finishes answered with delay_free

    def _blocks(self, n: int) -> list[int]:
        out = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return out

    @rule(rid=st.sampled_from(["a", "b", "c"]), base=st.sampled_from([1, 1, 500]), n=st.integers(1, 80), L_blocks=st.integers(0, 3), use_lookup=st.booleans())
    def admit(self, rid: str, base: int, n: int, L_blocks: int, use_lookup: bool) -> None:
        r = self.reqs.get(rid)
        if r is not None and r["running"]:
            return
        toks = r["tokens"] if r is not None else prompt(n, start=base)
        L = min(L_blocks * BS, (len(toks) - 1) // BS * BS)
        E = self.sim.lookup(rid, toks, L=L) if use_lookup else 0
        C = L + E
        S = len(toks) - C
        table = self._blocks((len(toks) + BS - 1) // BS)
        slot = self.sim.depot.engines[self.sim.engine].slots.get(rid)
        try:
            self.sim.step(self.sim.new(rid, toks, L=L, E=E, S=S, table=table))
        except FailedPrecondition:
            assert slot is not None and slot.phase.value == "FINISHING"  # ids are not reused while finishing
            self.sim.step_no -= 1
            self.sim.step(finished=[rid])  # the engine drops the request again
            return
        self.reqs[rid] = {"tokens": toks, "sent": len(toks), "computed": C + S, "table": table, "running": True}

    @rule(rid=st.sampled_from(["a", "b", "c"]))
    def decode(self, rid: str) -> None:
        r = self.reqs.get(rid)
        if r is None or not r["running"]:
            return
        C = r["computed"]
        new_tok = 7000 + C
        r["tokens"].append(new_tok)
        blocks = self._blocks(1) if C % BS == 0 else []
        r["table"] += blocks
        self.sim.step(self.sim.cached(rid, C=C, S=1, tokens=[new_tok], blocks=blocks))
        r["computed"] = C + 1
        r["sent"] += 1

    @rule(rid=st.sampled_from(["a", "b", "c"]))
    def finish(self, rid: str) -> None:
        r = self.reqs.pop(rid, None)
        if r is None:
            return
        plan = self.sim.step(finished=[rid])
        if rid in plan.delay_free:
            self.delayed[rid] = self.delayed.get(rid, 0) + 1

    @rule(rid=st.sampled_from(["a", "b", "c"]))
    def preempt(self, rid: str) -> None:
        r = self.reqs.get(rid)
        if r is None or not r["running"]:
            return
        self.sim.step(preempted=[rid])
        r["running"] = False

    @rule()
    def forward_done(self) -> None:
        self.sim.forward_done()

    @rule(fail=st.sets(st.integers(0, 5), max_size=2))
    def copies(self, fail: set[int]) -> None:
        self.sim.run_copies(fail)

    @rule()
    def reclaim(self) -> None:  # the service's background eviction, between any two engine calls
        self.sim.depot.reclaim()
        pool = self.sim.depot.engines[self.sim.engine].domain.registry.pool
        assert pool.capacity_blocks - pool.num_used >= 2 or not self.sim.depot.reclaim()

    @rule(ms=st.integers(0, 40_000))
    def time_passes(self, ms: int) -> None:
        self.sim.now += ms
        self.sim.depot.renew_lease(self.sim.engine, self.sim.now)
        self.sim.depot.expire(self.sim.now)
        self.sim.run_copies()

    @rule(rid=st.sampled_from(["a", "b", "zz"]), C=st.integers(0, 200), S=st.integers(0, 50))
    def bad_update_changes_nothing(self, rid: str, C: int, S: int) -> None:
        d = self.sim.depot
        before = (len(d.ops.ops), {r: len(s.states) for r, s in d.engines[self.sim.engine].slots.items()})
        try:
            self.sim.step(self.sim.cached(rid, C=C + 10_000, S=S))
        except DepotError:
            self.sim.step_no -= 1
        after = (len(d.ops.ops), {r: len(s.states) for r, s in d.engines[self.sim.engine].slots.items()})
        assert before == after

    @invariant()
    def invariants(self) -> None:
        d = self.sim.depot
        d.check_invariants()
        stored: dict[int, int] = {}
        for e in self.sim.events:
            if isinstance(e, OpCompleted) and e.op.kind is OpKind.STORE:
                for i, h in zip(e.op.block_indices, e.op.hashes):
                    if i not in e.op.failed:
                        stored[h] = stored.get(h, 0) + 1
        reg = d.engines[self.sim.engine].domain.registry
        # A hash is stored again only after it left the tier (evicted, or dropped as corrupt), never while resident.
        for h, n in stored.items():
            if n > 1:
                assert reg.evictions > 0 or d.counters["checksum_failures"] > 0
        # Each finish answered with delay_free is released exactly once, when its slot goes.
        released = [e.request_id for e in self.sim.events if isinstance(e, RequestReleased)]
        slots = d.engines[self.sim.engine].slots
        for rid, n in self.delayed.items():
            got = released.count(rid)
            finishing = rid in slots and slots[rid].phase.value == "FINISHING"
            assert got == n - finishing, (rid, got, n, finishing)
        assert set(released) <= set(self.delayed)


TestDepot = DepotMachine.TestCase
TestDepot.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)


class DiskDepotMachine(DepotMachine):
    """The same engine double over a 6-block host tier and a 6-block disk tier (write-back past
    half full, admitting every block; the host tier is sometimes cleared, so that lookups find
    blocks only on disk): disk jobs end in any order, some failing or corrupt."""

    def __init__(self) -> None:
        super().__init__()
        block = layout().block_bytes
        conf = DepotConfig(
            host_bytes=6 * block, slab_bytes=2 * block, disk_bytes=6 * disk_record_bytes(block),
            disk_slab_bytes=3 * disk_record_bytes(block), disk=DiskConfig(watermark=0.5, job_blocks=2, admit_after=1),
            free_reserve_fraction=1 / 3,
        )
        self.sim = Sim(UpdateStyle.VLLM, depot=Depot(conf))
        self.pending: list[DiskJob] = []

    @rule(flush=st.booleans())
    def disk_jobs_start(self, flush: bool) -> None:
        self.pending += self.sim.depot.take_disk_jobs(self.sim.now, flush)
        self.sim.depot.take_disk_drops()

    @rule(pick=st.integers(0, 7), fail=st.booleans(), corrupt=st.booleans())
    def disk_job_ends(self, pick: int, fail: bool, corrupt: bool) -> None:
        if not self.pending:
            return
        job = self.pending.pop(pick % len(self.pending))
        first = {job.items[0].hash}
        self.sim.depot.disk_job_done(job.job_id, first if fail else set(), first if corrupt else set())
        self.sim.run_copies()

    @rule()
    def quiet_period(self) -> None:
        """Every forward reported, every copy and disk job done (so later lookups can hit the disk)."""
        self.sim.forward_done()
        for _ in range(3):
            self.disk_jobs_start(flush=False)
            while self.pending:
                self.disk_job_ends(0, fail=False, corrupt=False)

    @rule()
    def clear_host(self) -> None:
        self.sim.depot.clear(host=True, disk=False)

    @rule(rid=st.sampled_from(["a", "b", "c"]), base=st.sampled_from([1, 500]), n=st.integers(17, 80))
    def prompt_back_from_disk(self, rid: str, base: int, n: int) -> None:
        """A random walk rarely lines up store, write, host loss and a lookup; this rule does, and
        leaves the read to the other rules (it may fail, come back corrupt, or outlive the load)."""
        self.quiet_period()
        self.clear_host()
        self.admit(rid, base, n, L_blocks=0, use_lookup=True)


TestDiskDepot = DiskDepotMachine.TestCase
TestDiskDepot.settings = settings(max_examples=120, stateful_step_count=50, deadline=None)


class RemoteDepotMachine(DepotMachine):
    """The same engine double over a 6-block host tier and a remote store (a set of hashes here) that
    goes down and up, loses blocks behind the daemon's back and answers jobs in any order, some of
    their blocks failing or corrupt; lookups are extended by what it holds, as the runtime does."""

    def __init__(self) -> None:
        super().__init__()
        block = layout().block_bytes
        conf = DepotConfig(
            host_bytes=6 * block, slab_bytes=2 * block, free_reserve_fraction=1 / 3, disk=DiskConfig(admit_after=1),
            remote=RemoteConfig(enabled=True, queue_blocks=4, job_blocks=2, jobs_in_flight=2),
        )
        self.sim = Sim(UpdateStyle.VLLM, depot=Depot(conf))
        self.sim.depot.set_remote_up(True)
        self.held: set[int] = set()
        self.pending: list[RemoteJob] = []
        sim = self.sim

        def lookup(rid: str, tokens: list[int], L: int = 0) -> int:
            res = sim.depot.lookup(sim.engine, RequestId(rid), tokens_to_bytes(tokens), cache_salt="", lora_name="",
                                   device_matched_tokens=L, pin_ms=0, now_ms=sim.now)
            if not res.remote_query:
                return res.matched_tokens
            found = 0
            while found < len(res.remote_query) and res.remote_query[found] in self.held:
                found += 1
            pin = sim.depot.engines[sim.engine].pins.get(RequestId(rid))
            return sim.depot.extend_lookup(sim.engine, RequestId(rid), pin, res, found).matched_tokens

        sim.lookup = lookup  # type: ignore[method-assign]

    @rule()
    def remote_jobs_start(self) -> None:
        self.pending += self.sim.depot.take_remote_jobs()

    @rule(pick=st.integers(0, 7), fail=st.booleans(), corrupt=st.booleans())
    def remote_job_ends(self, pick: int, fail: bool, corrupt: bool) -> None:
        if not self.pending:
            return
        job = self.pending.pop(pick % len(self.pending))
        hs = {it.hash for it in job.items}
        first = {job.items[0].hash}
        if job.kind is RemoteJobKind.WRITE:
            present = hs & self.held
            self.held |= hs - (first if fail else set())
            self.sim.depot.remote_job_done(job.job_id, first if fail else set(), set(), present)
        else:
            missing = (hs - self.held) | (first if fail else set())
            self.sim.depot.remote_job_done(job.job_id, missing, (first if corrupt else set()) - missing, set())
        self.sim.run_copies()

    @rule(up=st.booleans())
    def store_up_or_down(self, up: bool) -> None:
        self.sim.depot.set_remote_up(up)

    @rule(pick=st.integers(0, 1000))
    def store_loses_a_block(self, pick: int) -> None:
        if self.held:
            self.held.discard(sorted(self.held)[pick % len(self.held)])

    @rule()
    def quiet_period(self) -> None:
        self.sim.forward_done()
        self.sim.run_copies()
        for _ in range(4):
            self.remote_jobs_start()
            while self.pending:
                self.remote_job_ends(0, fail=False, corrupt=False)

    @rule(rid=st.sampled_from(["a", "b", "c"]), base=st.sampled_from([1, 500]), n=st.integers(17, 80))
    def prompt_back_from_the_store(self, rid: str, base: int, n: int) -> None:
        """Written, gone from the host tier, looked up again: the read is left to the other rules."""
        self.quiet_period()
        self.sim.depot.clear(host=True, disk=False)
        self.admit(rid, base, n, L_blocks=0, use_lookup=True)


TestRemoteDepot = RemoteDepotMachine.TestCase
TestRemoteDepot.settings = settings(max_examples=120, stateful_step_count=50, deadline=None)


def test_owner_heaps_do_not_grow_with_touches() -> None:
    """Every touch offers a block again; the stale offers of an owner's heap are pruned as the global
    heap's are compacted, so a long-running daemon's heaps stay near the number of blocks."""
    reg = BlockRegistry(BlockPool("c", 100, SlabBudget(total_bytes=800, slab_bytes=300)), owner_share=0.5)
    for h in (1, 2, 3):
        assert reg.prepare_store(BlockHash(h), None, "a") is not None
        reg.complete_store(BlockHash(h), True)
    for _ in range(20_000):
        reg.touch([BlockHash(1), BlockHash(2), BlockHash(3)])
    assert len(reg._policy) <= 4 * 3 + 1024 + 3 and len(reg._owner_policies["a"]) <= 4 * 3 + 1024 + 3
    assert reg.prepare_store(BlockHash(4), None, "a") is not None  # at its share (3): its LRU block went
    assert BlockHash(1) not in reg.entries and reg.owned == {"a": 3}
    reg.check_invariants()


def test_evictions_of_blocks_never_hit_are_counted_apart() -> None:
    """A full tier whose evicted blocks had served lookups is healthy; one that evicts blocks
    nothing ever asked for again is thrashing (or sees no reuse): KvdepotHostTierThrashing."""
    reg = BlockRegistry(BlockPool("c", 100, SlabBudget(total_bytes=300, slab_bytes=300)))  # 3 cells
    for h in (1, 2, 3):
        assert reg.prepare_store(BlockHash(h), None) is not None
        reg.complete_store(BlockHash(h), True)
    assert reg.match_and_pin([BlockHash(1)]) == 1
    reg.unpin(BlockHash(1))
    reg.touch([BlockHash(1)])
    assert reg.prepare_store(BlockHash(4), None) is not None  # evicts 2: never hit
    assert (reg.evictions, reg.evicted_unhit) == (1, 1)
    reg.touch([BlockHash(3), BlockHash(4)])
    assert reg.prepare_store(BlockHash(5), None) is not None  # evicts 1: it served a lookup
    assert (reg.evictions, reg.evicted_unhit) == (2, 1)
    reg.check_invariants()
