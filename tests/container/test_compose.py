"""docker-compose.yml as shipped, brought up with podman-compose: the daemon and a vLLM engine
container (deploy/engine.Dockerfile) sharing the socket volume. OpenAI-API requests with a long
shared prefix go to the engine; the engine container is restarted (its own prefix cache gone) and
the prefix is then served from the daemon: the engine's `cached_tokens` and the daemon's hit
counters say so, and the outputs are the same."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kvdepot import DepotClient
from kvdepot.testing.daemon import free_port
from tests.container.conftest import DAEMON_IMAGE, ENGINE_IMAGE, RECIPE, ROOT, need_image, podman, wait_serving

pytestmark = pytest.mark.container
PREFIX = [(7 * i) % 500 + 3 for i in range(384)]  # 384 tokens: 24 blocks of 16 shared by every request
TAILS = [[(11 * i + 5 * k) % 500 + 3 for k in range(20)] for i in range(3)]


def post(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def wait_http(url: str, engine: str, timeout_s: float = 300) -> None:
    end = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > end:
            logs = podman("logs", engine, check=False)
            raise AssertionError(f"{url} did not answer within {timeout_s} s:\n{(logs.stdout + logs.stderr)[-4000:]}")
        time.sleep(1)


def complete(base: str, prompt: list[int]) -> tuple[list[Any], int]:
    r = post(base + "/v1/completions", {"model": "/models/tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 0})
    cached = (r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return r["choices"][0]["logprobs"]["tokens"], cached


@pytest.mark.timeout(900)
def test_compose_engine_restart_is_served_from_the_daemon(tmp_path: Path) -> None:
    need_image(DAEMON_IMAGE)
    need_image(ENGINE_IMAGE)
    project = f"kvt{os.getpid()}"
    ports = {k: str(free_port()) for k in ("KVDEPOT_PORT", "KVDEPOT_LANE_PORT", "KVDEPOT_METRICS_PORT", "KVDEPOT_ENGINE_PORT")}
    models = str(tmp_path / "models")
    os.mkdir(models)
    # The test model, made by the engine image itself (random weights, a real tokenizer).
    podman("run", "--rm", "-v", f"{models}:/out", "--entrypoint", "python3", ENGINE_IMAGE, "-c",
           "from kvdepot.testing.tiny_llama import build_tiny_llama; build_tiny_llama('/out/tiny')", timeout=300)
    env = {
        **os.environ, **ports, "KVDEPOT_MODELS": models, "KVDEPOT_MODEL": "tiny", "KVDEPOT_DTYPE": "float32",
        "KVDEPOT_MAX_MODEL_LEN": "1024", "KVDEPOT_HOST_GIB": "1", "KVDEPOT_DISK_GIB": "1", "KVDEPOT_ENGINE_KV_GIB": "1",
    }

    def compose(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        out = subprocess.run([RECIPE, "compose", "-p", project, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        assert out.returncode == 0, f"compose {args}: {out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        return out

    base = f"http://127.0.0.1:{ports['KVDEPOT_ENGINE_PORT']}"
    daemon = f"127.0.0.1:{ports['KVDEPOT_PORT']}"
    engine = f"{project}_engine_1"
    compose("up", "-d")
    try:
        wait_serving(daemon)
        wait_http(base + "/health", engine)
        first = [complete(base, PREFIX + t) for t in TAILS]
        assert first[0][1] == 0  # nothing cached anywhere yet
        assert all(c >= 256 for _, c in first[1:])  # the engine's own prefix cache (vLLM's hit)
        with DepotClient(daemon, strict=True) as c:
            (registered,) = c.engines()
            assert registered.model == "/models/tiny"
            bs = registered.layout.block_size  # vLLM's CPU build: 128 unless told otherwise
            blocks = len(PREFIX) // bs  # the prefix is whole blocks
            end = time.monotonic() + 30
            while c.stats().counters["stored_blocks"] < blocks and time.monotonic() < end:
                time.sleep(0.2)
            before = dict(c.stats().counters)
        assert before["stored_blocks"] >= blocks

        # The engine container restarts: its GPU/CPU prefix cache is gone, the daemon's is not.
        podman("restart", "-t", "30", engine, timeout=120)
        wait_http(base + "/health", engine)
        again = [complete(base, PREFIX + t) for t in TAILS]
        with DepotClient(daemon, strict=True) as c:
            after = dict(c.stats().counters)
        print(json.dumps({"block_size": bs, "cached_before_restart": [n for _, n in first], "cached_after_restart": [n for _, n in again],
                          "daemon_hit_tokens": after["lookup_hit_tokens"] - before["lookup_hit_tokens"],
                          "daemon_loaded_blocks": after["loaded_blocks"] - before["loaded_blocks"]}))
        assert [o for o, _ in again] == [o for o, _ in first]
        assert again[0][1] >= len(PREFIX), again[0][1]  # the whole prefix from the daemon
        assert after["lookup_hit_tokens"] - before["lookup_hit_tokens"] >= len(PREFIX)
        assert after["loaded_blocks"] - before["loaded_blocks"] >= blocks
        assert after["load_failed_blocks"] == before["load_failed_blocks"] == 0
    finally:
        logs = {name: subprocess.run([RECIPE, "podman", "logs", f"{project}_{name}_1"], capture_output=True, text=True, timeout=60)
                for name in ("kvdepotd", "engine")}
        compose("down", "-v", "-t", "30")
    for name, out in logs.items():
        assert out.returncode == 0, f"podman logs {name}: {out.stderr[-2000:]}"
    daemon_log, engine_log = (logs[n].stdout + logs[n].stderr for n in ("kvdepotd", "engine"))
    assert "kvdepotd serving on" in daemon_log and "Traceback" not in daemon_log, daemon_log[-3000:]
    # The engine's own log: every completion answered, and no traceback through kvdepot's code. (vLLM
    # itself may log one when its container stops: the API server's output handler finds its engine
    # core gone first. The connector's INFO lines go where vLLM sends the root logger's: nowhere.)
    assert engine_log.count('"POST /v1/completions HTTP/1.1" 200') >= 2 * len(TAILS), engine_log[-3000:]  # both lives
    ours = [ln for ln in engine_log.splitlines() if re.search(r'File "[^"]*/kvdepot/', ln)]
    assert not ours, "\n".join(ours[:20]) + "\n" + engine_log[-3000:]
