"""Hypothesis drives arbitrary messages (and raw bytes) at every RPC of the running daemon.

Every answer is a response or a clear client-error status; never INTERNAL, never a dead daemon,
never a traceback in its log; and its own invariants hold afterwards (checked through inspection).
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvdepot import DepotClient, StepBatch
from kvdepot.testing import DaemonProcess
from kvdepot.v1 import kvdepot_pb2 as pb
from tests.integration.conftest import LAYOUT

pytestmark = [pytest.mark.integration, pytest.mark.fuzz]
SERVICE = pb.DESCRIPTOR.services_by_name["BlockManager"]
UNARY = [m for m in SERVICE.methods if not m.client_streaming and not m.server_streaming]
LANE_CODES = {c.value[0]: c for c in grpc.StatusCode}
ALLOWED = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
ENGINE: dict[str, str] = {}

T = FieldDescriptor
SCALARS = {
    T.TYPE_UINT32: st.integers(0, 2**32 - 1) | st.integers(0, 300),
    T.TYPE_UINT64: st.integers(0, 2**64 - 1) | st.integers(0, 300),
    T.TYPE_FIXED64: st.integers(0, 2**64 - 1),
    T.TYPE_DOUBLE: st.floats(allow_nan=True),
    T.TYPE_BOOL: st.booleans(),
    T.TYPE_STRING: st.text(max_size=12) | st.sampled_from(["", "float16", "r1", "m"]),
    T.TYPE_BYTES: st.binary(max_size=64),
    T.TYPE_ENUM: st.integers(0, 4),
}


def message(desc: Any, depth: int = 0) -> st.SearchStrategy[Any]:
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for f in desc.fields:
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            continue
        if f.message_type is not None:
            if depth > 2:
                continue
            inner = message(f.message_type, depth + 1)
        else:
            inner = SCALARS[f.type]
        if f.is_repeated:
            inner = st.lists(inner, max_size=6)
        if f.name == "engine_id":
            inner = st.sampled_from(["known", "nope", ""])
        fields[f.name] = st.none() | inner

    def build(values: dict[str, Any]) -> Any:
        msg = desc._concrete_class()
        for k, v in values.items():
            if v is None:
                continue
            if k == "engine_id" and v == "known":
                v = ENGINE["id"]
            f = desc.fields_by_name[k]
            if f.is_repeated:
                getattr(msg, k).extend(v) if f.message_type is None else [getattr(msg, k).add().CopyFrom(x) for x in v]
            elif f.message_type is not None:
                getattr(msg, k).CopyFrom(v)
            else:
                setattr(msg, k, v)
        return msg

    return st.fixed_dictionaries({}, optional=fields).map(build)


@pytest.fixture(scope="module")
def target() -> Iterator[tuple[DaemonProcess, DepotClient]]:
    d = DaemonProcess(args=["--max-tokens", "100000"]).start()
    c = DepotClient(d.tcp, strict=True, deadline_s=5.0)
    ENGINE["id"] = c.register_engine("m", LAYOUT)
    b = StepBatch()
    b.new("r1", list(range(64)), [0, 1, 2, 3], computed=0, scheduled=64)
    c.step(b)
    yield d, c
    c.close()
    assert d.stop() == 0
    log = d.log()
    assert "Traceback" not in log and "internal error" not in log, log


def call(ch: grpc.Channel, method: Any, payload: bytes) -> None:
    rpc = ch.unary_unary(f"/{SERVICE.full_name}/{method.name}", request_serializer=None, response_deserializer=None)
    try:
        rpc(payload, timeout=10)
    except grpc.RpcError as e:
        assert e.code() in ALLOWED, f"{method.name}: {e.code()} {e.details()}"


@settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_arbitrary_messages_at_every_rpc(target: tuple[DaemonProcess, DepotClient], data: st.DataObject) -> None:
    d, c = target
    method = data.draw(st.sampled_from(UNARY))
    if method.name in ("Clear", "UnregisterEngine") and data.draw(st.booleans()):
        method = SERVICE.methods_by_name["GetStats"]  # keep the known engine alive most of the time
    msg = data.draw(message(method.input_type))
    if method.name == "UnregisterEngine" and msg.engine_id == ENGINE["id"]:
        msg.engine_id = "nope"
    with grpc.insecure_channel(d.tcp) as ch:
        call(ch, method, msg.SerializeToString())
    assert d.alive()


@settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(method=st.sampled_from(UNARY), raw=st.binary(max_size=200))
def test_raw_bytes_at_every_rpc(target: tuple[DaemonProcess, DepotClient], method: Any, raw: bytes) -> None:
    d, _ = target
    with grpc.insecure_channel(d.tcp) as ch:
        call(ch, method, raw)
    assert d.alive()


@settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(msgs=st.lists(message(pb.WorkerMessage.DESCRIPTOR), max_size=5))
def test_arbitrary_worker_streams(target: tuple[DaemonProcess, DepotClient], msgs: list[Any]) -> None:
    d, c = target
    with grpc.insecure_channel(d.tcp) as ch:
        stream = ch.stream_stream(f"/{SERVICE.full_name}/WorkerStream", request_serializer=pb.WorkerMessage.SerializeToString, response_deserializer=pb.WorkerEvent.FromString)
        try:
            for _ in stream(iter(msgs), timeout=2):
                pass
        except grpc.RpcError as e:
            assert e.code() in ALLOWED | {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}, (e.code(), e.details())
    assert d.alive()
    s = c.stats()
    assert s.engines >= 1


@settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(msgs=st.lists(message(pb.SessionRequest.DESCRIPTOR) | st.binary(max_size=80), max_size=5))
def test_arbitrary_session_streams(target: tuple[DaemonProcess, DepotClient], msgs: list[Any]) -> None:
    d, c = target
    raw = [m if isinstance(m, bytes) else m.SerializeToString() for m in msgs]
    with grpc.insecure_channel(d.tcp) as ch:
        stream = ch.stream_stream(f"/{SERVICE.full_name}/Session", response_deserializer=pb.SessionResponse.FromString)
        answered = 0
        try:
            for _ in stream(iter(raw), timeout=2):
                answered += 1
        except grpc.RpcError as e:
            assert e.code() in ALLOWED, (e.code(), e.details())
        assert answered <= len(raw)
    assert d.alive()
    assert c.stats().engines >= 1


@settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    msgs=st.lists(message(pb.SessionRequest.DESCRIPTOR) | st.binary(max_size=80), max_size=5),
    tail=st.binary(max_size=12),  # then bytes that need not be a whole frame
)
def test_arbitrary_lane_frames(target: tuple[DaemonProcess, DepotClient], msgs: list[Any], tail: bytes) -> None:
    """The lane answers every whole frame with OK or an allowed status, in order."""
    d, c = target
    raw = [m if isinstance(m, bytes) else m.SerializeToString() for m in msgs]
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(d.unix[len("unix:") :] + ".lane")
        s.sendall(b"".join(struct.pack("<I", len(r)) + r for r in raw) + tail)
        for _ in raw:
            (n,) = struct.unpack("<I", s.recv(4, socket.MSG_WAITALL))
            body = s.recv(n, socket.MSG_WAITALL)
            assert body and (body[0] == 0 or LANE_CODES[body[0]] in ALLOWED), body
    assert d.alive()
    assert c.stats().engines >= 1
