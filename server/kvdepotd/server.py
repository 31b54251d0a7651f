"""Assembles and runs the daemon: gRPC server, health, reflection, metrics, signals, drain.

Lifecycle (STYLE.md 10): run() serves until SIGTERM/SIGINT, then shutdown() drains in order:
health NOT_SERVING -> stop accepting -> let in-flight RPCs finish within the grace -> end ops ->
close worker streams. shutdown() is idempotent.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
import ssl
import stat
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from kvdepot.tls import read_pem
from kvdepot.v1 import kvdepot_pb2 as pb
from kvdepotd import core
from kvdepotd.auth import AuthError, Tokens
from kvdepotd.config import DaemonConfig
from kvdepotd.core.depot import Depot, DepotConfig
from kvdepotd.core.disk import DiskConfig, disk_record_bytes
from kvdepotd.core.remote import RemoteConfig
from kvdepotd.core.records import Caps
from kvdepotd.handoff import Handoffs
from kvdepotd.lane import Lanes, unix_path
from kvdepotd.metrics import Metrics, serve_metrics
from kvdepotd.runtime import Runtime
from kvdepotd.service import DepotService
from kvdepotd.storage.disk import DiskError
from kvdepotd.storage.disk_dir import DiskStore
from kvdepotd.storage.remote import RemoteSettings, RemoteStore, ValueKeys
from kvdepotd.storage.host_arena import ArenaError, HostArena
from kvdepotd.transfer import blockcopy
from kvdepotd.transfer.host import Faults
from kvdepotd.wire import safe_parser

log = logging.getLogger("kvdepotd")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["BlockManager"].full_name
# CPython's cyclic collector, as the daemon runs it. The engine path allocates and frees thousands
# of objects per Step, almost none in cycles: at the default young-generation threshold (700) a
# collection ran every few Steps and set the Step's p99, and a full collection walks everything
# torch and grpc built at import, a stall of every engine (docs/performance.md). So start-up's
# objects are frozen out of collection (reference counting still frees them) and the young
# generation is collected every 20,000 net allocations.
GC_THRESHOLDS = (20_000, 20, 20)


def block_manager_handlers(service: DepotService) -> grpc.GenericRpcHandler:
    """The service's handlers, like the generated add_..._to_server, except that a request that is
    not valid protobuf reaches the method as a BadMessage (answered INVALID_ARGUMENT with a clear
    message) instead of failing inside gRPC with UNKNOWN and a traceback in the log."""
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["BlockManager"].methods:
        parse = safe_parser(getattr(pb, method.input_type.name), method.name)
        serialize = getattr(pb, method.output_type.name).SerializeToString
        impl = getattr(service, method.name)
        if method.name in ("Lookup", "Step"):
            impl = _counted(impl, service.metrics, method.name)
        if method.client_streaming:
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(impl, parse, serialize)
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(impl, parse, serialize)
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)


class StartupError(RuntimeError):
    """The daemon cannot start as configured; the message says why."""


def _counted(impl: Callable[..., Awaitable[Any]], metrics: Metrics, method: str) -> Callable[..., Awaitable[Any]]:
    """A unary engine-path call, counted by transport (the lane and the Session stream count theirs)."""

    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        metrics.engine_call(method, "unary")
        return await impl(request, context)

    return handler


def depot_config(cfg: DaemonConfig) -> DepotConfig:
    return DepotConfig(
        host_bytes=cfg.host_bytes,
        slab_bytes=cfg.slab_mib << 20,
        lease_ms=cfg.lease_ms,
        pin_ms=cfg.pin_ms,
        op_timeout_ms=cfg.op_timeout_ms,
        max_tokens=cfg.max_tokens,
        eviction_policy=cfg.eviction_policy,
        namespace_host_share=cfg.namespace_host_share,
        namespace_disk_share=cfg.namespace_disk_share,
        caps=Caps(
            cfg.max_slots_per_engine, cfg.max_slots_per_namespace, cfg.max_pins_per_engine, cfg.max_pins_per_namespace, cfg.max_pin_tokens_per_namespace,
            cfg.max_slot_tokens_per_namespace,
        ),
        disk_bytes=cfg.disk_bytes,
        disk_slab_bytes=cfg.disk_slab_mib << 20,
        disk=DiskConfig(policy=cfg.disk_policy, admit_after=cfg.disk_admit_after, admit_window_ms=int(cfg.disk_admit_window_s * 1000)),
        remote=RemoteConfig(
            enabled=bool(cfg.remote), queue_blocks=cfg.remote_queue_blocks, jobs_in_flight=2 * cfg.remote_threads,  # one waiting per thread
            recheck_ms=int(cfg.remote_recheck_s * 1000), prefetch=cfg.remote_prefetch,
        ),
        first_op_id=time.time_ns() // 1000,  # microseconds: above every id an earlier daemon handed out
    )


def _prepare_unix(addr: str) -> None:
    """Creates the socket's folder and removes a stale socket file nobody listens on."""
    path = unix_path(addr)
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise StartupError(f"{path} exists and is not a socket")
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(path)
        except OSError:
            os.unlink(path)
            return
    raise StartupError(f"another process is serving on {addr}")


class Recovery:
    """What start-up found in the disk tier."""

    def __init__(self, blocks: int = 0, dropped: int = 0, seconds: float = 0.0) -> None:
        self.blocks, self.dropped, self.seconds = blocks, dropped, seconds


def recover_disk(depot: Depot, store: DiskStore) -> Recovery:
    """Reads back every layout class the disk tier holds and hands the valid blocks to the core."""
    t0 = time.monotonic()
    rec = Recovery()
    reasons: dict[str, int] = {}
    for meta in store.existing():
        cls, block_bytes, world_size = meta["layout_class"], meta["block_bytes"], meta["world_size"]  # checked by read_meta
        budget = depot.disk_budget
        per_slab, slab_bytes = budget.slab_size_for(disk_record_bytes(block_bytes))
        got = store.recover(cls, block_bytes, world_size, per_slab, budget.free_bytes // slab_bytes)
        if not depot.restore_disk(cls, block_bytes, world_size, got.blocks):  # cannot happen after recover()'s checks
            got.dropped["could not be restored"] = len(got.blocks)
            for h, _, slot, _ in got.blocks:
                store.classes[cls].forget(slot, h)
            store.classes[cls].flush_removes()
            got.blocks = []
        rec.blocks += len(got.blocks)
        if got.bad_records:
            log.warning("disk tier: %s: %d journal records failed their checksum and were skipped; %d blocks found again by their headers", cls, got.bad_records, got.relisted)
        for reason, n in got.dropped.items():
            reasons[reason] = reasons.get(reason, 0) + n
    rec.dropped = sum(reasons.values())
    rec.seconds = time.monotonic() - t0
    log.info(
        "disk tier: recovered %d blocks in %.2f s%s", rec.blocks, rec.seconds,
        "; dropped " + ", ".join(f"{n} ({why})" for why, n in sorted(reasons.items())) if reasons else "",
    )
    return rec


class Daemon:
    def __init__(self, cfg: DaemonConfig) -> None:
        self.cfg = cfg
        tokens = self._load_tokens()
        self.depot = Depot(depot_config(cfg))
        try:
            self.arena = HostArena(cfg.host_bytes)
        except ArenaError as e:
            raise StartupError(str(e)) from None
        self.metrics = Metrics(self.depot, lambda: self.runtime.copy.mapped_bytes)
        faults = Faults(cfg.fault_load_delay_ms, cfg.fault_corrupt_loads, cfg.fault_store_delay_ms)
        if faults.load_delay_ms or faults.corrupt_loads or faults.store_delay_ms:
            log.warning(
                "fault injection on: loads wait %d ms, stores %d ms; the next %d loaded blocks are corrupted",
                faults.load_delay_ms, faults.store_delay_ms, faults.corrupt_loads,
            )
        self.runtime = Runtime(self.depot, self.metrics, self.arena, copy_threads=cfg.copy_threads, store_nice=cfg.store_nice, faults=faults)
        self.runtime.load_budget_ms = cfg.load_budget_ms
        self.service = DepotService(self.runtime)
        self.service.auth = tokens
        self.recovery = Recovery()
        self.metrics.recovery = self.recovery
        self.health = HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.lanes = Lanes(self.service.answer, cfg.max_message_mib << 20, lambda: self.service.auth is not None)
        self.handoffs = Handoffs(lambda: self.service.auth, self.runtime.arena_fd)
        self.metrics.handoff_pending.set_function(self.handoffs.pending)
        self.metrics.host_backed.set_function(lambda: self.runtime.arenas.ready_bytes)
        self.service.shm_paths = cfg.shm_paths
        self.service.max_rank_bytes = cfg.max_rank_bytes
        self.metrics.lane_connections.set_function(self.lanes.open_connections)
        self.addresses: list[str] = []
        self.metrics_address = ""
        self._metrics_http: object | None = None
        self._stopped = asyncio.Event()
        self._shutdown_started = False

    async def start(self) -> None:
        cfg = self.cfg
        mib = cfg.max_message_mib << 20
        server = grpc.aio.server(
            options=[("grpc.max_receive_message_length", mib), ("grpc.max_send_message_length", mib), ("grpc.so_reuseport", 0)]
        )
        server.add_generic_rpc_handlers((block_manager_handlers(self.service),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection((SERVICE_NAME, "grpc.health.v1.Health", reflection.SERVICE_NAME), server)
        creds, lane_tls = self._tls_credentials()
        for addr in self.cfg.listen:
            if addr.startswith("unix:"):
                _prepare_unix(addr)
            try:
                port = server.add_insecure_port(addr) if creds is None or addr.startswith("unix:") else server.add_secure_port(addr, creds)
            except RuntimeError as e:
                raise StartupError(f"cannot listen on {addr}: {e}") from None
            if not addr.startswith("unix:") and addr.endswith(":0"):
                addr = f"{addr[:-2]}:{port}"
            self.addresses.append(addr)
        if self.cfg.metrics_listen:
            host, _, port_s = self.cfg.metrics_listen.rpartition(":")
            try:
                srv, _thread = serve_metrics(host.strip("[]"), int(port_s), self.metrics.registry, self._may_scrape)
            except OSError as e:
                raise StartupError(f"cannot serve metrics on {self.cfg.metrics_listen}: {e.strerror or e}") from None
            self._metrics_http = srv
            self.metrics_address = f"http://{host}:{srv.server_port}/metrics"
        self.server = server  # bound (a busy address failed above, before anything slow)
        if self.cfg.host_prealloc:
            t0 = time.monotonic()
            try:
                await asyncio.to_thread(self.arena.prepare_all)
            except ArenaError as e:
                raise StartupError(str(e)) from None
            log.info("host tier: %.2f GiB backed with memory in %.2f s (--host-prealloc)", self.cfg.host_gib, time.monotonic() - t0)
        if self.cfg.disk_dir:
            self._open_disk()
        if cfg.remote:
            settings = RemoteSettings.parse(
                cfg.remote, user=cfg.remote_user, password=cfg.remote_password, ca_file=cfg.remote_ca, prefix=cfg.remote_prefix,
                ttl_s=cfg.remote_ttl_s, timeout_ms=cfg.remote_timeout_ms, keys=self._remote_keys(),
            )
            await self.runtime.attach_remote(RemoteStore(settings), cfg.remote_threads, cfg.remote_lookup_ms)
        # grpc's health servicer answers SERVING for "" from the start: not before the lanes, the
        # handoff sockets and their permissions are ready (set below, last).
        await self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.start()
        if self.cfg.lane:
            for addr in self.addresses:
                unix = addr.startswith("unix:")
                if unix:
                    _prepare_unix(addr + ".lane")
                try:
                    await self.lanes.listen(addr, self.cfg.lane_port, tls=None if unix else lane_tls)
                except OSError as e:
                    raise StartupError(f"cannot open the lane beside {addr}: {e.strerror or e}") from None
            self.service.lanes = self.lanes.addresses
        for addr in self.addresses:
            if addr.startswith("unix:"):
                _prepare_unix(addr + ".handoff")
                try:
                    self.handoffs.listen(addr)
                except OSError as e:
                    raise StartupError(f"cannot open the handoff socket beside {addr}: {e.strerror or e}") from None
        if self.handoffs.addresses:
            self.service.handoffs = self.handoffs
        elif not self.cfg.shm_paths:
            log.warning("shm_paths is false and no unix: address has a handoff socket: engines on CPU cannot register their KV memory")
        if self.cfg.socket_mode:
            for addr in self.addresses + self.lanes.addresses + self.handoffs.addresses:
                if addr.startswith("unix:"):
                    os.chmod(unix_path(addr), int(self.cfg.socket_mode, 8))
        self.runtime.start()
        gc.collect()
        gc.freeze()
        gc.set_threshold(*GC_THRESHOLDS)
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        tls = "" if creds is None else (" with TLS on TCP" + (", client certificates required" if self.cfg.tls_client_ca else ""))
        lanes = f" (lanes {', '.join(self.lanes.addresses)})" if self.lanes.addresses else ""
        if self.handoffs.addresses:
            lanes += f" (KV memory handoff {', '.join(self.handoffs.addresses)})"
        log.info("kvdepotd serving on %s%s%s", ", ".join(self.addresses), tls, lanes)
        native = core.compiled() and blockcopy.available
        log.info(
            "core %s, %s block copy%s", "compiled (mypyc)" if core.compiled() else "plain Python", "native" if blockcopy.available else "torch",
            "" if native else " (a `pip install .` with a C compiler builds both)",
        )
        self._log_tokens(self.service.auth)
        if self.service.auth is not None and creds is None and any(not a.startswith("unix:") for a in self.addresses):
            log.warning("tokens travel in plaintext on the TCP addresses: anyone on the network path can read them (use --tls-cert)")
        if self.service.auth is not None and self.cfg.shm_paths:
            log.warning(
                "tokens keep tenants' blocks apart, but with shm_paths on, a CPU engine may name any /dev/shm KV file of the "
                "daemon's user, another tenant's too: set shm_paths = false (engines at a unix: address hand their memory over)"
            )
        log.info(
            "host tier %.2f GiB (%d-MiB slabs, %d + %d copy threads for loads + stores, stores at nice +%d), lease %d ms, op deadline %d ms, metrics %s",
            self.cfg.host_gib, self.cfg.slab_mib, self.cfg.copy_threads, self.cfg.copy_threads, self.cfg.store_nice, self.cfg.lease_ms, self.cfg.op_timeout_ms, self.metrics_address or "off",
        )
        for warning in self.cfg.warnings():
            log.warning("%s", warning)
        if self.cfg.disk_dir:
            log.info(
                "disk tier %.2f GiB in %s (%s, admit after %d sightings, %s I/O, %d threads)",
                self.cfg.disk_gib, self.cfg.disk_dir, self.cfg.disk_policy, self.cfg.disk_admit_after,
                "O_DIRECT" if self.cfg.disk_direct_io else "buffered", self.cfg.disk_threads,
            )
        if self.runtime.remote is not None:
            c = self.cfg
            log.info(
                "remote tier %s (keys %s:*, %s, admit after %d sightings, %d threads, request timeout %d ms, lookup budget %d ms, queue %d blocks)",
                self.runtime.remote.store.settings.describe(), c.remote_prefix, f"TTL {c.remote_ttl_s} s" if c.remote_ttl_s else "no TTL",
                c.disk_admit_after, c.remote_threads, c.remote_timeout_ms, c.remote_lookup_ms, c.remote_queue_blocks,
            )

    def _remote_keys(self) -> ValueKeys:
        try:
            keys = ValueKeys.load(self.cfg.remote_key_file)
        except ValueError as e:
            raise StartupError(str(e)) from None
        log.info("remote tier: values signed with key %s%s", keys.ids[0], f"; also accepted: {', '.join(keys.ids[1:])}" if keys.ids[1:] else "")
        return keys

    def _open_disk(self) -> None:
        cfg = self.cfg
        try:
            store = DiskStore(cfg.disk_dir, cfg.disk_bytes, direct=cfg.disk_direct_io)
            self.recovery = self.metrics.recovery = recover_disk(self.depot, store)
        except (DiskError, OSError) as e:
            raise StartupError(f"disk tier: {e}") from None
        self.runtime.attach_disk(store, cfg.disk_threads)

    def _load_tokens(self) -> Tokens | None:
        path = self.cfg.auth_file
        if not path:
            return None
        try:
            tokens = Tokens.load(path)
        except AuthError as e:
            raise StartupError(str(e)) from None
        with contextlib.suppress(OSError):
            if os.stat(path).st_mode & 0o077:
                log.warning("the tokens file %s can be read by other users (chmod 600 it)", path)
        return tokens

    @staticmethod
    def _log_tokens(tokens: Tokens | None) -> None:
        if tokens is not None:
            log.info("tokens required: %d from %s %s", len(tokens), tokens.source, tokens.summary())

    def _may_scrape(self, token: str | None) -> bool:
        """/metrics names tenants (kvdepot_namespace_*): with an auth file only a metrics or an admin token reads it."""
        auth = self.service.auth
        return auth is None or auth.may_scrape(token)

    def reload_tokens(self) -> None:
        """SIGHUP: the tokens file again; a file that is now wrong keeps the tokens in force."""
        if not self.cfg.auth_file:
            log.info("SIGHUP: no tokens file to re-read (--auth-file is not set)")
            return
        try:
            self.service.auth = Tokens.load(self.cfg.auth_file)
        except AuthError as e:
            log.error("SIGHUP: %s; the tokens in force stay", e)
            return
        self._log_tokens(self.service.auth)
        self.service.tokens_changed()

    def _tls_credentials(self) -> tuple[grpc.ServerCredentials | None, ssl.SSLContext | None]:
        """gRPC's credentials and the TCP lane's SSL context (the same certificate, key and client
        CA), or None twice for plaintext."""
        cfg = self.cfg
        if not cfg.tls_cert:
            return None, None
        try:
            files = (("certificate", cfg.tls_cert), ("key", cfg.tls_key), ("client CA", cfg.tls_client_ca))
            cert, key, ca = (read_pem(path, what) for what, path in files)
        except ValueError as e:
            raise StartupError(str(e)) from None
        assert cert is not None and key is not None
        # gRPC takes any bytes and would fail each handshake later: check the PEM files now.
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            ctx.load_cert_chain(cfg.tls_cert, cfg.tls_key)
        except ssl.SSLError as e:
            raise StartupError(f"TLS: {cfg.tls_cert} and {cfg.tls_key} are not a PEM certificate and its private key ({e})") from None
        try:
            if ca is not None:
                ctx.load_verify_locations(cadata=ca.decode(errors="replace"))
                ctx.verify_mode = ssl.CERT_REQUIRED
        except ssl.SSLError as e:
            raise StartupError(f"TLS: {cfg.tls_client_ca} holds no PEM CA certificate ({e})") from None
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None), ctx

    async def run(self) -> None:
        try:
            await self.start()
        except StartupError:  # e.g. a lane port that is taken: what did start is stopped first
            self.lanes.close()
            self.handoffs.close()
            if self.server is not None:
                await self.server.stop(None)
            if self._metrics_http is not None:
                self._metrics_http.shutdown()  # type: ignore[attr-defined]
            self.arena.close()
            raise
        loop = asyncio.get_running_loop()
        def on_signal(sig: signal.Signals) -> None:
            loop.create_task(self.shutdown(sig.name))

        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, on_signal, sig)
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signal.SIGHUP, self.reload_tokens)
        await self._stopped.wait()

    async def shutdown(self, why: str = "shutdown") -> None:
        if self._shutdown_started:
            return
        self._shutdown_started = True
        log.info("%s: draining (health NOT_SERVING, grace %.1f s)", why, self.cfg.drain_grace_s)
        await self.health.enter_graceful_shutdown()
        self.lanes.close()
        self.handoffs.close()
        if self.server is not None:
            await self.service.close(self.cfg.drain_grace_s)
            await self.server.stop(self.cfg.drain_grace_s)
        if self._metrics_http is not None:
            self._metrics_http.shutdown()  # type: ignore[attr-defined]
        self.runtime.arenas.close()
        for addr in self.addresses + self.lanes.addresses + self.handoffs.addresses:
            if addr.startswith("unix:"):
                with contextlib.suppress(OSError):
                    os.unlink(unix_path(addr))
        log.info("stopped")
        self._stopped.set()
