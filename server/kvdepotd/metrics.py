"""Prometheus metrics. Depot counters and pool gauges are read at scrape time (nothing on the hot
path); RPC latency and errors are observed per call. Names: kvdepot_<what>[_<unit>][_total].
serve_metrics serves them, behind a token where the daemon has an auth file (the per-namespace
figures name tenants)."""

from __future__ import annotations

import socket
import time
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from kvdepotd.core.depot import Depot
    from kvdepotd.transfer.base import Copied

DISK_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
RPC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0)
COPY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class DepotCollector(Collector):
    def __init__(self, depot: Depot, mapped_bytes: Callable[[], int], recovery: Callable[[], Any]) -> None:
        self.depot = depot
        self.mapped_bytes = mapped_bytes
        self.recovery = recovery

    def collect(self) -> Iterator[Metric]:
        st = self.depot.stats()
        for name, value in sorted(st.counters.items()):
            c = CounterMetricFamily(f"kvdepot_{name}", f"kvdepot core counter {name}")
            c.add_metric([], value)
            yield c
        yield GaugeMetricFamily("kvdepot_engines", "registered engines", value=st.engines)
        yield GaugeMetricFamily("kvdepot_slots", "request slots", value=st.slots)
        yield GaugeMetricFamily("kvdepot_ops_in_flight", "load and store ops not yet ended", value=st.ops_in_flight)
        now_ms = int(time.time() * 1000)
        yield GaugeMetricFamily(
            "kvdepot_oldest_op_age_seconds", "age of the oldest load or store op in flight (0: none)", value=st.oldest_op_age_ms(now_ms) / 1000
        )
        lease = GaugeMetricFamily(
            "kvdepot_engine_lease_remaining_seconds", "time until a registered engine's lease expires unless it calls or beats",
            labels=["engine_id", "engine_name", "namespace"],
        )
        for e in list(self.depot.engines.values()):
            lease.add_metric([e.engine_id, e.name, e.namespace], max(0.0, (e.lease_expires_ms - now_ms) / 1000))
        yield lease
        for name, help_, values in (
            ("kvdepot_namespace_engines", "registered engines per namespace (tenant)", st.namespace_engines),
            ("kvdepot_namespace_slots", "request slots per namespace (tenant)", st.namespace_slots),
            ("kvdepot_namespace_host_blocks", "host-tier blocks per namespace (tenant), all layout classes", st.namespace_host_blocks),
        ):
            g = GaugeMetricFamily(name, help_, labels=["namespace"])
            for ns, n in sorted(values.items()):
                g.add_metric([ns], n)
            yield g
        labels = ["layout_class", "tier"]
        gauges = {
            "capacity_blocks": GaugeMetricFamily("kvdepot_pool_capacity_blocks", "blocks the pool holds or can still claim", labels=labels),
            "used_blocks": GaugeMetricFamily("kvdepot_pool_used_blocks", "blocks resident or being stored", labels=labels),
            "pinned_blocks": GaugeMetricFamily("kvdepot_pool_pinned_blocks", "blocks pinned by lookups or loads", labels=labels),
            "in_flight_blocks": GaugeMetricFamily("kvdepot_pool_in_flight_blocks", "blocks being stored", labels=labels),
        }
        for p in st.pools:
            for field, g in gauges.items():
                g.add_metric([p.layout_class, p.tier], getattr(p, field))
        yield from gauges.values()
        yield GaugeMetricFamily("kvdepot_host_tier_bytes", "configured host tier size", value=st.host_bytes)
        yield GaugeMetricFamily("kvdepot_disk_tier_bytes", "configured disk tier size (0: none)", value=st.disk_bytes)
        yield GaugeMetricFamily("kvdepot_disk_tier_used_bytes", "disk tier bytes claimed by slab files", value=st.disk_used_bytes)
        rec = self.recovery()
        yield GaugeMetricFamily("kvdepot_disk_recovered_blocks", "blocks found valid in the disk tier at start-up", value=rec.blocks)
        yield GaugeMetricFamily(
            "kvdepot_disk_recovery_dropped_blocks", "blocks listed in the disk tier at start-up but dropped as doubtful", value=rec.dropped
        )
        yield GaugeMetricFamily("kvdepot_disk_recovery_seconds", "time the disk tier's start-up recovery took", value=rec.seconds)
        yield GaugeMetricFamily("kvdepot_mapped_engine_bytes", "engine KV memory the daemon has mapped", value=self.mapped_bytes())
        yield GaugeMetricFamily("kvdepot_remote_queue_blocks", "admitted blocks waiting to be written to the remote store", value=st.remote_queue_blocks)
        yield GaugeMetricFamily("kvdepot_remote_jobs", "remote store reads and writes running", value=st.remote_jobs)


class Metrics:
    def __init__(self, depot: Depot | None = None, mapped_bytes: Callable[[], int] = lambda: 0) -> None:
        self.registry = CollectorRegistry()
        self.rpc_seconds = Histogram(
            "kvdepot_rpc_duration_seconds", "time spent serving one RPC", ["method"], registry=self.registry, buckets=RPC_BUCKETS
        )
        self.rpc_errors = Counter("kvdepot_rpc_errors", "RPCs answered with an error status", ["method", "code"], registry=self.registry)
        self.disk_io_bytes = Counter("kvdepot_disk_io_bytes", "block bytes moved by the disk tier", ["op"], registry=self.registry)
        self.disk_io_seconds = Histogram(
            "kvdepot_disk_io_duration_seconds", "time one disk job took (many blocks)", ["op"], registry=self.registry, buckets=DISK_BUCKETS
        )
        self.remote_io_bytes = Counter("kvdepot_remote_io_bytes", "block bytes moved to and from the remote store", ["op"], registry=self.registry)
        self.remote_io_seconds = Histogram(
            "kvdepot_remote_io_duration_seconds", "time one remote store job took (up to 32 blocks)", ["op"], registry=self.registry,
            buckets=DISK_BUCKETS,
        )
        self.remote_lookup_seconds = Histogram(
            "kvdepot_remote_lookup_duration_seconds", "time a Lookup spent asking the remote store which blocks it holds",
            registry=self.registry, buckets=RPC_BUCKETS,
        )
        self.remote_failures = Counter(
            "kvdepot_remote_failures", "remote store keys that failed, by kind: timeout, error, missing (evicted or never written), "
            "corrupt, lookup_timeout (a Lookup's budget ran out)", ["kind"], registry=self.registry,
        )
        self._remote_up: Gauge | None = None  # exported once a remote tier is configured: 0 means down, never "none"
        self.copy_bytes = Counter(
            "kvdepot_host_copy_bytes", "block bytes copied between engine memory and the host tier (all ranks)", ["op"], registry=self.registry
        )
        self.copy_seconds = Histogram(
            "kvdepot_host_copy_duration_seconds", "one op's copy on one rank, from its first blocks to its last",
            ["op"], registry=self.registry, buckets=COPY_BUCKETS,
        )
        self.copy_queued_seconds = Histogram(
            "kvdepot_host_copy_queued_seconds", "time one op's part waited for a copy thread", ["op"], registry=self.registry,
            buckets=COPY_BUCKETS,
        )
        self.op_seconds = Histogram(
            "kvdepot_op_duration_seconds", "from the Step that planned an op to its end, to the millisecond (a store's includes "
            "the wait for its forward)", ["kind", "result"], registry=self.registry, buckets=COPY_BUCKETS,
        )
        self.engine_calls = Counter(
            "kvdepot_engine_calls", "Lookup and Step calls by how they came: lane, session (gRPC stream) or unary gRPC",
            ["method", "transport"], registry=self.registry,
        )
        self._calls = {(m, t): self.engine_calls.labels(m, t) for m in ("Lookup", "Step") for t in ("lane", "session", "unary")}
        self.lane_connections = Gauge("kvdepot_lane_connections", "open connections on the lanes", registry=self.registry)
        self.host_backed = Gauge(
            "kvdepot_host_tier_backed_bytes", "host tier bytes backed by memory so far (taken as blocks fill the tier)", registry=self.registry
        )
        self.handoff_pending = Gauge(
            "kvdepot_handoff_pending_descriptors", "KV memory descriptors handed over and not registered yet", registry=self.registry
        )
        self._copy = {k: (self.copy_bytes.labels(k), self.copy_seconds.labels(k), self.copy_queued_seconds.labels(k)) for k in ("load", "store")}
        self._ops = {(k, ok): self.op_seconds.labels(k, "ok" if ok else "failed") for k in ("load", "store") for ok in (True, False)}
        # Every known label value is exported from the start (at 0), so dashboards and alerts see
        # a series before the first event rather than no data.
        for op in ("read", "write"):
            for family in (self.disk_io_bytes, self.disk_io_seconds, self.remote_io_bytes, self.remote_io_seconds):
                family.labels(op)
        for kind in ("timeout", "error", "missing", "corrupt", "lookup_timeout"):
            self.remote_failures.labels(kind)
        self.recovery: Any = _NoRecovery()
        if depot is not None:
            self.registry.register(DepotCollector(depot, mapped_bytes, lambda: self.recovery))

    def set_remote_up(self, up: bool) -> None:
        if self._remote_up is None:
            self._remote_up = Gauge("kvdepot_remote_up", "1 while the remote store answers its health check, 0 while it does not "
                                    "(absent without a remote tier)", registry=self.registry)
        self._remote_up.set(1 if up else 0)

    def engine_call(self, method: str, transport: str) -> None:
        self._calls[(method, transport)].inc()

    def observe_disk(self, op: str, nbytes: int, seconds: float) -> None:
        """A disk job ended (called on a disk thread; prometheus_client is thread-safe)."""
        self.disk_io_bytes.labels(op).inc(nbytes)
        self.disk_io_seconds.labels(op).observe(seconds)

    def observe_remote(self, op: str, nbytes: int, seconds: float) -> None:
        """A remote store job ended (on a remote thread)."""
        self.remote_io_bytes.labels(op).inc(nbytes)
        self.remote_io_seconds.labels(op).observe(seconds)

    def note_remote(self, kind: str, n: int) -> None:
        if n:
            self.remote_failures.labels(kind).inc(n)

    def observe_remote_lookup(self, seconds: float) -> None:
        self.remote_lookup_seconds.observe(seconds)

    def observe_copy(self, c: Copied) -> None:
        """A host copy part ended (on the event loop, once per op and rank)."""
        nbytes, seconds, queued = self._copy[c.kind]
        nbytes.inc(c.nbytes)
        seconds.observe(c.copy_s)
        queued.observe(c.queued_s)

    def observe_op(self, kind: str, success: bool, ms: int) -> None:
        """An op ended (on the event loop; several per Step, so the children are looked up once)."""
        self._ops[(kind, success)].observe(ms / 1000)


class _NoRecovery:
    blocks = dropped = 0
    seconds = 0.0


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (wsgiref's name)
        pass


def serve_metrics(host: str, port: int, registry: CollectorRegistry, allowed: Callable[[str | None], bool]) -> tuple[Any, threading.Thread]:
    """/metrics over HTTP on a thread of its own. `allowed(token)` decides each scrape by the bearer
    token it carries (None without one); a refused scrape gets 401 and no figure."""
    app = make_wsgi_app(registry)

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        header = environ.get("HTTP_AUTHORIZATION", "")
        token = header[7:].strip() if header[:7].lower() == "bearer " else None
        if not allowed(token):
            start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", 'Bearer realm="kvdepotd metrics"')])
            return [b"this daemon's /metrics needs 'Authorization: Bearer <token>' with a metrics or an admin token of its auth file\n"]
        return app(environ, start_response)

    family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM)[0][0]

    class Server(ThreadingWSGIServer):
        address_family = family

    srv = make_server(host, port, guarded, Server, handler_class=_Quiet)
    t = threading.Thread(target=srv.serve_forever, name="kvdepotd-metrics", daemon=True)
    t.start()
    return srv, t
