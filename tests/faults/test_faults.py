"""The fault suite (marker `fault`, its own CI stage): engines and daemons that die or freeze at
the worst moments, many engines at once, and tenants probing each other, all against real
daemon processes on loopback, with every loaded byte checked.

Each test prints one line, `fault: <case>: tried N, survived N, lost N`, which docs/security.md
reports (survived: the engine finished every request with right KV and the daemon served on;
lost: blocks or requests that did not)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from kvdepot import DepotClient, KvLayout
from kvdepot.testing import DaemonProcess
from kvdepot.v1 import kvdepot_pb2 as pb
from tests.integration.conftest import attached_engine, close_engine

pytestmark = pytest.mark.fault
LAY = KvLayout(num_layers=4, num_kv_heads=2, head_size=8, dtype="float16", block_size=16, kind="vllm_cpu")
OP_MS = 2000  # the daemon's op deadline in these tests; engines wait a little longer, never for ever


def prompt(k: int, blocks: int = 6) -> list[int]:
    return list(range(100_000 * (k + 1), 100_000 * (k + 1) + blocks * 16 + 3))


def report(case: str, tried: int, survived: int) -> None:
    print(f"\nfault: {case}: tried {tried}, survived {survived}, lost {tried - survived}", flush=True)


class Outcome:
    """One fault case's report line, printed whether its checks passed or not (a case that failed
    a check counts as lost): `with Outcome(case) as o: ...; o.survived()` at the end of the checks."""

    def __init__(self, case: str) -> None:
        self.case, self.ok, self.detail = case, False, ""

    def survived(self, detail: str = "") -> None:
        self.ok, self.detail = True, detail

    def __enter__(self) -> Outcome:
        return self

    def __exit__(self, *exc: object) -> None:
        report(f"{self.case}{'; ' + self.detail if self.detail else ''}", 1, int(self.ok and exc[0] is None))


def quiet(d: DaemonProcess) -> None:
    """Nothing is pinned, copying or held for a request any more."""
    with DepotClient(d.tcp, deadline_s=5.0) as c:
        end = time.monotonic() + 10
        while True:
            s = c.stats()
            if s.ops_in_flight == 0 and all(p.pinned_blocks == 0 for p in s.pools):
                return
            assert time.monotonic() < end, f"ops or pins left: {s}"
            time.sleep(0.05)


# -- an engine killed at any point ---------------------------------------------------------------------
ENGINE = """
import sys, time
from kvdepot import DepotClient, KvLayout, StepBatch
from kvdepot.testing import FakeEngine
lay = KvLayout(num_layers=4, num_kv_heads=2, head_size=8, dtype="float16", block_size=16, kind="vllm_cpu")
c = DepotClient(sys.argv[1], deadline_s=5.0)
c.register_engine("crash-model", lay)
e = FakeEngine(c, layout=lay)
for w in e.workers:
    w.attached.wait(5)
point = sys.argv[2]
p = list(range(777_000, 777_000 + 6 * 16 + 3))
if point != "registered":
    e.generate(p)
    e.reset_prefix_cache()
if point == "holding pins and slots":
    for k in range(20):
        c.lookup(f"pin-{k}", p)
    b = StepBatch()
    for k in range(8):
        b.new(f"slot-{k}", list(range(k * 1000, k * 1000 + 40)), [200 + 3 * k, 201 + 3 * k, 202 + 3 * k], computed=0, scheduled=40)
    c.step(b)
if point == "mid-load":
    e.add_request(p)
    print("ready", flush=True)
    e.step()  # the load is delayed by the daemon: killed while it copies into this process's memory
print("ready", flush=True)
time.sleep(60)
"""


@pytest.fixture(scope="module")
def crash_daemon() -> Iterator[DaemonProcess]:
    with DaemonProcess(args=["--lease-ms", "1500", "--fault-load-delay-ms", "400"]) as d:
        yield d
    assert "Traceback" not in d.log(), d.log()


@pytest.mark.parametrize("point", ["registered", "holding pins and slots", "mid-load"])
def test_an_engine_killed_leaves_nothing_behind_after_its_lease(crash_daemon: DaemonProcess, point: str) -> None:
    d = crash_daemon
    with Outcome(f"engine SIGKILLed ({point})") as outcome, DepotClient(d.tcp, deadline_s=5.0) as c:
        mapped = c.stats().mapped_engine_bytes
        proc = subprocess.Popen([sys.executable, "-c", ENGINE, d.tcp, point], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(0.15 if point == "mid-load" else 0)
        s = c.stats()
        assert s.engines == 1
        if point == "mid-load":  # the signal lands while the load is in flight (held 400 ms by fault injection)
            assert s.ops_in_flight >= 1 and any(op.kind == pb.OP_KIND_LOAD for op in s.oldest_ops), s.oldest_ops
        proc.kill()
        proc.wait()
        t0 = time.monotonic()
        while c.stats().engines:
            assert time.monotonic() - t0 < 3.0, "the dead engine outlived its lease"
            time.sleep(0.05)
        released = time.monotonic() - t0
        s = c.stats()
        assert s.slots == 0 and s.mapped_engine_bytes == mapped and all(p.pinned_blocks == 0 for p in s.pools)
        quiet(d)
        if point != "registered":  # what it stored outlives it, byte-exact
            e = attached_engine(d, LAY, "crash-model")
            e.generate(list(range(777_000, 777_000 + 6 * 16 + 3)))
            assert e.stats.loaded_tokens == 96 and e.stats.kv_mismatched_tokens == 0
            close_engine(e)
        assert d.alive
        outcome.survived(f"released {released:.2f} s after the kill (lease 1.5 s)")


# -- a daemon killed or frozen mid-load and mid-store ------------------------------------------------------
@pytest.mark.parametrize("phase", ["load", "store"])
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSTOP"])
def test_a_daemon_killed_or_frozen_mid_op_never_hangs_or_corrupts_an_engine(phase: str, sig: str) -> None:
    """The daemon's copies are held 800 ms (fault injection) and the signal comes 300 ms in: the
    load or the store is copying when the daemon dies or freezes."""
    d = DaemonProcess(args=["--op-timeout-ms", str(OP_MS), f"--fault-{phase}-delay-ms", "800"]).start()
    outcome = Outcome(f"daemon {sig} mid-{phase}")
    try:
        e = attached_engine(d, LAY, "m", strict=False, deadline_s=0.5, load_timeout_s=OP_MS / 1000 + 0.5, release_timeout_s=OP_MS / 1000 + 1)
        p = prompt(1)
        first = e.generate(p, max_new_tokens=4)
        e.reset_prefix_cache()
        rid = e.add_request(p if phase == "load" else prompt(2), max_new_tokens=4)
        signal_at = threading.Timer(0.3, lambda: d.proc.send_signal(getattr(signal, sig)))
        signal_at.start()
        t0 = time.monotonic()
        e.step()  # plans the load (and waits for it) or the stores (copied after this step's forward)
        load_wait = time.monotonic() - t0
        signal_at.join()
        while rid not in e.done:
            e.step()
            assert time.monotonic() - t0 < OP_MS / 1000 + 2, f"the engine hung on a {sig}ed daemon"
        took = time.monotonic() - t0  # the request is answered; its blocks may still be held for the release timeout
        e.run_until_done()
        held = time.monotonic() - t0
        assert held < took + OP_MS / 1000 + 1 + 1.5  # the release timeout (held blocks) and a call's deadline
        if phase == "load" and sig == "SIGKILL":  # the worker stream dropped: the wait ends 0.5 s later, not at its timeout
            assert load_wait < 1.5, load_wait
        assert e.stats.kv_mismatched_tokens == 0
        if phase == "load":
            assert e.done[rid].output == first.output
        e.check()
        if sig == "SIGSTOP":
            d.proc.send_signal(signal.SIGCONT)  # it resumes (its copies past their deadline touch nothing): the engine is served again
        else:
            d = DaemonProcess(tcp=d.tcp).start()
        end = time.monotonic() + 10
        loaded = 0
        k = 10
        while loaded == 0:
            assert time.monotonic() < end, "the engine was not served again"
            e.generate(prompt(k), max_new_tokens=1)
            e.reset_prefix_cache()
            before = e.stats.loaded_tokens
            e.generate(prompt(k), max_new_tokens=1)
            loaded = e.stats.loaded_tokens - before
            k += 1
        assert e.stats.kv_mismatched_tokens == 0
        e.check()
        close_engine(e)
        outcome.survived(
            f"the load wait ended after {load_wait:.2f} s, the request was answered {took:.2f} s "
            f"after and its blocks free {held:.2f} s after (op deadline {OP_MS / 1000:.0f} s), served again after"
        )
    finally:
        outcome.__exit__(*sys.exc_info())
        if d.alive:
            d.proc.send_signal(signal.SIGCONT)
            d.stop()


# -- many engines at once ------------------------------------------------------------------------------------
def test_eight_engines_for_a_while_lose_nothing_and_serve_no_wrong_byte() -> None:
    """8 engines x SOAK_S: shared and private prefixes, aborts, preemptions (little KV space), a
    host tier small enough to evict; every finished request's KV is checked position by position."""
    soak_s = float(os.environ.get("KVDEPOT_SOAK_S", "40"))
    d = DaemonProcess(args=["--host-gib", "0.004", "--slab-mib", "1", "--lease-ms", "5000"]).start()  # 1024 blocks: evictions
    stats: list[tuple[int, int, int, int]] = []
    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            rng = random.Random(k)
            e = attached_engine(d, LAY, "soak-model", num_blocks=16, max_batched_tokens=64)
            done = 0
            end = time.monotonic() + soak_s
            while time.monotonic() < end:
                rids = []
                for _ in range(3):  # three at once in 16 blocks: some are preempted
                    base = rng.choice([0, 1, 2, 3]) if rng.random() < 0.6 else 10 + k * 1000 + rng.randrange(1000)
                    p = prompt(base, blocks=rng.randrange(1, 9))[: rng.randrange(20, 140)]
                    rids.append(e.add_request(p, max_new_tokens=rng.randrange(1, 48)))
                if rng.random() < 0.2:
                    e.step()
                    e.abort(rng.choice(rids))
                e.run_until_done()
                done += len(rids)
                if rng.random() < 0.2:
                    e.reset_prefix_cache()
            e.check()
            stats.append((done, e.stats.loaded_tokens, e.stats.kv_mismatched_tokens, e.stats.preemptions))
            close_engine(e)
        except BaseException as exc:  # the main thread reports it
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(soak_s + 120)
    requests, loaded, wrong, preempted = (sum(x[i] for x in stats) for i in range(4))
    whole = sum(1 for x in stats if x[2] == 0)  # engines that finished with every position right
    counters: dict[str, int] = {}
    try:
        assert not errors, errors
        assert len(stats) == 8
        quiet(d)
        with DepotClient(d.tcp, deadline_s=5.0) as c:
            s = c.stats()
            assert s.engines == 0 and s.slots == 0
            counters = dict(s.counters)
        assert d.stop() == 0 and "Traceback" not in d.log()
        assert wrong == 0 and loaded > 0
        assert counters["checksum_failures"] == 0
    finally:  # engines that finished with no wrong position survived; the line is printed whatever failed
        report(
            f"8 engines x {soak_s:.0f} s: {requests} requests, {loaded} tokens loaded, {preempted} preemptions, "
            f"{counters.get('evictions', '?')} evictions, {counters.get('stored_blocks', '?')} blocks stored, {wrong} wrong positions",
            8, whole,
        )
