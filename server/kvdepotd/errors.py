"""The one place that maps core errors to gRPC status codes (the client maps them back)."""

from __future__ import annotations

import grpc

from kvdepotd.auth import PermissionDenied, Unauthenticated
from kvdepotd.core.errors import DepotError, FailedPrecondition, InvalidRequest, NotFound, ResourceExhausted

STATUS: dict[type[DepotError], grpc.StatusCode] = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
}


def status_of(err: DepotError) -> grpc.StatusCode:
    for cls in type(err).__mro__:  # a refinement (auth.ForeignEngine is a NotFound) answers as its kind
        if cls in STATUS:
            return STATUS[cls]
    return grpc.StatusCode.INVALID_ARGUMENT
