"""What every edge of the daemon shares about bytes on the wire: a request that does not parse
(BadMessage, from safe_parser) and the lane's frames (which the handoff socket uses too).

Frames: a little-endian u32 length, then that many bytes. An answer's first byte is the gRPC status
code (0 = OK); after it, the answer's message when OK, else the UTF-8 text of the error.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import grpc

FRAME = struct.Struct("<I")


class BadMessage:
    """A request whose bytes are not a valid message of its type (see safe_parser)."""

    def __init__(self, what: str) -> None:
        self.what = what

    def WhichOneof(self, _: str) -> None:  # so a worker stream's first-message check rejects it
        return None


def safe_parser(cls: Any, method: str) -> Callable[[bytes], Any]:
    """A parser for `cls` that answers bad bytes with a BadMessage (the handler then answers
    INVALID_ARGUMENT with its text) instead of raising inside gRPC (UNKNOWN and a traceback)."""

    def parse(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except Exception as e:  # DecodeError and friends: the bytes are not this message
            return BadMessage(f"{method}: the request is not a valid {cls.DESCRIPTOR.full_name} ({e})")

    return parse


def ok_frame(payload: bytes) -> bytes:
    return FRAME.pack(len(payload) + 1) + b"\0" + payload


def error_frame(code: grpc.StatusCode, details: str) -> bytes:
    body = details.encode()
    return FRAME.pack(len(body) + 1) + bytes([code.value[0]]) + body
