"""Bad input gets a clear status and message, changes nothing, and the daemon stays up."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc
import itertools

import pytest

from kvdepot import DepotClient, StepBatch
from kvdepot.errors import DepotError, FailedPrecondition, InvalidRequest, NotFound
from kvdepot.testing import DaemonProcess
from kvdepot.v1 import kvdepot_pb2 as pb
from kvdepot.v1 import kvdepot_pb2_grpc as pb_grpc
from tests.integration.conftest import LAYOUT

pytestmark = pytest.mark.integration
C = grpc.StatusCode


@pytest.fixture(scope="module")
def small() -> Iterator[DaemonProcess]:
    d = DaemonProcess(args=["--max-tokens", "4096", "--max-message-mib", "1"]).start()
    yield d
    assert d.stop() == 0
    assert "Traceback" not in d.log(), d.log()


_BASE = itertools.count(1)


@pytest.fixture
def c(small: DaemonProcess) -> Iterator[DepotClient]:
    client = DepotClient(small.tcp, strict=True, deadline_s=5.0)
    client.register_engine("m", LAYOUT)
    # One live request so that bad updates have state to corrupt.
    b = StepBatch()
    base = next(_BASE) * 1000  # fresh tokens: the live request's blocks are not resident yet
    b.new("live", list(range(base, base + 40)), [0, 1, 2], computed=0, scheduled=40)
    client.step(b)
    yield client
    client.close()


def snapshot(c: DepotClient) -> tuple[Any, ...]:
    s = c.stats()
    slots = sorted((x.request_id, x.tokens, x.computed_tokens, x.ops_in_flight) for x in c.slots())
    counters = {k: v for k, v in s.counters.items() if not k.startswith("lookup")}
    return s.engines, s.slots, s.ops_in_flight, [(p.used_blocks, p.pinned_blocks) for p in s.pools], counters, slots


def expect(c: DepotClient, err: type[DepotError], words: str, call: Callable[[], object]) -> None:
    before = snapshot(c)
    with pytest.raises(err) as info:
        call()
    assert words in str(info.value), str(info.value)
    assert snapshot(c) == before
    assert c.stats().engines >= 1  # still alive and answering


def step_with(
    c: DepotClient, fill: Callable[[StepBatch], None], step: int | None = None, tamper: Callable[[pb.StepRequest], None] | None = None
) -> Callable[[], object]:
    """Sends the batch `fill` builds; `tamper` edits the wire message first (what a client other than ours may send)."""

    def run() -> object:
        b = StepBatch()
        fill(b)
        req = b.to_pb(c.engine_id, step if step is not None else c.last_step + 1)
        if tamper is not None:
            tamper(req)
        try:
            return c._stub.Step(req, timeout=5)
        except grpc.RpcError as e:
            from kvdepot.errors import from_rpc_error

            raise from_rpc_error(e) from None

    return run


def test_unknown_engine(c: DepotClient) -> None:
    stub = c._stub
    for call in (
        lambda: stub.Lookup(pb.LookupRequest(engine_id="nope", request_id="r", tokens=[1]), timeout=5),
        lambda: stub.Step(pb.StepRequest(engine_id="nope", step=1), timeout=5),
        lambda: stub.Heartbeat(pb.HeartbeatRequest(engine_id="nope"), timeout=5),
        lambda: stub.ListSlots(pb.ListSlotsRequest(engine_id="nope"), timeout=5),
    ):
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() is C.NOT_FOUND and "not registered" in info.value.details()


def test_unknown_request_id(c: DepotClient) -> None:
    expect(c, NotFound, "send it with is_new first", step_with(c, lambda b: b.cached("ghost", [1], [], computed=0, scheduled=1)))
    expect(c, NotFound, "has no request ghost", lambda: c.slot("ghost"))


@pytest.mark.parametrize(
    "layout, words",
    [
        (dict(num_layers=0), "num_layers"),
        (dict(num_kv_heads=100000), "num_kv_heads"),
        (dict(dtype="float128"), "dtype"),
        (dict(block_size=0), "block_size"),
        (dict(world_size=0), "world_size"),
        (dict(num_layers=1024, num_kv_heads=1024, head_size=4096), "bytes per rank"),
        (dict(kv_factor=3), "kv_factor must be 1 (K only) or 2"),
        (dict(kv_factor=1, kind=pb.KV_LAYOUT_KIND_VLLM_CPU), "a vllm_cpu layout holds K and V"),
    ],
)
def test_layouts_that_make_no_sense(c: DepotClient, layout: dict, words: str) -> None:
    base = dict(num_layers=2, num_kv_heads=2, head_size=8, dtype="float16", block_size=16, world_size=1)
    base.update(layout)
    req = pb.RegisterEngineRequest(model="m", layout=pb.KvLayout(**base))
    with pytest.raises(grpc.RpcError) as info:
        c._stub.RegisterEngine(req, timeout=5)
    assert info.value.code() is C.INVALID_ARGUMENT and words in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        c._stub.RegisterEngine(pb.RegisterEngineRequest(model="m"), timeout=5)
    assert "layout is required" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        c._stub.RegisterEngine(pb.RegisterEngineRequest(layout=pb.KvLayout(num_layers=1, num_kv_heads=1, head_size=1, dtype="float16", block_size=1, world_size=1)), timeout=5)
    assert "model" in info.value.details()


def test_inconsistent_counts(c: DepotClient) -> None:
    toks = list(range(100))
    cases: list[tuple[type[DepotError], str, Callable[[StepBatch], None]]] = [
        (InvalidRequest, "exceeds its 100 tokens", lambda b: b.new("x", toks, list(range(7)), computed=101, scheduled=0)),
        (InvalidRequest, "not a multiple of the block size", lambda b: b.new("x", toks, list(range(7)), computed=10, scheduled=0, loaded=10)),
        (InvalidRequest, "block-aligned", lambda b: b.new("x", toks, list(range(7)), computed=40, scheduled=0, device_matched=8, loaded=32)),
        (InvalidRequest, "exceed its", lambda b: b.new("x", toks, list(range(7)), computed=100, scheduled=0, device_matched=96, loaded=16)),
        (InvalidRequest, "exceeds computed_tokens", lambda b: b.new("x", toks, list(range(7)), computed=16, scheduled=0, device_matched=32)),
        (InvalidRequest, "must carry its tokens", lambda b: b.new("x", [], [], computed=0, scheduled=0)),
        (InvalidRequest, "request x: computed_tokens 0 + scheduled_tokens 500 = 500 runs past its 3 tokens", lambda b: b.new("x", [1, 2, 3], [1], computed=0, scheduled=500)),
        (InvalidRequest, "request live: computed_tokens 40 + scheduled_tokens 1000", lambda b: b.cached("live", [], [], computed=40, scheduled=1000)),
        (InvalidRequest, "only for new updates", lambda b: b._add("live", False, [], [], 40, 0, 16, 0, "", "")),
        (InvalidRequest, "appears twice", lambda b: (b.new("x", toks, list(range(7)), computed=0, scheduled=1), b.new("x", toks, list(range(7)), computed=0, scheduled=1))),
        (InvalidRequest, "both updated and finished", lambda b: (b.cached("live", [], [], computed=40, scheduled=0), b.finished.append("live"))),
    ]
    for err, words, fill in cases:
        expect(c, err, words, step_with(c, fill))


def test_new_row_must_carry_the_requests_whole_sequence(c: DepotClient) -> None:
    """A new row for a request the daemon holds (resumed, or emitted again after an async load)
    carries its whole sequence: another one is refused and changes nothing (it would have been
    appended: a 40-token request holding 80)."""
    live = [s.request_id for s in c.slots()]
    assert live == ["live"]
    held = c.slot("live").summary.tokens
    other = list(range(7, 47))
    expect(c, InvalidRequest, "request live: a new update carries the request's whole token sequence, and token 0 differs",
           step_with(c, lambda b: b.new("live", other, [0, 1, 2], computed=0, scheduled=40)))
    expect(c, InvalidRequest, "request live: a new update carries the request's whole token sequence; 39 tokens is fewer than the 40",
           step_with(c, lambda b: b.new("live", other[:39], [0, 1, 2], computed=0, scheduled=39)))
    assert held == 40 and c.slot("live").summary.tokens == held


def test_lookup_without_tokens(c: DepotClient) -> None:
    expect(c, InvalidRequest, "request r: no tokens", lambda: c._admin("Lookup", pb.LookupRequest(engine_id=c.engine_id, request_id="r")))


def test_block_table_shorter_than_positions(c: DepotClient) -> None:
    expect(c, InvalidRequest, "shorter than the 100 positions", step_with(c, lambda b: b.new("x", list(range(100)), [1, 2], computed=0, scheduled=100)))
    expect(c, InvalidRequest, "shorter than the 50 positions", step_with(c, lambda b: b.cached("live", list(range(10)), [], computed=40, scheduled=10)))


def test_repeated_block_ids(c: DepotClient) -> None:
    """Two positions of one request in one engine block would store one over the other, and another
    engine would load the wrong KV with every checksum passing: refused, in both paths of a Step."""
    expect(c, InvalidRequest, "block id 3 appears twice", step_with(c, lambda b: b.new("x", list(range(64)), [3, 3, 3, 3, 4], computed=0, scheduled=64)))
    expect(c, InvalidRequest, "block id 9 appears twice", step_with(c, lambda b: b.new("x", list(range(40)), [7, 9, 9], computed=0, scheduled=40)))
    # a running request's appended block that its table holds already (the fast path), or twice
    expect(c, InvalidRequest, "block id 1 appears twice", step_with(c, lambda b: b.cached("live", list(range(9)), [1], computed=40, scheduled=9)))
    expect(c, InvalidRequest, "block id 5 appears twice", step_with(c, lambda b: b.cached("live", list(range(9)), [5, 5], computed=40, scheduled=9)))
    step_with(c, lambda b: b.cached("live", list(range(9)), [5], computed=40, scheduled=9))()  # a fresh one is fine


def test_columns_that_do_not_line_up(c: DepotClient) -> None:
    def bad(b: StepBatch) -> None:
        b.new("x", [1, 2, 3], [0], computed=0, scheduled=3)
        b.computed.append(5)

    expect(c, InvalidRequest, "computed_tokens has 2 entries for 1 request_ids", step_with(c, bad))

    def bad_tokens(b: StepBatch) -> None:
        b.new("x", [1, 2, 3], [0], computed=0, scheduled=3)
        b.num_new_tokens[0] = 5

    expect(c, InvalidRequest, "num_new_tokens add up to 5", step_with(c, bad_tokens))

    def short_flags(b: StepBatch) -> None:  # is_new may be omitted (all false), not cut short
        b.new("x", [1, 2, 3], [0], computed=0, scheduled=3)
        b.cached("live", [], [], computed=40, scheduled=0)
        b.is_new.pop()

    expect(c, InvalidRequest, "is_new has 1 entries for 2 request_ids (0 or one per request)", step_with(c, short_flags))


def test_step_tokens_in_one_form_only(c: DepotClient) -> None:
    def sent(tamper: Callable[[pb.StepRequest], None]) -> Callable[[], object]:
        return step_with(c, lambda b: b.new("x", [1, 2, 3], [0], computed=0, scheduled=3), tamper=tamper)

    expect(c, InvalidRequest, "either new_tokens or new_tokens_u32le", sent(lambda r: r.new_tokens.extend([1, 2, 3])))
    expect(c, InvalidRequest, "new_tokens_u32le has 11 bytes", sent(lambda r: setattr(r, "new_tokens_u32le", r.new_tokens_u32le[:-1])))
    expect(c, InvalidRequest, "num_new_tokens add up to 3 but new_tokens has 2", sent(lambda r: setattr(r, "new_tokens_u32le", r.new_tokens_u32le[:-4])))

    def listed(r: pb.StepRequest) -> None:  # the repeated field (grpcurl's form) still works
        r.new_tokens.extend([1, 2, 3])
        r.new_tokens_u32le = b""

    sent(listed)()
    assert c.slot("x").summary.request_id == "x"


def test_oversized_token_lists(c: DepotClient, small: DaemonProcess) -> None:
    expect(c, InvalidRequest, "over the limit of 4096", step_with(c, lambda b: b.new("x", list(range(5000)), list(range(400)), computed=0, scheduled=1)))
    with pytest.raises(grpc.RpcError) as info:
        c._stub.Lookup(pb.LookupRequest(engine_id=c.engine_id, request_id="r", tokens_u32le=b"\0" * (4 * 5000)), timeout=5)
    assert info.value.code() is C.INVALID_ARGUMENT and "over the limit" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:  # past the gRPC message limit (1 MiB here)
        c._stub.Lookup(pb.LookupRequest(engine_id=c.engine_id, request_id="r", tokens_u32le=b"\0" * (2 << 20)), timeout=5)
    assert info.value.code() is C.RESOURCE_EXHAUSTED
    with pytest.raises(grpc.RpcError) as info:
        c._stub.Lookup(pb.LookupRequest(engine_id=c.engine_id, request_id="r", tokens_u32le=b"\0" * 7), timeout=5)
    assert "multiple of 4" in info.value.details()
    assert small.alive()


def test_old_steps_and_ranks(c: DepotClient) -> None:
    for _ in range(20):
        b = StepBatch()
        b.finished.append("never-seen")  # not empty, so it reaches the daemon and advances its step
        c.step(b)
    expect(c, FailedPrecondition, "older than the engine's last step", step_with(c, lambda b: None, step=1))
    link = c.worker(5)  # world size is 1
    import time

    time.sleep(0.5)
    assert not link.attached.is_set()
    link.close()


def test_worker_stream_must_attach_first(small: DaemonProcess, c: DepotClient) -> None:
    with grpc.insecure_channel(small.tcp) as ch:
        stub = pb_grpc.BlockManagerStub(ch)
        call = stub.WorkerStream(iter([pb.WorkerMessage(forward_done=pb.WorkerMessage.ForwardDone(step=1))]), timeout=5)
        with pytest.raises(grpc.RpcError) as info:
            list(call)
        assert info.value.code() is C.INVALID_ARGUMENT and "attach" in info.value.details()
        call = stub.WorkerStream(iter([pb.WorkerMessage(attach=pb.WorkerMessage.Attach(engine_id=c.engine_id, rank=3))]), timeout=5)
        with pytest.raises(grpc.RpcError) as info:
            list(call)
        assert "outside the engine's world size" in info.value.details()


def test_finishing_request_id_is_not_reused(c: DepotClient) -> None:
    fin = StepBatch()
    fin.finished.append("live")
    res = c.step(fin)
    assert res.delay_free == ("live",)  # its store waits for a forward no worker reported
    expect(c, FailedPrecondition, "ids are not reused", step_with(c, lambda b: b.new("live", [1] * 20, [0, 1], computed=0, scheduled=20)))
