"""WorkerLink: a worker rank's side of the wire (rpc WorkerStream, and the doorbell), on threads."""

from __future__ import annotations

import collections
import logging
import os
import queue
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc

from kvdepot import messages as m
from kvdepot.common import ClientCore
from kvdepot.errors import from_rpc_error
from kvdepot.handoff import fetch_arena, hand_over, handoff_path
from kvdepot.v1 import kvdepot_pb2 as pb

log = logging.getLogger("kvdepot")


def _cuda(req: pb.RegisterKvCachesRequest) -> bool:
    return any(s.WhichOneof("handle") == "cuda_driver" for s in req.storages)


def _slots(req: pb.RegisterKvCachesRequest) -> list[Any]:
    """Where the ids of the descriptors handed over go, in their order: each memfd storage, each
    chunk of CUDA virtual memory."""
    out: list[Any] = []
    for s in req.storages:
        which = s.WhichOneof("handle")
        if which == "cpu_shm":
            out.append(s.cpu_shm)
        elif which == "cuda_driver":
            out += list(s.cuda_driver.chunks)
    return out


class WorkerLink:
    """A worker rank's stream, kept open by a background thread that reconnects and re-attaches.

    forward_done() never blocks; poll() returns the events that arrived; wait() blocks up to a timeout.

    When the KV memory is handed over (memfds, a daemon reached at unix:PATH), the link hands over a
    doorbell with it: one end of a unix datagram socket pair, on which the daemon's copy threads
    send each load's op id the moment this rank's part is copied. poll() reports those as
    LoadCopied (and, for a load copied layer by layer, each layer's landing as LayersCopied), ahead
    of the stream's own report (which crosses the daemon's event loop and gRPC's
    threads on both sides, several times slower: docs/performance.md); the stream's reader thread
    rings the same socket with an empty datagram, so waiting is one select() on it either way.
    """

    def __init__(self, client: ClientCore, rank: int) -> None:
        self.client = client
        self.rank = rank
        # A rank that copies its blocks itself (engine_copies): its orders go here, and the engine's
        # host memory (fetched after each registration of its caches) to on_arena(fd, size).
        self.on_orders: Callable[[list[pb.CopyOrder]], None] | None = None
        self.on_arena: Callable[[int, int], None] | None = None
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
        if fds and (handoff_path(self.client.address) is None or len(fds) != len(_slots(req))):
            raise ValueError("descriptors go to a daemon reached at unix:PATH, one per memfd storage or CUDA chunk of the registration")
        if fds and self._bell_in is None and not _cuda(req):  # the copy threads ring it for memory in host RAM
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
            if self._fds:  # handed over again each time: a restarted daemon holds none of them
                bell = [self._bell_out.fileno()] if self._bell_out is not None else []
                cuda = len(self._fds) if _cuda(req) else 0
                ids = hand_over(handoff_path(self.client.address) or "", [*self._fds, *bell], self.client._token, timeout, cuda_fds=cuda)
                for slot, handoff_id in zip(_slots(req), ids):
                    slot.handoff_id = handoff_id
                if bell:
                    req.doorbell_handoff_id = ids[-1]
            if req.engine_copies and self.on_arena is not None:  # each time (a restarted daemon has other memory), before any order
                fd, size = fetch_arena(handoff_path(self.client.address) or "", engine_id, self.client._token, timeout)
                try:
                    self.on_arena(fd, size)
                finally:
                    os.close(fd)
            self.client._stub.RegisterKvCaches(req, timeout=timeout)
        except grpc.RpcError as e:
            if raise_errors and self.client.strict:
                raise from_rpc_error(e, self.client.address) from None
            log.error("kvdepot worker %d: KV caches not registered: %s", self.rank, e.details())
            return False
        self._kv_engine = engine_id
        return True

    def forward_done(self, step: int, cuda_event: Any = None) -> None:
        """The forward of `step` is done (CPU), or will be once `cuda_event` (a torch.cuda.Event made
        with interprocess=True and recorded after the forward) completes: never blocks."""
        self._last_forward = max(self._last_forward, step)
        # Queued even before the daemon answered the attach: the stream sends it right after the
        # attach (a report made only once attached was lost when it came in between). A stream that
        # ends first drops its queue; the next attach reports _last_forward instead. A report
        # twice is harmless: the daemon starts each store once.
        handle = bytes(cuda_event.ipc_handle()) if cuda_event is not None else b""
        self._out.put(pb.WorkerMessage(forward_done=pb.WorkerMessage.ForwardDone(step=step, cuda_event=handle)))

    def copies_done(self, op_id: int, failed: Sequence[int], message: str = "") -> None:
        """An order carried out (engine_copies): never blocks."""
        self._out.put(pb.WorkerMessage(copies_done=pb.WorkerMessage.CopiesDone(op_id=op_id, failed=failed, message=message)))

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
                elif len(data) == 11 and data[8] == 2:
                    out.append(m.LayersCopied(int.from_bytes(data[:8], "little"), int.from_bytes(data[9:], "little")))
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

    def wait(self, done: Callable[[list[m.WorkerEvent]], bool], timeout_s: float, detached_grace_s: float | None = None) -> list[m.WorkerEvent]:
        """Collects events until `done(collected)` or the timeout; returns what was collected. With
        `detached_grace_s`, also gives up once the stream has been down that long (the daemon died
        or was restarted: what it did not report, it will not)."""
        end = time.monotonic() + timeout_s
        got: list[m.WorkerEvent] = []
        detached_since: float | None = None
        while True:
            got += self.poll()
            if done(got):
                return got
            now = time.monotonic()
            if detached_grace_s is not None:
                if self.attached.is_set():
                    detached_since = None
                elif detached_since is None:
                    detached_since = now
                elif now - detached_since > detached_grace_s:
                    return got
            left = end - now
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
            if not engine_id:  # the engine is not registered (yet): it may be any moment (a join waits for its creator)
                time.sleep(0.05)
                continue
            if not self._register_kv(engine_id):
                time.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
                continue
            try:
                self._call = self.client._stub.WorkerStream(self._requests(engine_id))
                for ev in self._call:
                    if ev.HasField("attached"):
                        self.attached.set()
                        backoff = 0.05
                    if ev.orders and self.on_orders is not None:
                        self.on_orders(list(ev.orders))
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
