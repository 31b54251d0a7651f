"""Engines whose workers copy their blocks themselves (engine_copies): their blocks live in a domain
of their namespace's own, whose host memory (a space of its own, counted against the shared budget)
their workers map, so no other namespace's block is ever within their reach."""

from __future__ import annotations

import pytest

from kvdepot.layout import KvLayout
from kvdepotd.core.depot import Depot, DepotConfig
from kvdepotd.core.disk import is_private, private_class, public_class
from kvdepotd.core.errors import FailedPrecondition, InvalidRequest
from kvdepotd.core.ops import EngineId
from kvdepotd.core.slots import UpdateStyle

LAYOUT = KvLayout(num_layers=2, num_kv_heads=1, head_size=4, dtype="float16", block_size=16, kind="trtllm")


def register(depot: Depot, name: str, namespace: str, copies: bool, key: str = "", join: bool = False):  # type: ignore[no-untyped-def]
    return depot.register_engine(
        EngineId(name), name=name, model="m", layout=LAYOUT, namespace=namespace, style=UpdateStyle.TRTLLM, lease_ms=60_000, now_ms=0,
        key=key, join=join, engine_copies=copies,
    )[0]


def test_each_namespace_of_engine_copies_engines_has_its_own_domain_and_space() -> None:
    slab = 4 * LAYOUT.block_bytes
    depot = Depot(DepotConfig(host_bytes=4 * slab, slab_bytes=slab))
    a, a2 = register(depot, "a", "team-a", True), register(depot, "a2", "team-a", True)
    b, shared = register(depot, "b", "team-b", True), register(depot, "s", "team-a", False)
    # One domain per namespace for engines that copy; the daemon-copied engines keep the shared one.
    assert a.domain is a2.domain and a.domain is not b.domain and shared.domain is not a.domain
    assert is_private(a.domain.layout_class) and not is_private(shared.domain.layout_class)
    assert public_class(a.domain.layout_class) == public_class(b.domain.layout_class) == LAYOUT.layout_class
    assert a.domain.layout_class == private_class(LAYOUT.layout_class, "team-a") != private_class(LAYOUT.layout_class, "team-b")
    # Each space starts at 0 (its own memory); the tier's budget is one: four slabs in all.
    pools = [e.domain.registry.pool for e in (a, b, shared)]
    assert [p.byte_offset(p.allocate()) for p in pools] == [0, 0, 0]  # type: ignore[arg-type]
    assert depot.host_budget.used_bytes == 3 * slab
    extra = register(depot, "c", "team-c", True).domain.registry.pool
    assert extra.allocate() is not None and depot.host_budget.free_bytes == 0
    assert register(depot, "d", "team-d", True).domain.registry.pool.allocate() is None  # the budget is spent


def test_a_join_must_match_how_the_engine_copies() -> None:
    depot = Depot(DepotConfig(host_bytes=1 << 20, slab_bytes=1 << 16))
    register(depot, "a", "", True, key="k")
    with pytest.raises(FailedPrecondition, match="engine_copies True"):
        register(depot, "a-worker", "", False, key="k", join=True)
    assert register(depot, "a-worker", "", True, key="k", join=True).engine_id == "a"
    with pytest.raises(InvalidRequest, match="layout kind 'none'"):
        depot.register_engine(
            EngineId("n"), name="n", model="m", layout=KvLayout(num_layers=2, num_kv_heads=1, head_size=4, dtype="float16", block_size=16),
            namespace="", style=UpdateStyle.VLLM, lease_ms=0, now_ms=0, engine_copies=True,
        )
