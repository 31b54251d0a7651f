"""One engine instance's identity at the daemon, unique by construction.

The processes of one engine (its scheduler and a worker per rank) register under one key and the
daemon joins them into one engine. The key is never derived from the environment: the scheduler
mints it (`mint`: a 128-bit secret), registers the engine under it, and hands it to its own workers
only: through the per-step metadata the engine broadcasts to every rank, and, to a worker in the
scheduler's own process, through the Instance both find from the engine's config object (the
same object in that process). Workers only ever join (RegisterEngine `join`): the daemon refuses a
join whose key no live engine holds, so a process of another instance, whatever its environment,
can never join this one. (Before, a key made of the host, a job id and the model merged two
instances started in one Slurm job: their ranks replaced each other and one's KV was served as
the other's.)

    Instance.of(config)     the process's Instance for one engine's config object
    mint(engine, model)     a new key: readable prefix, secret suffix
    inst.set_key(key)       the scheduler's key; workers waiting in this process join now
    inst.when_keyed(fn)     fn(key) now, or once the scheduler set it
"""

from __future__ import annotations

import secrets
import socket
import threading
from collections.abc import Callable
from typing import Any

from kvdepot.layout import KvLayout


def mint(engine: str, model: str) -> str:
    """A key no other instance has: the engine and host for people reading logs, then a secret."""
    return f"{engine}:{socket.gethostname()}:{model[-64:]}:{secrets.token_hex(16)}"


class Instance:
    _lock = threading.Lock()
    _by_config: dict[int, tuple[Any, Instance]] = {}  # id(config) -> (config, its Instance): the config is kept, so its id is not reused

    def __init__(self) -> None:
        self.key = ""
        self.layout: KvLayout | None = None  # rank 0's worker's, for a scheduler that cannot derive it (TensorRT-LLM)
        self.engine_copies = False  # rank 0's worker copies its blocks itself (kvdepot.engine_copy)
        self.scheduler: Any = None  # the scheduler side in this process, if any
        self._waiting: list[Callable[[str], None]] = []

    @classmethod
    def of(cls, config: Any) -> Instance:
        """The Instance of the engine whose processes got `config` (TensorRT-LLM's llm_args, vLLM's
        VllmConfig): in one process, its scheduler and worker get the same object."""
        with cls._lock:
            got = cls._by_config.get(id(config))
            if got is None or got[0] is not config:
                got = cls._by_config[id(config)] = (config, Instance())
            return got[1]

    def set_key(self, key: str) -> None:
        with self._lock:
            self.key = key
            waiting, self._waiting = self._waiting, []
        for fn in waiting:
            fn(key)

    def when_keyed(self, fn: Callable[[str], None]) -> None:
        with self._lock:
            if not self.key:
                self._waiting.append(fn)
                return
            key = self.key
        fn(key)

    def publish(self, layout: KvLayout, engine_copies: bool = False) -> None:
        with self._lock:
            self.layout, self.engine_copies = layout, engine_copies
