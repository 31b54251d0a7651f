"""The handoff socket: engine workers hand the daemon file descriptors of their KV memory.

A worker that reaches the daemon at unix:PATH keeps its CPU KV tensors in memfds and sends the
descriptors over unix:PATH.handoff (SCM_RIGHTS); RegisterKvCaches then names them by the ids the
daemon answered. It may hand over its doorbell too, a unix datagram socket on which the copy
threads announce each load the moment its bytes are in (kvdepotd.transfer.host). The daemon maps
memory it was given, not a file it opened by name, so:
- engine and daemon may run as different users, in containers that share no /dev/shm;
- a worker can only hand over memory it holds itself (a path names any file of the daemon's user);
- the memfds are sealed against shrinking (checked here), so an engine cannot truncate memory the
  daemon copies into, which would kill the daemon with SIGBUS; a /dev/shm file can be truncated;
- nothing is left in /dev/shm when an engine is killed, and /dev/shm's size limit does not apply.

Wire format (see HandoffRequest in the proto): frames as on the lane, a request carries its
descriptors in the same sendmsg, one answer per request. Connections are rare (one per worker
registration) and short: each is served on its own thread, with a timeout, off the event loop.

    Handoffs(tokens)          tokens(): the daemon's current Tokens, or None without an auth_file
    .listen(grpc_address)     opens unix:PATH.handoff beside a unix:PATH address; returns its address
    .claim(id, namespace)     the descriptor (now the caller's to close), for an engine of `namespace`
    .pending()                descriptors handed over and not claimed yet
    .close()                  stops listening; closes every unclaimed descriptor
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import socket
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from kvdepot.auth import metadata
from kvdepot.lane import unix_path
from kvdepot.v1 import kvdepot_pb2 as pb
from kvdepotd.auth import OPEN, Caller, PermissionDenied, Tokens
from kvdepotd.core.errors import DepotError, InvalidRequest
from kvdepotd.errors import status_of
from kvdepotd.wire import FRAME, error_frame, ok_frame

log = logging.getLogger("kvdepotd.handoff")
MAX_FDS = 250  # the kernel passes at most 253 per message
MAX_REQUEST = 4096
TTL_S = 60.0  # an unclaimed descriptor is closed after this long
MAX_PENDING = 4096
MAX_CONNECTIONS = 32
TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class _Held:
    fd: int
    caller: Caller
    expires: float


def sealed(fd: int) -> bool:
    """A non-empty memfd that can never shrink: memory the daemon may map and copy into without
    the owner pulling pages from under it (a truncated mapping is a SIGBUS: the daemon's death)."""
    try:
        st = os.fstat(fd)
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:  # not a file that takes seals (a pipe, a socket, a file outside memfd/tmpfs)
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size > 0 and bool(seals & fcntl.F_SEAL_SHRINK)


def doorbell(fd: int) -> bool:
    """A unix datagram socket: a worker's doorbell (RegisterKvCachesRequest.doorbell_handoff_id)."""
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            return False
        with socket.socket(fileno=os.dup(fd)) as s:
            return s.family == socket.AF_UNIX and s.type == socket.SOCK_DGRAM
    except OSError:
        return False


class Refused(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code


class Handoffs:
    def __init__(self, tokens: Callable[[], Tokens | None], ttl_s: float = TTL_S, max_pending: int = MAX_PENDING) -> None:
        self._tokens = tokens
        self._ttl_s = ttl_s
        self._max_pending = max_pending
        self._held: dict[str, _Held] = {}
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._listeners: list[socket.socket] = []
        self._closed = False
        self.addresses: list[str] = []

    def listen(self, grpc_address: str) -> str:
        path = unix_path(grpc_address) + ".handoff"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
            sock.listen(64)
        except OSError:
            sock.close()
            raise
        self._listeners.append(sock)
        self.addresses.append(f"unix:{path}")
        threading.Thread(target=self._accept, args=(sock,), name="kvdepotd-handoff", daemon=True).start()
        return f"unix:{path}"

    def claim(self, handoff_id: str, namespace: str) -> int:
        """The descriptor handed over as `handoff_id`, for an engine of `namespace`; the caller closes it."""
        with self._lock:
            self._expire(time.monotonic())
            held = self._held.get(handoff_id)
            if held is None:
                raise InvalidRequest(f"handoff id {handoff_id[:64]!r} names no descriptor (unknown, already claimed, or older than {self._ttl_s:.0f} s)")
            if not held.caller.may_use(namespace):
                raise PermissionDenied(f"handoff id {handoff_id[:64]!r} was handed over with {held.caller.describe()}, not for namespace {namespace!r}")
            del self._held[handoff_id]
        return held.fd

    def pending(self) -> int:
        with self._lock:
            self._expire(time.monotonic())
            return len(self._held)

    def close(self) -> None:
        self._closed = True
        for sock in self._listeners:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the accept()
            except OSError:
                pass
            sock.close()
        with self._lock:
            held, self._held = list(self._held.values()), {}
        for h in held:
            os.close(h.fd)

    # -- serving --------------------------------------------------------------------------------
    def _accept(self, sock: socket.socket) -> None:
        while not self._closed:
            try:
                conn, _ = sock.accept()
            except OSError:
                return  # closed
            if not self._slots.acquire(blocking=False):
                conn.close()  # too many at once: the worker tries again with its next registration
                continue
            threading.Thread(target=self._serve, args=(conn,), name="kvdepotd-handoff-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(TIMEOUT_S)
            while not self._closed:
                try:
                    got = self._receive(conn)
                except Refused as e:
                    conn.sendall(error_frame(e.code, str(e)))
                    return  # the stream may be out of step: end it
                if got is None:
                    return
                body, fds = got
                try:
                    ids = self._hold(body, fds)
                except Refused as e:
                    conn.sendall(error_frame(e.code, str(e)))
                    continue
                conn.sendall(ok_frame(pb.HandoffResponse(ids=ids).SerializeToString()))
        except OSError:
            pass  # the worker went away or was too slow
        finally:
            conn.close()
            self._slots.release()

    @staticmethod
    def _receive(conn: socket.socket) -> tuple[bytes, list[int]] | None:
        """One request frame and the descriptors that came with it; None at the end of the stream."""
        data, fds, flags, _ = socket.recv_fds(conn, MAX_REQUEST + FRAME.size, MAX_FDS)
        if not data:
            return None  # the end of the stream (descriptors only ever come with bytes)
        buf = bytearray(data)
        try:
            if flags & socket.MSG_CTRUNC:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"handoff: more than {MAX_FDS} descriptors in one request")
            while len(buf) < FRAME.size or len(buf) < FRAME.size + FRAME.unpack_from(buf)[0]:
                if len(buf) >= FRAME.size and FRAME.unpack_from(buf)[0] > MAX_REQUEST:
                    raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, f"handoff: a request over {MAX_REQUEST} bytes")
                more = conn.recv(MAX_REQUEST + FRAME.size - len(buf))
                if not more:
                    raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "handoff: the stream ended inside a request")
                buf += more
            (n,) = FRAME.unpack_from(buf)
            if len(buf) != FRAME.size + n:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "handoff: send one request at a time and wait for its answer")
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return bytes(buf[FRAME.size :]), fds

    def _hold(self, body: bytes, fds: list[int]) -> list[str]:
        """Checks a request and keeps its descriptors (closing them all when anything is wrong)."""
        try:
            try:
                req = pb.HandoffRequest.FromString(body)
            except DecodeError:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "handoff: the request is not a HandoffRequest") from None
            caller = self._caller(req.token)
            if req.fds != len(fds):
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"handoff: the request says {req.fds} descriptors and {len(fds)} came with it")
            if not fds:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "handoff: no descriptors came with the request")
            for i, fd in enumerate(fds):
                if not (sealed(fd) or doorbell(fd)):
                    raise Refused(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"handoff: descriptor {i} is neither a memfd sealed against shrinking "
                        "(memfd_create with MFD_ALLOW_SEALING, then F_ADD_SEALS F_SEAL_SHRINK; kvdepot.handles does this) "
                        "nor a unix datagram socket (a doorbell)",
                    )
            now = time.monotonic()
            with self._lock:
                self._expire(now)
                if len(self._held) + len(fds) > self._max_pending:
                    raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, f"handoff: {len(self._held)} descriptors wait to be claimed already (at most {self._max_pending})")
                ids = [secrets.token_hex(16) for _ in fds]
                for handoff_id, fd in zip(ids, fds):
                    self._held[handoff_id] = _Held(fd, caller, now + self._ttl_s)
            return ids
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise

    def _caller(self, token: str) -> Caller:
        tokens = self._tokens()
        if tokens is None:
            return OPEN
        try:
            return tokens.caller((metadata(token),) if token else ())
        except DepotError as e:
            raise Refused(status_of(e), f"handoff: {e}") from None

    def _expire(self, now: float) -> None:
        """Closes descriptors nobody claimed in time (the lock is held)."""
        for i in [i for i, h in self._held.items() if h.expires <= now]:
            os.close(self._held.pop(i).fd)
