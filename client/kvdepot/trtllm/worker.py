"""The connector's worker side (every rank): TensorRT-LLM's KV pool handed to the engine-neutral
kvdepot.connector.worker, and TensorRT-LLM's get_finished contract (an id is returned only after
TensorRT-LLM passed it in, and TensorRT-LLM acts on it once every rank has returned it)."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from kvdepot.connector.config import ConnectorConfig
from kvdepot.connector.instance import Instance
from kvdepot.connector.worker import LoadJob, WorkerSide
from kvdepot.trtllm.api import broadcast_from_rank0
from kvdepot.trtllm.common import STYLE, TrtllmMeta, check_args, layout_of, model_of

log = logging.getLogger("kvdepot.trtllm")


class TrtllmWorkerSide(WorkerSide):
    def __init__(self, cfg: ConnectorConfig, llm_args: Any, instance: Instance) -> None:
        super().__init__(cfg, None, model_of(llm_args), STYLE)
        self.llm_args = llm_args
        self.instance = instance  # rank 0's scheduler is in this process (the same llm_args)
        self.late = False  # a load's bytes are used only once checked: TensorRT-LLM cannot hear of a failed one
        self.saving: set[str] = set()  # passed in as saving (request_finished said True), not returned yet
        self.loading: set[str] = set()  # passed in as loading asynchronously, not returned yet
        self.loaded: set[str] = set()  # loads that ended, not passed in yet
        self.fresh_meta = False  # the bound metadata's finished map is still to be read
        self.load_failures = 0  # blocks promised to TensorRT-LLM that did not arrive intact
        self.failed: dict[str, list[int]] = {}  # request -> its blocks whose load failed, not yet acted on
        self.ops_of: dict[str, dict[int, int]] = {}  # request -> its ops (id -> deadline ms), from the metadata

    def register(self, pool: torch.Tensor | None, rank: int, why: str = "") -> None:
        """Shares the pool; rank 0 hands its layout to the scheduler in its process, which registers
        the engine; every rank joins it under the key the scheduler minted, which rank 0 broadcasts
        here over TensorRT-LLM's own communicator (the steps' metadata carries it too, for a rank that
        missed it).
        A rank whose pool cannot be shared never joins, and the daemon then offers this engine no
        hit and stores nothing of it; rank 0's: the scheduler never connects."""
        why = why or check_args(self.llm_args)
        try:
            layout = None if why or pool is None else layout_of(pool, self.llm_args)
        except ValueError as e:
            layout, why = None, str(e)
        if layout is None:
            log.error("kvdepot: connector disabled: %s", why)
        else:
            self.layout = layout
        shared = layout is not None and pool is not None and self.share([pool], ["kv_pool"], int(pool.shape[0]), rank)
        if shared and rank == 0:
            try:
                if (scheduler := self.instance.scheduler) is not None:
                    self.instance.publish(layout, self.engine_copies)  # type: ignore[arg-type]
                    shared = scheduler.ready()
            except Exception as e:  # nothing may keep rank 0 from the broadcast below: the other ranks wait in it
                log.error("kvdepot: the scheduler could not register the engine (%s): the connector stays off", e)
                shared = False
        # A collective: every rank calls it, whatever happened above.
        key = broadcast_from_rank0(self.instance.key if rank == 0 and shared else "")
        if shared and key:
            try:
                self.join(key)
            except Exception as e:
                log.error("kvdepot: worker %d could not join the engine (%s): this engine gets no hits and stores nothing", rank, e)

    def bound(self, meta: object) -> None:
        self.fresh_meta = True
        if isinstance(meta, TrtllmMeta):
            for rid, ops in meta.ops.items():
                self.ops_of.setdefault(rid, {}).update(ops)
            for rid in meta.forget:
                self.ops_of.pop(rid, None)
            self.join_soon(meta.engine_key)  # a rank other than 0 learns its engine's key here

    def _fail_unloaded(self, job: LoadJob) -> list[int]:
        for op in job.ops:  # settled: ended, or past writing
            self.ops_of.get(job.request_id, {}).pop(op, None)
        failed = super()._fail_unloaded(job)
        if failed:
            self.failed.setdefault(job.request_id, []).extend(failed)
        return failed

    def before_forward(self, meta: object) -> None:
        """The step's synchronous loads settle before the forward (whose inputs TensorRT-LLM
        prepares after this call): a load that failed is known while its request can still be
        told to compute those blocks."""
        if isinstance(meta, TrtllmMeta):
            self.preempted(meta)
            self.start_loads(meta)
            self.take_load_errors()
            self._act_on_failures()

    def _act_on_failures(self) -> None:
        failed, self.failed = self.failed, {}
        for rid, blocks in failed.items():
            self.load_failures += len(blocks)
            if self.rank != 0:
                continue  # rank 0 speaks for the engine (the scheduler is in its process)
            side = self.instance.scheduler
            if side is None:
                log.error("kvdepot: request %s: %d blocks did not load, and this process has no scheduler to rewind it", rid, len(blocks))
                continue
            side.rewind(rid, blocks, self.layout.world_size if self.layout else 1)

    def after_forward(self, meta: object, stream: Any) -> None:
        if isinstance(meta, TrtllmMeta):
            self.forward_done(meta.step, stream)

    def finished_ids(self, meta: object, finished_gen_req_ids: list[int], started_loading_req_ids: list[int]) -> tuple[list[int], list[int]]:
        held = meta.held if isinstance(meta, TrtllmMeta) and self.fresh_meta else None
        self.fresh_meta = False
        # TensorRT-LLM passes an id in once: it is offered until returned. A request is saved once
        # every op of it the metadata named has ended (or can no longer write), unless its ops are
        # unknown (held): then once the daemon released it.
        self.saving |= {str(r) for r in finished_gen_req_ids}
        by_daemon, recving = self.finished(set(self.saving), held)
        sending = set(by_daemon or ())
        rest = [rid for rid in self.saving - sending if rid not in self.holding]
        if rest:
            now_ms, gone = time.time() * 1000, self._gone()
            sending |= {rid for rid in rest if gone or all(op in self.done or now_ms > deadline + 500 for op, deadline in self.ops_of.get(rid, {}).items())}
        self.saving -= sending
        for rid in sending:
            self.ops_of.pop(rid, None)
        self.loading |= {str(r) for r in started_loading_req_ids}
        self._act_on_failures()  # async loads that failed: rewound before TensorRT-LLM hears they ended
        self.loaded |= recving or set()
        out = self.loaded & self.loading
        self.loaded -= out
        self.loading -= out
        return sorted(int(r) for r in sending or ()), sorted(int(r) for r in out)
