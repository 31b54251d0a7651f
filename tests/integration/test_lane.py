"""The lane (kvdepotd.lane): Lookup and Step on a plain framed socket beside each listen address.
It answers what the gRPC handlers answer, a bad frame costs its sender a clear error and never the
daemon, a stalled daemon costs a call its deadline, a restarted daemon costs no call, a lane that
is out leaves the client on gRPC, and shutdown removes it."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import struct
import threading
import time

import grpc
import pytest

from kvdepot import AsyncDepotClient, DepotClient, StepBatch
from kvdepot.errors import InvalidRequest
from kvdepot.lane import AsyncLane, Lane, pick
from kvdepot.testing import DaemonProcess, free_port
from kvdepot.v1 import kvdepot_pb2 as pb
from tests.integration.conftest import LAYOUT, drain_with_an_idle_client

pytestmark = pytest.mark.integration
FRAME = struct.Struct("<I")


def new_batch(rid: str, toks: list[int]) -> StepBatch:
    b = StepBatch()
    b.new(rid, toks, list(range((len(toks) + 15) // 16)), computed=0, scheduled=len(toks))
    return b


def raw_call(sock: socket.socket, payload: bytes) -> tuple[int, bytes]:
    sock.sendall(FRAME.pack(len(payload)) + payload)
    (n,) = FRAME.unpack(sock.recv(4, socket.MSG_WAITALL))
    body = sock.recv(n, socket.MSG_WAITALL) if n else b""
    return body[0], body[1:]


def lane_path(d: DaemonProcess) -> str:
    return d.unix[len("unix:") :] + ".lane"


def test_pick_finds_the_lane_beside_the_address_the_client_used() -> None:
    lanes = ["127.0.0.1:4001", "0.0.0.0:4002", "unix:/run/k/d.sock.lane"]
    assert pick("127.0.0.1:50061", lanes) == ("tcp", "127.0.0.1", 4001)
    assert pick("kvdepotd:50061", lanes) == ("tcp", "kvdepotd", 4002)  # a wildcard listener
    assert pick("[::1]:50061", ["[::1]:4003"]) == ("tcp", "::1", 4003)
    # A socket volume mounted elsewhere in the engine's container: the path the client knows wins.
    assert pick("unix:/mnt/k/d.sock", lanes) == ("unix", "/mnt/k/d.sock.lane", 0)
    assert pick("unix:///abs/d.sock", lanes) == ("unix", "/abs/d.sock.lane", 0)
    assert pick("unix:/x.sock", ["127.0.0.1:4001"]) is None
    assert pick("127.0.0.1:50061", []) is None
    assert pick("dns:///kvdepotd:50061", lanes) is None


@pytest.mark.parametrize("via", ["tcp", "unix"])
def test_registration_names_the_lanes_and_the_client_uses_them(daemon: DaemonProcess, via: str) -> None:
    address = daemon.tcp if via == "tcp" else daemon.unix
    with DepotClient(address, strict=True, deadline_s=5.0) as c, DepotClient(address, strict=True, deadline_s=5.0, lane=False) as g:
        c.register_engine(f"m-lane-{via}", LAYOUT)
        g.register_engine(f"m-grpc-{via}", LAYOUT)  # another model: nothing shared, the same answers
        toks = list(range(900, 964))
        assert c._lane._target is not None and c._lane._target[0] == via
        res = c.step(new_batch("a", toks))
        assert c._lane._sock is not None  # the call went on the lane
        assert g._lane._target is None
        assert [op.kind for op in res.ops] == [op.kind for op in g.step(new_batch("a", toks)).ops] == ["store"]
        assert c.lookup("q", toks) == g.lookup("q", toks)
        with pytest.raises(InvalidRequest, match="block table"):  # the handler's own error, over the lane
            bad = StepBatch()
            bad.new("r", list(range(64)), [0], computed=0, scheduled=64)
            c.step(bad)
        assert c.lookup("q2", toks).degraded is False  # the connection stays usable after an error
    assert os.path.exists(lane_path(daemon))


def test_bad_frames_get_clear_errors_and_the_daemon_serves_on(daemon: DaemonProcess, client: DepotClient) -> None:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(lane_path(daemon))
        code, msg = raw_call(s, b"\xff\xff\xff")  # not protobuf
        assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and b"not a valid kvdepot.v1.SessionRequest" in msg
        code, msg = raw_call(s, b"")  # an empty SessionRequest
        assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and b"a lookup, a step or a hello" in msg
        req = pb.SessionRequest(lookup=pb.LookupRequest(engine_id="nobody", request_id="x", tokens=[1, 2]))
        code, msg = raw_call(s, req.SerializeToString())
        assert code == grpc.StatusCode.NOT_FOUND.value[0] and b"nobody" in msg
        req = pb.SessionRequest(lookup=pb.LookupRequest(engine_id=client.engine_id, request_id="x", tokens=list(range(64))))
        code, body = raw_call(s, req.SerializeToString())
        assert code == 0 and pb.SessionResponse.FromString(body).lookup.total_blocks == 4
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(lane_path(daemon))
        s.sendall(FRAME.pack(1 << 31))  # over the message limit: answered, then the connection ends
        (n,) = FRAME.unpack(s.recv(4, socket.MSG_WAITALL))
        body = s.recv(n, socket.MSG_WAITALL)
        assert body[0] == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and b"limit" in body
        assert s.recv(1) == b""
    with socket.socket(socket.AF_UNIX) as s:  # a client that sends half a frame and goes away
        s.connect(lane_path(daemon))
        s.sendall(FRAME.pack(100) + b"abc")
    assert client.lookup("after", list(range(64))).matched_tokens == 0
    assert client.stats().engines >= 1


def test_requests_sent_back_to_back_are_answered_in_order(daemon: DaemonProcess, client: DepotClient) -> None:
    reqs = [pb.SessionRequest(lookup=pb.LookupRequest(engine_id=client.engine_id, request_id=f"o{i}", tokens=list(range(16 * (i + 1))))) for i in range(20)]
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(lane_path(daemon))
        s.sendall(b"".join(FRAME.pack(len(b)) + b for b in (r.SerializeToString() for r in reqs)))
        for i in range(20):
            (n,) = FRAME.unpack(s.recv(4, socket.MSG_WAITALL))
            body = s.recv(n, socket.MSG_WAITALL)
            assert body[0] == 0 and pb.SessionResponse.FromString(body[1:]).lookup.total_blocks == i + 1


def test_a_stalled_daemon_costs_a_lane_call_its_deadline() -> None:
    d = DaemonProcess().start()
    assert d.proc is not None
    try:
        with DepotClient(d.tcp, deadline_s=0.2) as c:
            c.register_engine("m-stall", LAYOUT)
            assert not c.step(new_batch("a", list(range(32)))).degraded
            d.proc.send_signal(signal.SIGSTOP)
            t0 = time.monotonic()
            assert c.lookup("b", list(range(32))).degraded
            assert time.monotonic() - t0 < 0.5
            d.proc.send_signal(signal.SIGCONT)
            time.sleep(0.3)  # the late answer arrives on the dropped connection, not on the next call's
            r = c.lookup("c", list(range(32)))
            assert not r.degraded and r.matched_tokens == 0
    finally:
        d.proc.send_signal(signal.SIGCONT)
        assert d.stop() == 0


def test_a_restarted_daemon_costs_no_call_and_its_lane_file_goes() -> None:
    toks = list(range(900, 964))
    d = DaemonProcess().start()
    with DepotClient(d.unix, deadline_s=1.0) as c:
        c.register_engine("m-restart", LAYOUT)
        assert not c.lookup("a", toks).degraded and c._lane._sock is not None
        d.stop(signal.SIGKILL)
        assert os.path.exists(lane_path(d))  # stale: the next daemon must clear it
        d = DaemonProcess(unix=d.unix).start()
        end = time.monotonic() + 15
        while c.epoch < 2 and time.monotonic() < end:  # the keeper registers with the new daemon
            time.sleep(0.05)
        assert c.epoch == 2
        assert not c.lookup("b", toks).degraded, "the first call after the restart was lost"
        assert not c.step(new_batch("b", toks)).degraded
        assert c._lane._sock is not None  # on the lane again
    assert d.stop() == 0
    assert not os.path.exists(lane_path(d))  # a clean shutdown removes the lane's socket


def test_without_a_lane_the_client_stays_on_grpc() -> None:
    with DaemonProcess(args=["--lane", "false"]) as d:
        assert not os.path.exists(lane_path(d))
        with DepotClient(d.tcp, strict=True, deadline_s=5.0) as c:
            c.register_engine("m-nolane", LAYOUT)
            assert c._lane._target is None
            assert c.step(new_batch("a", list(range(32)))).ops
    with DaemonProcess() as d, DepotClient(d.tcp, strict=True, deadline_s=5.0) as c:
        c.register_engine("m-lane-gone", LAYOUT)
        c._lane.configure(["127.0.0.1:1"])  # a lane that is not there: gRPC serves, the lane rests
        assert c.step(new_batch("a", list(range(32)))).ops
        assert c._lane._sock is None and c._lane._retry_at > time.monotonic()


def test_a_fixed_lane_port_is_where_the_lane_listens_and_a_taken_one_stops_the_start() -> None:
    port = free_port()
    with DaemonProcess(args=["--lane-port", str(port)]) as d, DepotClient(d.tcp, strict=True, deadline_s=5.0) as c:
        c.register_engine("m-lane-port", LAYOUT)
        assert c._lane._target == ("tcp", "127.0.0.1", port)
        assert c.step(new_batch("a", list(range(32)))).ops
        assert c._lane._sock is not None and c._lane._sock.getpeername()[1] == port
        with pytest.raises(RuntimeError, match="cannot open the lane beside 127.0.0.1:[0-9]+: .*in use"):
            DaemonProcess(args=["--lane-port", str(port)]).start(timeout_s=30)


class ScriptedLane:
    """A lane server whose connections each answer `answers[i]` frames (OK, an empty
    SessionResponse) and then close: a stand-in for a daemon that restarts or breaks."""

    def __init__(self, answers: list[int]) -> None:
        self.answers = list(answers)
        self.server = socket.socket()
        self.server.bind(("127.0.0.1", 0))
        self.server.listen()
        self.port = self.server.getsockname()[1]
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while self.answers:
            conn, _ = self.server.accept()
            self.connections += 1
            with conn:
                for _ in range(self.answers.pop(0)):
                    (n,) = FRAME.unpack(conn.recv(4, socket.MSG_WAITALL))
                    conn.recv(n, socket.MSG_WAITALL)
                    conn.sendall(FRAME.pack(1) + b"\0")
                conn.recv(4, socket.MSG_WAITALL)  # the next request arrives, and the connection closes


def test_a_dead_idle_connection_costs_one_reconnect_and_a_new_one_that_breaks_hands_over_to_grpc() -> None:
    req = pb.SessionRequest(lookup=pb.LookupRequest(engine_id="e", request_id="r"))
    srv = ScriptedLane([1, 1, 0])
    lane = Lane(f"127.0.0.1:{srv.port + 1}")
    lane.configure([f"127.0.0.1:{srv.port}"])
    assert lane.call(req, 2.0) == pb.SessionResponse()  # connection 1
    assert lane.call(req, 2.0) == pb.SessionResponse()  # connection 1 dies under it: sent again on connection 2
    assert srv.connections == 2
    assert lane.call(req, 2.0) is None  # connection 2 dies, and the new connection 3 too: over to gRPC
    assert srv.connections == 3 and lane._retry_at > time.monotonic()
    assert lane.call(req, 2.0) is None  # resting: no connection tried
    assert srv.connections == 3
    lane.close()


def test_async_lane_makes_the_same_decisions() -> None:
    req = pb.SessionRequest(lookup=pb.LookupRequest(engine_id="e", request_id="r"))
    srv = ScriptedLane([1, 1, 0])

    async def main() -> None:
        lane = AsyncLane(f"127.0.0.1:{srv.port + 1}")
        lane.configure([f"127.0.0.1:{srv.port}"])
        assert await lane.call(req, 2.0) == pb.SessionResponse()
        assert await lane.call(req, 2.0) == pb.SessionResponse()  # sent again on a new connection
        assert await lane.call(req, 2.0) is None  # a new connection broke too: over to gRPC
        assert srv.connections == 3 and lane._retry_at > time.monotonic()
        lane.close()

    asyncio.run(main())


def test_async_client_uses_the_lane_and_a_stalled_daemon_costs_a_call_its_deadline() -> None:
    d = DaemonProcess().start()
    assert d.proc is not None

    async def main() -> None:
        c = AsyncDepotClient(d.unix, deadline_s=0.2)
        await c.register_engine("m-async-lane", LAYOUT)
        assert not (await c.step(new_batch("a", list(range(32))))).degraded
        assert c._lane._conn is not None  # it went on the lane
        assert d.proc is not None
        d.proc.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        assert (await c.lookup("b", list(range(32)))).degraded
        assert time.monotonic() - t0 < 0.5
        d.proc.send_signal(signal.SIGCONT)
        await asyncio.sleep(0.3)
        r = await c.lookup("c", list(range(32)))
        assert not r.degraded and r.matched_tokens == 0
        await c.close()

    try:
        asyncio.run(main())
    finally:
        d.proc.send_signal(signal.SIGCONT)
        assert d.stop() == 0


def test_an_open_lane_does_not_hold_the_drain() -> None:
    d = drain_with_an_idle_client("lane connection", lane=True)
    assert not os.path.exists(lane_path(d))
