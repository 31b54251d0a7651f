"""The connector's worker side (each worker process): shares the KV tensors with the daemon, waits
for a step's loads, reports forward-done, and reads the completion stream (KvDepotConnector's
docstring maps vLLM's hooks to the methods)."""

from __future__ import annotations

import collections
import logging
import time
from typing import Any

import torch

from kvdepot import handles
from kvdepot.client import DepotClient, WorkerLink
from kvdepot.handoff import handoff_path
from kvdepot.layout import KvLayout
from kvdepot.messages import LoadCopied, OpCompleted, RequestReleased
from kvdepot.vllm.common import KvDepotMetadata, KvDepotWorkerMetadata, LoadJob, connect
from kvdepot.vllm.config import ConnectorConfig

log = logging.getLogger("kvdepot.vllm")
_NOT_ATTACHED_GRACE_S = 0.5  # a worker stream down this long while we wait: the daemon is gone


class WorkerSide:
    def __init__(self, cfg: ConnectorConfig, layout: KvLayout | None, model: str, key: str) -> None:
        self.cfg = cfg
        self.layout = layout
        self.model = model
        self.key = key
        self.rank = 0
        self.client: DepotClient | None = None
        self.link: WorkerLink | None = None
        self.cuda = False
        self.done: collections.OrderedDict[int, OpCompleted] = collections.OrderedDict()
        self.copied: set[int] = set()  # loads the forward may use, their OpCompleted to follow: bytes in (and checked, without late checks)
        self.late = cfg.late_checks_for(layout) if layout is not None else False  # the forward may use unchecked bytes
        self.checking: list[LoadJob] = []  # this step's synchronous loads, until their checks end
        self.released: set[str] = set()
        self.async_jobs: dict[str, LoadJob] = {}
        self.load_errors: set[int] = set()
        self.seen_finished: set[str] = set()
        self.holding: dict[str, float] = {}  # delayed request -> give up waiting for its release at
        self.ready: set[str] = set()  # may be reported finished sending once vLLM said it finished
        self.new_completed: set[int] = set()
        self.paths: list[str] = []
        self.fds: list[int] = []
        self.not_attached_since: float | None = None

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.layout is None:
            return
        names, tensors = list(kv_caches), list(kv_caches.values())
        if not tensors:
            return
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self.rank = get_tensor_model_parallel_rank()
        num_blocks = int(tensors[0].shape[1] if self.layout.kind == "vllm_flash" else tensors[0].shape[0])
        self.cuda = tensors[0].is_cuda
        try:
            if self.cuda:
                req = handles.export_cuda_tensors(tensors, num_blocks, names)
            elif handoff_path(self.cfg.address) is not None:  # memfds handed over: no file in /dev/shm, any user
                req, self.fds = handles.share_cpu_tensors_memfd(tensors, num_blocks, names)
            else:
                req, self.paths = handles.share_cpu_tensors(tensors, num_blocks, names)
        except Exception as e:  # e.g. no room for the memory: the engine serves on, every load it is planned fails and is recomputed
            log.error("kvdepot: worker %d: cannot share the KV cache with the daemon (%s); loads and stores stay off", self.rank, e)
            return
        self.client = connect(self.cfg, self.layout, self.model, self.key, f"{self.cfg.engine_name}-worker-{self.rank}")
        if self.client is None:
            return
        self.link = self.client.worker(self.rank)
        if not self.link.register_kv_caches(req, self.fds) and self.client.engine_id:
            log.error("kvdepot: worker %d: the daemon refused the KV caches; loads and stores stay off", self.rank)

    # events ---------------------------------------------------------------------------------------
    def _absorb(self) -> None:
        if self.link is None:
            return
        for ev in self.link.poll():
            if isinstance(ev, OpCompleted):
                self.done[ev.op_id] = ev
                self.new_completed.add(ev.op_id)
                self.copied.discard(ev.op_id)
            elif isinstance(ev, LoadCopied) and ev.op_id not in self.done and (ev.intact or self.late):
                self.copied.add(ev.op_id)
            elif isinstance(ev, RequestReleased):
                self.released.add(ev.request_id)
        while len(self.done) > 100_000:  # completions nobody waits for (stores): keep a window
            self.done.popitem(last=False)

    def _gone(self) -> bool:
        """The daemon cannot write any more: its stream has been down for a while (it died)."""
        if self.link is None or self.link.attached.is_set():
            self.not_attached_since = None
            return self.link is None
        now = time.monotonic()
        if self.not_attached_since is None:
            self.not_attached_since = now
        return now - self.not_attached_since > _NOT_ATTACHED_GRACE_S

    def _settled(self, job: LoadJob) -> bool:
        if all(op in self.done for op in job.ops):
            return True
        return time.time() * 1000 > job.deadline_ms + 500 or self._gone()

    def _in_place(self, job: LoadJob) -> bool:
        """The job's bytes are in the engine's blocks (and checked, unless the engine takes late load
        checks), or it is settled."""
        return all(op in self.done or op in self.copied for op in job.ops) or self._settled(job)

    def _fail_unloaded(self, job: LoadJob) -> None:
        ok: set[int] = set()
        for op_id, blocks in job.ops.items():
            self.copied.discard(op_id)
            ev = self.done.pop(op_id, None)
            if ev is not None:
                ok.update(set(blocks) - set(ev.failed_block_ids))
        failed = [b for b in job.targets if b not in ok]
        if failed:
            log.info("kvdepot: request %s: %d of %d blocks not loaded; vLLM recomputes them", job.request_id, len(failed), len(job.targets))
            self.load_errors.update(failed)

    def _wait(self, settled: Any) -> None:
        while True:
            self._absorb()
            if settled() or self.link is None:
                return
            self.link.wait_for_events(0.01)

    # per step --------------------------------------------------------------------------------------
    def preempted(self, meta: KvDepotMetadata) -> None:
        ops = [op for ops in meta.preempted_ops.values() for op in ops]
        if ops and self.link is not None:
            deadline = time.monotonic() + self.cfg.release_timeout_s
            self._wait(lambda: all(op in self.done for op in ops) or self._gone() or time.monotonic() > deadline)

    def start_loads(self, meta: KvDepotMetadata) -> None:
        sync = [job for job in meta.loads if not job.is_async]
        for job in meta.loads:
            if job.is_async:
                self.async_jobs[job.request_id] = job
        if not sync:
            return
        # The forward may start once the bytes are in place; whether they were intact is known by
        # the end of the step (take_load_errors), and vLLM drops a step's output for a request whose
        # loaded blocks it is told failed after the forward.
        self._wait(lambda: all(self._in_place(job) for job in sync))
        self.checking += sync

    def forward_done(self, step: int) -> None:
        if self.link is None or step <= 0:
            return
        event = None
        if self.cuda:
            event = torch.cuda.Event(interprocess=True)
            event.record()
        self.link.forward_done(step, event)

    def finished(self, finished_req_ids: set[str], meta: KvDepotMetadata | None) -> tuple[set[str] | None, set[str] | None]:
        self._absorb()
        self.seen_finished |= finished_req_ids
        if meta is not None:
            for rid, holds in meta.finished.items():
                if holds:
                    self.holding[rid] = time.monotonic() + self.cfg.release_timeout_s
                else:
                    self.ready.add(rid)
        now = time.monotonic()
        gone = bool(self.holding) and self._gone()  # a daemon that is gone touches no block
        for rid, give_up in list(self.holding.items()):
            if rid in self.released or now > give_up or gone:
                del self.holding[rid]
                self.released.discard(rid)
                self.ready.add(rid)
        sending = {rid for rid in self.ready if rid in self.seen_finished}
        self.ready -= sending
        self.seen_finished = {rid for rid in self.seen_finished if rid in self.holding or rid in self.ready}
        recving = set()
        for rid, job in list(self.async_jobs.items()):
            if self._settled(job):
                self._fail_unloaded(job)
                del self.async_jobs[rid]
                recving.add(rid)
        return sending or None, recving or None

    def take_load_errors(self) -> set[int]:
        """After the forward: the blocks of this step's loads that did not arrive intact."""
        if self.checking:
            jobs, self.checking = self.checking, []
            self._wait(lambda: all(self._settled(job) for job in jobs))
            for job in jobs:
                self._fail_unloaded(job)
        out, self.load_errors = self.load_errors, set()
        return out

    def worker_meta(self) -> KvDepotWorkerMetadata | None:
        if not self.new_completed:
            return None
        out, self.new_completed = self.new_completed, set()
        return KvDepotWorkerMetadata(out)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        handles.remove_shm_files(self.paths)
        handles.close_fds(self.fds)
        self.fds = []
