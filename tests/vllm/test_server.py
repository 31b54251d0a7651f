"""vLLM's OpenAI server with the connector, in vLLM's default multiprocess topology (API server,
EngineCore with the scheduler connector, a worker process with the worker connector), configured
only through --kv-transfer-config on the command line. Two completions of one prompt, the vLLM
prefix cache reset between them: the second is served by the daemon with the same text. The
daemon asks for tokens (--auth-file): the scheduler and the worker process each present theirs,
read from the connector's token_file, and the engine lands in the token's namespace."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

import kvdepot
from kvdepot import DepotClient
from kvdepot.testing import DaemonProcess
from kvdepot.testing.daemon import free_port
from tests.vllm.engine import BLOCK, P

ROOT = str(Path(os.path.abspath(__file__)).parents[2])  # as vLLM prints paths under it: not resolved

pytestmark = pytest.mark.vllm


def post(url: str, body: dict[str, Any] | None = None) -> Any:
    data = json.dumps(body).encode() if body is not None else b""
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=60) as r:
        text = r.read()
    return json.loads(text) if text else None


ADMIN, TEAM = "admin-token-0123456789", "team-a-token-0123456789"


class Server:
    """vLLM's OpenAI server (its own process tree) with the connector, started by the constructor."""

    def __init__(self, model_dir: str, kv: dict[str, Any], log_path: Path) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
        env["VLLM_SERVER_DEV_MODE"] = "1"  # enables POST /reset_prefix_cache
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--port", str(self.port),
            "--dtype", "float32", "--max-model-len", "512", "--enforce-eager", "--block-size", str(BLOCK),
            "--max-num-seqs", "8", "--kv-transfer-config", json.dumps(kv),
            # A clean shutdown (vLLM's default, 0, kills its processes at once), with room: it took 6 s on a
            # quiet 2-core machine, and past the timeout vLLM kills EngineCore before it can unregister.
            "--shutdown-timeout", "30",
        ]
        self.log_path = log_path
        self.log = open(log_path, "w+")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + 240
        while True:
            assert self.proc.poll() is None, self.log_path.read_text()[-5000:]
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.5)

    def complete(self, model_dir: str, prompt: list[int]) -> str:
        body = {"model": model_dir, "prompt": prompt, "max_tokens": 8, "temperature": 0}
        return str(post(self.base + "/v1/completions", body)["choices"][0]["text"])

    def stop(self) -> str:
        """Stops the server; its log."""
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
        self.log.seek(0)
        text = self.log.read()
        self.log.close()
        return text


def wait_released(c: DepotClient) -> None:
    """vLLM frees a request's blocks only once the daemon released it (its stores ended), and a
    reset while they are held does nothing: waits for the release first."""
    deadline = time.monotonic() + 30
    while any(c.slots(e.engine_id) for e in c.engines()) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # the engine's next steps pass the release on and free the blocks


def test_openai_server_second_completion_is_a_daemon_hit(model_dir: str, tmp_path: Any) -> None:
    (tmp_path / "tokens.toml").write_text(f'admin = "{ADMIN}"\n[namespaces]\nteam-a = "{TEAM}"\n')
    (tmp_path / "team-a.token").write_text(TEAM + "\n")
    # As a multi-tenant daemon should run: tokens, and KV memory only as handed-over memfds.
    with DaemonProcess(args=["--host-gib", "0.25", "--auth-file", str(tmp_path / "tokens.toml"), "--shm-paths", "false"]) as d:
        kv = {"kv_connector": "KvDepotConnector", "kv_connector_module_path": "kvdepot.vllm", "kv_role": "kv_both",
              "kv_connector_extra_config": {"address": "unix://" + d.unix[len("unix:"):], "token_file": str(tmp_path / "team-a.token")}}
        server = Server(model_dir, kv, tmp_path / "server.log")
        text = ""
        try:
            server.wait_healthy()
            first = server.complete(model_dir, P)
            with DepotClient(d.tcp, strict=True, token=ADMIN) as c:
                wait_released(c)
                post(server.base + "/reset_prefix_cache")
                before = dict(c.stats().counters)
                second = server.complete(model_dir, P)
                after = dict(c.stats().counters)
                engines = c.engines()
            assert second == first
            assert after["loaded_blocks"] - before["loaded_blocks"] == 3  # P's three full blocks
            assert before["stored_blocks"] == 3
            assert len(engines) == 1  # EngineCore and the worker joined one engine by its key
            assert engines[0].namespace == "team-a"
            assert "(memory handed over)" in d.log()
        finally:
            text = server.stop()
        # vLLM logs its own shutdown (EngineDeadError on terminate, with a traceback through vLLM's
        # files, which live under the checkout when its venv does); nothing may come from kvdepot:
        # no traceback through the connector's files and no error naming it, the checkout's own
        # path (which may hold the word) left out.
        own = os.path.dirname(kvdepot.__file__) + os.sep
        assert own not in text and "Failed to reset prefix cache" not in text, text[-5000:]
        lines = [ln.replace(ROOT, "") for ln in text.splitlines()]
        assert not [ln for ln in lines if "ERROR" in ln and "kvdepot" in ln], text[-5000:]
        # A clean shutdown unregisters both processes: the engine is gone now, not at its lease's expiry.
        with DepotClient(d.tcp, strict=True, token=ADMIN) as c:
            deadline = time.monotonic() + 10
            while c.engines() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not c.engines(), d.log()[-3000:]
        assert "one of its processes unregistered" in d.log() and "lease expired" not in d.log(), d.log()[-3000:]


def test_two_servers_with_one_config_keep_their_own_engines(model_dir: str, tmp_path: Any) -> None:
    """Two servers of one model on one node started with the very same --kv-transfer-config,
    engine_id included (vLLM keeps a given engine_id as it is): each is an engine of its own at the
    daemon (its key minted by its own tensor-parallel rank 0), and each serves its own prompt from
    the daemon after a reset, byte for byte what it computed."""
    with DaemonProcess(args=["--host-gib", "0.25"]) as d:
        kv = {"kv_connector": "KvDepotConnector", "kv_connector_module_path": "kvdepot.vllm", "kv_role": "kv_both",
              "engine_id": "one-id-for-both", "kv_connector_extra_config": {"address": "unix://" + d.unix[len("unix:"):]}}
        servers = [Server(model_dir, kv, tmp_path / f"server-{i}.log") for i in range(2)]
        prompts = [P, [p + 300 for p in P]]  # within the tiny model's 512 tokens
        try:
            for s in servers:
                s.wait_healthy()
            with DepotClient(d.tcp, strict=True) as c:
                engines = c.engines()
                assert len(engines) == 2 and all(list(e.mapped_ranks) == [0] for e in engines), engines
                first = [s.complete(model_dir, p) for s, p in zip(servers, prompts)]
                wait_released(c)
                for s in servers:
                    post(s.base + "/reset_prefix_cache")
                before = dict(c.stats().counters)
                second = [s.complete(model_dir, p) for s, p in zip(servers, prompts)]
                after = dict(c.stats().counters)
            assert second == first
            assert before["stored_blocks"] == 6 and after["loaded_blocks"] - before["loaded_blocks"] == 6
        finally:
            for s in servers:
                s.stop()
