"""The remote tier on a cluster as fleets run one: 3 primaries with a replica each, at the shipped
defaults. A primary killed mid-load fails over to its replica and reads resume without touching a
daemon; slots moved between primaries under traffic (MOVED, ASK), and a node added, cost no wrong
bytes and no lasting misses."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from kvdepot.testing.valkey import ValkeyCluster
from tests.integration.conftest import close_engine, wait_counter
from tests.integration.test_remote_tier import PROMPT, engine, hashes_of, node, stop_clean, stored_on

pytestmark = pytest.mark.integration


@pytest.fixture
def replicated() -> Iterator[ValkeyCluster]:
    with ValkeyCluster(primaries=3, replicas=1, maxmemory="64mb") as vc:
        yield vc


def test_a_primary_killed_mid_load_fails_over_to_its_replica_and_reads_resume(replicated: ValkeyCluster) -> None:
    vc = replicated
    a, b = node(vc), node(vc, "--remote-prefetch", "false")  # the reads at the Step: after the kill
    try:
        first = stored_on(a)
        vc.wait_synced()
        e = engine(b)
        lookup = e.client.lookup
        victim = vc.node_of(next(k for k in vc.keys("kvdepot:*")))

        def lookup_then_kill(*args: object, **kw: object) -> object:
            res = lookup(*args, **kw)  # type: ignore[arg-type]
            assert res.matched_tokens == 40 * 16
            vc.kill(victim)  # a primary holding some of the prompt dies between the Lookup and its reads
            return res

        e.client.lookup = lookup_then_kill  # type: ignore[method-assign]
        out = e.generate(PROMPT, max_new_tokens=3)
        e.client.lookup = lookup  # type: ignore[method-assign]
        assert out.output == first and e.stats.kv_mismatched_tokens == 0
        close_engine(e)
        vc.wait_serving()  # the replica took over its slots
        assert len(vc.keys("kvdepot:*")) >= 40  # and holds what its primary had
        # The same daemon, not restarted, reads everything again: the dead primary's blocks from its replica.
        f = engine(b)
        f.client.clear("host")
        f.client.clear("disk")
        end = time.monotonic() + 30
        while True:
            f.reset_prefix_cache()
            before = f.stats.loaded_tokens
            got = f.generate(PROMPT, max_new_tokens=3)
            assert got.output == first and f.stats.kv_mismatched_tokens == 0
            if f.stats.loaded_tokens - before == 40 * 16:
                break  # every block read from the store, the dead primary's from its promoted replica
            assert time.monotonic() < end, "reads did not resume after the failover"
            f.client.clear("host")
            f.client.clear("disk")
            time.sleep(0.5)
        close_engine(f)
    finally:
        stop_clean(a, b)


def test_slots_moved_to_an_added_node_under_traffic_cost_no_wrong_bytes(replicated: ValkeyCluster) -> None:
    """A new primary joins and the slots that hold the prompt's blocks move to it, key by key,
    while engines on both nodes keep loading and storing: MOVED and ASK on the way, and afterwards
    every block is read from where it lives now."""
    vc = replicated
    a, b = node(vc), node(vc)
    errors: list[BaseException] = []
    stop = threading.Event()
    try:
        first = stored_on(a)
        moving = sorted({vc.slot_of(k) for k in vc.keys("kvdepot:*") if vc.node_of(k) == 0})
        assert moving

        def traffic() -> None:
            try:
                n = 0
                ea = engine(a)
                while not stop.is_set():
                    other = list(range(200_000 + 1000 * n, 200_000 + 1000 * n + 8 * 16 + 1))  # new blocks: writes
                    ea.generate(other, max_new_tokens=1)
                    n += 1
                    assert ea.stats.kv_mismatched_tokens == 0
                close_engine(ea)
            except BaseException as err:  # reported by the test
                errors.append(err)

        t = threading.Thread(target=traffic)
        t.start()
        new = vc.add_node()
        eb = engine(b)
        moved = 0
        for k in range(0, len(moving), 4):  # reads of the prompt between slot moves
            moved += vc.move_slots(moving[k : k + 4], 0, new)
            eb.client.clear("host")
            eb.client.clear("disk")
            eb.reset_prefix_cache()
            assert eb.generate(PROMPT, max_new_tokens=3).output == first and eb.stats.kv_mismatched_tokens == 0
        stop.set()
        t.join(60)
        assert not errors, errors
        assert moved >= len(moving)
        assert all(vc.node_of(k) == new for k in vc.keys("kvdepot:*") if vc.slot_of(k) in moving)
        # Settled: every block of the prompt is read again, from wherever it lives now.
        eb.client.clear("host")
        eb.client.clear("disk")
        eb.reset_prefix_cache()
        before = eb.client.stats().counters["remote_read_blocks"]
        assert eb.generate(PROMPT, max_new_tokens=3).output == first and eb.stats.kv_mismatched_tokens == 0
        assert eb.client.stats().counters["remote_read_blocks"] - before == 40
        wait_counter(eb.client, "remote_read_blocks", before + 40)
        close_engine(eb)
        assert hashes_of(PROMPT)
    finally:
        stop.set()
        stop_clean(a, b)
