"""DepotClient (threads) and AsyncDepotClient (asyncio): the engine's side of the wire.

Engine-path calls (lookup, step, forward_done) carry a short deadline and never raise or block past
it unless the client is `strict`: when the daemon is down, slow, or has forgotten the engine (it
restarted), they answer "miss / no ops" with `degraded=True`, and a keeper in the background
heartbeats, re-registers and reconnects. Inspection and admin calls raise kvdepot.errors.

Addresses: HOST:PORT, unix:PATH, unix:///abs/path (the forms `kvdepotd --listen` takes).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import select
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

import grpc

from kvdepot import messages as m
from kvdepot.errors import DepotError, NotFound, from_rpc_error
from kvdepot.handoff import hand_over, handoff_path
from kvdepot.lane import AsyncLane, Lane, LocalRpcError
from kvdepot.layout import KvLayout
from kvdepot.tls import Tls, channel
from kvdepot.v1 import kvdepot_pb2 as pb
from kvdepot.v1 import kvdepot_pb2_grpc as pb_grpc

log = logging.getLogger("kvdepot")
DEFAULT_ADDRESS = "127.0.0.1:50061"
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.enable_retries", 0),
]
REJECTION_LOG_S = 30


class _Every:
    """True for a key at most once per period: log lines that would otherwise repeat every step."""

    def __init__(self, period_s: float) -> None:
        self.period_s = period_s
        self._last: dict[object, float] = {}

    def due(self, key: object) -> bool:
        now = time.monotonic()
        if now - self._last.get(key, -self.period_s) < self.period_s:
            return False
        self._last[key] = now
        return True


MISSES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
BROKEN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)  # how a session stream that ended answers


class _Registration:
    """What the client registered, so it can register again after the daemon forgot it."""

    def __init__(self, req: pb.RegisterEngineRequest) -> None:
        self.req = req
        self.engine_id = ""
        self.lease_ms = 30_000
        self.epoch = 0  # bumps each time the daemon gives a new engine id: older slots are gone
        self.block_bytes = 0

    def accept(self, r: pb.RegisterEngineResponse) -> None:
        self.engine_id = r.engine_id
        self.lease_ms = r.lease_ms or self.lease_ms
        self.block_bytes = r.block_bytes
        self.epoch += 1


def _degraded(client: Any, e: grpc.RpcError, what: str) -> None:
    """Decides whether an engine-path failure is a miss (logged, returned) or raised (strict)."""
    code = e.code()
    if client.strict:
        raise from_rpc_error(e) from None
    if code is grpc.StatusCode.NOT_FOUND and client._reg is not None and "is not registered" in (e.details() or ""):
        client._reg.engine_id = ""  # the daemon restarted or our lease expired: the keeper re-registers
    if code in MISSES or code is grpc.StatusCode.NOT_FOUND:
        log.debug("kvdepot %s degraded to a miss: %s", what, code.name)
    elif client._rejections.due((what, code)):  # e.g. a revoked token: every call of every step
        log.error("kvdepot %s rejected (%s): %s; treating it as a miss (said at most every %d s)", what, code.name, e.details(), REJECTION_LOG_S)


def _again_on_new_stream(reused: bool, e: grpc.RpcError, deadline: float) -> bool:
    """Whether a failed session call goes once more, on a new stream: only when a stream that was
    already open broke under it, which says nothing about the call (Lookup and Step are both safe
    to repeat; a repeated step is answered the same), and time is left."""
    return reused and e.code() in BROKEN and time.monotonic() < deadline


class _Session:
    """The engine path's stream (rpc Session): Lookup and Step in one long-lived call, which spares
    each call gRPC's per-call setup. Opened on first use and again after any failure; one call at
    a time (a caller that finds it busy, or a daemon without Session, goes unary). A stream has no
    per-message deadline, so a watchdog thread cancels a call that outlives its own, checking every
    quarter of the client's deadline."""

    def __init__(self, stub: pb_grpc.BlockManagerStub, period_s: float, closed: threading.Event) -> None:
        self._stub = stub
        self._period_s = period_s
        self._closed = closed
        self._busy = threading.Lock()  # held by the one call in flight
        self._guard = threading.Lock()  # orders the watchdog's cancel against a call's end
        self._requests: queue.SimpleQueue[pb.SessionRequest | None] = queue.SimpleQueue()
        self._call: Any = None
        self._waiting: tuple[float, Any] | None = None  # (deadline, call) of the call in flight
        self._expired = False
        self._watchdog: threading.Thread | None = None
        self.supported = True

    def call(self, req: pb.SessionRequest, timeout_s: float) -> pb.SessionResponse | None:
        """The daemon's answer; None when the caller should use the unary call; raises grpc.RpcError."""
        if not self.supported or not self._busy.acquire(blocking=False):
            return None
        try:
            deadline = time.monotonic() + timeout_s
            if self._call is not None and self._call.done():  # ended while idle (the daemon restarted)
                self.reset()
            reused = self._call is not None
            try:
                return self._round_trip(req, deadline, timeout_s)
            except grpc.RpcError as e:
                if not _again_on_new_stream(reused, e, deadline):
                    raise
                return self._round_trip(req, deadline, timeout_s)
        except grpc.RpcError as e:
            if e.code() is grpc.StatusCode.UNIMPLEMENTED:  # a daemon older than Session
                self.supported = False
                return None
            raise
        finally:
            self._busy.release()

    def _round_trip(self, req: pb.SessionRequest, deadline: float, timeout_s: float) -> pb.SessionResponse:
        """One request and its answer on the stream (opened if need be); any failure resets it, and
        one the watchdog caused is DEADLINE_EXCEEDED."""
        if self._call is None:
            self._open()
        call = self._call
        self._expired = False
        self._waiting = (deadline, call)
        self._requests.put(req)
        try:
            return next(call)
        except StopIteration:
            self.reset()
            raise LocalRpcError(grpc.StatusCode.UNAVAILABLE, "the daemon ended the session") from None
        except grpc.RpcError:
            self.reset()
            if self._expired:
                raise LocalRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {timeout_s * 1000:.0f} ms") from None
            raise
        finally:
            with self._guard:
                self._waiting = None
            if self._expired:  # cancelled, even if the answer made it: the stream is done
                self.reset()

    def _open(self) -> None:
        self._requests = queue.SimpleQueue()
        self._call = self._stub.Session(iter(self._requests.get, None))
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, name="kvdepot-session-watchdog", daemon=True)
            self._watchdog.start()

    def _watch(self) -> None:
        while not self._closed.wait(self._period_s):
            with self._guard:
                w = self._waiting
                if w is not None and time.monotonic() > w[0]:
                    self._expired = True
                    w[1].cancel()

    def reset(self) -> None:
        """Ends the stream (the next call opens a new one)."""
        call, self._call = self._call, None
        if call is not None:
            self._requests.put(None)  # lets grpc's request-feeding thread finish
            call.cancel()


class _ClientCore:
    """What the sync and asyncio clients share: settings, registration state, request building
    and the decisions about failures. Subclasses only differ in how they wait."""

    def __init__(self, address: str, deadline_s: float, admin_deadline_s: float, strict: bool, channel: Any) -> None:
        self.address = address
        self.deadline_s = deadline_s
        self.admin_deadline_s = admin_deadline_s
        self.strict = strict
        self._channel = channel
        self._stub = pb_grpc.BlockManagerStub(channel)
        self._reg: _Registration | None = None
        self._step = 0
        self._rejections = _Every(REJECTION_LOG_S)

    @property
    def engine_id(self) -> str:
        return self._reg.engine_id if self._reg else ""

    @property
    def epoch(self) -> int:
        """Registration generation: when it changes, the daemon has no slots of older requests."""
        return self._reg.epoch if self._reg else 0

    @property
    def last_step(self) -> int:
        return self._step

    def _start_registration(
        self, model: str, layout: KvLayout, name: str, namespace: str, update_style: str, lease_ms: int, key: str, late_load_checks: bool
    ) -> None:
        layout.validate()
        self._reg = _Registration(m.register_pb(model, layout, name, namespace, update_style, lease_ms, key, late_load_checks))

    def _registration_failed(self, e: grpc.RpcError, raise_errors: bool) -> bool:
        """False when the daemon did not answer (the keeper retries); raises a rejection when asked."""
        if e.code() in MISSES and not (raise_errors and self.strict):
            return False
        if raise_errors:
            raise from_rpc_error(e) from None
        log.error("kvdepot: registration rejected: %s", e.details())
        return False

    def _heartbeat_failed(self, e: grpc.RpcError) -> None:
        if e.code() is grpc.StatusCode.NOT_FOUND and self._reg is not None:
            log.warning("kvdepot: the daemon forgot engine %s; registering again", self._reg.engine_id)
            self._reg.engine_id = ""
        elif e.code() not in MISSES and self._rejections.due(("heartbeat", e.code())):
            log.error("kvdepot: heartbeat rejected (%s): %s", e.code().name, e.details())

    def _lookup_request(
        self, request_id: str, tokens: Sequence[int], L: int, cache_salt: str, lora_name: str, pin_ms: int
    ) -> pb.LookupRequest | None:
        if not self.engine_id:
            return None
        return m.lookup_pb(self.engine_id, request_id, tokens, L, cache_salt, lora_name, pin_ms)

    def _step_request(self, batch: m.StepBatch) -> pb.StepRequest | m.StepResult:
        """The next step's request, or its result when no round trip is needed: an empty step needs
        no answer, and an unregistered engine gets a miss (the number is used up either way, so
        forward-done reports stay in step with the engine)."""
        self._step += 1
        if batch.empty or not self.engine_id:
            return m.StepResult(self._step, degraded=not self.engine_id)
        return batch.to_pb(self.engine_id, self._step)

    def _unregister_request(self) -> pb.UnregisterEngineRequest | None:
        if self._reg is None or not self._reg.engine_id:
            return None
        eid, self._reg = self._reg.engine_id, None
        return pb.UnregisterEngineRequest(engine_id=eid)


class DepotClient(_ClientCore):
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
        super().__init__(address, deadline_s, admin_deadline_s, strict, channel(address, tls, CHANNEL_OPTIONS, token=token))
        self._closed = threading.Event()
        self._keeper: threading.Thread | None = None
        self._workers: list[WorkerLink] = []
        self._token = token  # for the handoff socket, which carries no metadata
        self._session = _Session(self._stub, deadline_s / 4, self._closed)
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
    ) -> str:
        """Registers the engine and starts the keeper. Returns the engine id, or "" when the daemon
        did not answer (the keeper keeps trying; engine-path calls are misses until then).

        Processes of one engine (a scheduler and its workers) pass the same `engine_key` and share
        one engine id. `late_load_checks`: the engine can take a load's failure after the step that
        used the blocks and discard that step's output (vLLM can); its loads then report LoadCopied
        before their checksums are checked, and OpCompleted after."""
        self._start_registration(model, layout, name, namespace, update_style, lease_ms, engine_key, late_load_checks)
        self._try_register(raise_errors=True)
        if self._keeper is None:
            self._keeper = threading.Thread(target=self._keep, name="kvdepot-keeper", daemon=True)
            self._keeper.start()
        return self.engine_id

    def _try_register(self, raise_errors: bool = False) -> bool:
        assert self._reg is not None
        try:
            r = self._stub.RegisterEngine(self._reg.req, timeout=max(self.deadline_s, 1.0))
            self._reg.accept(r)
            self._lane.configure(r.lanes)
            log.info("kvdepot: engine registered as %s at %s", self._reg.engine_id, self.address)
            return True
        except grpc.RpcError as e:
            return self._registration_failed(e, raise_errors)

    def _keep(self) -> None:
        next_beat = 0.0
        while not self._closed.wait(0.2):
            reg = self._reg
            if reg is None:
                continue
            if not reg.engine_id:
                self._try_register()
                next_beat = time.monotonic() + reg.lease_ms / 3000
            elif time.monotonic() >= next_beat:
                next_beat = time.monotonic() + reg.lease_ms / 3000
                try:
                    self._stub.Heartbeat(pb.HeartbeatRequest(engine_id=reg.engine_id), timeout=1.0)
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
        if req is None:
            return m.MISS
        timeout_s = timeout_s or self.deadline_s
        try:
            if (r := self._engine_call(pb.SessionRequest(lookup=req), timeout_s)) is not None:
                return m.lookup_result(r.lookup)
            return m.lookup_result(self._stub.Lookup(req, timeout=timeout_s))
        except grpc.RpcError as e:
            _degraded(self, e, "lookup")
            return m.MISS

    def step(self, batch: m.StepBatch) -> m.StepResult:
        """Sends one engine step. Step numbers are the client's own and strictly increase."""
        req = self._step_request(batch)
        if isinstance(req, m.StepResult):
            return req
        try:
            if (r := self._engine_call(pb.SessionRequest(step=req), self.deadline_s)) is not None:
                return m.step_result(r.step)
            return m.step_result(self._stub.Step(req, timeout=self.deadline_s))
        except grpc.RpcError as e:
            _degraded(self, e, "step")
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
            raise from_rpc_error(e) from None

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
        self._closed.set()
        self._session.reset()
        self._lane.close()
        for w in self._workers:
            w.close()
        self._channel.close()

    def __enter__(self) -> DepotClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class WorkerLink:
    """A worker rank's stream, kept open by a background thread that reconnects and re-attaches.

    forward_done() never blocks; poll() returns the events that arrived; wait() blocks up to a timeout.

    When the KV memory is handed over (memfds, a daemon reached at unix:PATH), the link hands over a
    doorbell with it: one end of a unix datagram socket pair, on which the daemon's copy threads
    send each load's op id the moment this rank's part is copied. poll() reports those as
    LoadCopied, ahead of the stream's own report (which crosses the daemon's event loop and gRPC's
    threads on both sides: 1.3 - 4.7 ms on two cores beside a vLLM step, against 0.1 - 0.4 for the
    doorbell); the stream's reader thread rings the same socket with an empty datagram, so waiting
    is one select() on it either way.
    """

    def __init__(self, client: DepotClient, rank: int) -> None:
        self.client = client
        self.rank = rank
        self._out: queue.SimpleQueue[pb.WorkerMessage | None] = queue.SimpleQueue()
        self._events: collections.deque[m.WorkerEvent] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._last_forward = -1
        self.attached = threading.Event()
        self._call: Any = None
        self._kv: pb.RegisterKvCachesRequest | None = None
        self._fds: list[int] = []
        self._kv_engine = ""  # the engine id the KV caches were last registered under
        self._bell_in: socket.socket | None = None  # the doorbell's ends (see the class docstring)
        self._bell_out: socket.socket | None = None
        self._thread = threading.Thread(target=self._run, name=f"kvdepot-worker-{rank}", daemon=True)
        self._thread.start()

    def register_kv_caches(self, req: pb.RegisterKvCachesRequest, fds: Sequence[int] = ()) -> bool:
        """Hands this rank's KV tensors (kvdepot.handles) to the daemon, now and again after every
        re-registration of the engine. `fds`: the memfds of share_cpu_tensors_memfd, one per
        storage, handed over on the daemon's handoff socket each time (the client must reach the
        daemon at unix:PATH; the link keeps them open). False when the daemon refused them or is
        not reachable yet (the link keeps trying); an error instead when the client is strict."""
        if fds and (handoff_path(self.client.address) is None or len(fds) != len(req.storages)):
            raise ValueError("descriptors go to a daemon reached at unix:PATH, one per storage of the registration")
        if fds and self._bell_in is None:
            self._bell_in, self._bell_out = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._bell_in.setblocking(False)
            self._bell_out.setblocking(False)
        self._kv, self._fds = req, list(fds)
        return self._register_kv(self.client.engine_id, raise_errors=True)

    def _register_kv(self, engine_id: str, raise_errors: bool = False) -> bool:
        if self._kv is None or (engine_id and self._kv_engine == engine_id):
            return True
        if not engine_id:
            return False  # the engine is not registered yet: the link registers the tensors later
        req = pb.RegisterKvCachesRequest()
        req.CopyFrom(self._kv)
        req.engine_id, req.rank = engine_id, self.rank
        timeout = max(self.client.admin_deadline_s, 5.0)
        try:
            if self._bell_out is not None:  # handed over again each time: a restarted daemon holds none of them
                ids = hand_over(handoff_path(self.client.address) or "", [*self._fds, self._bell_out.fileno()], self.client._token, timeout)
                for storage, handoff_id in zip(req.storages, ids):
                    storage.cpu_shm.handoff_id = handoff_id
                req.doorbell_handoff_id = ids[-1]
            self.client._stub.RegisterKvCaches(req, timeout=timeout)
        except grpc.RpcError as e:
            if raise_errors and self.client.strict:
                raise from_rpc_error(e) from None
            log.error("kvdepot worker %d: KV caches not registered: %s", self.rank, e.details())
            return False
        self._kv_engine = engine_id
        return True

    def forward_done(self, step: int, cuda_event: Any = None) -> None:
        """The forward of `step` is done (CPU), or will be once `cuda_event` (a torch.cuda.Event made
        with interprocess=True and recorded after the forward) completes: never blocks."""
        self._last_forward = max(self._last_forward, step)
        if self.attached.is_set():
            handle = bytes(cuda_event.ipc_handle()) if cuda_event is not None else b""
            self._out.put(pb.WorkerMessage(forward_done=pb.WorkerMessage.ForwardDone(step=step, cuda_event=handle)))

    def poll(self) -> list[m.WorkerEvent]:
        out: list[m.WorkerEvent] = []
        if self._bell_in is not None:  # first: the doorbell rang before the stream's reports were made
            while True:
                try:
                    data = self._bell_in.recv(64)
                except OSError:  # BlockingIOError: nothing more
                    break
                if len(data) == 9:
                    out.append(m.LoadCopied(int.from_bytes(data[:8], "little"), intact=data[8] == 1))
        with self._cond:
            out += self._events
            self._events.clear()
        return out

    def wait_for_events(self, timeout_s: float) -> bool:
        """Blocks until events are waiting (poll() takes them) or the timeout passes."""
        if self._bell_in is not None:
            with self._cond:
                if self._events:
                    return True
            return bool(select.select([self._bell_in], [], [], timeout_s)[0])
        with self._cond:
            if not self._events:
                self._cond.wait(timeout_s)
            return bool(self._events)

    def wait(self, done: Callable[[list[m.WorkerEvent]], bool], timeout_s: float) -> list[m.WorkerEvent]:
        """Collects events until `done(collected)` or the timeout; returns what was collected."""
        end = time.monotonic() + timeout_s
        got: list[m.WorkerEvent] = []
        while True:
            got += self.poll()
            if done(got):
                return got
            left = end - time.monotonic()
            if left <= 0:
                return got
            self.wait_for_events(min(left, 0.05))

    def close(self) -> None:
        self._closed = True
        self._out.put(None)
        if self._call is not None:
            self._call.cancel()
        for bell in (self._bell_in, self._bell_out):
            if bell is not None:
                bell.close()

    def _ring(self) -> None:
        """Wakes a wait_for_events() blocked on the doorbell (a full socket is awake already)."""
        if self._bell_out is not None:
            try:
                self._bell_out.send(b"")
            except OSError:
                pass

    def _requests(self, engine_id: str) -> Iterator[pb.WorkerMessage]:
        yield pb.WorkerMessage(attach=pb.WorkerMessage.Attach(engine_id=engine_id, rank=self.rank))
        if self._last_forward >= 0:  # stores waiting on a forward we reported while disconnected
            yield pb.WorkerMessage(forward_done=pb.WorkerMessage.ForwardDone(step=self._last_forward))
        while True:
            msg = self._out.get()
            if msg is None or self._closed:
                return
            yield msg

    def _run(self) -> None:
        backoff = 0.05
        while not self._closed:
            engine_id = self.client.engine_id
            if not engine_id or not self._register_kv(engine_id):
                time.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
                continue
            try:
                self._call = self.client._stub.WorkerStream(self._requests(engine_id))
                for ev in self._call:
                    if ev.HasField("attached"):
                        self.attached.set()
                        backoff = 0.05
                    batch = m.worker_events(ev)
                    if batch:
                        with self._cond:
                            self._events += batch
                            self._cond.notify_all()
                        self._ring()
            except grpc.RpcError as e:
                if self._closed:
                    return
                log.debug("kvdepot worker %d stream ended: %s", self.rank, e.code())
            finally:
                self.attached.clear()
                self._out.put(None)  # end the old request iterator
                self._out = queue.SimpleQueue()
            time.sleep(backoff)
            backoff = min(backoff * 2, 1.0)


class AsyncDepotClient(_ClientCore):
    """The asyncio twin of DepotClient (same semantics: deadlines, degrade to miss, keeper task)."""

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
        super().__init__(address, deadline_s, admin_deadline_s, strict, channel(address, tls, CHANNEL_OPTIONS, aio=True, token=token))
        self._keeper: asyncio.Task[None] | None = None
        self._session: Any = None  # the engine path's stream, as in DepotClient's _Session
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
    ) -> str:
        self._start_registration(model, layout, name, namespace, update_style, lease_ms, engine_key, late_load_checks)
        await self._try_register(raise_errors=True)
        if self._keeper is None:
            self._keeper = asyncio.get_running_loop().create_task(self._keep())
        return self.engine_id

    async def _try_register(self, raise_errors: bool = False) -> bool:
        assert self._reg is not None
        try:
            r = await self._stub.RegisterEngine(self._reg.req, timeout=max(self.deadline_s, 1.0))
            self._reg.accept(r)
            self._lane.configure(r.lanes)
            return True
        except grpc.RpcError as e:
            return self._registration_failed(e, raise_errors)

    async def _keep(self) -> None:
        next_beat = 0.0
        while True:
            await asyncio.sleep(0.2)
            reg = self._reg
            if reg is None:
                continue
            if not reg.engine_id:
                await self._try_register()
                next_beat = time.monotonic() + reg.lease_ms / 3000
            elif time.monotonic() >= next_beat:
                next_beat = time.monotonic() + reg.lease_ms / 3000
                try:
                    await self._stub.Heartbeat(pb.HeartbeatRequest(engine_id=reg.engine_id), timeout=1.0)
                except grpc.RpcError as e:
                    self._heartbeat_failed(e)

    async def lookup(
        self, request_id: str, tokens: Sequence[int], *, device_matched_tokens: int = 0, cache_salt: str = "", lora_name: str = "", pin_ms: int = 0
    ) -> m.LookupResult:
        req = self._lookup_request(request_id, tokens, device_matched_tokens, cache_salt, lora_name, pin_ms)
        if req is None:
            return m.MISS
        try:
            if (r := await self._session_call(pb.SessionRequest(lookup=req))) is not None:
                return m.lookup_result(r.lookup)
            return m.lookup_result(await self._stub.Lookup(req, timeout=self.deadline_s))
        except grpc.RpcError as e:
            _degraded(self, e, "lookup")
            return m.MISS

    async def step(self, batch: m.StepBatch) -> m.StepResult:
        req = self._step_request(batch)
        if isinstance(req, m.StepResult):
            return req
        try:
            if (r := await self._session_call(pb.SessionRequest(step=req))) is not None:
                return m.step_result(r.step)
            return m.step_result(await self._stub.Step(req, timeout=self.deadline_s))
        except grpc.RpcError as e:
            _degraded(self, e, "step")
            return m.StepResult(self._step, degraded=True)

    async def _session_call(self, req: pb.SessionRequest) -> pb.SessionResponse | None:
        """The answer on the lane or else the session stream; None when the caller should go unary
        (busy, or a daemon without Session); raises grpc.RpcError. As DepotClient's _Session.call: a
        stream that ended while idle is replaced, and one that breaks as the call goes out gets it
        once more (_again_on_new_stream)."""
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
                    if not _again_on_new_stream(reused, e, deadline):
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
            raise from_rpc_error(e) from None
        finally:
            call.cancel()

    async def _admin(self, method: str, req: Any) -> Any:
        try:
            return await getattr(self._stub, method)(req, timeout=self.admin_deadline_s)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

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
        if self._keeper is not None:
            self._keeper.cancel()
        if self._session is not None:
            self._session.cancel()
        self._lane.close()
        await self._channel.close()


__all__ = ["AsyncDepotClient", "DepotClient", "DepotError", "NotFound", "WorkerLink"]
