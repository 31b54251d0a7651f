"""TLS on the daemon's TCP addresses (--tls-cert/--tls-key, mutual with --tls-client-ca): TLS
clients are served, plaintext ones and ones trusting another CA are not, Unix sockets stay
plaintext with their lane, no plaintext TCP lane is opened, and the health command speaks TLS."""

from __future__ import annotations

import asyncio
import re
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


def test_tls_clients_are_served_and_no_plaintext_lane_is_used(tls_daemon: DaemonProcess, pki: Pki) -> None:
    assert "with TLS on TCP" in tls_daemon.log()
    with DepotClient(tls_daemon.tcp, strict=True, deadline_s=5.0, tls=Tls(ca=pki.ca)) as c:
        c.register_engine("m-tls", LAYOUT)
        assert c._lane._target is None  # a TLS client never sends its engine path in the clear
        assert [op.kind for op in c.step(batch("a")).ops] == ["store"]
        assert not c.lookup("q", list(range(40))).degraded
    assert health(tls_daemon.tcp, "--tls-ca", pki.ca) == 0


def test_the_asyncio_client_speaks_tls_too(tls_daemon: DaemonProcess, pki: Pki) -> None:
    async def main() -> None:
        c = AsyncDepotClient(tls_daemon.tcp, strict=True, deadline_s=5.0, tls=Tls(ca=pki.ca))
        await c.register_engine("m-tls-async", LAYOUT)
        assert c._lane._target is None
        assert [op.kind for op in (await c.step(batch("a"))).ops] == ["store"]
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
    lanes = re.search(r"\(lanes ([^)]*)\)", tls_daemon.log())
    assert lanes is not None and all(lane.startswith("unix:") for lane in lanes.group(1).split(", "))  # no TCP lane
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
