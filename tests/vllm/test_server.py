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


def test_openai_server_second_completion_is_a_daemon_hit(model_dir: str, tmp_path: Any) -> None:
    (tmp_path / "tokens.toml").write_text(f'admin = "{ADMIN}"\n[namespaces]\nteam-a = "{TEAM}"\n')
    (tmp_path / "team-a.token").write_text(TEAM + "\n")
    # As a multi-tenant daemon should run: tokens, and KV memory only as handed-over memfds.
    with DaemonProcess(args=["--host-gib", "0.25", "--auth-file", str(tmp_path / "tokens.toml"), "--shm-paths", "false"]) as d:
        port = free_port()
        env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
        env["VLLM_SERVER_DEV_MODE"] = "1"  # enables POST /reset_prefix_cache
        kv = {"kv_connector": "KvDepotConnector", "kv_connector_module_path": "kvdepot.vllm", "kv_role": "kv_both",
              "kv_connector_extra_config": {"address": "unix://" + d.unix[len("unix:"):], "token_file": str(tmp_path / "team-a.token")}}
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--port", str(port),
            "--dtype", "float32", "--max-model-len", "512", "--enforce-eager", "--block-size", str(BLOCK),
            "--max-num-seqs", "8", "--kv-transfer-config", json.dumps(kv),
            "--shutdown-timeout", "10",  # a clean shutdown (vLLM's default, 0, kills its processes at once)
        ]
        log = open(tmp_path / "server.log", "w+")
        server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 180
            while True:
                assert server.poll() is None, open(tmp_path / "server.log").read()[-5000:]
                try:
                    with urllib.request.urlopen(base + "/health", timeout=2) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                assert time.monotonic() < deadline, "server did not come up"
                time.sleep(0.5)
            body = {"model": model_dir, "prompt": P, "max_tokens": 8, "temperature": 0}
            first = post(base + "/v1/completions", body)
            with DepotClient(d.tcp, strict=True, token=ADMIN) as c:
                # vLLM frees the request's blocks only once the daemon released it (its stores ended),
                # and a reset while they are held does nothing: wait for the release first.
                deadline = time.monotonic() + 30
                while any(c.slots(e.engine_id) for e in c.engines()) and time.monotonic() < deadline:
                    time.sleep(0.05)
                time.sleep(0.5)  # the engine's next steps pass the release on and free the blocks
                post(base + "/reset_prefix_cache")
                before = dict(c.stats().counters)
                second = post(base + "/v1/completions", body)
                after = dict(c.stats().counters)
                engines = c.engines()
            assert second["choices"][0]["text"] == first["choices"][0]["text"]
            assert after["loaded_blocks"] - before["loaded_blocks"] == 3  # P's three full blocks
            assert before["stored_blocks"] == 3
            assert len(engines) == 1  # EngineCore and the worker joined one engine by its key
            assert engines[0].namespace == "team-a"
            assert "(memory handed over)" in d.log()
        finally:
            server.terminate()
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, 9)
            log.seek(0)
            text = log.read()
            log.close()
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
