from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator

import pytest

from kvdepot import DepotClient
from kvdepot.errors import DepotError
from kvdepot.layout import KvLayout
from kvdepot.testing import DaemonProcess
from kvdepot.testing.trtllm import KvCacheConfig, TorchLlmArgs
from kvdepot.testing.trtllm_executor import StandInExecutor

BS = 16
_models = itertools.count()


def layout(world_size: int = 1, kv_factor: int = 2) -> KvLayout:
    """TensorRT-LLM's pool of a small model: 2 layers, 2 KV heads of 8 per rank."""
    return KvLayout(num_layers=2, num_kv_heads=2, head_size=8, dtype="float16", block_size=BS, world_size=world_size, kind="trtllm", kv_factor=kv_factor)


def prompt(n: int, start: int = 1) -> list[int]:
    return list(range(start, start + n))


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    d = DaemonProcess(args=["--host-gib", "0.25", "--op-timeout-ms", "3000"]).start()
    yield d
    assert d.stop() == 0, d.log()
    assert "Traceback" not in d.log(), d.log()


Make = Callable[..., StandInExecutor]


@pytest.fixture
def make(daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> Iterator[Make]:
    """Builds stand-in executors against `daemon` (or the address given), each its own model."""
    made: list[StandInExecutor] = []

    def build(
        *, world_size: int = 1, kv_factor: int = 2, address: str = "", model: str = "", num_blocks: int = 64, copy_mode: str = "auto", **kw: object
    ) -> StandInExecutor:
        """copy_mode "engine": the workers copy their blocks themselves (at the daemon's unix: address)."""
        monkeypatch.setenv("KVDEPOT_COPY_MODE", copy_mode)
        if copy_mode == "engine" and not address:
            address = daemon.unix
        monkeypatch.setenv("KVDEPOT_ADDRESS", address or daemon.tcp)
        args = TorchLlmArgs(model=model or f"trt-model-{next(_models)}", kv_cache_config=KvCacheConfig(tokens_per_block=BS), tensor_parallel_size=world_size)
        with DepotClient(address or daemon.tcp, deadline_s=5.0) as c:
            base = dict(c.stats().counters)  # the daemon is shared: counters() gives what this executor moved
        ex = StandInExecutor(layout(world_size, kv_factor), num_blocks, args, **kw)  # type: ignore[arg-type]
        _baseline[id(ex)] = base
        made.append(ex)
        return ex

    yield build
    for ex in made:
        ex.close()


_baseline: dict[int, dict[str, int]] = {}


def counters(ex: StandInExecutor) -> dict[str, int]:
    """The daemon's counters since `ex` was built."""
    c = ex.scheduler.side.client
    assert c is not None, "the connector never connected"
    base = _baseline.get(id(ex), {})
    return {k: v - base.get(k, 0) for k, v in c.stats().counters.items()}


def mapped_ranks(ex: StandInExecutor) -> list[int]:
    """The ranks of `ex`'s engine whose KV memory the daemon has mapped."""
    c = ex.scheduler.side.client
    assert c is not None, "the connector never connected"
    infos = [e for e in c.engines() if e.engine_id == c.engine_id]
    return sorted(infos[0].mapped_ranks) if infos else []  # [] : not registered (again) yet


def wait_until(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Waits for `cond`; one that raises a DepotError (a daemon starting again) is not there yet."""
    end = time.monotonic() + timeout_s
    while True:
        try:
            if cond():
                return
        except DepotError:
            pass
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def generated(ex: StandInExecutor, rid: int) -> list[int]:
    r = ex.done[rid]
    return r.get_tokens(0)[r.py_orig_prompt_len :]


