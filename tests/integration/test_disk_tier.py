"""The disk tier over a real daemon process, real slab files and FakeEngine's real KV bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from kvdepot import DepotClient, KvLayout
from kvdepot.testing import DaemonProcess, FakeEngine
from tests.integration.conftest import attached_engine, close_engine, wait_counter

pytestmark = pytest.mark.integration

# 4 layers x 2 heads x 8 x fp16 x 16 tokens x K,V = 4096 bytes: O_DIRECT straight from the host arena.
ALIGNED = KvLayout(num_layers=4, num_kv_heads=2, head_size=8, dtype="float16", block_size=16, kind="vllm_cpu")
# 3 layers: 3072 bytes, not a multiple of 4 KiB: through the bounce buffer.
UNALIGNED = KvLayout(num_layers=3, num_kv_heads=2, head_size=8, dtype="float16", block_size=16, kind="vllm_flash")


def start(disk_dir: str, *extra: str) -> DaemonProcess:
    return DaemonProcess(args=["--disk-dir", disk_dir, "--disk-gib", "0.02", "--disk-slab-mib", "1", *extra]).start()


def engine(d: DaemonProcess, lay: KvLayout, model: str = "disk-model", **kw: object) -> FakeEngine:
    return attached_engine(d, lay, model, **kw)


close = close_engine


def disk_pool(c: DepotClient) -> tuple[int, int]:
    """(used, capacity) blocks of the one disk pool."""
    from kvdepot.v1 import kvdepot_pb2 as pb

    (p,) = [p for p in c.stats().pools if p.tier == pb.TIER_DISK]
    return p.used_blocks, p.capacity_blocks


def stop_clean(d: DaemonProcess) -> None:
    assert d.stop() == 0
    assert "Traceback" not in d.log(), d.log()


@pytest.mark.parametrize("lay", [ALIGNED, UNALIGNED], ids=["aligned", "bounce"])
def test_prompt_evicted_from_host_is_loaded_byte_exact_from_disk(tmp_path: str, lay: KvLayout) -> None:
    host_gib = str(64 * lay.block_bytes / 2**30)  # 64 host blocks: the next prompts push the first out
    d = start(str(tmp_path), "--host-gib", host_gib, "--slab-mib", "1", "--disk-admit-after", "1")
    try:
        e = engine(d, lay)
        first_prompt = list(range(1000, 1000 + 20 * 16 + 5))
        first = e.generate(first_prompt, max_new_tokens=2)
        for k in range(4):  # 80 more blocks through a 64-block host tier (write-back past 80%)
            e.generate(list(range(50_000 + k * 1000, 50_000 + k * 1000 + 20 * 16 + 5)), max_new_tokens=1)
        c = e.client
        wait_counter(c, "disk_written_blocks", 20)
        assert c.stats().counters["evictions"] > 0
        e.reset_prefix_cache()
        e.stats.loaded_tokens = 0
        again = e.generate(first_prompt, max_new_tokens=2)
        assert e.stats.loaded_tokens == 20 * 16 and e.stats.failed_load_blocks == 0
        assert e.stats.kv_mismatched_tokens == 0 and again.output == first.output
        counters = c.stats().counters
        assert counters["disk_read_blocks"] > 0 and counters["lookup_disk_hit_tokens"] > 0
        e.check()
        close(e)
    finally:
        stop_clean(d)


def test_blocks_survive_a_restart_and_a_clean_shutdown_loses_nothing(tmp_path: str) -> None:
    d = start(str(tmp_path), "--disk-admit-after", "1")  # write-back: nothing is written until shutdown
    e = engine(d, ALIGNED)
    p = list(range(3000, 3000 + 10 * 16 + 3))
    first = e.generate(p, max_new_tokens=2)
    assert e.client.stats().counters["disk_written_blocks"] == 0
    close(e)
    stop_clean(d)  # the flush writes the admitted host blocks
    assert "recovered 0 blocks" in d.log()
    out = subprocess.run([sys.executable, "-m", "kvdepotd", "check-disk", str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"classes": 1, "blocks": 10, "valid": 10, "bad": 0, "relisted": 0, "problems": []}

    d = start(str(tmp_path), "--disk-admit-after", "1")
    try:
        e = engine(d, ALIGNED)
        s = e.client.stats()
        assert (s.disk_recovered_blocks, s.disk_recovery_dropped_blocks) == (10, 0)
        again = e.generate(p, max_new_tokens=2)
        assert e.stats.loaded_tokens == 10 * 16 and e.stats.kv_mismatched_tokens == 0
        assert again.output == first.output
        close(e)
    finally:
        stop_clean(d)


def test_corrupt_block_on_disk_is_caught_and_recomputed(tmp_path: str) -> None:
    d = start(str(tmp_path), "--disk-policy", "write-through", "--disk-admit-after", "1")
    try:
        e = engine(d, ALIGNED)
        c = e.client
        p = list(range(9000, 9000 + 6 * 16 + 1))
        first = e.generate(p, max_new_tokens=2)
        wait_counter(c, "disk_written_blocks", 6)
        (cls,) = [n for n in os.listdir(tmp_path) if os.path.isdir(os.path.join(tmp_path, n))]
        slab = os.path.join(tmp_path, cls, "slab-00000.kv")
        record = 4096 + ALIGNED.block_bytes
        with open(slab, "r+b") as f:  # flip data bytes of the block in slot 2
            f.seek(2 * record + 4096 + 100)
            f.write(b"\xff" * 8)
        c.clear("host")
        e.reset_prefix_cache()
        again = e.generate(p, max_new_tokens=2)
        assert e.stats.failed_load_blocks >= 1 and e.stats.kv_mismatched_tokens == 0
        assert again.output == first.output
        assert c.stats().counters["disk_checksum_failures"] == 1
        wait_counter(c, "disk_written_blocks", 7)  # dropped, recomputed, stored and written again
        close(e)
    finally:
        stop_clean(d)


def test_recovery_drops_what_the_files_do_not_back(tmp_path: str) -> None:
    d = start(str(tmp_path), "--disk-policy", "write-through", "--disk-admit-after", "1")
    e = engine(d, ALIGNED)
    e.generate(list(range(100, 100 + 8 * 16 + 1)), max_new_tokens=1)
    wait_counter(e.client, "disk_written_blocks", 8)
    close(e)
    stop_clean(d)
    (cls,) = [n for n in os.listdir(tmp_path) if os.path.isdir(os.path.join(tmp_path, n))]
    with open(os.path.join(tmp_path, cls, "slab-00000.kv"), "r+b") as f:  # a header that no longer matches
        f.seek(3 * (4096 + ALIGNED.block_bytes) + 8)
        f.write(b"\x01\x02")
    with open(os.path.join(tmp_path, cls, "journal"), "ab") as f:  # a torn record at the end
        f.write(b"\x01garbage")
    d = start(str(tmp_path))
    try:
        c = DepotClient(d.tcp, strict=True, deadline_s=5.0)
        s = c.stats()
        assert (s.disk_recovered_blocks, s.disk_recovery_dropped_blocks) == (7, 1)
        assert "dropped 1 (header does not match the journal)" in d.log()
        c.close()
    finally:
        stop_clean(d)


def test_bad_disk_configuration_fails_at_start_with_a_clear_message(tmp_path: str) -> None:
    blocker = os.path.join(tmp_path, "file")
    with open(blocker, "w") as f:
        f.write("x")
    with pytest.raises(RuntimeError, match="disk tier directory .* is not usable"):
        DaemonProcess(args=["--disk-dir", os.path.join(blocker, "sub")]).start()
    with pytest.raises(RuntimeError, match="the disk tier needs 100000.00 GiB"):
        DaemonProcess(args=["--disk-dir", str(tmp_path), "--disk-gib", "100000"]).start()


def test_one_directory_serves_one_daemon(tmp_path: str) -> None:
    d = start(str(tmp_path))
    try:
        with pytest.raises(RuntimeError, match="another kvdepotd uses"):
            start(str(tmp_path))
    finally:
        stop_clean(d)


def test_metrics_and_inspection_cover_the_disk_tier(tmp_path: str) -> None:
    import urllib.request

    import grpc

    from kvdepot.testing.daemon import free_port
    from kvdepot.v1 import kvdepot_pb2 as pb
    from kvdepot.v1 import kvdepot_pb2_grpc as pb_grpc

    port = free_port()
    d = start(str(tmp_path), "--disk-policy", "write-through", "--disk-admit-after", "1", "--metrics-listen", f"127.0.0.1:{port}")
    try:
        e = engine(d, ALIGNED)
        c = e.client
        p = list(range(500, 500 + 4 * 16 + 1))
        e.generate(p, max_new_tokens=1)
        wait_counter(c, "disk_written_blocks", 4)
        c.clear("host")
        from kvdepot.hashing import block_hashes, salt_hash, scope_seed, tokens_to_bytes

        h = block_hashes(tokens_to_bytes(p), 16, scope_seed(salt_hash(), "", "disk-model"))[0]
        assert list(c.block(h).tiers) == [pb.TIER_DISK]
        assert disk_pool(c)[0] == 4
        e.reset_prefix_cache()
        e.generate(p, max_new_tokens=1)
        assert list(c.block(h).tiers) == [pb.TIER_HOST, pb.TIER_DISK]  # staged: now in both
        with grpc.insecure_channel(d.tcp) as ch:
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.BlockManagerStub(ch).Clear(pb.ClearRequest(tier=7), timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not a tier" in (err.value.details() or "")
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        for name in (
            'kvdepot_pool_used_blocks{layout_class="' + ALIGNED.layout_class + '",tier="disk"} 4.0',
            "kvdepot_disk_admitted_blocks_total 4.0",
            "kvdepot_disk_written_blocks_total 4.0",
            "kvdepot_disk_read_blocks_total 4.0",
            "kvdepot_disk_checksum_failures_total 0.0",
            'kvdepot_disk_io_bytes_total{op="write"} ' + f"{4 * ALIGNED.block_bytes}.0",
            'kvdepot_disk_io_duration_seconds_count{op="read"}',
            "kvdepot_disk_recovered_blocks 0.0",
            "kvdepot_disk_tier_bytes",
        ):
            assert name in text, name
        close(e)
    finally:
        stop_clean(d)


@pytest.fixture
def tmp_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:  # type: ignore[override]
    yield str(tmp_path_factory.mktemp("disk"))



@pytest.mark.parametrize("share", [0.5, 1.0])
def test_a_namespace_at_its_disk_share_evicts_its_own_disk_blocks(tmp_path: str, share: float) -> None:
    """Team A floods a 256-block disk tier (write-through). With namespace_disk_share 0.5 it evicts
    its own disk blocks past 128, so team B's 6 blocks stay on disk; without a share (the control)
    A's flood pushes them out."""
    from kvdepot.v1 import kvdepot_pb2 as pb

    from kvdepot.hashing import block_hashes, salt_hash, scope_seed, tokens_to_bytes

    args = ["--disk-policy", "write-through", "--disk-admit-after", "1", "--namespace-disk-share", str(share)]
    d = DaemonProcess(args=["--disk-dir", str(tmp_path), "--disk-gib", str(2 / 1024), "--disk-slab-mib", "1", *args]).start()
    try:
        engines = [engine(d, ALIGNED, namespace=ns) for ns in ("team-a", "team-b")]
        a, b = engines
        p = list(range(50, 150))
        b.generate(p, max_new_tokens=1)  # B's 6 full blocks go to disk
        wait_counter(b.client, "disk_written_blocks", 6)
        for i in range(26):  # A: 416 blocks of its own through a 256-block disk
            a.generate(list(range(i * 1000 + 5000, i * 1000 + 5000 + 16 * 16 + 1)), max_new_tokens=1)
        wait_counter(a.client, "disk_evictions", 1)
        time.sleep(0.5)  # the last writes land
        hs = block_hashes(tokens_to_bytes(p), 16, scope_seed(salt_hash(), "team-b", "disk-model"))[:6]
        on_disk = sum(pb.TIER_DISK in b.client.block(h).tiers for h in hs)
        used, capacity = disk_pool(a.client)
        if share < 1:
            assert on_disk == 6, "B's disk blocks were evicted by A's flood"
            assert used <= capacity // 2 + 6
        else:
            assert on_disk < 6  # the control: without a share, A's flood took B's disk blocks
        for e in engines:
            close(e)
    finally:
        stop_clean(d)
