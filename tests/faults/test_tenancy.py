"""Tenancy probes over every RPC: tenant A (a valid token of its own namespace), a caller with no
token and one with a wrong token try every method of the service, the lane and /metrics against
tenant B's engine, requests and blocks. Every probe must learn nothing: the same answer as for
an engine, request or block that does not exist, or a refusal that names no tenant."""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvdepot import DepotClient, KvLayout, StepBatch
from kvdepot.hashing import block_hashes, salt_hash, scope_seed, tokens_to_bytes
from kvdepot.messages import layout_pb
from kvdepot.testing import DaemonProcess, FakeEngine
from kvdepot.testing.daemon import free_port
from kvdepot.v1 import kvdepot_pb2 as pb
from kvdepot.v1 import kvdepot_pb2_grpc as pb_grpc
from tests.integration.test_auth import lane_call

pytestmark = pytest.mark.fault
ADMIN, SCRAPE, A, B = "admin-token-0123456789", "metrics-token-0123456789", "team-a-token-0123456789", "team-b-token-0123456789"
LAY = KvLayout(num_layers=2, num_kv_heads=2, head_size=8, dtype="float16", block_size=16, kind="vllm_cpu")
PROMPT = list(range(4242, 4242 + 5 * 16 + 1))
C = grpc.StatusCode


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    tokens = tmp_path_factory.mktemp("tenancy") / "tokens.toml"
    tokens.write_text(f'admin = "{ADMIN}"\nmetrics = "{SCRAPE}"\n[namespaces]\nteam-a = "{A}"\nteam-b = "{B}"\n')
    tokens.chmod(0o600)
    with DaemonProcess(args=["--auth-file", str(tokens), "--metrics-listen", f"127.0.0.1:{free_port()}"]) as d:
        yield d
    assert "Traceback" not in d.log(), d.log()


def test_no_rpc_tells_a_tenant_anything_of_another(daemon: DaemonProcess, tmp_path: Path) -> None:
    victim = DepotClient(daemon.tcp, strict=True, deadline_s=5.0, token=B)
    victim.register_engine("shared-model", LAY)
    e = FakeEngine(victim, layout=LAY)
    for w in e.workers:
        assert w.attached.wait(5)
    e.generate(PROMPT)
    e.add_request(list(range(9000, 9100)), max_new_tokens=1000, rid="b-running")
    e.step()  # one request of B's still running
    eid_b = victim.engine_id
    hashes_b = block_hashes(tokens_to_bytes(PROMPT), 16, scope_seed(salt_hash(), "team-b", "shared-model"))
    assert victim.block(hashes_b[0]).found  # what there is to learn

    attacker = DepotClient(daemon.tcp, strict=True, deadline_s=5.0, token=A)
    eid_a = attacker.register_engine("shared-model", LAY)
    ghost = "eng-000000000000"  # an engine that does not exist: what B's must look like
    tried = leaked = 0

    def same_as_ghost(method: Any, make: Callable[[str], Any], metadata: tuple[tuple[str, str], ...]) -> None:
        """The probe on B's engine is answered exactly as on an engine that does not exist."""
        nonlocal tried, leaked
        answers = []
        for eid in (eid_b, ghost):
            try:
                answers.append(("ok", method(make(eid), timeout=5, metadata=metadata)))
            except grpc.RpcError as err:
                answers.append((err.code(), err.details().replace(eid, "ID")))
        tried += 1
        if answers[0] != answers[1] or answers[0][0] == "ok":
            leaked += 1
            print(f"LEAK: {method}: {answers}")

    with grpc.insecure_channel(daemon.tcp) as ch:
        stub = pb_grpc.BlockManagerStub(ch)
        unary = {
            "Heartbeat": lambda eid: pb.HeartbeatRequest(engine_id=eid),
            "UnregisterEngine": lambda eid: pb.UnregisterEngineRequest(engine_id=eid),
            "RegisterKvCaches": lambda eid: pb.RegisterKvCachesRequest(engine_id=eid),
            "Lookup": lambda eid: pb.LookupRequest(engine_id=eid, request_id="b-running", tokens=PROMPT),
            "Step": lambda eid: pb.StepRequest(engine_id=eid, step=10_000),
            "ListSlots": lambda eid: pb.ListSlotsRequest(engine_id=eid),
            "GetSlot": lambda eid: pb.GetSlotRequest(engine_id=eid, request_id="b-running"),
            "GetBlock": lambda eid: pb.GetBlockRequest(engine_id=eid, hash=hashes_b[0]),
        }
        for token in (A, "", "wrong-token-0123456789"):
            md = (("authorization", f"Bearer {token}"),) if token else ()
            for name, make in unary.items():
                same_as_ghost(getattr(stub, name), make, md)
            same_as_ghost(
                lambda req, **kw: list(stub.Session(iter([req]), **kw)), lambda eid: pb.SessionRequest(lookup=unary["Lookup"](eid)), md
            )
            same_as_ghost(
                lambda req, **kw: list(stub.WorkerStream(iter([req]), **kw)),
                lambda eid: pb.WorkerMessage(attach=pb.WorkerMessage.Attach(engine_id=eid, rank=0)),
                md,
            )

        md_a = (("authorization", f"Bearer {A}"),)

        def check(what: str, ok: bool) -> None:
            nonlocal tried, leaked
            tried += 1
            if not ok:
                leaked += 1
                print(f"LEAK: {what}")

        # A's own engine, B's prompt: hashes are scoped, so nothing of B's is found or loaded
        check("Lookup of B's prompt", stub.Lookup(pb.LookupRequest(engine_id=eid_a, request_id="x", tokens=PROMPT), timeout=5, metadata=md_a).matched_tokens == 0)
        check("GetBlock of B's hashes", not any(stub.GetBlock(pb.GetBlockRequest(engine_id=eid_a, hash=h), timeout=5, metadata=md_a).found for h in hashes_b))
        b = StepBatch()
        b.new("x", PROMPT, list(range(6)), computed=0, scheduled=len(PROMPT))
        step = b.to_pb(eid_a, 1)
        check("Step with B's prompt", all(op.kind != pb.OP_KIND_LOAD for op in stub.Step(step, timeout=5, metadata=md_a).ops))
        check("ListEngines", {x.engine_id for x in stub.ListEngines(pb.ListEnginesRequest(), timeout=5, metadata=md_a).engines} == {eid_a})

        def refused(call: Callable[[], Any], code: grpc.StatusCode, named: str = "") -> bool:
            """Refused with `code`, naming no tenant the caller did not name itself."""
            try:
                call()
            except grpc.RpcError as err:
                return err.code() is code and "team-b" not in err.details().replace(named, "")
            return False

        check("GetStats", refused(lambda: stub.GetStats(pb.GetStatsRequest(), timeout=5, metadata=md_a), C.PERMISSION_DENIED))
        check("Clear", refused(lambda: stub.Clear(pb.ClearRequest(), timeout=5, metadata=md_a), C.PERMISSION_DENIED))
        check(
            "RegisterEngine into team-b",
            refused(
                lambda: stub.RegisterEngine(pb.RegisterEngineRequest(model="shared-model", namespace="team-b", layout=layout_pb(LAY)), timeout=5, metadata=md_a),
                C.PERMISSION_DENIED,
                named="namespace 'team-b'",
            ),
        )
        who = stub.WhoAmI(pb.WhoAmIRequest(), timeout=5, metadata=md_a)
        check("WhoAmI", who.namespace == "team-a" and not who.admin)

    # the lane: A's hello, then B's engine
    assert attacker._lane._target is not None
    _, host, port = attacker._lane._target
    with socket.create_connection((host, port), timeout=5) as s:
        assert lane_call(s, pb.SessionRequest(hello=pb.Hello(token=A)))[0] == 0
        got = [lane_call(s, pb.SessionRequest(lookup=pb.LookupRequest(engine_id=eid, request_id="q", tokens=PROMPT))) for eid in (eid_b, ghost)]
        tried += 1
        leaked += got[0][0] != C.NOT_FOUND.value[0] or got[0][1].replace(eid_b.encode(), b"ID") != got[1][1].replace(ghost.encode(), b"ID")

    # a lane connection nobody lets in does not stay: closed 5 s after it opened without a hello
    with socket.create_connection((host, port), timeout=10) as s:
        t0 = time.monotonic()
        tried += 1
        leaked += s.recv(1) != b"" or not 4 < time.monotonic() - t0 < 8

    # /metrics names tenants: not to A, nor to anyone without a metrics or admin token
    url = "http://" + daemon.args[daemon.args.index("--metrics-listen") + 1] + "/metrics"
    for token in (A, None):
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
        tried += 1
        try:
            urllib.request.urlopen(req, timeout=5)
            leaked += 1
        except urllib.error.HTTPError as err:
            leaked += err.code != 401 or b"team-b" in err.read()

    assert "b-running" in {x.request_id for x in victim.slots()}  # B's engine and request were untouched by all of it
    print(f"\nfault: tenancy probes over every RPC, the lane and /metrics: tried {tried}, survived {tried - leaked}, lost {leaked}")
    assert leaked == 0
    attacker.close()
    victim.close()
    assert e.kv is not None
    e.kv.close()
