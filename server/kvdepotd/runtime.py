"""The runtime room: executes what the core decides, and reports back. It owns the Depot, the copy
engines (host, and disk when configured), the worker channels with their backlog, the ticker and
the disk flush at shutdown.

The loop, run after every call that can create work (`pump`): the core's ready op parts go to the
host copy engine and its disk jobs to the disk engine; their results come back on the event loop
(`_parts_done`, `_disk_done`) into the core; the core's events go to the workers' channels, or to
a bounded backlog while a rank has no stream attached. Everything runs on one event loop, so the
Depot needs no locks; copy and disk threads see only the plain plans the core hands out.

The gRPC service (kvdepotd.service) translates requests into these calls; nothing here knows
protobuf except the worker events it queues, which are the channels' wire format.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from kvdepot.v1 import kvdepot_pb2 as pb
from kvdepotd import convert
from kvdepotd.core.depot import Depot
from kvdepotd.core.records import Engine, LoadCopied, LookupResult, OpCompleted, StepPlan
from kvdepotd.core.errors import FailedPrecondition, NotFound
from kvdepotd.core.ops import EngineId, OpId, RequestId
from kvdepotd.core.slots import StepColumns
from kvdepotd.metrics import Metrics
from kvdepotd.storage.disk_dir import DiskStore
from kvdepotd.storage.host_arena import Arenas, HostArena
from kvdepotd.storage.remote import RemoteStore
from kvdepotd.transfer.base import PartDone
from kvdepotd.transfer.host import Faults, HostCopyEngine
from kvdepotd.transfer.disk import DiskCopyEngine
from kvdepotd.transfer.remote import RemoteCopyEngine
from kvdepotd.transfer.engine_copy import CopyOrder, EngineCopyRank
from kvdepotd.transfer.mapping import RankMapping, populate

log = logging.getLogger("kvdepotd")
BACKLOG = 65_536  # events kept per (engine, rank) while no worker stream is attached
RECENT_FAILURES = 32  # failures kept for GetStats (kvdepotd status)
RATE_STALE_S = 10.0  # a load rate older than this no longer caps Lookups (load_budget_ms)
TICK_S = 0.05
REMOTE_CHECK_S = 1.0  # how often the remote store's health is checked
DETACHED_LEASE_MS = 5_000  # an engine whose last worker stream ended keeps its lease this long (a worker reconnects in about 1 s)
UNMAPPED_GRACE_MS = 10_000  # an engine's ranks register their memory within this of its registration, or it is said
Rank = tuple[EngineId, int]


@dataclass(frozen=True, slots=True)
class Failure:
    """One failure an operator should see: an op with failed blocks, a checksum failure, an
    expired lease, the remote store going down."""

    unix_s: float
    kind: str
    engine_id: str
    message: str


def now_ms() -> int:
    return int(time.time() * 1000)


class WorkerChannel:
    """One attached worker stream: a queue the runtime fills and the stream drains."""

    def __init__(self, metadata: Any = ()) -> None:
        self.queue: asyncio.Queue[pb.WorkerEvent | None] = asyncio.Queue()
        self.closed: tuple[grpc.StatusCode, str] | None = None  # None: ended by the worker
        self.metadata = tuple(metadata or ())  # the stream's, to check its token again when tokens change

    def invocation_metadata(self) -> tuple[Any, ...]:  # as a call context answers it (DepotService.caller)
        return self.metadata

    def close(self, reason: str, code: grpc.StatusCode = grpc.StatusCode.NOT_FOUND) -> None:
        self.closed = (code, reason)
        self.queue.put_nowait(None)


class Runtime:
    def __init__(self, depot: Depot, metrics: Metrics, arena: HostArena, copy_threads: int = 2, faults: Faults | None = None, store_nice: int = 10) -> None:
        self.depot = depot
        self.metrics = metrics
        self.arenas = Arenas(arena)
        self.copy = HostCopyEngine(
            self._parts_done, self.arenas, threads=copy_threads, faults=faults, on_copied=self._part_copied, store_nice=store_nice,
            clock_ms=now_ms, on_order=self._order,
        )
        self.disk: DiskCopyEngine | None = None
        self.remote: RemoteCopyEngine | None = None
        self._remote_lookups: ThreadPoolExecutor | None = None
        self._remote_lookup_ms = 20
        self.load_budget_ms = 1000  # DaemonConfig.load_budget_ms (0: none)
        self._remote_health: asyncio.Task[None] | None = None
        self.channels: dict[Rank, WorkerChannel] = {}
        self.backlog: dict[Rank, deque[pb.WorkerEvent]] = {}
        self.failures: deque[Failure] = deque(maxlen=RECENT_FAILURES)
        self.started = time.time()
        self._pumping = False
        self._flush = False
        self._ticker: asyncio.Task[None] | None = None
        self._populating: set[asyncio.Task[None]] = set()
        self._unmapped_noted: dict[EngineId, bool] = {}  # engines told about once for a rank's memory not mapped
        # Ops that ended while a copy thread still held one of their parts: the workers hear of the
        # end (and of their request's release) once the parts stopped, so that an engine never
        # reuses blocks a copy still touches.
        self._held: dict[OpId, tuple[EngineId, pb.WorkerEvent.OpCompleted]] = {}
        self._held_releases: set[tuple[EngineId, str]] = set()
        self._stop_populating = threading.Event()

    def attach_disk(self, store: DiskStore, threads: int) -> None:
        self.disk = DiskCopyEngine(self._disk_done, self.arenas, store, threads, self.metrics.observe_disk)

    async def attach_remote(self, store: RemoteStore, threads: int, lookup_ms: int) -> None:
        """The remote tier. The store is asked once here (briefly: a store that is down at start
        is no reason not to serve) and then every REMOTE_CHECK_S by the health check, which
        connects when it can and tells the core whether the store answers."""
        self.remote = RemoteCopyEngine(self._remote_done, self.arenas, store, threads, self.metrics.observe_remote, self.metrics.note_remote)
        self._remote_lookups = ThreadPoolExecutor(2, thread_name_prefix="kvdepot-remote-lookup")
        self._remote_lookup_ms = lookup_ms
        await self._check_remote(first=True)

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self._ticker = asyncio.get_running_loop().create_task(self._tick())
        if self.remote is not None:
            self._remote_health = asyncio.get_running_loop().create_task(self._watch_remote())

    async def _watch_remote(self) -> None:
        while True:
            await asyncio.sleep(REMOTE_CHECK_S)
            try:
                await self._check_remote()
            except Exception:
                log.exception("remote store health check failed")

    async def _check_remote(self, first: bool = False) -> None:
        assert self.remote is not None
        store = self.remote.store
        was = self.depot.remote.up
        connected = store.client is not None
        up = await asyncio.to_thread(store.ping)
        self.metrics.set_remote_up(up)
        if up and not connected:
            for w in await asyncio.to_thread(store.config_warnings):
                log.warning("remote tier: %s", w)
            # A first Lookup would pay for the client's first pipelined call and the lookup
            # thread's start: past an engine's 50-ms Lookup deadline on a busy machine.
            await asyncio.get_running_loop().run_in_executor(self._remote_lookups, self.remote.held, "", "warm-up", [0], 1000)
        if up != was or first:
            self.depot.set_remote_up(up)
            where = store.settings.describe()
            if up:
                log.info("remote tier: store %s answers (%s)", where, "cluster" if store.cluster else "one server")
            else:
                self.failed("remote_down", "", f"remote tier: store {where} does not answer ({store.error or 'no answer'}): "
                            "lookups skip it and blocks are not written to it until it does", warn=True)
        self.pump()

    async def close(self, grace_s: float) -> None:
        """The drain's first half: stops the ticker, flushes the disk tier (within the grace) and
        stops faulting mappings in. stop_engines() is the second, once the service's streams ended."""
        if self._ticker is not None:
            self._ticker.cancel()
        if self._remote_health is not None:
            self._remote_health.cancel()
        if self.disk is not None:
            await self._flush_disk(grace_s)
        self._stop_populating.set()  # a thread still faulting a mapping in stops at its next 2 MiB

    async def stop_engines(self) -> None:
        """After the service's streams ended: the copy engines stop, the worker streams close."""
        await self.copy.close()
        if self.disk is not None:
            await self.disk.close()
        if self.remote is not None:
            await self.remote.close()
            if self._remote_lookups is not None:
                self._remote_lookups.shutdown(wait=False)
            await asyncio.to_thread(self.remote.store.close)
        for ch in list(self.channels.values()):
            ch.close("daemon shutting down", grpc.StatusCode.UNAVAILABLE)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            try:
                for gone in self.depot.expire(now_ms()):
                    self.failed("lease_expired", gone, f"engine {gone} lease expired: its slots, pins and ops were released", warn=True)
                    self._close_engine(gone, "engine lease expired")
                self.depot.reclaim()
                self.pump()
            except Exception:  # the ticker must not die: a bug here is logged, the daemon serves on
                log.exception("expiry tick failed")

    async def _flush_disk(self, grace_s: float) -> None:
        """A clean shutdown writes admitted host blocks to disk (write-back holds them back) and
        waits for disk jobs, within the grace."""
        self._flush = True
        self.pump()
        end = time.monotonic() + grace_s
        while self.depot.disk_jobs and time.monotonic() < end:
            await asyncio.sleep(0.01)
            self.pump()
        if self.depot.disk_jobs:
            log.warning("shutdown: %d disk jobs still running after the grace", self.depot.disk_jobs)

    # -- what the service asks for ----------------------------------------------------------------
    def register_engine(self, engine_id: EngineId, **kw: Any) -> tuple[Engine, bool]:
        """Depot.register_engine (same keywords, less the clock); a new engine's layout goes to the copy engine."""
        eng, joined = self.depot.register_engine(engine_id, now_ms=now_ms(), **kw)
        if not joined:
            self.copy.add_engine(eng.engine_id, eng.layout)
        return eng, joined

    def renew_lease(self, engine_id: EngineId) -> int:
        return self.depot.renew_lease(engine_id, now_ms())

    def unregister_engine(self, engine_id: EngineId) -> int | None:
        """Released slots, or None when other processes of the engine remain (nothing ended)."""
        if not self.depot.leave_engine(engine_id):
            return None
        released = self.depot.unregister_engine(engine_id)
        self._close_engine(engine_id, "engine unregistered")
        self.pump()
        return released

    async def lookup(self, engine_id: EngineId, request_id: RequestId, tokens: bytes, **kw: Any) -> LookupResult:
        """Depot.lookup (same keywords, less the clock); the call renews the engine's lease. Where
        the local tiers stop short and a remote store is up, the store is asked (on a remote
        thread, within --remote-lookup-ms) which of the next blocks it holds."""
        t = now_ms()
        res = self.depot.lookup(engine_id, request_id, tokens, now_ms=t, load_cap=self._load_cap(engine_id), **kw)
        self.depot.renew_lease(engine_id, t)
        self._note_unmapped(engine_id)
        if res.remote_query and self.remote is not None:
            eng = self.depot.engine(engine_id)
            pin = eng.pins.get(request_id)
            t0 = time.perf_counter()
            found = await asyncio.get_running_loop().run_in_executor(
                self._remote_lookups, self.remote.held, eng.namespace, eng.domain.layout_class, res.remote_query, self._remote_lookup_ms
            )
            self.metrics.observe_remote_lookup(time.perf_counter() - t0)
            res = self.depot.extend_lookup(engine_id, request_id, pin, res, found)
            self.pump()  # the reads of what the store holds start now (remote_prefetch)
        return res

    def _load_cap(self, engine_id: EngineId) -> int:
        """The most blocks of the engine a load can copy within the load budget, at the rate CPU
        loads copied lately and behind those waiting; -1: no limit (no budget; an engine whose
        memory the daemon does not copy as CPU memory; no load measured in the last RATE_STALE_S,
        so that a rate measured in a bad moment is measured again rather than shutting hits off)."""
        rate = self.copy.load_rate
        if not self.load_budget_ms or not rate or time.monotonic() - self.copy.load_rate_at > RATE_STALE_S:
            return -1
        m = self.copy.mappings.get((engine_id, 0))
        if not isinstance(m, RankMapping) or m.device != "cpu":
            return -1
        fits = rate * self.load_budget_ms / 1000 - self.copy.load_backlog_bytes()
        return max(0, int(fits // max(1, self.depot.engine(engine_id).layout.block_bytes)))

    def step(self, engine_id: EngineId, step: int, columns: StepColumns, finished: list[RequestId], preempted: list[RequestId]) -> StepPlan:
        t = now_ms()
        plan = self.depot.step(engine_id, step, columns, finished, preempted, t)
        self.depot.renew_lease(engine_id, t)
        self._note_unmapped(engine_id)
        self.pump()
        return plan

    def forward_done(self, engine_id: EngineId, rank: int, step: int, cuda_event: bytes = b"") -> None:
        if cuda_event:
            self.copy.note_forward_event(engine_id, rank, step, cuda_event)
        self.depot.forward_done(engine_id, rank, step)
        self.depot.renew_lease(engine_id, now_ms())
        self.pump()

    def add_mapping(self, mapping: RankMapping | EngineCopyRank) -> None:
        """A rank's mapped KV memory: copies may use it now; its pages are faulted in meanwhile
        (not awaited: a copy that comes first faults its own pages in)."""
        engine_id = EngineId(mapping.engine_id)
        self.copy.add_mapping(mapping)
        self.depot.rank_mapped(engine_id, mapping.rank)
        self.depot.renew_lease(engine_id, now_ms())
        eng = self.depot.engine(engine_id)
        if eng.mapped_in_full and self._unmapped_noted.pop(engine_id, None) is not None:
            log.info("engine %s: every rank's KV memory is mapped now: lookups may hit and blocks are stored", engine_id)
        if isinstance(mapping, EngineCopyRank):
            return
        task = asyncio.get_running_loop().create_task(self._populate(mapping))
        self._populating.add(task)
        task.add_done_callback(self._populating.discard)

    def _note_unmapped(self, engine_id: EngineId) -> None:
        """Says once per engine that a rank's memory is not mapped yet, so it gets no hits."""
        eng = self.depot.engine(engine_id)
        if eng.mapped_in_full or engine_id in self._unmapped_noted or now_ms() - eng.registered_ms < UNMAPPED_GRACE_MS:
            return
        missing = sorted(set(range(eng.layout.world_size)) - eng.mapped)
        self._unmapped_noted[engine_id] = True
        self.failed(
            "unmapped", engine_id, f"engine {engine_id} ({eng.name!r}): rank(s) {missing} have not registered their KV memory: "
            "lookups miss and nothing is stored until they do (was the worker's share refused or did it fail? see its log)", warn=True,
        )

    def clear(self, host: bool, disk: bool) -> tuple[int, int]:
        out = self.depot.clear(host=host, disk=disk)
        self.pump()
        return out

    def attach(self, key: Rank, ch: WorkerChannel) -> None:
        """A worker stream for `key`: it replaces an older one and gets what the backlog kept."""
        old = self.channels.get(key)
        if old is not None:
            old.close(f"rank {key[1]} attached again on another stream", grpc.StatusCode.CANCELLED)
            self.copy.worker_gone(key[0], key[1])  # orders on the old stream may never be reported
        self.channels[key] = ch
        for queued in self.backlog.pop(key, ()):
            ch.queue.put_nowait(queued)

    def detach(self, key: Rank, ch: WorkerChannel) -> bool:
        """The stream ended. When it was the engine's last, its processes have most likely exited
        (TensorRT-LLM calls no shutdown hook; a killed process says nothing): the engine's lease
        runs out DETACHED_LEASE_MS from now unless a call of the engine renews it first. Only for
        an engine whose memory was mapped: a stream that never shared any proves no process left."""
        if self.channels.get(key) is not ch:
            return False
        del self.channels[key]
        self.copy.worker_gone(key[0], key[1])
        eng = self.depot.engines.get(key[0])
        if eng is not None and eng.mapped and not any(k[0] == key[0] for k in self.channels):
            self.depot.shorten_lease(key[0], now_ms() + DETACHED_LEASE_MS)
        return True

    def _order(self, order: CopyOrder) -> bool:
        """An engine-copy part's order, to its rank's stream alone (never kept for a later stream:
        an order must not be carried out after the daemon gave its op up); False when it has none."""
        ch = self.channels.get((EngineId(order.engine_id), order.rank))
        if ch is None:
            return False
        ch.queue.put_nowait(pb.WorkerEvent(orders=[convert.copy_order_pb(order)]))
        return True

    def engine_copied(self, engine_id: EngineId, rank: int, op_id: OpId, failed: list[int], message: str) -> None:
        """A worker carried out one of its orders (WorkerMessage.copies_done)."""
        self.depot.engine_rank(engine_id, rank)
        self.copy.engine_copied(op_id, rank, failed, message)
        self.depot.renew_lease(engine_id, now_ms())
        self.pump()

    def arena_fd(self, engine_id: EngineId, namespace_ok: Any) -> tuple[int, int]:
        """The descriptor (still the arena's: the caller dups it) and size of the host memory an
        engine_copies engine's workers map. `namespace_ok(namespace)`: whether the asker may."""
        eng = self.depot.engines.get(engine_id)
        if eng is None or not namespace_ok(eng.namespace):
            raise NotFound(f"engine {engine_id!r} is not registered")
        if not eng.engine_copies:
            raise FailedPrecondition(f"engine {engine_id} did not register with engine_copies: the daemon copies its blocks")
        arena = self.arenas.of(eng.domain.layout_class)
        return arena.fd, arena.total_bytes

    def attached_ranks(self, engine_id: EngineId) -> list[int]:
        return sorted(r for (eid, r) in self.channels if eid == engine_id)

    def failed(self, kind: str, engine_id: str, message: str, warn: bool = False) -> None:
        """Keeps a failure for GetStats (kvdepotd status); `warn` logs it too (an op's failed
        blocks are not logged: a remote miss or a late load makes them, which is no news)."""
        if warn:
            log.warning("%s", message)
        self.failures.append(Failure(time.time(), kind, engine_id, message))

    # -- the loop -----------------------------------------------------------------------------------
    def pump(self) -> None:
        if self._pumping:  # a copy engine that ends parts at once calls back into us
            return
        self._pumping = True
        try:
            for op_id in self.depot.take_cancels():
                self.copy.cancel(op_id)
            parts = self.depot.take_ready()
            while parts:
                self.copy.submit(parts)
                parts = self.depot.take_ready()
            if self.disk is not None:
                self.disk.forget(self.depot.take_disk_drops())  # delete last: before any slot is rewritten
                self.disk.submit(self.depot.take_disk_jobs(now_ms(), self._flush))
            if self.remote is not None:
                self.remote.submit(self.depot.take_remote_jobs())
        finally:
            self._pumping = False
        events = self.depot.take_events()
        if not events:
            return
        batches: dict[EngineId, pb.WorkerEvent] = {}
        t = now_ms()
        for ev in events:
            msg = batches.get(ev.engine_id)
            if msg is None:
                msg = batches[ev.engine_id] = pb.WorkerEvent()
            if isinstance(ev, OpCompleted):
                done = convert.op_completed_pb(ev.op)
                if self.copy.busy(ev.op.op_id):  # it ended early (deadline, finished request): its parts stop first
                    self.copy.cancel(ev.op.op_id)
                    self._held[ev.op.op_id] = (ev.engine_id, done)
                else:
                    msg.completed.append(done)
                self.metrics.observe_op(ev.op.kind.value.lower(), ev.op.success, t - ev.op.planned_ms)
                op = ev.op
                if not op.success and not op.cancelled:  # a cancelled store's request went back: no failure
                    why = op.message or "no reason given"
                    self.failed(op.kind.value.lower(), op.engine_id, f"op {op.op_id} of request {op.request_id}: {len(op.failed)} of {len(op.block_ids)} blocks failed: {why}")
            elif isinstance(ev, LoadCopied):
                msg.copied.append(ev.op_id)
            elif self._holds(ev.engine_id, ev.request_id):
                self._held_releases.add((ev.engine_id, ev.request_id))
            else:
                msg.released.append(ev.request_id)
        for engine_id, msg in batches.items():
            if msg.ByteSize():  # not when all it had was held
                self._route(engine_id, msg)

    def _holds(self, engine_id: EngineId, request_id: str) -> bool:
        return any(e == engine_id and c.request_id == request_id for e, c in self._held.values())

    def _route(self, engine_id: EngineId, msg: pb.WorkerEvent) -> None:
        """Every rank of the engine gets the batch (each must know of every op's end)."""
        eng = self.depot.engines.get(engine_id)
        if eng is None:
            return
        for rank in range(eng.layout.world_size):
            key = (engine_id, rank)
            ch = self.channels.get(key)
            if ch is not None:
                ch.queue.put_nowait(msg)
            else:
                self.backlog.setdefault(key, deque(maxlen=BACKLOG)).append(msg)

    def _part_copied(self, op_id: int, rank: int) -> None:
        self.depot.part_copied(OpId(op_id), rank)
        self.pump()

    def _parts_done(self, done: list[PartDone]) -> None:
        for d in done:
            self.depot.complete_part(OpId(d.op_id), d.rank, d.failed, d.message, d.corrupt)
            held = self._held.get(OpId(d.op_id))
            if held is not None and not self.copy.busy(OpId(d.op_id)):  # its last part stopped: now the workers hear
                del self._held[OpId(d.op_id)]
                engine_id, done = held
                msg = pb.WorkerEvent(completed=[done])
                if (engine_id, done.request_id) in self._held_releases and not self._holds(engine_id, done.request_id):
                    self._held_releases.discard((engine_id, done.request_id))
                    msg.released.append(done.request_id)
                self._route(engine_id, msg)
            if d.copied is not None:
                self.metrics.observe_copy(d.copied)
            if d.corrupt:
                self.failed("checksum", "", f"op {d.op_id} rank {d.rank}: {len(d.corrupt)} blocks failed their checksum and were dropped", warn=True)
        self.depot.reclaim()  # while the engine runs its forward, not in its next Step
        self.pump()

    def _disk_done(self, job_id: int, failed: set[int], corrupt: set[int], message: str) -> None:
        self.depot.disk_job_done(job_id, failed, corrupt, message)  # type: ignore[arg-type]
        if corrupt:
            self.failed("checksum", "", f"disk job {job_id}: {len(corrupt)} blocks failed their checksum and were dropped", warn=True)
        self.pump()

    def _remote_done(self, job_id: int, failed: set[int], corrupt: set[int], present: set[int], message: str, forged: set[int]) -> None:
        self.depot.remote_job_done(job_id, failed, corrupt, present, message, forged)  # type: ignore[arg-type]
        if forged:
            self.failed("forged", "", f"remote job {job_id}: {len(forged)} blocks in the store failed their MAC (deleted there; recomputed): "
                        f"{message}", warn=True)
        elif corrupt:
            self.failed("checksum", "", f"remote job {job_id}: {len(corrupt)} blocks were corrupt in the store (deleted there; recomputed)", warn=True)
        self.pump()

    def _close_engine(self, engine_id: EngineId, reason: str) -> None:
        self.copy.forget_engine(engine_id)
        self._unmapped_noted.pop(engine_id, None)
        for key in [k for k in self.channels if k[0] == engine_id]:
            self.channels.pop(key).close(reason)
        for key in [k for k in self.backlog if k[0] == engine_id]:
            del self.backlog[key]

    async def _populate(self, mapping: RankMapping) -> None:
        t0 = time.monotonic()
        if await asyncio.to_thread(populate, mapping, self._stop_populating):
            log.info(
                "engine %s rank %d: %.1f MiB of KV memory faulted in (%.0f ms)",
                mapping.engine_id, mapping.rank, mapping.mapped_bytes / 2**20, (time.monotonic() - t0) * 1000,
            )
