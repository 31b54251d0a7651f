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
# first kind only), hence one class per kind of call: (unary|stream) -> (unary|stream).
KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")


def _interceptor_class(kind: str, aio: bool) -> type:
    base_name = "".join(w.capitalize() for w in kind.split("_")) + "ClientInterceptor"
    if aio:
        async def intercept_async(self: _Bearer, continuation: Any, details: Any, request: Any) -> Any:
            return await continuation(self._aio_with_token(details), request)

        return type("Aio" + base_name, (_Bearer, getattr(grpc.aio, base_name)), {f"intercept_{kind}": intercept_async})

    def intercept(self: _Bearer, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    return type(base_name, (_Bearer, getattr(grpc, base_name)), {f"intercept_{kind}": intercept})


_CLASSES = {aio: [_interceptor_class(kind, aio) for kind in KINDS] for aio in (False, True)}


def interceptors(token: str, aio: bool = False) -> list[Any]:
    check_token(token)
    return [cls(token) for cls in _CLASSES[aio]]
