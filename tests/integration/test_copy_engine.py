"""The host copy engine in-process: real shared memory, real threads, a real arena."""

from __future__ import annotations

import asyncio
import os
import sys
import threading

import pytest

from kvdepot.hashing import tokens_to_bytes
from kvdepot.layout import KvLayout
from kvdepot.testing.kv import FakeKv
from kvdepotd.convert import rank_spec
from kvdepotd.core.depot import Depot, DepotConfig, OpCompleted
from kvdepotd.core.ops import EngineId, OpId, OpKind, RequestId
from kvdepotd.core.slots import SlotUpdate, StepColumns, UpdateStyle
from kvdepotd.storage.host_arena import Arenas, HostArena
from kvdepotd.transfer import host
from kvdepotd.transfer.base import PartDone
from kvdepotd.transfer.host import HostCopyEngine
from kvdepotd.transfer.mapping import map_rank

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_size=8, dtype="float16", block_size=16, kind="vllm_cpu")
E = EngineId("e")


async def run_ops(depot: Depot, copy: HostCopyEngine) -> list[OpCompleted]:
    """Hands ready parts to the copy engine and waits until none is in flight."""
    events: list[OpCompleted] = []
    for _ in range(200):
        parts = depot.take_ready()
        if parts:
            copy.submit(parts)
        events += [e for e in depot.take_events() if isinstance(e, OpCompleted)]
        if not depot.ops.ops and not parts:
            return events
        await asyncio.sleep(0.01)
    raise TimeoutError("ops did not end")


def test_checksum_mismatch_fails_the_load_and_drops_the_block() -> None:
    async def main() -> None:
        arena = HostArena(1 << 20)
        depot = Depot(DepotConfig(host_bytes=1 << 20, slab_bytes=1 << 20))
        copy = HostCopyEngine(lambda done: [depot.complete_part(d.op_id, d.rank, d.failed, d.message, d.corrupt) for d in done], Arenas(arena), clock_ms=lambda: 0)
        depot.register_engine(E, name="", model="m", layout=LAYOUT, namespace="", style=UpdateStyle.VLLM, lease_ms=0, now_ms=0)
        copy.add_engine(E, LAYOUT)
        kv = FakeKv(LAYOUT, num_blocks=8)
        [req] = kv.share()
        copy.add_mapping(map_rank(E, LAYOUT, rank_spec(req)))
        depot.rank_mapped(E, 0)
        toks = list(range(40, 73))  # 33 tokens: blocks 0 and 1 are full
        kv.write([0, 1, 2], toks, range(33))
        depot.step(E, 1, [SlotUpdate(RequestId("a"), True, 0, 33, tokens_to_bytes(toks), (0, 1, 2))], [], [], 0)
        depot.forward_done(E, 0, 1)
        [store] = await run_ops(depot, copy)
        assert store.op.kind is OpKind.STORE and store.op.success
        # Flip one byte of block 1 in the host tier.
        reg = depot.engines[E].domain.registry
        h1 = depot.slot(E, RequestId("a")).hashes[1]
        off = reg.pool.byte_offset(reg.entries[h1].cell) + 100
        arena.tensor[off] ^= 0xFF
        res = depot.lookup(E, RequestId("b"), tokens_to_bytes(toks), cache_salt="", lora_name="", device_matched_tokens=0, pin_ms=0, now_ms=0)
        assert res.matched_tokens == 32
        kv.poison([4, 5])
        depot.step(E, 2, [SlotUpdate(RequestId("b"), True, 32, 1, tokens_to_bytes(toks), (4, 5, 6), 0, 32)], [], [], 0)
        [load] = await run_ops(depot, copy)
        assert load.op.kind is OpKind.LOAD and load.op.failed == {1} and load.op.corrupt == {1}
        assert load.op.failed_block_ids() == [5]
        assert kv.mismatches([4], toks, 16) == []  # block 0 arrived byte-exact
        assert h1 not in reg.entries and depot.counters["checksum_failures"] == 1
        depot.check_invariants()
        await copy.close()
        kv.close()

    asyncio.run(main())


async def load_and_store_order(monkeypatch: pytest.MonkeyPatch) -> tuple[list[OpKind], dict[OpKind, set[int]]]:
    """One copy thread per queue: an 8-block store is submitted, then, once its copy has begun, a
    4-block load; the store's copy is held until the load has ended (or 1 s). Returns the order the
    two ended in and the nice values of the threads that copied each kind."""
    arena = HostArena(1 << 20)
    depot = Depot(DepotConfig(host_bytes=1 << 20, slab_bytes=1 << 20))
    order: list[OpKind] = []
    load_done, hold, store_started = threading.Event(), threading.Event(), threading.Event()
    nice: dict[OpKind, set[int]] = {OpKind.LOAD: set(), OpKind.STORE: set()}
    real_copy = HostCopyEngine._copy

    def copy_(self: HostCopyEngine, part: host._Part, work: host.Work, first: bool) -> tuple[list[int], list[int], str]:
        nice[part.plan.kind].add(os.getpriority(os.PRIO_PROCESS, 0))  # (0: this thread, on Linux)
        if part.plan.kind is OpKind.STORE and hold.is_set():
            store_started.set()
            load_done.wait(1.0)
        return real_copy(self, part, work, first)

    monkeypatch.setattr(HostCopyEngine, "_copy", copy_)

    def done(parts: list[PartDone]) -> None:
        for d in parts:
            kind = depot.ops.ops[OpId(d.op_id)].kind
            order.append(kind)
            if kind is OpKind.LOAD:
                load_done.set()
            depot.complete_part(d.op_id, d.rank, d.failed, d.message, d.corrupt)

    copy = HostCopyEngine(done, Arenas(arena), threads=1, clock_ms=lambda: 0)
    depot.register_engine(E, name="", model="m", layout=LAYOUT, namespace="", style=UpdateStyle.VLLM, lease_ms=0, now_ms=0)
    copy.add_engine(E, LAYOUT)
    kv = FakeKv(LAYOUT, num_blocks=32)
    [req] = kv.share()
    copy.add_mapping(map_rank(E, LAYOUT, rank_spec(req)))
    depot.rank_mapped(E, 0)
    a = list(range(1000, 1065))  # 4 full blocks
    b = list(range(2000, 2129))  # 8 full blocks
    kv.write([0, 1, 2, 3, 4], a, range(65))
    depot.step(E, 1, [SlotUpdate(RequestId("a"), True, 0, 65, tokens_to_bytes(a), (0, 1, 2, 3, 4))], [], [], 0)
    depot.forward_done(E, 0, 1)
    await run_ops(depot, copy)
    order.clear()
    hold.set()
    kv.write(list(range(5, 14)), b, range(129))
    depot.step(E, 2, [SlotUpdate(RequestId("b"), True, 0, 129, tokens_to_bytes(b), tuple(range(5, 14)))], [], [], 0)
    depot.forward_done(E, 0, 2)  # the 8-block store may start now
    assert depot.lookup(E, RequestId("c"), tokens_to_bytes(a), cache_salt="", lora_name="", device_matched_tokens=0, pin_ms=0, now_ms=0).matched_tokens == 64
    kv.poison([20, 21, 22, 23])
    depot.step(E, 3, [SlotUpdate(RequestId("c"), True, 64, 1, tokens_to_bytes(a), (20, 21, 22, 23, 24), 0, 64)], [], [], 0)
    parts = depot.take_ready()
    assert [p.kind for p in parts] == [OpKind.STORE, OpKind.LOAD]
    copy.submit(parts[:1])
    assert await asyncio.to_thread(store_started.wait, 1.0)  # the store's copy has begun (and is held)
    copy.submit(parts[1:])
    await run_ops(depot, copy)
    assert kv.mismatches([20, 21, 22, 23], a, 64) == []
    depot.check_invariants()
    await copy.close()
    kv.close()
    return order, nice


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
def test_loads_and_stores_have_their_own_threads_stores_at_lower_priority(monkeypatch: pytest.MonkeyPatch) -> None:
    """A load is on the engine's critical path, a store is background work: a load submitted behind
    a store whose copy is stuck still runs and ends first (byte-exact), and stores are copied by
    threads `store_nice` (10) below the daemon's priority, loads at the daemon's own."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    order, nice = asyncio.run(load_and_store_order(monkeypatch))
    assert order == [OpKind.LOAD, OpKind.STORE]
    assert nice == {OpKind.LOAD: {base}, OpKind.STORE: {min(19, base + 10)}}


def test_a_late_checked_load_copies_first_and_then_fails_the_corrupt_block() -> None:
    """For an engine that takes load failures after its forward (vLLM): the copy engine says the
    bytes are in once every block is copied, corrupt ones included, then reports the block whose
    checksum failed; the intact block arrived byte-exact."""

    async def main() -> None:
        arena = HostArena(1 << 20)
        depot = Depot(DepotConfig(host_bytes=1 << 20, slab_bytes=1 << 20))
        seen: list[str] = []

        def copied(op_id: int, rank: int) -> None:
            seen.append("copied")
            depot.part_copied(OpId(op_id), rank)

        def done(parts: list[PartDone]) -> None:
            seen.extend("done" for _ in parts)
            for d in parts:
                depot.complete_part(d.op_id, d.rank, d.failed, d.message, d.corrupt)

        copy = HostCopyEngine(done, Arenas(arena), on_copied=copied, clock_ms=lambda: 0)
        depot.register_engine(E, name="", model="m", layout=LAYOUT, namespace="", style=UpdateStyle.VLLM, lease_ms=0, now_ms=0, late_load_checks=True)
        copy.add_engine(E, LAYOUT)
        kv = FakeKv(LAYOUT, num_blocks=8)
        [req] = kv.share()
        copy.add_mapping(map_rank(E, LAYOUT, rank_spec(req)))
        depot.rank_mapped(E, 0)
        toks = list(range(40, 73))
        kv.write([0, 1, 2], toks, range(33))
        depot.step(E, 1, [SlotUpdate(RequestId("a"), True, 0, 33, tokens_to_bytes(toks), (0, 1, 2))], [], [], 0)
        depot.forward_done(E, 0, 1)
        await run_ops(depot, copy)
        reg = depot.engines[E].domain.registry
        h1 = depot.slot(E, RequestId("a")).hashes[1]
        arena.tensor[reg.pool.byte_offset(reg.entries[h1].cell) + 100] ^= 0xFF
        assert depot.lookup(E, RequestId("b"), tokens_to_bytes(toks), cache_salt="", lora_name="", device_matched_tokens=0, pin_ms=0, now_ms=0).matched_tokens == 32
        kv.poison([4, 5])
        seen.clear()
        depot.step(E, 2, [SlotUpdate(RequestId("b"), True, 32, 1, tokens_to_bytes(toks), (4, 5, 6), 0, 32)], [], [], 0)
        events = await run_ops(depot, copy)
        [load] = [e.op for e in events if e.op.kind is OpKind.LOAD]
        assert seen == ["copied", "done"]
        assert load.check_late and load.failed == {1} and load.corrupt == {1}
        assert kv.mismatches([4], toks, 16) == []  # block 0 arrived byte-exact
        assert kv.mismatches([4, 5], toks, 32) != []  # block 1's bad bytes went in before the check caught them
        assert h1 not in reg.entries and depot.counters["checksum_failures"] == 1
        depot.check_invariants()
        await copy.close()
        kv.close()

    asyncio.run(main())


def _rss_kib(address: int) -> int:
    """Resident KiB of this process's mapping that contains `address` (from /proc/self/smaps)."""
    lines = open("/proc/self/smaps").read().splitlines()
    for i, line in enumerate(lines):
        span = line.split(" ", 1)[0]
        if "-" in span and all(c in "0123456789abcdef-" for c in span):
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= address < hi:
                rss = next(x for x in lines[i + 1 :] if x.startswith("Rss:"))
                return int(rss.split()[1])
    raise LookupError("no mapping holds the address")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")
def test_populate_faults_a_fresh_mapping_in() -> None:
    """The daemon maps an engine's KV memory afresh: no page is in its page tables until touched.
    populate() puts them all there up front (off the event loop), so first copies do not fault."""
    from kvdepotd.transfer.mapping import populate

    kv = FakeKv(LAYOUT, num_blocks=1024)  # 2 MiB
    try:
        [req] = kv.share()
        m = map_rank(E, LAYOUT, rank_spec(req))
        addr, size_kib = m.storages[0].address, m.storages[0].nbytes // 1024
        assert size_kib >= 1024 and _rss_kib(addr) < size_kib // 4
        stopped = threading.Event()
        stopped.set()
        assert not populate(m, stopped)  # a daemon shutting down does not wait for it
        assert _rss_kib(addr) < size_kib // 4
        assert populate(m)
        assert _rss_kib(addr) >= size_kib
    finally:
        kv.close()


def test_an_op_that_ends_while_its_copy_runs_is_reported_once_the_copy_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    """A load whose deadline passes while a copy thread is inside one of its blocks: the workers
    hear that it ended (and that its finished request is released) only once that thread has let go
    of the block, so the engine never hands blocks to another request while a copy writes them."""
    from kvdepotd.metrics import Metrics
    from kvdepotd.runtime import Runtime, WorkerChannel

    inside, let_go = threading.Event(), threading.Event()
    real_move = HostCopyEngine._move

    def move(self: HostCopyEngine, m: object, bid: int, hoff: int, nbytes: int, to_host: bool, want_hash: bool) -> int | None:
        if not to_host:  # a load's block: held inside the copy until the test lets go
            inside.set()
            let_go.wait(5)
        return real_move(self, m, bid, hoff, nbytes, to_host, want_hash)  # type: ignore[arg-type]

    monkeypatch.setattr(HostCopyEngine, "_move", move)

    async def main() -> None:
        depot = Depot(DepotConfig(host_bytes=1 << 20, slab_bytes=1 << 20))
        rt = Runtime(depot, Metrics(depot), HostArena(1 << 20), copy_threads=1)
        rt.register_engine(E, name="", model="m", layout=LAYOUT, namespace="", style=UpdateStyle.VLLM, lease_ms=600_000)
        kv = FakeKv(LAYOUT, num_blocks=8)
        [req] = kv.share()
        rt.add_mapping(map_rank(E, LAYOUT, rank_spec(req)))
        ch = WorkerChannel()
        rt.attach((E, 0), ch)
        toks = list(range(40, 73))
        kv.write([0, 1, 2], toks, range(33))
        rt.step(E, 1, StepColumns.of([SlotUpdate(RequestId("a"), True, 0, 33, tokens_to_bytes(toks), (0, 1, 2))]), [], [])
        rt.forward_done(E, 0, 1)
        while depot.ops.ops:
            await asyncio.sleep(0.01)
        assert (await rt.lookup(E, RequestId("b"), tokens_to_bytes(toks), cache_salt="", lora_name="", device_matched_tokens=0, pin_ms=0)).matched_tokens == 32
        plan = rt.step(E, 2, StepColumns.of([SlotUpdate(RequestId("b"), True, 32, 1, tokens_to_bytes(toks), (4, 5, 6), 0, 32)]), [RequestId("a")], [])
        [load] = plan.ops
        while not inside.is_set():
            await asyncio.sleep(0.01)
        while not ch.queue.empty():
            ch.queue.get_nowait()
        rt.step(E, 3, StepColumns.of([]), [RequestId("b")], [])  # b finishes (cancelled) while its load copies
        depot.expire(load.deadline_ms + 1)  # and the load's deadline passes
        rt.pump()
        await asyncio.sleep(0.1)
        early = []
        while not ch.queue.empty():
            early.append(ch.queue.get_nowait())
        assert early == [], early  # the copy thread is still inside a block of the engine's
        let_go.set()
        events = []
        for _ in range(100):
            while not ch.queue.empty():
                events.append(ch.queue.get_nowait())
            if any(e.released for e in events):
                break
            await asyncio.sleep(0.01)
        assert [c.op_id for e in events for c in e.completed] == [load.op_id]
        assert [r for e in events for r in e.released] == ["b"]
        await rt.stop_engines()
        kv.close()

    asyncio.run(main())
