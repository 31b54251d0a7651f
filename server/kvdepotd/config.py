"""Daemon configuration: one table of options, read from defaults < TOML file < KVDEPOT_* env < flags.

Every option has one name: `host_gib` in the file, `KVDEPOT_HOST_GIB` in the environment,
`--host-gib` on the command line. Unknown keys and bad values are errors that say which source
held them. The result is a frozen DaemonConfig; the core never reads files or the environment.
"""

from __future__ import annotations

import argparse
import os
import tomllib
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvdepot.lane import check_unix_path, unix_path
from kvdepotd.environment import ENV_PREFIX, options_in

DEFAULT_LISTEN = "127.0.0.1:50061"


class ConfigError(ValueError):
    """A bad option; the message names the option and where it came from."""


@dataclass(frozen=True, slots=True)
class DaemonConfig:
    listen: tuple[str, ...] = (DEFAULT_LISTEN,)
    host_gib: float = 4.0
    host_prealloc: bool = False
    slab_mib: int = 64
    copy_threads: int = 2
    store_nice: int = 10
    metrics_listen: str = "127.0.0.1:9464"
    lease_ms: int = 30_000
    pin_ms: int = 30_000
    op_timeout_ms: int = 30_000
    load_budget_ms: int = 1000
    max_tokens: int = 1 << 21
    max_message_mib: int = 64
    lane: bool = True
    lane_port: int = 0
    socket_mode: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    auth_file: str = ""
    shm_paths: bool = True
    eviction_policy: str = "leaf-lru"
    namespace_host_share: float = 1.0
    namespace_disk_share: float = 1.0
    max_slots_per_engine: int = 8192
    max_slots_per_namespace: int = 32768
    max_pins_per_engine: int = 8192
    max_pins_per_namespace: int = 32768
    max_pin_tokens_per_namespace: int = 64 << 20
    max_slot_tokens_per_namespace: int = 64 << 20
    max_rank_gib: float = 0.0
    drain_grace_s: float = 10.0
    log_level: str = "info"
    log_format: str = "text"
    disk_dir: str = ""
    disk_gib: float = 16.0
    disk_slab_mib: int = 256
    disk_policy: str = "write-back"
    disk_admit_after: int = 2
    disk_admit_window_s: float = 600.0
    disk_direct_io: bool = True
    disk_threads: int = 2
    remote: str = ""
    remote_user: str = ""
    remote_password: str = ""
    remote_ca: str = ""
    remote_key_file: str = ""
    remote_prefix: str = "kvdepot"
    remote_ttl_s: int = 0
    remote_timeout_ms: int = 1000
    remote_lookup_ms: int = 20
    remote_queue_blocks: int = 8192
    remote_threads: int = 2
    remote_recheck_s: float = 10.0
    remote_prefetch: bool = False
    fault_load_delay_ms: int = 0
    fault_store_delay_ms: int = 0
    fault_corrupt_loads: int = 0

    @property
    def host_bytes(self) -> int:
        return int(self.host_gib * (1 << 30))

    @property
    def max_rank_bytes(self) -> int:
        if self.max_rank_gib:
            return int(self.max_rank_gib * (1 << 30))
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

    @property
    def disk_bytes(self) -> int:
        return int(self.disk_gib * (1 << 30)) if self.disk_dir else 0

    def warnings(self) -> list[str]:
        """Settings that start but serve less than they seem to (logged at start, printed by
        check-config). A tier is handed to layout classes in slabs that stay with their class."""
        out = []
        for tier, total, slab_mib, knobs in (
            ("host", self.host_bytes, self.slab_mib, "host_gib or lower slab_mib"),
            ("disk", self.disk_bytes, self.disk_slab_mib, "disk_gib or lower disk_slab_mib"),
        ):
            if 0 < total < 2 * (slab_mib << 20):
                out.append(
                    f"the {tier} tier ({total / (1 << 20):.0f} MiB) is less than two {slab_mib}-MiB slabs: the first layout class "
                    f"(model, dtype, block size, parallelism) to store takes all of it, and engines of any other store nothing there; raise {knobs}"
                )
        return out


HELP: dict[str, str] = {
    "listen": f"address to serve gRPC on: HOST:PORT or unix:PATH (repeatable; env: comma-separated). Default {DEFAULT_LISTEN}",
    "host_gib": "host-memory tier size in GiB (G2). Default 4",
    "host_prealloc": "back the whole host tier with memory before serving: the memory is taken up front and a "
    "/dev/shm too small for it stops the daemon at start (start-up then waits about 0.6 s per GiB). False (the "
    "default): memory is taken as blocks fill the tier, a little ahead of them, and serving starts at once",
    "slab_mib": "slab size in MiB; the host tier is handed to layout classes in slabs. Default 64",
    "copy_threads": "threads copying loads between engines and the host tier, and as many copying stores; more help "
    "where there are cores and memory bandwidth to spare. Default 2",
    "store_nice": "how much lower than the daemon's the priority of the threads copying stores is (a nice increment, "
    "0-19): a store is background work that gives the CPU to the engine and to loads; 0 runs stores like loads. "
    "Default 10",
    "metrics_listen": "HOST:PORT for Prometheus /metrics over HTTP; empty disables. Default 127.0.0.1:9464",
    "lease_ms": "engine lease: an engine that sends no heartbeat for this long is released. Default 30000",
    "pin_ms": "how long a Lookup keeps its matched blocks pinned by default. Default 30000",
    "op_timeout_ms": "deadline of every load and store op. Default 30000",
    "load_budget_ms": "the longest a Lookup's hit may take to copy into the engine, at the rate the daemon's loads "
    "copied lately and behind the loads already waiting: a Lookup offers only the blocks that fit (none when the "
    "waiting loads alone take longer), so on a starved host the engine computes instead of waiting for a late load "
    "(engines whose CPU memory the daemon copies; a rate older than 10 s caps nothing). 0: no limit. Default 1000",
    "max_tokens": "most tokens one request may carry. Default 2097152",
    "max_message_mib": "largest gRPC message accepted, in MiB. Default 64",
    "lane": "also answer the engine path (Lookup, Step) on a plain framed socket beside each listen address "
    "(unix:PATH.lane; TCP: same host, on lane_port), told to engines when they register; "
    "about a third of gRPC's round-trip time. Default true",
    "lane_port": "TCP port of the lane beside each HOST:PORT listen address (a fixed one to publish or let through "
    "a firewall); 0 lets the system pick. Default 0",
    "socket_mode": "permissions of the Unix socket files (the gRPC socket, its lane and its handoff socket), in octal: "
    "0660 lets the daemon's group connect, 0666 every local user (with tokens to tell them apart). Empty (the "
    "default): the daemon's umask decides",
    "tls_cert": "PEM certificate (chain) for TLS on the TCP listen addresses and their lanes, with --tls-key; Unix "
    "sockets stay plaintext. Empty (the default): plaintext",
    "tls_key": "PEM private key of --tls-cert",
    "tls_client_ca": "PEM CA certificates: TLS clients must present a certificate signed by one of them (mutual "
    "TLS; needs --tls-cert). Empty (the default): no client certificates asked for",
    "auth_file": "TOML file of tokens: every call must carry one (metadata 'authorization: Bearer TOKEN'); a "
    "namespace's token registers and drives engines of that namespace only, an admin token may do everything. "
    "Re-read on SIGHUP. Empty (the default): no tokens, any caller may do everything (docs/security.md)",
    "shm_paths": "accept CPU KV memory named by a /dev/shm path (the daemon opens any such file of its own user); "
    "false: only memory handed over on the handoff socket beside a unix: listen address, which a worker can do "
    "only for memory it holds (set it false when tenants share a daemon). Default true",
    "eviction_policy": "eviction policy: leaf-lru (leaves first, LRU among leaves). Default leaf-lru",
    "namespace_host_share": "most of the host tier one namespace (tenant) may hold, as a fraction: a namespace at its "
    "share evicts its own least recently used blocks to store more, so one tenant cannot flush the others' blocks "
    "out. 1 (the default): no limit",
    "namespace_disk_share": "the same for the disk tier: a namespace at its share of a layout class's disk pool "
    "evicts its own blocks there to write more, and blocks it cannot place stay in host memory only. 1 (the default): "
    "no limit",
    "max_slots_per_engine": "most requests one engine may have in flight at the daemon (new ones past it make the "
    "Step RESOURCE_EXHAUSTED, naming the cap). Default 8192",
    "max_slots_per_namespace": "most requests all engines of one namespace (tenant) may have in flight. Default 32768",
    "max_pins_per_engine": "most Lookup pins one engine may hold (a pin lasts until its request starts or finishes, "
    "or pin_ms). Default 8192",
    "max_pins_per_namespace": "most Lookup pins all engines of one namespace may hold. Default 32768",
    "max_pin_tokens_per_namespace": "most prompt tokens the Lookup pins of one namespace may keep (about 8 bytes of "
    "daemon memory a token). Default 67108864",
    "max_slot_tokens_per_namespace": "most tokens the request slots of one namespace may keep (about 11 bytes of daemon "
    "memory a token with its block hashes); a Step past it is refused whole. Default 67108864",
    "max_rank_gib": "most CPU memory one worker rank may register, in GiB, and the largest file or memfd behind it "
    "(only the registered range is ever mapped). 0 (the default): the machine's memory",
    "drain_grace_s": "on SIGTERM, seconds to let in-flight RPCs and ops finish. Default 10",
    "log_level": "debug, info, warning or error. Default info",
    "log_format": "text (one line per record) or json (one JSON object per line: time, level, logger, message, and "
    "exception when there is one), for log collectors. Default text",
    "disk_dir": "directory of the disk tier (G3); blocks there survive restarts. Empty (the default) means no disk tier",
    "disk_gib": "disk tier size in GiB (used only with --disk-dir). Default 16",
    "disk_slab_mib": "size of one preallocated disk slab file in MiB. Default 256",
    "disk_policy": "write-back (host blocks go to disk when the host tier is past 80%% full, and on a clean shutdown) or "
    "write-through (as soon as they are admitted). Default write-back",
    "disk_admit_after": "a block goes to disk only once requests carried it this many times within the window "
    "(1 admits every block). Default 2",
    "disk_admit_window_s": "the admission window in seconds. Default 600",
    "disk_direct_io": "true: disk I/O with O_DIRECT (no page cache); false: buffered I/O. Default true",
    "disk_threads": "threads writing to disk and checking what was read (one more thread issues the reads). Default 2",
    "remote": "the remote tier (G4), a Valkey or Redis store shared by the daemons of many nodes: "
    "valkey://HOST:PORT[,HOST:PORT...] (a cluster's seed nodes or one server; valkeys:// for TLS; "
    "valkey://USER@HOST:PORT for an ACL user). Empty (the default): no remote tier (docs/remote.md)",
    "remote_user": "ACL user for the remote store (or USER@ in the address)",
    "remote_password": "password for the remote store; prefer the environment (KVDEPOT_REMOTE_PASSWORD) to a flag, which "
    "other local users can read in the process list",
    "remote_ca": "PEM CA certificates to check the remote store's TLS certificate with (valkeys://). Empty: the system's",
    "remote_key_file": "file with the secret the deployment's daemons share (one per line, at least 32 characters: "
    "`openssl rand -hex 32`): every value in the remote store carries a MAC with a key derived from it and the namespace, "
    "so only daemons holding it can write blocks the others accept. The first line signs; later lines are accepted too "
    "(a rotation, docs/remote.md). Required with remote",
    "remote_prefix": "first part of every key the daemon writes to the remote store (an ACL key pattern can confine the "
    "daemon's user to PREFIX:*). Default kvdepot",
    "remote_ttl_s": "seconds a block lives in the remote store; 0 (the default): until the store evicts it (maxmemory "
    "with maxmemory-policy allkeys-lru)",
    "remote_timeout_ms": "the most one request to the remote store may take (a batch of up to 32 blocks); a block not "
    "read in time is recomputed by the engine. Default 1000",
    "remote_lookup_ms": "the most a Lookup waits for the remote store to say which blocks it holds; past it the blocks "
    "count as missing. Keep it under the engines' own lookup deadline (the vLLM connector's lookup_timeout_ms, 50). "
    "Default 20",
    "remote_queue_blocks": "admitted blocks waiting to be written to the remote store; more are dropped (and counted) "
    "rather than slowing anything. Default 8192",
    "remote_threads": "threads reading from and writing to the remote store. Default 2",
    "remote_prefetch": "true: the blocks a Lookup finds in the remote store are read into the host tier at once, before "
    "the engine's Step asks to load them (for engines whose requests wait between their Lookup and their first Step); "
    "false (the default): when the Step asks. A single vLLM request was no faster with it (docs/performance.md)",
    "remote_recheck_s": "a block the store was seen to hold longer ago than this is asked about again when it is next "
    "used, and written again if the store lost it (a flush, an eviction, a primary restarted empty). Default 10",
    "fault_load_delay_ms": "fault injection for tests: every load waits this long before copying. Default 0",
    "fault_store_delay_ms": "fault injection for tests: every store waits this long before copying. Default 0",
    "fault_corrupt_loads": "fault injection for tests: the next N blocks loaded have their host bytes flipped first "
    "(the checksum must catch them). Default 0",
}

LOG_LEVELS = ("debug", "info", "warning", "error")


def _positive(name: str, conv: Callable[[Any], Any], allow_zero: bool = False, most: int | None = None) -> Callable[[Any], Any]:
    def check(v: Any) -> Any:
        if isinstance(v, bool):
            raise ValueError("expected a number")
        x = conv(v)
        if most is not None and not 0 <= x <= most:
            raise ValueError(f"must be in 0..{most}")
        if x < 0 or (x == 0 and not allow_zero):
            raise ValueError(f"must be {'>= 0' if allow_zero else '> 0'}")
        return x

    return check


def _listen(v: Any) -> tuple[str, ...]:
    items = [s.strip() for s in v.split(",")] if isinstance(v, str) else list(v)
    if not items or not all(isinstance(s, str) and s for s in items):
        raise ValueError("expected one or more addresses")
    for s in items:
        check_address(s, companions=True)
    return tuple(items)


def _port(v: Any) -> int:
    if isinstance(v, bool):
        raise ValueError("expected a port number")
    x = int(v)
    if not 0 <= x <= 65535:
        raise ValueError("must be a port in [0, 65535]")
    return x


def _choice(*allowed: str) -> Callable[[Any], str]:
    def check(v: Any) -> str:
        if v not in allowed:
            raise ValueError(f"must be one of {', '.join(allowed)}")
        return str(v)

    return check


def _bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
        return v.lower() in ("true", "1", "yes", "on")
    raise ValueError("expected true or false")


def _fraction(v: Any) -> float:
    if isinstance(v, bool):
        raise ValueError("expected a number")
    x = float(v)
    if not 0 < x <= 1:
        raise ValueError("must be a fraction in (0, 1]")
    return x


def _mode(v: Any) -> str:
    if not isinstance(v, str) or (v and (not all(c in "01234567" for c in v) or int(v, 8) > 0o777)):
        raise ValueError("expected permissions in octal, such as 0660")
    return v


def _path(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError("expected a path")
    return v


def _plain(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError("expected a string")
    return v


def _remote_url(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError("expected valkey://HOST:PORT[,HOST:PORT...]")
    if v:
        parse_remote_url(v)  # raises ValueError saying what is wrong
    return v


REMOTE_SCHEMES = {"valkey": False, "redis": False, "valkeys": True, "rediss": True}  # scheme -> TLS


def parse_remote_url(url: str) -> tuple[bool, str, str, tuple[tuple[str, int], ...]]:
    """valkey://[user[:password]@]host:port[,host:port...] (redis:// too; valkeys:// or rediss://
    for TLS) -> (tls, user, password, addresses)."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in REMOTE_SCHEMES:
        raise ValueError("expected valkey://HOST:PORT[,HOST:PORT...] (or valkeys:// for TLS)")
    cred, at, hosts = rest.rpartition("@")
    user, _, password = cred.partition(":") if at else ("", "", "")
    addresses = []
    for part in hosts.rstrip("/").split(","):
        host, colon, port = part.strip().rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{part!r} is not HOST:PORT")
        addresses.append((host.strip("[]"), int(port)))
    return REMOTE_SCHEMES[scheme], urllib.parse.unquote(user), urllib.parse.unquote(password), tuple(addresses)


def _key_prefix(v: Any) -> str:
    if not isinstance(v, str) or not v or any(c.isspace() or c in "{}*?[]" for c in v):
        raise ValueError("expected a non-empty key prefix without spaces, braces or glob characters")
    return v


def _text(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError("expected a string")
    if v:
        check_address(v)
    return v


PARSERS: dict[str, Callable[[Any], Any]] = {
    "listen": _listen,
    "host_gib": _positive("host_gib", float, allow_zero=True),
    "slab_mib": _positive("slab_mib", int),
    "copy_threads": _positive("copy_threads", int),
    "store_nice": _positive("store_nice", int, allow_zero=True, most=19),
    "metrics_listen": _text,
    "lease_ms": _positive("lease_ms", int),
    "pin_ms": _positive("pin_ms", int),
    "op_timeout_ms": _positive("op_timeout_ms", int),
    "load_budget_ms": _positive("load_budget_ms", int, allow_zero=True),
    "max_tokens": _positive("max_tokens", int),
    "max_message_mib": _positive("max_message_mib", int),
    "lane": _bool,
    "lane_port": _port,
    "socket_mode": _mode,
    "tls_cert": _path,
    "tls_key": _path,
    "tls_client_ca": _path,
    "auth_file": _path,
    "shm_paths": _bool,
    "host_prealloc": _bool,
    "eviction_policy": _choice("leaf-lru"),
    "namespace_host_share": _fraction,
    "namespace_disk_share": _fraction,
    "max_slots_per_engine": _positive("max_slots_per_engine", int),
    "max_slots_per_namespace": _positive("max_slots_per_namespace", int),
    "max_pins_per_engine": _positive("max_pins_per_engine", int),
    "max_pins_per_namespace": _positive("max_pins_per_namespace", int),
    "max_pin_tokens_per_namespace": _positive("max_pin_tokens_per_namespace", int),
    "max_slot_tokens_per_namespace": _positive("max_slot_tokens_per_namespace", int),
    "max_rank_gib": _positive("max_rank_gib", float, allow_zero=True),
    "drain_grace_s": _positive("drain_grace_s", float, allow_zero=True),
    "log_level": _choice(*LOG_LEVELS),
    "log_format": _choice("text", "json"),
    "disk_dir": _path,
    "disk_gib": _positive("disk_gib", float),
    "disk_slab_mib": _positive("disk_slab_mib", int),
    "disk_policy": _choice("write-back", "write-through"),
    "disk_admit_after": _positive("disk_admit_after", int),
    "disk_admit_window_s": _positive("disk_admit_window_s", float),
    "disk_direct_io": _bool,
    "disk_threads": _positive("disk_threads", int),
    "remote": _remote_url,
    "remote_user": _plain,
    "remote_password": _plain,
    "remote_ca": _path,
    "remote_key_file": _path,
    "remote_prefix": _key_prefix,
    "remote_ttl_s": _positive("remote_ttl_s", int, allow_zero=True),
    "remote_timeout_ms": _positive("remote_timeout_ms", int),
    "remote_lookup_ms": _positive("remote_lookup_ms", int),
    "remote_queue_blocks": _positive("remote_queue_blocks", int),
    "remote_threads": _positive("remote_threads", int),
    "remote_recheck_s": _positive("remote_recheck_s", float),
    "remote_prefetch": _bool,
    "fault_load_delay_ms": _positive("fault_load_delay_ms", int, allow_zero=True),
    "fault_store_delay_ms": _positive("fault_store_delay_ms", int, allow_zero=True),
    "fault_corrupt_loads": _positive("fault_corrupt_loads", int, allow_zero=True),
}


def check_address(addr: str, companions: bool = False) -> None:
    """HOST:PORT (IPv6 as [::1]:PORT) or unix:PATH / unix:///abs/path (short enough for the system,
    with the lane and handoff sockets beside it when `companions`)."""
    if addr.startswith("unix:"):
        if len(addr) == len("unix:"):
            raise ValueError(f"{addr!r}: unix: needs a path")
        check_unix_path(unix_path(addr), companions)
        return
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{addr!r} is not HOST:PORT or unix:PATH")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="TOML file with any of the options below (env: KVDEPOT_CONFIG)")
    for f in fields(DaemonConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "listen":
            parser.add_argument(flag, action="append", metavar="ADDR", help=HELP[f.name])
        else:
            parser.add_argument(flag, metavar=f.name.split("_")[-1].upper(), help=HELP[f.name])


def load(args: argparse.Namespace, env: Mapping[str, str] = os.environ) -> DaemonConfig:
    values: dict[str, Any] = {}
    path = args.config or env.get(ENV_PREFIX + "CONFIG")
    if path:
        values.update(_parse_source(_read_toml(path), f"config file {path}"))
    try:
        env_values = options_in(env, PARSERS)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    values.update(_parse_source(env_values, "environment", prefix=ENV_PREFIX))
    flag_values = {f.name: getattr(args, f.name) for f in fields(DaemonConfig) if getattr(args, f.name, None) is not None}
    values.update(_parse_source(flag_values, "command line", prefix="--"))
    cfg = DaemonConfig(**values)
    if bool(cfg.tls_cert) != bool(cfg.tls_key):
        raise ConfigError("tls_cert and tls_key go together: TLS needs the certificate and its private key")
    if cfg.tls_client_ca and not cfg.tls_cert:
        raise ConfigError("tls_client_ca asks TLS clients for certificates: it needs tls_cert and tls_key")
    if cfg.remote and not cfg.remote_key_file:
        raise ConfigError(
            "remote needs remote_key_file: a secret the deployment's daemons share, so that no other writer of the store can plant "
            "blocks (make one with `openssl rand -hex 32 > FILE`, give every daemon the same file; docs/remote.md)"
        )
    return cfg


def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    return {k.replace("-", "_"): v for k, v in data.items()}


def _parse_source(raw: Mapping[str, Any], where: str, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in PARSERS:
            known = ", ".join(sorted(PARSERS))
            raise ConfigError(f"unknown option {prefix}{key} in {where}; known options: {known}")
        try:
            out[name] = PARSERS[name](value)
        except (ValueError, TypeError) as e:
            shown = (prefix + name.upper()) if prefix == ENV_PREFIX else (prefix + name.replace("_", "-") if prefix else name)
            raise ConfigError(f"bad value {value!r} for {shown} in {where}: {e}") from None
    return out
