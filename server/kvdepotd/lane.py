"""The lane: Lookup and Step over a plain framed socket, beside gRPC.

A gRPC round trip crosses several threads on each side (the client's request feeder and channel
poller, the server's completion-queue poller, then the event loop); a message on a plain socket
wakes one reader on each side, so the engine path's round trip is a fraction of gRPC's
(docs/performance.md has the figures). The lane carries only the engine path, the calls made on
every engine step; everything else stays on gRPC.

Wire format, both ways: frames of a little-endian u32 length, then that many bytes.
    request   a SessionRequest (the message of rpc Session)
    answer    one byte, the gRPC status code (0 = OK), then a SessionResponse when it is 0,
              or the UTF-8 message of the error otherwise
A connection answers its requests one at a time, in order, through the gRPC handlers themselves
(same checks, errors and metrics). A request that is not a valid SessionRequest is answered
INVALID_ARGUMENT and the connection stays usable; a frame longer than the message limit is
answered RESOURCE_EXHAUSTED and the connection is closed.

Tokens (--auth-file): a lane has no metadata, so a connection's first request is a `hello`
carrying the token, and its later requests act for the token of its last accepted hello, checked
again on every request (a token taken out of the file on SIGHUP stops working at once). A
connection with no accepted hello HELLO_S after it opened is closed, so connections nobody lets
in cannot pile up.

Where: beside each `--listen` address, `unix:PATH` gets `unix:PATH.lane` and `HOST:PORT` gets
the same host on `--lane-port` (0, the default: a port of the system's choosing); under TLS
(--tls-cert) a TCP lane speaks TLS with the gRPC port's certificate and client-certificate rule.
RegisterEngine's answer lists them; the client picks the one beside the address it reached the
daemon at, and falls back to the Session stream whenever the lane cannot be reached.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Awaitable, Callable
from typing import cast

import grpc

from kvdepot.auth import metadata
from kvdepot.lane import unix_path
from kvdepot.v1 import kvdepot_pb2 as pb
from kvdepotd.wire import FRAME, BadMessage, error_frame, ok_frame, safe_parser

log = logging.getLogger("kvdepotd.lane")

Answer = Callable[[pb.SessionRequest | BadMessage, "LaneContext", str], Awaitable[pb.SessionResponse]]  # DepotService.answer
PARSE = safe_parser(pb.SessionRequest, "Session")  # bad bytes: a BadMessage, answered INVALID_ARGUMENT


class LaneContext:
    """What the gRPC handlers use of their context: abort() records the status and ends the
    handler as grpc.aio's does; the metadata is the connection's token, as a gRPC call sends it."""

    def __init__(self, token: str, peer: str = "lane") -> None:
        self.code = grpc.StatusCode.OK
        self.details = ""
        self.token = token
        self._peer = peer

    def peer(self) -> str:
        return self._peer

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return (metadata(self.token),) if self.token else ()

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        self.code, self.details = code, details
        raise grpc.aio.AbortError(details)


HELLO_S = 5.0  # where tokens are required, a connection without an accepted hello by then is closed


class LaneConnection(asyncio.Protocol):
    def __init__(self, answer: Answer, max_frame: int, connections: set[LaneConnection], tokens_required: Callable[[], bool]) -> None:
        self._answer = answer
        self._max_frame = max_frame
        self._connections = connections
        self._tokens_required = tokens_required
        self._buf = bytearray()
        self._transport: asyncio.Transport | None = None
        self._busy = False
        self._closing = False
        self._token = ""  # of the last hello the daemon accepted
        self._peer = "lane"

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's
        peer = transport.get_extra_info("peername")
        self._peer = f"lane {peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "lane (unix socket)"
        self._connections.add(self)
        asyncio.get_running_loop().call_later(HELLO_S, self._hello_due)

    def _hello_due(self) -> None:
        """A connection that holds a descriptor without ever being let in (no accepted hello where
        tokens are required) is closed: idle strangers cannot pile up connections."""
        if self._transport is not None and not self._token and self._tokens_required():
            log.info("%s: no accepted hello within %.0f s; closing it", self._peer, HELLO_S)
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._connections.discard(self)
        self._transport = None

    def data_received(self, data: bytes) -> None:
        self._buf += data
        if not self._busy:
            self._next()

    def close(self) -> None:
        """Ends the connection once the request in hand (if any) is answered."""
        self._closing = True
        if not self._busy and self._transport is not None:
            self._transport.close()

    def _next(self) -> None:
        t = self._transport
        if t is None:
            return
        if self._closing:
            t.close()
            return
        if len(self._buf) < FRAME.size:
            return
        (n,) = FRAME.unpack_from(self._buf)
        if n > self._max_frame:
            t.write(error_frame(grpc.StatusCode.RESOURCE_EXHAUSTED, f"lane: a request of {n} bytes is over the {self._max_frame}-byte limit"))
            t.close()
            return
        if len(self._buf) < FRAME.size + n:
            return
        body = bytes(self._buf[FRAME.size : FRAME.size + n])
        del self._buf[: FRAME.size + n]
        self._busy = True
        t.pause_reading()  # one request at a time: a client that does not wait buffers in its kernel
        asyncio.get_running_loop().create_task(self._serve(body))

    async def _serve(self, body: bytes) -> None:
        req = PARSE(body)
        hello = isinstance(req, pb.SessionRequest) and req.WhichOneof("call") == "hello"
        ctx = LaneContext(req.hello.token if hello else self._token, self._peer)
        if hello:
            self._token = ""  # a refused hello leaves the connection with no token
        try:
            payload = (await self._answer(req, ctx, "lane")).SerializeToString()
            out = ok_frame(payload)
            if hello:
                self._token = ctx.token
        except grpc.aio.AbortError:
            out = error_frame(ctx.code, ctx.details)
        except Exception:  # the handlers map every error they expect; this is a bug
            log.exception("lane request failed")
            out = error_frame(grpc.StatusCode.INTERNAL, "Session: internal error (see the daemon log)")
        t = self._transport
        self._busy = False
        if t is None:
            return
        t.write(out)
        t.resume_reading()
        self._next()


class Lanes:
    """The daemon's lane listeners and their open connections."""

    def __init__(self, answer: Answer, max_frame: int, tokens_required: Callable[[], bool] = lambda: False) -> None:
        self._answer = answer
        self._max_frame = max_frame
        self._tokens_required = tokens_required
        self._servers: list[asyncio.AbstractServer] = []
        self._connections: set[LaneConnection] = set()
        self.addresses: list[str] = []

    def open_connections(self) -> int:
        return len(self._connections)

    def _factory(self) -> LaneConnection:
        return LaneConnection(self._answer, self._max_frame, self._connections, self._tokens_required)

    async def listen(self, grpc_address: str, port: int = 0, tls: ssl.SSLContext | None = None) -> str:
        """Opens the lane beside one gRPC listen address (TCP: on `port`, 0 for the system's
        choice, over TLS when `tls` is given); returns the lane's address."""
        loop = asyncio.get_running_loop()
        if grpc_address.startswith("unix:"):
            path = unix_path(grpc_address) + ".lane"
            server = await loop.create_unix_server(self._factory, path)
            addr = f"unix:{path}"
        else:
            host = grpc_address.rpartition(":")[0]
            server = await loop.create_server(self._factory, host.strip("[]"), port, ssl=tls, ssl_handshake_timeout=10 if tls else None)
            port = server.sockets[0].getsockname()[1]
            addr = f"{host}:{port}"
        self._servers.append(server)
        self.addresses.append(addr)
        return addr

    def close(self) -> None:
        """Stops accepting and ends every connection once its request in hand is answered (the
        client goes on over gRPC, which drains as it does)."""
        for server in self._servers:
            server.close()
        for conn in list(self._connections):
            conn.close()

