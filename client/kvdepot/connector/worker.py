"""A connector's worker side (each worker process of an engine): shares the KV tensors with the
daemon, waits for a step's loads, reports forward-done, and reads the completion stream. Engine
neutral: the engine's connector maps its hooks to these methods and hands over its per-step
metadata, which carries `loads`, `finished` and `preempted_ops` (see LoadJob)."""

from __future__ import annotations

import atexit
import collections
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvdepot import handles
from kvdepot.client import DepotClient, WorkerLink
from kvdepot.engine_copy import EngineCopier
from kvdepot.connector.config import ConnectorConfig
from kvdepot.errors import DepotError
from kvdepot.handoff import handoff_path
from kvdepot.layout import KvLayout
from kvdepot.messages import LayersCopied, LoadCopied, OpCompleted, OpInfo, RequestReleased, StepBatch, StepResult, WorkerEvent

_NOT_ATTACHED_GRACE_S = 0.5  # a worker stream down this long while we wait: the daemon is gone
STARTUP_WAIT_S = 10.0  # the most an engine's start-up waits for the daemon to map its workers' KV memory


@dataclass
class LoadJob:
    """Loads into one request's blocks: the targets the engine counts on, and the daemon's ops for
    them. A target no successful op covered is a failed block."""

    request_id: str  # the daemon's request id (TensorRT-LLM's integer ids as decimal strings)
    targets: list[int]
    ops: dict[int, tuple[int, ...]]  # op id -> engine block ids
    deadline_ms: int  # unix ms after which no op of this job can still write (daemon deadline)
    is_async: bool


def load_jobs(ops: Sequence[OpInfo], promised: Sequence[tuple[str, list[int], bool]]) -> list[LoadJob]:
    """The step's LoadJobs: for each request promised a load (its id, target blocks, async), the
    daemon's load ops for it; none when the daemon refused or did not answer (every target fails)."""
    by_req: dict[str, dict[int, tuple[int, ...]]] = collections.defaultdict(dict)
    deadline: dict[str, int] = {}
    for op in ops:
        if op.kind == "load":
            by_req[op.request_id][op.op_id] = op.block_ids
            deadline[op.request_id] = max(deadline.get(op.request_id, 0), op.deadline_ms)
    return [LoadJob(rid, targets, by_req.get(rid, {}), deadline.get(rid, 0), is_async) for rid, targets, is_async in promised]


def send_step(client: DepotClient, batch: StepBatch, reqs: Mapping[str, Any]) -> tuple[StepBatch, StepResult, int]:
    """Sends the step's updates: (the batch as sent, the answer, the step whose forward the workers
    must report done, 0 when no store waits on it: a decode step that completes no block sends
    nothing to the daemon at all). An engine not registered (yet) sends none: the daemon knows none
    of these requests, so each is new to it again (its `epoch` goes to -1)."""
    if not client.engine_id:
        for rid in batch.request_ids:
            reqs[rid].epoch = -1
        batch = StepBatch()
    result = client.step(batch)
    return batch, result, result.step if any(op.kind == "store" for op in result.ops) else 0


def wait_mapped(client: DepotClient, timeout_s: float, log: logging.Logger) -> bool:
    """Waits (at an engine's start-up) until the daemon has mapped every rank's KV memory: before,
    it offers the engine no hit. False, said once, when that did not happen within `timeout_s`."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            info = next((e for e in client.engines() if e.engine_id == client.engine_id), None)
        except DepotError:
            return False  # an older daemon, a token that cannot list engines: no wait
        if info is None and not client.engine_id:
            return False  # not registered (the daemon is not there yet): nothing to wait for
        if info is not None and (info.layout.kind == 0 or len(info.mapped_ranks) >= max(1, info.layout.world_size)):
            return True
        time.sleep(0.01)
    log.warning("kvdepot: the workers' KV memory is not all mapped %.0f s after start: no hits until it is (see the workers' log)", timeout_s)
    return False


def close_at_exit(side: Any) -> None:
    """side.close() when the process exits: TensorRT-LLM calls no shutdown hook, and a daemon that
    heard nothing would hold the engine's slots and pins until its lease ran out. (Held strongly:
    the engine may have dropped its connector objects by then; close() is idempotent.)"""
    atexit.register(_close_quietly, side)


def _close_quietly(side: Any) -> None:
    try:
        side.close()
    except Exception as e:  # the process is exiting: a failed goodbye costs the daemon a lease, nothing more
        logging.getLogger("kvdepot").debug("kvdepot: closing at exit: %s", e)


def disconnect(client: DepotClient | None) -> None:
    """Unregisters (the daemon lets go of the engine's slots and pins at once) and closes."""
    if client is None:
        return
    try:
        client.unregister()
    except DepotError:
        pass
    client.close()


class StepMeta(Protocol):
    """What the worker side reads from an engine's per-step metadata."""

    loads: list[LoadJob]
    preempted_ops: dict[str, list[int]]  # ops that may still touch blocks the engine takes back


def connect(
    cfg: ConnectorConfig, layout: KvLayout, model: str, key: str, name: str, style: str = "vllm", join: bool = False, engine_copies: bool = False
) -> DepotClient | None:
    """A client registered under `key` (kvdepot.connector.instance): the scheduler creates the
    engine, a worker (`join`) joins it, waiting in the background while it is not there yet.
    `engine_copies`: the workers copy the engine's blocks themselves (kvdepot.engine_copy)."""
    log = logging.getLogger(f"kvdepot.{style}")  # each engine's connector logs under its own name
    client = DepotClient(cfg.address, deadline_s=cfg.step_timeout_ms / 1000, tls=cfg.tls(), token=cfg.token)
    try:
        engine_id = client.register_engine(
            model, layout, name=name, namespace=cfg.namespace, engine_key=key, late_load_checks=cfg.late_checks_for(layout),
            keep_trying=True, update_style=style, join=join, engine_copies=engine_copies,
        )
    except DepotError as e:
        log.error("kvdepot: the daemon at %s refused the engine (%s); the connector stays off", cfg.address, e)
        client.close()
        return None
    if engine_id:  # else the client warned, naming the address (or its engine is not there yet), and keeps trying
        log.info("kvdepot: %s connected to %s as engine %s", name, cfg.address, engine_id)
    return client


class WorkerSide:
    on_failed_load = ""  # what the engine does about blocks that did not load, for the log line
    # The engine waits for each layer (wait_for_layer) before its forward reads it, and hears of a
    # failed load after the forward (take_load_errors): loads may land layer by layer.
    waits_per_layer = False

    def __init__(self, cfg: ConnectorConfig, layout: KvLayout | None, model: str, style: str = "vllm") -> None:
        self.cfg = cfg
        self.layout = layout
        self.model = model
        self.key = ""  # the engine's key, from its scheduler (kvdepot.connector.instance); joined once known
        self.style = style
        self._joining = threading.Lock()
        self._join_asked = ""  # the key a join_soon thread is joining
        close_at_exit(self)
        self.log = logging.getLogger(f"kvdepot.{style}")
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
        self.ready: set[str] = set()  # may be reported finished sending once the engine said it finished
        self.new_completed: set[int] = set()
        self.paths: list[str] = []
        self.kv_request: Any = None  # the registration of the shared tensors (pb.RegisterKvCachesRequest)
        self.fds: list[int] = []
        self.not_attached_since: float | None = None
        self.copier: EngineCopier | None = None  # this rank copies its blocks itself (engine_copies)
        self._deferred: list[WorkerEvent] = []  # events held while the copier still carries out an order of their op
        self.layerwise = self.waits_per_layer and cfg.layerwise_loads and layout is not None and layout.num_layers > 1
        self.landed: dict[int, int] = {}  # op -> its layers in this rank's blocks (doorbell), until it ends
        self.layer_jobs: list[LoadJob] = []  # this step's synchronous loads, which its forward waits for layer by layer
        self.awaited: set[int] = set()  # the layers this step's forward waited for

    @property
    def engine_copies(self) -> bool:
        return self.copier is not None

    def share(self, tensors: Sequence[torch.Tensor], names: Sequence[str], num_blocks: int, rank: int) -> bool:
        """Shares this rank's KV tensors with the daemon (copy_mode daemon or auto): CUDA IPC handles
        (torch's, else the CUDA driver's), memfds handed over (a daemon at unix:PATH) or /dev/shm
        files; or, where a GPU pool can be shared in no way (auto) or copy_mode says engine, has
        this worker copy its blocks itself (kvdepot.engine_copy). They are registered once the
        engine's key is known (join). False when neither works: this rank never joins, and the
        daemon, which maps no memory for it, offers the engine no hit and stores nothing of it."""
        if self.layout is None or not tensors:
            return False
        self.rank = rank
        self.cuda = tensors[0].is_cuda
        why = "copy_mode is engine"
        try:
            if self.cfg.copy_mode != "engine":
                try:
                    self.kv_request, self.fds, self.paths = self._share(tensors, names, num_blocks)
                    # Loads land layer by layer only in handed-over CPU memory (the doorbell says so)
                    self.layerwise = self.layerwise and not self.cuda and bool(self.fds)
                    self.kv_request.layer_rings = self.layerwise
                    return True
                except handles.Unshareable as e:
                    if self.cfg.copy_mode == "daemon":
                        raise
                    why = str(e)
            if handoff_path(self.cfg.address) is None:
                raise ValueError(f"this worker must copy its blocks itself ({why}), which needs the daemon at a unix: address")
            self.layerwise = False
            self.copier = EngineCopier(tensors, self.layout, num_blocks, self._report)
            self.kv_request = handles.engine_copy_request(tensors, num_blocks, names)
        except Exception as e:  # e.g. no room for the memory: the engine serves on without the daemon
            self.log.error(
                "kvdepot: worker %d: cannot share the KV cache with the daemon (%s): this engine gets no hits and stores nothing",
                self.rank, e,
            )
            return False
        self.log.info("kvdepot: worker %d copies its blocks itself (engine-side copy: %s)", self.rank, why)
        return True

    def _share(self, tensors: Sequence[torch.Tensor], names: Sequence[str], num_blocks: int) -> tuple[Any, list[int], list[str]]:
        if self.cuda:  # handed over on the handoff socket where virtual memory is exported as descriptors
            req, fds = handles.export_cuda_tensors(tensors, num_blocks, names, may_hand_over=handoff_path(self.cfg.address) is not None)
            return req, fds, []
        if handoff_path(self.cfg.address) is not None:  # memfds handed over: no file in /dev/shm, any user
            req, fds = handles.share_cpu_tensors_memfd(tensors, num_blocks, names)
            return req, fds, []
        req, paths = handles.share_cpu_tensors(tensors, num_blocks, names)
        return req, [], paths

    def _report(self, op_id: int, failed: list[int], message: str) -> None:
        if (link := self.link) is not None:
            link.copies_done(op_id, failed, message)

    def join(self, key: str) -> None:
        """Joins the engine its scheduler registered under `key` and registers this rank's shared KV
        tensors with it (again under a new key, which a scheduler never mints: kept for safety)."""
        with self._joining:
            if self.kv_request is None or self.layout is None or not key or key == self.key:
                return
            if self.key:
                self.log.warning("kvdepot: worker %d: the scheduler's engine key changed; joining again", self.rank)
                self.close_link()
            self.key = key
            self.attach()

    def join_soon(self, key: str) -> None:
        """join() on a thread of its own: the engine's step does not wait for the registration."""
        if key and key != self.key and key != self._join_asked and self.kv_request is not None:
            self._join_asked = key
            threading.Thread(target=self.join, args=(key,), name=f"kvdepot-join-{self.rank}", daemon=True).start()

    def attach(self) -> None:
        """Joins the engine under self.key and registers this rank's shared KV tensors with it."""
        if self.kv_request is None or self.layout is None:
            return
        name = f"{self.cfg.engine_name}-worker-{self.rank}"
        self.client = connect(self.cfg, self.layout, self.model, self.key, name, self.style, join=True, engine_copies=self.engine_copies)
        if self.client is None:
            return
        self.link = self.client.worker(self.rank)
        if self.copier is not None:
            self.link.on_orders, self.link.on_arena = self.copier.submit, self.copier.map_arena
        if not self.link.register_kv_caches(self.kv_request, self.fds) and self.client.engine_id:
            self.log.error("kvdepot: worker %d: the daemon refused the KV caches; loads and stores stay off", self.rank)

    # events ---------------------------------------------------------------------------------------
    def _absorb(self) -> None:
        if self.link is None:
            return
        events, self._deferred = self._deferred + self.link.poll(), []
        for k, ev in enumerate(events):
            if isinstance(ev, OpCompleted) and self.copier is not None and self.copier.busy(ev.op_id):
                # This process still copies for the op (an order it took before the daemon gave the op
                # up): the engine must not act on its end yet. What came after it waits too, in order.
                self._deferred = events[k:]
                break
            if isinstance(ev, OpCompleted):
                self.done[ev.op_id] = ev
                self.new_completed.add(ev.op_id)
                self.copied.discard(ev.op_id)
                self.landed.pop(ev.op_id, None)
            elif isinstance(ev, LayersCopied) and ev.op_id not in self.done:
                self.landed[ev.op_id] = max(self.landed.get(ev.op_id, 0), ev.layers)
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
        if self.copier is not None and any(self.copier.busy(op) for op in job.ops):
            return False  # this process still writes its blocks
        if all(op in self.done for op in job.ops):
            return True
        return time.time() * 1000 > job.deadline_ms + 500 or self._gone()

    def _in_place(self, job: LoadJob) -> bool:
        """The job's bytes are in the engine's blocks (and checked, unless the engine takes late load
        checks), or it is settled."""
        return all(op in self.done or op in self.copied for op in job.ops) or self._settled(job)

    def _fail_unloaded(self, job: LoadJob) -> list[int]:
        ok: set[int] = set()
        for op_id, blocks in job.ops.items():
            self.copied.discard(op_id)
            ev = self.done.get(op_id)  # kept (in the window): a wait on the op later knows it ended
            if ev is not None:
                ok.update(set(blocks) - set(ev.failed_block_ids))
        failed = [b for b in job.targets if b not in ok]
        if failed:
            self.log.info("kvdepot: request %s: %d of %d blocks not loaded%s", job.request_id, len(failed), len(job.targets), self.on_failed_load)
            self.load_errors.update(failed)
        return failed

    def _wait(self, settled: Any) -> None:
        while True:
            self._absorb()
            if settled() or self.link is None:
                return
            self.link.wait_for_events(0.01)

    # per step --------------------------------------------------------------------------------------
    def preempted(self, meta: StepMeta) -> None:
        ops = [op for ops in meta.preempted_ops.values() for op in ops]
        if ops and self.link is not None:
            deadline = time.monotonic() + self.cfg.release_timeout_s
            self._wait(lambda: all(op in self.done for op in ops) or self._gone() or time.monotonic() > deadline)

    def start_loads(self, meta: StepMeta) -> None:
        sync = [job for job in meta.loads if not job.is_async]
        for job in meta.loads:
            if job.is_async:
                self.async_jobs[job.request_id] = job
        if not sync:
            return
        if self.layerwise:  # the forward waits in wait_for_layer, each layer for its own bytes
            self.layer_jobs, self.awaited = sync, set()
            self.checking += sync
            return
        # The forward may start once the bytes are in place; whether they were intact is known by
        # the end of the step (take_load_errors), and vLLM drops a step's output for a request whose
        # loaded blocks it is told failed after the forward.
        self._wait(lambda: all(self._in_place(job) for job in sync))
        self.checking += sync

    def wait_for_layer(self, layer: int, own: bool = True) -> None:
        """Before the forward reads `layer` of this step's loaded blocks: waits until that layer
        of every synchronous load is in place (or its op has settled: the blocks that did not
        arrive are reported after the forward). Its bytes may not be checked yet: their verdict
        comes with take_load_errors, as with late load checks. `own`: the wait is that layer's
        (not another layer's that waits for it): the forward reads it only after."""
        if not self.layer_jobs:
            return
        if own:
            self.awaited.add(layer)
        jobs = self.layer_jobs
        self._wait(lambda: all(self._layer_in_place(job, layer) for job in jobs))

    def _layer_in_place(self, job: LoadJob, layer: int) -> bool:
        return all(op in self.done or op in self.copied or self.landed.get(op, 0) > layer for op in job.ops) or self._settled(job)

    def _spoiled_loads(self) -> list[LoadJob]:
        """This step's loads its forward may have read before they landed: all of them when it did
        not wait for every layer (an engine that calls wait_for_layer_load for some layers only),
        and then this worker waits for whole loads from now on."""
        jobs, self.layer_jobs = self.layer_jobs, []
        if not jobs or self.layout is None:
            return []
        missed = sorted(set(range(self.layout.num_layers)) - self.awaited)
        if not missed:
            return []
        self.log.warning(
            "kvdepot: worker %d: the forward did not wait for layers %s of its loads; they are recomputed, and loads are waited for whole from now on",
            self.rank, missed[:8],
        )
        self.layerwise = False
        return jobs

    def forward_done(self, step: int, stream: Any = None) -> None:
        """The forward of `step` is done (CPU) or enqueued: on CUDA an interprocess event recorded
        on `stream` (default: the current stream) tells the daemon when it ends."""
        if self.link is None or step <= 0:
            return
        event = None
        if self.cuda:
            event = torch.cuda.Event(interprocess=not self.engine_copies)
            event.record(stream)
        if self.copier is not None:  # its stores' copies wait for the event on the copier's stream
            self.copier.note_forward(step, event)
            event = None
        self.link.forward_done(step, event)

    def finished(self, finished_req_ids: set[str], held: dict[str, bool] | None) -> tuple[set[str] | None, set[str] | None]:
        """(requests that may be reported finished sending, async loads that ended). `held`: the
        step's delayed requests -> whether the daemon still holds them (it says when it lets go)."""
        self._absorb()
        self.seen_finished |= finished_req_ids
        if held is not None:
            for rid, holds in held.items():
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
        spoiled = self._spoiled_loads()
        if self.checking:
            jobs, self.checking = self.checking, []
            self._wait(lambda: all(self._settled(job) for job in jobs))  # the spoiled ones too: nothing writes their blocks after
            for job in jobs:
                self._fail_unloaded(job)
        for job in spoiled:
            self.load_errors.update(job.targets)
        out, self.load_errors = self.load_errors, set()
        return out

    def take_completed(self) -> set[int]:
        """Op ids that ended since the last call."""
        out, self.new_completed = self.new_completed, set()
        return out

    def close_link(self) -> None:
        if self.link is not None:
            self.link.close()
        if self.client is not None:
            self.client.close()
        self.link, self.client = None, None

    def close(self) -> None:
        """Leaves the engine (the last of its processes to leave ends it) and lets go of the shared
        memory; idempotent (it runs at exit too)."""
        self.close_link()
        if self.copier is not None:
            self.copier.close()
        handles.remove_shm_files(self.paths)
        handles.close_fds(self.fds)
        self.fds, self.paths = [], []
