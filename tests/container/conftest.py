"""The container stage: the images `scripts/container build` made, run with podman through
`scripts/container podman` (all state in the recipe's own folder). Without podman or the images
these tests skip, unless KVDEPOT_REQUIRE_CONTAINERS=1 (CI's stage) makes that a failure."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "scripts" / "container")
DAEMON_IMAGE = os.environ.get("KVDEPOT_IMAGE", "localhost/kvdepotd:latest")
ENGINE_IMAGE = os.environ.get("KVDEPOT_ENGINE_IMAGE", "localhost/kvdepot-engine:latest")


def podman(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([RECIPE, "podman", *args], capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} -> {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out


def need_image(image: str) -> None:
    why = ""
    if shutil.which("podman") is None:
        why = "podman is not installed (scripts/container setup)"
    elif podman("image", "exists", image, check=False).returncode != 0:
        why = f"no image {image} (scripts/container build)"
    if why:
        if os.environ.get("KVDEPOT_REQUIRE_CONTAINERS") == "1":
            pytest.fail(why)
        pytest.skip(why)


def volume_path(name: str, within: str) -> str:
    """The volume's folder on this machine, by a symlink in `within` (a `short_dir`): a socket's
    path must fit in 108 bytes, and the volume's own path under a deep checkout's .containers/
    does not always."""
    mount = podman("volume", "inspect", name, "--format", "{{.Mountpoint}}").stdout.strip()
    link = os.path.join(within, name)
    os.symlink(mount, link)
    return link


@pytest.fixture
def short_dir() -> Iterator[str]:
    """A folder on a short path for one test, removed after it."""
    d = tempfile.mkdtemp(prefix="kvt-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def wait_serving(address: str, timeout_s: float = 60) -> None:
    end = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            assert time.monotonic() < end, f"{address} did not answer SERVING within {timeout_s} s"
            time.sleep(0.2)


def inspect(name: str) -> dict[str, Any]:
    return json.loads(podman("inspect", name).stdout)[0]  # type: ignore[no-any-return]


@pytest.fixture
def volumes(request: pytest.FixtureRequest) -> Iterator[dict[str, str]]:
    """Fresh named volumes for one test, removed after it (with any container left using them)."""
    tag = f"kvt-{os.getpid()}-{request.node.name[-20:].replace('_', '-')}"
    names = {"sock": f"{tag}-sock", "disk": f"{tag}-disk"}
    for n in names.values():
        podman("volume", "create", n)
    yield names
    left = podman("ps", "-aq", "--filter", f"name={tag}", check=False).stdout.split()
    if left:
        podman("rm", "-f", "-t", "0", *left, check=False)
    for n in names.values():
        podman("volume", "rm", "-f", n, check=False)
