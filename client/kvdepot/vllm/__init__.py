"""kvdepot for vLLM: `KvDepotConnector`, a KVConnectorBase_V1 that hands vLLM's offloading to kvdepotd.

    --kv-transfer-config '{"kv_connector":"KvDepotConnector","kv_connector_module_path":"kvdepot.vllm",
                           "kv_role":"kv_both","kv_connector_extra_config":{"address":"unix:/run/kvdepot/kvdepotd.sock"}}'

Install with `pip install 'kvdepot[vllm]'`. The extra config keys are documented in
kvdepot.vllm.config (and the README).
"""

from kvdepot.vllm.connector import KvDepotConnector, KvDepotMetadata, KvDepotWorkerMetadata

__all__ = ["KvDepotConnector", "KvDepotMetadata", "KvDepotWorkerMetadata"]
