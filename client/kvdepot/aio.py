"""AsyncDepotClient: DepotClient's asyncio twin (kvdepot.client has the contract)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc

from kvdepot import messages as m
from kvdepot.common import CHANNEL_OPTIONS, DEFAULT_ADDRESS, ClientCore, degraded
from kvdepot.errors import from_rpc_error
from kvdepot.lane import AsyncLane, LocalRpcError
from kvdepot.layout import KvLayout
from kvdepot.session import again_on_new_stream
from kvdepot.tls import Tls, channel
from kvdepot.v1 import kvdepot_pb2 as pb

log = logging.getLogger("kvdepot")


class AsyncDepotClient(ClientCore):
    """The asyncio twin of DepotClient (same semantics: deadlines, degrade to miss, keeper task; the
    requests, the keeper's decisions and the failure rules are ClientCore's)."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        deadline_s: float = 0.1,
        admin_deadline_s: float = 10.0,
        strict: bool = False,
        session: bool = True,
        lane: bool = True,
        tls: Tls | None = None,
        token: str = "",
    ) -> None:
        super().__init__(address, deadline_s, admin_deadline_s, strict, channel(address, tls, CHANNEL_OPTIONS, aio=True, token=token), token)
        self._keeper: asyncio.Task[None] | None = None
        self._session: Any = None  # the engine path's stream, as in DepotClient's Session
        self._session_busy = asyncio.Lock()
        self._session_supported = session
        self._lane = AsyncLane(address, enabled=lane and session, token=token, tls=tls.ssl_context() if tls is not None else None)

    async def register_engine(
        self,
        model: str,
        layout: KvLayout,
        *,
        name: str = "",
        namespace: str = "",
        update_style: str = "vllm",
        lease_ms: int = 0,
        engine_key: str = "",
        late_load_checks: bool = False,
        keep_trying: bool = False,
        join: bool = False,
        engine_copies: bool = False,
    ) -> str:
        """As DepotClient.register_engine."""
        self._start_registration(model, layout, name, namespace, update_style, lease_ms, engine_key, late_load_checks, join, engine_copies)
        await self._try_register(raise_errors=True, keep_trying=keep_trying)
        if self._keeper is None:
            self._keeper = asyncio.get_running_loop().create_task(self._keep())
        return self.engine_id

    async def _try_register(self, raise_errors: bool = False, keep_trying: bool = True) -> bool:
        assert self._reg is not None
        try:
            r = await self._stub.RegisterEngine(self._reg.req, timeout=max(self.deadline_s, 1.0))
            self._reg.accept(r)
            self._lane.configure(r.lanes)
            return True
        except grpc.RpcError as e:
            return self._registration_failed(e, raise_errors, keep_trying)

    async def _keep(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            due = self._keeper_due()
            if due == "register":
                await self._try_register()
            elif due is not None:
                try:
                    await self._stub.Heartbeat(due, timeout=1.0)
                except grpc.RpcError as e:
                    self._heartbeat_failed(e)

    async def lookup(
        self, request_id: str, tokens: Sequence[int], *, device_matched_tokens: int = 0, cache_salt: str = "", lora_name: str = "", pin_ms: int = 0
    ) -> m.LookupResult:
        req = self._lookup_request(request_id, tokens, device_matched_tokens, cache_salt, lora_name, pin_ms)
        if req is None or self._quiet():
            return m.MISS
        try:
            r = await self._session_call(pb.SessionRequest(lookup=req))
            got = m.lookup_result(r.lookup if r is not None else await self._stub.Lookup(req, timeout=self.deadline_s))
            self._late = 0
            return got
        except grpc.RpcError as e:
            degraded(self, e, "lookup")
            return m.MISS

    async def step(self, batch: m.StepBatch) -> m.StepResult:
        req = self._step_request(batch)
        if isinstance(req, m.StepResult):
            return req
        if self._quiet():
            return m.StepResult(self._step, degraded=True)
        try:
            r = await self._session_call(pb.SessionRequest(step=req))
            res = m.step_result(r.step if r is not None else await self._stub.Step(req, timeout=self.deadline_s))
            self._late = 0
            return res
        except grpc.RpcError as e:
            degraded(self, e, "step")
            return m.StepResult(self._step, degraded=True)

    async def _session_call(self, req: pb.SessionRequest) -> pb.SessionResponse | None:
        """The answer on the lane or else the session stream; None when the caller should go unary
        (busy, or a daemon without Session); raises grpc.RpcError. As DepotClient's Session.call: a
        stream that ended while idle is replaced, and one that breaks as the call goes out gets it
        once more (again_on_new_stream)."""
        if (r := await self._lane.call(req, self.deadline_s)) is not None:
            return r
        if not self._session_supported or self._session_busy.locked():
            return None
        async with self._session_busy:
            if self._session is not None and self._session.done():
                self._session = None
            reused = self._session is not None
            deadline = time.monotonic() + self.deadline_s
            try:
                try:
                    return await self._session_round_trip(req, deadline)
                except grpc.RpcError as e:
                    if not again_on_new_stream(reused, e, deadline):
                        raise
                    return await self._session_round_trip(req, deadline)
            except grpc.RpcError as e:
                if e.code() is grpc.StatusCode.UNIMPLEMENTED:
                    self._session_supported = False
                    return None
                raise

    async def _session_round_trip(self, req: pb.SessionRequest, deadline: float) -> pb.SessionResponse:
        if self._session is None:
            self._session = self._stub.Session()
        call = self._session

        async def round_trip() -> Any:
            await call.write(req)
            return await call.read()

        try:
            r = await asyncio.wait_for(round_trip(), max(deadline - time.monotonic(), 0.001))
            if r is grpc.aio.EOF:
                raise LocalRpcError(grpc.StatusCode.UNAVAILABLE, "the daemon ended the session")
            return r
        except (grpc.RpcError, asyncio.TimeoutError) as e:
            self._session = None
            call.cancel()
            if isinstance(e, asyncio.TimeoutError):
                raise LocalRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {self.deadline_s * 1000:.0f} ms") from None
            raise

    async def worker_events(self, rank: int, forward_done: asyncio.Queue[int]) -> AsyncIterator[m.WorkerEvent]:
        """One attach of rank `rank`: steps put on `forward_done` are reported; events are yielded.
        Ends (raising kvdepot.errors) when the stream breaks; the caller decides whether to re-attach."""

        async def requests() -> AsyncIterator[pb.WorkerMessage]:
            yield pb.WorkerMessage(attach=pb.WorkerMessage.Attach(engine_id=self.engine_id, rank=rank))
            while True:
                step = await forward_done.get()
                yield pb.WorkerMessage(forward_done=pb.WorkerMessage.ForwardDone(step=step))

        call = self._stub.WorkerStream(requests())
        try:
            async for ev in call:
                for e in m.worker_events(ev):
                    yield e
        except grpc.RpcError as e:
            raise from_rpc_error(e, self.address) from None
        finally:
            call.cancel()

    async def _admin(self, method: str, req: Any) -> Any:
        try:
            return await getattr(self._stub, method)(req, timeout=self.admin_deadline_s)
        except grpc.RpcError as e:
            raise from_rpc_error(e, self.address) from None

    async def stats(self) -> pb.GetStatsResponse:
        return await self._admin("GetStats", pb.GetStatsRequest())

    async def who_am_i(self) -> pb.WhoAmIResponse:
        return await self._admin("WhoAmI", pb.WhoAmIRequest())

    async def engines(self) -> list[pb.EngineInfo]:
        return list((await self._admin("ListEngines", pb.ListEnginesRequest())).engines)

    async def slots(self, engine_id: str | None = None) -> list[pb.SlotSummary]:
        return list((await self._admin("ListSlots", pb.ListSlotsRequest(engine_id=engine_id or self.engine_id))).slots)

    async def slot(self, request_id: str, engine_id: str | None = None) -> pb.GetSlotResponse:
        return await self._admin("GetSlot", pb.GetSlotRequest(engine_id=engine_id or self.engine_id, request_id=request_id))

    async def block(self, block_hash: int, engine_id: str | None = None) -> pb.GetBlockResponse:
        return await self._admin("GetBlock", pb.GetBlockRequest(engine_id=engine_id or self.engine_id, hash=block_hash))

    async def clear(self, tier: str = "") -> pb.ClearResponse:
        return await self._admin("Clear", m.clear_request(tier))

    async def unregister(self) -> None:
        if (req := self._unregister_request()) is not None:
            await self._admin("UnregisterEngine", req)

    async def close(self) -> None:
        """As DepotClient.close: unregisters the engine, then closes every connection."""
        if self._keeper is not None:
            self._keeper.cancel()
        if (req := self._unregister_request()) is not None:
            try:
                await self._stub.UnregisterEngine(req, timeout=1.0)
            except grpc.RpcError as e:
                log.debug("kvdepot: unregister at close: %s", e.code().name)
        if self._session is not None:
            self._session.cancel()
        self._lane.close()
        await self._channel.close()
