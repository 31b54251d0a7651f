"""The gRPC edge: checks who calls, translates protobuf to runtime and core calls and back, and
plumbs the streams (Session, WorkerStream). No slot logic and no execution lives here: the runtime
(kvdepotd.runtime) runs what the core decides.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from kvdepot.v1 import kvdepot_pb2 as pb
from kvdepot.v1 import kvdepot_pb2_grpc as pb_grpc
from kvdepotd import convert
from kvdepotd.auth import OPEN, Caller, ForeignEngine, PermissionDenied, Tokens, Unauthenticated, bearer
from kvdepotd.core.records import Engine
from kvdepotd.core.errors import DepotError, InvalidRequest
from kvdepotd.core.ops import EngineId, OpId, RequestId
from kvdepotd.errors import status_of
from kvdepotd.handoff import Handoffs, doorbell
from kvdepotd.runtime import Runtime, WorkerChannel, now_ms
from kvdepotd.transfer.engine_copy import EngineCopyRank
from kvdepotd.transfer.mapping import map_rank
from kvdepotd.wire import BadMessage

log = logging.getLogger("kvdepotd")


def key_fingerprint(key: str) -> str:
    """What the log says of an engine key: a connector's key holds its instance's secret."""
    return hashlib.blake2b(key.encode(), digest_size=4).hexdigest() if key else "none"
T = TypeVar("T")
AUDIT_S = 10.0  # a refused token is logged at most this often per method and kind of refusal


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


class DepotService(pb_grpc.BlockManagerServicer):
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.depot = runtime.depot  # read-only here: inspection answers
        self.metrics = runtime.metrics
        # Open Session streams, ended at shutdown: task -> whether it waits for its next request.
        self._sessions: dict[asyncio.Task[Any], bool] = {}
        self._closing = False
        self.lanes: list[str] = []  # the lane addresses (kvdepotd.lane), told to engines as they register
        self.auth: Tokens | None = None  # None: no tokens asked for, every caller may do everything
        self.handoffs: Handoffs | None = None  # descriptors handed over beside unix addresses (kvdepotd.handoff)
        self.shm_paths = True  # False: cpu_shm memory only as handed-over descriptors, never by path
        self.max_rank_bytes = 1 << 62  # most CPU memory one rank may register (max_rank_gib)
        self._refusals: dict[tuple[str, str], tuple[float, int]] = {}  # (method, error) -> (last logged, since)

    async def close(self, grace_s: float = 10.0) -> None:
        await self.runtime.close(grace_s)
        self._closing = True
        await self._end_sessions(grace_s)
        await self.runtime.stop_engines()

    async def _end_sessions(self, grace_s: float) -> None:
        """Ends idle Session streams, which would hold the drain for the whole grace. Each is
        cancelled while it waits for its next request, in its own frame, which answers the cancel
        with UNAVAILABLE. One that is elsewhere (grpc still completing the send of its last answer)
        is left to get there: a cancel landing in grpc's frame ends the task but leaves the call
        open until the grace is over."""
        end = time.monotonic() + grace_s
        while self._sessions and time.monotonic() < end:
            for task, waiting in list(self._sessions.items()):
                if waiting:
                    task.cancel()
            await asyncio.sleep(0.005)

    # -- who calls ---------------------------------------------------------------------------------
    def caller(self, context: Any) -> Caller:
        """Whom the call's token speaks for (a lane's context gives the token of its hello)."""
        auth = self.auth
        return OPEN if auth is None else auth.caller(context.invocation_metadata())

    def own_engine(self, context: Any, engine_id: EngineId) -> Engine:
        """The engine, when the caller may drive it. The token is checked first: a call without a
        valid one learns nothing, not even whether the engine exists."""
        caller = self.caller(context)
        eng = self.depot.engine(engine_id)
        if not caller.may_use(eng.namespace):
            raise ForeignEngine(engine_id, caller)
        return eng

    def refused(self, method: str, e: DepotError, context: Any) -> None:
        """A call refused for its token, in the log for whoever audits the daemon: the first of each
        kind at once, then at most one line per kind every AUDIT_S with the count in between.
        Other errors are the caller's to read, not the operator's: not logged."""
        if not isinstance(e, (Unauthenticated, PermissionDenied, ForeignEngine)):
            return
        key = (method, type(e).__name__)
        now = time.monotonic()
        last, suppressed = self._refusals.get(key, (-AUDIT_S, 0))
        if now - last < AUDIT_S:
            self._refusals[key] = (last, suppressed + 1)
            return
        self._refusals[key] = (now, 0)
        more = f" ({suppressed} more like it since the last line)" if suppressed else ""
        log.warning("refused %s from %s: %s%s", method, context.peer(), getattr(e, "audit", e), more)

    def tokens_changed(self) -> None:
        """Ends the worker streams whose token no longer drives their engine (their forward-done
        reports would keep its lease alive while its scheduler's calls are refused)."""
        for (engine_id, rank), ch in list(self.runtime.channels.items()):
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
        caller = self.caller(context)  # first: a call without a valid token learns nothing
        if not request.HasField("layout"):
            raise InvalidRequest("layout is required")
        namespace = request.namespace if caller.admin else caller.namespace
        if request.namespace and request.namespace != namespace:  # empty: the token's namespace
            raise PermissionDenied(f"namespace {request.namespace!r} is not the namespace of the call's token ({caller.describe()})")
        eng, joined = self.runtime.register_engine(
            EngineId(f"eng-{uuid.uuid4().hex[:12]}"),
            name=request.engine_name,
            model=request.model,
            layout=convert.layout_from_pb(request.layout),
            namespace=namespace,
            style=convert.style_from_pb(request.update_style),
            lease_ms=request.lease_ms,
            key=request.engine_key,
            late_load_checks=request.late_load_checks,
            join=request.join,
            engine_copies=request.engine_copies,
        )
        engine_id = eng.engine_id
        if joined:
            log.info("engine %s joined by another process (name=%r, key %s)", engine_id, request.engine_name, key_fingerprint(request.engine_key))
        else:
            log.info(
                "engine %s registered: name=%r model=%r layout=%s namespace=%r style=%s late_load_checks=%s%s",
                engine_id, eng.name, eng.model, eng.layout.layout_class, eng.namespace, eng.style.value, eng.late_load_checks,
                " (its workers copy its blocks: engine-side copy)" if eng.engine_copies else "",
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
        return pb.HeartbeatResponse(lease_expires_unix_ms=self.runtime.renew_lease(engine_id))

    @rpc
    async def UnregisterEngine(self, request: pb.UnregisterEngineRequest, context: grpc.aio.ServicerContext) -> pb.UnregisterEngineResponse:
        engine_id = self.own_engine(context, EngineId(request.engine_id)).engine_id
        released = self.runtime.unregister_engine(engine_id)
        if released is None:
            log.info("engine %s: one of its processes unregistered; the others keep it", engine_id)
            return pb.UnregisterEngineResponse()
        log.info("engine %s unregistered (%d slots released)", engine_id, released)
        return pb.UnregisterEngineResponse(released_slots=released)

    @rpc
    async def RegisterKvCaches(self, request: pb.RegisterKvCachesRequest, context: grpc.aio.ServicerContext) -> pb.RegisterKvCachesResponse:
        engine_id = self.own_engine(context, EngineId(request.engine_id)).engine_id
        eng = self.depot.engine_rank(engine_id, request.rank)
        if request.engine_copies != eng.engine_copies:
            raise InvalidRequest(
                f"engine {engine_id} registered with engine_copies={eng.engine_copies}: its ranks "
                + ("copy their blocks themselves (engine_copies, no storages)" if eng.engine_copies else "share their KV memory (storages)")
            )
        if request.engine_copies:
            if request.num_blocks == 0 or request.storages:
                raise InvalidRequest("a rank that copies its blocks itself registers num_blocks and no storages")
            self.runtime.add_mapping(EngineCopyRank(engine_id, request.rank, request.num_blocks))
            log.info("engine %s rank %d copies its blocks itself (engine-side copy, %d blocks)", engine_id, request.rank, request.num_blocks)
            return pb.RegisterKvCachesResponse()
        bell = self._doorbell(request, eng.namespace)
        try:
            fds = self._claim(request, eng.namespace)
            try:
                # Mapping validates and maps GiBs of engine memory: off the event loop, so other engines' steps go on.
                mapping = await asyncio.to_thread(map_rank, engine_id, eng.layout, convert.rank_spec(request), fds, self.max_rank_bytes)
            finally:
                for fd in fds.values():
                    os.close(fd)  # a mapping holds its own reference
        except BaseException:
            if bell is not None:
                bell.close()
            raise
        mapping.doorbell = bell
        mapping.layer_rings = bell is not None and request.layer_rings
        self.depot.engine_rank(engine_id, request.rank)  # still registered after the wait
        self.runtime.add_mapping(mapping)
        log.info(
            "engine %s rank %d mapped %d tensors (%d blocks, %.1f MiB) on %s%s",
            engine_id, request.rank, len(request.tensors), mapping.num_blocks, mapping.mapped_bytes / 2**20, mapping.device,
            " (memory handed over)" if fds else "",
        )
        return pb.RegisterKvCachesResponse(mapped_bytes=mapping.mapped_bytes)

    def _claim(self, request: pb.RegisterKvCachesRequest, namespace: str) -> dict[str, int]:
        """The descriptors the request's handoff ids name (the caller closes them), or none."""
        shm = [s.cpu_shm for s in request.storages if s.WhichOneof("handle") == "cpu_shm"]
        if not self.shm_paths and any(not h.handoff_id for h in shm):
            raise InvalidRequest("this daemon takes CPU KV memory only as descriptors handed over on its handoff socket, not by path (shm_paths = false)")
        ids = [(h.handoff_id, False) for h in shm]
        ids += [(k.handoff_id, True) for s in request.storages if s.WhichOneof("handle") == "cuda_driver" for k in s.cuda_driver.chunks]
        fds: dict[str, int] = {}
        try:
            for handoff_id, cuda in ids:
                if handoff_id and handoff_id not in fds:
                    if self.handoffs is None:
                        raise InvalidRequest("this daemon has no handoff socket (it listens on no unix: address): name the memory by path")
                    fds[handoff_id] = self.handoffs.claim(handoff_id, namespace, cuda)
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
        fd = self.handoffs.claim(request.doorbell_handoff_id, namespace)
        if not doorbell(fd):
            os.close(fd)
            raise InvalidRequest(f"doorbell_handoff_id {request.doorbell_handoff_id[:64]!r} names a descriptor that is not a unix datagram socket")
        sock = socket.socket(fileno=fd)
        sock.setblocking(False)
        return sock

    # -- the engine path ------------------------------------------------------------------------
    @rpc
    async def Lookup(self, request: pb.LookupRequest, context: grpc.aio.ServicerContext) -> pb.LookupResponse:
        engine_id = EngineId(request.engine_id)
        if self.auth is not None:
            self.own_engine(context, engine_id)
        res = await self.runtime.lookup(
            engine_id,
            RequestId(request.request_id),
            convert.lookup_tokens(request),
            cache_salt=request.cache_salt,
            lora_name=request.lora_name,
            device_matched_tokens=request.device_matched_tokens,
            pin_ms=request.pin_ms,
        )
        tiers = ((pb.TIER_HOST, res.host_tokens), (pb.TIER_DISK, res.disk_tokens), (pb.TIER_REMOTE, res.remote_tokens))
        by_tier = [pb.TierTokens(tier=t, tokens=n) for t, n in tiers if n]
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
        plan = self.runtime.step(
            engine_id,
            request.step,
            convert.step_columns(request),
            [RequestId(r) for r in request.finished],
            [RequestId(r) for r in request.preempted],
        )
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
        self.runtime.attach(key, ch)
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
            if self.runtime.detach(key, ch):
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
                    self.runtime.forward_done(engine_id, rank, msg.forward_done.step, msg.forward_done.cuda_event)
                elif which == "copies_done":
                    d = msg.copies_done
                    self.runtime.engine_copied(engine_id, rank, OpId(d.op_id), list(d.failed), d.message[:512])
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
        auth = self.auth  # the figures name nobody, but they add up every namespace's traffic
        if auth is not None and not auth.may_scrape(bearer(context.invocation_metadata())):
            raise PermissionDenied(
                f"GetStats reports every namespace's figures together: it needs an admin or a metrics token, not {self.caller(context).describe()}"
            )
        st = self.depot.stats()
        now = now_ms()
        detail = auth is None or auth.is_admin(bearer(context.invocation_metadata()))
        tiers = {"host": pb.TIER_HOST, "disk": pb.TIER_DISK}
        pools = [
            pb.PoolStats(
                layout_class=p.layout_class,
                tier=tiers[p.tier],
                block_bytes=p.block_bytes,
                capacity_blocks=p.capacity_blocks,
                used_blocks=p.used_blocks,
                pinned_blocks=p.pinned_blocks,
                in_flight_blocks=p.in_flight_blocks,
            )
            for p in st.pools
        ]
        rec = self.metrics.recovery
        return pb.GetStatsResponse(
            engines=st.engines,
            slots=st.slots,
            ops_in_flight=st.ops_in_flight,
            pools=pools,
            counters=st.counters,
            host_bytes=st.host_bytes,
            disk_bytes=st.disk_bytes,
            uptime_s=time.time() - self.runtime.started,
            mapped_engine_bytes=self.runtime.copy.mapped_bytes,
            mapped_ranks=len(self.runtime.copy.mappings),
            disk_dir=self.runtime.disk.store.root if self.runtime.disk is not None else "",
            disk_recovered_blocks=rec.blocks,
            disk_recovery_dropped_blocks=rec.dropped,
            disk_recovery_s=rec.seconds,
            remote=self.runtime.remote.store.settings.describe() if self.runtime.remote is not None else "",
            remote_up=self.depot.remote.up,
            remote_queue_blocks=st.remote_queue_blocks,
            remote_jobs=st.remote_jobs,
            oldest_op_age_ms=st.oldest_op_age_ms(now),
            oldest_ops=convert.oldest_ops(self.depot.ops.ops.values(), now, 10) if detail else [],
            recent_failures=[pb.RecentFailure(unix_s=f.unix_s, kind=f.kind, engine_id=f.engine_id, message=f.message) for f in self.runtime.failures]
            if detail else [],
        )

    @rpc
    async def ListEngines(self, request: pb.ListEnginesRequest, context: grpc.aio.ServicerContext) -> pb.ListEnginesResponse:
        caller = self.caller(context)
        return pb.ListEnginesResponse(
            engines=[
                convert.engine_info(e, self.runtime.attached_ranks(e.engine_id))
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
        if tier == pb.TIER_REMOTE:
            raise InvalidRequest(
                "the remote store is shared with other daemons and cleared there, not by one daemon "
                "(delete its keys, PREFIX:*, in the store; docs/remote.md)"
            )
        if tier not in (pb.TIER_UNSPECIFIED, pb.TIER_HOST, pb.TIER_DISK):
            raise InvalidRequest(f"tier {tier} is not a tier")
        dropped, kept = self.runtime.clear(host=tier != pb.TIER_DISK, disk=tier != pb.TIER_HOST)
        log.info("clear (%s): dropped %d blocks, kept %d pinned or in flight", pb.Tier.Name(tier), dropped, kept)
        return pb.ClearResponse(dropped_blocks=dropped, kept_blocks=kept)
