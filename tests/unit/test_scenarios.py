"""Narrated slot scenarios (block size 16), each run in vLLM style and as its TensorRT-LLM twin.

The twin differs where the engines differ (reference/engines.md A1.6, A2.4): after a synchronous
load TensorRT-LLM reports computed_position = L (device reuse only), vLLM num_computed_tokens = L+E.
Stores are planned in the step whose forward completes the block and start only when the worker
reports that forward done (rule 4), so "no store in the first step" means: nothing runs before
the forward, and the engine's own blocks are never planned at all.
"""

from __future__ import annotations

import pytest

from kvdepotd.core.depot import LoadCopied, OpCompleted
from kvdepotd.core.errors import FailedPrecondition, InvalidRequest, NotFound
from kvdepotd.core.ops import OpKind, RequestId
from kvdepotd.core.slots import BlockState, UpdateStyle
from kvdepot.hashing import tokens_to_bytes
from tests.unit.sim import BS, Sim, blocks_of, engine_blocks_of, prompt

STYLES = [UpdateStyle.VLLM, UpdateStyle.TRTLLM]
D = list(range(10, 20))  # engine block ids d0..d9
LOAD, STORE = OpKind.LOAD, OpKind.STORE


@pytest.mark.parametrize("style", STYLES)
def test_a_device_hit_blocks_never_stored(style: UpdateStyle) -> None:
    """Seed bug: 100-token prompt, 32 tokens on the engine's GPU, nothing in the tiers."""
    sim = Sim(style)
    toks = prompt(100)
    assert sim.lookup("r", toks, L=32) == 0
    # Step 1: the engine computes tokens 32..99. Blocks 0-1 are its own; nothing may run before the forward.
    plan = sim.step(sim.new("r", toks, L=32, S=68, table=D[:7]))
    assert 0 not in blocks_of(plan, STORE) and 1 not in blocks_of(plan, STORE)
    assert sim.depot.take_ready() == []
    assert sim.states("r")[:2] == [BlockState.DEVICE_HIT] * 2
    sim.forward_done()
    # Decode to the end of the block: 2-5 were stored exactly once, 0-1 never.
    plan2 = sim.step(sim.cached("r", C=100, S=1, tokens=[7]))
    sim.forward_done()
    stored = [i for op in sim.completed(STORE) for i in op.block_indices]
    assert sorted(stored) == [2, 3, 4, 5]
    assert blocks_of(plan2, STORE) == []
    assert sim.states("r") == [BlockState.DEVICE_HIT] * 2 + [BlockState.STORED] * 4


@pytest.mark.parametrize("style", STYLES)
def test_a_twin_without_scheduled_count_plans_nothing_in_first_step(style: UpdateStyle) -> None:
    """TensorRT-LLM as Dynamo saw it (no scheduled count): the first step plans no store at all;
    blocks 2-5 follow in the next step, 0-1 never."""
    sim = Sim(style)
    toks = prompt(100)
    plan1 = sim.step(sim.new("r", toks, L=32, S=0, table=D[:7]))
    assert plan1.ops == []
    sim.forward_done()
    plan2 = sim.step(sim.cached("r", C=100, S=0, tokens=[7]))
    assert blocks_of(plan2, STORE) == [2, 3, 4, 5]
    sim.forward_done()
    sim.step(sim.cached("r", C=101, S=0, tokens=[8]))
    assert sorted(i for op in sim.completed(STORE) for i in op.block_indices) == [2, 3, 4, 5]


@pytest.mark.parametrize("style", STYLES)
def test_b_host_hit_loads_into_right_blocks_and_stores_only_new(style: UpdateStyle) -> None:
    """G1 holds 32 tokens, the host tier blocks 2-4: load 2-4 into d2-d4, store 5, then 6 at 112."""
    sim = Sim(style)
    toks = prompt(100)
    # Another request with the same first 80 tokens, also on the engine's GPU for 32, stored 2-4.
    sim.prefill_and_store("x", toks[:80] + [9999] * 3, L=32)
    assert sim.resident(toks) == 0  # 0-1 were never stored: the engine has them
    assert sim.lookup("r", toks, L=32) == 48
    plan = sim.step(sim.new("r", toks, L=32, E=48, S=20, table=D[:7]))
    assert blocks_of(plan, LOAD) == [2, 3, 4]
    assert engine_blocks_of(plan, LOAD) == D[2:5]
    assert blocks_of(plan, STORE) == [5]
    assert engine_blocks_of(plan, STORE) == [D[5]]
    # Loads start at once; the store waits for the forward.
    ready = sim.run_copies()
    assert [p.kind for p in ready] == [LOAD]
    sim.forward_done()
    # Decode from 100 to 112 tokens: block 6 exactly when the 112th token is computed.
    n = 100
    stores_at: list[int] = []
    while n < 113:
        p = sim.step(sim.cached("r", C=n, S=1, tokens=[5000 + n], blocks=[D[n // BS]] if n % BS == 0 else []))
        sim.forward_done()
        if blocks_of(p, STORE):
            stores_at.append(n + 1)
            assert blocks_of(p, STORE) == [6]
        n += 1
    assert stores_at == [112]
    assert sim.states("r")[:7] == [BlockState.DEVICE_HIT] * 2 + [BlockState.LOADED] * 3 + [BlockState.STORED] * 2


@pytest.mark.parametrize("style", STYLES)
def test_c_chunked_prefill(style: UpdateStyle) -> None:
    """Chunks of 32: stores 0-1, 2-3, 4-5 in the steps that compute them, none twice."""
    sim = Sim(style)
    toks = prompt(100)
    plans = [sim.step(sim.new("r", toks, S=32, table=D[:2]))]
    sim.forward_done()
    for c, more in ((32, D[2:4]), (64, D[4:6]), (96, D[6:7])):
        plans.append(sim.step(sim.cached("r", C=c, S=min(32, 100 - c), blocks=more)))
        sim.forward_done()
    assert [blocks_of(p, STORE) for p in plans] == [[0, 1], [2, 3], [4, 5], []]
    assert sorted(i for op in sim.completed(STORE) for i in op.block_indices) == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("style", STYLES)
def test_d_decode_across_boundaries_tail_never_stored(style: UpdateStyle) -> None:
    sim = Sim(style)
    toks = prompt(100)
    sim.step(sim.new("r", toks, S=100, table=D[:7]))
    sim.forward_done()
    n, stored_at = 100, []
    while n < 140:  # generate up to 140 tokens: blocks 6 (at 112) and 7 (at 128); 128..139 is the tail
        p = sim.step(sim.cached("r", C=n, S=1, tokens=[n], blocks=[D[n // BS]] if n % BS == 0 else []))
        sim.forward_done()
        stored_at += [(n + 1, i) for i in blocks_of(p, STORE)]
        n += 1
    assert stored_at == [(112, 6), (128, 7)]
    sim.step(finished=["r"])
    assert sim.resident(toks + list(range(100, 140))) == 8  # blocks 0..7, never the 12-token tail


@pytest.mark.parametrize("style", STYLES)
def test_e_preemption_then_resume_fresh_lookup_no_restore(style: UpdateStyle) -> None:
    sim = Sim(style)
    toks = prompt(100)
    sim.step(sim.new("r", toks, S=100, table=D[:7]))
    sim.forward_done()
    sim.step(preempted=["r"])
    assert sim.depot.slot(sim.engine, "r").block_table == []
    # Resume: a fresh lookup sees what the tiers hold (Dynamo never re-matched; we do).
    assert sim.lookup("r", toks, L=0) == 96
    plan = sim.step(sim.new("r", toks, E=96, S=4, table=[30, 31, 32, 33, 34, 35, 36]))
    assert blocks_of(plan, LOAD) == [0, 1, 2, 3, 4, 5]
    assert engine_blocks_of(plan, LOAD) == [30, 31, 32, 33, 34, 35]
    assert blocks_of(plan, STORE) == []
    sim.run_copies()
    sim.forward_done()
    assert sim.depot.engines[sim.engine].domain.registry.pool.num_used == 6


def test_e_preemption_before_the_forward_cancels_the_stores() -> None:
    """Preempted before any rank reported the step's forward: its stores would read blocks the engine
    is about to reuse, so they end, counted as cancelled (not as failures of the tier)."""
    sim = Sim(UpdateStyle.VLLM)
    plan = sim.step(sim.new("r", prompt(100), S=100, table=D[:7]))
    assert blocks_of(plan, STORE) == [0, 1, 2, 3, 4, 5]
    sim.step(preempted=["r"])
    c = sim.depot.counters
    assert c["store_blocks_cancelled"] == 6 and c["store_failed_blocks"] == 0 and c["stored_blocks"] == 0
    assert sim.resident(prompt(100)) == 0


@pytest.mark.parametrize("style", STYLES)
def test_e_resume_with_device_hit_and_partly_stored(style: UpdateStyle) -> None:
    """Preempted after 0-3 were stored (chunked); resumed with the engine holding 0-1: no re-store."""
    sim = Sim(style)
    toks = prompt(100)
    sim.step(sim.new("r", toks, S=64, table=D[:4]))
    sim.forward_done()
    sim.step(preempted=["r"])
    assert sim.lookup("r", toks, L=32) == 32  # blocks 2-3 from the host tier
    plan = sim.step(sim.new("r", toks, L=32, E=32, S=36, table=[40, 41, 42, 43, 44, 45, 46]))
    assert blocks_of(plan, LOAD) == [2, 3] and engine_blocks_of(plan, LOAD) == [42, 43]
    assert blocks_of(plan, STORE) == [4, 5]


@pytest.mark.parametrize("style", STYLES)
def test_f_abort_during_load(style: UpdateStyle) -> None:
    sim = Sim(style)
    toks = prompt(100)
    sim.prefill_and_store("x", toks)
    assert sim.lookup("r", toks) == 96
    sim.step(sim.new("r", toks, E=96, S=4, table=D[:7]))
    # The request is aborted while its load is still copying: the engine must keep the blocks.
    ready = sim.depot.take_ready()
    plan = sim.step(finished=["r"])
    assert plan.delay_free == ["r"]
    for p in ready:
        sim.depot.complete_part(p.op_id, p.rank)
    sim.run_copies()
    assert sim.released() == ["r"]
    sim.step(finished=["r"])  # a repeated finish changes nothing
    sim.run_copies()
    assert sim.released() == ["r"]
    reg = sim.depot.engines[sim.engine].domain.registry
    assert reg.num_pinned == 0


@pytest.mark.parametrize("style", STYLES)
def test_f_a_finished_requests_load_stops_and_ends_once_its_copy_reported(style: UpdateStyle) -> None:
    """A request cancelled while its load copies: the load is of no use, but a copy thread may be
    writing one of its blocks. The engine is told to keep the blocks (delay_free), the running
    part is told to stop, parts not started copy nothing, and the request is released only once
    the copy reported: never while a block may still be written."""
    sim = Sim(style, world_size=2)
    toks = prompt(100)
    sim.prefill_and_store("x", toks)
    assert sim.lookup("r", toks) == 96
    sim.step(sim.new("r", toks, E=96, S=4, table=D[:7]))
    ready = sim.depot.take_ready()
    copying = [p for p in ready if p.rank == 0]  # rank 0's part is with a copy thread; rank 1's not yet
    sim.depot._ready += [(sim.depot.ops.ops[p.op_id], p.rank) for p in ready if p.rank == 1]
    plan = sim.step(finished=["r"])
    assert plan.delay_free == ["r"]
    assert sim.depot.take_cancels() == [copying[0].op_id]
    [later] = sim.depot.take_ready()
    assert later.rank == 1 and later.work == ()  # handed out empty: it touches no block
    sim.depot.complete_part(later.op_id, 1, list(later.indices))
    sim.events += sim.depot.take_events()
    assert sim.released() == []  # rank 0's copy may still be writing
    sim.depot.complete_part(copying[0].op_id, 0, [i for i in copying[0].indices if i >= 2])  # it stopped after two blocks
    sim.events += sim.depot.take_events()
    assert sim.released() == ["r"]
    c = sim.depot.counters
    assert c["load_blocks_cancelled"] == 6 and c["load_failed_blocks"] == 0
    assert sim.depot.engines[sim.engine].domain.registry.num_pinned == 0
    sim.depot.check_invariants()


@pytest.mark.parametrize("style", STYLES)
def test_g_finish_with_stores_pending(style: UpdateStyle) -> None:
    sim = Sim(style)
    toks = prompt(100)
    sim.step(sim.new("r", toks, S=100, table=D[:7]))
    plan = sim.step(finished=["r"])  # finished before the worker reported the forward
    assert plan.delay_free == ["r"]
    assert sim.released() == []
    sim.forward_done(step=1)
    assert sim.released() == ["r"]
    assert [op.success for op in sim.completed(STORE)] == [True]
    sim.step()
    sim.forward_done()
    assert sim.released() == ["r"]  # exactly once
    with pytest.raises(Exception):
        sim.depot.slot(sim.engine, "r")


@pytest.mark.parametrize("style", STYLES)
def test_h_block_aligned_full_hit_keeps_last_block(style: UpdateStyle) -> None:
    sim = Sim(style)
    toks = prompt(96)
    sim.prefill_and_store("x", toks)
    assert sim.resident(toks) == 6
    assert sim.lookup("r", toks) == 80  # the engine recomputes block 5 for its logits
    short = prompt(16, start=500)
    sim.prefill_and_store("y", short)
    assert sim.lookup("s", short) == 0


@pytest.mark.parametrize("style", STYLES)
def test_i_repeated_and_out_of_order_updates_change_nothing(style: UpdateStyle) -> None:
    sim = Sim(style)
    toks = prompt(64)
    u = sim.new("r", toks, S=64, table=D[:4])
    plan = sim.step(u)
    again = sim.depot.step(sim.engine, 1, [u], [], [], sim.now)
    assert again is plan and len(sim.depot.ops.ops) == 1
    sim.step(sim.cached("r", C=64, S=1, tokens=[1], blocks=[D[4]]))
    # An older step within the answer cache is answered the same; nothing is planned twice.
    assert sim.depot.step(sim.engine, 1, [u], [], [], sim.now) is plan
    for _ in range(20):
        sim.step()
    with pytest.raises(FailedPrecondition):
        sim.depot.step(sim.engine, 1, [u], [], [], sim.now)
    sim.forward_done()
    assert sim.states("r") == [BlockState.STORED] * 4


@pytest.mark.parametrize("style", STYLES)
def test_j_resident_or_in_flight_block_never_allocated_again(style: UpdateStyle) -> None:
    sim = Sim(style)
    toks = prompt(64)
    plan = sim.step(sim.new("a", toks, S=64, table=D[:4]), sim.new("b", toks, S=64, table=D[4:8]))
    assert blocks_of(plan, STORE) == [0, 1, 2, 3]  # only a's; b's are in flight already
    assert sim.states("b") == [BlockState.ALREADY_CACHED] * 4
    pool = sim.depot.engines[sim.engine].domain.registry.pool
    assert pool.num_used == 4
    sim.forward_done()
    plan2 = sim.step(sim.new("c", toks, S=64, table=D[:4]))
    assert plan2.ops == [] and pool.num_used == 4


@pytest.mark.parametrize("style", STYLES)
def test_failed_load_is_recomputed_and_then_stored(style: UpdateStyle) -> None:
    sim = Sim(style)
    toks = prompt(64)
    sim.prefill_and_store("x", toks)
    assert sim.lookup("r", toks + [1]) == 64
    sim.step(sim.new("r", toks + [1], E=64, S=1, table=D[:5]))
    sim.run_copies(fail={2})
    [load] = sim.completed(LOAD)
    assert not load.success and load.failed_block_ids() == [D[2]]
    assert sim.states("r")[2] is BlockState.LOAD_FAILED
    # The engine rewinds to the failed block and recomputes from there (rule 6).
    plan = sim.step(sim.cached("r", C=32, S=33))
    assert blocks_of(plan, STORE) == []  # still resident: a failed copy does not mean the tier lost it
    assert sim.states("r")[2] is BlockState.ALREADY_CACHED


@pytest.mark.parametrize("style", STYLES)
def test_failed_load_cancels_stores_computed_over_it_until_the_rewind(style: UpdateStyle) -> None:
    """Mixed case: blocks 2-4 load while the forward computes 5. Block 3 fails to load: what the
    forward computed after it (block 5) read a wrong block 3, so it is never stored; once the
    engine rewinds and recomputes, blocks 3 and up are decided again."""
    sim = Sim(style)
    toks = prompt(100)
    sim.prefill_and_store("x", toks[:80] + [9999] * 3, L=32)
    assert sim.lookup("r", toks, L=32) == 48
    plan = sim.step(sim.new("r", toks, L=32, E=48, S=20, table=D[:7]))
    assert blocks_of(plan, STORE) == [5]
    sim.run_copies(fail={3})
    sim.forward_done()
    [store] = sim.completed(STORE)[-1:]
    assert store.request_id == "r" and not store.success
    assert sim.resident(toks) == 0  # blocks 0-1 never stored; nothing new became resident
    # The engine rewinds to block 3 and recomputes 48..99: block 5 is stored now, 3 is still resident.
    plan = sim.step(sim.cached("r", C=48, S=52))
    assert blocks_of(plan, STORE) == [5]
    sim.forward_done()
    assert sim.states("r")[3:6] == [BlockState.ALREADY_CACHED, BlockState.LOADED, BlockState.STORED]


@pytest.mark.parametrize("style", STYLES)
def test_forward_before_its_load_ended_is_never_stored(style: UpdateStyle) -> None:
    """A worker that ran the forward before the step's load ended (it gave up waiting, or never
    saw the op) reports forward-done: the store of that step is cancelled, not run."""
    sim = Sim(style)
    toks = prompt(100)
    sim.prefill_and_store("x", toks[:80] + [9999] * 3, L=32)
    sim.lookup("r", toks, L=32)
    plan = sim.step(sim.new("r", toks, L=32, E=48, S=20, table=D[:7]))
    [store_op] = [op for op in plan.ops if op.kind is STORE]
    sim.depot.forward_done(sim.engine, 0, sim.step_no)  # the load has not run yet
    assert store_op.op_id not in sim.depot.ops.ops
    sim.run_copies()  # the load lands late
    plan = sim.step(sim.cached("r", C=32, S=68))  # the engine recomputes everything it did not trust
    assert blocks_of(plan, STORE) == [5]


@pytest.mark.parametrize("style", STYLES)
def test_tp2_op_done_only_when_both_ranks_done(style: UpdateStyle) -> None:
    sim = Sim(style, world_size=2)
    sim.step(sim.new("r", prompt(32), S=32, table=D[:2]))
    plan = sim.step(finished=["r"])
    assert plan.delay_free == ["r"]
    sim.forward_done(step=1, ranks=[0])
    assert sim.released() == []
    sim.forward_done(step=1, ranks=[1])
    assert sim.released() == ["r"]


@pytest.mark.parametrize("style", STYLES)
def test_missing_forward_done_ends_at_deadline(style: UpdateStyle) -> None:
    """A worker that never reports its forward: the op fails at its deadline, nothing hangs."""
    sim = Sim(style)
    sim.step(sim.new("r", prompt(32), S=32, table=D[:2]))
    sim.step(finished=["r"])
    sim.depot.expire(sim.now + sim.depot.config.op_timeout_ms)
    sim.run_copies()
    [op] = sim.completed(STORE)
    assert not op.success and op.message == "deadline exceeded"
    assert sim.released() == ["r"]
    assert sim.resident(prompt(32)) == 0


@pytest.mark.parametrize("style", STYLES)
def test_tier_full_of_pinned_blocks_refuses_explicitly(style: UpdateStyle) -> None:
    sim = Sim(style, host_blocks=4)
    toks = prompt(64)
    sim.prefill_and_store("x", toks)
    assert sim.lookup("p", toks + [1]) == 64  # pins all four
    plan = sim.step(sim.new("r", prompt(32, start=900), S=32, table=D[:2]))
    assert plan.ops == []
    assert sim.states("r") == [BlockState.NOT_STORED] * 2
    assert sim.depot.counters["store_blocks_tier_full"] == 2


@pytest.mark.parametrize("style", STYLES)
def test_repolled_lookup_with_different_hit_is_consistent(style: UpdateStyle) -> None:
    sim = Sim(style)
    toks = prompt(100)
    sim.prefill_and_store("x", toks)
    assert sim.lookup("r", toks, L=0) == 96
    assert sim.lookup("r", toks, L=32) == 64
    assert sim.lookup("r", toks, L=40) == 0  # partial-block device hit: no external match
    reg = sim.depot.engines[sim.engine].domain.registry
    assert reg.num_pinned == 0  # each re-poll replaced the earlier pin


def test_trtllm_async_load_reports_l_plus_e() -> None:
    """TensorRT-LLM after an async load emits the request as new with computed_position = L+E."""
    sim = Sim(UpdateStyle.TRTLLM)
    toks = prompt(100)
    sim.prefill_and_store("x", toks)
    assert sim.lookup("r", toks, L=32) == 64
    plan = sim.step(sim.new("r", toks, L=32, E=64, S=4, C=96, table=D[:7]))
    assert blocks_of(plan, LOAD) == [2, 3, 4, 5] and blocks_of(plan, STORE) == []


@pytest.mark.parametrize("style", STYLES)
def test_new_row_after_async_load_continues_without_appending_the_prompt_again(style: UpdateStyle) -> None:
    """An async load is announced when it starts (L+E computed, nothing scheduled); the engine then
    emits the request as new with its whole prompt and a fuller table. The slot continues: 100
    tokens, not 200, and the blocks after the load are stored under the prompt's own hashes."""
    sim = Sim(style)
    toks = prompt(100)
    sim.prefill_and_store("x", toks[:64] + prompt(36, start=500))
    assert sim.lookup("r", toks, L=0) == 64
    sim.step(sim.new("r", toks, E=64, S=0, C=64, table=D[:4]))
    sim.run_copies()
    plan = sim.step(sim.new("r", toks, E=64, S=36, C=64, table=D[:7]))
    slot = sim.depot.slot(sim.engine, "r")
    assert slot.num_tokens == 100
    assert blocks_of(plan, STORE) == [4, 5]
    sim.forward_done()
    assert sim.resident(toks) == 6


@pytest.mark.parametrize("style", STYLES)
def test_new_row_whose_tokens_differ_from_the_slots_is_refused(style: UpdateStyle) -> None:
    sim = Sim(style)
    toks = prompt(100)
    sim.step(sim.new("r", toks, S=64, table=D[:4]))
    sim.step(preempted=["r"])
    with pytest.raises(InvalidRequest, match="token 40 differs"):
        sim.step(sim.new("r", toks[:40] + [9999] + toks[41:], S=100, table=D[:7]))
    with pytest.raises(InvalidRequest, match="60 tokens is fewer than the 100"):
        sim.step(sim.new("r", toks[:60], S=60, table=D[:4]))
    assert sim.depot.slot(sim.engine, "r").num_tokens == 100  # refused whole: nothing changed
    sim.step(sim.new("r", toks + [7, 8], S=102, table=D[:7]))  # the whole sequence, grown: fine
    assert sim.depot.slot(sim.engine, "r").num_tokens == 102


def test_rejected_step_is_undone_entirely() -> None:
    """Good rows before a bad one are rolled back: tokens, hashes, block table, counts."""
    sim = Sim()
    sim.step(sim.new("a", prompt(15), S=15, table=D[:1]), sim.new("b", prompt(30, start=100), S=30, table=D[1:3]))
    before = {r: (bytes(s.tokens), list(s.hashes), list(s.states), list(s.block_table), s.computed, s.last_step)
              for r, s in sim.depot.engines[sim.engine].slots.items()}
    ops_before = len(sim.depot.ops.ops)
    with pytest.raises(NotFound):
        sim.step(
            sim.cached("a", C=15, S=1, tokens=[7], blocks=[D[5]]),  # completes block 0: hashed
            sim.cached("b", C=30, S=1, tokens=[8]),
            sim.cached("ghost", C=0, S=1, tokens=[9]),
        )
    after = {r: (bytes(s.tokens), list(s.hashes), list(s.states), list(s.block_table), s.computed, s.last_step)
             for r, s in sim.depot.engines[sim.engine].slots.items()}
    assert after == before and len(sim.depot.ops.ops) == ops_before
    sim.step_no -= 1
    plan = sim.step(sim.cached("a", C=15, S=1, tokens=[7], blocks=[D[5]]))
    assert blocks_of(plan, STORE) == [0]


def test_every_counter_the_core_moves_is_declared() -> None:
    """Dashboards see every counter from the start; a counter missing from COUNTERS would vanish."""
    import pathlib
    import re

    from kvdepotd.core import depot, records

    # Every module of the core, read beside the package (compiled or not).
    src = "\n".join(p.read_text() for p in sorted(pathlib.Path(depot.__file__).parent.glob("*.py")))
    used = set(re.findall(r'counters\["([a-z_]+)"\]', src))
    for pair in re.findall(r'"([a-z_]+)" if ok else "([a-z_]+)"', src):
        used |= set(pair)
    assert {"stored_blocks", "load_failed_blocks", "disk_written_blocks", "lookups"} <= used
    assert used <= set(records.COUNTERS), used - set(records.COUNTERS)


def test_first_step_reuses_the_lookups_hash_chain(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hit's Step does not hash the prompt a second time; other tokens still get their own chain."""
    import kvdepotd.core.slots as slots_mod
    from kvdepot.hashing import block_hashes, tokens_to_bytes
    from kvdepotd.core.ops import RequestId

    sim = Sim()
    toks = prompt(6 * BS + 5)
    sim.prefill_and_store("a", toks)
    hashed: list[int] = []
    real = slots_mod.block_hashes

    def counting(*a, **k):  # type: ignore[no-untyped-def]
        out = real(*a, **k)
        hashed.append(len(out))
        return out

    monkeypatch.setattr(slots_mod, "block_hashes", counting)
    assert sim.lookup("b", toks) == 6 * BS
    sim.step(sim.new("b", toks, E=6 * BS, S=5, table=list(range(10, 17))))
    slot = sim.depot.engines[sim.engine].slots[RequestId("b")]
    assert slot.hashes == block_hashes(tokens_to_bytes(toks), BS, slot.seed)
    assert sum(hashed) == 0  # the lookup computed all six full blocks

    other = prompt(6 * BS + 5, start=9)  # looked up with one prompt, scheduled with another
    sim.lookup("c", toks)
    sim.step(sim.new("c", other, S=len(other), table=list(range(20, 27))))
    assert sim.depot.engines[sim.engine].slots[RequestId("c")].hashes == block_hashes(tokens_to_bytes(other), BS, slot.seed)
    assert sum(hashed) == 6


@pytest.mark.parametrize("late", [True, False])
def test_late_checked_load_says_copied_once_every_rank_has(late: bool) -> None:
    """An engine that can take a load's failure after the forward (vLLM) hears LoadCopied once the
    bytes are in on every rank, then the OpCompleted with the checks' result; others never hear it."""
    sim = Sim(world_size=2, late_load_checks=late)
    P = prompt(48)
    sim.prefill_and_store("a", P)
    assert sim.lookup("b", P) == 32  # a block-aligned hit keeps the last block for the engine
    plan = sim.step(sim.new("b", P, E=32, S=16, table=[7, 8, 9]))
    [load] = [op for op in plan.ops if op.kind is OpKind.LOAD]
    assert load.check_late is late
    sim.depot.take_ready()
    # Rank 0 has copied its bytes: nothing to say yet.
    sim.depot.part_copied(load.op_id, 0)
    assert not [e for e in sim.depot.take_events() if isinstance(e, LoadCopied)]
    # Rank 1 too (reported twice): one LoadCopied for a late-checked load.
    sim.depot.part_copied(load.op_id, 1)
    sim.depot.part_copied(load.op_id, 1)
    copied = [e.op_id for e in sim.depot.take_events() if isinstance(e, LoadCopied)]
    assert copied == ([load.op_id] if late else [])
    # The checks end: block 1 was corrupt on rank 0. The op fails that block and the tier drops it.
    sim.depot.complete_part(load.op_id, 0, [1], "checksum mismatch", [1])
    sim.depot.complete_part(load.op_id, 1)
    [done] = [e.op for e in sim.depot.take_events() if isinstance(e, OpCompleted)]
    assert done.op_id == load.op_id and done.failed == {1} and sim.states("b")[:2] == [BlockState.LOADED, BlockState.LOAD_FAILED]
    assert sim.resident(P) == 1
    sim.depot.part_copied(load.op_id, 0)  # after the end: ignored
    assert not sim.depot.take_events()
    sim.depot.check_invariants()


def test_a_load_cap_offers_only_the_blocks_that_fit_and_says_so() -> None:
    """The runtime's load budget (load_budget_ms) turns into a cap on the blocks a Lookup offers:
    the first ones past the engine's own hit, none at 0; the pins follow, and each capped Lookup
    is counted. The hit rate's denominator still counts what the tiers could have offered."""
    sim = Sim()
    toks = prompt(100)
    sim.prefill_and_store("x", toks)
    c = sim.depot.counters
    asked = c["lookup_asked_tokens"]

    def lookup(L: int, cap: int) -> int:
        return sim.depot.lookup(
            sim.engine, RequestId("r"), tokens_to_bytes(toks), cache_salt="", lora_name="", device_matched_tokens=L, pin_ms=0,
            now_ms=sim.now, load_cap=cap,
        ).matched_tokens

    assert lookup(0, -1) == 96 and c["lookups_over_load_budget"] == 0
    assert lookup(0, 2) == 32 and c["lookups_over_load_budget"] == 1
    assert sim.depot.engines[sim.engine].domain.registry.num_pinned == 2
    assert lookup(16, 1) == 16  # past the engine's own block
    assert lookup(0, 0) == 0 and c["lookups_over_load_budget"] == 3
    assert lookup(0, 6) == 96 and c["lookups_over_load_budget"] == 3  # all fit
    assert c["lookup_asked_tokens"] - asked == 96 + 96 + 80 + 96 + 96
