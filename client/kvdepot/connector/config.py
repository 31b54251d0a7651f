"""A connector's settings, checked once at start-up. vLLM takes them as `kv_connector_extra_config`
keys; TensorRT-LLM's config refuses keys it does not know, so its connector reads the same keys
from KVDEPOT_<KEY> environment variables and from a YAML, TOML or JSON file named by
$KVDEPOT_CONNECTOR_CONFIG (from_env; the variables win).

    address             the daemon: HOST:PORT, tcp://HOST:PORT, unix:PATH or unix:///abs/path
                        (default: $KVDEPOT_ADDRESS, else 127.0.0.1:50061)
    namespace           tenant; blocks are shared only within one namespace (default "")
    load_async          loads run while vLLM schedules other requests (WAITING_FOR_REMOTE_KVS)
                        instead of before this step's forward (default false)
    lookup_timeout_ms   how long the scheduler waits for a Lookup before calling it a miss (50)
    step_timeout_ms     how long the scheduler waits for a Step before treating it as a miss (100)
    release_timeout_s   how long blocks of a finished request wait for the daemon's release when the
                        daemon stopped answering (35; longer than the daemon's op deadline)
    keep_fail_policy    keep kv_load_failure_policy "fail" (default false: the connector sets
                        "recompute", because a failed or late load of a cache must cost a hit, not
                        fail the request)
    engine_name         shown in ListEngines and the daemon's log (default "vllm")
    late_load_checks    true: a synchronous load lets the forward start once its bytes are
                        copied; the daemon checks the checksums meanwhile and a corrupt block is
                        reported through get_block_ids_with_load_errors after the forward, which
                        makes vLLM drop that step's output for the request and recompute from the
                        block. false: the forward waits for the checks. auto (default): true when
                        the KV cache is on a GPU (the check is CPU work beside the device copy and
                        the GPU's forward), false on CPU (the check would compete with the forward
                        for the same cores)
    layerwise_loads     true (default): a synchronous load is copied layer by layer and each
                        attention layer's forward waits only for its own layer (vLLM's
                        wait_for_layer_load), so the forward runs while later layers are still
                        being copied; the blocks' checksums are known after the forward, and a bad
                        one is reported as for late_load_checks. Where the daemon cannot tell a
                        worker of each layer (GPU memory, /dev/shm files by path) the first layer
                        waits for them all. false: the forward waits for the whole load. vLLM
                        only: TensorRT-LLM cannot drop a forward's output, so it always waits
    tls_ca, tls_cert,   TLS to a daemon on a TCP address (kvdepotd --tls-cert): PEM files of the CA
    tls_key             that signed its certificate (empty: the system's roots) and, when it asks
                        for one, this engine's certificate and key. Setting any of them turns TLS on
    token_file          a file holding the token, for a daemon that asks for one (kvdepotd
                        --auth-file); default $KVDEPOT_TOKEN_FILE, else the token itself from
                        $KVDEPOT_TOKEN, else none. (Not the token in this config: vLLM logs it.)
    copy_mode           who copies blocks between the engine's KV memory and the daemon's host
                        memory: daemon (it maps the engine's memory: shared CPU memory, CUDA IPC
                        through torch or the CUDA driver), engine (the workers copy, into host
                        memory the daemon hands them: kvdepot.engine_copy; needs a unix: address),
                        auto (default): the daemon where the memory can be shared, else the engine
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvdepot.auth import check_token, read_token
from kvdepot.client import DEFAULT_ADDRESS
from kvdepot.layout import KvLayout
from kvdepot.tls import Tls

KEYS = (
    "address", "namespace", "load_async", "lookup_timeout_ms", "step_timeout_ms", "release_timeout_s", "keep_fail_policy", "engine_name",
    "late_load_checks", "tls_ca", "tls_cert", "tls_key", "token_file", "copy_mode", "layerwise_loads",
)


def env_name(key: str) -> str:
    """The variable from_env reads `key` from: KVDEPOT_<KEY>, but KVDEPOT_CLIENT_TLS_* for the TLS
    files (KVDEPOT_TLS_CERT and KVDEPOT_TLS_KEY are the daemon's own certificate and key)."""
    return "KVDEPOT_" + ("CLIENT_" if key.startswith("tls_") else "") + key.upper()


ENV_NAMES = frozenset({env_name(k) for k in KEYS} | {"KVDEPOT_CONNECTOR_CONFIG", "KVDEPOT_TOKEN"})  # every variable a connector reads


@dataclass(frozen=True)
class ConnectorConfig:
    address: str = DEFAULT_ADDRESS
    namespace: str = ""
    load_async: bool = False
    lookup_timeout_ms: int = 50
    step_timeout_ms: int = 100
    release_timeout_s: float = 35.0
    keep_fail_policy: bool = False
    engine_name: str = "vllm"
    late_load_checks: str = "auto"
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    token_file: str = ""
    copy_mode: str = "auto"
    layerwise_loads: bool = True
    token: str = field(default="", repr=False)  # read from token_file or $KVDEPOT_TOKEN at start-up

    def tls(self) -> Tls | None:
        return Tls.of(self.tls_ca, self.tls_cert, self.tls_key)

    def late_checks_for(self, layout: KvLayout) -> bool:
        return self.late_load_checks == "true" or (self.late_load_checks == "auto" and layout.kind != "vllm_cpu")

    @staticmethod
    def from_extra(extra: dict[str, Any] | None) -> ConnectorConfig:
        """Raises ValueError naming the key when a value is wrong or a key is unknown."""
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(KEYS))
        if unknown:
            raise ValueError(f"kvdepot: unknown kv_connector_extra_config keys {unknown}; known: {list(KEYS)}")
        out: dict[str, Any] = {"address": os.environ.get("KVDEPOT_ADDRESS", DEFAULT_ADDRESS), "token_file": os.environ.get("KVDEPOT_TOKEN_FILE", "")}
        for key, value in extra.items():
            out[key] = _coerce(key, value)
        try:
            out["token"] = read_token(out["token_file"]) if out["token_file"] else os.environ.get("KVDEPOT_TOKEN", "").strip()
            if out["token"]:
                check_token(out["token"])
        except ValueError as e:
            raise ValueError(f"kvdepot: {e}") from None
        out["address"] = _address(out["address"])
        cfg = ConnectorConfig(**out)
        if cfg.copy_mode not in ("auto", "daemon", "engine"):
            raise ValueError(f"kvdepot: copy_mode must be auto, daemon or engine, got {cfg.copy_mode!r}")
        if cfg.copy_mode == "engine" and not cfg.address.startswith("unix:"):
            raise ValueError("kvdepot: copy_mode engine needs the daemon at a unix: address (its host memory is handed over there)")
        if cfg.late_load_checks not in ("auto", "true", "false"):
            raise ValueError(f"kvdepot: late_load_checks must be auto, true or false, got {cfg.late_load_checks!r}")
        if not cfg.address:
            raise ValueError("kvdepot: address must name the daemon (HOST:PORT, unix:PATH or unix:///abs/path)")
        if cfg.tls() is not None and cfg.address.startswith("unix:"):
            raise ValueError("kvdepot: tls_* keys are for a TCP address; the daemon serves Unix sockets in plaintext")
        if bool(cfg.tls_cert) != bool(cfg.tls_key):
            raise ValueError("kvdepot: tls_cert and tls_key go together")
        return cfg


def _address(address: str) -> str:
    """The daemon's address as the client takes it: tcp://HOST:PORT (the form TensorRT-LLM's
    server_url documents) is HOST:PORT."""
    if address.startswith("tcp://"):
        rest = address[len("tcp://") :].rstrip("/")
        host, _, port = rest.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"kvdepot: address {address!r} must be tcp://HOST:PORT")
        return rest
    return address


def from_env(environ: Mapping[str, str], **defaults: Any) -> ConnectorConfig:
    """The settings of a connector whose engine has no place for them (TensorRT-LLM): `defaults`,
    then the file named by $KVDEPOT_CONNECTOR_CONFIG (by its suffix YAML or TOML, else JSON), then
    KVDEPOT_<KEY> variables ($KVDEPOT_ADDRESS, $KVDEPOT_NAMESPACE, $KVDEPOT_LOAD_ASYNC, ...; the
    TLS files from $KVDEPOT_CLIENT_TLS_CA, _CERT and _KEY, apart from the daemon's own).
    Raises ValueError naming the file, variable or key that is wrong."""
    extra: dict[str, Any] = dict(defaults)
    path = environ.get("KVDEPOT_CONNECTOR_CONFIG", "")
    if path:
        try:
            with open(path, "rb") as f:
                data = _parse(path, f.read())
        except (OSError, ValueError) as e:
            raise ValueError(f"kvdepot: KVDEPOT_CONNECTOR_CONFIG={path}: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"kvdepot: KVDEPOT_CONNECTOR_CONFIG={path} must hold a table of settings")
        extra.update(data)
    for key in KEYS:
        value = environ.get(env_name(key))
        if value is not None:
            extra[key] = value
    return ConnectorConfig.from_extra(extra)


def _parse(path: str, data: bytes) -> Any:
    """TOML (.toml), YAML (.yaml, .yml: the format TensorRT-LLM's own options file has; needs
    PyYAML, which TensorRT-LLM installs) or JSON."""
    if path.endswith(".toml"):
        return tomllib.loads(data.decode())
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError:
            raise ValueError("a YAML file needs PyYAML (pip install pyyaml); TOML or JSON do not") from None
        try:
            return yaml.safe_load(data)
        except yaml.YAMLError as e:
            raise ValueError(str(e)) from None
    return json.loads(data)


def _coerce(key: str, value: Any) -> Any:
    if key == "late_load_checks" and isinstance(value, bool):
        return "true" if value else "false"
    want = type(getattr(ConnectorConfig, key))
    if want is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
        raise ValueError(f"kvdepot: {key} must be true or false, got {value!r}")
    if want in (int, float):
        try:
            num = want(value)
        except (TypeError, ValueError):
            raise ValueError(f"kvdepot: {key} must be a number, got {value!r}") from None
        if num <= 0:
            raise ValueError(f"kvdepot: {key} must be positive, got {value!r}")
        return num
    if not isinstance(value, str):
        raise ValueError(f"kvdepot: {key} must be a string, got {value!r}")
    return value
