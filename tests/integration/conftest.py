from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvdepot import DepotClient, KvLayout
from kvdepot.testing import DaemonProcess, FakeEngine

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_size=8, dtype="float16", block_size=16)


def attached_engine(d: DaemonProcess, lay: KvLayout, model: str, strict: bool = True, deadline_s: float = 5.0, **kw: object) -> FakeEngine:
    """A FakeEngine registered with the daemon as `model`, its workers' streams attached."""
    c = DepotClient(d.tcp, strict=strict, deadline_s=deadline_s)
    c.register_engine(model, lay)
    e = FakeEngine(c, layout=lay, **kw)  # type: ignore[arg-type]
    for w in e.workers:
        assert w.attached.wait(5)
    return e


def close_engine(e: FakeEngine) -> None:
    e.client.close()
    assert e.kv is not None
    e.kv.close()


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
