"""The connector's scheduler side (rank 0): turns TensorRT-LLM's own request semantics into slot
updates, at most one Step per engine step (docs/trtllm.md walks through it).

    get_num_new_matched_tokens(request, L)   L is TensorRT-LLM's own prefix hit; asks the daemon
                                             for E beyond it (a short deadline: a miss when slow)
    update_state_after_alloc(request, ids)   commits L, E (what the cache manager took) and the
                                             block table; an async load is announced in the next
                                             Step (the request is absent from the scheduler output
                                             until it has loaded)
    build_connector_meta(output)             new requests as new with L and E apart (so blocks the
                                             engine had are never stored again), cached requests
                                             as cached, token and block deltas only; the engine's
                                             key for the workers
    request_finished(request, ids)           True while the daemon may still read or write its blocks

The engine's key is minted here (kvdepot.connector.instance). Every block a request is given
beyond its own prefix hit is checked against the requests tracked here: TensorRT-LLM frees a
cancelled request's blocks without asking (_claim).
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from kvdepot.client import DepotClient
from kvdepot.common import Every
from kvdepot.connector.config import ConnectorConfig
from kvdepot.connector.worker import STARTUP_WAIT_S, close_at_exit, connect, disconnect, load_jobs, send_step, wait_mapped
from kvdepot.messages import StepBatch, StepResult, cached_update_needed
from kvdepot.connector.instance import Instance, mint
from kvdepot.trtllm.common import STYLE, TrtllmMeta

log = logging.getLogger("kvdepot.trtllm")


@dataclass
class ReqState:
    request: Any  # TensorRT-LLM's LlmRequest
    L: int = 0  # the engine's own prefix hit at the last admission
    E: int = 0  # tokens loaded from the daemon at the last admission
    is_async: bool = False
    tokens: list[int] = field(default_factory=list)  # what the engine reported (prompt, then deltas)
    table: list[int] = field(default_factory=list)
    announced: bool = False  # the daemon got this admission's new update
    restart: bool = False  # admitted again (TensorRT-LLM replays a request whose allocation died)
    epoch: int = -1  # the client's registration epoch when the daemon learned of it
    sent_tokens: int = 0
    sent_blocks: int = 0
    sent_end: int = 0  # computed + scheduled of the last update sent (the daemon's terms)
    stores: dict[int, int] = field(default_factory=dict)  # store op id -> deadline (unix ms): may still read its blocks
    loads: dict[int, int] = field(default_factory=dict)  # load op id -> deadline (unix ms): may still write its blocks
    short: int = 0  # loaded tokens the engine computes again (it honoured less than offered, mid-block)
    lost: bool = False  # no more updates (a Step carrying one went unanswered, or blocks without pages)
    unknown: bool = False  # a Step carrying its update went unanswered: what the daemon planned is unknown


class SchedulerSide:
    def __init__(self, cfg: ConnectorConfig, model: str, instance: Instance, block_size: int, enabled: bool = True) -> None:
        self.cfg = cfg
        self.off = not enabled  # the engine is outside what kvdepot serves, or the daemon refused it
        self.model = model
        self.instance = instance
        self.key = mint("trtllm", model)  # this instance's own: its workers learn it from us alone
        self.bs = block_size
        self.client: DepotClient | None = None
        self.reqs: dict[str, ReqState] = {}
        self.guess: dict[str, tuple[int, int, bool, list[int]]] = {}  # rid -> (L, E, async, tokens) answered, not yet allocated
        self.async_starts: list[str] = []
        self.to_finish: list[str] = []
        self.to_preempt: list[str] = []
        self.to_forget: list[str] = []
        self.admissions: collections.deque[tuple[str, int, int, int]] = collections.deque(maxlen=1024)  # (rid, L, E, C) sent
        self.block_owner: dict[int, str] = {}  # engine block -> the request it was last given to
        self.prefix: dict[str, int] = {}  # request -> its own prefix hit L, from asking until its allocation
        self.reused: dict[str, list[int]] = {}  # freed without request_finished -> its ops still running
        self._vanish_log = Every(60.0)
        self._waiting_since = time.monotonic()
        instance.scheduler = self
        instance.set_key(self.key)
        close_at_exit(self)

    def ready(self) -> bool:
        """Connected: the daemon is asked only once rank 0's worker has shared the pool's layout."""
        if self.client is not None or self.off:
            return self.client is not None
        layout = self.instance.layout
        if layout is None:
            if time.monotonic() - self._waiting_since > 60:
                log.warning("kvdepot: rank 0's worker has not registered the KV pool yet; the connector stays idle")
                self._waiting_since = time.monotonic()
            return False
        self.client = connect(self.cfg, layout, self.model, self.key, self.cfg.engine_name, STYLE, engine_copies=self.instance.engine_copies)
        self.off = self.client is None  # refused: connect() said why
        return not self.off

    @staticmethod
    def _usable(request: Any) -> bool:
        """Tokens alone do not name multimodal or embedding-fed KV: such requests stay with the
        engine. get_num_new_matched_tokens gets the C++ binding's LlmRequest, which has no py_*
        attributes: these are the binding's (None where unset), the Python subclass's too."""
        for attr in ("multimodal_hashes", "multimodal_positions", "prompt_embedding_table", "py_multimodal_data"):
            if getattr(request, attr, None) is not None:
                return False
        return True

    @staticmethod
    def _names(request: Any) -> tuple[str, str]:
        """The salt (the newest releases pass cache_salt, a string; one binding has cache_salt_id,
        an integer) and the LoRA adapter, folded into the block hashes."""
        salt = getattr(request, "cache_salt", None) or ""
        if not salt and (salt_id := getattr(request, "cache_salt_id", None)) is not None:
            salt = f"trtllm-salt-id-{salt_id}"
        lora = getattr(request, "lora_task_id", None)
        return str(salt), "" if lora is None else f"trtllm-lora-{lora}"

    # -- TensorRT-LLM's scheduler calls -------------------------------------------------------------
    def matched(self, request: Any, L: int) -> tuple[int, bool]:
        rid = str(request.request_id)
        self.prefix[rid] = L
        st = self.reqs.get(rid)
        if st is not None and st.announced and st.epoch >= 0:
            st.restart = True  # asked again: its allocation died and it runs again from the start
        if not self.ready() or not self._usable(request):
            self.guess.pop(rid, None)
            return 0, False  # the daemon never hears of it: nothing is loaded or stored for it
        assert self.client is not None
        tokens = request.get_tokens(0)
        offerable = (len(tokens) - 1) // self.bs * self.bs - L  # never past the last prompt token
        E = 0
        # Else the engine has all it can use itself (no round trip), or the request gets no updates.
        if offerable > 0 and not L % self.bs and not (st is not None and st.lost):
            salt, lora = self._names(request)
            res = self.client.lookup(rid, tokens, device_matched_tokens=L, cache_salt=salt, lora_name=lora, timeout_s=self.cfg.lookup_timeout_ms / 1000)
            E = min(res.matched_tokens, offerable)
        is_async = bool(E) and self.cfg.load_async
        self.guess[rid] = (L, E, is_async, tokens)
        return E, is_async

    def allocated(self, request: Any, block_ids: list[int]) -> None:
        rid = str(request.request_id)
        self._claim(rid, block_ids[self.prefix.pop(rid, 0) // self.bs :])  # whether the daemon hears of it or not
        guess = self.guess.pop(rid, None)
        if guess is None or self.client is None:
            return
        L, E, is_async, tokens = guess
        # KVCacheManagerV2 may take fewer tokens than offered (it allocates a chunk at a time) and
        # computes the rest: the request's position says what it took (L + taken; TensorRT-LLM's
        # own py_num_connector_matched_tokens stays 0 on the object the older cache manager passes
        # here, whose C++ side took it all). The last block it takes in part is loaded whole (the
        # engine counts those positions as loaded) and then recomputed.
        pos = getattr(request, "context_current_position", L + E)
        short = 0
        if isinstance(pos, int) and L <= pos < L + E:
            taken = pos - L
            short = -taken % self.bs  # loaded positions the engine computes again
            E = taken + short
        st = self.reqs.get(rid)
        if st is None:
            st = self.reqs[rid] = ReqState(request)
        elif st.restart:
            self.to_preempt.append(rid)  # the daemon lets go of the old blocks before the new row
        st.request = request  # the engine's object of this admission (rewind moves its position)
        st.L, st.E, st.is_async, st.table, st.announced = L, E, is_async, list(block_ids), False
        st.short = short
        st.tokens = tokens
        self._check_table(st)
        st.sent_blocks = st.sent_end = 0
        if is_async:
            self.async_starts.append(rid)

    def build(self, so: Any, meta: TrtllmMeta) -> None:
        if self.client is None:
            return
        meta.engine_key = self.key
        epoch = self.client.epoch
        if self.to_preempt:
            self._preempt(meta)
        meta.preempted_ops.update(self.reused)  # the forward must not write blocks their ops still copy
        self.reused = {}
        batch = StepBatch()
        batch.finished, self.to_finish = self.to_finish, []
        loads: list[ReqState] = []
        starts, self.async_starts = self.async_starts, []
        for rid in starts:  # absent from the output until loaded: announced now, while it loads
            st = self.reqs.get(rid)
            if st is not None:
                self._new(batch, st, st.L + st.E, 0)
                loads.append(st)
        for rd in so.new_requests:
            st = self.reqs.get(str(rd.request_id))
            if st is None:
                continue
            st.tokens, st.table = list(rd.new_tokens), list(rd.new_block_ids)
            self._check_table(st)
            if st.announced and st.is_async and st.epoch == epoch:  # emitted after its async load: it continues
                self._cached(batch, st, rd.computed_position, rd.num_scheduled_tokens, force=True)
                continue
            self._new(batch, st, rd.computed_position, rd.num_scheduled_tokens)
            if st.E and not st.is_async and st.announced:
                loads.append(st)
        for rd in so.cached_requests:
            if rd.new_block_ids:
                self._claim(str(rd.request_id), rd.new_block_ids)
            st = self.reqs.get(str(rd.request_id))
            if st is None:
                continue
            st.tokens += rd.new_tokens
            st.table += rd.new_block_ids
            if rd.new_block_ids:
                self._check_table(st)
            if st.epoch == epoch and st.announced:
                self._cached(batch, st, rd.computed_position, rd.num_scheduled_tokens)
        batch, result, meta.step = send_step(self.client, batch, self.reqs)
        self._take_result(batch, result, loads, meta)

    @staticmethod
    def _check_table(st: ReqState) -> None:
        """A block without a page (-1, BAD_PAGE_INDEX: a sliding window has passed it) holds no KV
        to load or store: such a request stays with the engine alone."""
        if not st.lost and st.table and min(st.table) < 0:
            log.info("kvdepot: request %s has blocks without a page (sliding window): not offloaded", st.request.request_id)
            st.lost = True

    def _preempt(self, meta: TrtllmMeta) -> None:
        """Re-admitted requests: the daemon ends what it planned on their old blocks, and every
        worker waits for those ops before this step's forward may write blocks again."""
        assert self.client is not None
        batch = StepBatch()
        rids, self.to_preempt = self.to_preempt, []
        now = time.time() * 1000
        for rid in rids:
            st = self.reqs.get(rid)
            if st is None:
                continue
            if st.epoch == self.client.epoch:
                batch.preempted.append(rid)
            # Its loads all settled before it computed (or was returned loaded); its stores may still
            # read the old blocks, which TensorRT-LLM has freed.
            if live := [op for op, deadline in st.stores.items() if deadline + 1000 > now]:
                meta.preempted_ops[rid] = live
            st.restart, st.stores, st.loads = False, {}, {}
        if len(batch.preempted):
            self.client.step(batch)

    def _new(self, batch: StepBatch, st: ReqState, C: int, S: int) -> None:
        assert self.client is not None
        if st.epoch != self.client.epoch:
            if st.epoch >= 0 and st.E:
                # The daemon restarted while this request may have been loading: what reached its
                # blocks is unknown, so nothing computed over them may be stored.
                st.lost = True
            st.epoch, st.sent_tokens = self.client.epoch, 0
        if st.lost:
            return
        # The daemon's terms: a synchronous load's tokens are computed (TensorRT-LLM leaves them out),
        # and the tokens of its last block the engine computes again are not computed twice.
        sync_load = C == st.L and st.E
        if sync_load and st.short:
            S = max(0, S - st.short)
        end = (st.L + st.E if sync_load else C) + S
        # A new update carries the whole sequence the daemon holds, and what this step computes.
        upto = min(len(st.tokens), max(end, st.L + st.E, st.sent_tokens))
        salt, lora = self._names(st.request)
        L = min(st.L, C)
        batch.new(str(st.request.request_id), st.tokens[:upto], st.table, computed=C, scheduled=S, device_matched=L, loaded=st.E, cache_salt=salt, lora_name=lora)
        st.sent_tokens, st.sent_blocks, st.sent_end, st.announced = upto, len(st.table), end, True
        self.admissions.append((str(st.request.request_id), L, st.E, C))
        log.debug("kvdepot: request %s admitted: L=%d E=%d computed=%d scheduled=%d", st.request.request_id, L, st.E, C, S)

    def _cached(self, batch: StepBatch, st: ReqState, C: int, S: int, force: bool = False) -> None:
        end = C + S
        if st.lost or not (force or cached_update_needed(self.bs, len(st.table), st.sent_blocks, C, S, st.sent_end)):
            return
        upto = min(len(st.tokens), end)
        batch.cached(str(st.request.request_id), st.tokens[st.sent_tokens : upto], st.table[st.sent_blocks :], computed=C, scheduled=S)
        st.sent_tokens, st.sent_blocks, st.sent_end = max(st.sent_tokens, upto), len(st.table), end

    def _take_result(self, batch: StepBatch, result: StepResult, loads: list[ReqState], meta: TrtllmMeta) -> None:
        if result.degraded and len(batch):
            for rid in batch.request_ids:  # applied or not, unknown: no more updates (see kvdepot.vllm)
                if (st := self.reqs.get(rid)) is not None:
                    st.lost = st.unknown = True
                    meta.held[rid] = True  # the workers wait for the daemon's release of it, not for ops
        meta.forget, self.to_forget = self.to_forget, []
        for op in result.ops:
            if (st := self.reqs.get(op.request_id)) is not None:
                (st.stores if op.kind == "store" else st.loads)[op.op_id] = op.deadline_ms
            meta.ops.setdefault(op.request_id, []).append((op.op_id, op.deadline_ms))
        meta.loads += load_jobs(result.ops, [(str(st.request.request_id), st.table[st.L // self.bs : (st.L + st.E) // self.bs], st.is_async) for st in loads])

    def rewind(self, request_id: str, failed_blocks: list[int], world_size: int) -> bool:
        """Blocks of a load that did not arrive intact: with one rank, the request's
        context_current_position goes back to the first of them, so TensorRT-LLM computes them
        instead (its connector API has no other way to say a load failed; called from the worker
        before the request's forward). With more ranks each holds its own copy of the request and
        only rank 0's is here: nothing can be rewound. True when rewound."""
        st = self.reqs.get(request_id)
        if st is None or not failed_blocks:
            return False
        at = min((st.table.index(b) for b in failed_blocks if b in st.table), default=-1) * self.bs
        if world_size != 1 or at < 0:
            log.error(
                "kvdepot: request %s: %d promised blocks did not load intact and TensorRT-LLM with %d ranks cannot be told to "
                "compute them: this request's KV from token %d on is wrong (the daemon stores nothing computed over it)",
                request_id, len(failed_blocks), world_size, at,
            )
            return False
        request = st.request
        if request.context_current_position > at:
            log.warning("kvdepot: request %s: %d blocks did not load; TensorRT-LLM computes from token %d instead", request_id, len(failed_blocks), at)
            request.context_current_position = at
        return True

    def _claim(self, rid: str, fresh: list[int]) -> None:
        """Blocks newly given to `rid` (not its own prefix hit, which it may share with a live request).
        One that another tracked request holds means TensorRT-LLM freed that one without asking
        request_finished, as it does a cancelled request: its ops may still read or write the block."""
        for b in fresh:
            other = self.block_owner.get(b)
            if other is not None and other != rid:
                self._vanished(other, rid)
            self.block_owner[b] = rid

    def _vanished(self, rid: str, to: str = "") -> None:
        """`rid` is gone without request_finished (cancelled): the daemon hears it finished, and the
        workers let its live ops end before the next forward writes the blocks it had."""
        st = self.reqs.pop(rid, None)
        self.guess.pop(rid, None)
        if st is None:
            return
        for b in st.table:
            if self.block_owner.get(b) == rid:
                del self.block_owner[b]
        if self.client is None or st.epoch != self.client.epoch:
            return
        self.to_finish.append(rid)
        now = time.time() * 1000
        if live := [op for op, deadline in (*st.stores.items(), *st.loads.items()) if deadline + 1000 > now]:
            self.reused[rid] = live
        if self._vanish_log.due(rid):
            log.info("kvdepot: request %s was freed without request_finished (cancelled?)%s: %d of its ops end before the next forward",
                     rid, f"; its blocks went to request {to}" if to else "", len(live))

    def finished(self, request: Any, cache_block_ids: list[int] | None = None) -> bool:
        """Whether TensorRT-LLM must keep the request's blocks until the workers report it saved: an
        op of it may still read or write them: a store, or a load (a request that finished while
        its load ran; TensorRT-LLM frees the blocks on False, and the load would write into
        whatever request gets them next). Called with no blocks (they were freed already: a
        cancel under the overlap scheduler), the request is handled as one freed unasked (_claim). Every worker heard of every op of the request in the metadata, and
        of each one's end on its stream: it returns the request once they ended, in this very step
        if they have (no further step is needed; an idle engine builds none). The daemon hears of
        the finish in the next Step and stops its loads then. A request whose Step went unanswered
        waits for the daemon's release instead."""
        rid = str(request.request_id)
        if cache_block_ids is not None and not cache_block_ids and rid in self.reqs:
            self._vanished(rid)  # asked after its blocks were freed (a cancel under the overlap scheduler): too late to keep them
            return False
        self.guess.pop(rid, None)
        st = self.reqs.pop(rid, None)
        if st is not None:
            for b in st.table:
                if self.block_owner.get(b) == rid:
                    del self.block_owner[b]
        if st is None or self.client is None or st.epoch != self.client.epoch:
            return False
        self.to_finish.append(rid)
        now = time.time() * 1000
        if st.unknown or any(deadline + 1000 > now for deadline in (*st.stores.values(), *st.loads.values())):
            return True
        self.to_forget.append(rid)
        return False

    def wait_mapped(self) -> None:
        if self.ready() and self.client is not None:
            wait_mapped(self.client, STARTUP_WAIT_S, log)

    def close(self) -> None:
        disconnect(self.client)
        self.client = None
