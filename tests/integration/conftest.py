from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvdepot import DepotClient, KvLayout
from kvdepot.testing import DaemonProcess

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_size=8, dtype="float16", block_size=16)


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    d = DaemonProcess(args=["--host-gib", "0.25", "--lease-ms", "5000"]).start()
    yield d
    rc = d.stop()
    log = d.log()
    assert rc == 0, log
    assert "Traceback" not in log, log


@pytest.fixture
def client(daemon: DaemonProcess) -> Iterator[DepotClient]:
    c = DepotClient(daemon.tcp, strict=True, deadline_s=5.0)
    c.register_engine("test-model", LAYOUT, name="pytest")
    yield c
    c.close()
