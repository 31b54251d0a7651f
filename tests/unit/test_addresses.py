"""Unix socket addresses over the system's 107-byte limit are refused by the clients with a message
that says so, before gRPC's bare "target uri is not valid" (the daemon's settings: test_config)."""

from __future__ import annotations

import pytest

from kvdepot import AsyncDepotClient, DepotClient
from kvdepot.lane import UNIX_PATH_MAX, check_unix_path
from kvdepot.tls import Tls, channel


def path_of(n: int) -> str:
    return "/tmp/" + "x" * (n - len("/tmp/") - len("/k.sock")) + "/k.sock"


def test_a_path_at_the_limit_is_accepted_and_one_byte_more_is_not() -> None:
    check_unix_path(path_of(UNIX_PATH_MAX))
    with pytest.raises(ValueError, match=f"is {UNIX_PATH_MAX + 1} bytes, over the system's limit of {UNIX_PATH_MAX}: use a shorter path"):
        check_unix_path(path_of(UNIX_PATH_MAX + 1))
    with pytest.raises(ValueError, match="is 109 bytes"):
        check_unix_path("/tmp/é" + "x" * 95 + "/k.sock")  # bytes, not characters


@pytest.mark.parametrize("client", [DepotClient, AsyncDepotClient])
@pytest.mark.parametrize("form", ["unix:", "unix://"])
def test_clients_refuse_a_socket_path_over_the_limit(client: type, form: str) -> None:
    with pytest.raises(ValueError, match="over the system's limit of 107"):
        client(form + path_of(UNIX_PATH_MAX + 1))
    channel(form + path_of(UNIX_PATH_MAX), None, []).close()  # lazily connecting: no daemon needed


def test_tls_over_a_unix_socket_is_refused() -> None:
    with pytest.raises(ValueError, match="TLS is for TCP addresses"):
        channel("unix:/tmp/k.sock", Tls(ca="ca.pem"), [])

