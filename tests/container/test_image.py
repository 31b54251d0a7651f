"""The daemon's image (./Dockerfile, unchanged), run as a sidecar would run it: health inside the
container, the socket volume and the published port from outside, a real engine (FakeEngine with
real KV memory, handed over as memfds) through the socket volume, SIGTERM draining to exit 0, and
the disk tier's volume serving its blocks to a new container of the image (an upgrade). The first
container runs with a read-only root file system, as deploy/kubernetes runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest

from kvdepot import DepotClient, KvLayout
from kvdepot.testing import FakeEngine
from kvdepot.testing.daemon import free_port
from tests.container.conftest import DAEMON_IMAGE, inspect, need_image, podman, volume_path, wait_serving

pytestmark = pytest.mark.container
LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_size=8, dtype="float16", block_size=16, kind="vllm_cpu")  # real KV bytes, every position checked
PROMPT = list(range(1000, 1300))  # 18 full blocks of 16


def run_daemon(name: str, volumes: dict[str, str], port: int, metrics_port: int, *extra: str) -> None:
    podman(
        "run", "-d", "--name", name, "--shm-size", "512m", *extra,
        "-v", f"{volumes['sock']}:/run/kvdepot", "-v", f"{volumes['disk']}:/var/lib/kvdepot",
        "-p", f"127.0.0.1:{port}:50061", "-p", f"127.0.0.1:{metrics_port}:9464",
        "-e", "KVDEPOT_HOST_GIB=0.25", "-e", "KVDEPOT_DISK_DIR=/var/lib/kvdepot", "-e", "KVDEPOT_DISK_GIB=0.25",
        "-e", "KVDEPOT_DISK_ADMIT_AFTER=1",
        DAEMON_IMAGE,
    )


def engine_at(address: str) -> FakeEngine:
    c = DepotClient(address, strict=True)
    c.register_engine("container-model", LAYOUT)
    e = FakeEngine(c, layout=LAYOUT)
    for w in e.workers:
        assert w.attached.wait(10)
    return e


@pytest.mark.timeout(300)
def test_image_serves_drains_and_keeps_its_disk_tier(volumes: dict[str, str], short_dir: str) -> None:
    need_image(DAEMON_IMAGE)
    port, mport = free_port(), free_port()
    tcp = f"127.0.0.1:{port}"
    first = f"{volumes['sock']}-a"
    # A read-only root file system, as the Kubernetes example runs it: the daemon writes only to its
    # volumes and /dev/shm.
    run_daemon(first, volumes, port, mport, "--read-only", "--read-only-tmpfs=false")
    wait_serving(tcp)
    # Health as the image declares it (podman runs the HEALTHCHECK on demand: no systemd timer here).
    assert podman("healthcheck", "run", first).returncode == 0
    inside = podman("exec", first, "kvdepotd", "health", "unix:/run/kvdepot/kvdepotd.sock")
    assert "SERVING" in inside.stdout
    assert "compiled" in podman("exec", first, "kvdepotd", "--version").stdout
    assert podman("exec", first, "id", "-u").stdout.strip() == "10001"
    # The published metrics port.
    with urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=5) as r:
        assert b"kvdepot_engines " in r.read()

    # A real engine round trip through the socket volume, as an engine container would make it.
    sock = "unix:" + os.path.join(volume_path(volumes["sock"], short_dir), "kvdepotd.sock")
    e = engine_at(sock)
    out = e.generate(PROMPT, max_new_tokens=2)
    e.reset_prefix_cache()
    again = e.generate(PROMPT, max_new_tokens=2)
    assert again.output == out.output and e.stats.loaded_tokens >= 17 * 16 and e.stats.kv_mismatched_tokens == 0
    e.client.close()
    load = subprocess.run([sys.executable, "-m", "kvdepot.testing.workload", sock, "--seconds", "2"], capture_output=True, text=True, timeout=60)
    assert load.returncode == 0, load.stdout + load.stderr

    # SIGTERM drains (the disk tier is write-back: what the host tier holds goes to disk now) and
    # exits 0 well within the stop timeout.
    t0 = time.monotonic()
    podman("stop", "-t", "30", first)
    stopped_in = time.monotonic() - t0
    state = inspect(first)["State"]
    logs = podman("logs", first).stderr + podman("logs", first).stdout
    assert state["ExitCode"] == 0 and stopped_in < 15, (state, logs[-2000:])
    assert "SIGTERM" in logs or "draining" in logs

    # A new container of the image (an upgrade) on the same volumes: the blocks are still there.
    podman("rm", first)
    second = f"{volumes['sock']}-b"
    run_daemon(second, volumes, port, mport)
    wait_serving(tcp)
    with DepotClient(tcp, strict=True) as c:
        assert c.stats().disk_recovered_blocks >= 17
    e2 = engine_at(sock)
    hit = e2.client.lookup("after-restart", PROMPT)
    assert hit.matched_tokens >= 17 * 16, hit
    served = e2.generate(PROMPT, max_new_tokens=2)
    assert served.output == out.output and e2.stats.loaded_tokens >= 17 * 16 and e2.stats.kv_mismatched_tokens == 0
    e2.client.close()
    podman("stop", "-t", "30", second)
    assert inspect(second)["State"]["ExitCode"] == 0


def test_image_refuses_a_bad_setting_clearly() -> None:
    need_image(DAEMON_IMAGE)
    out = podman("run", "--rm", "-e", "KVDEPOT_HOST_GIB=lots", DAEMON_IMAGE, check=False)
    assert out.returncode == 2, out
    assert "KVDEPOT_HOST_GIB" in out.stderr and "lots" in out.stderr
    version = podman("run", "--rm", DAEMON_IMAGE, "--version")
    assert json.dumps(version.stdout).startswith('"kvdepotd ')
