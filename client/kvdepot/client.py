"""DepotClient: the engine's side of the wire, on threads (AsyncDepotClient in kvdepot.aio is the
asyncio twin; WorkerLink in kvdepot.worker is a worker rank's stream).

Engine-path calls (lookup, step, forward_done) carry a short deadline and never raise or block past
it unless the client is `strict`: when the daemon is down, slow, or has forgotten the engine (it
restarted), they answer "miss / no ops" with `degraded=True`, and a keeper in the background
heartbeats, re-registers and reconnects. Inspection and admin calls raise kvdepot.errors.

Addresses: HOST:PORT, unix:PATH, unix:///abs/path (the forms `kvdepotd --listen` takes).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import grpc

from kvdepot import messages as m
from kvdepot.common import CHANNEL_OPTIONS, DEFAULT_ADDRESS, ClientCore, degraded
from kvdepot.errors import from_rpc_error
from kvdepot.lane import Lane
from kvdepot.layout import KvLayout
from kvdepot.session import Session
from kvdepot.tls import Tls, channel
from kvdepot.v1 import kvdepot_pb2 as pb
from kvdepot.worker import WorkerLink

log = logging.getLogger("kvdepot")


class DepotClient(ClientCore):
    """Synchronous client; safe to share between threads."""

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
        """Lookups and steps go on the daemon's lane (a plain framed socket, kvdepot.lane) when
        `lane` and the daemon has one, else on one long-lived gRPC stream (rpc Session), which
        saves gRPC's per-call setup; `session=False` sends each as its own unary call. `tls`
        (kvdepot.tls.Tls) makes the channel to a TCP address a TLS one, and the lane with it.
        `token`: for a daemon that asks for one (kvdepotd --auth-file; see
        kvdepot.auth.read_token); every call carries it. Raises ValueError for TLS files that
        cannot be read."""
        super().__init__(address, deadline_s, admin_deadline_s, strict, channel(address, tls, CHANNEL_OPTIONS, token=token), token)
        self._closed = threading.Event()
        self._keeper: threading.Thread | None = None
        self._workers: list[WorkerLink] = []
        self._session = Session(self._stub, deadline_s / 4, self._closed)
        self._session.supported = session
        self._lane = Lane(address, enabled=lane and session, token=token, tls=tls.ssl_context() if tls is not None else None)

    # -- engine registration -------------------------------------------------------------------
    def register_engine(
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
        """Registers the engine and starts the keeper; returns the engine id. A daemon that does not
        answer raises kvdepot.errors.Unavailable naming the address, unless `keep_trying` (an
        engine that must go on without the cache): then a warning says so, the answer is "", the
        keeper registers the engine once the daemon answers, and engine-path calls are misses until
        then.

        Processes of one engine (a scheduler and its workers) pass the same `engine_key` and share
        one engine id; with `join` this registration only joins the live engine of that key (NOT_FOUND
        when there is none; the keeper tries again, as after a daemon restart its creator may not
        have registered again yet). `engine_copies`: the engine's workers copy its blocks
        themselves (kvdepot.engine_copy). `late_load_checks`: the engine can take a load's failure after the step that
        used the blocks and discard that step's output (vLLM can); its loads then report LoadCopied
        before their checksums are checked, and OpCompleted after."""
        self._start_registration(model, layout, name, namespace, update_style, lease_ms, engine_key, late_load_checks, join, engine_copies)
        self._try_register(raise_errors=True, keep_trying=keep_trying)
        if self._keeper is None:
            self._keeper = threading.Thread(target=self._keep, name="kvdepot-keeper", daemon=True)
            self._keeper.start()
        return self.engine_id

    def _try_register(self, raise_errors: bool = False, keep_trying: bool = True) -> bool:
        assert self._reg is not None
        try:
            r = self._stub.RegisterEngine(self._reg.req, timeout=max(self.deadline_s, 1.0))
            self._reg.accept(r)
            self._lane.configure(r.lanes)
            log.info("kvdepot: engine registered as %s at %s", self._reg.engine_id, self.address)
            return True
        except grpc.RpcError as e:
            return self._registration_failed(e, raise_errors, keep_trying)

    def _keep(self) -> None:
        while not self._closed.wait(0.2):
            due = self._keeper_due()
            if due == "register":
                self._try_register()
            elif due is not None:
                try:
                    self._stub.Heartbeat(due, timeout=1.0)
                except grpc.RpcError as e:
                    self._heartbeat_failed(e)

    # -- the engine path -----------------------------------------------------------------------
    def lookup(
        self,
        request_id: str,
        tokens: Sequence[int],
        *,
        device_matched_tokens: int = 0,
        cache_salt: str = "",
        lora_name: str = "",
        pin_ms: int = 0,
        timeout_s: float | None = None,
    ) -> m.LookupResult:
        """E: the tokens beyond the engine's own hit the daemon can load, pinned for the request;
        a miss with degraded=True when the daemon does not answer within timeout_s (deadline_s)."""
        req = self._lookup_request(request_id, tokens, device_matched_tokens, cache_salt, lora_name, pin_ms)
        if req is None or self._quiet():
            return m.MISS
        timeout_s = timeout_s or self.deadline_s
        try:
            r = self._engine_call(pb.SessionRequest(lookup=req), timeout_s)
            got = m.lookup_result(r.lookup if r is not None else self._stub.Lookup(req, timeout=timeout_s))
            self._late = 0
            return got
        except grpc.RpcError as e:
            degraded(self, e, "lookup")
            return m.MISS

    def step(self, batch: m.StepBatch) -> m.StepResult:
        """Sends one engine step. Step numbers are the client's own and strictly increase."""
        req = self._step_request(batch)
        if isinstance(req, m.StepResult):
            return req
        if self._quiet():
            return m.StepResult(self._step, degraded=True)
        try:
            r = self._engine_call(pb.SessionRequest(step=req), self.deadline_s)
            res = m.step_result(r.step if r is not None else self._stub.Step(req, timeout=self.deadline_s))
            self._late = 0
            return res
        except grpc.RpcError as e:
            degraded(self, e, "step")
            return m.StepResult(self._step, degraded=True)

    def _engine_call(self, req: pb.SessionRequest, timeout_s: float) -> pb.SessionResponse | None:
        """The answer over the lane, else the session stream; None: make it a unary call."""
        r = self._lane.call(req, timeout_s)
        return r if r is not None else self._session.call(req, timeout_s)

    def worker(self, rank: int = 0) -> WorkerLink:
        """The worker side of rank `rank`: forward-done out, op completions in (one stream, kept open)."""
        link = WorkerLink(self, rank)
        self._workers.append(link)
        return link

    # -- inspection and admin (these raise) ---------------------------------------------------------
    def _admin(self, method: str, req: Any) -> Any:
        try:
            return getattr(self._stub, method)(req, timeout=self.admin_deadline_s)
        except grpc.RpcError as e:
            raise from_rpc_error(e, self.address) from None

    def stats(self) -> pb.GetStatsResponse:
        return self._admin("GetStats", pb.GetStatsRequest())

    def who_am_i(self) -> pb.WhoAmIResponse:
        """Whether the daemon asks for tokens, and the namespace (or admin) this client's token is for."""
        return self._admin("WhoAmI", pb.WhoAmIRequest())

    def engines(self) -> list[pb.EngineInfo]:
        return list(self._admin("ListEngines", pb.ListEnginesRequest()).engines)

    def slots(self, engine_id: str | None = None) -> list[pb.SlotSummary]:
        return list(self._admin("ListSlots", pb.ListSlotsRequest(engine_id=engine_id or self.engine_id)).slots)

    def slot(self, request_id: str, engine_id: str | None = None) -> pb.GetSlotResponse:
        return self._admin("GetSlot", pb.GetSlotRequest(engine_id=engine_id or self.engine_id, request_id=request_id))

    def block(self, block_hash: int, engine_id: str | None = None) -> pb.GetBlockResponse:
        return self._admin("GetBlock", pb.GetBlockRequest(engine_id=engine_id or self.engine_id, hash=block_hash))

    def clear(self, tier: str = "") -> pb.ClearResponse:
        """Drops every block that is neither pinned nor in flight, in one tier ("host", "disk") or all."""
        return self._admin("Clear", m.clear_request(tier))

    def unregister(self) -> None:
        if (req := self._unregister_request()) is not None:
            self._admin("UnregisterEngine", req)

    def close(self) -> None:
        """Unregisters the engine (its slots, pins and ops end now, not at its lease's expiry;
        another process of the same engine_key keeps it), then closes every connection."""
        self._closed.set()
        for w in self._workers:
            w.close()
        if (req := self._unregister_request()) is not None:
            try:
                self._stub.UnregisterEngine(req, timeout=1.0)
            except grpc.RpcError as e:
                log.debug("kvdepot: unregister at close: %s", e.code().name)
        self._session.reset()
        self._lane.close()
        self._channel.close()

    def __enter__(self) -> DepotClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["DEFAULT_ADDRESS", "DepotClient", "WorkerLink"]
