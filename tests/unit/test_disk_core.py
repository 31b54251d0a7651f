"""The core's disk tier: admission, write-back/through, mixed-tier lookups, staging loads."""

from __future__ import annotations

from kvdepot.hashing import block_hashes, salt_hash, scope_seed, tokens_to_bytes
from kvdepotd.core.depot import Depot, DepotConfig
from kvdepotd.core.disk import DiskConfig, DiskJob, DiskJobKind, disk_record_bytes
from kvdepotd.core.ops import OpKind, RequestId
from kvdepotd.core.slots import BlockState

from .sim import BS, Sim, blocks_of, layout, prompt

BLOCK = layout().block_bytes


def disk_sim(host_blocks: int = 64, disk_blocks: int = 64, **cfg: object) -> Sim:
    """`cfg`: DiskConfig's fields, each named with a disk_ prefix (disk_policy=...)."""
    conf = DepotConfig(
        host_bytes=host_blocks * BLOCK,
        slab_bytes=4 * BLOCK,
        disk_bytes=disk_blocks * disk_record_bytes(BLOCK),
        disk_slab_bytes=8 * disk_record_bytes(BLOCK),
        disk=DiskConfig(**{k.removeprefix("disk_"): v for k, v in cfg.items()}),  # type: ignore[arg-type]
    )
    return Sim(depot=Depot(conf))


def hashes(tokens: list[int]) -> list[int]:
    return block_hashes(tokens_to_bytes(tokens), BS, scope_seed(salt_hash(), "", "m"))


def run_disk(sim: Sim, fail: set[int] = frozenset(), corrupt: set[int] = frozenset()) -> list[DiskJob]:  # type: ignore[assignment]
    """Runs every disk job the core hands out (the given hashes fail or come back corrupt)."""
    done: list[DiskJob] = []
    while jobs := sim.depot.take_disk_jobs(sim.now):
        for job in jobs:
            hs = {it.hash for it in job.items}
            sim.depot.disk_job_done(job.job_id, hs & set(fail), hs & set(corrupt))
            done.append(job)
        sim.depot.check_invariants()
    return done


def on_disk(sim: Sim, tokens: list[int]) -> int:
    disk = sim.depot.engines[sim.engine].domain.disk
    assert disk is not None
    return disk.lookup(hashes(tokens))


def only_on_disk(toks: list[int], **cfg: object) -> Sim:
    """A depot whose disk tier holds `toks`'s blocks (stored, written through) and whose host tier does not."""
    sim = disk_sim(**{"disk_policy": "write-through", "disk_admit_after": 1, **cfg})  # type: ignore[arg-type]
    sim.prefill_and_store("a", toks)
    run_disk(sim)
    sim.depot.clear(host=True, disk=False)
    return sim


def written(jobs: list[DiskJob]) -> int:
    return sum(len(j.items) for j in jobs if j.kind is DiskJobKind.WRITE)


def test_write_through_admitting_everything_writes_each_stored_block_once() -> None:
    sim = disk_sim(disk_policy="write-through", disk_admit_after=1)
    toks = prompt(100)
    sim.prefill_and_store("a", toks)
    assert written(run_disk(sim)) == 6
    assert on_disk(sim, toks) == 6
    sim.prefill_and_store("b", toks)  # every block already cached: nothing is written again
    assert written(run_disk(sim)) == 0
    assert sim.depot.all_counters()["disk_written_blocks"] == 6


def test_admission_needs_the_configured_number_of_sightings() -> None:
    sim = disk_sim(disk_policy="write-through", disk_admit_after=2)
    toks = prompt(64)
    sim.prefill_and_store("a", toks)
    assert run_disk(sim) == []
    assert sim.depot.all_counters()["disk_rejected_blocks"] == 4
    sim.prefill_and_store("b", toks)  # seen a second time: admitted
    assert written(run_disk(sim)) == 4
    assert sim.depot.all_counters()["disk_admitted_blocks"] == 4


def test_admission_window_forgets_old_sightings() -> None:
    sim = disk_sim(disk_policy="write-through", disk_admit_after=2, disk_admit_window_ms=1000)
    toks = prompt(64)
    sim.prefill_and_store("a", toks)
    sim.now += 5000
    sim.prefill_and_store("b", toks)  # the first sighting is out of the window
    assert run_disk(sim) == []


def test_write_back_waits_for_the_watermark() -> None:
    sim = disk_sim(host_blocks=16, disk_admit_after=1)  # write-back by default
    sim.prefill_and_store("a", prompt(8 * BS, start=1))  # 8 of 16 blocks: under 80%
    assert run_disk(sim) == []
    sim.prefill_and_store("b", prompt(6 * BS, start=1000))  # 14 of 16: past it
    assert written(run_disk(sim)) == 14


def test_clean_shutdown_flush_writes_what_write_back_held() -> None:
    sim = disk_sim(host_blocks=16, disk_admit_after=1)
    sim.prefill_and_store("a", prompt(4 * BS))
    assert sim.depot.take_disk_jobs(sim.now) == []
    jobs = sim.depot.take_disk_jobs(sim.now, flush=True)
    assert sum(len(j.items) for j in jobs) == 4


def test_evicted_from_host_is_a_disk_hit_staged_through_the_host_tier() -> None:
    sim = disk_sim(disk_policy="write-through", disk_admit_after=1)
    toks = prompt(100)
    sim.prefill_and_store("a", toks)
    run_disk(sim)
    assert sim.depot.clear(host=True, disk=False) == (6, 0)
    assert sim.lookup("b", toks) == 96
    plan = sim.step(sim.new("b", toks, E=96, S=4, table=list(range(200, 207))))
    load = next(op for op in plan.ops if op.kind is OpKind.LOAD)
    assert load.held and sim.depot.take_ready() == []  # nothing copies into the engine before the read
    jobs = run_disk(sim)
    assert [j.kind for j in jobs] == [DiskJobKind.READ] and len(jobs[0].items) == 6
    sim.run_copies()
    assert sim.completed(OpKind.LOAD)[0].success
    assert sim.states("b")[:6] == [BlockState.LOADED] * 6
    assert sim.resident(toks) == 6  # staged blocks stay in the host tier
    counters = sim.depot.all_counters()
    assert counters["disk_read_blocks"] == 6 and counters["lookup_disk_hit_tokens"] == 96


def test_lookup_mixes_tiers_and_stages_only_the_disk_blocks() -> None:
    sim = disk_sim(disk_policy="write-through", disk_admit_after=1)
    toks = prompt(100)
    sim.prefill_and_store("a", toks)
    run_disk(sim)
    host = sim.depot.engines[sim.engine].domain.registry
    hs = hashes(toks)
    host.discard(hs[2])  # block 2 only on disk, then host again from 3 on
    host.discard(hs[5])
    res = sim.depot.lookup(sim.engine, RequestId("b"), tokens_to_bytes(toks), cache_salt="", lora_name="", device_matched_tokens=0, pin_ms=0, now_ms=sim.now)
    assert (res.matched_tokens, res.host_tokens, res.disk_tokens) == (96, 64, 32)
    sim.step(sim.new("b", toks, E=96, S=4, table=list(range(200, 207))))
    jobs = run_disk(sim)
    assert sorted(it.hash for j in jobs for it in j.items) == sorted([hs[2], hs[5]])
    sim.run_copies()
    assert sim.completed(OpKind.LOAD)[0].success


def test_corrupt_disk_block_fails_its_load_and_is_dropped() -> None:
    toks = prompt(100)
    sim = only_on_disk(toks)
    sim.lookup("b", toks)
    sim.step(sim.new("b", toks, E=96, S=4, table=list(range(200, 207))))
    hs = hashes(toks)
    run_disk(sim, corrupt={hs[3]})
    sim.run_copies()
    op = sim.completed(OpKind.LOAD)[0]
    assert op.failed == {3} and "checksum" in op.message or op.failed == {3}
    assert on_disk(sim, toks) == 3
    assert sim.depot.all_counters()["disk_checksum_failures"] == 1


def test_data_read_from_disk_that_fails_the_loads_check_is_dropped_from_both_tiers() -> None:
    """The disk read checks a block's header; its data is checked by the load that copies it into
    the engine. Bad data there is the disk's: the block goes from the host and the disk tier."""
    toks = prompt(100)
    sim = only_on_disk(toks)
    sim.lookup("b", toks)
    sim.step(sim.new("b", toks, E=96, S=4, table=list(range(200, 207))))
    hs = hashes(toks)
    run_disk(sim)
    sim.run_copies(corrupt={3})
    assert sim.completed(OpKind.LOAD)[0].failed == {3}
    assert hs[3] not in sim.depot.engines[sim.engine].domain.registry.entries
    assert on_disk(sim, toks) == 3
    assert [h for _, h, _ in sim.depot.take_disk_drops()] == [hs[3]]  # the storage journals its removal
    counters = sim.depot.all_counters()
    assert (counters["disk_checksum_failures"], counters["checksum_failures"]) == (1, 0)


def test_load_that_ends_while_staging_leaves_the_blocks_in_the_host_tier() -> None:
    toks = prompt(100)
    sim = only_on_disk(toks)
    sim.lookup("b", toks)
    sim.step(sim.new("b", toks, E=96, S=4, table=list(range(200, 207))))
    sim.now += 31_000  # past the op deadline, within the lease
    sim.depot.expire(sim.now)  # the op's deadline passes while its blocks are read
    sim.events += sim.depot.take_events()
    assert not sim.completed(OpKind.LOAD)[0].success
    sim.depot.check_invariants()
    run_disk(sim)
    assert sim.resident(toks) == 6


def test_two_loads_of_one_disk_prefix_share_one_read() -> None:
    toks = prompt(100)
    sim = only_on_disk(toks)
    assert sim.lookup("b", toks) == 96 and sim.lookup("c", toks + [7]) == 96
    sim.step(
        sim.new("b", toks, E=96, S=4, table=list(range(200, 207))),
        sim.new("c", toks + [7], E=96, S=5, table=list(range(300, 307))),
    )
    jobs = run_disk(sim)
    assert len(jobs) == 1 and len(jobs[0].items) == 6
    sim.run_copies()
    loads = sim.completed(OpKind.LOAD)
    assert len(loads) == 2 and all(op.success for op in loads)


def test_a_block_on_disk_is_never_stored_again() -> None:
    toks = prompt(64)
    sim = only_on_disk(toks)
    plan = sim.step(sim.new("b", toks, S=64, table=[1, 2, 3, 4]))
    assert blocks_of(plan, OpKind.STORE) == []
    assert sim.states("b") == [BlockState.ALREADY_CACHED] * 4


def test_full_disk_evicts_leaves_first_and_reports_the_drops() -> None:
    sim = disk_sim(disk_blocks=8, disk_policy="write-through", disk_admit_after=1)
    first, second = prompt(4 * BS, start=1), prompt(6 * BS, start=5000)
    sim.prefill_and_store("a", first)
    run_disk(sim)
    sim.depot.take_disk_drops()
    sim.prefill_and_store("b", second)
    run_disk(sim)
    drops = sim.depot.take_disk_drops()
    assert len(drops) == 2
    assert on_disk(sim, first) == 2  # the leaves (blocks 3, then 2) went first: the prefix still matches
    assert on_disk(sim, second) == 6


def test_restored_blocks_are_hits_in_a_fresh_depot() -> None:
    sim = disk_sim(disk_policy="write-through", disk_admit_after=1)
    toks = prompt(100)
    sim.prefill_and_store("a", toks)
    jobs = run_disk(sim)
    saved = [(it.hash, it.parent, it.disk_cell, it.owner) for j in jobs for it in j.items]
    fresh = disk_sim()
    fresh_depot = fresh.depot
    assert fresh_depot.restore_disk(layout().layout_class, BLOCK, 1, saved)
    assert fresh.lookup("b", toks) == 96
    fresh_depot.check_invariants()


def test_restore_refuses_slots_beyond_the_disk() -> None:
    sim = disk_sim(disk_blocks=8)
    assert not sim.depot.restore_disk(layout().layout_class, BLOCK, 1, [(1, None, 0, ""), (2, 1, 64, "")])
    assert sim.depot.restore_disk(layout().layout_class, BLOCK, 1, [(1, None, 0, ""), (2, 1, 7, "")])


def test_a_long_disk_load_is_cut_into_ops_that_start_as_their_blocks_arrive() -> None:
    toks = prompt(40 * BS + 1)
    sim = only_on_disk(toks, host_blocks=128, disk_blocks=128, disk_job_blocks=8)
    assert sim.lookup("b", toks) == 40 * BS
    plan = sim.step(sim.new("b", toks, E=40 * BS, S=1, table=list(range(200, 241))))
    loads = [op for op in plan.ops if op.kind is OpKind.LOAD]
    assert [len(op.block_indices) for op in loads] == [4] * 10 and all(op.held for op in loads)
    jobs = sim.depot.take_disk_jobs(sim.now)
    assert len(jobs) == 10
    sim.depot.disk_job_done(jobs[0].job_id, set(), set())
    ready = sim.depot.take_ready()
    assert [p.op_id for p in ready] == [loads[0].op_id]  # the first part copies while the rest is read
    for p in ready:
        sim.depot.complete_part(p.op_id, p.rank)
    for job in jobs[1:]:
        sim.depot.disk_job_done(job.job_id, set(), set())
    sim.run_copies()
    assert sim.states("b")[:40] == [BlockState.LOADED] * 40


def test_two_layout_classes_of_one_model_stage_the_same_hashes_from_disk_apart() -> None:
    """Engines of one model with other layouts (TP 1 and TP 2) have the same block hashes in two
    pools; reads of one hash for both at once are two reads (the second used to replace the first's
    waiting loads, and its report then raised KeyError)."""
    big = disk_record_bytes(2 * BLOCK)
    depot = Depot(DepotConfig(host_bytes=128 * BLOCK, slab_bytes=4 * BLOCK, disk_bytes=64 * big, disk_slab_bytes=8 * big,
                              disk=DiskConfig(policy="write-through", admit_after=1)))
    tp1, tp2 = Sim(depot=depot, name="tp1"), Sim(depot=depot, name="tp2", world_size=2)
    toks = prompt(100)
    for s in (tp1, tp2):
        s.prefill_and_store("w", toks)
    run_disk(tp1)
    depot.clear(host=True, disk=False)
    assert tp1.lookup("x", toks) == 96 and tp2.lookup("y", toks) == 96
    tp1.step(tp1.new("x", toks, E=96, S=4, table=list(range(200, 207))))
    tp2.step(tp2.new("y", toks, E=96, S=4, table=list(range(300, 307))))
    run_disk(tp1)
    tp1.run_copies()
    tp2.run_copies()
    loads = tp1.completed(OpKind.LOAD) + tp2.completed(OpKind.LOAD)
    assert sorted(op.engine_id for op in loads) == [tp1.engine, tp2.engine] and all(op.success for op in loads)
