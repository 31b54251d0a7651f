from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvdepotd import cli, config, environment


def load(argv: list[str], env: dict[str, str] | None = None) -> config.DaemonConfig:
    args = cli.parser().parse_args(["serve", *argv])
    return config.load(args, env or {})


def test_defaults_need_no_options() -> None:
    cfg = load([])
    assert cfg.listen == (config.DEFAULT_LISTEN,) and cfg.host_gib == 4.0


def test_precedence_flags_over_env_over_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    f = tmp_path / "kvdepotd.toml"
    f.write_text('host_gib = 1.5\nlease_ms = 1000\nlisten = ["unix:/tmp/a.sock"]\nop-timeout-ms = 7\n')
    cfg = load(["--config", str(f)])
    assert (cfg.host_gib, cfg.lease_ms, cfg.listen, cfg.op_timeout_ms) == (1.5, 1000, ("unix:/tmp/a.sock",), 7)
    cfg = load(["--config", str(f)], {"KVDEPOT_HOST_GIB": "2", "KVDEPOT_LISTEN": "127.0.0.1:1,unix:/tmp/b"})
    assert cfg.host_gib == 2.0 and cfg.listen == ("127.0.0.1:1", "unix:/tmp/b") and cfg.lease_ms == 1000
    cfg = load(["--config", str(f), "--host-gib", "3", "--listen", "127.0.0.1:2", "--listen", "127.0.0.1:3"], {"KVDEPOT_HOST_GIB": "2"})
    assert cfg.host_gib == 3.0 and cfg.listen == ("127.0.0.1:2", "127.0.0.1:3")
    cfg = load([], {"KVDEPOT_CONFIG": str(f)})
    assert cfg.lease_ms == 1000


@pytest.mark.parametrize(
    "argv, env, words",
    [
        (["--host-gib", "-1"], {}, "--host-gib"),
        (["--listen", "nowhere"], {}, "HOST:PORT"),
        (["--listen", "unix:/tmp/" + "x" * 88 + "/k.sock"], {}, "with its .handoff socket beside it is 108 bytes, over the system's limit of 107"),
        ([], {"KVDEPOT_LISTEN": "unix:/tmp/" + "x" * 88 + "/k.sock"}, "KVDEPOT_LISTEN"),
        (["--log-level", "loud"], {}, "one of"),
        ([], {"KVDEPOT_LEASE_MS": "soon"}, "KVDEPOT_LEASE_MS"),
        (["--eviction-policy", "fifo"], {}, "leaf-lru"),
        (["--lane-port", "70000"], {}, "--lane-port"),
        ([], {"KVDEPOT_LANE_PORT": "-1"}, "port in"),
        (["--tls-cert", "c.pem"], {}, "tls_cert and tls_key go together"),
        (["--tls-client-ca", "ca.pem"], {}, "needs tls_cert"),
        (["--socket-mode", "rw-rw----"], {}, "octal"),
        ([], {"KVDEPOT_SOCKET_MODE": "1777"}, "KVDEPOT_SOCKET_MODE"),
        (["--shm-paths", "maybe"], {}, "true or false"),
        (["--store-nice", "20"], {}, "--store-nice"),
        ([], {"KVDEPOT_STORE_NICE": "-5"}, "0..19"),
    ],
)
def test_bad_values_name_the_option(argv: list[str], env: dict[str, str], words: str) -> None:
    with pytest.raises(config.ConfigError, match=words.replace("-", "\\-")):
        load(argv, env)


def test_unknown_file_key_lists_known_ones(tmp_path) -> None:  # type: ignore[no-untyped-def]
    f = tmp_path / "c.toml"
    f.write_text("hots_gib = 1\n")
    with pytest.raises(config.ConfigError, match="unknown option hots_gib.*known options: .*host_gib"):
        load(["--config", str(f)])


def test_other_kvdepot_env_vars_are_ignored() -> None:
    env = {"KVDEPOT_ADDRESS": "x", "KVDEPOT_CLIENT_TLS_CERT": "c.pem", "KVDEPOT_LOAD_ASYNC": "true", "KVDEPOT_REQUIRE_MONITORING": "1"}
    assert load([], env).listen == (config.DEFAULT_LISTEN,)
    # Kubernetes' service links for a Service named kvdepot or kvdepot-metrics in the namespace
    links = {"KVDEPOT_SERVICE_HOST": "10.0.0.7", "KVDEPOT_SERVICE_PORT": "50061", "KVDEPOT_SERVICE_PORT_GRPC": "50061",
             "KVDEPOT_PORT": "tcp://10.0.0.7:50061", "KVDEPOT_PORT_50061_TCP": "tcp://10.0.0.7:50061", "KVDEPOT_PORT_50061_TCP_ADDR": "10.0.0.7",
             "KVDEPOT_PORT_50061_TCP_PORT": "50061", "KVDEPOT_PORT_50061_TCP_PROTO": "tcp", "KVDEPOT_METRICS_SERVICE_HOST": "10.0.0.8"}
    assert load([], links).listen == (config.DEFAULT_LISTEN,)


@pytest.mark.parametrize(
    "var, words",
    [
        ("KVDEPOT_HOST_GB", "unknown variable KVDEPOT_HOST_GB in the environment; did you mean KVDEPOT_HOST_GIB?"),
        ("KVDEPOT_REMOTE_TIMEOUT", "did you mean KVDEPOT_REMOTE_TIMEOUT_MS?"),
        ("KVDEPOT_ZZZ", "unknown variable KVDEPOT_ZZZ in the environment \\(every"),
    ],
)
def test_a_misspelled_variable_is_refused_naming_the_nearest_option(var: str, words: str) -> None:
    with pytest.raises(config.ConfigError, match=words):
        load([], {var: "1"})


def test_every_kvdepot_variable_the_project_names_is_known() -> None:
    """A variable the docs, scripts, container files or tests use is an option or in OTHER_ENV:
    else a daemon started beside it would refuse to run."""
    import re

    root = Path(__file__).resolve().parents[2]
    names: dict[str, str] = {}
    for path in [root / "README.md", root / "Dockerfile", root / "docker-compose.yml", root / ".ci" / "run"] + [
        p for d in ("docs", "scripts", "deploy", "tests", "bench", "client", "server") for p in (root / d).rglob("*") if p.is_file() and p.suffix in ("", ".py", ".md", ".yml", ".yaml", ".sh", ".Dockerfile", ".toml")
    ]:
        if path.name == "test_config.py":  # its misspellings are on purpose
            continue
        for name in re.findall(r"KVDEPOT_[A-Z][A-Z0-9_]*[A-Z0-9](?!_\*)\b", path.read_text(errors="replace")):
            names.setdefault(name, str(path.relative_to(root)))
    names.pop("KVDEPOT_HOST_GB", None)  # docs/operations.md's example of a refused one
    unknown = {n: where for n, where in names.items()
               if n not in environment.OTHER_ENV and n[len("KVDEPOT_") :].lower() not in config.PARSERS and not environment.SERVICE_LINK.fullmatch(n)}
    assert not unknown, f"KVDEPOT_* variables neither options nor in environment.OTHER_ENV: {unknown}"


def test_every_option_has_help() -> None:
    p = argparse.ArgumentParser()
    config.add_arguments(p)
    text = p.format_help()
    for name in config.HELP:
        assert "--" + name.replace("_", "-") in text


def test_json_log_lines_carry_the_exception() -> None:
    import json
    import logging

    from kvdepotd.cli import JsonFormatter

    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        record = logging.LogRecord("kvdepotd", logging.ERROR, __file__, 1, "step %s failed", ("7",), sys.exc_info())
    out = json.loads(JsonFormatter().format(record))
    assert out["level"] == "error" and out["logger"] == "kvdepotd" and out["message"] == "step 7 failed"
    assert "ValueError: boom" in out["exception"] and "\n" not in JsonFormatter().format(record)


def test_a_tier_of_less_than_two_slabs_is_warned_about(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert load([]).warnings() == [] and load(["--host-gib", "0.125", "--disk-dir", str(tmp_path), "--disk-gib", "0.5"]).warnings() == []
    small = load(["--host-gib", "0.05", "--disk-dir", str(tmp_path), "--disk-gib", "0.25", "--disk-slab-mib", "256"]).warnings()
    assert small == [
        "the host tier (51 MiB) is less than two 64-MiB slabs: the first layout class (model, dtype, block size, parallelism) "
        "to store takes all of it, and engines of any other store nothing there; raise host_gib or lower slab_mib",
        "the disk tier (256 MiB) is less than two 256-MiB slabs: the first layout class (model, dtype, block size, parallelism) "
        "to store takes all of it, and engines of any other store nothing there; raise disk_gib or lower disk_slab_mib",
    ]
    assert cli.main(["check-config", "--host-gib", "0.05"]) == 0  # it starts: a warning, not an error
    assert "kvdepotd: warning: the host tier (51 MiB) is less than two 64-MiB slabs" in capsys.readouterr().err


def test_check_config_checks_the_tokens_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "tokens.toml"
    good.write_text('admin = "admin-token-0123456789"\n[namespaces]\nteam-a = ["team-a-token-0123456789"]\n')
    assert cli.main(["check-config", "--auth-file", str(good)]) == 0
    assert f"# {good}: 2 tokens (namespaces 'team-a'; 1 admin; 0 metrics)" in capsys.readouterr().out
    bad = tmp_path / "bad.toml"
    bad.write_text('[namespaces]\nteam-a = "short"\n')
    assert cli.main(["check-config", "--auth-file", str(bad)]) == 2
    assert "a token must be at least 16 characters" in capsys.readouterr().err


def test_check_config_refuses_a_misspelled_variable(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KVDEPOT_HOST_GB", "8")
    assert cli.main(["check-config"]) == 2
    assert "did you mean KVDEPOT_HOST_GIB?" in capsys.readouterr().err
