"""Table-driven slot transitions: (slot state before, update) -> (block states after, plan).

Each row starts from a fresh engine with blocks 0..3 of a 64-token prompt already in the host tier
when `tier` says so, then applies `before` updates and the row's `update`.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvdepotd.core.ops import OpKind
from kvdepotd.core.slots import BlockState as B
from tests.unit.sim import Sim, blocks_of, prompt

P = prompt(64)
T = [10, 11, 12, 13, 14]


@dataclass
class Row:
    name: str
    tier: bool  # blocks 0..3 of P already resident
    lookup_L: int | None  # None: no lookup before the update
    before: list[tuple]  # ("new", L, E, S) / ("cached", C, S) / ("preempt",)
    update: tuple
    states: list[B]
    loads: list[int]
    stores: list[int]


ROWS = [
    Row("cold prefill", False, None, [], ("new", 0, 0, 64), [B.STORING] * 4, [], [0, 1, 2, 3]),
    Row("device hit 32", False, None, [], ("new", 32, 0, 32), [B.DEVICE_HIT] * 2 + [B.STORING] * 2, [], [2, 3]),
    Row("all cached in tier", True, None, [], ("new", 0, 0, 64), [B.ALREADY_CACHED] * 4, [], []),
    Row("load 48 + compute 16", True, 0, [], ("new", 0, 48, 16), [B.LOADING] * 3 + [B.ALREADY_CACHED], [0, 1, 2], []),
    Row("device 16 + load 32", True, 16, [], ("new", 16, 32, 16), [B.DEVICE_HIT] + [B.LOADING] * 2 + [B.ALREADY_CACHED], [1, 2], []),
    Row("load without lookup pin", True, None, [], ("new", 0, 32, 32), [B.LOADING] * 2 + [B.ALREADY_CACHED] * 2, [0, 1], []),
    Row("load of absent blocks", False, None, [], ("new", 0, 32, 32), [B.LOADING] * 2 + [B.STORING] * 2, [0, 1], [2, 3]),
    Row("chunk then chunk", False, None, [("new", 0, 0, 32)], ("cached", 32, 32), [B.STORING] * 4, [], [2, 3]),
    Row("repeat of a chunk (rewind)", False, None, [("new", 0, 0, 32)], ("cached", 0, 32), [B.STORING] * 2 + [B.PENDING] * 2, [], []),
    Row("partial chunk", False, None, [], ("new", 0, 0, 40), [B.STORING] * 2 + [B.PENDING] * 2, [], [0, 1]),
    Row("resume after preempt", False, None, [("new", 0, 0, 32), ("preempt",)], ("new", 0, 0, 64), [B.STORING] * 4, [], [0, 1, 2, 3]),  # the cancelled stores run again
    Row("new twice (async follow-up)", False, None, [("new", 0, 0, 0)], ("new", 0, 0, 64), [B.STORING] * 4, [], [0, 1, 2, 3]),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_transition(row: Row) -> None:
    sim = Sim()
    if row.tier:
        sim.prefill_and_store("seed", P + [7])
    if row.lookup_L is not None:
        sim.lookup("r", P + [7], L=row.lookup_L)
    for b in row.before:
        if b[0] == "new":  # a new update carries the whole sequence, the first time or not
            sim.step(sim.new("r", P, L=b[1], E=b[2], S=b[3], table=T[:4]))
        elif b[0] == "cached":
            sim.step(sim.cached("r", C=b[1], S=b[2]))
        else:
            sim.step(preempted=["r"])
    u = row.update
    if u[0] == "new":
        plan = sim.step(sim.new("r", P, L=u[1], E=u[2], S=u[3], table=T[:4]))
    else:
        plan = sim.step(sim.cached("r", C=u[1], S=u[2]))
    assert sim.states("r") == row.states
    assert blocks_of(plan, OpKind.LOAD) == row.loads
    assert blocks_of(plan, OpKind.STORE) == row.stores
    sim.depot.check_invariants()


def test_reclaim_frees_a_reserve_ahead_of_the_stores_that_need_it() -> None:
    """Background eviction (the service runs it while the engine computes): least recently used
    leaves go first, down to 1/64 of the pool free; a Step's stores then allocate without evicting,
    and blocks a lookup pinned stay."""
    sim = Sim(host_blocks=128)  # reserve: 2 slots
    reg = sim.depot.engines[sim.engine].domain.registry
    for i in range(16):  # 16 prompts of 8 blocks fill the tier
        sim.prefill_and_store(f"r{i}", prompt(128, start=1000 * i + 1))
    assert reg.pool.capacity_blocks - reg.pool.num_used == 0
    assert sim.lookup("hold", prompt(128, start=1)) == 128 - 16  # pins r0's blocks (all but the last)
    assert sim.depot.reclaim() == 2
    assert reg.pool.capacity_blocks - reg.pool.num_used == 2 and reg.evictions == 2
    assert sim.resident(prompt(128, start=1)) == 7  # only r0's unpinned last block went of r0 ...
    assert sim.resident(prompt(128, start=1001)) == 7  # ... and then the next LRU leaf, r1's last
    assert sim.depot.reclaim() == 0  # at the reserve already
    plan = sim.step(sim.new("new", prompt(32, start=99_001), S=32, table=[500, 501]))
    assert blocks_of(plan, OpKind.STORE) == [0, 1] and reg.evictions == 2  # served from the reserve
