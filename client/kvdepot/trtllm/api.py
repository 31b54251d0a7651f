"""TensorRT-LLM's connector API: the real base classes where `tensorrt_llm` imports, kvdepot's
stand-ins (kvdepot.testing.trtllm) elsewhere. `real` says which."""

from __future__ import annotations

import importlib
import logging
from types import ModuleType
from typing import Any

from kvdepot.testing import trtllm as stand_in

log = logging.getLogger("kvdepot.trtllm")
# Where releases keep the module: 2025 releases in pyexecutor/, 2026 ones in pyexecutor/connectors/.
MODULES = ("tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector", "tensorrt_llm._torch.pyexecutor.kv_cache_connector")


def real_module() -> ModuleType | None:
    """TensorRT-LLM's connector module, or None where it does not import (not installed, or its
    CUDA bindings do not load)."""
    for name in MODULES:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name and not name.startswith(e.name):
                log.debug("kvdepot: %s does not import: %s", name, e)
            continue
        except Exception as e:  # tensorrt_llm installed without a usable CUDA
            log.debug("kvdepot: %s does not import: %s", name, e)
            return None
    return None


_real = real_module()
real = _real is not None
api: Any = _real if _real is not None else stand_in
KvCacheConnectorScheduler: Any = api.KvCacheConnectorScheduler
KvCacheConnectorWorker: Any = api.KvCacheConnectorWorker


def mpi_rank() -> int:
    if real:
        from tensorrt_llm._utils import mpi_rank as rank

        return int(rank())
    return stand_in.mpi_rank()


def broadcast_from_rank0(obj: Any) -> Any:
    """Rank 0's `obj` on every rank, over TensorRT-LLM's own communicator (the one its connector
    manager broadcasts the scheduler's answers on). A collective: every rank must call it, at the
    same point (register_kv_caches, which each rank's executor calls once). Without MPI (Ray) it is
    each rank's own object."""
    if real:
        from tensorrt_llm._utils import mpi_broadcast

        return mpi_broadcast(obj, root=0)
    return stand_in.mpi_broadcast(obj)
