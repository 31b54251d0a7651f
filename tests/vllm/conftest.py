"""Fixtures of the real-vLLM stage (scripts/test-vllm, in .venv-vllm). Without vLLM installed
these tests are not collected at all, so the default run stays fast and needs no vLLM."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.vllm.engine import ENV

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]
else:
    os.environ.update(ENV)  # before vllm is imported anywhere


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from kvdepot.testing.tiny_llama import build_tiny_llama

    return build_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def expected(model_dir: str) -> dict[str, list[int]]:
    """Greedy outputs of every test prompt from vLLM without the connector (its own process)."""
    out = subprocess.run(
        [sys.executable, "-m", "tests.vllm.engine", model_dir], capture_output=True, text=True, timeout=300,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    )
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("BASELINE ")), None)
    assert out.returncode == 0 and line, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(line[len("BASELINE ") :])  # type: ignore[no-any-return]


@pytest.fixture
def fresh_llm() -> Iterator[list]:  # type: ignore[type-arg]
    """Engines a test makes are shut down after it (their KV caches are GiB-sized)."""
    made: list = []  # type: ignore[type-arg]
    yield made
    for llm in made:
        llm.llm_engine.engine_core.shutdown()
    made.clear()
    import gc

    gc.collect()
