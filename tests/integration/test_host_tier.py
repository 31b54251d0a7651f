"""Real KV bytes between FakeEngine's tensors and the daemon's host tier, over a process boundary."""

from __future__ import annotations

import glob
import os
import signal
from collections.abc import Iterator

import grpc
import pytest

from kvdepot import DepotClient, KvLayout
from kvdepot.handles import share_cpu_tensors
from kvdepot.testing import DaemonProcess, FakeEngine
from kvdepot.v1 import kvdepot_pb2 as pb
from tests.integration.conftest import attached_engine, close_engine, served_again

pytestmark = pytest.mark.integration
KINDS = ["vllm_cpu", "vllm_flash", "contiguous"]


def layout(kind: str, world_size: int = 1) -> KvLayout:
    return KvLayout(num_layers=3, num_kv_heads=2, head_size=8, dtype="float16", block_size=16, world_size=world_size, kind=kind)


@pytest.fixture(scope="module")
def depot() -> Iterator[DaemonProcess]:
    d = DaemonProcess(args=["--host-gib", "0.0625", "--slab-mib", "1"]).start()  # small slabs: many layout classes
    yield d
    assert d.stop() == 0
    assert "Traceback" not in d.log(), d.log()


def engine(d: DaemonProcess, kind: str, model: str = "kv-model", world_size: int = 1, **kw: object) -> FakeEngine:
    return attached_engine(d, layout(kind, world_size), model + "-" + kind, world_size=world_size, **kw)


close = close_engine


@pytest.mark.parametrize("memory", ["path", "handoff"])
@pytest.mark.parametrize("kind", KINDS)
def test_repeated_prompt_is_loaded_byte_exact(depot: DaemonProcess, kind: str, memory: str) -> None:
    """Over TCP the engine's KV is a /dev/shm file the daemon opens by path; at the unix: address
    it is a memfd handed over on the handoff socket (kvdepotd.handoff), and no file is made."""
    files = set(glob.glob(f"/dev/shm/kvdepot-{os.getpid()}-*"))
    e = engine(depot, kind, model=f"kv-model-{memory}", address=depot.unix if memory == "handoff" else depot.tcp)
    assert e.kv is not None and bool(e.kv.fds) == (memory == "handoff") != bool(e.kv.paths)
    assert (set(glob.glob(f"/dev/shm/kvdepot-{os.getpid()}-*")) == files) == (memory == "handoff")
    assert served_again(e, list(range(300, 500)), max_new_tokens=3) == 192
    e.check()
    close(e)
    if memory == "handoff":
        assert "(memory handed over)" in depot.log()


def test_a_daemon_serving_cpu_engines_never_loads_torch() -> None:
    """With the native block copy (the build `pip install .` makes) CPU memory is mapped and copied
    without torch: the daemon never loads it (a second of start-up, ~200 MiB, and a stall of the
    event loop while its library initializes), not even once an engine's blocks moved."""
    from kvdepotd.storage.lazy_torch import NVIDIA_DEVICE
    from kvdepotd.transfer import blockcopy

    if not blockcopy.available or os.path.exists(NVIDIA_DEVICE):
        pytest.skip("torch copies CPU blocks without the native block copy; a GPU machine pins the host tier with it")
    with DaemonProcess(args=["--host-gib", "0.0625"]) as d:
        e = engine(d, "vllm_cpu")
        assert served_again(e, list(range(1000, 1200)), max_new_tokens=3) == 192
        e.check()
        close(e)
        assert d.proc is not None
        with open(f"/proc/{d.proc.pid}/maps") as f:
            assert "libtorch" not in f.read()


def test_mixed_local_and_daemon_blocks_byte_exact(depot: DaemonProcess) -> None:
    e = engine(depot, "vllm_cpu", model="mixed")
    p = list(range(7000, 7080)) + [1, 2, 3]
    e.generate(p[:32] + [5] * 20, max_new_tokens=1)  # the engine's own cache: p's first 32 tokens
    other = engine(depot, "vllm_cpu", model="mixed")
    other.generate(p, max_new_tokens=1)  # the daemon: p's blocks 0-4
    planned = e.client.stats().counters["store_blocks_planned"]
    r = e.generate(p, max_new_tokens=2)
    assert (e.stats.local_hit_tokens, e.stats.loaded_tokens) == (32, 48)
    assert r.kv_mismatches == [] and e.stats.kv_mismatched_tokens == 0
    assert e.client.stats().counters["store_blocks_planned"] == planned  # nothing stored twice
    close(e)
    close(other)


def test_two_engines_share_blocks(depot: DaemonProcess) -> None:
    a = engine(depot, "vllm_flash", model="shared")
    b = engine(depot, "vllm_flash", model="shared")
    p = list(range(900, 1030))
    a.generate(p, max_new_tokens=1)
    r = b.generate(p, max_new_tokens=1)
    assert b.stats.loaded_tokens == 128 and r.kv_mismatches == []
    close(a)
    close(b)


@pytest.mark.parametrize("share", [0.5, 1.0])
def test_a_namespace_at_its_share_evicts_its_own_blocks(share: float) -> None:
    """Team A floods a 32-block tier. With namespace_host_share 0.5 it evicts its own blocks past
    16, so team B's prompt (6 blocks) stays served; without a share (the control) A flushes it out."""
    import urllib.request

    from kvdepot.testing import free_port

    lay = layout("vllm_cpu")
    port = free_port()
    args = ["--host-gib", str(96 / 2**20), "--slab-mib", "1", "--namespace-host-share", str(share), "--metrics-listen", f"127.0.0.1:{port}"]
    with DaemonProcess(args=args) as d:
        engines = [attached_engine(d, lay, "shared-model", namespace=ns) for ns in ("team-a", "team-b")]
        a, b = engines
        p = list(range(50, 150))
        b.generate(p, max_new_tokens=1)  # B's 6 full blocks are stored
        for i in range(6):  # A: 60 blocks of its own
            a.generate(list(range(i * 1000 + 5000, i * 1000 + 5160)), max_new_tokens=1)
        s = a.client.stats()
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        held = {ln.split('"')[1]: float(ln.split()[-1]) for ln in body.splitlines() if ln.startswith("kvdepot_namespace_host_blocks{")}
        loaded = served_again(b, p) if share < 1 else None
        if share < 1:
            assert loaded == 96, "B's blocks were evicted by A's flood"
            assert held["team-a"] <= 16 and held["team-b"] == 6
            assert s.counters["evictions"] > 0 and s.counters["store_blocks_over_share"] == 0
        else:
            b.reset_prefix_cache()
            b.generate(p, max_new_tokens=1)
            assert b.stats.loaded_tokens < 96  # the control: without a share, A's flood took B's blocks
        for e in engines:
            close(e)


def test_tensor_parallel_ranks_each_get_their_bytes(depot: DaemonProcess) -> None:
    e = engine(depot, "contiguous", model="tp2", world_size=2)
    p = list(range(50, 150))
    e.generate(p, max_new_tokens=1)
    e.reset_prefix_cache()
    r = e.generate(p, max_new_tokens=1)
    assert e.stats.loaded_tokens == 96 and r.kv_mismatches == []
    close(e)


def test_eviction_under_pressure_stays_correct() -> None:
    # 3 layers x 2 x 16 x 2 heads x 8 x fp16 = 3 KiB per block; a 96 KiB tier holds 32 blocks.
    with DaemonProcess(args=["--host-gib", str(96 / 2**20), "--slab-mib", "1"]) as d:
        e = engine(d, "vllm_cpu", model="pressure")
        prompts = [list(range(i * 1000, i * 1000 + 160)) for i in range(6)]  # 60 blocks > 32
        for p in prompts:
            e.generate(p, max_new_tokens=1)
        e.reset_prefix_cache()
        for p in reversed(prompts):  # the most recent prompts are the ones still in the tier
            assert e.generate(p, max_new_tokens=1).kv_mismatches == []
        s = e.client.stats()
        assert s.counters["evictions"] > 0 and s.pools[0].used_blocks <= 32
        assert e.stats.loaded_tokens > 0 and e.stats.kv_mismatched_tokens == 0
        close(e)


def test_daemon_killed_mid_transfer_requests_complete_correctly() -> None:
    d = DaemonProcess(args=["--host-gib", "0.0625"]).start()
    c = DepotClient(d.tcp, deadline_s=0.3)
    lay = layout("vllm_cpu")
    c.register_engine("killed", lay)
    e = FakeEngine(c, layout=lay, max_batched_tokens=64, load_timeout_s=0.5, release_timeout_s=1.0)
    assert e.workers[0].attached.wait(5)
    prompts = [list(range(i * 100, i * 100 + 150)) for i in range(4)]
    for p in prompts:
        e.generate(p, max_new_tokens=2)
    e.reset_prefix_cache()
    for p in prompts:
        e.add_request(p, max_new_tokens=20)
    e.step()  # loads are under way
    d.stop(signal.SIGKILL)
    e.run_until_done()
    assert e.stats.kv_mismatched_tokens == 0
    assert all(len(r.output) in (2, 20) for r in e.done.values())
    e.check()
    c.close()
    assert e.kv is not None
    e.kv.close()


def test_bad_handles_are_refused(depot: DaemonProcess, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import torch

    c = DepotClient(depot.tcp, strict=True, deadline_s=5.0)
    lay = layout("vllm_flash")
    c.register_engine("handles", lay)
    tensors = [torch.zeros(2, 4, 16, 2, 8, dtype=torch.float16) for _ in range(3)]
    req, paths = share_cpu_tensors(tensors, num_blocks=4)

    def send(mutate) -> grpc.RpcError:  # type: ignore[no-untyped-def]
        r = pb.RegisterKvCachesRequest()
        r.CopyFrom(req)
        r.engine_id = c.engine_id
        mutate(r)
        with pytest.raises(grpc.RpcError) as info:
            c._stub.RegisterKvCaches(r, timeout=5)
        return info.value

    outside = tmp_path / "kv"
    outside.write_bytes(b"\0" * 4096)
    e = send(lambda r: setattr(r.storages[0].cpu_shm, "path", str(outside)))
    assert e.code() is grpc.StatusCode.INVALID_ARGUMENT and "/dev/shm" in e.details()
    os.chmod(paths[0], 0o644)
    e = send(lambda r: None)
    assert "mode" in e.details()
    os.chmod(paths[0], 0o600)
    if os.geteuid() == 0:  # another user's file, which a daemon running as root could open: refused
        os.chown(paths[0], 12345, -1)
        e = send(lambda r: None)
        assert e.code() is grpc.StatusCode.INVALID_ARGUMENT and "belongs to uid 12345" in e.details()
        os.chown(paths[0], 0, -1)
    e = send(lambda r: r.tensors[1].shape.__setitem__(1, 5))
    assert "shape" in e.details()
    e = send(lambda r: setattr(r, "num_blocks", 5))
    assert "shape" in e.details()
    e = send(lambda r: r.tensors[2].__setattr__("storage_offset", 10**6))
    assert "past its" in e.details()
    e = send(lambda r: setattr(r, "rank", 3))
    assert "world size" in e.details()
    e = send(lambda r: r.tensors[0].__setattr__("dtype", "float32"))
    assert "float32" in e.details()
    r = pb.RegisterKvCachesRequest()
    r.CopyFrom(req)
    r.engine_id = c.engine_id
    assert c._stub.RegisterKvCaches(r, timeout=5).mapped_bytes == sum(t.untyped_storage().nbytes() for t in tensors)
    c.close()
    for p in paths:
        os.unlink(p)


def test_dead_engine_has_its_mappings_released() -> None:
    with DaemonProcess(args=["--host-gib", "0.0625", "--slab-mib", "1", "--lease-ms", "400"]) as d:
        lay = layout("vllm_cpu")
        c = DepotClient(d.tcp, strict=True, deadline_s=5.0)
        c.register_engine("dies", lay, lease_ms=400)
        e = FakeEngine(c, layout=lay)
        assert e.workers[0].attached.wait(5)
        watcher = DepotClient(d.tcp, strict=True, deadline_s=5.0)
        s = watcher.stats()
        assert s.mapped_ranks == 1 and s.mapped_engine_bytes > 0
        e.add_request(list(range(64)), max_new_tokens=50)
        e.step()
        c._closed.set()  # the engine process "dies": no more heartbeats
        for w in e.workers:
            w.close()
        import time

        time.sleep(1.2)
        s = watcher.stats()
        assert (s.engines, s.slots, s.mapped_ranks, s.mapped_engine_bytes) == (0, 0, 0, 0)
        assert all(p.pinned_blocks == 0 for p in s.pools)
        watcher.close()
        assert e.kv is not None
        e.kv.close()


def test_cuda_event_on_a_cpu_engine_is_ignored(depot: DaemonProcess) -> None:
    """GPU workers attach an end-of-forward CUDA event to ForwardDone; a CPU mapping has nothing to
    wait for, so the daemon ignores it (and never needs CUDA to do so)."""

    class NotAnEvent:
        @staticmethod
        def ipc_handle() -> bytes:
            return b"\x01" * 64

    e = engine(depot, "contiguous", model="event")
    rid = e.add_request(list(range(40_000, 40_064)), max_new_tokens=1)
    real_forward_done = e.workers[0].forward_done
    e.workers[0].forward_done = lambda step, ev=None: real_forward_done(step, NotAnEvent())  # type: ignore[method-assign]
    e.run_until_done()
    assert e.done[rid].kv_mismatches == []
    assert e.client.stats().counters["stored_blocks"] >= 4
    close(e)


def test_late_load_checks_over_the_daemon() -> None:
    """An engine registered with late_load_checks hears LoadCopied for a load before its
    OpCompleted; the daemon corrupts the first block it loads (fault injection), and the
    completion names that block while the other arrives byte-exact."""
    from kvdepot import LoadCopied, OpCompleted, StepBatch
    from kvdepot.testing.kv import FakeKv

    d = DaemonProcess(args=["--host-gib", "0.0625", "--fault-corrupt-loads", "1"]).start()
    lay = layout("vllm_cpu")
    kv = FakeKv(lay, num_blocks=16)
    try:
        with DepotClient(d.tcp, strict=True) as c:
            c.register_engine("late", lay, late_load_checks=True)
            w = c.worker(0)
            assert w.attached.wait(10)
            [req] = kv.share()
            assert w.register_kv_caches(req)
            toks = list(range(900, 933))  # blocks 0 and 1 full
            kv.write([0, 1, 2], toks, range(33))
            b = StepBatch()
            b.new("a", toks, [0, 1, 2], computed=0, scheduled=33)
            w.forward_done(c.step(b).step)
            w.wait(lambda evs: any(isinstance(e, OpCompleted) for e in evs), 10)
            assert c.lookup("b", toks).matched_tokens == 32
            kv.poison([4, 5])
            b = StepBatch()
            b.new("b", toks, [4, 5, 6], computed=32, scheduled=1, loaded=32)
            res = c.step(b)
            [load] = [op for op in res.ops if op.kind == "load"]
            evs = w.wait(lambda evs: any(isinstance(e, OpCompleted) and e.op_id == load.op_id for e in evs), 10)
            mine = [e for e in evs if getattr(e, "op_id", None) == load.op_id]
            assert [type(e) for e in mine] == [LoadCopied, OpCompleted]
            done = mine[1]
            # The copy threads may take the two blocks in either order: the first copied is the corrupted one.
            assert isinstance(done, OpCompleted) and not done.success and done.failed_block_ids in ((4,), (5,))
            bad = done.failed_block_ids[0] - 4
            assert kv.mismatches([4, 5], toks, 32) and all(pos // 16 == bad for pos in kv.mismatches([4, 5], toks, 32))  # the other arrived intact
            w.close()
    finally:
        kv.close()
        assert d.stop() == 0


def test_copy_metrics_count_what_was_copied() -> None:
    """/metrics shows the host copies: bytes per direction (blocks x block bytes, every rank), each
    part's copy and queue time, and each op's time from its Step to its end."""
    import urllib.request

    from kvdepot.testing.daemon import free_port

    port = free_port()
    d = DaemonProcess(args=["--host-gib", "0.0625", "--metrics-listen", f"127.0.0.1:{port}"]).start()
    try:
        e = engine(d, "vllm_cpu", model="metrics", world_size=2)
        p = list(range(40, 40 + 4 * 16 + 1))  # 4 full blocks
        first = e.generate(p, max_new_tokens=1)
        e.reset_prefix_cache()
        assert e.generate(p, max_new_tokens=1).output == first.output
        assert e.stats.loaded_tokens == 64
        close(e)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        block = layout("vllm_cpu", 2).block_bytes  # both ranks' halves
        for line in (
            f'kvdepot_host_copy_bytes_total{{op="store"}} {4 * block}.0',
            f'kvdepot_host_copy_bytes_total{{op="load"}} {4 * block}.0',
            'kvdepot_host_copy_duration_seconds_count{op="load"} 2.0',  # one part per rank
            'kvdepot_host_copy_queued_seconds_count{op="store"}',
            'kvdepot_op_duration_seconds_count{kind="load",result="ok"} 1.0',
            'kvdepot_op_duration_seconds_count{kind="store",result="failed"} 0.0',
        ):
            assert line in text, line
    finally:
        assert d.stop() == 0


def test_a_hit_that_cannot_be_copied_in_time_is_offered_only_as_far_as_it_fits() -> None:
    """load_budget_ms: the daemon times its loads' copies (here each load is held 400 ms, as on a
    starved host), and a Lookup then offers only the blocks it can copy within the budget at that
    rate (a miss for the rest, computed by the engine at once) instead of a load the engine would
    wait for; counted in lookups_over_load_budget. Without a budget the whole hit is offered."""
    from kvdepot import OpCompleted, StepBatch
    from kvdepot.testing.kv import FakeKv

    lay = KvLayout(num_layers=4, num_kv_heads=8, head_size=64, dtype="float16", block_size=16, kind="vllm_cpu")  # 128 KiB a block
    n = 64 * 16  # 8 MiB
    toks = list(range(7000, 7000 + n + 1))
    for budget, want in (("200", range(1, 64)), ("0", [n])):
        d = DaemonProcess(args=["--host-gib", "0.125", "--fault-load-delay-ms", "400", "--load-budget-ms", budget]).start()
        kv = FakeKv(lay, num_blocks=2 * 65)
        try:
            with DepotClient(d.tcp, strict=True) as c:
                c.register_engine("budget", lay)
                w = c.worker(0)
                assert w.attached.wait(10)
                [req] = kv.share()
                assert w.register_kv_caches(req)
                kv.write(list(range(65)), toks, range(n + 1))
                b = StepBatch()
                b.new("store", toks, list(range(65)), computed=0, scheduled=n + 1)
                w.forward_done(c.step(b).step)
                w.wait(lambda evs: any(isinstance(e, OpCompleted) for e in evs), 20)
                assert c.lookup("load", toks).matched_tokens == n  # nothing timed yet: the whole hit
                b = StepBatch()
                b.new("load", toks, list(range(65, 130)), computed=n, scheduled=1, loaded=n)
                [op] = [op for op in c.step(b).ops if op.kind == "load"]
                w.wait(lambda evs: any(isinstance(e, OpCompleted) and e.op_id == op.op_id for e in evs), 20)  # 8 MiB in 0.4 s
                got = c.lookup("again", toks).matched_tokens
                assert (got // 16 in want) if budget != "0" else got == n, got
                assert c.stats().counters["lookups_over_load_budget"] == (1 if budget != "0" else 0)
                w.close()
        finally:
            kv.close()
            assert d.stop() == 0
