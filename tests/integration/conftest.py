from __future__ import annotations

import signal
import socket
import time
from collections.abc import Iterator

import pytest

from kvdepot import DepotClient, KvLayout, StepBatch
from kvdepot.testing import DaemonProcess, FakeEngine

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_size=8, dtype="float16", block_size=16)


def attached_engine(
    d: DaemonProcess, lay: KvLayout, model: str, strict: bool = True, deadline_s: float = 5.0, address: str = "", namespace: str = "", **kw: object
) -> FakeEngine:
    """A FakeEngine registered with the daemon as `model` in `namespace` (at `address`, else its TCP
    one), its workers' streams attached."""
    c = DepotClient(address or d.tcp, strict=strict, deadline_s=deadline_s)
    c.register_engine(model, lay, namespace=namespace)
    e = FakeEngine(c, layout=lay, **kw)  # type: ignore[arg-type]
    for w in e.workers:
        assert w.attached.wait(5)
    return e


def served_again(e: FakeEngine, prompt: list[int], max_new_tokens: int = 1) -> int:
    """Generates `prompt`, drops the engine's own prefix cache and generates it again: the output
    must repeat with every position's KV right. Returns the tokens the second run loaded."""
    first = e.generate(prompt, max_new_tokens=max_new_tokens)
    e.reset_prefix_cache()
    before = e.stats.loaded_tokens
    second = e.generate(prompt, max_new_tokens=max_new_tokens)
    assert second.output == first.output and e.stats.kv_mismatched_tokens == 0 and e.stats.failed_load_blocks == 0
    return e.stats.loaded_tokens - before


def drain_with_an_idle_client(what: str, lane: bool) -> DaemonProcess:
    """SIGTERMs a daemon while a client that has just been answered keeps its lane (or its Session
    stream) open: the drain must not wait on it, the daemon exits 0 without a traceback, and the
    client's next Step is a miss. Returns the stopped daemon for checks of its own."""
    d = DaemonProcess(args=["--drain-grace-s", "10"]).start()
    with DepotClient(d.tcp, deadline_s=0.5, lane=lane) as c:
        c.register_engine(f"m-drain-{what}", LAYOUT)
        b = StepBatch()
        b.new("r", list(range(32)), [0, 1], computed=0, scheduled=32)
        assert not c.step(b).degraded
        assert (c._lane._sock is not None) == lane  # the call went where the caller asked
        assert d.proc is not None
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(20) == 0
        assert time.monotonic() - t0 < 5, f"the drain waited on an idle {what}"
        b = StepBatch()
        b.new("s", list(range(32)), [0, 1], computed=0, scheduled=32)
        assert c.step(b).degraded
    assert "Traceback" not in d.log()
    return d


def fill_accept_queue(path: str) -> list[socket.socket]:
    """Connects to the Unix socket at `path` until its queue of connections not yet accepted is
    full (a connect that may not wait says EAGAIN); the caller closes the connections."""
    queued: list[socket.socket] = []
    while True:
        s = socket.socket(socket.AF_UNIX)
        s.setblocking(False)
        try:
            s.connect(path)
        except BlockingIOError:
            s.close()
            return queued
        queued.append(s)


def wait_counter(c: DepotClient, name: str, at_least: int, timeout_s: float = 10.0) -> int:
    """Waits until the daemon's counter `name` reaches `at_least`; returns it."""
    end = time.monotonic() + timeout_s
    while (v := c.stats().counters[name]) < at_least:
        assert time.monotonic() < end, f"{name} stayed at {v} (< {at_least})"
        time.sleep(0.02)
    return v


def close_engine(e: FakeEngine) -> None:
    e.client.close()
    assert e.kv is not None
    e.kv.close()


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    d = DaemonProcess(args=["--host-gib", "0.25", "--lease-ms", "5000"]).start()
    yield d
    rc = d.stop()
    log = d.log()
    assert rc == 0, log
    assert "Traceback" not in log, log


@pytest.fixture
def client(daemon: DaemonProcess) -> Iterator[DepotClient]:
    c = DepotClient(daemon.tcp, strict=True, deadline_s=5.0)
    c.register_engine("test-model", LAYOUT, name="pytest")
    yield c
    c.close()
