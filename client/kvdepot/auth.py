"""A token for a daemon that asks for one (kvdepotd --auth-file).

    read_token(path)               the token in a file (surrounding whitespace dropped); ValueError
                                   naming the file when it cannot be read or is empty
    check_token(token)             ValueError unless it can travel as gRPC metadata
    interceptors(token, aio)       gRPC client interceptors that put "authorization: Bearer TOKEN"
                                   on every call of a channel (kvdepot.tls.channel uses them)

The lane, which has no metadata, presents the token in a hello (kvdepot.lane).
"""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import grpc


def read_token(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read the token file {path}: {getattr(e, 'strerror', None) or e}") from None
    if not token:
        raise ValueError(f"the token file {path} is empty")
    check_token(token, f" in {path}")
    return token


def check_token(token: str, where: str = "") -> None:
    if not token.isascii() or not token.isprintable() or " " in token:
        raise ValueError(f"the token{where} must be printable ASCII without spaces (it travels as gRPC metadata)")


def metadata(token: str) -> tuple[str, str]:
    return ("authorization", f"Bearer {token}")


class _Details(
    namedtuple("_Details", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")), grpc.ClientCallDetails
):
    pass


class _Bearer:
    def __init__(self, token: str) -> None:
        self._md = metadata(token)

    def _with_token(self, d: Any) -> _Details:
        return _Details(d.method, d.timeout, [*(d.metadata or ()), self._md], d.credentials, d.wait_for_ready, d.compression)

    def _aio_with_token(self, d: Any) -> grpc.aio.ClientCallDetails:
        return grpc.aio.ClientCallDetails(d.method, d.timeout, grpc.aio.Metadata(*(d.metadata or ()), self._md), d.credentials, d.wait_for_ready)


# grpc takes one kind of call per interceptor object (grpc.aio files a multi-kind one under its
# first kind only), hence one class per kind.
class _UnaryUnary(_Bearer, grpc.UnaryUnaryClientInterceptor):
    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)


class _UnaryStream(_Bearer, grpc.UnaryStreamClientInterceptor):
    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)


class _StreamUnary(_Bearer, grpc.StreamUnaryClientInterceptor):
    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._with_token(details), requests)


class _StreamStream(_Bearer, grpc.StreamStreamClientInterceptor):
    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._with_token(details), requests)


class _AioUnaryUnary(_Bearer, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._aio_with_token(details), request)


class _AioUnaryStream(_Bearer, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._aio_with_token(details), request)


class _AioStreamUnary(_Bearer, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._aio_with_token(details), requests)


class _AioStreamStream(_Bearer, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._aio_with_token(details), requests)


def interceptors(token: str, aio: bool = False) -> list[Any]:
    check_token(token)
    kinds = (_AioUnaryUnary, _AioUnaryStream, _AioStreamUnary, _AioStreamStream) if aio else (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)
    return [kind(token) for kind in kinds]
