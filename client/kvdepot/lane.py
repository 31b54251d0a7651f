"""The client's end of the lane: Lookup and Step on a plain framed socket (see kvdepotd.lane for
the wire format and why). One blocking socket, one call at a time, the caller's own thread: no
thread hand-offs, which is where gRPC's round trip spends its time on a small machine.

    pick(address, lanes)        the lane beside the gRPC address the client was given, or None
    Lane.call(req, timeout_s)   the answer; None when the lane cannot be used now (the caller goes
                                over gRPC); raises grpc.RpcError (LocalRpcError) otherwise
    AsyncLane                   the same for asyncio

With a token, each new connection first sends a hello carrying it (a lane has no metadata); a
refused hello fails the call with the daemon's status, as the gRPC call would.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
import struct
import threading
import time
from collections.abc import Sequence
from typing import TypeVar

import grpc
from google.protobuf.message import Message

from kvdepot.v1 import kvdepot_pb2 as pb

log = logging.getLogger("kvdepot")
FRAME = struct.Struct("<I")
CODES = {c.value[0]: c for c in grpc.StatusCode}
WILDCARD = ("0.0.0.0", "[::]", "::", "")
MAX_BACKOFF_S = 30.0
M = TypeVar("M", bound=Message)


class LocalRpcError(grpc.RpcError):
    """A failure shaped like grpc's: a lane's answer, or one the client itself decided (a call past
    its deadline, a connection that broke)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


Target = tuple[str, str, int]  # ("unix", path, 0) or ("tcp", host, port)


def pick(address: str, lanes: Sequence[str]) -> Target | None:
    """unix:PATH reaches its lane at PATH.lane; HOST:PORT at the same host, on the port of the lane
    the daemon opened beside that host (or beside a wildcard host). Other forms: no lane."""
    if address.startswith("unix:"):
        if not any(lane.startswith("unix:") for lane in lanes):
            return None
        return ("unix", unix_path(address) + ".lane", 0)
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "/" in host:
        return None
    tcp = [(h, p) for h, _, p in (lane.rpartition(":") for lane in lanes if not lane.startswith("unix:")) if p.isdigit()]
    if not tcp:
        return None
    port_of = next((p for h, p in tcp if h == host), None) or next((p for h, p in tcp if h in WILDCARD), None) or tcp[0][1]
    return ("tcp", host.strip("[]"), int(port_of))


def unix_path(address: str) -> str:
    """The socket file of unix:PATH or unix:///abs/path (the daemon's side uses this too)."""
    return address[len("unix://") :] if address.startswith("unix://") else address[len("unix:") :]


UNIX_PATH_MAX = 107  # bytes: sun_path holds 108 with the terminating NUL
COMPANIONS = (".lane", ".handoff")  # the daemon's sockets beside a unix:PATH address


def check_unix_path(path: str, companions: bool = False) -> None:
    """ValueError when the socket path (with its longest companion, for the daemon) is over the
    system's limit; gRPC would only say the target is not valid."""
    beside = max(COMPANIONS, key=len) if companions else ""
    n = len(os.fsencode(path + beside))
    if n > UNIX_PATH_MAX:
        raise ValueError(
            f"the Unix socket path {path}{f' with its {beside} socket beside it' if beside else ''} is {n} bytes, over the system's limit of {UNIX_PATH_MAX}: "
            "use a shorter path (a symlink to its folder will do)"
        )


def recv_exactly(sock: socket.socket, n: int) -> memoryview:
    """n bytes from a blocking socket; ConnectionResetError when it ends first."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionResetError("the daemon closed the connection")
        got += k
    return view


def answer(body: bytes | memoryview, kind: type[M] = pb.SessionResponse) -> M:
    """An answer frame's bytes: the message, or the daemon's error raised as LocalRpcError."""
    if not body:
        raise LocalRpcError(grpc.StatusCode.INTERNAL, "the daemon answered an empty frame")
    if body[0]:
        raise LocalRpcError(CODES.get(body[0], grpc.StatusCode.UNKNOWN), bytes(body[1:]).decode(errors="replace"))
    return kind.FromString(body[1:])


class _LaneBase:
    """The decisions both clients share: which lane, when to rest it, when to send again.

    A connection that was already open may have died while idle (a restarted daemon): that says
    nothing about the call, which is safe to send again (a repeated step is answered the same), so
    it goes once more on a new connection. A new one that breaks hands the call to gRPC and the
    lane rests: a daemon that is down fails there too, within the deadline, and one whose lane
    alone is out keeps its engine served."""

    def __init__(self, address: str, enabled: bool = True, token: str = "", tls: ssl.SSLContext | None = None) -> None:
        self._address = address
        self._tls = tls  # a TCP lane of a daemon with --tls-cert speaks TLS
        self._hello = request_frame(pb.SessionRequest(hello=pb.Hello(token=token))) if token else b""
        self._target: Target | None = None
        self._retry_at = 0.0  # after a failed connect, the lane rests until then
        self._backoff_s = 0.0
        self.enabled = enabled

    def _retarget(self, lanes: Sequence[str]) -> bool:
        """Takes the lanes a (new) registration told of; True when the target changed."""
        target = pick(self._address, lanes) if self.enabled else None
        if target == self._target:
            return False
        self._target = target
        self._retry_at, self._backoff_s = 0.0, 0.0
        return True

    def _resting(self) -> bool:
        return self._target is None or time.monotonic() < self._retry_at

    def _rest(self, why: object = "it broke on a new connection") -> None:
        """No lane for a while (doubling up to MAX_BACKOFF_S); calls go over gRPC meanwhile."""
        assert self._target is not None
        self._backoff_s = min(MAX_BACKOFF_S, max(0.1, 2 * self._backoff_s))
        self._retry_at = time.monotonic() + self._backoff_s
        kind, where, port = self._target
        log.info("kvdepot: lane %s unusable (%s); using gRPC, trying again in %.1f s", where if kind == "unix" else f"{where}:{port}", why, self._backoff_s)

    def _send_again(self, e: LocalRpcError, reused: bool, deadline: float) -> bool:
        """After a failed round trip: True to send again on a new connection; False when the
        connection was new (the lane rests and the call goes over gRPC); raises `e` otherwise."""
        if e.code() is not grpc.StatusCode.UNAVAILABLE or time.monotonic() >= deadline:
            raise e
        if not reused:
            self._rest()
        return reused


def request_frame(req: pb.SessionRequest) -> bytes:
    data = req.SerializeToString()
    return FRAME.pack(len(data)) + data


class Lane(_LaneBase):
    """For DepotClient: a blocking socket used from the caller's thread."""

    def __init__(self, address: str, enabled: bool = True, token: str = "", tls: ssl.SSLContext | None = None) -> None:
        super().__init__(address, enabled, token, tls)
        self._sock: socket.socket | None = None
        self._busy = threading.Lock()  # held by the one call in flight

    def configure(self, lanes: Sequence[str]) -> None:
        with self._busy:
            if self._retarget(lanes):
                self._drop()

    def call(self, req: pb.SessionRequest, timeout_s: float) -> pb.SessionResponse | None:
        if self._target is None or not self._busy.acquire(blocking=False):
            return None
        try:
            deadline = time.monotonic() + timeout_s
            frame = request_frame(req)
            for _ in range(2):
                reused = self._sock is not None
                if not reused and not self._connect(deadline):
                    return None
                try:
                    if not reused and self._hello:
                        self._greet(deadline, timeout_s)
                    return self._round_trip(frame, deadline, timeout_s)
                except LocalRpcError as e:
                    if not self._send_again(e, reused, deadline):
                        return None
            return None
        finally:
            self._busy.release()

    def close(self) -> None:
        with self._busy:
            self._target = None
            self._drop()

    def _connect(self, deadline: float) -> bool:
        if self._resting():
            return False
        assert self._target is not None
        kind, where, port = self._target
        timeout = max(deadline - time.monotonic(), 1e-3)
        try:
            if kind == "unix":
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(timeout)
                try:
                    sock.connect(where)
                except OSError:
                    sock.close()
                    raise
            else:
                sock = socket.create_connection((where, port), timeout=timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self._tls is not None:
                    try:
                        sock = self._tls.wrap_socket(sock, server_hostname=where)  # the handshake, within the timeout
                    except OSError:
                        sock.close()
                        raise
        except OSError as e:  # ssl.SSLError included
            self._rest(e)
            return False
        self._sock = sock
        return True

    def _greet(self, deadline: float, timeout_s: float) -> None:
        """The hello of a new connection; one the daemon refuses is not kept."""
        try:
            self._round_trip(self._hello, deadline, timeout_s)
        except LocalRpcError:
            self._drop()
            raise

    def _round_trip(self, frame: bytes, deadline: float, timeout_s: float) -> pb.SessionResponse:
        sock = self._sock
        assert sock is not None
        try:
            sock.settimeout(max(deadline - time.monotonic(), 1e-4))
            sock.sendall(frame)
            (n,) = FRAME.unpack(recv_exactly(sock, FRAME.size))
            body = recv_exactly(sock, n)
        except TimeoutError:
            self._drop()  # the answer may still come: this connection is out of step now
            raise LocalRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {timeout_s * 1000:.0f} ms") from None
        except OSError as e:
            self._drop()
            raise LocalRpcError(grpc.StatusCode.UNAVAILABLE, f"the lane broke: {e}") from None
        return answer(body)

    def _drop(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()


class AsyncLane(_LaneBase):
    """For AsyncDepotClient: asyncio streams, the same decisions."""

    def __init__(self, address: str, enabled: bool = True, token: str = "", tls: ssl.SSLContext | None = None) -> None:
        super().__init__(address, enabled, token, tls)
        self._conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._busy = asyncio.Lock()

    def configure(self, lanes: Sequence[str]) -> None:
        if self._retarget(lanes):
            self._drop()  # a call in flight on it fails over to the new target

    async def call(self, req: pb.SessionRequest, timeout_s: float) -> pb.SessionResponse | None:
        if self._target is None or self._busy.locked():
            return None
        async with self._busy:
            deadline = time.monotonic() + timeout_s
            frame = request_frame(req)
            for _ in range(2):
                reused = self._conn is not None
                if not reused and not await self._connect(deadline):
                    return None
                try:
                    if not reused and self._hello:
                        await self._greet(deadline, timeout_s)
                    return await self._round_trip(frame, deadline, timeout_s)
                except LocalRpcError as e:
                    if not self._send_again(e, reused, deadline):
                        return None
            return None

    def close(self) -> None:
        self._target = None
        self._drop()

    async def _connect(self, deadline: float) -> bool:
        if self._resting():
            return False
        assert self._target is not None
        kind, where, port = self._target
        if kind == "unix":
            opening = asyncio.open_unix_connection(where)
        else:
            opening = asyncio.open_connection(where, port, ssl=self._tls, server_hostname=where if self._tls else None)
        try:
            self._conn = await asyncio.wait_for(opening, max(deadline - time.monotonic(), 1e-3))
        except (OSError, asyncio.TimeoutError) as e:
            self._rest(e if isinstance(e, OSError) else "no connection within the deadline")
            return False
        return True

    async def _greet(self, deadline: float, timeout_s: float) -> None:
        try:
            await self._round_trip(self._hello, deadline, timeout_s)
        except LocalRpcError:
            self._drop()
            raise

    async def _round_trip(self, frame: bytes, deadline: float, timeout_s: float) -> pb.SessionResponse:
        assert self._conn is not None
        reader, writer = self._conn

        async def exchange() -> bytes:
            writer.write(frame)
            (n,) = FRAME.unpack(await reader.readexactly(FRAME.size))
            return await reader.readexactly(n)

        try:
            body = await asyncio.wait_for(exchange(), max(deadline - time.monotonic(), 1e-4))
        except asyncio.TimeoutError:
            self._drop()
            raise LocalRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {timeout_s * 1000:.0f} ms") from None
        except (OSError, asyncio.IncompleteReadError) as e:
            self._drop()
            raise LocalRpcError(grpc.StatusCode.UNAVAILABLE, f"the lane broke: {e!r}") from None
        return answer(body)

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn[1].close()
