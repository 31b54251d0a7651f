"""Errors the client raises (inspection and admin calls always; engine-path calls only when strict).

The daemon's status codes map back to these in one place, `from_rpc_error`."""

from __future__ import annotations

import grpc


class DepotError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN


class InvalidRequest(DepotError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(DepotError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(DepotError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Unauthenticated(DepotError):
    """The daemon asks for a token and got none, or one it does not know."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(DepotError):
    """The token does not allow this (another namespace's engine, Clear without an admin token)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(InvalidRequest):
    """A cap the daemon's operator set is reached (the message names it): slots, lookup pins, sizes."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(DepotError):
    """The daemon did not answer in time or is not running: for the engine, a cache miss."""

    code = grpc.StatusCode.UNAVAILABLE


_BY_CODE: dict[grpc.StatusCode, type[DepotError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.OUT_OF_RANGE: InvalidRequest,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: Unavailable,
    grpc.StatusCode.CANCELLED: Unavailable,
}


UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def from_rpc_error(e: grpc.RpcError, address: str = "") -> DepotError:
    """The error for a failed call; one that did not reach the daemon names the address it tried."""
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = e.details() if hasattr(e, "details") else str(e)
    text = f"{code.name}: {details}"
    if address and code in UNREACHABLE:
        text = f"kvdepotd at {address} did not answer ({text})"
    err = _BY_CODE.get(code, DepotError)(text)
    err.code = code
    return err
