"""Reading the Depot's state whole: the statistics the edges export, and the invariants tests check.

    stats(...) -> DepotStats        engines, slots, ops, every pool of every tier, per-namespace
                                    figures and the counters, in one walk (GetStats and /metrics)
    all_counters(counters, domains) every counter of COUNTERS, at 0 until it first moves
    check_invariants(...)           registries and pools consistent, every pin accounted for by a
                                    lookup, a load or a disk job, no slot holding an ended op
The Depot calls them with its parts (Depot.stats, Depot.check_invariants).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

from kvdepot.hashing import BlockHash
from kvdepotd.core.disk import DiskJob, DiskJobKind, Domain
from kvdepotd.core.remote import RemoteJob, RemoteJobKind
from kvdepotd.core.ops import EngineId, Op, OpId, OpKind
from kvdepotd.core.pool import SlabBudget
from kvdepotd.core.records import COUNTERS, DepotStats, Engine, PoolStats

Engines = Mapping[EngineId, Engine]
Domains = Mapping[str, Domain]


def stats(
    engines: Engines,
    domains: Domains,
    ops: Mapping[OpId, Op],
    counters: Mapping[str, int],
    host: SlabBudget,
    disk: SlabBudget,
    remote_queue: int = 0,
    remote_jobs: int = 0,
) -> DepotStats:
    """One walk over the state for GetStats and the metrics."""
    pools: list[PoolStats] = []
    ns_engines: Counter[str] = Counter()
    ns_slots: Counter[str] = Counter()
    ns_blocks: Counter[str] = Counter()
    for e in engines.values():
        ns_engines[e.namespace] += 1
        ns_slots[e.namespace] += len(e.slots)
    for dom in domains.values():
        ns_blocks.update(dom.registry.owned)
        for tier, reg in (("host", dom.registry), ("disk", dom.disk)):
            if reg is not None:
                pool = reg.pool
                pools.append(PoolStats(dom.layout_class, tier, dom.block_bytes, pool.capacity_blocks, pool.num_used, reg.num_pinned, reg.num_storing))
    return DepotStats(
        engines=len(engines),
        slots=sum(ns_slots.values()),
        ops_in_flight=len(ops),
        pools=pools,
        counters=all_counters(counters, domains),
        namespace_engines=dict(ns_engines),
        namespace_slots=dict(ns_slots),
        namespace_host_blocks=dict(ns_blocks),
        host_bytes=host.total_bytes,
        disk_bytes=disk.total_bytes,
        disk_used_bytes=disk.used_bytes,
        remote_queue_blocks=remote_queue,
        remote_jobs=remote_jobs,
        oldest_op_planned_ms=min((op.planned_ms for op in ops.values()), default=0),
    )


def all_counters(counters: Mapping[str, int], domains: Domains) -> dict[str, int]:
    out = {name: counters.get(name, 0) for name in COUNTERS}
    out["evictions"] = sum(d.registry.evictions for d in domains.values())
    out["evicted_unhit_blocks"] = sum(d.registry.evicted_unhit for d in domains.values())
    out["disk_evictions"] = sum(d.disk.evictions for d in domains.values() if d.disk is not None)
    return out


def check_invariants(
    engines: Engines,
    domains: Domains,
    by_key: Mapping[tuple[str, str], EngineId],
    ops: Mapping[OpId, Op],
    disk_jobs: Iterable[DiskJob],
    remote_jobs: Iterable[RemoteJob] = (),
) -> None:
    """Asserts what must hold between calls (the hypothesis state machines call it after every step)."""
    for dom in domains.values():
        dom.registry.check_invariants()
        if dom.disk is not None:
            dom.disk.check_invariants()
    assert by_key == {(e.namespace, e.key): i for i, e in engines.items() if e.key}, "engine keys out of step"
    host_pins: Counter[BlockHash] = Counter()
    disk_pins: Counter[BlockHash] = Counter()
    for eng in engines.values():
        assert eng.pin_tokens == sum(len(p.tokens) >> 2 for p in eng.pins.values()), "pinned prompt tokens out of step"
        for p in eng.pins.values():
            for h, on_disk in zip(p.hashes, p.on_disk):
                (disk_pins if on_disk else host_pins)[h] += 1
        assert eng.slot_tokens == sum(s.counted for s in eng.slots.values()), "slot tokens out of step"
        for slot in eng.slots.values():
            assert slot.counted == len(slot.tokens) >> 2, f"slot {slot.request_id}: tokens counted out of step"
            for op_id in slot.ops:
                assert op_id in ops, f"slot {slot.request_id} holds ended op {op_id}"
    for op in ops.values():
        if op.kind is OpKind.LOAD:
            host_pins.update(h for i, h, s in zip(op.block_indices, op.hashes, op.tier_cells) if s is not None and i not in op.staging)
    for job in disk_jobs:
        (host_pins if job.kind is DiskJobKind.WRITE else disk_pins).update(it.hash for it in job.items)
    for rjob in remote_jobs:
        if rjob.kind is RemoteJobKind.WRITE:
            host_pins.update(it.hash for it in rjob.items)
    pins: Counter[BlockHash] = Counter()
    dpins: Counter[BlockHash] = Counter()
    for dom in domains.values():
        pins.update({h: e.pins for h, e in dom.registry.entries.items() if e.pins})
        if dom.disk is not None:
            dpins.update({h: e.pins for h, e in dom.disk.entries.items() if e.pins})
    assert pins == host_pins, "a host pin leaked or went missing"
    assert dpins == disk_pins, "a disk pin leaked or went missing"
