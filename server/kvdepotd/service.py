"""The gRPC edge: translates protobuf to Depot calls and back, routes worker events, runs the
copy engine's results back into the core. No slot logic lives here.

Everything runs on one event loop, so the Depot needs no locks. After every call that can create
work, `_pump()` hands ready op parts to the copy engine and routes the core's events to the
workers' streams (or a bounded backlog while a rank is not attached).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from kvdepot.v1 import kvdepot_pb2 as pb
from kvdepot.v1 import kvdepot_pb2_grpc as pb_grpc
from kvdepotd import convert
from kvdepotd.auth import OPEN, Caller, PermissionDenied, Tokens, Unauthenticated
from kvdepotd.core.depot import Depot, Engine, LoadCopied, OpCompleted
from kvdepotd.core.errors import DepotError, InvalidRequest
from kvdepotd.core.ops import EngineId, OpId, RequestId
from kvdepotd.errors import status_of
from kvdepotd.metrics import Metrics
from kvdepotd.storage.host_arena import HostArena
from kvdepotd.transfer import Faults, HostCopyEngine, PartDone
from kvdepotd.transfer.disk import DiskCopyEngine
from kvdepotd.transfer.mapping import RankMapping, map_rank, populate

if TYPE_CHECKING:
    from kvdepotd.handoff import Handoffs

log = logging.getLogger("kvdepotd")
T = TypeVar("T")
BACKLOG = 65_536  # events kept per (engine, rank) while no worker stream is attached
TICK_S = 0.05
AUDIT_S = 10.0  # a refused token is logged at most this often per method and kind of refusal


class BadMessage:
    """A request whose bytes are not a valid message of its type (see safe_parser)."""

    def __init__(self, what: str) -> None:
        self.what = what

    def WhichOneof(self, _: str) -> None:  # so a worker stream's first-message check rejects it
        return None


def safe_parser(cls: Any, method: str) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except Exception as e:  # DecodeError and friends: the bytes are not this message
            return BadMessage(f"{method}: the request is not a valid {cls.DESCRIPTOR.full_name} ({e})")

    return parse


def rpc(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Maps core errors to a status with their message; anything else is a bug: logged, INTERNAL."""
    name = fn.__name__

    @functools.wraps(fn)
    async def wrapper(self: DepotService, request: Any, context: grpc.aio.ServicerContext) -> T:
        t0 = time.perf_counter()
        try:
            if isinstance(request, BadMessage):
                raise InvalidRequest(request.what)
            return await fn(self, request, context)
        except DepotError as e:
            self.metrics.rpc_errors.labels(name, status_of(e).name).inc()
            self.refused(name, e, context)
            await context.abort(status_of(e), str(e))
        except ValueError as e:  # protobuf range errors and the like from a malformed message
            self.metrics.rpc_errors.labels(name, "INVALID_ARGUMENT").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: {e}")
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception:
            log.exception("%s failed", name)
            self.metrics.rpc_errors.labels(name, "INTERNAL").inc()
            await context.abort(grpc.StatusCode.INTERNAL, f"{name}: internal error (see the daemon log)")
        finally:
            self.metrics.rpc_seconds.labels(name).observe(time.perf_counter() - t0)
        raise AssertionError("unreachable")

    return wrapper


class WorkerChannel:
    """One attached worker stream: a queue the service fills and the stream drains."""

    def __init__(self, metadata: Any = ()) -> None:
        self.queue: asyncio.Queue[pb.WorkerEvent | None] = asyncio.Queue()
        self.closed: tuple[grpc.StatusCode, str] | None = None  # None: ended by the worker
        self.metadata = tuple(metadata or ())  # the stream's, to check its token again when tokens change

    def invocation_metadata(self) -> tuple[Any, ...]:  # as a call context answers it (DepotService.caller)
        return self.metadata

    def close(self, reason: str, code: grpc.StatusCode = grpc.StatusCode.NOT_FOUND) -> None:
        self.closed = (code, reason)
        self.queue.put_nowait(None)


class DepotService(pb_grpc.BlockManagerServicer):
    def __init__(self, depot: Depot, metrics: Metrics, arena: HostArena, copy_threads: int = 2, faults: Faults | None = None, store_nice: int = 10) -> None:
        self.depot = depot
        self.metrics = metrics
        self.copy = HostCopyEngine(self._parts_done, arena, threads=copy_threads, faults=faults, on_copied=self._part_copied, store_nice=store_nice)
        self._pumping = False
        self.channels: dict[tuple[EngineId, int], WorkerChannel] = {}
        self.backlog: dict[tuple[EngineId, int], deque[pb.WorkerEvent]] = {}
        self.started = time.time()
        self._ticker: asyncio.Task[None] | None = None
        self.disk: DiskCopyEngine | None = None
        self._flush = False
        self._populating: set[asyncio.Task[None]] = set()
        # Open Session streams, ended at shutdown: task -> whether it waits for its next request.
        self._sessions: dict[asyncio.Task[Any], bool] = {}
        self._closing = False
        self.lanes: list[str] = []  # the lane addresses (kvdepotd.lane), told to engines as they register
        self.auth: Tokens | None = None  # None: no tokens asked for, every caller may do everything
        self.handoffs: Handoffs | None = None  # descriptors handed over beside unix addresses (kvdepotd.handoff)
        self.shm_paths = True  # False: cpu_shm memory only as handed-over descriptors, never by path
        self._refusals: dict[tuple[str, str], tuple[float, int]] = {}  # (method, error) -> (last logged, since)
        self._stop_populating = threading.Event()

    @staticmethod
    def now_ms() -> int:
        return int(time.time() * 1000)

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self._ticker = asyncio.get_running_loop().create_task(self._tick())

    async def close(self, grace_s: float = 10.0) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
        if self.disk is not None:
            await self._flush_disk(grace_s)
        self._stop_populating.set()  # a thread still faulting a mapping in stops at its next 2 MiB
        self._closing = True
        await self._end_sessions(grace_s)
        await self.copy.close()
        if self.disk is not None:
            await self.disk.close()
        for ch in list(self.channels.values()):
            ch.close("daemon shutting down", grpc.StatusCode.UNAVAILABLE)

    async def _end_sessions(self, grace_s: float) -> None:
        """Ends idle Session streams, which would hold the drain for the whole grace. Each is
        cancelled while it waits for its next request, in its own frame, which answers the cancel
        with UNAVAILABLE. One that is elsewhere (grpc still completing the send of its last answer,
        seen on a loaded machine) is left to get there: a cancel landing in grpc's frame ends the
        task but leaves the call open until the grace is over."""
        end = time.monotonic() + grace_s
        while self._sessions and time.monotonic() < end:
            for task, waiting in list(self._sessions.items()):
                if waiting:
                    task.cancel()
            await asyncio.sleep(0.005)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            try:
                before = set(self.depot.engines)
                self.depot.expire(self.now_ms())
                for gone in before - set(self.depot.engines):
                    log.warning("engine %s lease expired: its slots, pins and ops were released", gone)
                    self._close_engine(gone, "engine lease expired")
                self.depot.reclaim()
                self._pump()
            except Exception:  # the ticker must not die: a bug here is logged, the daemon serves on
                log.exception("expiry tick failed")

    async def _flush_disk(self, grace_s: float) -> None:
        """A clean shutdown writes admitted host blocks to disk (write-back holds them back) and
        waits for disk jobs, within the grace."""
        self._flush = True
        self._pump()
        end = time.monotonic() + grace_s
        while self.depot.disk_jobs and time.monotonic() < end:
            await asyncio.sleep(0.01)
            self._pump()
        if self.depot.disk_jobs:
            log.warning("shutdown: %d disk jobs still running after the grace", len(self.depot.disk_jobs))

    # -- the pump ---------------------------------------------------------------------------------
    def _pump(self) -> None:
        if self._pumping:  # a copy engine that ends parts at once calls back into us
            return
        self._pumping = True
        try:
            parts = self.depot.take_ready()
            while parts:
                self.copy.submit(parts)
                parts = self.depot.take_ready()
            if self.disk is not None:
                self.disk.forget(self.depot.take_disk_drops())  # delete last: before any slot is rewritten
                self.disk.submit(self.depot.take_disk_jobs(self.now_ms(), self._flush))
        finally:
            self._pumping = False
        events = self.depot.take_events()
        if not events:
            return
        batches: dict[EngineId, pb.WorkerEvent] = {}
        now_ms = self.now_ms()
        for ev in events:
            msg = batches.get(ev.engine_id)
            if msg is None:
                msg = batches[ev.engine_id] = pb.WorkerEvent()
            if isinstance(ev, OpCompleted):
                msg.completed.append(convert.op_completed_pb(ev.op))
                self.metrics.observe_op(ev.op.kind.value.lower(), ev.op.success, now_ms - ev.op.planned_ms)
            elif isinstance(ev, LoadCopied):
                msg.copied.append(ev.op_id)
            else:
                msg.released.append(ev.request_id)
        for engine_id, msg in batches.items():
            self._route(engine_id, msg)

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
        self._pump()

    def _parts_done(self, done: list[PartDone]) -> None:
        for d in done:
            self.depot.complete_part(OpId(d.op_id), d.rank, d.failed, d.message, d.corrupt)
            if d.copied is not None:
                self.metrics.observe_copy(d.copied)
            if d.corrupt:
                log.warning("op %d rank %d: %d blocks failed their checksum and were dropped", d.op_id, d.rank, len(d.corrupt))
        self.depot.reclaim()  # while the engine runs its forward, not in its next Step
        self._pump()

    def disk_done(self, job_id: int, failed: set[int], corrupt: set[int], message: str) -> None:
        self.depot.disk_job_done(job_id, failed, corrupt, message)  # type: ignore[arg-type]
        if corrupt:
            log.warning("disk job %d: %d blocks failed their checksum and were dropped", job_id, len(corrupt))
        self._pump()

    def _close_engine(self, engine_id: EngineId, reason: str) -> None:
        self.copy.forget_engine(engine_id)
        for key in [k for k in self.channels if k[0] == engine_id]:
            self.channels.pop(key).close(reason)
        for key in [k for k in self.backlog if k[0] == engine_id]:
            del self.backlog[key]

    def _touch_lease(self, engine_id: EngineId) -> None:
        """Any call from an engine proves it alive; heartbeats only matter when it is idle."""
        eng = self.depot.engines.get(engine_id)
        if eng is not None:
            eng.lease_expires_ms = self.now_ms() + eng.lease_ms

    # -- who calls ---------------------------------------------------------------------------------
    def caller(self, context: Any) -> Caller:
        """Whom the call's token speaks for (a lane's context gives the token of its hello)."""
        auth = self.auth
        return OPEN if auth is None else auth.caller(context.invocation_metadata())

    def own_engine(self, context: Any, engine_id: EngineId) -> Engine:
        """The engine, when the caller may drive it (NotFound for an unknown one, as before)."""
        eng = self.depot.engine(engine_id)
        if self.auth is not None and not (c := self.caller(context)).may_use(eng.namespace):
            raise PermissionDenied(f"engine {engine_id} is not in the namespace of the call's token ({c.describe()})")
        return eng

    def refused(self, method: str, e: DepotError, context: Any) -> None:
        """A call refused for its token, in the log for whoever audits the daemon: the first of each
        kind at once, then at most one line per kind every AUDIT_S with the count in between.
        Other errors are the caller's to read, not the operator's: not logged."""
        if not isinstance(e, (Unauthenticated, PermissionDenied)):
            return
        key = (method, type(e).__name__)
        now = time.monotonic()
        last, suppressed = self._refusals.get(key, (-AUDIT_S, 0))
        if now - last < AUDIT_S:
            self._refusals[key] = (last, suppressed + 1)
            return
        self._refusals[key] = (now, 0)
        more = f" ({suppressed} more like it since the last line)" if suppressed else ""
        log.warning("refused %s from %s: %s%s", method, context.peer(), e, more)

    def tokens_changed(self) -> None:
        """Ends the worker streams whose token no longer drives their engine (their forward-done
        reports would keep its lease alive while its scheduler's calls are refused)."""
        for (engine_id, rank), ch in list(self.channels.items()):
            eng = self.depot.engines.get(engine_id)
            try:
                if eng is not None and not self.caller(ch).may_use(eng.namespace):
                    raise PermissionDenied(f"the stream's token no longer speaks for namespace {eng.namespace!r}")
            except DepotError as e:
                log.warning("engine %s rank %d: worker stream ended: %s", engine_id, rank, e)
                ch.close(f"token refused after the daemon re-read its tokens: {e}", status_of(e))

    @rpc
    async def WhoAmI(self, request: pb.WhoAmIRequest, context: grpc.aio.ServicerContext) -> pb.WhoAmIResponse:
        c = self.caller(context)
        return pb.WhoAmIResponse(tokens_required=self.auth is not None, namespace=c.namespace, admin=c.admin)

    # -- engines ----------------------------------------------------------------------------------
    @rpc
    async def RegisterEngine(self, request: pb.RegisterEngineRequest, context: grpc.aio.ServicerContext) -> pb.RegisterEngineResponse:
        if not request.HasField("layout"):
            raise InvalidRequest("layout is required")
        caller = self.caller(context)
        namespace = request.namespace if caller.admin else caller.namespace
        if request.namespace and request.namespace != namespace:  # empty: the token's namespace
            raise PermissionDenied(f"namespace {request.namespace!r} is not the namespace of the call's token ({caller.describe()})")
        eng, joined = self.depot.register_engine(
            EngineId(f"eng-{uuid.uuid4().hex[:12]}"),
            name=request.engine_name,
            model=request.model,
            layout=convert.layout_from_pb(request.layout),
            namespace=namespace,
            style=convert.style_from_pb(request.update_style),
            lease_ms=request.lease_ms,
            now_ms=self.now_ms(),
            key=request.engine_key,
            late_load_checks=request.late_load_checks,
        )
        engine_id = eng.engine_id
        if joined:
            log.info("engine %s joined by another process (name=%r key=%r)", engine_id, request.engine_name, request.engine_key)
        else:
            self.copy.add_engine(engine_id, eng.layout)
            log.info(
                "engine %s registered: name=%r model=%r layout=%s namespace=%r style=%s late_load_checks=%s",
                engine_id, eng.name, eng.model, eng.layout.layout_class, eng.namespace, eng.style.value, eng.late_load_checks,
            )
        return pb.RegisterEngineResponse(
            engine_id=engine_id,
            lease_ms=eng.lease_ms,
            block_bytes=eng.layout.block_bytes,
            host_capacity_blocks=self.depot.capacity_blocks(engine_id),
            joined=joined,
            lanes=self.lanes,
        )

    @rpc
    async def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext) -> pb.HeartbeatResponse:
        engine_id = self.own_engine(context, EngineId(request.engine_id)).engine_id
        return pb.HeartbeatResponse(lease_expires_unix_ms=self.depot.heartbeat(engine_id, self.now_ms()))

    @rpc
    async def UnregisterEngine(self, request: pb.UnregisterEngineRequest, context: grpc.aio.ServicerContext) -> pb.UnregisterEngineResponse:
        engine_id = self.own_engine(context, EngineId(request.engine_id)).engine_id
        released = self.depot.unregister_engine(engine_id)
        self._close_engine(engine_id, "engine unregistered")
        self._pump()
        log.info("engine %s unregistered (%d slots released)", engine_id, released)
        return pb.UnregisterEngineResponse(released_slots=released)

    @rpc
    async def RegisterKvCaches(self, request: pb.RegisterKvCachesRequest, context: grpc.aio.ServicerContext) -> pb.RegisterKvCachesResponse:
        engine_id = self.own_engine(context, EngineId(request.engine_id)).engine_id
        eng = self.depot.engine_rank(engine_id, request.rank)
        bell = self._doorbell(request, eng.namespace)
        try:
            fds = self._claim(request, eng.namespace)
            try:
                # Mapping validates and maps GiBs of engine memory: off the event loop, so other engines' steps go on.
                mapping = await asyncio.to_thread(map_rank, engine_id, eng.layout, request, fds)
            finally:
                for fd in fds.values():
                    os.close(fd)  # a mapping holds its own reference
        except BaseException:
            if bell is not None:
                bell.close()
            raise
        mapping.doorbell = bell
        self.depot.engine_rank(engine_id, request.rank)  # still registered after the wait
        self.copy.add_mapping(mapping)
        self._touch_lease(engine_id)
        log.info(
            "engine %s rank %d mapped %d tensors (%d blocks, %.1f MiB) on %s%s",
            engine_id, request.rank, len(request.tensors), mapping.num_blocks, mapping.mapped_bytes / 2**20, mapping.device,
            " (memory handed over)" if fds else "",
        )
        # Its pages are faulted in meanwhile, so the first copies run at full speed (not awaited: the
        # engine goes on starting; a copy that comes first faults its own pages in as before).
        task = asyncio.get_running_loop().create_task(self._populate(mapping))
        self._populating.add(task)
        task.add_done_callback(self._populating.discard)
        return pb.RegisterKvCachesResponse(mapped_bytes=mapping.mapped_bytes)

    def _claim(self, request: pb.RegisterKvCachesRequest, namespace: str) -> dict[str, int]:
        """The descriptors the request's handoff ids name (the caller closes them), or none."""
        shm = [s.cpu_shm for s in request.storages if s.WhichOneof("handle") == "cpu_shm"]
        if not self.shm_paths and any(not h.handoff_id for h in shm):
            raise InvalidRequest("this daemon takes CPU KV memory only as descriptors handed over on its handoff socket, not by path (shm_paths = false)")
        fds: dict[str, int] = {}
        try:
            for h in shm:
                if h.handoff_id and h.handoff_id not in fds:
                    if self.handoffs is None:
                        raise InvalidRequest("this daemon has no handoff socket (it listens on no unix: address): name the memory by path")
                    fds[h.handoff_id] = self.handoffs.claim(h.handoff_id, namespace)
        except DepotError:
            for fd in fds.values():
                os.close(fd)
            raise
        return fds

    def _doorbell(self, request: pb.RegisterKvCachesRequest, namespace: str) -> socket.socket | None:
        """The worker's doorbell socket (non-blocking), when the request names one."""
        if not request.doorbell_handoff_id:
            return None
        if self.handoffs is None:
            raise InvalidRequest("this daemon has no handoff socket (it listens on no unix: address): leave doorbell_handoff_id empty")
        from kvdepotd.handoff import doorbell

        fd = self.handoffs.claim(request.doorbell_handoff_id, namespace)
        if not doorbell(fd):
            os.close(fd)
            raise InvalidRequest(f"doorbell_handoff_id {request.doorbell_handoff_id[:64]!r} names a descriptor that is not a unix datagram socket")
        sock = socket.socket(fileno=fd)
        sock.setblocking(False)
        return sock

    async def _populate(self, mapping: RankMapping) -> None:
        t0 = time.monotonic()
        if await asyncio.to_thread(populate, mapping, self._stop_populating):
            log.info(
                "engine %s rank %d: %.1f MiB of KV memory faulted in (%.0f ms)",
                mapping.engine_id, mapping.rank, mapping.mapped_bytes / 2**20, (time.monotonic() - t0) * 1000,
            )

    # -- the engine path ------------------------------------------------------------------------
    @rpc
    async def Lookup(self, request: pb.LookupRequest, context: grpc.aio.ServicerContext) -> pb.LookupResponse:
        engine_id = EngineId(request.engine_id)
        if self.auth is not None:
            self.own_engine(context, engine_id)
        res = self.depot.lookup(
            engine_id,
            RequestId(request.request_id),
            convert.lookup_tokens(request),
            cache_salt=request.cache_salt,
            lora_name=request.lora_name,
            device_matched_tokens=request.device_matched_tokens,
            pin_ms=request.pin_ms,
            now_ms=self.now_ms(),
        )
        self._touch_lease(engine_id)
        by_tier = [pb.TierTokens(tier=t, tokens=n) for t, n in ((pb.TIER_HOST, res.host_tokens), (pb.TIER_DISK, res.disk_tokens)) if n]
        return pb.LookupResponse(
            matched_tokens=res.matched_tokens,
            by_tier=by_tier,
            pin_deadline_unix_ms=res.pin_deadline_ms,
            total_blocks=res.total_blocks,
        )

    @rpc
    async def Step(self, request: pb.StepRequest, context: grpc.aio.ServicerContext) -> pb.StepResponse:
        engine_id = EngineId(request.engine_id)
        if self.auth is not None:
            self.own_engine(context, engine_id)
        plan = self.depot.step(
            engine_id,
            request.step,
            convert.step_columns(request),
            [RequestId(r) for r in request.finished],
            [RequestId(r) for r in request.preempted],
            self.now_ms(),
        )
        self._touch_lease(engine_id)
        self._pump()
        return convert.plan_to_pb(plan)

    async def Session(
        self, request_iterator: AsyncIterator[pb.SessionRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.SessionResponse]:
        """Lookup and Step on one stream, answered in order by the unary handlers themselves (same
        errors, same metrics); the first failure ends the stream with that call's status."""
        if self._closing:  # a client reopening during the drain would hold it for the whole grace
            await context.abort(grpc.StatusCode.UNAVAILABLE, "kvdepotd is shutting down")
        task = asyncio.current_task()
        assert task is not None
        requests = request_iterator.__aiter__()
        try:
            while True:
                self._sessions[task] = True
                try:
                    req = await requests.__anext__()
                except StopAsyncIteration:
                    return
                finally:
                    self._sessions[task] = False
                yield await self.answer(req, context)
        except asyncio.CancelledError:
            if not self._closing:
                raise
            # Cancelling grpc's task alone leaves the call open until the server's grace ends.
            await context.abort(grpc.StatusCode.UNAVAILABLE, "kvdepotd is shutting down")
        finally:
            self._sessions.pop(task, None)

    async def answer(self, req: pb.SessionRequest | BadMessage, context: Any, transport: str = "session") -> pb.SessionResponse:
        """One call of a Session stream or of the lane (kvdepotd.lane), by the unary handler."""
        if isinstance(req, BadMessage):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, req.what)
            raise AssertionError("unreachable")
        which = req.WhichOneof("call")
        if which == "step":
            self.metrics.engine_call("Step", transport)
            return pb.SessionResponse(step=await self.Step(req.step, context))
        if which == "lookup":
            self.metrics.engine_call("Lookup", transport)
            return pb.SessionResponse(lookup=await self.Lookup(req.lookup, context))
        if which == "hello":
            return pb.SessionResponse(hello=await self.WhoAmI(pb.WhoAmIRequest(), context))
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Session: each SessionRequest carries a lookup, a step or a hello")
        raise AssertionError("unreachable")

    async def WorkerStream(
        self, request_iterator: AsyncIterator[pb.WorkerMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WorkerEvent]:
        it = request_iterator.__aiter__()
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            return
        key, err = self._attach(first, context)
        if err is not None:
            await context.abort(*err)
            return
        ch = WorkerChannel(context.invocation_metadata())
        old = self.channels.get(key)
        if old is not None:
            old.close(f"rank {key[1]} attached again on another stream", grpc.StatusCode.CANCELLED)
        self.channels[key] = ch
        for queued in self.backlog.pop(key, ()):
            ch.queue.put_nowait(queued)
        log.info("engine %s rank %d attached", *key)
        reader = asyncio.get_running_loop().create_task(self._read_worker(it, key, ch))
        try:
            yield pb.WorkerEvent(attached=pb.WorkerEvent.Attached(rank=key[1]))
            while True:
                event = await ch.queue.get()
                if event is None:
                    break
                yield event
        finally:
            reader.cancel()
            if self.channels.get(key) is ch:
                del self.channels[key]
                log.info("engine %s rank %d detached", *key)
        if ch.closed is not None:
            await context.abort(*ch.closed)

    def _attach(self, first: pb.WorkerMessage, context: Any) -> tuple[tuple[EngineId, int], tuple[grpc.StatusCode, str] | None]:
        if isinstance(first, BadMessage):
            return (EngineId(""), 0), (grpc.StatusCode.INVALID_ARGUMENT, first.what)
        if first.WhichOneof("msg") != "attach":
            return (EngineId(""), 0), (grpc.StatusCode.INVALID_ARGUMENT, "the first message on a worker stream must be attach")
        engine_id, rank = EngineId(first.attach.engine_id), first.attach.rank
        try:
            self.own_engine(context, engine_id)
            self.depot.engine_rank(engine_id, rank)
        except DepotError as e:
            self.refused("WorkerStream", e, context)
            return (engine_id, rank), (status_of(e), str(e))
        return (engine_id, rank), None

    async def _read_worker(self, it: AsyncIterator[pb.WorkerMessage], key: tuple[EngineId, int], ch: WorkerChannel) -> None:
        engine_id, rank = key
        try:
            async for msg in it:
                if isinstance(msg, BadMessage):
                    ch.close(msg.what, grpc.StatusCode.INVALID_ARGUMENT)
                    return
                which = msg.WhichOneof("msg")
                if which == "forward_done":
                    if msg.forward_done.cuda_event:
                        self.copy.note_forward_event(engine_id, rank, msg.forward_done.step, msg.forward_done.cuda_event)
                    self.depot.forward_done(engine_id, rank, msg.forward_done.step)
                    self._touch_lease(engine_id)
                    self._pump()
                else:
                    ch.close(f"unexpected {which or 'empty'} message after attach", grpc.StatusCode.INVALID_ARGUMENT)
                    return
            ch.queue.put_nowait(None)  # the worker ended its side
        except DepotError as e:
            ch.close(str(e), status_of(e))
        except (asyncio.CancelledError, grpc.aio.AioRpcError):
            pass

    # -- inspection and admin ---------------------------------------------------------------------
    @rpc
    async def GetStats(self, request: pb.GetStatsRequest, context: grpc.aio.ServicerContext) -> pb.GetStatsResponse:
        self.caller(context)  # any known token: the figures name no engine or request
        d = self.depot
        pools = []
        for dom in d.domains.values():
            for tier, reg in ((pb.TIER_HOST, dom.registry), (pb.TIER_DISK, dom.disk)):
                if reg is None:
                    continue
                pools.append(
                    pb.PoolStats(
                        layout_class=dom.layout_class,
                        tier=tier,
                        block_bytes=dom.block_bytes,
                        capacity_blocks=reg.pool.capacity_blocks,
                        used_blocks=reg.pool.num_used,
                        pinned_blocks=reg.num_pinned,
                        in_flight_blocks=reg.num_storing,
                    )
                )
        rec = self.metrics.recovery
        return pb.GetStatsResponse(
            engines=len(d.engines),
            slots=sum(len(e.slots) for e in d.engines.values()),
            ops_in_flight=len(d.ops.ops),
            pools=pools,
            counters=d.all_counters(),
            host_bytes=d.host_arena.total_bytes,
            uptime_s=time.time() - self.started,
            mapped_engine_bytes=self.copy.mapped_bytes,
            mapped_ranks=len(self.copy.mappings),
            disk_bytes=d.disk_arena.total_bytes,
            disk_dir=self.disk.store.root if self.disk is not None else "",
            disk_recovered_blocks=rec.blocks,
            disk_recovery_dropped_blocks=rec.dropped,
            disk_recovery_s=rec.seconds,
        )

    @rpc
    async def ListEngines(self, request: pb.ListEnginesRequest, context: grpc.aio.ServicerContext) -> pb.ListEnginesResponse:
        caller = self.caller(context)
        return pb.ListEnginesResponse(
            engines=[
                convert.engine_info(e, sorted(r for (eid, r) in self.channels if eid == e.engine_id))
                for e in self.depot.engines.values()
                if caller.may_use(e.namespace)
            ]
        )

    @rpc
    async def ListSlots(self, request: pb.ListSlotsRequest, context: grpc.aio.ServicerContext) -> pb.ListSlotsResponse:
        eng = self.own_engine(context, EngineId(request.engine_id))
        return pb.ListSlotsResponse(slots=[convert.slot_summary(s) for s in eng.slots.values()])

    @rpc
    async def GetSlot(self, request: pb.GetSlotRequest, context: grpc.aio.ServicerContext) -> pb.GetSlotResponse:
        self.own_engine(context, EngineId(request.engine_id))
        slot = self.depot.slot(EngineId(request.engine_id), RequestId(request.request_id))
        return pb.GetSlotResponse(summary=convert.slot_summary(slot), blocks=convert.slot_blocks(slot))

    @rpc
    async def GetBlock(self, request: pb.GetBlockRequest, context: grpc.aio.ServicerContext) -> pb.GetBlockResponse:
        self.own_engine(context, EngineId(request.engine_id))
        host, disk = self.depot.block_info(EngineId(request.engine_id), request.hash)  # type: ignore[arg-type]
        e = host or disk
        if e is None:
            return pb.GetBlockResponse(found=False)
        return pb.GetBlockResponse(
            found=True,
            tiers=[t for t, x in ((pb.TIER_HOST, host), (pb.TIER_DISK, disk)) if x is not None],
            state=e.status.value,
            pins=e.pins,
            hits=e.hits,
            has_parent=e.parent is not None,
            parent=e.parent or 0,
            children=e.children,
        )

    @rpc
    async def Clear(self, request: pb.ClearRequest, context: grpc.aio.ServicerContext) -> pb.ClearResponse:
        if not self.caller(context).admin:
            raise PermissionDenied("Clear drops the blocks of every namespace: it needs an admin token")
        tier = request.tier
        if tier not in (pb.TIER_UNSPECIFIED, pb.TIER_HOST, pb.TIER_DISK):
            raise InvalidRequest(f"tier {tier} is not a tier")
        dropped, kept = self.depot.clear(host=tier != pb.TIER_DISK, disk=tier != pb.TIER_HOST)
        self._pump()
        log.info("clear (%s): dropped %d blocks, kept %d pinned or in flight", pb.Tier.Name(tier), dropped, kept)
        return pb.ClearResponse(dropped_blocks=dropped, kept_blocks=kept)
