"""The handoff socket: engine workers hand the daemon file descriptors of their KV memory.

A worker that reaches the daemon at unix:PATH keeps its CPU KV tensors in memfds and sends the
descriptors over unix:PATH.handoff (SCM_RIGHTS); RegisterKvCaches then names them by the ids the
daemon answered. It may hand over its doorbell too, a unix datagram socket on which the copy
threads announce each load the moment its bytes are in (kvdepotd.transfer.host). The other way, a
worker of an engine whose workers copy their blocks themselves fetches the engine's private host
memory here (fetch_arena: one descriptor in the answer, for a token of the engine's namespace). The daemon maps
memory it was given, not a file it opened by name, so:
- engine and daemon may run as different users, in containers that share no /dev/shm;
- a worker can only hand over memory it holds itself (a path names any file of the daemon's user);
- the memfds are sealed against shrinking (checked here), so an engine cannot truncate memory the
  daemon copies into, which would kill the daemon with SIGBUS; a /dev/shm file can be truncated;
- nothing is left in /dev/shm when an engine is killed, and /dev/shm's size limit does not apply.

Wire format (see HandoffRequest in the proto): frames as on the lane, a request carries its
descriptors in the same sendmsg, one answer per request. Connections are rare (one per worker
registration) and short. One thread serves them all with non-blocking sockets (never the event
loop), so a connection that sends nothing holds no thread and makes nobody wait:
- each connection must deliver a whole request within REQUEST_TIMEOUT_S of connecting or of its
  last answer, else it is closed;
- the peer's uid (SO_PEERCRED, checked at accept) may hold PER_UID connections: one more closes
  that uid's oldest connection still waiting for a request, so an idle or slow peer can starve
  only connections of its own user;
- at most MAX_CONNECTIONS in all: a new one closes the oldest waiting one of the uid holding the
  most, so a worker's handoff gets in however many idle connections others opened.

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
import selectors
import socket
import stat
import struct
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
from kvdepotd.core.ops import EngineId
from kvdepotd.errors import status_of
from kvdepotd.wire import FRAME, error_frame, ok_frame

log = logging.getLogger("kvdepotd.handoff")
MAX_FDS = 250  # the kernel passes at most 253 per message
MAX_REQUEST = 4096
TTL_S = 60.0  # an unclaimed descriptor is closed after this long
MAX_PENDING = 4096
MAX_CONNECTIONS = 256  # connections open at once (an idle one costs a descriptor, no thread)
PER_UID = 16  # of which one peer user may hold
REQUEST_TIMEOUT_S = 2.0  # to deliver a whole request, from connecting or from the last answer
LOG_EVERY_S = 10.0


@dataclass(frozen=True, slots=True)
class _Held:
    fd: int
    caller: Caller
    expires: float
    cuda: bool = False  # a CUDA allocation (checked by the driver when imported), never mapped as memory


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


@dataclass(slots=True)
class _Conn:
    sock: socket.socket
    uid: int
    pid: int
    opened: float
    deadline: float  # a whole request by then, or the connection is closed
    buf: bytearray
    fds: list[int]  # descriptors that came with the request so far

    def drop_fds(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def peer_of(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a unix socket."""
    pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid


class Refused(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code


ArenaFd = Callable[[EngineId, Callable[[str], bool]], tuple[int, int]]


class Handoffs:
    def __init__(self, tokens: Callable[[], Tokens | None], arena: ArenaFd | None = None, ttl_s: float = TTL_S, max_pending: int = MAX_PENDING) -> None:
        """`arena(engine_id, may_use)`: the descriptor and size of an engine_copies engine's host
        memory (Runtime.arena_fd), for HandoffRequest.fetch_arena."""
        self._tokens = tokens
        self._arena = arena
        self._ttl_s = ttl_s
        self._max_pending = max_pending
        self._held: dict[str, _Held] = {}
        self._lock = threading.Lock()
        self._sel = selectors.DefaultSelector()
        self._conns: dict[int, _Conn] = {}  # fileno -> connection (the serving thread's alone)
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread: threading.Thread | None = None
        self._listeners: list[socket.socket] = []
        self._closed = False
        self.addresses: list[str] = []
        self._warned = -LOG_EVERY_S  # when a connection closed to make room was last logged

    def listen(self, grpc_address: str) -> str:
        path = unix_path(grpc_address) + ".handoff"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
            sock.listen(MAX_CONNECTIONS)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._listeners.append(sock)
        self.addresses.append(f"unix:{path}")
        self._sel.register(sock, selectors.EVENT_READ, sock)
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="kvdepotd-handoff", daemon=True)
            self._thread.start()
        else:
            self._wake_w.send(b"x")  # the loop picks up the new listener
        return f"unix:{path}"

    def claim(self, handoff_id: str, namespace: str, cuda: bool = False) -> int:
        """The descriptor handed over as `handoff_id`, for an engine of `namespace`; the caller closes
        it. `cuda`: it must have come as a CUDA allocation (else as memory or a doorbell)."""
        with self._lock:
            self._expire(time.monotonic())
            held = self._held.get(handoff_id)
            if held is None:
                raise InvalidRequest(f"handoff id {handoff_id[:64]!r} names no descriptor (unknown, already claimed, or older than {self._ttl_s:.0f} s)")
            if not held.caller.may_use(namespace):
                raise PermissionDenied(f"handoff id {handoff_id[:64]!r} was handed over with {held.caller.describe()}, not for namespace {namespace!r}")
            if held.cuda != cuda:
                raise InvalidRequest(f"handoff id {handoff_id[:64]!r} was handed over as {'a CUDA allocation' if held.cuda else 'memory'}, not as {'a CUDA allocation' if cuda else 'memory'}")
            del self._held[handoff_id]
        return held.fd

    def pending(self) -> int:
        with self._lock:
            self._expire(time.monotonic())
            return len(self._held)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._wake_w.send(b"x")
            self._thread.join(5)
        else:
            self._sel.close()
            self._wake_r.close()
            self._wake_w.close()
        for sock in self._listeners:
            sock.close()
        with self._lock:
            held, self._held = list(self._held.values()), {}
        for h in held:
            os.close(h.fd)

    # -- serving (one thread, non-blocking sockets) ------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._closed:
                now = time.monotonic()
                wait = min((c.deadline for c in self._conns.values()), default=now + 1.0) - now
                for key, _ in self._sel.select(max(0.0, min(wait, 1.0))):
                    if key.fileobj is self._wake_r:
                        self._wake_r.recv(64)
                    elif key.data is not None:
                        self._accept_all(key.data)
                    elif (c := self._conns.get(key.fd)) is not None:
                        self._readable(c)
                now = time.monotonic()
                for c in [c for c in self._conns.values() if c.deadline <= now]:
                    self._end(c)  # too slow to send a request: its place goes to others
        finally:
            for c in list(self._conns.values()):
                self._end(c)
            self._sel.close()
            self._wake_r.close()
            self._wake_w.close()

    def _accept_all(self, listener: socket.socket) -> None:
        """Empties the listener's queue (up to MAX_CONNECTIONS at a time): a queue left full makes a
        worker's connect wait, however quickly idle connections are then closed."""
        for _ in range(MAX_CONNECTIONS):
            try:
                sock, _ = listener.accept()
            except OSError:  # BlockingIOError: the queue is empty
                return
            self._accept(sock)

    def _accept(self, sock: socket.socket) -> None:
        try:
            pid, uid = peer_of(sock)
        except OSError:
            sock.close()
            return
        sock.setblocking(False)
        now = time.monotonic()
        mine = [c for c in self._conns.values() if c.uid == uid]
        if len(mine) >= PER_UID:
            self._make_room(mine, f"uid {uid} holds {len(mine)} handoff connections (at most {PER_UID})")
        elif len(self._conns) >= MAX_CONNECTIONS:
            by_uid: dict[int, list[_Conn]] = {}
            for c in self._conns.values():
                by_uid.setdefault(c.uid, []).append(c)
            self._make_room(max(by_uid.values(), key=len), f"{len(self._conns)} handoff connections are open (at most {MAX_CONNECTIONS})")
        c = _Conn(sock, uid, pid, now, now + REQUEST_TIMEOUT_S, bytearray(), [])
        self._conns[sock.fileno()] = c
        self._sel.register(sock, selectors.EVENT_READ, None)

    def _make_room(self, among: list[_Conn], why: str) -> None:
        """Closes the oldest connection of `among`, one that is still waiting for a request first."""
        victim = min(among, key=lambda c: (bool(c.buf), c.opened))
        now = time.monotonic()
        if now - self._warned >= LOG_EVERY_S:  # a flood of connections must not flood the log
            self._warned = now
            log.warning("handoff: %s: closing the oldest waiting one (pid %d uid %d)", why, victim.pid, victim.uid)
        self._end(victim)

    def _end(self, c: _Conn) -> None:
        self._conns.pop(c.sock.fileno(), None)
        try:
            self._sel.unregister(c.sock)
        except (KeyError, ValueError):
            pass
        c.drop_fds()
        c.sock.close()

    def _readable(self, c: _Conn) -> None:
        try:
            data, fds, flags, _ = socket.recv_fds(c.sock, MAX_REQUEST + FRAME.size - len(c.buf), MAX_FDS)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._end(c)
            return
        c.fds += fds
        if not data:  # the end of the stream (descriptors only ever come with bytes)
            self._end(c)
            return
        c.buf += data
        try:
            if flags & socket.MSG_CTRUNC or len(c.fds) > MAX_FDS:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"handoff: more than {MAX_FDS} descriptors in one request")
            if len(c.buf) < FRAME.size:
                return
            (n,) = FRAME.unpack_from(c.buf)
            if n > MAX_REQUEST:
                raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, f"handoff: a request over {MAX_REQUEST} bytes")
            if len(c.buf) < FRAME.size + n:
                return
            if len(c.buf) > FRAME.size + n:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "handoff: send one request at a time and wait for its answer")
        except Refused as e:
            self._answer(c, error_frame(e.code, str(e)))
            self._end(c)  # the stream may be out of step: end it
            return
        body, fds, c.buf, c.fds = bytes(c.buf[FRAME.size :]), c.fds, bytearray(), []
        give: list[int] = []
        try:
            req = self._parse(body, fds)
            if req.HasField("fetch_arena"):
                for fd in fds:
                    os.close(fd)
                if fds:
                    raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "handoff: fetch_arena takes no descriptors")
                fd, size = self._fetch(req)
                answer, give = ok_frame(pb.HandoffResponse(arena_bytes=size).SerializeToString()), [fd]
            else:
                answer = ok_frame(pb.HandoffResponse(ids=self._hold(req, fds)).SerializeToString())
        except Refused as e:
            answer = error_frame(e.code, str(e))
        c.deadline = time.monotonic() + REQUEST_TIMEOUT_S
        if not self._answer(c, answer, give):
            self._end(c)

    @staticmethod
    def _answer(c: _Conn, frame: bytes, fds: list[int] = ()) -> bool:  # type: ignore[assignment]
        """Sends a (small) answer, with `fds`, without waiting: False when the socket would not take it whole."""
        try:
            return (socket.send_fds(c.sock, [frame], fds) if fds else c.sock.send(frame)) == len(frame)
        except OSError:
            return False

    @staticmethod
    def _parse(body: bytes, fds: list[int]) -> pb.HandoffRequest:
        try:
            return pb.HandoffRequest.FromString(body)
        except DecodeError:
            for fd in fds:
                os.close(fd)
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "handoff: the request is not a HandoffRequest") from None

    def _fetch(self, req: pb.HandoffRequest) -> tuple[int, int]:
        """An engine_copies engine's host memory, for a worker of its namespace (the descriptor stays
        the arena's: sent, not closed)."""
        caller = self._caller(req.token)
        if self._arena is None:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, "handoff: this daemon hands out no host memory")
        try:
            return self._arena(EngineId(req.fetch_arena.engine_id), caller.may_use)
        except DepotError as e:
            raise Refused(status_of(e), f"handoff: {e}") from None

    def _hold(self, req: pb.HandoffRequest, fds: list[int]) -> list[str]:
        """Checks a request and keeps its descriptors (closing them all when anything is wrong)."""
        try:
            caller = self._caller(req.token)
            if req.fds != len(fds):
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"handoff: the request says {req.fds} descriptors and {len(fds)} came with it")
            if not fds:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "handoff: no descriptors came with the request")
            if req.cuda_fds > len(fds):
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"handoff: cuda_fds {req.cuda_fds} is more than the {len(fds)} descriptors")
            first_cuda = len(fds) - req.cuda_fds
            for i, fd in enumerate(fds):
                if i >= first_cuda:
                    continue  # CUDA allocations: the driver checks them when the registration imports them
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
                for i, (handoff_id, fd) in enumerate(zip(ids, fds)):
                    self._held[handoff_id] = _Held(fd, caller, now + self._ttl_s, cuda=i >= first_cuda)
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
