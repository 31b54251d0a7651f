"""kvdepot for TensorRT-LLM: KvDepotScheduler and KvDepotWorker, loaded through its
`kv_connector_config` (docs/trtllm.md):

    kv_connector_config:
      connector_module: kvdepot.trtllm
      connector_scheduler_class: KvDepotScheduler
      connector_worker_class: KvDepotWorker

Settings come from KVDEPOT_* environment variables or the file $KVDEPOT_CONNECTOR_CONFIG names
(kvdepot.connector.config). The classes are imported on first use.
"""

from typing import Any

__all__ = ["KvDepotScheduler", "KvDepotWorker", "TrtllmMeta"]


def __getattr__(name: str) -> Any:
    if name in ("KvDepotScheduler", "KvDepotWorker"):
        from kvdepot.trtllm import connector

        return getattr(connector, name)
    if name == "TrtllmMeta":
        from kvdepot.trtllm.common import TrtllmMeta

        return TrtllmMeta
    raise AttributeError(f"module 'kvdepot.trtllm' has no attribute {name!r}")
