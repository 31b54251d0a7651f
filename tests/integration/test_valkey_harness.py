"""The test Valkey harness itself: a port taken between picking and binding is picked again, and a
server that dies is reported with its own log (CI once lost a cluster to a bare "did not answer")."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from kvdepot.testing import valkey
from kvdepot.testing.valkey import PortTaken, ValkeyCluster


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


def test_free_ports_are_distinct() -> None:
    ports = valkey.free_ports(64)
    assert len(set(ports)) == 64


def test_a_port_taken_before_the_server_binds_it_is_picked_again(monkeypatch: pytest.MonkeyPatch, taken_port: int) -> None:
    picks: list[list[int]] = []
    free_ports = valkey.free_ports

    def first_pick_has_a_taken_port(n: int) -> list[int]:
        ports = free_ports(n)
        if not picks:
            ports[1] = taken_port
        picks.append(ports)
        return ports

    monkeypatch.setattr(valkey, "free_ports", first_pick_has_a_taken_port)
    with ValkeyCluster(primaries=3) as vc:
        assert len(picks) == 2 and taken_port not in vc.ports + vc.bus_ports
        assert vc.command("CLUSTER", "INFO").decode().count("cluster_state:ok") == 1


def test_a_server_that_cannot_bind_says_so_with_its_log(monkeypatch: pytest.MonkeyPatch, taken_port: int) -> None:
    monkeypatch.setattr(valkey, "free_ports", lambda n: [taken_port] * n)
    with pytest.raises(PortTaken, match=f"valkey on port {taken_port} exited with 1; its log ends:\n(.|\n)*Address already in use"):
        ValkeyCluster(primaries=1, cluster=False).start()


def test_a_server_that_dies_for_another_reason_is_not_retried() -> None:
    vc = ValkeyCluster(primaries=1, cluster=False, args=["--no-such-option", "1"])
    with pytest.raises(RuntimeError, match="exited with 1; its log ends:\n(.|\n)*no-such-option") as e:
        vc.start()
    assert not isinstance(e.value, PortTaken)
