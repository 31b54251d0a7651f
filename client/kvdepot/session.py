"""The engine path's gRPC stream for the threaded client (rpc Session), with its watchdog."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import grpc

from kvdepot.lane import LocalRpcError
from kvdepot.v1 import kvdepot_pb2 as pb
from kvdepot.v1 import kvdepot_pb2_grpc as pb_grpc

BROKEN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)  # how a session stream that ended answers


def again_on_new_stream(reused: bool, e: grpc.RpcError, deadline: float) -> bool:
    """Whether a failed session call goes once more, on a new stream: only when a stream that was
    already open broke under it, which says nothing about the call (Lookup and Step are both safe
    to repeat; a repeated step is answered the same), and time is left."""
    return reused and e.code() in BROKEN and time.monotonic() < deadline


class Session:
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
                if not again_on_new_stream(reused, e, deadline):
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
