"""An engine instance's identity at the daemon, as clusters launch TensorRT-LLM: instances started
with the same environment stay apart, and an instance a rank of which cannot share its memory gets
no hit and stores nothing, rather than a promise its ranks cannot keep."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvdepot import DepotClient, handles
from kvdepot.testing import DaemonProcess
from tests.trtllm.conftest import Make, counters, mapped_ranks, prompt

ROOT = Path(__file__).resolve().parents[2]


class InstanceProc:
    """tests.trtllm.instance_proc: one instance in a process of its own."""

    def __init__(self, model: str, env: dict[str, str], world_size: int = 1) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.trtllm.instance_proc", model, str(world_size)],
            cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        self.ready = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"the instance exited ({self.proc.wait()})"
        return json.loads(line)

    def ask(self, cmd: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=20)


@pytest.fixture
def instances(daemon: DaemonProcess) -> Iterator[list[InstanceProc]]:
    made: list[InstanceProc] = []
    yield made
    for p in made:
        p.close()


def test_two_instances_started_in_one_slurm_job_keep_their_own_engines(daemon: DaemonProcess, make: Make, instances: list[InstanceProc]) -> None:
    """Two single-GPU servers of one model started inside one Slurm job on one node: every job id
    a launcher sets is the same for both. Each stores and loads its own prompt, and a third engine
    loads both byte-exact (a merged engine copied one instance's blocks out of the other's memory)."""
    env = {**os.environ, "KVDEPOT_ADDRESS": daemon.tcp, "SLURM_JOB_ID": "777", "PMIX_NAMESPACE": "slurm.pmix.777.0", "PYTHONPATH": str(ROOT)}
    model = "one-job-model"
    a, b = InstanceProc(model, env), InstanceProc(model, env)
    instances += [a, b]
    assert a.ready["key"] != b.ready["key"]
    prompts = {"a": (10_000, 100), "b": (20_000, 100)}
    for name, inst in (("a", a), ("b", b)):  # both alive: each computes its prompt and stores it
        got = inst.ask("serve %d %d" % prompts[name])
        assert got["matched"] == [0, 0, False] and got["bad_kv"] == 0
    for name, inst in (("a", a), ("b", b)):  # each loads its own back
        inst.ask("reset")
        got = inst.ask("serve %d %d" % prompts[name])
        assert got["matched"] == [0, 96, False] and got["bad_kv"] == 0, (name, got)
    third = make(model=model)
    for start, n in prompts.values():
        r = third.add(prompt(n, start=start))
        third.run()
        assert third.matched[r.request_id] == (0, 96, False)
        assert third.bad_kv[r.request_id] == []  # every position of every block byte-exact
    with DepotClient(daemon.tcp) as c:
        assert len([e for e in c.engines() if e.model == model]) == 3


def test_a_join_without_the_engines_key_is_refused(daemon: DaemonProcess, make: Make) -> None:
    """A worker only joins: a key no live engine holds is refused, never made into an engine."""
    from kvdepot.errors import NotFound
    from tests.trtllm.conftest import layout

    ex = make()
    with DepotClient(daemon.tcp) as c, pytest.raises(NotFound, match="no live engine has this engine key"):
        c.register_engine(ex.llm_args.model, layout(), engine_key=ex.scheduler.side.key + "0", join=True)


def _failing_share(fail_calls: set[int]) -> Any:
    """handles.share_cpu_tensors that fails on the given calls (0: rank 0's, 1: rank 1's)."""
    real = handles.share_cpu_tensors
    calls = iter(range(100))

    def share(*a: Any, **kw: Any) -> Any:
        if next(calls) in fail_calls:
            raise OSError(28, "No space left on device")
        return real(*a, **kw)

    return share


def test_a_rank_that_cannot_share_its_pool_means_no_hits_and_no_stores(make: Make, monkeypatch: pytest.MonkeyPatch, daemon: DaemonProcess) -> None:
    """Rank 1's pool cannot be shared: the daemon maps rank 0 only, so it offers nothing (a load
    would leave rank 1's half of the blocks unwritten, and with two ranks TensorRT-LLM cannot be
    told) and stores nothing (half a block), and the operator sees why in `kvdepotd status`."""
    monkeypatch.setattr(handles, "share_cpu_tensors", _failing_share({1}))
    ex = make(world_size=2)
    p = prompt(100)
    first = ex.add(p)
    ex.run()
    assert mapped_ranks(ex) == [0]
    ex.reset_prefix_cache()
    second = ex.add(p)
    ex.run()
    assert ex.matched[second.request_id] == (0, 0, False)
    assert ex.bad_kv[first.request_id] == [] and ex.bad_kv[second.request_id] == []
    c = counters(ex)
    assert c["store_blocks_planned"] == 0 and c["store_blocks_unmapped"] == 12 and c["lookups_unmapped"] == 2
    out = subprocess.run(
        [str(ROOT / ".venv/bin/kvdepotd"), "status", daemon.tcp], capture_output=True, text=True, timeout=30, check=True
    ).stdout
    assert "memory of 1/2 ranks mapped: no hits, no stores" in out


def test_rank_0_that_cannot_share_its_pool_leaves_the_connector_idle(make: Make, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """One rank whose pool cannot be shared: the scheduler never registers the engine, so nothing
    is ever promised; the worker says why once."""
    monkeypatch.setattr(handles, "share_cpu_tensors", _failing_share({0}))
    with caplog.at_level(logging.ERROR, logger="kvdepot.trtllm"):
        ex = make()
        for _ in range(2):
            r = ex.add(prompt(100))
            ex.run()
            ex.reset_prefix_cache()
            assert ex.matched[r.request_id] == (0, 0, False) and ex.bad_kv[r.request_id] == []
    assert ex.scheduler.side.client is None
    assert caplog.text.count("cannot share the KV cache with the daemon") == 1


def engines_of(address: str, model: str) -> list[Any]:
    with DepotClient(address) as c:
        return [e for e in c.engines() if e.model == model]


def test_an_instance_that_exits_or_dies_leaves_the_daemon_at_once(daemon: DaemonProcess, instances: list[InstanceProc]) -> None:
    """TensorRT-LLM calls no connector shutdown: an instance that exits is unregistered at exit,
    and one killed outright is let go once its worker streams ended (DETACHED_LEASE_MS), not
    after its 30-second lease."""
    env = {**os.environ, "KVDEPOT_ADDRESS": daemon.tcp, "PYTHONPATH": str(ROOT)}
    for how in ("exit", "kill"):
        model = f"leaving-{how}"
        inst = InstanceProc(model, env, world_size=2)
        instances.append(inst)
        inst.ask("serve 1 100")
        assert len(engines_of(daemon.tcp, model)) == 1
        t0 = time.monotonic()
        if how == "exit":
            assert inst.proc.stdin is not None
            inst.proc.stdin.write("exit\n")
            inst.proc.stdin.flush()
            assert inst.proc.wait(20) == 0
        else:
            inst.proc.send_signal(signal.SIGKILL)
            inst.proc.wait(20)
        while engines_of(daemon.tcp, model):
            assert time.monotonic() - t0 < 12, how
            time.sleep(0.1)
        if how == "exit":
            assert time.monotonic() - t0 < 3
