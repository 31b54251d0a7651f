"""The remote tier's store (G4): a Valkey (or Redis) cluster or single server, through the
valkey-glide client, and the format of the values the daemon keeps there.

    RemoteSettings.parse(url, ...)   valkey://[user[:password]@]host:port[,host:port...]; valkeys:// for TLS
    RemoteStore(settings)            connect() / ping() / close(); exists(keys, timeout_ms) ->
                                     per key True, False or an error; get(keys) -> per key bytes,
                                     None (missing) or an error; set(items) -> per key None or an error
    block_key(prefix, namespace, layout_class, hash)   where a block lives
    pack_header(...) / check_value(...)                 the value: a header, then the block's data

One key per block holds every rank's data, so the store evicts a block whole (a header and data in
two keys could lose one and keep the other). The key is scoped by the namespace and layout class
(a fingerprint of both) and names the block's chained hash, which the model already scopes.

A value is a header, then the block's data (all ranks, rank after rank):
    magic "KVDPRMT1", format version (u16), world size (u16), header length (u32),
    data bytes (u64), hash (u64), parent (u64), has a parent (u8), 7 bytes of padding,
    fingerprint (u64), per-rank xxh3-64 of the data (u64 each),
    namespace and layout class (u16 length + UTF-8 each), xxh3-64 of all the header before it (u64)
A read checks every field against what the daemon expects and every rank's data against its
checksum; anything else is a corrupt block (deleted from the store, and the load recomputes it).

The store runs its own eviction (`maxmemory` with `maxmemory-policy allkeys-lru`, or a TTL per
value): `config_warnings()` says when it would refuse writes instead, or grow without bound.
"""

from __future__ import annotations

import functools
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from kvdepotd.config import parse_remote_url

MAGIC = b"KVDPRMT1"
FORMAT = 1
_FIXED = struct.Struct("<8sHHIQQQB7xQ")
_U64 = struct.Struct("<Q")
_U16 = struct.Struct("<H")


@functools.lru_cache(maxsize=4096)
def fingerprint(namespace: str, layout_class: str) -> int:
    return xxhash.xxh3_64_intdigest(namespace.encode() + b"\0" + layout_class.encode())


@functools.lru_cache(maxsize=4096)
def _key_head(prefix: str, namespace: str, layout_class: str) -> bytes:
    return b"%s:%016x:" % (prefix.encode(), fingerprint(namespace, layout_class))


def block_key(prefix: str, namespace: str, layout_class: str, h: int) -> bytes:
    """A Lookup makes up to 4096 of these on its budget: the part before the hash is made once."""
    return _key_head(prefix, namespace, layout_class) + b"%016x" % h


def header_bytes(world_size: int, namespace: str, layout_class: str) -> int:
    return _FIXED.size + 8 * world_size + 2 + len(namespace.encode()) + 2 + len(layout_class.encode()) + 8


def pack_header(world_size: int, data_bytes: int, h: int, parent: int | None, namespace: str, layout_class: str, checksums: Sequence[int]) -> bytes:
    ns, cls = namespace.encode(), layout_class.encode()
    length = _FIXED.size + 8 * world_size + 2 + len(ns) + 2 + len(cls) + 8
    head = b"".join(
        [
            _FIXED.pack(MAGIC, FORMAT, world_size, length, data_bytes, h, parent or 0, parent is not None, fingerprint(namespace, layout_class)),
            b"".join(_U64.pack(s) for s in checksums),
            _U16.pack(len(ns)), ns, _U16.pack(len(cls)), cls,
        ]
    )
    return head + _U64.pack(xxhash.xxh3_64_intdigest(head))


def check_header(value: bytes | memoryview, world_size: int, data_bytes: int, h: int, parent: int | None, namespace: str, layout_class: str) -> tuple[int, list[int]]:
    """(header length, per-rank checksums) when the value's header says exactly what is expected;
    raises ValueError naming the first field that does not."""
    if len(value) < _FIXED.size:
        raise ValueError(f"value of {len(value)} bytes is shorter than a header")
    magic, version, ws, length, nbytes, vh, vp, has_parent, fp = _FIXED.unpack_from(value)
    if magic != MAGIC:
        raise ValueError("not a kvdepot block (magic)")
    if version != FORMAT:
        raise ValueError(f"format version {version}, this daemon reads {FORMAT}")
    if length + 8 > len(value) or length < _FIXED.size + 8:
        raise ValueError(f"header length {length} does not fit the value")
    end = length - 8
    if _U64.unpack_from(value, end)[0] != xxhash.xxh3_64_intdigest(bytes(value[:end])):
        raise ValueError("header checksum mismatch")
    if (ws, nbytes) != (world_size, data_bytes):
        raise ValueError(f"{ws} ranks of {nbytes} bytes, expected {world_size} of {data_bytes}")
    if vh != h or (bool(has_parent), vp if has_parent else None) != (parent is not None, parent):
        raise ValueError("hash or parent differs from the key's block")
    if fp != fingerprint(namespace, layout_class):
        raise ValueError("namespace or layout class fingerprint differs")
    off = _FIXED.size
    sums = [_U64.unpack_from(value, off + 8 * r)[0] for r in range(ws)]
    off += 8 * ws
    names = []
    for _ in range(2):
        (n,) = _U16.unpack_from(value, off)
        names.append(bytes(value[off + 2 : off + 2 + n]).decode("utf-8", "replace"))
        off += 2 + n
    if off != end or names != [namespace, layout_class]:
        raise ValueError("namespace or layout class differs")
    if len(value) != length + data_bytes:
        raise ValueError(f"value has {len(value) - length} data bytes, expected {data_bytes}")
    return length, sums


@dataclass(frozen=True)
class RemoteSettings:
    addresses: tuple[tuple[str, int], ...]
    tls: bool = False
    user: str = ""
    password: str = ""
    ca_file: str = ""  # PEM roots for TLS (else the system's)
    prefix: str = "kvdepot"
    ttl_s: int = 0  # 0: values live until the store evicts them
    timeout_ms: int = 1000  # one store request (a job's batch)
    connect_timeout_ms: int = 1000

    @staticmethod
    def parse(url: str, **kw: Any) -> RemoteSettings:
        """The URL (config.parse_remote_url); a user or password given in `kw` wins over the URL's."""
        tls, user, password, addresses = parse_remote_url(url)
        fields: dict[str, Any] = {"user": user, "password": password}
        fields.update({k: v for k, v in kw.items() if v not in (None, "")})
        return RemoteSettings(addresses=addresses, tls=tls, **fields)

    def describe(self) -> str:
        """The store's addresses, never the password."""
        who = f"{self.user}@" if self.user else ""
        return ("valkeys://" if self.tls else "valkey://") + who + ",".join(f"{h}:{p}" for h, p in self.addresses)


class RemoteStore:
    """One glide client (thread-safe; the copy threads share it). Every call returns per-key
    results: a store with one node down still answers for the keys the others hold."""

    def __init__(self, settings: RemoteSettings) -> None:
        self.settings = settings
        self.client: Any = None
        self.cluster = False
        self.answered = False  # the last ping was answered
        self.error = ""  # why the last ping was not

    # -- connection --------------------------------------------------------------------------------
    def connect(self) -> None:
        """Connects (raises on failure). Whether the store is a cluster is asked of it."""
        import glide_sync as g

        # The client's own log lines (a reconnect every 2 s while a node is down, each timed-out
        # command) would go to stdout beside the daemon's log: the daemon reports what failed itself.
        g.Logger.set_logger_config(g.LogLevel.OFF)
        s = self.settings
        nodes = [g.NodeAddress(h, p) for h, p in s.addresses]
        creds = g.ServerCredentials(password=s.password or None, username=s.user or None) if (s.password or s.user) else None
        tls = None
        if s.tls and s.ca_file:
            with open(s.ca_file, "rb") as f:
                tls = g.TlsAdvancedConfiguration(root_pem_cacerts=f.read())
        common: dict[str, Any] = dict(use_tls=s.tls, credentials=creds, request_timeout=s.timeout_ms, client_name="kvdepotd")
        probe = g.GlideClient.create(
            g.GlideClientConfiguration(nodes[:1], advanced_config=g.AdvancedGlideClientConfiguration(s.connect_timeout_ms, tls), **common)
        )
        try:
            info = probe.custom_command(["INFO", "cluster"])
            self.cluster = b"cluster_enabled:1" in (info if isinstance(info, bytes) else str(info).encode())
        except BaseException:
            probe.close()
            raise
        if not self.cluster:
            self.client = probe
            return
        probe.close()
        self.client = g.GlideClusterClient.create(
            g.GlideClusterClientConfiguration(nodes, advanced_config=g.AdvancedGlideClusterClientConfiguration(s.connect_timeout_ms, tls), **common)
        )

    def ping(self) -> bool:
        """The store answers (in a cluster: the node glide asks). Connects first when needed;
        `error` says why not. While it does not answer, no command goes to the client until a seed
        address accepts a connection again (the client prints a line for every failed command)."""
        try:
            if self.client is None:
                self.connect()
            elif not self.answered and not self._reachable():
                self.error = "no address of the store accepts a connection"
                return False
            self.answered = bool(self.client.custom_command(["PING"]))
            self.error = ""
        except Exception as e:
            self.answered = False
            self.error = f"{type(e).__name__}: {e}"
        return self.answered

    def _reachable(self) -> bool:
        for host, port in self.settings.addresses:
            try:
                socket.create_connection((host, port), timeout=0.2).close()
                return True
            except OSError:
                continue
        return False

    def close(self) -> None:
        if self.client is not None:
            try:
                self.client.close()
            except Exception:
                pass
            self.client = None

    def config_warnings(self) -> list[str]:
        """What an operator should hear at start: a store that refuses writes when full (any
        maxmemory-policy but allkeys-*) or that has no memory bound, unless values carry a TTL."""
        try:
            got = self._config_get()
        except Exception as e:
            return [f"could not read the store's eviction settings ({e}); it must evict (maxmemory with maxmemory-policy allkeys-lru)"]
        if self.settings.ttl_s:
            return []  # blocks expire on their own
        policies: dict[str, list[str]] = {}
        unbounded = []
        for node, (policy, maxmemory) in sorted(got.items()):
            if not policy.startswith("allkeys-"):
                policies.setdefault(policy, []).append(node)
            if maxmemory == "0":
                unbounded.append(node)
        out = [
            f"maxmemory-policy is {policy} on {', '.join(nodes)}: a full store refuses kvdepot's writes (dropped and counted) instead of "
            "evicting old blocks; set allkeys-lru, or give blocks a TTL (--remote-ttl-s)"
            for policy, nodes in sorted(policies.items())
        ]
        if unbounded:
            out.append(f"maxmemory is 0 on {', '.join(unbounded)}: the store grows until its machine runs out of memory; set maxmemory")
        return out

    def _config_get(self) -> dict[str, tuple[str, str]]:
        def pairs(reply: Any) -> dict[str, str]:
            if isinstance(reply, dict):
                return {_s(k): _s(v) for k, v in reply.items()}
            return {_s(reply[i]): _s(reply[i + 1]) for i in range(0, len(reply), 2)}

        cmd = ["CONFIG", "GET", "maxmemory*"]
        if self.cluster:
            from glide_sync import AllPrimaries

            replies = self.client.custom_command(cmd, AllPrimaries())
            items = replies.items() if isinstance(replies, dict) else [("store", replies)]
        else:
            items = [("store", self.client.custom_command(cmd))]
        out = {}
        for node, reply in items:
            conf = pairs(reply)
            out[_s(node)] = (conf.get("maxmemory-policy", "?"), conf.get("maxmemory", "?"))
        return out

    # -- per-key commands (copy threads and the lookup's thread) ---------------------------------------------
    def _batch(self, fill: Any, timeout_ms: int | None = None) -> list[Any]:
        import glide_sync as g

        if self.client is None:
            raise ConnectionError("not connected to the remote store")
        batch: Any
        opts: Any
        if self.cluster:
            batch = g.ClusterBatch(is_atomic=False)
            opts = g.ClusterBatchOptions(timeout=timeout_ms) if timeout_ms else None
        else:
            batch = g.Batch(is_atomic=False)
            opts = g.BatchOptions(timeout=timeout_ms) if timeout_ms else None
        fill(batch)
        return list(self.client.exec(batch, raise_on_error=False, options=opts) or [])

    def exists(self, keys: Sequence[bytes], timeout_ms: int | None = None) -> list[bool | Exception]:
        def fill(b: Any) -> None:
            for k in keys:
                b.exists([k])

        return [r if isinstance(r, Exception) else bool(r) for r in self._batch(fill, timeout_ms)]

    def get_into(self, keys: Sequence[bytes], buffers: list[memoryview]) -> list[int | None]:
        """MGET straight into `buffers` (one per key, each large enough): per key the bytes
        written, or None (missing). Raises when any part fails (use get() then, per key)."""
        if self.client is None:
            raise ConnectionError("not connected to the remote store")
        return [None if r is None else int(r) for r in self.client.mget(list(keys), buffers=buffers)]

    def get(self, keys: Sequence[bytes], timeout_ms: int | None = None) -> list[bytes | None | Exception]:
        def fill(b: Any) -> None:
            for k in keys:
                b.get(k)

        return self._batch(fill, timeout_ms)

    def set(self, items: Sequence[tuple[bytes, Any]], timeout_ms: int | None = None) -> list[Exception | None]:
        ttl = self.settings.ttl_s
        expiry = None
        if ttl:
            from glide_sync import ExpirySet, ExpiryType

            expiry = ExpirySet(ExpiryType.SEC, ttl)

        def fill(b: Any) -> None:
            for k, v in items:
                b.set(k, v, expiry=expiry)

        return [r if isinstance(r, Exception) else None for r in self._batch(fill, timeout_ms)]

    def delete(self, keys: Sequence[bytes]) -> None:
        def fill(b: Any) -> None:
            for k in keys:
                b.delete([k])

        self._batch(fill)


def _s(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)
