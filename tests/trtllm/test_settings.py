"""The TensorRT-LLM connector's settings, key and layout, without a daemon."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvdepot.connector.instance import Instance, mint
from kvdepot.trtllm.common import check_args, layout_of, settings
from kvdepot.testing.trtllm import KvCacheConfig, TorchLlmArgs


def args(**kw: object) -> TorchLlmArgs:
    return TorchLlmArgs(model="m", kv_cache_config=KvCacheConfig(tokens_per_block=16), **kw)  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("KVDEPOT_ADDRESS", "KVDEPOT_NAMESPACE", "KVDEPOT_LOAD_ASYNC", "KVDEPOT_CONNECTOR_CONFIG", "KVDEPOT_TOKEN", "KVDEPOT_TOKEN_FILE", "PMIX_NAMESPACE"):
        monkeypatch.delenv(var, raising=False)


def test_settings_from_variables_and_a_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    f = tmp_path / "kvdepot.toml"
    f.write_text('address = "unix:/run/kvdepot/kvdepotd.sock"\nnamespace = "team-a"\nlookup_timeout_ms = 20\n')
    monkeypatch.setenv("KVDEPOT_CONNECTOR_CONFIG", str(f))
    monkeypatch.setenv("KVDEPOT_NAMESPACE", "team-b")  # a variable wins over the file
    monkeypatch.setenv("KVDEPOT_LOAD_ASYNC", "true")
    cfg = settings(args())
    assert (cfg.address, cfg.namespace, cfg.lookup_timeout_ms, cfg.load_async, cfg.engine_name) == ("unix:/run/kvdepot/kvdepotd.sock", "team-b", 20, True, "trtllm")
    j = tmp_path / "kvdepot.json"
    j.write_text(json.dumps({"step_timeout_ms": 250}))
    monkeypatch.setenv("KVDEPOT_CONNECTOR_CONFIG", str(j))
    assert settings(args()).step_timeout_ms == 250
    y = tmp_path / "kvdepot.yaml"  # the format of TensorRT-LLM's own options file
    y.write_text("namespace: team-c\nload_async: false\nrelease_timeout_s: 10\n")
    monkeypatch.setenv("KVDEPOT_CONNECTOR_CONFIG", str(y))
    monkeypatch.delenv("KVDEPOT_NAMESPACE")
    cfg = settings(args())
    assert (cfg.namespace, cfg.load_async, cfg.release_timeout_s) == ("team-c", True, 10.0)  # KVDEPOT_LOAD_ASYNC still wins
    y.write_text("namespace: [unclosed\n")
    with pytest.raises(ValueError, match="kvdepot.yaml"):
        settings(args())


def test_the_client_tls_variables_are_apart_from_the_daemons(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """KVDEPOT_TLS_CERT and _KEY are the daemon's own certificate: a connector beside it takes its
    own from KVDEPOT_CLIENT_TLS_*."""
    monkeypatch.setenv("KVDEPOT_ADDRESS", "daemon.local:50061")
    monkeypatch.setenv("KVDEPOT_TLS_CERT", "/etc/kvdepotd/server.pem")
    monkeypatch.setenv("KVDEPOT_TLS_KEY", "/etc/kvdepotd/server.key")
    assert settings(args()).tls() is None
    monkeypatch.setenv("KVDEPOT_CLIENT_TLS_CA", "ca.pem")
    monkeypatch.setenv("KVDEPOT_CLIENT_TLS_CERT", "engine.pem")
    monkeypatch.setenv("KVDEPOT_CLIENT_TLS_KEY", "engine.key")
    cfg = settings(args())
    assert (cfg.tls_ca, cfg.tls_cert, cfg.tls_key) == ("ca.pem", "engine.pem", "engine.key")


def test_settings_refuse_what_is_wrong(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    f = tmp_path / "bad.json"
    f.write_text(json.dumps({"adress": "x"}))
    monkeypatch.setenv("KVDEPOT_CONNECTOR_CONFIG", str(f))
    with pytest.raises(ValueError, match="unknown .* keys \\['adress'\\]"):
        settings(args())
    monkeypatch.setenv("KVDEPOT_CONNECTOR_CONFIG", str(tmp_path / "missing.toml"))
    with pytest.raises(ValueError, match="missing.toml"):
        settings(args())
    monkeypatch.delenv("KVDEPOT_CONNECTOR_CONFIG")
    monkeypatch.setenv("KVDEPOT_LOOKUP_TIMEOUT_MS", "soon")
    with pytest.raises(ValueError, match="lookup_timeout_ms must be a number"):
        settings(args())
    monkeypatch.delenv("KVDEPOT_LOOKUP_TIMEOUT_MS")
    monkeypatch.setenv("KVDEPOT_LATE_LOAD_CHECKS", "true")
    with pytest.raises(ValueError, match="late_load_checks cannot be on"):
        settings(args())
    monkeypatch.setenv("KVDEPOT_LATE_LOAD_CHECKS", "auto")
    assert settings(args()).late_load_checks == "false"


def test_server_url_of_newer_releases_is_the_address(monkeypatch: pytest.MonkeyPatch) -> None:
    a = args(kv_connector_config=SimpleNamespace(server_url="127.0.0.1:6000"))
    assert settings(a).address == "127.0.0.1:6000"
    monkeypatch.setenv("KVDEPOT_ADDRESS", "unix:/run/k.sock")
    assert settings(a).address == "unix:/run/k.sock"


def test_each_instance_mints_its_own_key_whatever_the_environment_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The job ids an MPI or Slurm launch sets are the same for every server one job starts: the
    key is minted, never derived from them."""
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    monkeypatch.setenv("PMIX_NAMESPACE", "prterun-host-1234@1")
    a, b = mint("trtllm", "m"), mint("trtllm", "m")
    assert a != b and a.startswith("trtllm:") and ":m:" in a and "777" not in a
    assert len(a.rsplit(":", 1)[1]) == 32  # 128 secret bits


def test_an_instance_is_found_by_its_config_object_only() -> None:
    """A worker finds its scheduler in its own process through the one llm_args object both got; an
    equal but other object (another instance in the same process) is another instance."""
    one, other = args(), args()
    assert one == other and Instance.of(one) is Instance.of(one) and Instance.of(one) is not Instance.of(other)
    seen: list[str] = []
    inst = Instance.of(one)
    inst.when_keyed(seen.append)
    assert seen == []
    inst.set_key("k1")
    inst.when_keyed(seen.append)
    assert seen == ["k1", "k1"]


def test_layout_from_the_pool() -> None:
    lay = layout_of(torch.empty(10, 4, 2, 8 * 16 * 64, dtype=torch.bfloat16), args())
    assert (lay.num_layers, lay.num_kv_heads, lay.head_size, lay.kv_factor, lay.block_size, lay.kind) == (4, 1, 512, 2, 16, "trtllm")
    assert lay.layout_class == "L4xH1xD512xbfloat16xB16xW1-trtllm"
    mla = layout_of(torch.empty(10, 4, 1, 576 * 16, dtype=torch.float16), args(tensor_parallel_size=2))
    assert mla.kv_factor == 1 and mla.world_size == 2 and mla.layout_class.endswith("W2xK1-trtllm")
    with pytest.raises(ValueError, match="not a multiple of tokens_per_block"):
        layout_of(torch.empty(10, 4, 2, 100, dtype=torch.float16), args())
    with pytest.raises(ValueError, match="shape"):
        layout_of(torch.empty(10, 4, 2, 16, 8, dtype=torch.float16), args())


def test_what_the_connector_refuses_at_start() -> None:
    """docs/trtllm.md's list of limits, each checked where the engine starts."""
    from kvdepot.testing.trtllm import SchedulerConfig

    assert check_args(args(pipeline_parallel_size=2)).startswith("pipeline parallelism")
    assert check_args(args(max_beam_width=2)) == "beam width must be 1"
    assert check_args(args(backend="tensorrt")).startswith("the connector API needs the PyTorch backend")
    assert check_args(args(enable_attention_dp=True)).startswith("attention data parallelism")
    assert "set kv_cache_config.enable_block_reuse: true" in check_args(
        TorchLlmArgs(model="m", kv_cache_config=KvCacheConfig(tokens_per_block=16, enable_block_reuse=False))
    )
    assert "needs GUARANTEED_NO_EVICT" in check_args(args(scheduler_config=SchedulerConfig("MAX_UTILIZATION")))
    assert check_args(args()) == ""


def test_server_url_in_the_documented_form(monkeypatch: pytest.MonkeyPatch) -> None:
    """TensorRT-LLM documents kv_connector_config.server_url as tcp://host:port."""
    assert settings(args(kv_connector_config=SimpleNamespace(server_url="tcp://daemon-1:50061"))).address == "daemon-1:50061"
    with pytest.raises(ValueError, match="must be tcp://HOST:PORT"):
        settings(args(kv_connector_config=SimpleNamespace(server_url="tcp://daemon-1")))
    monkeypatch.setenv("KVDEPOT_ADDRESS", "tcp://10.0.0.7:6000")
    assert settings(args()).address == "10.0.0.7:6000"
