"""kvdepot for vLLM: `KvDepotConnector`, a KVConnectorBase_V1 that hands vLLM's offloading to kvdepotd.

    --kv-transfer-config '{"kv_connector":"KvDepotConnector","kv_connector_module_path":"kvdepot.vllm",
                           "kv_role":"kv_both","kv_connector_extra_config":{"address":"unix:/run/kvdepot/kvdepotd.sock"}}'

Install with `pip install 'kvdepot[vllm]'`. The extra config keys are documented in
kvdepot.connector.config (and docs/vllm.md). The connector is imported on first use, so kvdepot.connector.config
can be read without vLLM installed.
"""

from typing import Any

__all__ = ["KvDepotConnector", "KvDepotMetadata", "KvDepotWorkerMetadata"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kvdepot.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module 'kvdepot.vllm' has no attribute {name!r}")
