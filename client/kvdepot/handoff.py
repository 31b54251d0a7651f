"""Handing KV memory to a daemon reached at unix:PATH: memfd descriptors over unix:PATH.handoff.

    handoff_path(address)              the handoff socket beside a unix: address, else None
    connect(sock, path, timeout_s)     connects, waiting for room in a full accept queue
    hand_over(path, fds, token)        the daemon's ids for the descriptors, in order; raises
                                       grpc.RpcError (LocalRpcError) as a gRPC call would
    fetch_arena(path, engine_id, token)   the host memory of an engine whose workers copy their
                                       blocks themselves: (descriptor, size), the caller's to close

See kvdepotd.handoff for the daemon's side and HandoffRequest in the proto for the wire.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence

import grpc

from kvdepot.lane import FRAME, LocalRpcError, answer, recv_exactly, unix_path
from kvdepot.v1 import kvdepot_pb2 as pb

MAX_FDS = 250  # per request: the kernel passes at most 253 descriptors in one message


def handoff_path(address: str) -> str | None:
    return unix_path(address) + ".handoff" if address.startswith("unix:") else None


def connect(sock: socket.socket, path: str, timeout_s: float) -> None:
    """Connects within `timeout_s`. A Unix socket whose queue of connections not yet accepted is
    full refuses a connect with a timeout at once (EAGAIN) rather than waiting for room: this
    waits for room, so a flood of idle connections delays a worker's handoff but does not fail it."""
    deadline = time.monotonic() + timeout_s
    while True:
        sock.settimeout(max(deadline - time.monotonic(), 1e-3))
        try:
            sock.connect(path)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise TimeoutError from None
            time.sleep(0.005)


def hand_over(path: str, fds: Sequence[int], token: str = "", timeout_s: float = 5.0, cuda_fds: int = 0) -> list[str]:
    """`cuda_fds`: how many of `fds` (the first ones) are CUDA virtual-memory allocations."""
    if cuda_fds and len(fds) > MAX_FDS:
        raise LocalRpcError(grpc.StatusCode.INVALID_ARGUMENT, f"at most {MAX_FDS} CUDA allocations at once")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            connect(sock, path, timeout_s)
            ids: list[str] = []
            for k in range(0, len(fds), MAX_FDS):
                part = list(fds[k : k + MAX_FDS])
                body = pb.HandoffRequest(token=token, fds=len(part), cuda_fds=cuda_fds).SerializeToString()
                socket.send_fds(sock, [FRAME.pack(len(body)) + body], part)
                (n,) = FRAME.unpack(recv_exactly(sock, FRAME.size))
                ids += answer(recv_exactly(sock, n), pb.HandoffResponse).ids
    except TimeoutError:
        raise LocalRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, f"the handoff socket {path} did not answer within {timeout_s:.0f} s") from None
    except OSError as e:
        raise LocalRpcError(grpc.StatusCode.UNAVAILABLE, f"cannot hand KV memory over at {path}: {e.strerror or e}") from None
    if len(ids) != len(fds):
        raise LocalRpcError(grpc.StatusCode.INTERNAL, f"the handoff socket answered {len(ids)} ids for {len(fds)} descriptors")
    return ids


def fetch_arena(path: str, engine_id: str, token: str = "", timeout_s: float = 5.0) -> tuple[int, int]:
    req = pb.HandoffRequest(token=token, fetch_arena=pb.FetchArena(engine_id=engine_id)).SerializeToString()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            connect(sock, path, timeout_s)
            sock.sendall(FRAME.pack(len(req)) + req)
            head, fds, _, _ = socket.recv_fds(sock, FRAME.size, 1)
            try:
                if len(head) < FRAME.size:
                    head += bytes(recv_exactly(sock, FRAME.size - len(head)))
                (n,) = FRAME.unpack(head)
                size = answer(recv_exactly(sock, n), pb.HandoffResponse).arena_bytes
            except BaseException:
                for fd in fds:
                    os.close(fd)
                raise
    except TimeoutError:
        raise LocalRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, f"the handoff socket {path} did not answer within {timeout_s:.0f} s") from None
    except OSError as e:
        raise LocalRpcError(grpc.StatusCode.UNAVAILABLE, f"cannot fetch host memory at {path}: {e.strerror or e}") from None
    if len(fds) != 1:
        raise LocalRpcError(grpc.StatusCode.INTERNAL, f"the handoff socket sent {len(fds)} descriptors for the host memory")
    return fds[0], size
