"""The connector's scheduler side (EngineCore process): decides what the daemon hears each step,
at most one Step per engine step (KvDepotConnector's docstring maps vLLM's hooks to the methods)."""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.v1.request import RequestStatus

from kvdepot.layout import KvLayout
from kvdepot.messages import StepBatch, StepResult, cached_update_needed
from kvdepot.connector.config import ConnectorConfig
from kvdepot.client import DepotClient
from kvdepot.connector.instance import mint
from kvdepot.connector.worker import STARTUP_WAIT_S, close_at_exit, connect, disconnect, load_jobs, send_step, wait_mapped
from kvdepot.vllm.common import KvDepotMetadata

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvdepot.vllm")
# Finish reasons that come from a sampled token, so from a forward after all of the request's loads.
_SAMPLED_STOPS = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_REPETITION)


@dataclass
class ReqState:
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


class SchedulerSide:
    def __init__(self, cfg: ConnectorConfig, layout: KvLayout | None, model: str) -> None:
        self.cfg = cfg
        self.layout = layout
        self.model = model
        self.bs = layout.block_size if layout else 0
        self.key = ""  # the engine's key: from the workers' handshake (connect), kvdepot.connector.instance
        self.client: DepotClient | None = None
        self.reqs: dict[str, ReqState] = {}
        self.guess: dict[str, tuple[int, int]] = {}  # rid -> (L, E) answered, not yet committed
        self.async_starts: list[str] = []
        self.to_finish: list[str] = []  # finished since the last step, known to the daemon
        self.delayed: set[str] = set()  # request_finished said True: the workers report their release
        self.op_owner: dict[int, str] = {}
        self.admissions: collections.deque[tuple[str, int, int, int]] = collections.deque(maxlen=1024)  # (rid, L, E, C) sent
        close_at_exit(self)

    def connect(self, keys: Iterable[str] = (), engine_copies: Iterable[bool] = ()) -> None:
        """Registers the engine under the key its workers minted and joined (vLLM hands their
        handshake over before the engine serves), or, when none came, under one minted here, which
        the workers then learn from the first step's metadata; with engine_copies when the workers
        copy their blocks themselves."""
        if self.client is not None or self.layout is None:
            return
        found, copies = sorted({k for k in keys if k}), set(engine_copies)
        if len(found) > 1 or len(copies) > 1:
            log.error("kvdepot: the workers joined different engine keys or copy modes: the connector stays off")
            self.layout = None
            return
        self.key = found[0] if found else mint("vllm", self.model)
        self.client = connect(self.cfg, self.layout, self.model, self.key, self.cfg.engine_name, engine_copies=copies == {True})
        if self.client is not None and found:  # start-up: serve once the workers' memory is mapped
            wait_mapped(self.client, STARTUP_WAIT_S, log)
    def _usable(self, request: Request) -> bool:
        self.connect()  # no handshake came (the workers could not share their caches): a key of our own
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
            st = self.reqs[rid] = ReqState(request)
        st.L, st.E, st.table = L, E, table
        st.is_async = st.waiting_load = bool(E) and self.cfg.load_async
        st.announced = False
        if st.is_async:
            self.async_starts.append(rid)

    def build(self, so: SchedulerOutput) -> KvDepotMetadata:
        meta = KvDepotMetadata()
        if self.client is None:
            return meta
        meta.engine_key = self.key
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
        loads: list[ReqState] = []
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
        batch, result, meta.step = send_step(self.client, batch, self.reqs)
        self._take_result(batch, result, loads, meta)
        return meta

    def _new(self, batch: StepBatch, st: ReqState, C: int, S: int) -> None:
        assert self.client is not None
        if st.epoch != self.client.epoch:  # first contact or a restarted daemon: send everything
            st.epoch, st.sent_tokens, st.lost = self.client.epoch, 0, False
        elif st.lost:
            return
        req = st.request
        # A new update carries the whole sequence the daemon holds (a resumed request's chunk may
        # end before the tokens sent before it was preempted), and what this step computes.
        upto = min(len(req.all_token_ids), max(C + S, st.L + st.E, st.sent_tokens))
        L = min(st.L, C)
        E = st.E if L + st.E <= C else 0
        batch.new(
            req.request_id, req.all_token_ids[:upto], st.table, computed=C, scheduled=S, device_matched=L,
            loaded=E, cache_salt=req.cache_salt or "", lora_name=req.lora_request.lora_name if req.lora_request else "",
        )
        st.sent_tokens, st.sent_blocks, st.sent_end, st.announced = upto, len(st.table), C + S, True
        self.admissions.append((req.request_id, L, E, C))
        log.debug("kvdepot: request %s admitted: L=%d E=%d computed=%d scheduled=%d", req.request_id, L, E, C, S)

    def _cached(self, batch: StepBatch, st: ReqState, C: int, S: int, force: bool = False) -> None:
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

    def _take_result(self, batch: StepBatch, result: StepResult, loads: list[ReqState], meta: KvDepotMetadata) -> None:
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
        for op in result.ops:
            st = self.reqs.get(op.request_id)
            if st is not None:
                st.open_ops[op.op_id] = op.kind
                self.op_owner[op.op_id] = op.request_id
        meta.loads += load_jobs(result.ops, [(st.request.request_id, st.table[st.L // self.bs : (st.L + st.E) // self.bs], st.is_async) for st in loads])

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
        disconnect(self.client)
        self.client, self.layout = None, None  # no connect() again
