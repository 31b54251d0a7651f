"""KV memory handed over as memfds on the handoff socket (kvdepotd.handoff): engines that reach the
daemon at unix:PATH register no file (byte-exact loads of every layout: test_host_tier), may run as
another user, hand their memory over again to a restarted daemon; bad handoffs are refused with a
status and leave the daemon serving."""

from __future__ import annotations

import fcntl
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvdepot import DepotClient, KvLayout
from kvdepot.handles import allocating_on_shared_memory, close_fds, remove_shm_files, share_cpu_tensors, share_cpu_tensors_memfd
from kvdepot.handoff import connect, hand_over, handoff_path
from kvdepot.lane import FRAME, LocalRpcError, answer
from kvdepot.testing import DaemonProcess, FakeEngine
from kvdepot.v1 import kvdepot_pb2 as pb
from kvdepotd.transfer import blockcopy
from tests.integration.conftest import attached_engine, close_engine, fill_accept_queue, served_again

pytestmark = pytest.mark.integration
NOBODY = 65534


def layout(kind: str = "vllm_cpu") -> KvLayout:
    return KvLayout(num_layers=3, num_kv_heads=2, head_size=8, dtype="float16", block_size=16, kind=kind)


@pytest.fixture(scope="module")
def depot() -> Iterator[DaemonProcess]:
    with DaemonProcess(args=["--host-gib", "0.0625", "--slab-mib", "1"]) as d:
        yield d
    assert "Traceback" not in d.log(), d.log()


def sock_path(d: DaemonProcess) -> str:
    path = handoff_path(d.unix)
    assert path is not None
    return path


def memfd(size: int = 4096, seal: bool = True) -> int:
    fd = os.memfd_create("test-kv", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    return fd


def raw_request(d: DaemonProcess, body: bytes, fds: list[int]) -> bytes:
    """One request on a fresh connection; the answer frame's bytes."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(sock_path(d))
        socket.send_fds(s, [FRAME.pack(len(body)) + body], fds)
        (n,) = FRAME.unpack(s.recv(4, socket.MSG_WAITALL))
        return s.recv(n, socket.MSG_WAITALL)


def refused(d: DaemonProcess, fds: list[int], count: int | None = None, token: str = "", cuda_fds: int = 0) -> LocalRpcError:
    body = pb.HandoffRequest(token=token, fds=len(fds) if count is None else count, cuda_fds=cuda_fds).SerializeToString()
    with pytest.raises(LocalRpcError) as info:
        answer(raw_request(d, body, fds), pb.HandoffResponse)
    return info.value


def test_memfd_share_keeps_values_and_cannot_shrink() -> None:
    tensors = [torch.arange(64, dtype=torch.float32).view(4, 16) + i for i in range(3)]
    before = [t.clone() for t in tensors]
    req, fds = share_cpu_tensors_memfd(tensors, num_blocks=4)
    try:
        assert len(fds) == len(req.storages) == 3 and all(not s.cpu_shm.path for s in req.storages)
        assert all(torch.equal(a, b) for a, b in zip(tensors, before))
        tensors[0][0, 0] = 99.0
        assert os.pread(fds[0], 4, 0) == torch.tensor([99.0]).numpy().tobytes()  # the tensor lives in the memfd
        with pytest.raises(PermissionError):
            os.ftruncate(fds[1], 16)  # sealed: the daemon's mapping can never lose pages under it
    finally:
        close_fds(fds)
    tensors[2].add_(1)  # the memory outlives the descriptors


@pytest.mark.parametrize("memfd", [True, False])
def test_a_kv_cache_allocated_on_shared_memory_is_shared_without_a_copy(memfd: bool) -> None:
    """vLLM allocates its KV cache (one int8 torch.zeros) inside the connector's
    get_mem_pool_context: it lands on a memfd or /dev/shm file from the start, and registering it
    copies nothing (the tensors keep their memory; the handle names that memory)."""
    nbytes, real = 4 << 20, torch.zeros
    with allocating_on_shared_memory(memfd):
        small = torch.zeros(64, dtype=torch.int8)  # not the KV cache: torch's own
        other = torch.zeros(nbytes, dtype=torch.float32)  # nor this (4-byte elements)
        buf = torch.zeros(nbytes, dtype=torch.int8, device=torch.device("cpu"))
        later = torch.zeros(nbytes, dtype=torch.int8)  # only the first is taken
    assert torch.zeros is real and not buf.any()
    views = [buf[:nbytes // 2].view(torch.float16).view(-1, 256), buf[nbytes // 2:].view(torch.float16).view(-1, 256)]
    views[0][1, 3] = 7.0
    addr = buf.untyped_storage().data_ptr()
    share = share_cpu_tensors_memfd if memfd else share_cpu_tensors
    req, held = share(views, num_blocks=views[0].shape[0])
    try:
        assert buf.untyped_storage().data_ptr() == addr and views[0].untyped_storage().data_ptr() == addr  # not moved
        assert len(req.storages) == 1 and req.storages[0].cpu_shm.size == nbytes
        want = views[0][1, 3].reshape(1).numpy().tobytes()
        at = (256 + 3) * 2
        if memfd:
            assert isinstance(held[0], int) and os.pread(held[0], 2, at) == want  # the memfd handed over is the cache's memory
            with pytest.raises(PermissionError):
                os.ftruncate(held[0], 16)
        else:
            path = req.storages[0].cpu_shm.path
            assert held == [path] and os.stat(path).st_mode & 0o777 == 0o600
            with open(path, "rb") as f:
                f.seek(at)
                assert f.read(2) == want
        for t in (small, other, later):  # torch's own memory: shared only by copying it over
            req2, held2 = share([t.view(-1, 64)], num_blocks=t.view(-1, 64).shape[0])
            assert t.untyped_storage().data_ptr() != addr
            (close_fds if memfd else remove_shm_files)(held2)  # type: ignore[operator]
    finally:
        (close_fds if memfd else remove_shm_files)(held)  # type: ignore[operator]


def test_no_room_for_the_kv_cache_is_an_error_before_anything_moves(tmp_path: Path) -> None:
    """Memory that does not fit (a container's small /dev/shm; here a file-size limit) must fail as
    an OSError while the tensors are still where they were, not as a SIGBUS in the engine during the
    copy; no file is left behind."""
    script = tmp_path / "full.py"
    script.write_text(
        textwrap.dedent(
            """
            import glob, os, resource, signal, torch
            from kvdepot.handles import share_cpu_tensors, share_cpu_tensors_memfd
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
            for share in (share_cpu_tensors, share_cpu_tensors_memfd):
                ts = [torch.arange(1 << 20, dtype=torch.float32) + i for i in range(2)]  # 4 MiB each
                ptrs = [t.data_ptr() for t in ts]
                try:
                    share(ts, num_blocks=1)
                    raise SystemExit("shared 8 MiB under a 1 MiB limit")
                except OSError as e:
                    assert "cannot reserve 4.0 MiB" in str(e), e
                assert [t.data_ptr() for t in ts] == ptrs and ts[1][5] == 6
                assert not glob.glob(f"/dev/shm/kvdepot-{os.getpid()}-*")
            print("ok")
            """
        )
    )
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run an engine as another user")
def test_an_engine_of_another_user_registers_through_the_handoff(tmp_path: Path) -> None:
    """Engine and daemon under different users: handed-over memory works, a /dev/shm path does not."""
    script = tmp_path / "engine.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import json, os, sys
            import encodings.idna, grpc._channel  # imported on first use, which would be as nobody
            from kvdepot import DepotClient, KvLayout
            from kvdepot.testing import FakeEngine
            from kvdepot.errors import DepotError
            # After every import: the interpreter and the checkout may be readable by root alone.
            os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY})
            lay = KvLayout(num_layers=3, num_kv_heads=2, head_size=8, dtype="float16", block_size=16, kind="vllm_cpu")
            c = DepotClient(sys.argv[1], strict=True, deadline_s=5.0)
            c.register_engine("other-user", lay)
            try:
                e = FakeEngine(c, layout=lay)
            except DepotError as err:
                print(json.dumps({{"refused": str(err)}}))
                sys.exit(0)
            assert e.workers[0].attached.wait(5)
            p = list(range(300, 500))
            first = e.generate(p, max_new_tokens=3)
            e.reset_prefix_cache()
            second = e.generate(p, max_new_tokens=3)
            s = e.stats
            print(json.dumps({{"uid": os.getuid(), "loaded": s.loaded_tokens, "failed": s.failed_load_blocks, "bad": s.kv_mismatched_tokens, "same": first.output == second.output}}))
            c.close()
            """
        )
    )
    script.chmod(0o644)
    tmp_path.chmod(0o755)
    with DaemonProcess() as d:
        path = d.unix[len("unix:") :]
        os.chmod(os.path.dirname(path), 0o711)
        for p in glob.glob(path + "*"):  # the sockets: as a daemon run with umask 0 would make them
            os.chmod(p, 0o666)

        def run(address: str) -> dict[str, object]:
            r = subprocess.run([sys.executable, str(script), address], capture_output=True, text=True, timeout=120)
            assert r.returncode == 0, r.stderr
            return json.loads(r.stdout.splitlines()[-1])  # type: ignore[no-any-return]

        assert run(d.unix) == {"uid": NOBODY, "loaded": 192, "failed": 0, "bad": 0, "same": True}
        out = run(d.tcp)  # over TCP the engine names a /dev/shm file, which is not the daemon user's
        assert f"belongs to uid {NOBODY}" in str(out["refused"])


def test_memory_is_handed_over_again_after_a_daemon_restart() -> None:
    d = DaemonProcess(args=["--host-gib", "0.0625"]).start()
    try:
        c = DepotClient(d.unix, deadline_s=1.0)
        c.register_engine("restart", layout())
        e = FakeEngine(c, layout=layout(), release_timeout_s=2.0)
        assert e.workers[0].attached.wait(5)
        e.generate(list(range(10, 100)), max_new_tokens=1)
        d.stop(signal.SIGKILL)
        d = DaemonProcess(args=["--host-gib", "0.0625"], unix=d.unix).start()
        end = time.monotonic() + 15
        while "(memory handed over)" not in d.log() and time.monotonic() < end:  # keeper, stream, then the KV
            time.sleep(0.05)
        assert "(memory handed over)" in d.log()
        assert served_again(e, list(range(1000, 1100)), max_new_tokens=2) == 96
        close_engine(e)
    finally:
        d.stop()
    assert not os.path.exists(sock_path(d))  # a clean shutdown removes the handoff socket too


def test_bad_handoffs_are_refused(depot: DaemonProcess) -> None:
    r, w = os.pipe()
    unsealed, good = memfd(seal=False), memfd()
    try:
        e = refused(depot, [r])
        assert e.code() is grpc.StatusCode.INVALID_ARGUMENT and "neither a memfd sealed against shrinking" in e.details()
        assert "descriptor 0" in refused(depot, [unsealed]).details()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stream:  # a doorbell is a datagram socket
            assert "nor a unix datagram socket" in refused(depot, [good, stream.fileno()]).details()
        assert "says 2 descriptors and 1 came" in refused(depot, [good], count=2).details()
        assert "no descriptors" in refused(depot, [], count=0).details()
        with pytest.raises(LocalRpcError) as info:
            answer(raw_request(depot, b"\xff\xff\xff", [good]), pb.HandoffResponse)
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "not a HandoffRequest" in info.value.details()
        with socket.socket(socket.AF_UNIX) as s:  # a frame longer than any request: refused, the connection ended
            s.settimeout(5)
            s.connect(sock_path(depot))
            s.sendall(FRAME.pack(1 << 20) + b"x" * 100)
            (n,) = FRAME.unpack(s.recv(4, socket.MSG_WAITALL))
            with pytest.raises(LocalRpcError, match="over 4096 bytes"):
                answer(s.recv(n, socket.MSG_WAITALL))
            assert s.recv(1) == b""
    finally:
        for fd in (r, w, unsealed, good):
            os.close(fd)
    with DepotClient(depot.tcp, strict=True, deadline_s=5.0) as c:
        c.register_engine("bad-handoff", layout("contiguous"))
        kv = torch.zeros(4, 3, 2, 16, 2, 8, dtype=torch.float16)
        req, fds = share_cpu_tensors_memfd([kv], num_blocks=4)
        try:
            [handoff_id] = hand_over(sock_path(depot), fds)
            req.engine_id = c.engine_id
            req.storages[0].cpu_shm.handoff_id = "0" * 32
            with pytest.raises(grpc.RpcError) as rpc:
                c._stub.RegisterKvCaches(req, timeout=5)
            assert rpc.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "names no descriptor" in rpc.value.details()
            req.storages[0].cpu_shm.handoff_id = handoff_id
            req.storages[0].cpu_shm.size = 10**9
            with pytest.raises(grpc.RpcError) as rpc:
                c._stub.RegisterKvCaches(req, timeout=5)
            assert "does not fit" in rpc.value.details()
            [handoff_id] = hand_over(sock_path(depot), fds)  # the refused registration used the last one up
            req.storages[0].cpu_shm.handoff_id = handoff_id
            req.storages[0].cpu_shm.size = kv.untyped_storage().nbytes()
            assert c._stub.RegisterKvCaches(req, timeout=5).mapped_bytes == kv.untyped_storage().nbytes()
            with pytest.raises(grpc.RpcError) as rpc:  # an id is claimed once
                c._stub.RegisterKvCaches(req, timeout=5)
            assert "names no descriptor" in rpc.value.details()
            handoff_id, not_a_bell = hand_over(sock_path(depot), [fds[0], fds[0]])
            req.storages[0].cpu_shm.handoff_id, req.doorbell_handoff_id = handoff_id, not_a_bell
            with pytest.raises(grpc.RpcError) as rpc:
                c._stub.RegisterKvCaches(req, timeout=5)
            assert rpc.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "not a unix datagram socket" in rpc.value.details()
        finally:
            close_fds(fds)
        assert c.stats().engines >= 1  # still serving


def test_a_full_connect_queue_makes_a_handoff_wait_not_fail(tmp_path: Path) -> None:
    """A Unix socket whose queue of connections not yet accepted is full refuses a connect with a
    timeout at once (EAGAIN): a worker's handoff waits for room until its deadline instead."""
    path = str(tmp_path / "s.handoff")
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(path)
        listener.listen(1)
        queued = fill_accept_queue(path)  # as a flood of idle connections can while the daemon is busy
        try:
            t0 = time.monotonic()
            with pytest.raises(LocalRpcError) as e:  # nobody makes room: the deadline, named
                hand_over(path, [0], timeout_s=0.3)
            assert e.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED and "did not answer within" in e.value.details()
            assert 0.3 <= time.monotonic() - t0 < 2.0
            accepting = threading.Timer(0.3, lambda: queued.append(listener.accept()[0]))
            accepting.start()
            with socket.socket(socket.AF_UNIX) as late:
                t0 = time.monotonic()
                connect(late, path, 5.0)  # room is made after 0.3 s: connected then
                assert 0.2 <= time.monotonic() - t0 < 4.0
            accepting.join()
        finally:
            for s in queued:
                s.close()


def test_the_doorbell_reports_a_load_ahead_of_the_stream() -> None:
    """A worker that hands its memory over hands its doorbell over with it: the copy threads send a
    load's op id on it the moment the rank's part is copied, so poll() has LoadCopied before the
    stream's OpCompleted, for an engine without late load checks too. It says whether every block
    matched its checksum: not for a block the daemon corrupted (fault injection), yes for a good load,
    whose bytes are in place."""
    from kvdepot import LoadCopied, OpCompleted, StepBatch
    from kvdepot.testing.kv import FakeKv

    d = DaemonProcess(args=["--host-gib", "0.0625", "--fault-corrupt-loads", "1"]).start()
    kv = FakeKv(layout(), num_blocks=16)
    try:
        with DepotClient(d.unix, strict=True) as c:
            c.register_engine("bell", layout())
            w = c.worker(0)
            assert w.attached.wait(10)
            [req] = kv.share(memfd=True)
            assert w.register_kv_caches(req, kv.fds[0])

            def load(rid: str, toks: list[int], first: int) -> tuple[LoadCopied, OpCompleted]:
                kv.write([first, first + 1, first + 2], toks, range(33))
                b = StepBatch()
                b.new(f"{rid}-store", toks, [first, first + 1, first + 2], computed=0, scheduled=33)
                w.forward_done(c.step(b).step)
                w.wait(lambda evs: any(isinstance(e, OpCompleted) for e in evs), 10)
                assert c.lookup(rid, toks).matched_tokens == 32
                b = StepBatch()
                b.new(rid, toks, [first + 3, first + 4, first + 5], computed=32, scheduled=1, loaded=32)
                [op] = [op for op in c.step(b).ops if op.kind == "load"]
                evs = w.wait(lambda evs: any(isinstance(e, OpCompleted) and e.op_id == op.op_id for e in evs), 10)
                mine = [e for e in evs if isinstance(e, (LoadCopied, OpCompleted)) and e.op_id == op.op_id]
                assert [type(e) for e in mine] == [LoadCopied, OpCompleted]
                copied, done = mine
                assert isinstance(copied, LoadCopied) and isinstance(done, OpCompleted)
                return copied, done

            copied, done = load("bad", list(range(900, 933)), 0)  # the daemon corrupts the first block it loads (either: two threads)
            assert not copied.intact and done.failed_block_ids in ((3,), (4,))
            copied, done = load("good", list(range(2000, 2033)), 8)
            assert copied.intact and done.success
            assert kv.mismatches([11, 12], list(range(2000, 2033)), 32) == []
            w.close()
    finally:
        kv.close()
        assert d.stop() == 0


@pytest.mark.skipif(not blockcopy.available, reason="loads land layer by layer through the native block copy (`pip install .`)")
@pytest.mark.parametrize(("kind", "kv_factor", "rings"), [
    ("vllm_cpu", 2, True), ("vllm_flash", 2, True), ("contiguous", 2, True), ("contiguous", 1, True), ("trtllm", 2, True), ("trtllm", 1, True),
    ("vllm_cpu", 2, False),
])
def test_a_load_lands_layer_by_layer(kind: str, kv_factor: int, rings: bool) -> None:
    """A load into handed-over memory of a worker that asks for layer rings is copied layer by
    layer: the doorbell says as layers have landed on every block (LayersCopied, 1 to 7 of 8), and
    when it says so those layers' bytes are in the engine's blocks, byte-exact, while later layers
    may still be on their way; then LoadCopied (checked) and OpCompleted. Enough blocks that each
    layer takes the copy threads a while, so a layer reported before it landed shows up as wrong
    bytes. A worker that does not ask gets the load whole, and no LayersCopied."""
    from kvdepot import LayersCopied, LoadCopied, OpCompleted, StepBatch
    from kvdepot.testing.kv import FakeKv

    lay = KvLayout(num_layers=8, num_kv_heads=8, head_size=64, dtype="float16", block_size=16, kind=kind, kv_factor=kv_factor)  # up to 256 KiB a block
    d = DaemonProcess(args=["--host-gib", "0.25"]).start()
    kv = FakeKv(lay, num_blocks=2 * 96 + 2)
    n = 96 * 16  # tokens: 96 blocks, 24 MiB
    toks = list(range(5000, 5000 + n + 1))
    try:
        with DepotClient(d.unix, strict=True) as c:
            c.register_engine("layers", lay)
            w = c.worker(0)
            assert w.attached.wait(10)
            [req] = kv.share(memfd=True)
            req.layer_rings = rings
            assert w.register_kv_caches(req, kv.fds[0])
            first, second = list(range(97)), list(range(97, 194))
            kv.write(first, toks, range(n + 1))
            b = StepBatch()
            b.new("store", toks, first, computed=0, scheduled=n + 1)
            w.forward_done(c.step(b).step)
            w.wait(lambda evs: any(isinstance(e, OpCompleted) for e in evs), 20)
            assert c.lookup("load", toks).matched_tokens == n
            b = StepBatch()
            b.new("load", toks, second, computed=n, scheduled=1, loaded=n)
            [op] = [op for op in c.step(b).ops if op.kind == "load"]
            want = kv.expected(toks, range(n), 0)
            seen: list[object] = []
            end = time.monotonic() + 20
            while not any(isinstance(e, OpCompleted) for e in seen) and time.monotonic() < end:
                for e in w.poll():
                    if getattr(e, "op_id", None) != op.op_id:
                        continue
                    if isinstance(e, LayersCopied):  # at once: the layers it names are in place now
                        got = kv.read(second, range(n), 0)
                        assert torch.equal(got[:, : e.layers], want[:, : e.layers]), f"layers < {e.layers} reported before they landed"
                    seen.append(e)
                w.wait_for_events(0.01)
            counts = [e.layers for e in seen if isinstance(e, LayersCopied)]  # two copy threads may ring in either order
            assert (bool(counts) and all(1 <= k < lay.num_layers for k in counts) and len(set(counts)) == len(counts)) == rings, counts
            rest = [e for e in seen if not isinstance(e, LayersCopied)]
            assert [type(e) for e in rest] == [LoadCopied, OpCompleted] and rest[0].intact and rest[1].success
            assert kv.mismatches(second, toks, n) == []
            w.close()
    finally:
        kv.close()
        assert d.stop() == 0


@pytest.mark.skipif(not blockcopy.available, reason="loads land layer by layer through the native block copy (`pip install .`)")
def test_a_layered_load_past_its_deadline_reports_no_layer() -> None:
    """A layered load whose op ends before its copy (held past the op's deadline) lands no layer:
    the doorbell says nothing of layers, only that the load is not intact, and every block fails."""
    from kvdepot import LayersCopied, LoadCopied, OpCompleted, StepBatch
    from kvdepot.testing.kv import FakeKv

    lay = KvLayout(num_layers=8, num_kv_heads=8, head_size=64, dtype="float16", block_size=16, kind="vllm_cpu")
    d = DaemonProcess(args=["--host-gib", "0.25", "--op-timeout-ms", "300", "--fault-load-delay-ms", "1000"]).start()
    kv = FakeKv(lay, num_blocks=2 * 33 + 2)
    n = 32 * 16
    toks = list(range(8000, 8000 + n + 1))
    try:
        with DepotClient(d.unix, strict=True) as c:
            c.register_engine("late-layers", lay)
            w = c.worker(0)
            assert w.attached.wait(10)
            [req] = kv.share(memfd=True)
            req.layer_rings = True
            assert w.register_kv_caches(req, kv.fds[0])
            kv.write(list(range(33)), toks, range(n + 1))
            b = StepBatch()
            b.new("store", toks, list(range(33)), computed=0, scheduled=n + 1)
            w.forward_done(c.step(b).step)
            w.wait(lambda evs: any(isinstance(e, OpCompleted) for e in evs), 20)
            b = StepBatch()
            assert c.lookup("load", toks).matched_tokens == n
            b.new("load", toks, list(range(33, 66)), computed=n, scheduled=1, loaded=n)
            [op] = [op for op in c.step(b).ops if op.kind == "load"]
            evs = w.wait(lambda evs: any(isinstance(e, LoadCopied) and e.op_id == op.op_id for e in evs), 20)
            mine = [e for e in evs if getattr(e, "op_id", None) == op.op_id]
            assert not any(isinstance(e, LayersCopied) for e in mine), mine
            assert [e.intact for e in mine if isinstance(e, LoadCopied)] == [False]
            w.close()
    finally:
        kv.close()
        assert d.stop() == 0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.binary(max_size=64), nfds=st.integers(0, 3), count=st.integers(0, 4))
def test_arbitrary_handoff_requests_get_an_answer(depot: DaemonProcess, body: bytes, nfds: int, count: int) -> None:
    fds = [memfd() for _ in range(nfds)]
    try:
        req = pb.HandoffRequest(fds=count).SerializeToString() + body
        try:
            ids = answer(raw_request(depot, req, fds), pb.HandoffResponse).ids
            assert len(ids) == nfds > 0  # (the bytes after the request may set its count again)
        except LocalRpcError as e:
            assert e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED), e
    finally:
        close_fds(fds)


def test_without_shm_paths_only_handed_over_memory_is_taken() -> None:
    with DaemonProcess(args=["--shm-paths", "false", "--socket-mode", "0660"]) as d:
        path = d.unix[len("unix:") :]
        assert {p: oct(os.stat(p).st_mode & 0o777) for p in glob.glob(path + "*")} == {
            p: "0o660" for p in (path, path + ".lane", path + ".handoff")
        }
        with DepotClient(d.tcp, strict=True, deadline_s=5.0) as c:
            c.register_engine("paths-off", layout())
            req, paths = share_cpu_tensors([torch.zeros(4, 2, 16, 16, dtype=torch.float16) for _ in range(3)], num_blocks=4)
            req.engine_id = c.engine_id
            with pytest.raises(grpc.RpcError) as rpc:
                c._stub.RegisterKvCaches(req, timeout=5)
            assert rpc.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "shm_paths = false" in rpc.value.details()
            for p in paths:
                os.unlink(p)
        e = attached_engine(d, layout(), "paths-off-handed", address=d.unix)
        assert served_again(e, list(range(50, 150))) == 96
        close_engine(e)


def test_handoffs_nobody_claims_are_closed(tmp_path: Path) -> None:
    from kvdepotd.core.errors import InvalidRequest
    from kvdepotd.handoff import Handoffs

    h = Handoffs(lambda: None, ttl_s=0.2, max_pending=2)
    h.listen(f"unix:{tmp_path}/d.sock")
    fds = [memfd() for _ in range(3)]
    try:
        path = f"{tmp_path}/d.sock.handoff"
        with pytest.raises(LocalRpcError) as info:
            hand_over(path, fds)
        assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        ids = hand_over(path, fds[:2])
        assert h.pending() == 2
        fd = h.claim(ids[0], "any")
        os.close(fd)
        time.sleep(0.3)
        assert h.pending() == 0  # the other one expired and was closed
        with pytest.raises(InvalidRequest, match="names no descriptor"):
            h.claim(ids[1], "any")
    finally:
        h.close()
        close_fds(fds)


def test_a_descriptor_marked_cuda_is_never_mapped_as_memory(depot: DaemonProcess) -> None:
    """CUDA allocations come unsealed (the driver checks them at import): one handed over as such
    cannot be claimed as memory, where an unsealed file could be shrunk under the daemon's copies."""
    unsealed = memfd(seal=False)
    try:
        [handoff_id] = hand_over(sock_path(depot), [unsealed], cuda_fds=1)
        assert "more than the 1 descriptors" in refused(depot, [unsealed], cuda_fds=2).details()
    finally:
        os.close(unsealed)
    with DepotClient(depot.tcp, strict=True, deadline_s=5.0) as c:
        c.register_engine("cuda-as-memory", layout("contiguous"))
        kv = torch.zeros(4, 3, 2, 16, 2, 8, dtype=torch.float16)
        req = pb.RegisterKvCachesRequest(engine_id=c.engine_id, num_blocks=4, tensors=handles_of(kv))
        req.storages.add().cpu_shm.CopyFrom(pb.CpuShmHandle(handoff_id=handoff_id, size=kv.untyped_storage().nbytes()))
        with pytest.raises(grpc.RpcError) as rpc:
            c._stub.RegisterKvCaches(req, timeout=5)
        assert rpc.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "handed over as a CUDA allocation, not as memory" in rpc.value.details()


def handles_of(kv: torch.Tensor) -> list[pb.KvTensor]:
    return [pb.KvTensor(name="kv", storage=0, shape=list(kv.shape), stride=list(kv.stride()), dtype="float16")]


def test_only_an_engine_copies_engines_namespace_fetches_its_host_memory(tmp_path: Path) -> None:
    """The host memory of an engine whose workers copy their blocks (its namespace's blocks only)
    goes to a token of that namespace, for an engine that registered so: never to another's."""
    from kvdepot.handoff import fetch_arena

    auth = tmp_path / "tokens.toml"
    auth.write_text('admin = "admin-token-0123456789"\n[namespaces]\nteam-a = "team-a-token-0123456789"\nteam-b = "team-b-token-0123456789"\n')
    with DaemonProcess(args=["--host-gib", "0.0625", "--slab-mib", "1", "--auth-file", str(auth)]) as d:
        path = sock_path(d)
        with DepotClient(d.unix, strict=True, token="team-a-token-0123456789") as a, DepotClient(d.unix, strict=True, token="team-a-token-0123456789") as plain:
            a.register_engine("ec-model", layout(), engine_copies=True)
            plain.register_engine("plain-model", layout())
            fd, size = fetch_arena(path, a.engine_id, "team-a-token-0123456789")
            try:
                assert size == 1 << 26 and os.fstat(fd).st_size == size
                assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK  # no holder can pull pages from under the daemon
            finally:
                os.close(fd)
            with pytest.raises(LocalRpcError) as info:
                fetch_arena(path, a.engine_id, "team-b-token-0123456789")
            assert info.value.code() is grpc.StatusCode.NOT_FOUND
            with pytest.raises(LocalRpcError) as info:
                fetch_arena(path, plain.engine_id, "team-a-token-0123456789")
            assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION and "did not register with engine_copies" in info.value.details()
            with pytest.raises(LocalRpcError) as info:
                fetch_arena(path, a.engine_id, "")
            assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED
