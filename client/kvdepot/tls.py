"""TLS to a daemon reached over TCP (kvdepotd --tls-cert/--tls-key, optionally --tls-client-ca).

    Tls(ca, cert, key), Tls.of()  PEM files: the CA that signed the daemon's certificate (empty:
                                  the system's roots), and this client's certificate and key when
                                  the daemon asks for one (mutual TLS)
    channel(address, tls, aio)    a gRPC channel to `address`, secure when `tls` is given

Unix sockets stay plaintext on both sides: who may connect is the socket file's permission. Under
TLS the daemon opens no TCP lane, so a TLS client's engine path goes over gRPC.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc


@dataclass(frozen=True)
class Tls:
    ca: str = ""
    cert: str = ""
    key: str = ""

    @staticmethod
    def of(ca: str = "", cert: str = "", key: str = "") -> Tls | None:
        """Settings that name any file turn TLS on; none: None (plaintext)."""
        return Tls(ca, cert, key) if ca or cert or key else None

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


def channel(address: str, tls: Tls | None, options: list[tuple[str, Any]], aio: bool = False) -> Any:
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options) if aio else grpc.insecure_channel(address, options=options)
    if address.startswith("unix:"):
        raise ValueError(f"TLS is for TCP addresses; {address} is a Unix socket, which the daemon serves in plaintext")
    creds = tls.credentials()
    return grpc.aio.secure_channel(address, creds, options=options) if aio else grpc.secure_channel(address, creds, options=options)
