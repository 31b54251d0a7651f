"""KvDepotConnector: vLLM's KVConnectorBase_V1 on top of the kvdepot client.

One class, two roles (reference/engines.md A1):

Scheduler (EngineCore process)
    get_num_new_matched_tokens  records L (vLLM's own prefix hit, the argument) and asks the daemon
                                for E under a short deadline; a miss when the daemon is slow or down
    update_state_after_alloc    commits L, E and the block table (async loads: the 2nd call only
                                brings the full table)
    build_connector_meta        at most one Step RPC per engine step, none when nothing matters
                                (a decode step that completes no block): new updates carry L and E
                                apart, so the blocks vLLM already had are never stored again
    request_finished            delays the free while an op of the request may still touch its blocks
Worker (each worker process)
    register_kv_caches          moves CPU KV tensors onto shared memory (set_()): memfds handed over
                                on the daemon's handoff socket when `address` is unix:PATH, /dev/shm
                                files otherwise; or exports CUDA IPC handles; then registers them
                                under the engine's shared key
    start_load_kv               waits for this step's synchronous loads (never past the op's deadline)
    wait_for_save               reports forward-done (CPU) or records an interprocess CUDA event
    get_finished / get_block_ids_with_load_errors   from the daemon's completion stream

Everything the two roles exchange rides in KvDepotMetadata (scheduler -> workers) and
KvDepotWorkerMetadata (workers -> scheduler): small, picklable, no tensors.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import RequestStatus

from kvdepot import handles
from kvdepot.client import DepotClient, WorkerLink
from kvdepot.errors import DepotError
from kvdepot.handoff import handoff_path
from kvdepot.layout import KvLayout
from kvdepot.messages import LoadCopied, OpCompleted, RequestReleased, StepBatch, StepResult, cached_update_needed
from kvdepot.vllm.config import ConnectorConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvdepot.vllm")
_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
_NOT_ATTACHED_GRACE_S = 0.5  # a worker stream down this long while we wait: the daemon is gone
# Finish reasons that come from a sampled token, so from a forward after all of the request's loads.
_SAMPLED_STOPS = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_REPETITION)


# -- what crosses the process boundary ----------------------------------------------------------------
@dataclass
class LoadJob:
    """Loads into one request's blocks: the targets vLLM counts on, and the daemon's ops for them.
    A target no successful op covered is a failed block (vLLM recomputes it)."""

    request_id: str
    targets: list[int]
    ops: dict[int, tuple[int, ...]]  # op id -> engine block ids
    deadline_ms: int  # unix ms after which no op of this job can still write (daemon deadline)
    is_async: bool


@dataclass
class KvDepotMetadata(KVConnectorMetadata):
    step: int = 0  # the client's step number when stores wait on this step's forward (else 0)
    loads: list[LoadJob] = field(default_factory=list)
    finished: dict[str, bool] = field(default_factory=dict)  # delayed request -> the daemon still holds it
    preempted_ops: dict[str, list[int]] = field(default_factory=dict)  # ops that may still read freed blocks


@dataclass
class KvDepotWorkerMetadata(KVConnectorWorkerMetadata):
    completed: set[int] = field(default_factory=set)  # op ids that ended (every rank hears of each)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KvDepotWorkerMetadata):
            return KvDepotWorkerMetadata(self.completed | other.completed)
        return self


# -- the connector -----------------------------------------------------------------------------------
class KvDepotConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = self._kv_transfer_config
        self.cfg = ConnectorConfig.from_extra(tc.kv_connector_extra_config)
        layout, why = layout_of(vllm_config, kv_cache_config)
        if layout is None:
            log.error("kvdepot: connector disabled: %s", why)
        model = vllm_config.model_config.model
        key = f"vllm:{tc.engine_id}"
        self._sched: _Scheduler | None = None
        self._worker: _Worker | None = None
        if role == KVConnectorRole.SCHEDULER:
            if tc.kv_load_failure_policy != "recompute" and not self.cfg.keep_fail_policy:
                log.info("kvdepot: kv_load_failure_policy set to 'recompute': a failed load of a cache costs a hit, not the request")
                tc.kv_load_failure_policy = "recompute"
            self._sched = _Scheduler(self.cfg, layout, model, key)
        else:
            self._worker = _Worker(self.cfg, layout, model, key)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped store is a future miss

    # -- scheduler role -----------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._sched is not None
        return self._sched.matched(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._sched is not None
        self._sched.allocated(request, blocks.get_block_ids(), num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._sched is not None
        return self._sched.build(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._sched is not None
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, KvDepotWorkerMetadata):
            self._sched.completed(meta.completed)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        return self._sched.finished(request), None

    # -- worker role -----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self._worker is not None and isinstance(kv_connector_metadata, KvDepotMetadata):
            self._worker.preempted(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvDepotMetadata)
        self._worker.start_loads(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv already waited for the step's synchronous loads

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        return  # the daemon copies computed blocks itself once the forward is reported done

    def wait_for_save(self) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvDepotMetadata)
        self._worker.forward_done(meta.step)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        meta = self._connector_metadata
        return self._worker.finished(finished_req_ids, meta if isinstance(meta, KvDepotMetadata) else None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.take_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        assert self._worker is not None
        return self._worker.worker_meta()

    def shutdown(self) -> None:
        for side in (self._sched, self._worker):
            if side is not None:
                side.close()


def layout_of(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> tuple[KvLayout | None, str]:
    """The engine's KvLayout, the same in every process (both roles derive it from kv_cache_config),
    or None and the reason when kvdepot cannot serve this model."""
    from vllm.platforms import current_platform
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        return None, f"the model has {len(groups)} KV cache groups; kvdepot serves plain attention models (one group)"
    spec = groups[0].kv_cache_spec
    if type(spec) is not FullAttentionSpec or isinstance(spec, MLAAttentionSpec) or getattr(spec, "sliding_window", None):
        return None, f"KV cache spec {type(spec).__name__} is not plain full attention"
    if spec.dtype not in _DTYPES:
        return None, f"KV cache dtype {spec.dtype} is not supported (float16, bfloat16, float32)"
    pc = vllm_config.parallel_config
    if pc.pipeline_parallel_size != 1:
        return None, "pipeline parallelism is not supported yet"
    layout = KvLayout(
        num_layers=len(groups[0].layer_names),
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        dtype=_DTYPES[spec.dtype],
        block_size=spec.block_size,
        world_size=pc.tensor_parallel_size,
        kind="vllm_cpu" if current_platform.is_cpu() else "vllm_flash",
    )
    try:
        layout.validate()
    except ValueError as e:
        return None, str(e)
    return layout, ""


def _connect(cfg: ConnectorConfig, layout: KvLayout, model: str, key: str, name: str) -> DepotClient | None:
    client = DepotClient(cfg.address, deadline_s=cfg.step_timeout_ms / 1000, tls=cfg.tls(), token=cfg.token)
    try:
        engine_id = client.register_engine(model, layout, name=name, namespace=cfg.namespace, engine_key=key, late_load_checks=cfg.late_checks_for(layout))
    except DepotError as e:
        log.error("kvdepot: the daemon at %s refused the engine (%s); the connector stays off", cfg.address, e)
        client.close()
        return None
    if engine_id:
        log.info("kvdepot: %s connected to %s as engine %s", name, cfg.address, engine_id)
    else:
        log.warning("kvdepot: no daemon at %s yet; serving without it and retrying in the background", cfg.address)
    return client


# -- scheduler side ------------------------------------------------------------------------------------
@dataclass
class _Req:
    request: Any  # vllm Request: its all_token_ids grow as it decodes
    L: int = 0  # vLLM's own prefix hit at the last admission
    E: int = 0  # tokens loaded from the daemon at the last admission
    table: list[int] = field(default_factory=list)
    is_async: bool = False
    waiting_load: bool = False  # an async load is running: the next allocation only extends the table
    announced: bool = False  # the daemon got this admission's new update
    epoch: int = -1  # the client's registration epoch when the daemon learned of it
    sent_tokens: int = 0
    sent_blocks: int = 0
    sent_end: int = 0  # computed + scheduled of the last update sent
    open_ops: dict[int, str] = field(default_factory=dict)  # op id -> kind, until its completion comes back
    lost: bool = False  # a Step carrying its update went unanswered (see _take_result)


class _Scheduler:
    def __init__(self, cfg: ConnectorConfig, layout: KvLayout | None, model: str, key: str) -> None:
        self.cfg = cfg
        self.bs = layout.block_size if layout else 0
        self.client = _connect(cfg, layout, model, key, cfg.engine_name) if layout else None
        self.reqs: dict[str, _Req] = {}
        self.guess: dict[str, tuple[int, int]] = {}  # rid -> (L, E) answered, not yet committed
        self.async_starts: list[str] = []
        self.to_finish: list[str] = []  # finished since the last step, known to the daemon
        self.delayed: set[str] = set()  # request_finished said True: the workers report their release
        self.op_owner: dict[int, str] = {}
        self.admissions: collections.deque[tuple[str, int, int, int]] = collections.deque(maxlen=1024)  # (rid, L, E, C) sent

    def _usable(self, request: Request) -> bool:
        return self.client is not None and not request.mm_features and getattr(request, "prompt_embeds", None) is None

    def matched(self, request: Request, L: int) -> tuple[int, bool]:
        st = self.reqs.get(request.request_id)
        if not self._usable(request) or (st is not None and st.lost and st.epoch == self.client.epoch):  # type: ignore[union-attr]
            return 0, False  # a lost request gets no updates, so nothing could be loaded for it
        assert self.client is not None
        offerable = (request.num_tokens - 1) // self.bs * self.bs - L  # never past the last prompt token
        if offerable <= 0 or L % self.bs:
            self.guess[request.request_id] = (L, 0)
            return 0, False  # vLLM has all it can use itself: no round trip
        tokens = list(request.all_token_ids)
        lora = request.lora_request.lora_name if request.lora_request else ""
        res = self.client.lookup(
            request.request_id, tokens, device_matched_tokens=L, cache_salt=request.cache_salt or "",
            lora_name=lora, timeout_s=self.cfg.lookup_timeout_ms / 1000,
        )
        E = min(res.matched_tokens, offerable)
        self.guess[request.request_id] = (L, E)
        return E, bool(E) and self.cfg.load_async

    def allocated(self, request: Request, block_ids: tuple[list[int], ...], E: int) -> None:
        if not self._usable(request):
            return
        rid = request.request_id
        table = list(block_ids[0]) if block_ids else []
        st = self.reqs.get(rid)
        if st is not None and st.waiting_load:  # 2nd call of an async load: the full table
            st.table, st.waiting_load = table, False
            return
        L, _ = self.guess.pop(rid, (0, 0))
        if st is None:
            st = self.reqs[rid] = _Req(request)
        st.L, st.E, st.table = L, E, table
        st.is_async = st.waiting_load = bool(E) and self.cfg.load_async
        st.announced = False
        if st.is_async:
            self.async_starts.append(rid)

    def build(self, so: SchedulerOutput) -> KvDepotMetadata:
        meta = KvDepotMetadata()
        if self.client is None:
            return meta
        epoch = self.client.epoch
        batch = StepBatch()
        batch.finished, self.to_finish = self.to_finish, []
        for rid in so.preempted_req_ids or ():
            st = self.reqs.get(rid)
            if st is None:
                continue
            if st.epoch == epoch and st.announced:
                batch.preempted.append(rid)
            if st.open_ops:
                meta.preempted_ops[rid] = sorted(st.open_ops)
            st.announced, st.table, st.sent_blocks, st.sent_end = False, [], 0, 0
        loads: list[_Req] = []
        starts, self.async_starts = self.async_starts, []
        for rid in starts:
            st = self.reqs.get(rid)
            if st is not None and st.waiting_load:
                self._new(batch, st, st.L + st.E, 0)
                loads.append(st)
        num_sched = so.num_scheduled_tokens
        for nr in so.scheduled_new_reqs:
            st = self.reqs.get(nr.req_id)
            if st is None:
                continue
            C, S = nr.num_computed_tokens, num_sched.get(nr.req_id, 0)
            st.table = list(nr.block_ids[0]) if nr.block_ids else []
            if st.announced:  # its async load ran: now it computes
                self._cached(batch, st, C, S, force=True)
                continue
            if C != st.L + st.E:
                log.warning("kvdepot: request %s: vLLM computed %d tokens, the connector expected L=%d + E=%d", nr.req_id, C, st.L, st.E)
            self._new(batch, st, C, S)
            if st.E:
                loads.append(st)
        cr = so.scheduled_cached_reqs
        for i, rid in enumerate(cr.req_ids):
            st = self.reqs.get(rid)
            if st is None:
                continue
            C, S, nb = cr.num_computed_tokens[i], num_sched.get(rid, 0), cr.new_block_ids[i]
            if rid in cr.resumed_req_ids:
                st.table = list(nb[0]) if nb else []
                self._new(batch, st, C, S)
                if st.E:
                    loads.append(st)
                continue
            if nb:
                st.table += nb[0]
            if st.epoch == epoch and st.announced:
                self._cached(batch, st, C, S)
        if not self.client.engine_id:  # not registered (yet): the daemon knows none of this
            for rid in batch.request_ids:
                self.reqs[rid].epoch = -1
            batch = StepBatch()
        result = self.client.step(batch)
        # Workers report the forward done only for steps with stores waiting on it: a decode step
        # that completes no block sends nothing to the daemon at all.
        meta.step = result.step if any(op.kind == "store" for op in result.ops) else 0
        self._take_result(batch, result, loads, meta)
        return meta

    def _new(self, batch: StepBatch, st: _Req, C: int, S: int) -> None:
        assert self.client is not None
        if st.epoch != self.client.epoch:  # first contact or a restarted daemon: send everything
            st.epoch, st.sent_tokens, st.lost = self.client.epoch, 0, False
        elif st.lost:
            return
        req = st.request
        upto = min(len(req.all_token_ids), max(C + S, st.L + st.E))
        L = min(st.L, C)
        E = st.E if L + st.E <= C else 0
        batch.new(
            req.request_id, req.all_token_ids[st.sent_tokens : upto], st.table, computed=C, scheduled=S, device_matched=L,
            loaded=E, cache_salt=req.cache_salt or "", lora_name=req.lora_request.lora_name if req.lora_request else "",
        )
        st.sent_tokens, st.sent_blocks, st.sent_end, st.announced = upto, len(st.table), C + S, True
        self.admissions.append((req.request_id, L, E, C))
        log.debug("kvdepot: request %s admitted: L=%d E=%d computed=%d scheduled=%d", req.request_id, L, E, C, S)

    def _cached(self, batch: StepBatch, st: _Req, C: int, S: int, force: bool = False) -> None:
        """Sparse (cached_update_needed): a plain decode step costs the engine no round trip."""
        end = C + S
        if st.lost:
            return
        if not (force or cached_update_needed(self.bs, len(st.table), st.sent_blocks, C, S, st.sent_end)):
            return
        req = st.request
        upto = min(len(req.all_token_ids), end)
        batch.cached(req.request_id, req.all_token_ids[st.sent_tokens : upto], st.table[st.sent_blocks :], computed=C, scheduled=S)
        st.sent_tokens, st.sent_blocks, st.sent_end = max(st.sent_tokens, upto), len(st.table), end

    def _take_result(self, batch: StepBatch, result: StepResult, loads: list[_Req], meta: KvDepotMetadata) -> None:
        if result.degraded and len(batch):
            # The daemon may or may not have applied these updates: its record of them is unknown,
            # so they get no more updates (resent tokens could be counted twice there). They are
            # still reported preempted and finished, so the daemon lets go of them.
            for rid in batch.request_ids:
                st = self.reqs.get(rid)
                if st is not None:
                    st.lost = True
        for rid in batch.finished:
            if rid in self.delayed:
                self.delayed.discard(rid)
                meta.finished[rid] = result.degraded or rid in result.delay_free
        by_req: dict[str, dict[int, tuple[int, ...]]] = collections.defaultdict(dict)
        deadline: dict[str, int] = {}
        for op in result.ops:
            st = self.reqs.get(op.request_id)
            if st is not None:
                st.open_ops[op.op_id] = op.kind
                self.op_owner[op.op_id] = op.request_id
            if op.kind == "load":
                by_req[op.request_id][op.op_id] = op.block_ids
                deadline[op.request_id] = max(deadline.get(op.request_id, 0), op.deadline_ms)
        for st in loads:
            first, end = st.L // self.bs, (st.L + st.E) // self.bs
            rid = st.request.request_id
            meta.loads.append(LoadJob(rid, st.table[first:end], by_req.get(rid, {}), deadline.get(rid, 0), st.is_async))

    def completed(self, op_ids: set[int]) -> None:
        for op_id in op_ids:
            rid = self.op_owner.pop(op_id, None)
            st = self.reqs.get(rid) if rid is not None else None
            if st is not None:
                st.open_ops.pop(op_id, None)

    def finished(self, request: Request) -> bool:
        """Whether vLLM must keep the request's blocks until the daemon released it. Decided here,
        without a round trip: completions reach the scheduler a step late (through the workers), so
        open ops are known from their kind. A request that stopped on a sampled token ran a forward
        after each of its loads, and a worker ends a step only once that step's loads ended (async
        loads end before the request is scheduled): only its stores can still run. An aborted
        request's load may. The next Step's answer (delay_free) says whether the daemon still holds
        it, and the worker reports the release."""
        rid = request.request_id
        self.guess.pop(rid, None)
        st = self.reqs.pop(rid, None)
        if st is None or self.client is None or st.epoch != self.client.epoch:
            return False
        self.to_finish.append(rid)
        for op_id in st.open_ops:
            self.op_owner.pop(op_id, None)
        kinds = set(st.open_ops.values())  # a store may still read its blocks, a load still write them
        if st.lost or "store" in kinds or (kinds and request.status not in _SAMPLED_STOPS):
            self.delayed.add(rid)
            return True
        return False

    def close(self) -> None:
        if self.client is not None:
            try:
                self.client.unregister()
            except DepotError:
                pass
            self.client.close()


# -- worker side ---------------------------------------------------------------------------------------
class _Worker:
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
        self.client = _connect(self.cfg, self.layout, self.model, self.key, f"{self.cfg.engine_name}-worker-{self.rank}")
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


__all__ = ["KvDepotConnector", "KvDepotMetadata", "KvDepotWorkerMetadata", "LoadJob", "layout_of"]
