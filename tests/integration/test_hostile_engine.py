"""Engines that hold a valid token and misbehave on purpose: they shrink the memory they
registered, register a little of a large file, hold the handoff socket's connections, or pile up
lookup pins and slots. None of it may crash or stall the daemon, or cost it memory past a cap."""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
import torch

from kvdepot import DepotClient, KvLayout, ResourceExhausted, StepBatch
from kvdepot.handles import close_fds, share_cpu_tensors_memfd
from kvdepot.handoff import hand_over, handoff_path
from kvdepot.testing import DaemonProcess
from tests.integration.conftest import attached_engine, close_engine, fill_accept_queue, served_again

pytestmark = pytest.mark.integration
LAY = KvLayout(num_layers=3, num_kv_heads=2, head_size=8, dtype="float16", block_size=16, kind="vllm_cpu")


@pytest.fixture(scope="module")
def depot() -> Iterator[DaemonProcess]:
    args = ["--host-gib", "0.0625", "--slab-mib", "1", "--max-rank-gib", "1.5"]
    args += ["--max-pins-per-engine", "3", "--max-pins-per-namespace", "5", "--max-pin-tokens-per-namespace", "100000"]
    args += ["--max-slots-per-engine", "4", "--max-slots-per-namespace", "6"]
    with DaemonProcess(args=args) as d:
        yield d
    assert "Traceback" not in d.log(), d.log()


def shmem_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssShmem:"))


def test_an_engine_that_truncates_its_kv_file_cannot_kill_the_daemon(depot: DaemonProcess) -> None:
    """With /dev/shm path registration an engine can shrink the file the daemon copies into: a
    copy then touches pages that are gone (SIGBUS). The copies fail; the daemon serves on."""
    e = attached_engine(depot, LAY, "shrinker")
    p = list(range(100, 100 + 5 * 16 + 3))
    e.generate(p, max_new_tokens=1)
    kv = e.kv
    assert kv is not None and kv.paths
    e.kv = None  # from here on the engine never touches its own (shrunk) memory, as an attacker would not
    for path in kv.paths:
        os.truncate(path, 0)
    c = e.client
    failed = c.stats().counters["store_failed_blocks"]
    e.generate(list(range(9000, 9000 + 5 * 16 + 3)), max_new_tokens=1)  # stores out of the shrunk file
    e.reset_prefix_cache()
    e.generate(p, max_new_tokens=1)  # a load into it
    counters = c.stats().counters
    assert counters["store_failed_blocks"] > failed and e.stats.failed_load_blocks > 0
    assert depot.alive
    assert "smaller than it registered" in depot.log() or "SIGBUS caught" in depot.log()
    other = attached_engine(depot, LAY, "shrinker")  # the same namespace and model: serves on, byte-exact
    assert served_again(other, list(range(20_000, 20_000 + 4 * 16 + 1))) == 4 * 16
    close_engine(other)
    e.client.close()
    kv.close()


def test_only_the_registered_range_is_mapped_and_accounted(depot: DaemonProcess) -> None:
    """A sealed memfd of 1 GiB, never written, registered for a few KiB: the daemon maps and
    pre-faults only the registered range, and says so."""
    kv = torch.zeros(2, 3, 2, 16, 2, 8, dtype=torch.float16)  # contiguous: 2 blocks
    req, fds = share_cpu_tensors_memfd([kv], num_blocks=2)
    big = os.memfd_create("big-kv", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(big, 1 << 30)
    fcntl.fcntl(big, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    try:
        with DepotClient(depot.unix, strict=True, deadline_s=5.0) as c:
            c.register_engine("big-file", KvLayout(num_layers=3, num_kv_heads=2, head_size=8, dtype="float16", block_size=16, kind="contiguous"))
            path = handoff_path(depot.unix)
            assert path is not None
            before_stats, before_rss = c.stats().mapped_engine_bytes, shmem_kib(depot.proc.pid)
            [req.storages[0].cpu_shm.handoff_id] = hand_over(path, [big])
            req.engine_id = c.engine_id
            assert c._stub.RegisterKvCaches(req, timeout=5).mapped_bytes == kv.untyped_storage().nbytes()
            time.sleep(0.3)  # the mapping is pre-faulted off the event loop
            assert c.stats().mapped_engine_bytes - before_stats == kv.untyped_storage().nbytes()
            assert shmem_kib(depot.proc.pid) - before_rss < 16 << 10  # not the 1 GiB behind it
            os.ftruncate(big, 2 << 30)  # grown past max_rank_gib: refused
            [req.storages[0].cpu_shm.handoff_id] = hand_over(path, [big])
            with pytest.raises(grpc.RpcError) as e:
                c._stub.RegisterKvCaches(req, timeout=5)
            assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "is 2.00 GiB, over the 1.50 GiB one rank may register (max_rank_gib)" in e.value.details()
    finally:
        os.close(big)
        close_fds(fds)


def test_idle_connections_cannot_starve_the_handoff_socket(depot: DaemonProcess) -> None:
    path = handoff_path(depot.unix)
    assert path is not None
    idle = []
    for _ in range(300):  # more than one user may hold, and more than all may
        s = socket.socket(socket.AF_UNIX)
        s.connect(path)
        idle.append(s)
    os.kill(depot.proc.pid, signal.SIGSTOP)  # a daemon too busy to accept: its queue fills up
    resume = threading.Timer(0.3, os.kill, (depot.proc.pid, signal.SIGCONT))
    try:
        idle += fill_accept_queue(path)
    finally:
        resume.start()
    kv = torch.zeros(2, 3, 2, 16, 2, 8, dtype=torch.float16)
    _, fds = share_cpu_tensors_memfd([kv], num_blocks=2)
    try:
        t0 = time.monotonic()
        assert len(hand_over(path, fds, timeout_s=5)) == 1  # a real worker's handoff waits for room, then gets in
        assert time.monotonic() - t0 < 1.5  # not after the idle connections' 2 s deadline
        resume.join()
        idle[-1].settimeout(5)
        t0 = time.monotonic()
        assert idle[-1].recv(1) == b""  # an idle connection is closed within its deadline
        assert time.monotonic() - t0 < 3.0
    finally:
        close_fds(fds)
        for s in idle:
            s.close()


def test_lookup_pins_and_slots_are_capped(depot: DaemonProcess) -> None:
    e = attached_engine(depot, LAY, "pinner")
    prompt = list(range(50_000, 50_000 + 4 * 16 + 1))
    e.generate(prompt, max_new_tokens=1)
    # Two more engines of the model, their memory mapped (else a lookup offers nothing), only looking up.
    with attached_engine(depot, LAY, "pinner").client as c, attached_engine(depot, LAY, "pinner").client as c2:
        for k in range(3):
            assert c.lookup(f"r{k}", prompt).matched_tokens == 64
        assert c.lookup("r0", prompt).matched_tokens == 64  # a repeated lookup replaces its own pin
        with pytest.raises(ResourceExhausted, match=r"holds 3 lookup pins, the most one engine may \(max_pins_per_engine\)"):
            c.lookup("r3", prompt)
        for k in range(2):
            c2.lookup(f"q{k}", prompt)
        with pytest.raises(ResourceExhausted, match=r"namespace '' holds 5 lookup pins, the most one namespace may \(max_pins_per_namespace\)"):
            c2.lookup("q2", prompt)
        with pytest.raises(ResourceExhausted, match="max_pin_tokens_per_namespace"):
            c.lookup("r0", list(range(200_000)))
        # slots: 4 per engine, 6 per namespace (e's slots are gone: its requests finished)
        b = StepBatch()
        for k in range(5):
            b.new(f"s{k}", [1, 2, 3], [k], computed=0, scheduled=3)
        with pytest.raises(ResourceExhausted, match=r"5 new ones are over the most one engine may \(4, max_slots_per_engine\)"):
            c.step(b)
        b = StepBatch()
        for k in range(4):
            b.new(f"s{k}", [1, 2, 3], [k], computed=0, scheduled=3)
        c.step(b)
        b = StepBatch()
        for k in range(3):
            b.new(f"t{k}", [1, 2, 3], [k], computed=0, scheduled=3)
        with pytest.raises(ResourceExhausted, match=r"namespace '' holds 4 request slots; 3 new ones are over .*max_slots_per_namespace"):
            c2.step(b)
        assert len(c.slots()) == 4 and not c2.slots()  # a refused step changed nothing
    close_engine(e)


def test_the_daemon_raises_its_descriptor_limit(depot: DaemonProcess) -> None:
    """Each client connection holds a descriptor: the daemon takes all the system allows it, so
    running out needs far more connections than the default soft limit of 1024."""
    import resource

    with open(f"/proc/{depot.proc.pid}/limits") as f:
        soft, hard = next(line.split()[3:5] for line in f if line.startswith("Max open files"))
    _, own_hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert soft == hard and int(soft) >= min(own_hard, 1 << 20)


def test_the_tokens_a_namespaces_slots_keep_are_capped_and_a_step_past_it_changes_nothing() -> None:
    """Slots were capped by count only: ten new 1e6-token requests grew a daemon by over 100 MiB.
    A Step whose tokens would take the namespace's slots past max_slot_tokens_per_namespace is
    refused whole, naming the cap; finishing requests makes room; decode growth counts too."""
    from kvdepot import StepBatch
    from kvdepot.errors import ResourceExhausted

    lay = KvLayout(num_layers=2, num_kv_heads=2, head_size=8, dtype="float16", block_size=16)
    with DaemonProcess(args=["--max-slot-tokens-per-namespace", "200000"]) as d:
        c = DepotClient(d.tcp, strict=True, deadline_s=10.0)
        c.register_engine("hog", lay)
        other = DepotClient(d.tcp, strict=True, deadline_s=10.0)
        other.register_engine("hog-2", lay)  # another engine of the same namespace shares the cap

        def new(client: DepotClient, rid: str, n: int) -> None:
            b = StepBatch()
            b.new(rid, list(range(n)), list(range(-(-n // 16))), computed=0, scheduled=0)  # nothing computed: no stores to wait for
            client.step(b)

        new(c, "a", 90_000)
        new(other, "b", 90_000)
        with pytest.raises(ResourceExhausted, match=r"holds 180000 tokens in request slots.*max_slot_tokens_per_namespace"):
            new(c, "c", 30_000)
        assert c.stats().slots == 2  # nothing of the refused step was applied
        b = StepBatch()
        b.finished.append("a")
        c.step(b)  # finishing makes room
        new(c, "c", 30_000)
        b = StepBatch()
        b.cached("c", list(range(30_000, 111_000)), list(range(1875, 6938)), computed=0, scheduled=0)
        with pytest.raises(ResourceExhausted, match="max_slot_tokens_per_namespace"):  # 90k + 30k held, 81k more
            c.step(b)
        assert c.stats().slots == 2 and d.alive
        b = StepBatch()
        b.cached("c", list(range(30_000, 100_000)), list(range(1875, 6250)), computed=0, scheduled=0)
        c.step(b)  # 70k more fits (190k)...
        with pytest.raises(ResourceExhausted, match="holds 190000 tokens"):  # ...and counts: a 20k request no longer does
            new(other, "d", 20_000)
        c.close()
        other.close()
    assert "Traceback" not in d.log()
