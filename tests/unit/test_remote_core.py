"""The core's remote tier: writes behind admission through a bounded queue, lookups extended by
what the store holds, loads staged from the store, and every way a store read can go wrong."""

from __future__ import annotations

from kvdepot.hashing import BlockHash, block_hashes, salt_hash, scope_seed, tokens_to_bytes
from kvdepotd.core.depot import Depot, DepotConfig
from kvdepotd.core.ops import OpKind, RequestId
from kvdepotd.core.records import LookupResult
from kvdepotd.core.remote import RemoteConfig, RemoteJob, RemoteJobKind
from kvdepotd.core.slots import BlockState

from .sim import BS, Sim, layout, prompt

BLOCK = layout().block_bytes


def remote_sim(host_blocks: int = 64, admit_after: int = 1, up: bool = True, **cfg: object) -> Sim:
    from kvdepotd.core.disk import DiskConfig

    conf = DepotConfig(
        host_bytes=host_blocks * BLOCK,
        slab_bytes=4 * BLOCK,
        disk=DiskConfig(admit_after=admit_after),
        remote=RemoteConfig(enabled=True, **cfg),  # type: ignore[arg-type]
    )
    sim = Sim(depot=Depot(conf))
    sim.depot.set_remote_up(up)
    return sim


def hashes(tokens: list[int]) -> list[BlockHash]:
    return block_hashes(tokens_to_bytes(tokens), BS, scope_seed(salt_hash(), "", "m"))


class Store:
    """What the remote store holds: the jobs the core hands out are run against it."""

    def __init__(self) -> None:
        self.held: set[BlockHash] = set()
        self.writes = 0

    def run(self, sim: Sim, fail: set[BlockHash] = frozenset(), corrupt: set[BlockHash] = frozenset()) -> list[RemoteJob]:  # type: ignore[assignment]
        done: list[RemoteJob] = []
        while jobs := sim.depot.take_remote_jobs():
            for job in jobs:
                hs = {it.hash for it in job.items}
                if job.kind is RemoteJobKind.WRITE:
                    present = hs & self.held
                    self.writes += len(hs - present - fail)
                    self.held |= hs - fail
                    sim.depot.remote_job_done(job.job_id, hs & fail, set(), present)
                else:
                    missing = (hs - self.held) | (hs & fail)
                    sim.depot.remote_job_done(job.job_id, missing, hs & corrupt - missing, set(), "missing" if missing else "")
                done.append(job)
            sim.depot.check_invariants()
        return done

    def lookup(self, sim: Sim, rid: str, tokens: list[int], L: int = 0) -> LookupResult:
        """Depot.lookup, then the remote extension as the runtime does it."""
        eng = sim.depot.engines[sim.engine]
        res = sim.depot.lookup(sim.engine, RequestId(rid), tokens_to_bytes(tokens), cache_salt="", lora_name="", device_matched_tokens=L, pin_ms=0, now_ms=sim.now)
        pin = eng.pins.get(RequestId(rid))
        found = 0
        while found < len(res.remote_query) and res.remote_query[found] in self.held:
            found += 1
        out = sim.depot.extend_lookup(sim.engine, RequestId(rid), pin, res, found) if res.remote_query else res
        sim.depot.check_invariants()
        return out


def stored_and_written(toks: list[int], **cfg: object) -> tuple[Sim, Store]:
    """A daemon stored `toks` and wrote its blocks to the store; then a second daemon (a fresh Sim)
    with empty tiers sees the same store."""
    a = remote_sim(**cfg)  # type: ignore[arg-type]
    store = Store()
    a.prefill_and_store("a", toks)
    store.run(a)
    return remote_sim(**cfg), store  # type: ignore[arg-type]


def test_stored_blocks_are_written_once_and_a_second_daemon_is_served_them() -> None:
    toks = prompt(100)
    b, store = stored_and_written(toks)
    assert store.writes == 6
    res = store.lookup(b, "b", toks)
    assert (res.matched_tokens, res.remote_tokens, res.host_tokens, res.disk_tokens) == (96, 96, 0, 0)
    plan = b.step(b.new("b", toks, E=96, S=4, table=list(range(200, 207))))
    load = next(op for op in plan.ops if op.kind is OpKind.LOAD)
    assert load.held and b.depot.take_ready() == []  # nothing is copied into the engine before the read
    jobs = store.run(b)
    assert [j.kind for j in jobs] == [RemoteJobKind.READ] and sum(len(j.items) for j in jobs) == 6
    b.run_copies()
    assert all(op.success for op in b.completed(OpKind.LOAD))
    assert b.states("b")[:6] == [BlockState.LOADED] * 6
    assert b.resident(toks) == 6  # the staged blocks stay in b's host tier
    c = b.depot.all_counters()
    assert (c["remote_read_blocks"], c["lookup_remote_hit_tokens"], c["remote_written_blocks"]) == (6, 96, 0)
    b.depot.check_invariants()


def test_blocks_the_store_holds_or_that_were_just_read_are_not_written_again() -> None:
    toks = prompt(100)
    b, store = stored_and_written(toks)
    store.lookup(b, "b", toks)
    b.step(b.new("b", toks, E=96, S=4, table=list(range(200, 207))))
    store.run(b)
    b.run_copies()
    b.prefill_and_store("c", toks + [9] * 30)  # the loaded blocks are sighted again, and two new blocks
    jobs = store.run(b)
    assert [it.hash for j in jobs for it in j.items] == hashes(toks + [9] * 30)[6:8]
    assert store.writes == 8


def test_a_block_the_store_already_holds_is_counted_and_remembered() -> None:
    toks = prompt(64)
    b, store = stored_and_written(toks)
    b.prefill_and_store("b", toks)  # b computed the same blocks: its writer finds them there
    store.run(b)
    c = b.depot.all_counters()
    assert (c["remote_write_skipped_blocks"], c["remote_written_blocks"]) == (4, 0)
    b.prefill_and_store("c", toks)
    assert b.depot.take_remote_jobs() == []  # known now: not queued again


def test_writes_follow_the_admission_rule() -> None:
    sim = remote_sim(admit_after=2)
    store = Store()
    toks = prompt(64)
    sim.prefill_and_store("a", toks)
    assert store.run(sim) == []
    sim.prefill_and_store("b", toks)
    assert sum(len(j.items) for j in store.run(sim)) == 4


def test_a_full_queue_drops_and_counts_and_pins_nothing() -> None:
    sim = remote_sim(queue_blocks=3, jobs_in_flight=1, job_blocks=2)
    sim.prefill_and_store("a", prompt(100))  # 6 blocks offered, 3 queued
    c = sim.depot.all_counters()
    assert (c["remote_queued_blocks"], c["remote_dropped_queue_full_blocks"]) == (3, 3)
    jobs = sim.depot.take_remote_jobs()
    assert [len(j.items) for j in jobs] == [2]  # one job in flight at a time
    sim.depot.check_invariants()  # the job pins its host blocks, nothing else does
    assert sim.depot.stats().remote_queue_blocks == 1


def test_writes_are_dropped_while_the_store_is_down_and_flow_again_when_it_is_back() -> None:
    sim = remote_sim(up=False)
    store = Store()
    sim.prefill_and_store("a", prompt(64))
    assert store.run(sim) == []
    assert sim.depot.all_counters()["remote_dropped_store_down_blocks"] == 4
    sim.depot.set_remote_up(True)
    sim.prefill_and_store("b", prompt(64, start=500))
    assert sum(len(j.items) for j in store.run(sim)) == 4


def test_going_down_drops_the_queue() -> None:
    sim = remote_sim(jobs_in_flight=1, job_blocks=1)
    sim.prefill_and_store("a", prompt(64))
    assert len(sim.depot.take_remote_jobs()) == 1
    sim.depot.set_remote_up(False)
    assert sim.depot.stats().remote_queue_blocks == 0
    assert sim.depot.all_counters()["remote_dropped_store_down_blocks"] == 3


def test_a_block_evicted_from_host_before_its_write_is_counted() -> None:
    sim = remote_sim()
    sim.prefill_and_store("a", prompt(64))
    sim.depot.clear(host=True, disk=False)
    assert sim.depot.take_remote_jobs() == []
    assert sim.depot.all_counters()["remote_dropped_evicted_blocks"] == 4


def test_no_remote_query_while_the_store_is_down_or_when_local_tiers_hold_everything() -> None:
    toks = prompt(100)
    sim = remote_sim(up=False)
    sim.prefill_and_store("a", toks)
    assert sim.depot.lookup(sim.engine, RequestId("x"), tokens_to_bytes(prompt(100, start=7)), cache_salt="", lora_name="",
                            device_matched_tokens=0, pin_ms=0, now_ms=sim.now).remote_query == ()
    sim.depot.set_remote_up(True)
    res = sim.depot.lookup(sim.engine, RequestId("b"), tokens_to_bytes(toks), cache_salt="", lora_name="", device_matched_tokens=0, pin_ms=0, now_ms=sim.now)
    assert res.matched_tokens == 96 and res.remote_query == ()


def test_the_match_runs_host_then_remote_and_stops_at_the_first_block_no_tier_holds() -> None:
    toks = prompt(160)  # 10 blocks, 9 on offer (the last token is never offered)
    b, store = stored_and_written(toks)
    hs = hashes(toks)
    b.prefill_and_store("local", toks[: 2 * BS])  # blocks 0-1 in b's host tier
    store.held.discard(hs[6])  # the store lost block 6: blocks 2-5 from it, the rest recomputed
    res = store.lookup(b, "b", toks)
    assert (res.matched_tokens, res.host_tokens, res.remote_tokens) == (6 * BS, 2 * BS, 4 * BS)
    assert b.depot.engines[b.engine].pins[RequestId("b")].hashes == hs[:6]
    store.lookup(b, "z", prompt(64, start=900))  # nothing anywhere: asked, missed
    c = b.depot.all_counters()
    assert (c["remote_lookups"], c["remote_lookup_hits"]) == (2, 1)


def test_a_lookup_without_any_hit_keeps_no_pin() -> None:
    b, store = stored_and_written(prompt(64))
    res = store.lookup(b, "z", prompt(64, start=900))
    assert res.matched_tokens == 0 and RequestId("z") not in b.depot.engines[b.engine].pins


def test_a_repeated_lookup_replaces_the_pin_and_the_stale_answer_does_not_extend_it() -> None:
    toks = prompt(100)
    b, store = stored_and_written(toks)
    eng = b.depot.engines[b.engine]
    res1 = b.depot.lookup(b.engine, RequestId("b"), tokens_to_bytes(toks), cache_salt="", lora_name="", device_matched_tokens=0, pin_ms=0, now_ms=b.now)
    pin1 = eng.pins[RequestId("b")]
    store.lookup(b, "b", toks)  # a retry answered first
    stale = b.depot.extend_lookup(b.engine, RequestId("b"), pin1, res1, 6)
    assert stale.matched_tokens == 0 and len(eng.pins[RequestId("b")].hashes) == 6
    b.depot.check_invariants()


def test_missing_corrupt_and_failed_store_reads_fail_only_those_blocks_and_the_engine_recomputes() -> None:
    toks = prompt(160)
    b, store = stored_and_written(toks)
    hs = hashes(toks)
    store.lookup(b, "b", toks)
    b.step(b.new("b", toks, E=144, S=16, table=list(range(200, 210))))
    store.held.discard(hs[3])  # evicted between the lookup and the read
    store.run(b, corrupt={hs[5]}, fail={hs[7]})
    b.run_copies()
    failed = set().union(*(op.failed for op in b.completed(OpKind.LOAD)))
    assert failed == {3, 5, 7}
    states = b.states("b")
    assert states[3] is BlockState.LOAD_FAILED and states[0] is BlockState.LOADED
    c = b.depot.all_counters()
    assert (c["remote_read_blocks"], c["remote_read_failed_blocks"], c["remote_checksum_failures"]) == (6, 2, 1)
    assert b.resident(toks) == 3  # blocks 0-2 staged and kept; 3 failed, so the prefix stops there
    b.depot.check_invariants()


def test_a_load_that_ends_while_its_store_read_runs_keeps_the_cell_until_the_read_returns() -> None:
    toks = prompt(100)
    b, store = stored_and_written(toks)
    store.lookup(b, "b", toks)
    b.step(b.new("b", toks, E=96, S=4, table=list(range(200, 207))))
    jobs = b.depot.take_remote_jobs()
    b.now += 31_000
    b.depot.expire(b.now)  # the op's deadline passes while the store is read
    b.events += b.depot.take_events()
    assert not b.completed(OpKind.LOAD)[0].success
    dom = b.depot.engines[b.engine].domain
    storing = {h for h, e in dom.registry.entries.items() if e.status.name == "STORING"}
    assert storing == set(hashes(toks)[:6])  # the cells the read writes into are not reused
    b.depot.reclaim()
    assert {h for h, e in dom.registry.entries.items() if e.status.name == "STORING"} == storing
    for job in jobs:
        b.depot.remote_job_done(job.job_id, set(), set(), set())
    b.depot.check_invariants()
    assert b.resident(toks) == 6


def test_two_loads_of_one_remote_prefix_share_one_read() -> None:
    toks = prompt(100)
    b, store = stored_and_written(toks)
    store.lookup(b, "b", toks)
    store.lookup(b, "c", toks + [7])
    b.step(
        b.new("b", toks, E=96, S=4, table=list(range(200, 207))),
        b.new("c", toks + [7], E=96, S=5, table=list(range(300, 307))),
    )
    jobs = store.run(b)
    assert sum(len(j.items) for j in jobs) == 6
    b.run_copies()
    assert [op.success for op in b.completed(OpKind.LOAD)] == [True, True]


def test_a_remote_tier_is_off_unless_configured() -> None:
    sim = Sim(depot=Depot(DepotConfig(host_bytes=64 * BLOCK, slab_bytes=4 * BLOCK)))
    sim.depot.set_remote_up(True)
    sim.prefill_and_store("a", prompt(64))
    assert sim.depot.take_remote_jobs() == [] and sim.depot.all_counters()["remote_queued_blocks"] == 0


def test_two_layout_classes_of_one_model_stage_the_same_hashes_apart() -> None:
    """Engines of one model with other layouts (TP 1 and TP 2) compute the same block hashes, held
    in two pools: their reads of the same hash at once are two reads, each landing in its own pool."""
    from kvdepotd.core.disk import DiskConfig

    depot = Depot(DepotConfig(host_bytes=128 * BLOCK, slab_bytes=4 * BLOCK, disk=DiskConfig(admit_after=1), remote=RemoteConfig(enabled=True)))
    depot.set_remote_up(True)
    tp1, tp2 = Sim(depot=depot, name="tp1"), Sim(depot=depot, name="tp2", world_size=2)
    assert depot.engines[tp1.engine].domain is not depot.engines[tp2.engine].domain
    toks = prompt(100)
    store = Store()
    store.held = set(hashes(toks))
    assert store.lookup(tp1, "x", toks).remote_tokens == 96 and store.lookup(tp2, "y", toks).remote_tokens == 96
    tp1.step(tp1.new("x", toks, E=96, S=4, table=list(range(200, 207))))
    tp2.step(tp2.new("y", toks, E=96, S=4, table=list(range(300, 307))))
    jobs = store.run(tp1)
    assert sorted(j.layout_class for j in jobs) == sorted({depot.engines[s.engine].domain.layout_class for s in (tp1, tp2)})
    tp1.run_copies()
    tp2.run_copies()
    loads = tp1.completed(OpKind.LOAD) + tp2.completed(OpKind.LOAD)  # (one depot: either sim may take both's events)
    assert sorted(op.engine_id for op in loads) == [tp1.engine, tp2.engine] and all(op.success for op in loads)
    depot.check_invariants()


def test_a_block_being_written_is_not_queued_again() -> None:
    sim = remote_sim(jobs_in_flight=1, job_blocks=8)
    toks = prompt(64)
    sim.prefill_and_store("a", toks)
    (job,) = sim.depot.take_remote_jobs()
    sim.prefill_and_store("b", toks)  # sighted again while its write runs
    assert sim.depot.stats().remote_queue_blocks == 0
    sim.depot.remote_job_done(job.job_id, set(), set(), set())
    assert sim.depot.take_remote_jobs() == [] and sim.depot.all_counters()["remote_written_blocks"] == 4


def test_a_lookup_that_misses_in_the_store_makes_every_later_block_writable_again() -> None:
    """The store lost the prompt (FLUSHALL, a primary restarted empty, its LRU): a daemon that knew
    it was there asks, misses at block 0, recomputes, and one round puts back every block, not the
    first alone (today's defect: 1 of 64 per round)."""
    toks = prompt(64 * BS + 1)
    b, store = stored_and_written(toks)
    store.lookup(b, "b", toks)  # b learns the store holds all 64...
    b.step(b.new("b", toks, E=64 * BS, S=1, table=list(range(300, 365))))
    store.run(b)
    b.run_copies()
    b.step(finished=["b"])
    assert len(b.depot.remote.known) == 64
    store.held.clear()  # ...then the store loses everything
    b.depot.clear(host=True, disk=False)  # and so does b: it must recompute
    res = store.lookup(b, "again", toks)
    assert res.matched_tokens == 0
    b.prefill_and_store("again", toks)
    jobs = store.run(b)
    assert sum(len(j.items) for j in jobs) == 64 and len(store.held) == 64


def test_a_block_known_in_the_store_is_asked_about_again_after_recheck_ms_and_put_back_when_lost() -> None:
    toks = prompt(64)
    sim = remote_sim(recheck_ms=5_000)
    store = Store()
    sim.prefill_and_store("a", toks)
    store.run(sim)
    sim.prefill_and_store("b", toks)  # known, and recently: not asked about
    assert sim.depot.take_remote_jobs() == []
    sim.now += 6_000
    sim.prefill_and_store("c", toks)  # known, but long ago: its write job asks the store first
    store.run(sim)
    c = sim.depot.all_counters()
    assert (c["remote_write_skipped_blocks"], c["remote_relearned_blocks"], store.writes) == (4, 0, 4)
    store.held.clear()  # the store loses them: the next use past recheck_ms writes them again
    sim.now += 6_000
    sim.prefill_and_store("d", toks)
    store.run(sim)
    c = sim.depot.all_counters()
    assert (c["remote_relearned_blocks"], store.writes, len(store.held)) == (4, 8, 4)


def test_a_lookups_store_hits_are_read_before_the_step_and_its_load_waits_on_those_reads() -> None:
    toks = prompt(100)
    b, store = stored_and_written(toks, prefetch=True)
    store.lookup(b, "b", toks)
    jobs = b.depot.take_remote_jobs()  # the reads start at the Lookup...
    assert [j.kind for j in jobs] == [RemoteJobKind.READ] and sum(len(j.items) for j in jobs) == 6
    assert b.depot.all_counters()["remote_prefetched_blocks"] == 6
    plan = b.step(b.new("b", toks, E=96, S=4, table=list(range(200, 207))))  # ...and the Step comes while they run
    load = next(op for op in plan.ops if op.kind is OpKind.LOAD)
    assert load.held and b.depot.take_remote_jobs() == []  # no second read: it waits on the Lookup's
    for j in jobs:
        b.depot.remote_job_done(j.job_id, set(), set(), set())
    b.run_copies()
    assert all(op.success for op in b.completed(OpKind.LOAD)) and b.states("b")[:6] == [BlockState.LOADED] * 6
    b.depot.check_invariants()


def test_prefetched_blocks_that_arrived_are_loaded_from_the_host_tier_and_a_failed_prefetch_is_read_again() -> None:
    toks = prompt(100)
    hs = hashes(toks)
    b, store = stored_and_written(toks, prefetch=True)
    store.lookup(b, "b", toks)
    store.run(b, fail={hs[4]})  # the Lookup's reads: all but block 4 arrive
    assert b.resident(toks) == 4
    plan = b.step(b.new("b", toks, E=96, S=4, table=list(range(200, 207))))
    jobs = store.run(b)  # the load reads block 4 itself: only what did not arrive
    assert [it.hash for j in jobs for it in j.items] == [hs[4]]
    b.run_copies()
    assert all(op.success for op in b.completed(OpKind.LOAD)) and len(plan.ops) >= 1
    b.depot.check_invariants()


def test_no_prefetch_by_default() -> None:
    toks = prompt(100)
    b, store = stored_and_written(toks)
    store.lookup(b, "b", toks)
    assert b.depot.take_remote_jobs() == []
