"""The vLLM connector's kv_connector_extra_config: defaults, coercion, and errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdepot.layout import KvLayout
from kvdepot.connector.config import ConnectorConfig


def test_defaults_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVDEPOT_ADDRESS", raising=False)
    cfg = ConnectorConfig.from_extra(None)
    assert cfg.address == "127.0.0.1:50061" and not cfg.load_async and cfg.lookup_timeout_ms == 50
    monkeypatch.setenv("KVDEPOT_ADDRESS", "unix:/run/kvdepot/kvdepotd.sock")
    assert ConnectorConfig.from_extra({}).address == "unix:/run/kvdepot/kvdepotd.sock"
    assert ConnectorConfig.from_extra({"address": "unix:///tmp/x.sock"}).address == "unix:///tmp/x.sock"


def test_the_token_comes_from_a_file_or_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for var in ("KVDEPOT_TOKEN", "KVDEPOT_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    assert ConnectorConfig.from_extra({}).token == ""
    monkeypatch.setenv("KVDEPOT_TOKEN", "from-env-0123456789")
    assert ConnectorConfig.from_extra({}).token == "from-env-0123456789"
    f = tmp_path / "token"
    f.write_text("from-file-0123456789\n")
    cfg = ConnectorConfig.from_extra({"token_file": str(f)})
    assert cfg.token == "from-file-0123456789" and "from-file" not in repr(cfg)  # never in a log line
    monkeypatch.setenv("KVDEPOT_TOKEN_FILE", str(f))
    assert ConnectorConfig.from_extra({}).token == "from-file-0123456789"
    monkeypatch.delenv("KVDEPOT_TOKEN_FILE")
    monkeypatch.setenv("KVDEPOT_TOKEN", "two words")
    with pytest.raises(ValueError, match="kvdepot: the token must be printable ASCII"):
        ConnectorConfig.from_extra({})
    with pytest.raises(ValueError, match="kvdepot: cannot read the token file"):
        ConnectorConfig.from_extra({"token_file": str(tmp_path / "missing")})


def test_values_are_coerced_from_json_and_cli_strings() -> None:
    cfg = ConnectorConfig.from_extra({"load_async": "true", "lookup_timeout_ms": "20", "release_timeout_s": 5, "namespace": "t1"})
    assert cfg.load_async is True and cfg.lookup_timeout_ms == 20 and cfg.release_timeout_s == 5.0 and cfg.namespace == "t1"


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"adress": "x"}, "unknown kv_connector_extra_config keys ['adress']"),
        ({"load_async": "maybe"}, "load_async must be true or false"),
        ({"lookup_timeout_ms": "soon"}, "lookup_timeout_ms must be a number"),
        ({"step_timeout_ms": 0}, "step_timeout_ms must be positive"),
        ({"namespace": 3}, "namespace must be a string"),
        ({"address": ""}, "address must name the daemon"),
        ({"late_load_checks": "sometimes"}, "late_load_checks must be auto, true or false"),
    ],
)
def test_bad_values_name_the_key(extra: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ConnectorConfig.from_extra(extra)


@pytest.mark.parametrize(
    "value, on_cpu, on_gpu",
    [(None, False, True), ("auto", False, True), (True, True, True), ("true", True, True), (False, False, False), ("false", False, False)],
)
def test_late_load_checks_by_device(value: object, on_cpu: bool, on_gpu: bool) -> None:
    """auto: late checks for a GPU KV cache only (on CPU the check competes with the forward)."""
    cfg = ConnectorConfig.from_extra({} if value is None else {"late_load_checks": value})
    cpu = KvLayout(num_layers=2, num_kv_heads=2, head_size=8, dtype="float16", block_size=16, kind="vllm_cpu")
    gpu = KvLayout(num_layers=2, num_kv_heads=2, head_size=8, dtype="float16", block_size=16, kind="vllm_flash")
    assert cfg.late_checks_for(cpu) is on_cpu and cfg.late_checks_for(gpu) is on_gpu
