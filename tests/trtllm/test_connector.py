"""kvdepot.trtllm end to end: TensorRT-LLM's scheduling loop (the stand-in executor) over a real
daemon and real KV memory, every position's KV checked on every rank (bad_kv), the daemon's own
counters saying what it planned."""

from __future__ import annotations

import logging
import signal
import threading
import time

import pytest

from kvdepot.testing import DaemonProcess, free_port
from kvdepot.testing.trtllm import LlmRequestState
from kvdepot.testing.trtllm_executor import StandInExecutor
from tests.trtllm.conftest import BS, Make, counters, generated, mapped_ranks, prompt, wait_until

# Who copies blocks between the engine's KV memory and the host tier: the daemon (it maps the
# engine's memory), or the engine's workers themselves (kvdepot.engine_copy: a GPU pool no API can
# export), on CPU tensors here, byte for byte the same checks.
COPY = pytest.mark.parametrize("copy_mode", ["auto", "engine"])


def served_twice(ex: StandInExecutor, p: list[int], max_new: int = 4) -> tuple[int, int]:
    """Runs `p`, drops the engine's own prefix cache, runs it again; both outputs must agree and
    every position's KV be right. Returns the two request ids."""
    a = ex.add(p, max_new)
    ex.run()
    ex.reset_prefix_cache()
    b = ex.add(p, max_new)
    ex.run()
    assert generated(ex, b.request_id) == generated(ex, a.request_id)
    assert ex.bad_kv[a.request_id] == [] and ex.bad_kv[b.request_id] == []
    return a.request_id, b.request_id


def test_new_request_after_a_gpu_hit_stores_only_the_blocks_after_it(make: Make) -> None:
    """The seed's bug: a new request whose first blocks TensorRT-LLM matched on the GPU must not
    have them offloaded again. The daemon is emptied after the first request, so a connector that
    sent the engine's hit as computed tokens would have all six blocks planned again."""
    ex = make()
    common = prompt(64)
    first = ex.add(common + prompt(36, start=500))
    ex.run()
    assert counters(ex)["store_blocks_planned"] == 6
    ex.scheduler.side.client.clear()  # type: ignore[union-attr]
    second = ex.add(common + prompt(36, start=900))
    ex.run()
    assert ex.matched[second.request_id] == (64, 0, False)  # TensorRT-LLM's own hit: blocks 0-3
    c = counters(ex)
    assert c["store_blocks_planned"] == 6 + 2  # blocks 4 and 5 only
    assert c["store_blocks_already_cached"] == 0
    assert ("2", 64, 0, 64) in ex.scheduler.side.admissions  # L and E sent apart: computed_position counts the GPU hit only
    assert ex.bad_kv == {first.request_id: [], second.request_id: []}


@COPY
def test_daemon_hit_loaded_synchronously_is_byte_identical(make: Make, copy_mode: str) -> None:
    ex = make(copy_mode=copy_mode)
    a, b = served_twice(ex, prompt(100))
    assert ex.matched[b] == (0, 96, False)
    c = counters(ex)
    assert c["loaded_blocks"] == 6 and c["stored_blocks"] == 6 and c["store_blocks_planned"] == 6  # nothing stored twice


@COPY
def test_daemon_hit_loaded_asynchronously_is_byte_identical(make: Make, monkeypatch: pytest.MonkeyPatch, copy_mode: str) -> None:
    """The request is left out of the scheduler output while it loads and comes back as new with
    its whole prompt: the slot continues (the daemon refuses a new row whose tokens do not match)."""
    monkeypatch.setenv("KVDEPOT_LOAD_ASYNC", "true")
    ex = make(copy_mode=copy_mode)
    p = prompt(100)
    a = ex.add(p)
    ex.run()
    ex.reset_prefix_cache()
    b = ex.add(p)
    ex.run()
    assert ex.matched[b.request_id] == (0, 96, True) and ex.parked[b.request_id] >= 1
    assert ("2", 0, 96, 96) in ex.scheduler.side.admissions  # announced when its load started: L+E computed, nothing scheduled
    assert generated(ex, b.request_id) == generated(ex, a.request_id)
    assert ex.bad_kv == {a.request_id: [], b.request_id: []}
    c = counters(ex)
    assert c["loaded_blocks"] == 6 and c["store_blocks_planned"] == 6


@COPY
def test_chunked_prefill(make: Make, copy_mode: str) -> None:
    """Chunks of 32 tokens: stores follow the chunks, a later hit loads them, the tail is computed."""
    ex = make(chunk_size=32, copy_mode=copy_mode)
    a, b = served_twice(ex, prompt(150))
    assert ex.matched[b] == (0, 144, False)
    assert counters(ex)["store_blocks_planned"] == 9


def test_generation_phase_stores(make: Make) -> None:
    """Blocks the generation fills are stored too: a later request that continues the conversation
    loads the prompt and the generated blocks."""
    ex = make()
    a = ex.add(prompt(40), 50)
    ex.run()
    tokens = ex.done[a.request_id].get_tokens(0)
    assert counters(ex)["store_blocks_planned"] == (len(tokens) - 1) // BS  # the last sampled token has no KV
    ex.reset_prefix_cache()
    b = ex.add(tokens + [7, 8, 9], 2)
    ex.run()
    assert ex.matched[b.request_id] == (0, (len(tokens) - 1) // BS * BS, False)
    assert ex.bad_kv[b.request_id] == []


@pytest.mark.parametrize("load_async", [False, True])
@COPY
def test_two_ranks(make: Make, monkeypatch: pytest.MonkeyPatch, load_async: bool, copy_mode: str) -> None:
    """Tensor parallel 2: each rank its own pool and worker, one scheduler; every rank's KV right."""
    monkeypatch.setenv("KVDEPOT_LOAD_ASYNC", str(load_async).lower())
    ex = make(world_size=2, copy_mode=copy_mode)
    a, b = served_twice(ex, prompt(100))
    assert ex.matched[b] == (0, 96, load_async)
    c = counters(ex)
    assert c["loaded_blocks"] == 6 and c["stored_blocks"] == 6


def test_an_async_load_completes_only_once_every_rank_returned_it(make: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDEPOT_LOAD_ASYNC", "true")
    ex = make(world_size=2)
    p = prompt(100)
    ex.add(p)
    ex.run()
    ex.reset_prefix_cache()
    slow = ex.workers[1]
    real = slow.get_finished
    held: list[int] = []

    def late(saved: list[int], loading: list[int]) -> tuple[list[int], list[int]]:
        s, loaded = real(saved, loading)
        held.extend(loaded)
        if len(held) and ex.iterations < hold_until:
            return s, []
        out, held[:] = list(held), []
        return s, out

    slow.get_finished = late  # type: ignore[method-assign]
    b = ex.add(p)
    hold_until = 10**9
    end = time.monotonic() + 10
    while not held:  # rank 0 has returned it (its load ended): rank 1 holds it back
        ex.step()
        assert time.monotonic() < end
        time.sleep(0.002)
    for _ in range(5):
        ex.step()
        assert b.state is LlmRequestState.DISAGG_GENERATION_TRANS_IN_PROGRESS  # parked until every rank returned it
    hold_until = 0
    ex.run()
    assert ex.bad_kv[b.request_id] == []


@COPY
def test_preemption_and_readmission(make: Make, copy_mode: str) -> None:
    """TensorRT-LLM replays a request whose allocation died: asked again, it loads what the daemon
    holds into its new blocks and finishes with the same output. Its first incarnation loaded from
    the daemon too; those ops had settled, so nothing waits on them."""
    ex = make(copy_mode=copy_mode)
    p = prompt(100)
    ref = ex.add(p, 8)
    ex.run()
    ex.reset_prefix_cache()
    r = ex.add(p, 8)
    while len(r.get_tokens(0)) < 103:  # loaded, context done, two tokens generated
        ex.step()
    assert ex.matched[r.request_id] == (0, 96, False)
    ex.preempt(r)
    t0 = time.monotonic()
    ex.run()
    assert time.monotonic() - t0 < 5
    assert ex.matched[r.request_id] == (0, 96, False)  # loaded again into its new blocks
    assert generated(ex, r.request_id) == generated(ex, ref.request_id)
    assert ex.bad_kv[r.request_id] == []
    c = counters(ex)
    assert c["preemptions"] == 1 and c["loaded_blocks"] == 12


def test_k_only_pool_round_trips_and_never_meets_k_and_v_blocks(make: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    """kv_factor 1 (MLA keeps K only): byte-exact both ways; an engine of the same model with K and
    V is in another layout class and never gets those blocks."""
    k_only = make(kv_factor=1, model="mla-model")
    assert k_only.workers[0].side.layout.kv_factor == 1
    served_twice(k_only, prompt(100))
    kv = make(model="mla-model")
    r = kv.add(prompt(100))
    kv.run()
    assert kv.matched[r.request_id] == (0, 0, False)
    assert kv.bad_kv[r.request_id] == []


def test_without_mpi_a_rank_joins_on_the_first_steps_metadata(make: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under Ray (no MPI) the key rank 0 broadcasts at registration reaches no other rank: rank 1
    joins once the first step's metadata names it, and until its memory is mapped the daemon
    offers no hit and stores nothing (a store would miss rank 1's half of each block)."""
    monkeypatch.setattr("kvdepot.trtllm.worker.broadcast_from_rank0", lambda obj: obj)  # each rank its own
    ex = make(world_size=2)
    assert ex.workers[0].side.key and not ex.workers[1].side.key
    first = ex.add(prompt(100, start=5000))
    ex.run()
    assert ex.bad_kv[first.request_id] == []
    key = ex.scheduler.side.key
    wait_until(lambda: ex.workers[1].side.key == key and mapped_ranks(ex) == [0, 1])
    c = counters(ex)
    assert c["store_blocks_planned"] == 0 and c["store_blocks_unmapped"] == 6
    served_twice(ex, prompt(100))  # both ranks mapped now: stored, then loaded, every rank's KV right


@COPY
def test_corrupted_block_is_recomputed(monkeypatch: pytest.MonkeyPatch, make: Make, copy_mode: str) -> None:
    """A block whose checksum fails on the way in: TensorRT-LLM computes from it instead (one rank:
    the request's context_current_position goes back), never runs on wrong KV, and the daemon stores
    what it computed."""
    d = DaemonProcess(args=["--host-gib", "0.25", "--fault-corrupt-loads", "2"]).start()
    try:
        ex = make(address=d.unix if copy_mode == "engine" else d.tcp, copy_mode=copy_mode)
        a = ex.add(prompt(100))
        ex.run()
        ex.reset_prefix_cache()
        b = ex.add(prompt(100))
        ex.run()
        assert generated(ex, b.request_id) == generated(ex, a.request_id)
        assert ex.bad_kv[b.request_id] == []
        assert ex.workers[0].side.load_failures == 2
        c = counters(ex)
        assert c["checksum_failures"] == 2 and c["load_failed_blocks"] == 2
        assert c["stored_blocks"] == 6 + 2, c  # the two it computed again are stored again
    finally:
        d.stop()


@pytest.mark.parametrize("load_async", [False, True])
@COPY
def test_daemon_killed_during_a_load(monkeypatch: pytest.MonkeyPatch, make: Make, load_async: bool, copy_mode: str) -> None:
    """The daemon dies while it copies a load: the engine stops waiting within a second of it (not
    at the op deadline) and computes what did not arrive (one rank: the request is rewound)."""
    monkeypatch.setenv("KVDEPOT_LOAD_ASYNC", str(load_async).lower())
    d = DaemonProcess(args=["--host-gib", "0.25", "--fault-load-delay-ms", "3000", "--op-timeout-ms", "20000"]).start()
    try:
        ex = make(address=d.unix if copy_mode == "engine" else d.tcp, copy_mode=copy_mode)
        a = ex.add(prompt(100))
        ex.run()
        ex.reset_prefix_cache()
        b = ex.add(prompt(100))
        assert d.proc is not None
        proc = d.proc

        def kill_once_admitted() -> None:  # while the load waits in the daemon (3 s)
            end = time.monotonic() + 10
            while b.request_id not in ex.matched and time.monotonic() < end:
                time.sleep(0.01)
            time.sleep(0.3)
            proc.send_signal(signal.SIGKILL)

        threading.Thread(target=kill_once_admitted, daemon=True).start()
        t0 = time.monotonic()
        ex.run(timeout_s=15)
        assert ex.matched[b.request_id][1] == 96
        assert time.monotonic() - t0 < 5  # well short of the op deadline (20 s)
        assert generated(ex, b.request_id) == generated(ex, a.request_id)
        assert ex.bad_kv[b.request_id] == []
    finally:
        d.stop(signal.SIGKILL)


def test_engine_side_copy_through_the_disk_tier_and_a_daemon_restart(make: Make, tmp_path: pytest.TempPathFactory) -> None:
    """An engine whose workers copy its blocks keeps them in its namespace's own host memory: they
    go to disk and come back from it like any block, also after a daemon restart (its workers
    fetch the new daemon's memory when they register again), byte for byte."""
    args = ["--host-gib", "0.25", "--disk-dir", str(tmp_path), "--disk-gib", "0.05", "--disk-slab-mib", "1", "--disk-admit-after", "1", "--disk-policy", "write-through"]
    d = DaemonProcess(args=args).start()
    try:
        ex = make(address=d.unix, copy_mode="engine", model="ec-disk")
        p = prompt(100)
        a = ex.add(p)
        ex.run()
        c = ex.scheduler.side.client
        assert c is not None
        wait_until(lambda: c.stats().counters["disk_written_blocks"] >= 6)
        c.clear("host")
        ex.reset_prefix_cache()
        b = ex.add(p)
        ex.run()
        assert ex.matched[b.request_id] == (0, 96, False) and ex.bad_kv[b.request_id] == []
        assert c.stats().counters["disk_read_blocks"] >= 6
        assert d.stop() == 0
        d = DaemonProcess(args=args, unix=d.unix, tcp=d.tcp).start()  # its disk tier recovers the blocks
        wait_until(lambda: mapped_ranks(ex) == [0], timeout_s=20)  # registered again, the new daemon's memory fetched
        ex.reset_prefix_cache()
        again = ex.add(p)
        ex.run()
        assert ex.matched[again.request_id] == (0, 96, False) and ex.bad_kv[again.request_id] == []
    finally:
        d.stop()
    assert generated(ex, b.request_id) == generated(ex, a.request_id) == generated(ex, again.request_id)


def test_finished_request_keeps_its_blocks_while_its_stores_run(make: Make) -> None:
    """request_finished says True while the daemon still copies out of the request's blocks: they
    stay allocated until every rank returns the request as saved, which is after the stores."""
    d = DaemonProcess(args=["--host-gib", "0.25", "--fault-store-delay-ms", "400"]).start()
    try:
        ex = make(address=d.tcp)
        r = ex.add(prompt(100), 1)
        saving_steps = 0
        while r.request_id not in ex.done:
            ex.step()
            if r.state is LlmRequestState.DISAGG_CONTEXT_TRANS_IN_PROGRESS:
                saving_steps += 1
                assert r.request_id in ex.tables  # not freed
            time.sleep(0.01)
        assert counters(ex)["stored_blocks"] == 6  # freed only once the stores had ended (they take 400 ms)
        assert saving_steps > 2
    finally:
        d.stop()


@COPY
@pytest.mark.parametrize("asks", [True, False])
def test_a_request_cancelled_during_its_load_keeps_its_blocks_until_the_load_ended(monkeypatch: pytest.MonkeyPatch, make: Make, copy_mode: str, asks: bool) -> None:
    """A request cancelled while its (slowed) load still copies. Asked (request_finished), the
    connector must keep its blocks; not asked (TensorRT-LLM's newest release keeps a request parked
    for an async load until the load is reported), the connector must report the load only once it
    ended. Were the blocks freed sooner, the next request would get them, and the late load would
    overwrite that request's KV. The pool holds one request, so the next one gets exactly these."""
    monkeypatch.setenv("KVDEPOT_LOAD_ASYNC", "true")
    d = DaemonProcess(args=["--host-gib", "0.25", "--fault-load-delay-ms", "1500"]).start()
    try:
        ex = make(address=d.unix if copy_mode == "engine" else d.tcp, copy_mode=copy_mode, num_blocks=7)
        a = ex.add(prompt(100))
        ex.run()
        ex.reset_prefix_cache()
        b = ex.add(prompt(100))
        ex.step()  # admitted and parked: its load waits 1.5 s in the daemon before it copies
        assert b.state is LlmRequestState.DISAGG_GENERATION_TRANS_IN_PROGRESS and ex.matched[b.request_id] == (0, 96, True)
        t0 = time.monotonic()
        ex.cancel(b, asks=asks)
        if asks:
            assert b.state is LlmRequestState.DISAGG_CONTEXT_TRANS_IN_PROGRESS  # request_finished said True: blocks kept
        c = ex.add(prompt(100, start=7000), 4)
        while c.request_id not in ex.bad_kv:  # c's context: it runs in b's blocks once they are free
            ex.step()
            time.sleep(0.002)
            assert time.monotonic() - t0 < 10
        time.sleep(2.0)  # past the load's delay: a load still running would have written by now
        tokens = c.get_tokens(0)
        assert ex.kv.mismatches(ex.tables[c.request_id], tokens, len(tokens) - 1) == []  # every position of c
        assert sorted(ex.tables[c.request_id]) == list(range(7))
        ex.run()
        assert ex.bad_kv[c.request_id] == [] and ex.bad_kv[a.request_id] == [] and b.request_id in ex.done
        counts = counters(ex)
        assert counts["load_blocks_planned"] == 6 and counts["load_failed_blocks"] == 0
    finally:
        d.stop()


def test_a_live_request_sharing_its_prefix_blocks_is_not_taken_for_a_freed_one(make: Make) -> None:
    """TensorRT-LLM gives a new request the blocks of a live one's prefix (block reuse): those are
    shared, not freed, so the live request goes on being served and stored as usual."""
    ex = make()
    first = ex.add(prompt(64) + prompt(40, start=500), 30)
    ex.step()  # its context: blocks 0-3 are full and reusable while it decodes
    second = ex.add(prompt(64) + prompt(40, start=900), 4)
    ex.run()
    assert ex.matched[second.request_id][0] == 64  # the engine's own hit: first's blocks 0-3, shared
    assert set(ex.tables.get(first.request_id, ())) == set() and first.request_id in ex.done
    assert ex.bad_kv[first.request_id] == [] and ex.bad_kv[second.request_id] == []
    # first: 8 full blocks over its 133 computed tokens; second: blocks 4 and 5 only (0-3 are first's)
    assert not ex.scheduler.side.reused and counters(ex)["store_blocks_planned"] == 8 + 2


@COPY
def test_a_request_cancelled_as_tensorrt_llm_cancels_never_lets_its_stores_read_another_requests_kv(
    monkeypatch: pytest.MonkeyPatch, make: Make, copy_mode: str
) -> None:
    """TensorRT-LLM frees a cancelled request's blocks without asking the connector, while the
    stores its last forward planned may still be copying out of them (slowed here). The next
    request gets those very blocks: its forward waits until those stores ended (else they would
    store its KV under the cancelled prompt's hashes), and a fresh engine then loads the cancelled
    prompt's blocks byte-exact."""
    d = DaemonProcess(args=["--host-gib", "0.25", "--fault-store-delay-ms", "800"]).start()
    try:
        ex = make(address=d.unix if copy_mode == "engine" else d.tcp, copy_mode=copy_mode, num_blocks=7)
        a = ex.add(prompt(100), 50)
        while len(a.get_tokens(0)) < 101:  # its context ran: the stores of blocks 0-5 wait 800 ms to copy
            ex.step()
        ex.cancel(a, asks=False)
        b = ex.add(prompt(100, start=7000), 4)
        ex.run()
        assert b.request_id in ex.done and ex.bad_kv[b.request_id] == []
        fresh = make(address=d.unix if copy_mode == "engine" else d.tcp, copy_mode=copy_mode, model=ex.llm_args.model)
        c = fresh.add(prompt(100))
        fresh.run()
        assert fresh.matched[c.request_id] == (0, 96, False)
        assert fresh.bad_kv[c.request_id] == []  # what was stored under a's prompt is a's KV
    finally:
        d.stop()


@pytest.mark.parametrize("load_async", [False, True])
def test_a_cache_manager_that_takes_less_than_offered(make: Make, monkeypatch: pytest.MonkeyPatch, load_async: bool) -> None:
    """KVCacheManagerV2 may take fewer tokens than the connector offered (here 24 fewer, which ends
    mid-block) and compute the rest. Every position of the engine's KV is right, the daemon stores
    only blocks the engine had computed (in 32-token chunks, its count of computed tokens must not
    run ahead), and a fresh engine loads all of it byte-exact."""
    monkeypatch.setenv("KVDEPOT_LOAD_ASYNC", str(load_async).lower())
    ex = make(chunk_size=32, honour=lambda E: max(0, E - 24))
    p = prompt(150)
    a = ex.add(p)
    ex.run()
    ex.reset_prefix_cache()
    longer = p + prompt(66, start=5000)  # 216 tokens: blocks 9-12 are new
    b = ex.add(longer)
    ex.run()
    assert ex.matched[b.request_id] == (0, 120, load_async)  # 144 offered, 120 taken: block 7 loaded, half recomputed
    assert ex.bad_kv[a.request_id] == [] and ex.bad_kv[b.request_id] == []
    assert counters(ex)["store_blocks_planned"] == 9 + 4
    fresh = make(model=ex.llm_args.model)
    c = fresh.add(longer)
    fresh.run()
    assert fresh.matched[c.request_id] == (0, 208, load_async) and fresh.bad_kv[c.request_id] == []


@pytest.mark.parametrize("field", ["multimodal_hashes", "multimodal_positions", "prompt_embedding_table"])
def test_a_multimodal_request_never_reaches_the_daemon(make: Make, field: str) -> None:
    """Its tokens do not name its KV (image placeholders, embeddings): no lookup, no slot, nothing
    stored. The fields are the C++ binding's, which get_num_new_matched_tokens receives."""
    ex = make()
    r = ex.add(prompt(100))
    setattr(r, field, [[1, 2, 3, 4]] if field == "multimodal_hashes" else [5, 9])
    ex.run()
    assert ex.bad_kv[r.request_id] == []
    c = counters(ex)
    assert c["lookups"] == 0 and c["slots_created"] == 0 and c["store_blocks_planned"] == 0


def test_salted_requests_share_blocks_only_with_their_salt(make: Make) -> None:
    """A salt keeps requests with the same tokens apart: the newest releases' cache_salt (a
    string) and the binding's cache_salt_id (an integer) alike."""
    ex = make()
    p = prompt(100)
    for kw in ({"cache_salt_id": 7}, {"cache_salt": "tenant-a"}):
        first = ex.add(p, **kw)  # type: ignore[arg-type]
        ex.run()
        ex.reset_prefix_cache()
        other = ex.add(p, **({"cache_salt_id": 8} if "cache_salt_id" in kw else {"cache_salt": "tenant-b"}))  # type: ignore[arg-type]
        ex.run()
        ex.reset_prefix_cache()
        same = ex.add(p, **kw)  # type: ignore[arg-type]
        ex.run()
        ex.reset_prefix_cache()
        assert ex.matched[other.request_id][1] == 0 and ex.matched[same.request_id][1] == 96, kw
        assert all(ex.bad_kv[r.request_id] == [] for r in (first, other, same))


def test_server_url_in_tensorrt_llms_form_reaches_the_daemon(daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """kv_connector_config.server_url as TensorRT-LLM documents it: tcp://host:port."""
    from kvdepot.testing.trtllm import KvCacheConfig, KvCacheConnectorConfig, TorchLlmArgs
    from tests.trtllm.conftest import layout

    monkeypatch.delenv("KVDEPOT_ADDRESS", raising=False)
    cfg = KvCacheConnectorConfig(connector_module="kvdepot.trtllm", connector_scheduler_class="KvDepotScheduler",
                                 connector_worker_class="KvDepotWorker", server_url="tcp://" + daemon.tcp)
    args = TorchLlmArgs(model="server-url-model", kv_cache_config=KvCacheConfig(tokens_per_block=BS), kv_connector_config=cfg)
    ex = StandInExecutor(layout(), 64, args)
    try:
        served_twice(ex, prompt(100))
        assert ex.scheduler.side.client.address == daemon.tcp
    finally:
        ex.close()


def test_a_cache_of_several_layer_groups_is_refused_at_start(daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """KVCacheManagerV2 registers a cache through register_kv_cache_layout: one pool is served as
    always; a cache of several layer groups (variable sliding windows) is refused when the engine
    starts, said once, and the engine runs without kvdepot (its per-group callbacks are no-ops)."""
    import torch

    from kvdepot.testing.trtllm import KvCacheConfig, KvCacheLayout, LlmRequest, TorchLlmArgs
    from kvdepot.trtllm import KvDepotScheduler, KvDepotWorker

    monkeypatch.setenv("KVDEPOT_ADDRESS", daemon.tcp)
    pool = torch.zeros(8, 2, 2, 16 * BS, dtype=torch.float16)
    for groups, served in (([[pool], [pool]], False), ([[pool]], True)):
        args = TorchLlmArgs(model=f"vswa-{len(groups)}", kv_cache_config=KvCacheConfig(tokens_per_block=BS))
        sched, worker = KvDepotScheduler(args), KvDepotWorker(args)
        try:
            caplog.clear()
            with caplog.at_level(logging.ERROR, logger="kvdepot.trtllm"):
                worker.register_kv_cache_layout(KvCacheLayout(groups))
                sched.wait_for_initialization()
            assert ("not one pool (2 layer groups)" in caplog.text) != served
            assert (sched.side.client is not None) == served
            r = LlmRequest(1, prompt(100), 4)
            assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
            sched.update_state_after_alloc_by_layer_group(r, [list(range(7))] * len(groups))
            assert sched.request_finished_by_layer_group(r, [list(range(7))] * len(groups)) is False
        finally:
            sched.shutdown()
            worker.shutdown()


def test_an_engine_the_connector_cannot_serve_runs_without_it(monkeypatch: pytest.MonkeyPatch, daemon: DaemonProcess, caplog: pytest.LogCaptureFixture) -> None:
    """Pipeline parallelism (which TensorRT-LLM refuses for connectors anyway), or no daemon at the
    address: the connector says why once and the engine computes everything itself."""
    from kvdepot.testing.trtllm import KvCacheConfig, TorchLlmArgs
    from tests.trtllm.conftest import layout

    monkeypatch.setenv("KVDEPOT_ADDRESS", daemon.tcp)
    with caplog.at_level(logging.ERROR, logger="kvdepot.trtllm"):
        ex = StandInExecutor(layout(), 64, TorchLlmArgs(model="pp-model", kv_cache_config=KvCacheConfig(tokens_per_block=BS), pipeline_parallel_size=2))
        try:
            r = ex.add(prompt(100))
            ex.run()
            assert ex.bad_kv[r.request_id] == [] and ex.scheduler.side.client is None
        finally:
            ex.close()
    assert caplog.text.count("pipeline parallelism is not supported") == 2  # the scheduler and the worker
    monkeypatch.setenv("KVDEPOT_ADDRESS", f"127.0.0.1:{free_port()}")
    t0 = time.monotonic()
    ex = StandInExecutor(layout(), 64, TorchLlmArgs(model="nobody", kv_cache_config=KvCacheConfig(tokens_per_block=BS)))
    try:
        for _ in range(3):
            r = ex.add(prompt(100))
            ex.run()
            assert ex.bad_kv[r.request_id] == [] and ex.matched[r.request_id] == (0 if r.request_id == 1 else 96, 0, False)
    finally:
        ex.close()
    assert time.monotonic() - t0 < 10
