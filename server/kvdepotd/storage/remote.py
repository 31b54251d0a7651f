"""The remote tier's store (G4): a Valkey (or Redis) cluster or single server, through the
valkey-glide client, and the format of the values the daemon keeps there.

    RemoteSettings.parse(url, ...)   valkey://[user[:password]@]host:port[,host:port...]; valkeys:// for TLS
    RemoteStore(settings)            connect() / ping() / close(); exists(keys, timeout_ms) ->
                                     per key True, False or an error; get(keys) -> per key bytes,
                                     None (missing) or an error; set(items) -> per key None or an error
    block_key(prefix, namespace, layout_class, hash)   where a block lives
    pack_header(...) / check_header(...)                the value: a header, then the block's data
    ValueKeys.load(path)                                the deployment's secret(s): every value carries
                                                        a keyed MAC (BLAKE3) of its header and data

One key per block holds every rank's data, so the store evicts a block whole (a header and data in
two keys could lose one and keep the other). The key is scoped by the namespace and layout class
(a fingerprint of both) and names the block's chained hash, which the model already scopes.

A value is a header, then the block's data (all ranks, rank after rank), little-endian:
    magic "KVDPRMT1", format version (u16, 2), world size (u16), header length (u32, the tag
    included), data bytes (u64), hash (u64), parent (u64; 0 without one), has a parent (u8),
    7 zero bytes of padding, fingerprint (u64), key id (u64), per-rank xxh3-64 of the data (u64
    each), namespace and layout class (u16 length + UTF-8 each), xxh3-64 of all the header before
    it (u64), then the tag: BLAKE3 keyed with the namespace's key (32 bytes) over the header before
    the tag and the data.
A read checks every field against what the daemon expects and every rank's data against its
checksum (a corrupt block: an accident), then the tag (a forged block, or one signed with a key
this daemon does not hold); either way the value is deleted from the store and the load recomputes.

The checksums catch accidents, the tag catches writers: whoever can write to the store but does
not hold the deployment's secret cannot make a value a daemon accepts. A namespace's key is derived
from the secret and the namespace, so a value moved under another tenant's key fails too.

The store runs its own eviction (`maxmemory` with `maxmemory-policy allkeys-lru`, or a TTL per
value): `config_warnings()` says when it would refuse writes instead, or grow without bound.
"""

from __future__ import annotations

import bisect
import functools
import hmac
import socket
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import blake3
import xxhash

from kvdepotd.config import parse_remote_url

MAGIC = b"KVDPRMT1"
FORMAT = 2
_FIXED = struct.Struct("<8sHHIQQQB7xQQ")
TAG_BYTES = 32
MIN_SECRET_CHARS = 32
SILENT_S = 1.0  # a node whose request timed out is not asked again for this long (one health check)
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


class ValueKeys:
    """The deployment's secrets (`remote_key_file`: one per line, the first signs, the others are
    accepted too, for a rotation) and the per-namespace MAC keys derived from them. A secret is
    never logged nor shown: `ids` (a one-way digest of each) names them."""

    def __init__(self, secrets: Sequence[bytes]) -> None:
        if not secrets:
            raise ValueError("no key")
        self._secrets = {_key_id(s): s for s in secrets}
        self.signing = _key_id(secrets[0])

    def __repr__(self) -> str:
        return f"ValueKeys(ids={self.ids})"

    @property
    def ids(self) -> list[str]:
        return [f"{i:016x}" for i in self._secrets]

    @staticmethod
    def load(path: str) -> ValueKeys:
        """Raises ValueError saying what is wrong with the file (never what it holds)."""
        try:
            with open(path, "rb") as f:
                lines = f.read().splitlines()
        except OSError as e:
            raise ValueError(f"remote_key_file {path}: {e.strerror or e}") from None
        secrets = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith(b"#")]
        if not secrets:
            raise ValueError(f"remote_key_file {path} holds no key (one secret per line; make one with `openssl rand -hex 32`)")
        for n, sec in enumerate(secrets, 1):
            if len(sec) < MIN_SECRET_CHARS:
                raise ValueError(f"remote_key_file {path}: key {n} has {len(sec)} characters, fewer than {MIN_SECRET_CHARS} (make one with `openssl rand -hex 32`)")
        if len({_key_id(s) for s in secrets}) != len(secrets):
            raise ValueError(f"remote_key_file {path} holds one key twice")
        return ValueKeys(secrets)

    @functools.lru_cache(maxsize=1024)  # noqa: B019 (a few keys, living as long as the daemon)
    def key(self, key_id: int, namespace: str) -> bytes | None:
        """The MAC key of `namespace` under the secret `key_id`, or None when this daemon does not hold it."""
        secret = self._secrets.get(key_id)
        if secret is None:
            return None
        return blake3.blake3(secret + b"\0" + namespace.encode(), derive_key_context=_NAMESPACE_KEY_CONTEXT).digest()

    def tag(self, key: bytes, head: bytes | memoryview, data: Any) -> bytes:
        return blake3.blake3(head, key=key).update(data).digest()


_NAMESPACE_KEY_CONTEXT = "kvdepot 2026-12 remote value key of a namespace"


def _key_id(secret: bytes) -> int:
    return int.from_bytes(blake3.blake3(secret, derive_key_context="kvdepot 2026-12 remote key id").digest(8), "little")


def header_bytes(world_size: int, namespace: str, layout_class: str) -> int:
    return _FIXED.size + 8 * world_size + 2 + len(namespace.encode()) + 2 + len(layout_class.encode()) + 8 + TAG_BYTES


def pack_header(
    world_size: int, data_bytes: int, h: int, parent: int | None, namespace: str, layout_class: str, checksums: Sequence[int], key_id: int
) -> bytes:
    """The header up to its tag (TAG_BYTES short of header_bytes): `seal` adds the tag once the
    data is behind it."""
    ns, cls = namespace.encode(), layout_class.encode()
    length = header_bytes(world_size, namespace, layout_class)
    head = b"".join(
        [
            _FIXED.pack(MAGIC, FORMAT, world_size, length, data_bytes, h, parent or 0, parent is not None, fingerprint(namespace, layout_class), key_id),
            b"".join(_U64.pack(s) for s in checksums),
            _U16.pack(len(ns)), ns, _U16.pack(len(cls)), cls,
        ]
    )
    return head + _U64.pack(xxhash.xxh3_64_intdigest(head))


def seal(keys: ValueKeys, namespace: str, value: memoryview) -> None:
    """Writes the tag of a value whose header (all but the tag) and data are in place."""
    length = _FIXED.unpack_from(value)[3]
    key = keys.key(keys.signing, namespace)
    assert key is not None
    value[length - TAG_BYTES : length] = keys.tag(key, value[: length - TAG_BYTES], value[length:])


class Forged(ValueError):
    """The value's tag does not check out: not made by a daemon holding one of this one's keys."""


def verify(keys: ValueKeys, namespace: str, value: bytes | memoryview, length: int, data: Any) -> None:
    """Raises Forged unless the value's tag is the one its header's key gives over the header and
    `data` (the value's data, wherever it was copied: what the engine will get is what is checked)."""
    key_id = _FIXED.unpack_from(value)[9]
    key = keys.key(key_id, namespace)
    if key is None:
        raise Forged(f"signed with key {key_id:016x}, which this daemon does not hold (it holds {', '.join(keys.ids)})")
    if not hmac.compare_digest(keys.tag(key, value[: length - TAG_BYTES], data), bytes(value[length - TAG_BYTES : length])):
        raise Forged("its tag does not match its contents: written by something that does not hold the deployment's key")


def check_header(value: bytes | memoryview, world_size: int, data_bytes: int, h: int, parent: int | None, namespace: str, layout_class: str) -> tuple[int, list[int]]:
    """(header length, per-rank checksums) when the value's header says exactly what is expected;
    raises ValueError naming the first field that does not: a damaged value (its structure or its
    header's checksum), or Forged for a well-made header of another block, namespace, layout or
    size (no accident makes one: it was put there). The tag is checked apart (verify)."""
    if len(value) < _FIXED.size:
        raise ValueError(f"value of {len(value)} bytes is shorter than a header")
    magic, version, ws, length, nbytes, vh, vp, has_parent, fp, _ = _FIXED.unpack_from(value)
    if magic != MAGIC:
        raise ValueError("not a kvdepot block (magic)")
    if version != FORMAT:
        raise ValueError(f"format version {version}, this daemon reads {FORMAT}")
    if length > len(value) or length < _FIXED.size + 8 * ws + 4 + 8 + TAG_BYTES:
        raise ValueError(f"header length {length} does not fit the value")
    end = length - TAG_BYTES - 8
    if _U64.unpack_from(value, end)[0] != xxhash.xxh3_64_intdigest(bytes(value[:end])):
        raise ValueError("header checksum mismatch")
    if (ws, nbytes) != (world_size, data_bytes):
        raise Forged(f"{ws} ranks of {nbytes} bytes, expected {world_size} of {data_bytes}")
    if vh != h or (bool(has_parent), vp if has_parent else None) != (parent is not None, parent):
        raise Forged("hash or parent differs from the key's block")
    if fp != fingerprint(namespace, layout_class):
        raise Forged("namespace or layout class fingerprint differs")
    off = _FIXED.size
    sums = [_U64.unpack_from(value, off + 8 * r)[0] for r in range(ws)]  # within `end`: checked above
    off += 8 * ws
    names = []
    for _ in range(2):
        if off + 2 > end:
            raise ValueError("the header's names run past its end")
        (n,) = _U16.unpack_from(value, off)
        if off + 2 + n > end:
            raise ValueError("the header's names run past its end")
        names.append(bytes(value[off + 2 : off + 2 + n]).decode("utf-8", "replace"))
        off += 2 + n
    if off != end or names != [namespace, layout_class]:
        raise Forged("namespace or layout class differs")
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
    keys: ValueKeys | None = field(default=None, repr=False, compare=False)  # None: values cannot be made or read

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
        self._silent: dict[str, float] = {}  # node -> until when its keys fail at once
        self._slot_starts: list[int] = []
        self._slot_ranges: list[tuple[int, int, str]] = []
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
            if self.client is None or not self.answered:
                refused = self._unreachable()
                if refused:
                    self.answered, self.error = False, refused
                    return False
            if self.client is None:
                self.connect()
            self.answered = bool(self.client.custom_command(["PING"]))
            self.error = ""
            if self.cluster:
                self._learn_slots()
        except Exception as e:
            self.answered = False
            self.error = f"{type(e).__name__}: {e}"
        return self.answered

    def _learn_slots(self) -> None:
        """Which primary serves which slots (CLUSTER SLOTS), for `by_node`: kept until asked again
        at the next health check (a moved slot only groups keys less well meanwhile; the client
        routes every key by its own map)."""
        try:
            reply = self.client.custom_command(["CLUSTER", "SLOTS"])
        except Exception:
            return
        ranges = sorted((int(r[0]), int(r[1]), f"{_s(r[2][0])}:{int(r[2][1])}") for r in reply or [])
        self._slot_starts = [r[0] for r in ranges]
        self._slot_ranges = ranges

    def by_node(self, keys: Sequence[bytes]) -> dict[str, list[int]]:
        """The positions of `keys` grouped by the primary that serves them, named "host:port" ("" for
        one server, or while the cluster's slots are not known)."""
        if not self.cluster or not self._slot_ranges:
            return {"": list(range(len(keys)))}
        groups: dict[str, list[int]] = {}
        for i, k in enumerate(keys):
            slot = key_slot(k)
            j = bisect.bisect_right(self._slot_starts, slot) - 1
            start, end, node = self._slot_ranges[j] if j >= 0 else (0, -1, "")
            groups.setdefault(node if start <= slot <= end else "", []).append(i)
        return groups

    def silent(self, node: str) -> bool:
        """The node's last request timed out within the last SILENT_S: its keys fail at once
        meanwhile, instead of each job waiting out its own timeout on a node that does not answer."""
        return time.monotonic() < self._silent.get(node, 0.0)

    def timed_out(self, node: str) -> None:
        self._silent[node] = time.monotonic() + SILENT_S

    def _unreachable(self) -> str:
        """Why no address of the store accepts a connection ("" when one does): a store with
        nothing listening is told apart from one that does not answer in time."""
        why = []
        for host, port in self.settings.addresses:
            try:
                socket.create_connection((host, port), timeout=0.2).close()
                return ""
            except OSError as e:
                why.append(f"{host}:{port}: {e.strerror or type(e).__name__}")
        return "no address accepts a connection: " + "; ".join(why)

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


def key_slot(key: bytes) -> int:
    """The cluster slot of a key (CRC16-XMODEM mod 16384, of its {hash tag} when it has one)."""
    start = key.find(b"{")
    if start >= 0:
        end = key.find(b"}", start + 1)
        if end > start + 1:
            key = key[start + 1 : end]
    crc = 0
    for byte in key:
        crc = ((crc << 8) & 0xFF00) ^ _CRC16[((crc >> 8) ^ byte) & 0xFF]
    return crc & 0x3FFF


def _crc16_table() -> list[int]:
    table = []
    for i in range(256):
        crc = i << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
        table.append(crc & 0xFFFF)
    return table


_CRC16 = _crc16_table()


def _s(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)
