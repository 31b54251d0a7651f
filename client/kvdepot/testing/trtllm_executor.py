"""StandInExecutor: TensorRT-LLM's PyTorch executor loop with a KV cache connector, replayed over
real KV memory (FakeKv: one pool per rank in TensorRT-LLM's layout), for tests of a connector
without TensorRT-LLM. It drives the connector exactly as TensorRT-LLM does
(py_executor_creator.py, py_executor.py, kv_cache_connector.py):

    * construction: the module is imported and the classes looked up by name; a worker per rank,
      the scheduler on rank 0 only, both built from the LLM arguments; register_kv_caches(pool)
      on every rank once the pool exists, then wait_for_initialization() on rank 0;
    * admission (the KV cache manager's addSequence): the engine's own prefix hit L (whole
      blocks, at most n-1 tokens, block reuse, of finished requests and of running ones whose
      context phase ended), get_num_new_matched_tokens(request, L) -> (E,
      async) ((0, True) raises), blocks for the whole prompt, context_current_position = L + E,
      update_state_after_alloc(request, block_ids); an async request is parked
      (DISAGG_GENERATION_TRANS_IN_PROGRESS) until get_finished returns it on every rank;
    * each iteration that schedules a request (an idle one only calls get_finished): the scheduler output (KvCacheConnectorSchedulerOutputManager's rules: a
      context request is new the first time it is emitted, with its whole prompt and every block,
      later emissions are deltas; a synchronous load's tokens are subtracted from a new request's
      computed_position; generation requests are cached with computed_position = len - 1 and 1
      scheduled token; parked requests are left out), build_connector_meta on rank 0, its
      metadata pickled to every rank (bind_connector_meta), start_load_kv, the layer hooks, the
      forward (KV written for the computed positions), wait_for_save, sampling, request_finished
      for finished requests (True keeps their blocks), then get_finished on every rank with the
      ids newly passed in, acting on ids every rank returned; an id returned before it was passed
      in raises, as TensorRT-LLM's own bookkeeping does;
    * preempt(): a request's allocation dies and it runs again from the start (TensorRT-LLM's
      request replay): its blocks are freed and poisoned, its deltas dropped;
    * cancel(): the user cancels a request. As TensorRT-LLM's releases do it (asks=False): the
      connector is not asked; a running request's blocks are freed at once, one parked for an async
      load is kept until every rank returned it loaded (the newest release's
      has_pending_transfers). Or (asks=True) request_finished decides whether its blocks are freed
      now (False) or once every rank returned it as saved (True), which catches a connector that
      answers False while its load still writes;
    * admission waits while the pool has too few free blocks for a request (GUARANTEED_NO_EVICT);
    * `honour`: the KV cache manager takes less of an offer than the connector made
      (KVCacheManagerV2's commit_new_matched_tokens) and computes the rest.

After each context phase it checks every position's KV on every rank against what a forward
writes (`bad_kv`): a load that brought wrong bytes shows up there.
"""

from __future__ import annotations

import collections
import importlib
import pickle
import time
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

from kvdepot.layout import KvLayout
from kvdepot.testing import trtllm as api
from kvdepot.testing.kv import FakeKv
from kvdepot.testing.trtllm import LlmRequest, LlmRequestState, RequestData, SchedulerOutput, TorchLlmArgs

PARKED = LlmRequestState.DISAGG_GENERATION_TRANS_IN_PROGRESS
SAVING = LlmRequestState.DISAGG_CONTEXT_TRANS_IN_PROGRESS


def next_token(tokens: list[int]) -> int:
    """Greedy sampling's stand-in: a function of the tokens alone."""
    return (sum(tokens[-3:]) * 31 + len(tokens)) % 400 + 1000


@dataclass
class _Emitted:
    block_ids: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)


class _OutputManager:
    """KvCacheConnectorSchedulerOutputManager, rule for rule."""

    def __init__(self) -> None:
        self.requests: dict[int, _Emitted] = collections.defaultdict(_Emitted)
        self.external_loads: dict[int, int] = {}

    def build(self, context: list[LlmRequest], generation: list[LlmRequest], loading: set[int], tables: dict[int, list[int]]) -> SchedulerOutput:
        out = SchedulerOutput()
        for req in context:
            if req.request_id in loading:
                continue
            is_new = req.request_id not in self.requests
            data = self._data(req, tables[req.request_id])
            if req.request_id in self.external_loads:
                data.computed_position -= self.external_loads[req.request_id]
            (out.new_requests if is_new else out.cached_requests).append(data)
        for req in generation:
            out.cached_requests.append(self._data(req, tables[req.request_id]))
        self.external_loads = {}
        return out

    def _data(self, req: LlmRequest, table: list[int]) -> RequestData:
        seen = self.requests[req.request_id]
        tokens = req.get_tokens(0)
        new_blocks, new_tokens = table[len(seen.block_ids) :], tokens[len(seen.tokens) :]
        seen.block_ids += new_blocks
        seen.tokens += new_tokens
        if req.state is LlmRequestState.CONTEXT_INIT:
            computed, scheduled = req.context_current_position, min(req.context_remaining_length, req.context_chunk_size)
        else:
            computed, scheduled = len(tokens) - 1, 1
        return RequestData(req.request_id, new_tokens, new_blocks, computed, scheduled, cache_salt=req.cache_salt)

    def reset_request(self, request_id: int) -> None:
        self.requests.pop(request_id, None)
        self.external_loads.pop(request_id, None)


class _Blocks:
    """The KV cache manager's pool with block reuse: full blocks of finished context are kept,
    keyed by their token prefix, and reused (least recently used evicted first)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.free = collections.deque(range(num_blocks))
        self.reusable: collections.OrderedDict[tuple[int, ...], int] = collections.OrderedDict()
        self.key_of: dict[int, tuple[int, ...]] = {}
        self.refs: collections.Counter[int] = collections.Counter()
        self.in_use: dict[tuple[int, ...], int] = {}

    def match(self, tokens: list[int]) -> list[int]:
        out: list[int] = []
        for i in range((len(tokens) - 1) // self.bs):
            key = tuple(tokens[: (i + 1) * self.bs])
            block = self.in_use.get(key, self.reusable.get(key))
            if block is None:
                break
            out.append(block)
        return out

    def publish(self, table: list[int], tokens: list[int], computed: int) -> None:
        """A context's full computed blocks become reusable by other requests while it runs on
        (TensorRT-LLM stores a context's blocks for reuse as its context phase ends)."""
        for i, b in enumerate(table[: computed // self.bs]):
            key = tuple(tokens[: (i + 1) * self.bs])
            if key not in self.in_use and key not in self.reusable and b not in self.key_of:
                self.in_use[key], self.key_of[b] = b, key

    def can_take(self, hit: list[int], n: int) -> bool:
        return len(self.free) + len(self.reusable) - sum(1 for b in hit if self.key_of.get(b) in self.reusable) >= n

    def take(self, hit: list[int], n: int) -> list[int]:
        for b in hit:
            key = self.key_of[b]
            self.reusable.pop(key, None)
            self.in_use[key] = b
            self.refs[b] += 1
        fresh = [self._one() for _ in range(n)]
        return hit + fresh

    def _one(self) -> int:
        if not self.free:
            if not self.reusable:
                raise RuntimeError("the stand-in's KV pool is full")
            key, b = self.reusable.popitem(last=False)
            del self.key_of[b]
            self.free.append(b)
        b = self.free.popleft()
        self.refs[b] += 1
        return b

    def release(self, table: list[int], tokens: list[int], computed: int, reuse: bool = True) -> None:
        for i, b in enumerate(table):
            self.refs[b] -= 1
            if self.refs[b] > 0:
                continue
            key = tuple(tokens[: (i + 1) * self.bs])
            if reuse and (i + 1) * self.bs <= computed and self.key_of.get(b, key) == key:
                self.key_of[b] = key
                self.in_use.pop(key, None)
                self.reusable[key] = b
            else:
                if b in self.key_of:
                    self.in_use.pop(self.key_of.pop(b), None)
                self.free.append(b)

    def reset_reuse(self) -> None:
        for key, b in self.reusable.items():
            del self.key_of[b]
            self.free.append(b)
        self.reusable.clear()


@dataclass
class _Async:
    saving: dict[int, LlmRequest] = field(default_factory=dict)
    loading: dict[int, LlmRequest] = field(default_factory=dict)


class StandInExecutor:
    def __init__(
        self,
        layout: KvLayout,
        num_blocks: int,
        llm_args: TorchLlmArgs,
        *,
        connector_module: str = "kvdepot.trtllm",
        scheduler_class: str = "KvDepotScheduler",
        worker_class: str = "KvDepotWorker",
        chunk_size: int = 0,
        max_batch: int = 8,
        device: str = "cpu",
        honour: Callable[[int], int] | None = None,
        pool_alloc: Callable[[tuple[int, ...], Any], Any] | None = None,
    ) -> None:
        """`honour(E)`: the tokens of a connector's offer the KV cache manager takes (KVCacheManagerV2
        may take fewer, recorded in request.py_num_connector_matched_tokens; it computes the rest).
        `pool_alloc(shape, dtype)`: the pool's memory from another allocator than torch's."""
        assert layout.kind == "trtllm" and layout.block_size == llm_args.kv_cache_config.tokens_per_block
        self.layout, self.bs, self.world = layout, layout.block_size, layout.world_size
        self.kv = FakeKv(layout, num_blocks, device, pool_alloc)
        self.blocks = _Blocks(num_blocks, self.bs)
        self.chunk_size = chunk_size
        self.max_batch = max_batch
        self.honour = honour
        self.llm_args = llm_args
        module = importlib.import_module(connector_module)
        worker_cls, scheduler_cls = getattr(module, worker_class), getattr(module, scheduler_class)
        self.workers = []
        for rank in range(self.world):
            api.set_rank(rank)
            self.workers.append(worker_cls(llm_args))
        api.set_rank(0)
        self.scheduler = scheduler_cls(llm_args)
        for rank, worker in enumerate(self.workers):
            api.set_rank(rank)
            worker.register_kv_caches(self.kv.ranks[rank][0])
        api.set_rank(0)
        self.scheduler.wait_for_initialization()
        self.output = _OutputManager()
        self.new_async = _Async()
        self.pending = [_Async() for _ in range(self.world)]
        self.local_done = [_Async() for _ in range(self.world)]
        self.waiting: collections.deque[LlmRequest] = collections.deque()
        self.active: list[LlmRequest] = []
        self.tables: dict[int, list[int]] = {}
        self.done: dict[int, LlmRequest] = {}
        self.bad_kv: dict[int, list[int]] = {}  # request -> positions whose KV was wrong after its context
        self.matched: dict[int, tuple[int, int, bool]] = {}  # request -> (L, E, async) at its last admission
        self.parked: dict[int, int] = {}  # request -> iterations it spent left out of the batch, loading
        self.cancelled: set[int] = set()
        self.dropped_when_loaded: set[int] = set()  # cancelled while parked: freed once its load is reported
        self.iterations = 0
        self._next_id = 1

    # -- requests -----------------------------------------------------------------------------------
    def add(self, prompt: list[int], max_new_tokens: int = 4, **kw: Any) -> LlmRequest:
        req = LlmRequest(self._next_id, prompt, max_new_tokens, **kw)
        self._next_id += 1
        self.waiting.append(req)
        return req

    def preempt(self, req: LlmRequest) -> None:
        """The request's allocation dies; it runs again from the start with the tokens it has."""
        table = self.tables.pop(req.request_id)
        self.blocks.release(table, req.get_tokens(0), 0, reuse=False)
        self.kv.poison(table)
        self.output.reset_request(req.request_id)
        self.active.remove(req)
        req.prompt_len = len(req.get_tokens(0))
        req.context_current_position, req.state = 0, LlmRequestState.CONTEXT_INIT
        self.waiting.appendleft(req)

    def cancel(self, req: LlmRequest, asks: bool = True) -> None:
        """The user cancelled `req`: finished now. `asks`: request_finished(req, blocks) says whether
        its blocks stay (True: until every rank returned it as saved) or are free for the next
        request at once (False); else (TensorRT-LLM's own way) nobody is asked."""
        if req in self.waiting:
            self.waiting.remove(req)
            return
        self.cancelled.add(req.request_id)
        if not asks:
            if req.state is PARKED:
                self.dropped_when_loaded.add(req.request_id)
            else:
                self._terminate(req, reuse=False)
            return
        req.state = LlmRequestState.GENERATION_COMPLETE
        if self.scheduler.request_finished(req, list(self.tables[req.request_id])):
            self.new_async.saving[req.request_id] = req
            req.state = SAVING
        else:
            self._terminate(req, reuse=False)  # what its blocks hold is not the KV of its tokens

    def reset_prefix_cache(self) -> None:
        self.blocks.reset_reuse()

    def run(self, timeout_s: float = 30.0) -> None:
        end = time.monotonic() + timeout_s
        while self.waiting or self.active:
            if time.monotonic() > end:
                raise TimeoutError(f"the stand-in executor did not finish in {timeout_s} s: {len(self.active)} requests active")
            if not self.step():
                time.sleep(0.002)  # only parked or saving requests: wait for the connector

    # -- one iteration --------------------------------------------------------------------------------
    def step(self) -> bool:
        """One executor iteration; False when nothing could be computed."""
        self.iterations += 1
        parked_now = self._admit()
        for r in self.active:
            if r.state is PARKED:
                self.parked[r.request_id] = self.parked.get(r.request_id, 0) + 1
        context = [r for r in self.active if r.state is LlmRequestState.CONTEXT_INIT]
        for r in context:  # the scheduler fixes each context request's chunk for this step
            r.context_chunk_size = min(r.context_remaining_length, self.chunk_size or r.context_remaining_length)
        generation = [r for r in self.active if r.state is LlmRequestState.GENERATION_IN_PROGRESS]
        for r in generation:
            if len(r.get_tokens(0)) > len(self.tables[r.request_id]) * self.bs:
                self.tables[r.request_id] += self.blocks.take([], 1)
        computed = bool(context or generation)
        if computed or parked_now:  # an idle iteration prepares no batch: no metadata, no forward
            so = self.output.build(context, generation, set(self.new_async.loading), self.tables)
            meta = self.scheduler.build_connector_meta(so)
            wire = pickle.dumps(meta)
            for rank, w in enumerate(self.workers):
                api.set_rank(rank)
                w.bind_connector_meta(pickle.loads(wire))
            for rank, w in enumerate(self.workers):
                api.set_rank(rank)
                w.start_load_kv(None)
            self._forward(context, generation)
            for rank, w in enumerate(self.workers):
                api.set_rank(rank)
                w.wait_for_save(None)
            api.set_rank(0)
            self._update(context, generation)
        self._get_finished()
        return computed

    def _admit(self) -> bool:
        """Admits waiting requests; True when one was parked for an async load (it was scheduled
        in this iteration before TensorRT-LLM took it out of the batch)."""
        parked = False
        while self.waiting and len(self.active) < self.max_batch:
            req = self.waiting[0]
            tokens = req.get_tokens(0)
            hit = self.blocks.match(tokens)
            if not self.blocks.can_take(hit, -(-len(tokens) // self.bs) - len(hit)):
                break  # its blocks are not free yet (a finished request still saving holds some)
            self.waiting.popleft()
            L = len(hit) * self.bs
            offered, is_async = self.scheduler.get_num_new_matched_tokens(req, L)
            if offered == 0 and is_async:
                raise RuntimeError("load_kv_async must be False when num_tokens is 0!")
            E = offered if self.honour is None else self.honour(offered)
            if is_async:  # even when less is honoured: the load was asked for
                self.new_async.loading[req.request_id] = req
            self.output.external_loads[req.request_id] = E
            n = -(-len(tokens) // self.bs) - len(hit)
            table = self.tables[req.request_id] = self.blocks.take(hit, n)
            req.context_current_position = L + E
            self.scheduler.update_state_after_alloc(req, list(table))
            self.matched[req.request_id] = (L, E, is_async)
            req.state = PARKED if is_async else LlmRequestState.CONTEXT_INIT
            parked |= is_async
            self.active.append(req)
        return parked

    def _forward(self, context: list[LlmRequest], generation: list[LlmRequest]) -> None:
        for layer in range(self.layout.num_layers):
            for rank, w in enumerate(self.workers):
                api.set_rank(rank)
                w.wait_for_layer_load(layer, None)
            for rank, w in enumerate(self.workers):
                api.set_rank(rank)
                w.save_kv_layer(layer, None)
        for r in context:  # from the position the request has now (a connector may have moved it back)
            start = r.context_current_position
            self.kv.write(self.tables[r.request_id], r.get_tokens(0), range(start, start + min(r.context_remaining_length, r.context_chunk_size)))
        for r in generation:
            n = len(r.get_tokens(0))
            self.kv.write(self.tables[r.request_id], r.get_tokens(0), range(n - 1, n))

    def _update(self, context: list[LlmRequest], generation: list[LlmRequest]) -> None:
        finished = []
        for r in context:
            r.context_current_position += min(r.context_remaining_length, r.context_chunk_size)
            if r.context_remaining_length == 0:
                self.bad_kv[r.request_id] = self.kv.mismatches(self.tables[r.request_id], r.get_tokens(0), r.prompt_len)
                self.blocks.publish(self.tables[r.request_id], r.get_tokens(0), r.prompt_len)
                r.state = LlmRequestState.GENERATION_IN_PROGRESS
                r.add_new_token(next_token(r.get_tokens(0)), 0)
                if len(r.get_tokens(0)) - r.py_orig_prompt_len >= r.max_new_tokens:
                    finished.append(r)
        for r in generation:
            r.add_new_token(next_token(r.get_tokens(0)), 0)
            if len(r.get_tokens(0)) - r.py_orig_prompt_len >= r.max_new_tokens:
                finished.append(r)
        for r in finished:
            r.state = LlmRequestState.GENERATION_COMPLETE
            if self.scheduler.request_finished(r, list(self.tables[r.request_id])):
                self.new_async.saving[r.request_id] = r
                r.state = SAVING
            else:
                self._terminate(r)

    def _terminate(self, r: LlmRequest, reuse: bool = True) -> None:
        tokens = r.get_tokens(0)
        self.blocks.release(self.tables.pop(r.request_id), tokens, len(tokens) - 1, reuse=reuse and r.request_id not in self.cancelled)
        self.output.reset_request(r.request_id)
        self.active.remove(r)
        r.state = LlmRequestState.GENERATION_COMPLETE
        self.done[r.request_id] = r

    def _get_finished(self) -> None:
        started_loading, finished_gen = list(self.new_async.loading), list(self.new_async.saving)
        for rank, w in enumerate(self.workers):
            pend, local = self.pending[rank], self.local_done[rank]
            pend.saving.update(self.new_async.saving)
            pend.loading.update(self.new_async.loading)
            api.set_rank(rank)
            saved, loaded = w.get_finished(finished_gen, started_loading)
            for rid in saved:
                if rid not in pend.saving:
                    raise KeyError(f"rank {rank} returned request {rid} as saved before it was passed in")
                local.saving[rid] = pend.saving.pop(rid)
            for rid in loaded:
                if rid not in pend.loading:
                    raise KeyError(f"rank {rank} returned request {rid} as loaded before it was passed in")
                local.loading[rid] = pend.loading.pop(rid)
        api.set_rank(0)
        self.new_async = _Async()
        all_saved = set.intersection(*(set(d.saving) for d in self.local_done))
        all_loaded = set.intersection(*(set(d.loading) for d in self.local_done))
        for rid in all_loaded:
            req = self.local_done[0].loading[rid]
            for d in self.local_done:
                del d.loading[rid]
            if rid in self.dropped_when_loaded:
                self.dropped_when_loaded.discard(rid)
                self._terminate(req, reuse=False)
            elif req.state is PARKED:  # not cancelled meanwhile
                req.state = LlmRequestState.CONTEXT_INIT
        for rid in all_saved:
            req = self.local_done[0].saving[rid]
            for d in self.local_done:
                del d.saving[rid]
            self._terminate(req)

    def close(self) -> None:
        for part in (self.scheduler, *self.workers):
            shutdown = getattr(part, "shutdown", None)
            if shutdown is not None:
                shutdown()
        self.kv.close()
