"""TLS on the daemon's TCP addresses (--tls-cert/--tls-key, mutual with --tls-client-ca): TLS
clients are served, on gRPC and on the lane, which speaks TLS too; plaintext clients and ones
trusting another CA are not; Unix sockets stay plaintext with their lane; the health command
speaks TLS."""

from __future__ import annotations

import asyncio
import socket
import ssl
import struct
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trustme

from kvdepot import AsyncDepotClient, DepotClient, StepBatch, Tls
from kvdepot.errors import Unauthenticated, Unavailable
from kvdepot.testing import DaemonProcess
from tests.integration.conftest import LAYOUT

pytestmark = pytest.mark.integration


@dataclass
class Pki:
    ca: str
    cert: str
    key: str
    client_cert: str
    client_key: str
    other_ca: str


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca, other = trustme.CA(), trustme.CA()
    server, client = ca.issue_cert("127.0.0.1", "localhost"), ca.issue_cert("engine-0")
    files = {
        "ca": ca.cert_pem, "other_ca": other.cert_pem, "cert": server.cert_chain_pems[0], "key": server.private_key_pem,
        "client_cert": client.cert_chain_pems[0], "client_key": client.private_key_pem,
    }
    for name, blob in files.items():
        blob.write_to_path(str(d / f"{name}.pem"))
    return Pki(**{name: str(d / f"{name}.pem") for name in files})


@pytest.fixture(scope="module")
def tls_daemon(pki: Pki) -> Iterator[DaemonProcess]:
    with DaemonProcess(args=["--tls-cert", pki.cert, "--tls-key", pki.key]) as d:
        yield d


def batch(rid: str) -> StepBatch:
    b = StepBatch()
    b.new(rid, list(range(40)), [0, 1, 2], computed=0, scheduled=40)
    return b


def health(address: str, *tls: str) -> int:
    return subprocess.run([sys.executable, "-m", "kvdepotd", "health", address, *tls], capture_output=True).returncode


def test_tls_clients_are_served_on_grpc_and_on_a_tls_lane(tls_daemon: DaemonProcess, pki: Pki) -> None:
    assert "with TLS on TCP" in tls_daemon.log()
    with DepotClient(tls_daemon.tcp, strict=True, deadline_s=5.0, tls=Tls(ca=pki.ca)) as c:
        c.register_engine("m-tls", LAYOUT)
        assert [op.kind for op in c.step(batch("a")).ops] == ["store"]
        assert not c.lookup("q", list(range(40))).degraded
        assert isinstance(c._lane._sock, ssl.SSLSocket)  # the engine path went on the lane, over TLS
        _, host, port = c._lane._target  # type: ignore[misc]
    with socket.create_connection((host, port), timeout=5) as s:  # a plaintext frame gets no answer
        s.sendall(struct.pack("<I", 2) + b"\x08\x01")
        with pytest.raises(OSError):
            if not s.recv(8):
                raise ConnectionResetError("closed without an answer")
    with DepotClient(tls_daemon.tcp, strict=True, deadline_s=5.0, tls=Tls(ca=pki.ca), lane=False) as c:
        c.register_engine("m-tls-grpc", LAYOUT)
        assert c.step(batch("a")).ops and c._lane._sock is None
    assert health(tls_daemon.tcp, "--tls-ca", pki.ca) == 0


def test_the_asyncio_client_speaks_tls_too(tls_daemon: DaemonProcess, pki: Pki) -> None:
    async def main() -> None:
        c = AsyncDepotClient(tls_daemon.tcp, strict=True, deadline_s=5.0, tls=Tls(ca=pki.ca))
        await c.register_engine("m-tls-async", LAYOUT)
        assert [op.kind for op in (await c.step(batch("a"))).ops] == ["store"]
        assert c._lane._conn is not None and c._lane._conn[1].get_extra_info("ssl_object") is not None
        await c.close()

    asyncio.run(main())


def test_plaintext_and_untrusted_clients_are_refused(tls_daemon: DaemonProcess, pki: Pki) -> None:
    for tls in (None, Tls(ca=pki.other_ca)):
        with DepotClient(tls_daemon.tcp, strict=True, deadline_s=2.0, tls=tls) as c, pytest.raises(Unavailable):
            c.register_engine("m-refused", LAYOUT)
    assert health(tls_daemon.tcp) == 1


def test_the_unix_socket_stays_plaintext_with_its_lane(tls_daemon: DaemonProcess, pki: Pki) -> None:
    with DepotClient(tls_daemon.unix, strict=True, deadline_s=5.0) as c:
        c.register_engine("m-unix", LAYOUT)
        assert c._lane._target is not None and c._lane._target[0] == "unix"
        assert c.step(batch("a")).ops
        assert c._lane._sock is not None
    with pytest.raises(ValueError, match="Unix socket"):
        DepotClient(tls_daemon.unix, tls=Tls(ca=pki.ca))


def test_mutual_tls_asks_for_a_client_certificate(pki: Pki) -> None:
    with DaemonProcess(args=["--tls-cert", pki.cert, "--tls-key", pki.key, "--tls-client-ca", pki.ca]) as d:
        assert "client certificates required" in d.log()
        with DepotClient(d.tcp, strict=True, deadline_s=2.0, tls=Tls(ca=pki.ca)) as c, pytest.raises(Unavailable):
            c.register_engine("m-no-cert", LAYOUT)
        with DepotClient(d.tcp, strict=True, deadline_s=5.0, tls=Tls(pki.ca, pki.client_cert, pki.client_key)) as c:
            c.register_engine("m-cert", LAYOUT)
            assert c.step(batch("a")).ops
            assert isinstance(c._lane._sock, ssl.SSLSocket)  # the lane asked for the certificate too
            _, host, port = c._lane._target  # type: ignore[misc]
        no_cert = ssl.create_default_context(cafile=pki.ca)
        with socket.create_connection((host, port), timeout=5) as raw, pytest.raises(OSError):
            with no_cert.wrap_socket(raw, server_hostname=host) as s:  # TLS 1.3 reports the refusal on first read
                s.sendall(struct.pack("<I", 2) + b"\x08\x01")
                if not s.recv(8):
                    raise ConnectionResetError("closed without an answer")
        assert health(d.tcp, "--tls-ca", pki.ca, "--tls-cert", pki.client_cert, "--tls-key", pki.client_key) == 0


def test_tls_files_that_cannot_be_read_stop_the_start(pki: Pki, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="TLS: cannot read the certificate file"):
        DaemonProcess(args=["--tls-cert", str(tmp_path / "missing.pem"), "--tls-key", pki.key]).start(timeout_s=30)
    with pytest.raises(RuntimeError, match="are not a PEM certificate and its private key"):  # a key that is not this certificate's, or not PEM at all
        DaemonProcess(args=["--tls-cert", pki.cert, "--tls-key", pki.ca]).start(timeout_s=30)
    with pytest.raises(ValueError, match="cannot read the ca file"):
        DepotClient("127.0.0.1:1", tls=Tls(ca=str(tmp_path / "missing.pem")))


def test_tokens_ride_on_tls(pki: Pki, tmp_path: Path) -> None:
    token = "team-a-token-0123456789"
    (tmp_path / "tokens.toml").write_text(f'[namespaces]\nteam-a = "{token}"\n')
    with DaemonProcess(args=["--tls-cert", pki.cert, "--tls-key", pki.key, "--auth-file", str(tmp_path / "tokens.toml")]) as d:
        assert "tokens travel in plaintext" not in d.log()  # TCP is TLS; the Unix socket stays local
        with DepotClient(d.tcp, strict=True, deadline_s=5.0, tls=Tls(ca=pki.ca), token=token) as c:
            c.register_engine("m-tls-token", LAYOUT)
            assert c.engines()[0].namespace == "team-a"
            assert c.step(batch("a")).ops
        with DepotClient(d.tcp, strict=True, deadline_s=5.0, tls=Tls(ca=pki.ca)) as c, pytest.raises(Unauthenticated):
            c.register_engine("m-tls-no-token", LAYOUT)
    with pytest.raises(ValueError, match="printable ASCII"):
        DepotClient("127.0.0.1:1", token="two words")
