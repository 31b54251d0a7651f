"""Tokens (kvdepotd --auth-file) against the real daemon: every call needs a known token, on gRPC
and on the lane; a namespace's token registers and drives only its namespace's engines, whose
blocks no other namespace hits; Clear needs an admin token; SIGHUP rotates tokens; a bad tokens
file stops the start."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import struct
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvdepot import AsyncDepotClient, DepotClient, KvLayout, PermissionDenied, StepBatch, Unauthenticated
from kvdepot.handles import close_fds, share_cpu_tensors_memfd
from kvdepot.handoff import hand_over, handoff_path
from kvdepot.hashing import block_hashes, salt_hash, scope_seed, tokens_to_bytes
from kvdepot.lane import LocalRpcError
from kvdepot.testing import DaemonProcess, FakeEngine
from kvdepot.testing.daemon import free_port
from kvdepot.v1 import kvdepot_pb2 as pb
from kvdepot.v1 import kvdepot_pb2_grpc as pb_grpc
from tests.integration.conftest import LAYOUT, close_engine, served_again

pytestmark = pytest.mark.integration
ADMIN, A, A2, B = "admin-token-0123456789", "team-a-token-0123456789", "team-a-next-0123456789", "team-b-token-0123456789"
SCRAPE = "metrics-token-0123456789"
TOKENS = f"""
admin = "{ADMIN}"
metrics = "{SCRAPE}"
[namespaces]
team-a = ["{A}", "{A2}"]
team-b = "{B}"
"""
KV = KvLayout(num_layers=2, num_kv_heads=2, head_size=8, dtype="float16", block_size=16, kind="vllm_cpu")


@pytest.fixture(scope="module")
def tokens_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("auth") / "tokens.toml"
    p.write_text(TOKENS)
    p.chmod(0o600)
    return p


@pytest.fixture(scope="module")
def daemon(tokens_file: Path) -> Iterator[DaemonProcess]:
    args = ["--auth-file", str(tokens_file), "--host-gib", "0.0625", "--slab-mib", "1", "--metrics-listen", f"127.0.0.1:{free_port()}"]
    with DaemonProcess(args=args) as d:
        yield d
    assert "Traceback" not in d.log(), d.log()


def engine(d: DaemonProcess, token: str, model: str, address: str = "") -> FakeEngine:
    c = DepotClient(address or d.tcp, strict=True, deadline_s=5.0, token=token)
    c.register_engine(model, KV)
    e = FakeEngine(c, layout=KV)
    for w in e.workers:
        assert w.attached.wait(5), "the worker stream did not attach"
    return e


def batch(rid: str) -> StepBatch:
    b = StepBatch()
    b.new(rid, list(range(40)), [0, 1, 2], computed=0, scheduled=40)
    return b


def test_calls_without_a_known_token_are_refused(daemon: DaemonProcess) -> None:
    assert "tokens required: 4" in daemon.log()
    for token in ("", "not-a-token-of-this-daemon"):
        with DepotClient(daemon.tcp, strict=True, deadline_s=5.0, token=token) as c:
            with pytest.raises(Unauthenticated, match="requires a token" if not token else "not one this daemon knows"):
                c.register_engine("m", LAYOUT)
            with pytest.raises(Unauthenticated):
                c.stats()
    with grpc.insecure_channel(daemon.tcp) as ch:  # health and reflection stay open: probes carry no token
        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING


def test_a_namespace_token_registers_in_its_namespace_only(daemon: DaemonProcess) -> None:
    with DepotClient(daemon.tcp, strict=True, deadline_s=5.0, token=A) as c:
        who = c.who_am_i()
        assert (who.tokens_required, who.namespace, who.admin) == (True, "team-a", False)
        with pytest.raises(PermissionDenied, match="namespace 'team-b' is not the namespace"):
            c.register_engine("m", LAYOUT, namespace="team-b")
        eid = c.register_engine("m", LAYOUT)  # no namespace given: the token's
        assert [(e.engine_id, e.namespace) for e in c.engines()] == [(eid, "team-a")]  # only its own
        with pytest.raises(PermissionDenied, match="admin token"):
            c.clear()
        with DepotClient(daemon.tcp, strict=True, deadline_s=5.0, token=ADMIN) as admin:
            assert admin.register_engine("m", LAYOUT, namespace="team-b")
            assert {"team-a", "team-b"} <= {e.namespace for e in admin.engines()}
            admin.clear()


def test_another_namespace_cannot_drive_or_inspect_an_engine(daemon: DaemonProcess) -> None:
    with DepotClient(daemon.tcp, strict=True, deadline_s=5.0, token=A) as a:
        eid = a.register_engine("m-own", LAYOUT)
        assert a.step(batch("r")).ops
        md = (("authorization", f"Bearer {B}"),)
        with grpc.insecure_channel(daemon.tcp) as ch:
            stub = pb_grpc.BlockManagerStub(ch)
            calls = [
                (stub.Step, pb.StepRequest(engine_id=eid, step=99)),
                (stub.Lookup, pb.LookupRequest(engine_id=eid, request_id="x", tokens=[1, 2, 3])),
                (stub.Heartbeat, pb.HeartbeatRequest(engine_id=eid)),
                (stub.ListSlots, pb.ListSlotsRequest(engine_id=eid)),
                (stub.GetSlot, pb.GetSlotRequest(engine_id=eid, request_id="r")),
                (stub.GetBlock, pb.GetBlockRequest(engine_id=eid, hash=1)),
                (stub.UnregisterEngine, pb.UnregisterEngineRequest(engine_id=eid)),
                (stub.RegisterKvCaches, pb.RegisterKvCachesRequest(engine_id=eid)),
            ]
            for method, req in calls:
                with pytest.raises(grpc.RpcError) as e:
                    method(req, timeout=5, metadata=md)
                # answered as for an engine that does not exist: a token learns nothing of other namespaces' engines
                assert e.value.code() is grpc.StatusCode.NOT_FOUND, (method, e.value.details())
                assert e.value.details() == f"engine '{eid}' is not registered (or its lease expired): register again"
            attach = pb.WorkerMessage(attach=pb.WorkerMessage.Attach(engine_id=eid, rank=0))
            with pytest.raises(grpc.RpcError) as e:
                list(stub.WorkerStream(iter([attach]), timeout=5, metadata=md))
            assert e.value.code() is grpc.StatusCode.NOT_FOUND
        assert a.slots()  # the engine and its slot are untouched
    log = daemon.log()  # for whoever audits the daemon: who was refused what, once per kind of refusal
    assert re.search(r"refused Step from ipv4:127\.0\.0\.1:\d+: engine eng-\w+ is not in the namespace", log), log[-3000:]
    assert "refused WorkerStream from ipv4:127.0.0.1" in log


def test_namespaces_never_share_blocks_and_the_lane_carries_tokens(daemon: DaemonProcess) -> None:
    a, a2, b = engine(daemon, A, "shared-model"), engine(daemon, A2, "shared-model"), engine(daemon, B, "shared-model")
    p = list(range(500, 630))
    a.generate(p, max_new_tokens=1)
    assert a.client._lane._sock is not None  # its engine path went on the lane, after a hello
    r = a2.generate(p, max_new_tokens=1)  # the same namespace (its second token): a hit, byte-exact
    assert a2.stats.loaded_tokens == 128 and r.kv_mismatches == []
    b.generate(p, max_new_tokens=1)  # the same model and prompt in another namespace: no hit
    assert b.stats.loaded_tokens == 0
    for e in (a, a2, b):
        e.check()
        close_engine(e)


def test_no_namespace_learns_what_another_has_cached(daemon: DaemonProcess) -> None:
    """Block hashes are computable by anyone who knows a prompt and a namespace's name (the public
    kvdepot.hashing): GetBlock answers only about the caller's own namespace's blocks."""
    b = engine(daemon, B, "probe-model")
    p = list(range(7000, 7130))
    b.generate(p, max_new_tokens=1)
    hs = block_hashes(tokens_to_bytes(p), KV.block_size, scope_seed(salt_hash(), "team-b", "probe-model"))
    assert b.client.block(hs[0]).found and b.client.block(hs[0]).tiers == [pb.TIER_HOST]
    with DepotClient(daemon.tcp, strict=True, deadline_s=5.0, token=A) as a:
        a.register_engine("probe-model", KV)
        assert not any(a.block(h).found for h in hs)  # as for a prompt nobody sent
        assert a.block(hs[0]) == pb.GetBlockResponse(found=False)
    close_engine(b)


def test_metrics_name_tenants_only_to_a_metrics_or_admin_token(daemon: DaemonProcess) -> None:
    url = "http://" + daemon.args[daemon.args.index("--metrics-listen") + 1] + "/metrics"

    def scrape(token: str | None) -> tuple[int, str]:
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    for token in (None, A, "wrong-token-0123456789"):  # a namespace's token must not learn the others' names
        code, body = scrape(token)
        assert code == 401 and "team-" not in body and "needs 'Authorization: Bearer <token>'" in body
    for token in (SCRAPE, ADMIN):
        code, body = scrape(token)
        assert code == 200 and "kvdepot_namespace_engines" in body
        with DepotClient(daemon.tcp, strict=True, deadline_s=5.0, token=token) as c:  # GetStats likewise
            assert c.stats().engines >= 0
    with DepotClient(daemon.tcp, strict=True, deadline_s=5.0, token=A) as c:
        with pytest.raises(PermissionDenied, match="GetStats reports every namespace's figures together: it needs an admin or a metrics token"):
            c.stats()
    with DepotClient(daemon.tcp, strict=True, deadline_s=5.0, token=SCRAPE) as c:  # a metrics token does nothing else
        with pytest.raises(PermissionDenied, match="a metrics token reads /metrics and nothing else"):
            c.register_engine("m", LAYOUT)


def test_the_asyncio_client_carries_its_token(daemon: DaemonProcess) -> None:
    async def main() -> None:
        for lane in (True, False):  # the lane's hello, and the gRPC Session stream's metadata
            c = AsyncDepotClient(daemon.tcp, strict=True, deadline_s=5.0, token=B, lane=lane)
            assert (await c.who_am_i()).namespace == "team-b"
            await c.register_engine(f"m-async-{lane}", LAYOUT)
            assert [op.kind for op in (await c.step(batch("r"))).ops] == ["store"]
            assert (c._lane._conn is not None) == lane
            assert {e.namespace for e in await c.engines()} == {"team-b"}
            await c.close()
        c = AsyncDepotClient(daemon.tcp, strict=True, deadline_s=5.0, token="wrong-token-0123456789")
        with pytest.raises(Unauthenticated):
            await c.register_engine("m-async", LAYOUT)
        await c.close()

    asyncio.run(main())


def lane_call(sock: socket.socket, req: pb.SessionRequest) -> tuple[int, bytes]:
    data = req.SerializeToString()
    sock.sendall(struct.pack("<I", len(data)) + data)
    (n,) = struct.unpack("<I", sock.recv(4, socket.MSG_WAITALL))
    body = sock.recv(n, socket.MSG_WAITALL)
    return body[0], body[1:]


def test_a_lane_connection_acts_only_after_an_accepted_hello(daemon: DaemonProcess) -> None:
    c = DepotClient(daemon.tcp, strict=True, deadline_s=5.0, token=A)  # open to the end: its engine stays registered
    try:
        eid = c.register_engine("m-lane", LAYOUT)
        assert c._lane._target is not None
        _, host, port = c._lane._target
        lookup = pb.SessionRequest(lookup=pb.LookupRequest(engine_id=eid, request_id="q", tokens=list(range(32))))
        unauthenticated = grpc.StatusCode.UNAUTHENTICATED.value[0]
        with socket.create_connection((host, port), timeout=5) as s:
            code, msg = lane_call(s, lookup)
            assert code == unauthenticated and b"requires a token" in msg
            assert re.search(r"refused Lookup from lane 127\.0\.0\.1:\d+: this daemon requires a token", daemon.log())
            code, _ = lane_call(s, pb.SessionRequest(hello=pb.Hello(token="wrong-token-0123456789")))
            assert code == unauthenticated
            assert lane_call(s, lookup)[0] == unauthenticated
            code, body = lane_call(s, pb.SessionRequest(hello=pb.Hello(token=B)))
            assert code == 0 and pb.SessionResponse.FromString(body).hello.namespace == "team-b"
            assert lane_call(s, lookup)[0] == grpc.StatusCode.NOT_FOUND.value[0]  # team-a's engine: as if it did not exist
            assert lane_call(s, pb.SessionRequest(hello=pb.Hello(token=A)))[0] == 0
            assert lane_call(s, lookup)[0] == 0
        with DepotClient(daemon.tcp, strict=True, deadline_s=5.0, token="wrong-token-0123456789") as bad:
            bad._lane.configure([f"{host}:{port}"])  # as a registration would tell it
            with pytest.raises(grpc.RpcError) as e:  # the client's refused hello fails the call, as gRPC would
                bad._lane.call(lookup, 5.0)
            assert e.value.code() is grpc.StatusCode.UNAUTHENTICATED
            assert bad._lane._sock is None  # and is not kept
    finally:
        c.close()

def test_handed_over_memory_needs_a_token_and_stays_in_its_namespace(daemon: DaemonProcess) -> None:
    path = handoff_path(daemon.unix)
    assert path is not None
    kv = torch.zeros(2, 4, 2, 16, 16, dtype=torch.float16)  # vllm_cpu: [layers][blocks, heads, block, 2*head]
    req, fds = share_cpu_tensors_memfd([kv[0], kv[1]], num_blocks=4)
    try:
        for token, code in (("", grpc.StatusCode.UNAUTHENTICATED), ("not-a-token-0123456789", grpc.StatusCode.UNAUTHENTICATED)):
            with pytest.raises(LocalRpcError) as info:
                hand_over(path, fds, token)
            assert info.value.code() is code
        with DepotClient(daemon.tcp, strict=True, deadline_s=5.0, token=B) as b:
            b.register_engine("m-handoff-b", KV)
            [handoff_id] = hand_over(path, fds, A)  # team-a's memory
            req.engine_id = b.engine_id
            req.storages[0].cpu_shm.handoff_id = handoff_id
            with pytest.raises(grpc.RpcError) as rpc:
                b._stub.RegisterKvCaches(req, timeout=5)
            assert rpc.value.code() is grpc.StatusCode.PERMISSION_DENIED and "team-a" in rpc.value.details()
    finally:
        close_fds(fds)
    assert "set shm_paths = false" in daemon.log()  # the daemon points at the gap paths leave
    e = engine(daemon, A, "m-handoff-a", address=daemon.unix)  # a FakeEngine with a token, over the handoff
    assert e.kv is not None and e.kv.fds
    assert served_again(e, list(range(600, 700))) == 96
    close_engine(e)


def test_sighup_rotates_tokens(tokens_file: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tokens_file.parent / "rotate.toml"
    path.write_text(f'[namespaces]\nteam-a = "{A}"\n')
    with DaemonProcess(args=["--auth-file", str(path)]) as d:
        assert d.proc is not None
        with DepotClient(d.tcp, strict=True, deadline_s=5.0, token=A) as c, DepotClient(d.tcp, deadline_s=5.0, token=A) as engine:
            c.register_engine("m", LAYOUT)
            engine.register_engine("m2", LAYOUT)
            assert engine.worker(0).attached.wait(5)
            assert c.step(batch("r")).ops and engine.step(batch("r")).ops  # on the lane
            path.write_text(f'[namespaces]\nteam-a = "{A2}"\n')  # A is revoked
            d.proc.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 10
            while d.log().count("tokens required") < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            with pytest.raises(Unauthenticated):  # the open lane connection stops working at once
                c.step(batch("s"))
            # An engine's client (not strict) takes each step as a miss and says why once, not every step.
            assert all(engine.step(batch(f"s{i}")).degraded for i in range(5))
            assert sum("step rejected (UNAUTHENTICATED)" in r.getMessage() for r in caplog.records) == 1
            assert "worker stream ended: the token is not one this daemon knows" in d.log()  # its lease is not kept alive
        with DepotClient(d.tcp, strict=True, deadline_s=5.0, token=A2) as c:
            assert c.who_am_i().namespace == "team-a"
            path.write_text("admin = [")  # broken: the tokens in force stay
            d.proc.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 10
            while "the tokens in force stay" not in d.log() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert "is not valid TOML" in d.log()
            assert c.who_am_i().namespace == "team-a"


def test_grpcurl_sends_a_token_as_metadata(daemon: DaemonProcess) -> None:
    from tests.integration.test_daemon import grpcurl_bin

    out = subprocess.run(
        [grpcurl_bin(), "-plaintext", "-H", f"authorization: Bearer {B}", daemon.tcp, "kvdepot.v1.BlockManager/WhoAmI"],
        capture_output=True, text=True, timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"tokens_required": True, "namespace": "team-b"}


@pytest.mark.parametrize(
    "text, error",
    [
        ("admin = [", "is not valid TOML"),
        (None, "cannot read the tokens file"),
    ],
)
def test_a_bad_tokens_file_stops_the_start(  # what a bad file is: tests/unit/test_auth.py
tmp_path: Path, text: str | None, error: str) -> None:
    path = tmp_path / "tokens.toml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(RuntimeError, match=error):
        DaemonProcess(args=["--auth-file", str(path)]).start(timeout_s=30)


def test_a_daemon_without_tokens_says_so(tmp_path: Path) -> None:
    with DaemonProcess() as d, DepotClient(d.tcp, strict=True, deadline_s=5.0, token=A) as c:
        who = c.who_am_i()  # a client with a token talks to a daemon that asks for none
        assert (who.tokens_required, who.admin) == (False, True)
        c.register_engine("m", LAYOUT, namespace="anything")
        assert c.step(batch("r")).ops and c._lane._sock is not None


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(token=st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=80), scheme=st.sampled_from(["Bearer ", "bearer ", "", "Basic "]))
def test_arbitrary_tokens_are_refused_cleanly(daemon: DaemonProcess, token: str, scheme: str) -> None:
    """Whatever a caller puts in the metadata or a lane hello: UNAUTHENTICATED, nothing else."""
    with grpc.insecure_channel(daemon.tcp) as ch:
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.BlockManagerStub(ch).WhoAmI(pb.WhoAmIRequest(), timeout=5, metadata=(("authorization", scheme + token),))
        assert e.value.code() is grpc.StatusCode.UNAUTHENTICATED, e.value.details()
    lane = re.search(r"lanes 127\.0\.0\.1:(\d+)", daemon.log())
    assert lane is not None
    with socket.create_connection(("127.0.0.1", int(lane.group(1))), timeout=5) as s:
        assert lane_call(s, pb.SessionRequest(hello=pb.Hello(token=token)))[0] == grpc.StatusCode.UNAUTHENTICATED.value[0]
