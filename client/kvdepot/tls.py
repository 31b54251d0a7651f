"""TLS to a daemon reached over TCP (kvdepotd --tls-cert/--tls-key, optionally --tls-client-ca).

    Tls(ca, cert, key), Tls.of()  PEM files: the CA that signed the daemon's certificate (empty:
                                  the system's roots), and this client's certificate and key when
                                  the daemon asks for one (mutual TLS)
    channel(address, tls, options, aio, token)
                                  a gRPC channel to `address`, secure when `tls` is given, every
                                  call carrying `token` when one is (kvdepot.auth)

Unix sockets stay plaintext on both sides: who may connect is the socket file's permission. Under
TLS the daemon's TCP lane speaks TLS too (Tls.ssl_context: the same files).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import Any

import grpc

from kvdepot.auth import interceptors
from kvdepot.lane import check_unix_path, unix_path


@dataclass(frozen=True)
class Tls:
    ca: str = ""
    cert: str = ""
    key: str = ""

    @staticmethod
    def of(ca: str = "", cert: str = "", key: str = "") -> Tls | None:
        """Settings that name any file turn TLS on; none: None (plaintext)."""
        return Tls(ca, cert, key) if ca or cert or key else None

    def ssl_context(self) -> ssl.SSLContext:
        """For the TCP lane: the same CA and client certificate; ValueError naming what is wrong."""
        try:
            ctx = ssl.create_default_context(cafile=self.ca or None)
            if self.cert:
                ctx.load_cert_chain(self.cert, self.key)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"TLS: {self.ca or 'the system CA'}, {self.cert or 'no certificate'}: {e}") from None
        return ctx

    def credentials(self) -> grpc.ChannelCredentials:
        """Reads the files now; raises ValueError naming a file that cannot be read."""
        if bool(self.cert) != bool(self.key):
            raise ValueError("TLS: a client certificate and its key go together (cert and key)")
        return grpc.ssl_channel_credentials(
            root_certificates=read_pem(self.ca, "ca"), private_key=read_pem(self.key, "key"), certificate_chain=read_pem(self.cert, "cert")
        )


def read_pem(path: str, what: str) -> bytes | None:
    """The file's bytes (None for no path); ValueError naming `what` and the path otherwise."""
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"TLS: cannot read the {what} file {path}: {e.strerror}") from None


def channel(address: str, tls: Tls | None, options: list[tuple[str, Any]], aio: bool = False, token: str = "") -> Any:
    if address.startswith("unix:"):
        if tls is not None:
            raise ValueError(f"TLS is for TCP addresses; {address} is a Unix socket, which the daemon serves in plaintext")
        check_unix_path(unix_path(address))
    creds = tls.credentials() if tls is not None else None
    if aio:
        extra = interceptors(token, aio=True) if token else None
        if creds is None:
            return grpc.aio.insecure_channel(address, options=options, interceptors=extra)
        return grpc.aio.secure_channel(address, creds, options=options, interceptors=extra)
    ch = grpc.insecure_channel(address, options=options) if creds is None else grpc.secure_channel(address, creds, options=options)
    return grpc.intercept_channel(ch, *interceptors(token)) if token else ch
