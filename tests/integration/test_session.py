"""The engine path's stream (rpc Session), with the lane off: what a unary Lookup or Step would answer, one call's
failure ends only that call, a stalled daemon costs a call its deadline and nothing more, a daemon
without Session is served unary, and an open session does not hold a shutdown."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from kvdepot import AsyncDepotClient, DepotClient, StepBatch
from kvdepot.errors import InvalidRequest
from kvdepot.testing import DaemonProcess, free_port
from kvdepot.v1 import kvdepot_pb2 as pb
from kvdepot.v1 import kvdepot_pb2_grpc as pb_grpc
from tests.integration.conftest import LAYOUT, drain_with_an_idle_client

pytestmark = pytest.mark.integration


def new_batch(rid: str, toks: list[int]) -> StepBatch:
    b = StepBatch()
    b.new(rid, toks, list(range((len(toks) + 15) // 16)), computed=0, scheduled=len(toks))
    return b


def test_raw_session_answers_in_order_and_ends_on_the_first_error(daemon: DaemonProcess, client: DepotClient) -> None:
    toks = list(range(500, 564))
    reqs = [
        pb.SessionRequest(lookup=pb.LookupRequest(engine_id=client.engine_id, request_id="s1", tokens=toks)),
        pb.SessionRequest(step=new_batch("s1", toks).to_pb(client.engine_id, 1_000_000)),
        pb.SessionRequest(lookup=pb.LookupRequest(engine_id="no-such-engine", request_id="s2", tokens=toks)),
        pb.SessionRequest(lookup=pb.LookupRequest(engine_id=client.engine_id, request_id="s3", tokens=toks)),
    ]
    with grpc.insecure_channel(daemon.tcp) as ch:
        answers = []
        with pytest.raises(grpc.RpcError) as err:
            for r in pb_grpc.BlockManagerStub(ch).Session(iter(reqs), timeout=5):
                answers.append(r)
        assert err.value.code() is grpc.StatusCode.NOT_FOUND and "no-such-engine" in (err.value.details() or "")
        assert [a.WhichOneof("result") for a in answers] == ["lookup", "step"]
        assert answers[0].lookup.total_blocks == 4 and answers[1].step.step == 1_000_000
        assert [op.kind for op in answers[1].step.ops] == [pb.OP_KIND_STORE]
        with pytest.raises(grpc.RpcError) as err:
            list(pb_grpc.BlockManagerStub(ch).Session(iter([pb.SessionRequest()]), timeout=5))
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "a lookup, a step or a hello" in (err.value.details() or "")
    assert client.stats().engines >= 1


def test_a_rejected_step_fails_alone_and_the_next_call_opens_a_new_stream(daemon: DaemonProcess) -> None:
    with DepotClient(daemon.tcp, strict=True, deadline_s=5.0, lane=False) as c:
        c.register_engine("m-session", LAYOUT)
        bad = StepBatch()
        bad.new("r", list(range(64)), [0], computed=0, scheduled=64)  # 4 blocks of tokens, a 1-entry table
        with pytest.raises(InvalidRequest, match="block table"):
            c.step(bad)
        assert c.step(new_batch("r2", list(range(64)))).ops
        assert c.lookup("r3", list(range(64))).matched_tokens == 0  # stored only once its forward is done


@pytest.fixture
def stalled() -> Iterator[DaemonProcess]:
    d = DaemonProcess().start()
    yield d
    assert d.proc is not None
    d.proc.send_signal(signal.SIGCONT)
    assert d.stop() == 0


def test_a_stalled_daemon_costs_one_deadline_then_misses_at_once_then_the_session_recovers(stalled: DaemonProcess) -> None:
    d = stalled
    assert d.proc is not None
    with DepotClient(d.tcp, deadline_s=0.2, lane=False) as c:
        c.register_engine("m-stall", LAYOUT)
        assert not c.step(new_batch("a", list(range(32)))).degraded  # the session is open
        d.proc.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        assert c.step(new_batch("b", list(range(32)))).degraded
        assert c.lookup("b", list(range(32))).degraded
        assert 0.3 < time.monotonic() - t0 < 1.5  # two calls late in a row, each its deadline (and a watchdog period at most)
        for rid in ("c", "d"):  # for QUIET_S after that, engine calls are misses at once
            t0 = time.monotonic()
            assert c.step(new_batch(rid, list(range(32)))).degraded
            assert c.lookup(rid, list(range(32))).degraded
            assert time.monotonic() - t0 < 0.05
        d.proc.send_signal(signal.SIGCONT)
        end = time.monotonic() + 10
        while c.lookup("e", list(range(100, 132))).degraded and time.monotonic() < end:
            time.sleep(0.05)
        r = c.step(new_batch("e", list(range(100, 132))))
        assert not r.degraded and r.ops


def test_async_client_session_deadline_and_recovery(stalled: DaemonProcess) -> None:
    d = stalled
    assert d.proc is not None

    async def main() -> None:
        c = AsyncDepotClient(d.tcp, deadline_s=0.2, lane=False)
        await c.register_engine("m-astall", LAYOUT)
        assert not (await c.lookup("a", list(range(32)))).degraded
        d.proc.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]
        t0 = time.monotonic()
        assert (await c.step(new_batch("b", list(range(32))))).degraded
        assert time.monotonic() - t0 < 1.0
        d.proc.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
        end = time.monotonic() + 10
        while (await c.lookup("c", list(range(100, 132)))).degraded and time.monotonic() < end:
            await asyncio.sleep(0.05)
        r = await c.step(new_batch("c", list(range(100, 132))))
        assert not r.degraded and r.ops
        await c.close()

    asyncio.run(main())


def test_a_daemon_without_session_is_served_unary() -> None:
    """A daemon older than the Session rpc answers UNIMPLEMENTED; the client goes unary for good."""
    calls: list[str] = []

    def lookup(req: pb.LookupRequest, ctx: grpc.ServicerContext) -> pb.LookupResponse:
        calls.append("Lookup")
        return pb.LookupResponse(matched_tokens=16, total_blocks=2)

    def step(req: pb.StepRequest, ctx: grpc.ServicerContext) -> pb.StepResponse:
        calls.append("Step")
        return pb.StepResponse(step=req.step)

    def register(req: pb.RegisterEngineRequest, ctx: grpc.ServicerContext) -> pb.RegisterEngineResponse:
        return pb.RegisterEngineResponse(engine_id="old-1", lease_ms=30_000)

    handlers = {
        "RegisterEngine": grpc.unary_unary_rpc_method_handler(register, pb.RegisterEngineRequest.FromString, pb.RegisterEngineResponse.SerializeToString),
        "Lookup": grpc.unary_unary_rpc_method_handler(lookup, pb.LookupRequest.FromString, pb.LookupResponse.SerializeToString),
        "Step": grpc.unary_unary_rpc_method_handler(step, pb.StepRequest.FromString, pb.StepResponse.SerializeToString),
    }
    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("kvdepot.v1.BlockManager", handlers),))
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    try:
        with DepotClient(f"127.0.0.1:{port}", strict=True, deadline_s=5.0) as c:
            c.register_engine("m", LAYOUT)
            assert c.lookup("r", list(range(32))).matched_tokens == 16
            assert c.step(new_batch("r", list(range(32)))).step == 1
            assert c.step(new_batch("s", list(range(32)))).step == 2
        assert calls == ["Lookup", "Step", "Step"]
    finally:
        server.stop(None)


def test_an_open_session_does_not_hold_the_drain() -> None:
    drain_with_an_idle_client("session", lane=False)


def test_the_first_call_after_a_daemon_restart_is_answered() -> None:
    """The session stream ends with the old daemon; the next call goes out on a new one instead
    of failing on the dead one (a restarted daemon must not cost the engine a miss)."""
    toks = list(range(900, 964))
    d = DaemonProcess().start()
    with DepotClient(d.tcp, deadline_s=1.0, lane=False) as c:
        c.register_engine("m", LAYOUT)
        assert not c.lookup("a", toks).degraded  # the session is open
        assert d.stop() == 0
        d = DaemonProcess(tcp=d.tcp).start()
        end = time.monotonic() + 10
        while c.epoch < 2 and time.monotonic() < end:  # the keeper registers with the new daemon
            time.sleep(0.05)
        assert c.epoch == 2
        assert not c.lookup("b", toks).degraded
        assert not c.step(new_batch("b", toks)).degraded
    assert d.stop() == 0


def test_async_client_first_call_after_a_daemon_restart_is_answered() -> None:
    toks = list(range(900, 964))
    daemons = [DaemonProcess().start()]

    async def main() -> None:
        c = AsyncDepotClient(daemons[0].tcp, deadline_s=1.0, lane=False)
        await c.register_engine("m", LAYOUT)
        assert not (await c.lookup("a", toks)).degraded
        assert daemons[0].stop() == 0
        daemons.append(DaemonProcess(tcp=daemons[0].tcp).start())
        end = time.monotonic() + 10
        while c.epoch < 2 and time.monotonic() < end:
            await asyncio.sleep(0.05)
        assert c.epoch == 2
        assert not (await c.lookup("b", toks)).degraded
        assert not (await c.step(new_batch("b", toks))).degraded
        await c.close()

    try:
        asyncio.run(main())
    finally:
        assert daemons[-1].stop() == 0
