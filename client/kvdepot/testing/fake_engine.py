"""FakeEngine: a paged KV cache and a scheduler double that drives a DepotClient as a vLLM-style
engine does, for tests and benchmarks of kvdepot without a real engine.

What it models (reference/engines.md A1):
    * a pool of `num_blocks` KV blocks with reference counts and its own prefix cache (hash -> block,
      LRU reuse of free cached blocks; the hit is block-aligned and at most n-1 tokens);
    * admission: local prefix hit L, then client.lookup(L) -> E, blocks for the hit, the load targets
      and the first chunk; synchronous loads (it waits for the load ops before its "forward");
    * chunked prefill (`max_batched_tokens` per step), decode of one token per step;
    * preemption of the newest running request when blocks run out (it is resumed later with a
      fresh lookup), finish and abort, delay-free (blocks held until the daemon releases them);
    * failed loads are recomputed (vLLM's recompute policy): the request rewinds to the first
      failed block.
Each step sends exactly one StepBatch and reports forward-done on rank 0's stream (and every other
rank when `world_size` > 1).
"""

from __future__ import annotations

import collections
import itertools
import time
from dataclasses import dataclass, field

from kvdepot.client import DepotClient, WorkerLink
from kvdepot.handoff import handoff_path
from kvdepot.hashing import block_hashes, salt_hash, tokens_to_bytes
from kvdepot.layout import KvLayout
from kvdepot.messages import OpCompleted, RequestReleased, StepBatch, StepResult, cached_update_needed
from kvdepot.testing.kv import FakeKv

DETACHED_GRACE_S = 0.5  # a worker stream down this long while a load is awaited: the daemon is gone (as the vLLM connector)


@dataclass
class FakeRequest:
    rid: str
    prompt: list[int]
    max_new_tokens: int
    cache_salt: str = ""
    tokens: list[int] = field(default_factory=list)
    table: list[int] = field(default_factory=list)
    computed: int = 0
    L: int = 0
    E: int = 0
    sent_tokens: int = 0  # tokens already sent to the daemon
    sent_blocks: int = 0
    sent_end: int = 0  # computed + scheduled of the last update sent
    is_new: bool = True  # next update is a new one (first schedule or resume)
    epoch: int = 0  # client registration epoch when the daemon learned of it
    lost: bool = False  # a step with its update went unanswered: the daemon's record is unknown
    preemptions: int = 0
    output: list[int] = field(default_factory=list)
    kv_mismatches: list[int] = field(default_factory=list)  # positions whose KV was wrong at finish

    @property
    def n(self) -> int:
        return len(self.tokens)


@dataclass
class EngineStats:
    computed_tokens: int = 0  # tokens the "forward" computed
    kv_mismatched_tokens: int = 0  # positions whose KV was wrong when a request finished (must stay 0)
    local_hit_tokens: int = 0
    loaded_tokens: int = 0
    failed_load_blocks: int = 0
    preemptions: int = 0
    degraded_steps: int = 0


class FakeEngine:
    def __init__(
        self,
        client: DepotClient,
        *,
        num_blocks: int = 256,
        block_size: int = 16,
        max_batched_tokens: int = 512,
        world_size: int = 1,
        use_depot: bool = True,
        load_timeout_s: float = 5.0,
        layout: KvLayout | None = None,
        sparse: bool = True,
        release_timeout_s: float = 35.0,
        check_kv: bool = True,
    ) -> None:
        """`layout` with a kind other than "none" gives the engine real KV tensors (FakeKv) that its
        forward writes and the daemon reads and fills through registered shared memory: memfds
        handed over when the client reaches the daemon at unix:PATH, /dev/shm files otherwise."""
        self.client = client
        self.bs = block_size
        self.num_blocks = num_blocks
        self.max_batched = max_batched_tokens
        self.use_depot = use_depot
        self.load_timeout_s = load_timeout_s
        self.sparse = sparse  # send cached updates only when they matter (cached_update_needed)
        self.release_timeout_s = release_timeout_s  # longer than the daemon's op deadline
        self.check_kv = check_kv  # check every position's KV when a request finishes (benchmarks may turn it off)
        self.held_until: dict[str, tuple[float, int]] = {}  # delay-freed request -> (give up at, epoch)
        self._had_ops: set[str] = set()  # requests the daemon planned ops for (its answers said so)
        self.kv: FakeKv | None = None
        if layout is not None and layout.kind != "none":
            assert layout.block_size == block_size and layout.world_size == world_size
            self.kv = FakeKv(layout, num_blocks)
        self.workers: list[WorkerLink] = [client.worker(r) for r in range(world_size)] if use_depot else []
        if self.kv is not None:
            memfd = handoff_path(client.address) is not None  # as the vLLM connector does
            for rank, (w, req) in enumerate(zip(self.workers, self.kv.share(memfd))):
                w.register_kv_caches(req, self.kv.fds[rank] if memfd else ())
        self.refs = [0] * num_blocks
        self.block_hash: dict[int, int] = {}  # block -> hash of the full block it holds (cached)
        self.cache: dict[int, int] = {}  # hash -> block (own prefix cache)
        self.free: collections.OrderedDict[int, None] = collections.OrderedDict((b, None) for b in range(num_blocks))
        self.waiting: collections.deque[FakeRequest] = collections.deque()
        self.running: list[FakeRequest] = []
        self.finished_ids: list[str] = []  # to report in the next step
        self.held: dict[str, list[int]] = {}  # delay-free: blocks kept until the daemon releases them
        self.done: dict[str, FakeRequest] = {}
        self.stats = EngineStats()
        self.steps = 0
        self._seq = itertools.count()

    # -- public -------------------------------------------------------------------------------------
    def add_request(self, prompt: list[int], max_new_tokens: int = 1, rid: str | None = None, cache_salt: str = "") -> str:
        rid = rid or f"req-{next(self._seq)}"
        self.waiting.append(FakeRequest(rid, list(prompt), max_new_tokens, cache_salt, tokens=list(prompt)))
        return rid

    def abort(self, rid: str) -> None:
        for q in (self.running, self.waiting):
            for r in list(q):
                if r.rid == rid:
                    q.remove(r)
                    self._finish(r, aborted=True)

    def run_until_done(self, max_steps: int = 10_000) -> None:
        """Steps until every request finished (and the daemon released what it held); at most
        `max_steps` steps of this call."""
        last = self.steps + max_steps
        while (self.waiting or self.running or self.held or self.finished_ids) and self.steps < last:
            self.step()
            if not (self.waiting or self.running or self.finished_ids):
                time.sleep(0.005)  # only releases are pending: idle steps, as an engine's would be
        if self.waiting or self.running:
            raise RuntimeError(f"requests still pending after {max_steps} steps")

    def generate(self, prompt: list[int], max_new_tokens: int = 1, **kw: str) -> FakeRequest:
        rid = self.add_request(prompt, max_new_tokens, **kw)
        self.run_until_done()
        return self.done[rid]

    def reset_prefix_cache(self) -> None:
        for h, b in list(self.cache.items()):
            if self.refs[b] == 0:
                del self.cache[h]
                del self.block_hash[b]

    # -- one engine step ------------------------------------------------------------------------------
    def step(self) -> StepResult | None:
        self.steps += 1
        batch = StepBatch()
        batch.finished, self.finished_ids = self.finished_ids, []
        budget = self.max_batched
        scheduled: list[tuple[FakeRequest, int]] = []
        for r in list(self.running):  # running first (decode and prefill chunks), as vLLM does
            if r not in self.running:  # preempted to make room for an earlier one
                continue
            want = min(budget, r.n - r.computed)
            if want <= 0:
                continue
            if not self._grow(r, r.computed + want, batch):
                continue
            scheduled.append((r, want))
            budget -= want
        while self.waiting and budget > 0:
            r = self.waiting[0]
            if r.rid in batch.preempted:
                break  # resumed in a later step, never in the one that preempts it
            got = self._admit(r, budget)
            if got is None:
                break
            self.waiting.popleft()
            self.running.append(r)
            scheduled.append((r, got))
            budget -= got
        for r, S in scheduled:
            self._add_update(batch, r, S)
        result = self._send(batch)
        if result is not None:
            self._run_loads(result, scheduled)
        self._forward(scheduled)
        for w in self.workers:
            w.forward_done(self.client.last_step)
        self._drain_events()
        return result

    # -- scheduling -----------------------------------------------------------------------------------
    def _admit(self, r: FakeRequest, budget: int) -> int | None:
        hashes = block_hashes(tokens_to_bytes(r.tokens), self.bs, salt_hash(r.cache_salt))
        hit: list[int] = []
        for h in hashes[: (r.n - 1) // self.bs]:
            b = self.cache.get(h)
            if b is None:
                break
            hit.append(b)
        L = len(hit) * self.bs
        E = 0
        if self.use_depot:
            E = self.client.lookup(r.rid, r.tokens, device_matched_tokens=L, cache_salt=r.cache_salt).matched_tokens
            E = min(E, (r.n - 1) // self.bs * self.bs - L)
        S = min(budget, r.n - L - E)
        need = -(-(L + E + S) // self.bs) - len(hit)
        for b in hit:
            self._ref(b)
        new = self._alloc(need)
        if new is None:
            for b in hit:
                self._unref(b)
            return None
        r.table = hit + new
        r.L, r.E, r.computed = L, E, L + E
        r.is_new = True
        r.sent_blocks = 0
        self.stats.local_hit_tokens += L
        return S

    def _grow(self, r: FakeRequest, end: int, batch: StepBatch) -> bool:
        need = -(-end // self.bs) - len(r.table)
        while need > 0:
            new = self._alloc(need)
            if new is not None:
                r.table += new
                return True
            victim = self.running[-1]
            self._preempt(victim, batch)
            if victim is r:
                return False
        return True

    def _preempt(self, r: FakeRequest, batch: StepBatch) -> None:
        self.running.remove(r)
        for b in r.table:
            self._unref(b)
        r.table, r.computed, r.sent_blocks = [], 0, 0
        r.preemptions += 1
        self.stats.preemptions += 1
        if not r.is_new:
            batch.preempted.append(r.rid)
        r.is_new = True
        self.waiting.appendleft(r)

    def _add_update(self, batch: StepBatch, r: FakeRequest, S: int) -> None:
        if r.lost and r.epoch == self.client.epoch:
            r.is_new = False
            return
        if r.is_new:
            if r.epoch != self.client.epoch:  # first contact, or the daemon restarted: send everything
                r.epoch, r.sent_tokens, r.lost = self.client.epoch, 0, False
            toks = r.tokens  # a new update carries the whole sequence, resumed or not
            batch.new(r.rid, toks, r.table, computed=r.computed, scheduled=S, device_matched=r.L, loaded=r.E, cache_salt=r.cache_salt)
        elif r.epoch != self.client.epoch:
            return  # the daemon forgot it (restart): it simply gets no more stores
        elif self.sparse and not cached_update_needed(self.bs, len(r.table), r.sent_blocks, r.computed, S, r.sent_end):
            return  # nothing for the daemon to decide: the tokens ride along with the next update
        else:
            batch.cached(r.rid, r.tokens[r.sent_tokens :], r.table[r.sent_blocks :], computed=r.computed, scheduled=S)
        r.sent_tokens, r.sent_blocks, r.is_new, r.sent_end = r.n, len(r.table), False, r.computed + S

    def _send(self, batch: StepBatch) -> StepResult | None:
        if not self.use_depot:
            for rid in batch.finished:
                for b in self.held.pop(rid, []):
                    self._unref(b)
            return None
        result = self.client.step(batch)
        self._had_ops.update(op.request_id for op in result.ops)
        if result.degraded:
            # The daemon may or may not have applied these updates: its record of them is unknown,
            # so they get no more updates (resending tokens could double them there). They are
            # still reported preempted and finished, so the daemon lets go of them.
            self.stats.degraded_steps += 1
            for r in self.running:
                if r.rid in batch.request_ids:
                    r.lost = True
        for rid in batch.finished:
            blocks = self.held.pop(rid, [])
            # Keep until RequestReleased. Where the daemon did not answer it may be frozen with ops
            # on these blocks still before their deadline: keep them the release timeout too.
            had_ops = rid in self._had_ops
            self._had_ops.discard(rid)
            if rid in result.delay_free or (result.degraded and had_ops and blocks):
                self.held[rid] = blocks
                self.held_until[rid] = (time.monotonic() + self.release_timeout_s, self.client.epoch)
            else:
                for b in blocks:
                    self._unref(b)
        return result

    def _run_loads(self, result: StepResult, scheduled: list[tuple[FakeRequest, int]]) -> None:
        """Synchronous loads: wait for this step's load ops before the forward; failed blocks rewind."""
        by_rid = {r.rid: r for r, _ in scheduled}
        if result.degraded:  # the daemon did not answer: nothing will be loaded, recompute
            for r, _ in scheduled:
                if r.E:
                    r.computed, r.E = r.L, 0
            return
        loads = {op.op_id: op for op in result.ops if op.kind == "load"}
        if not loads or not self.workers:
            return
        done = self.workers[0].wait(
            lambda evs: {e.op_id for e in evs if isinstance(e, OpCompleted)} >= loads.keys(), self.load_timeout_s, detached_grace_s=DETACHED_GRACE_S
        )
        self._handle_events(done)
        completed = {e.op_id: e for e in done if isinstance(e, OpCompleted)}
        for op_id, op in loads.items():
            req = by_rid.get(op.request_id)
            if req is None:
                continue
            r = req
            ev = completed.get(op_id)
            failed = set(ev.failed_block_ids) if ev is not None else set(op.block_ids)
            if failed:
                first = min(i for i, b in zip(op.block_indices, op.block_ids) if b in failed)
                self.stats.failed_load_blocks += len(failed)
                r.computed = min(r.computed, first * self.bs)
            self.stats.loaded_tokens += (len(op.block_ids) - len(failed)) * self.bs

    def _forward(self, scheduled: list[tuple[FakeRequest, int]]) -> None:
        for r, S in scheduled:
            end = min(r.n, r.computed + S)
            self.stats.computed_tokens += end - r.computed
            if self.kv is not None:
                self.kv.write(r.table, r.tokens, range(r.computed, end))
            r.computed = end
            hashes = block_hashes(tokens_to_bytes(r.tokens[: end - end % self.bs]), self.bs, salt_hash(r.cache_salt))
            for i, h in enumerate(hashes):
                b = r.table[i]
                if h not in self.cache and b not in self.block_hash:
                    self.cache[h] = b
                    self.block_hash[b] = h
            if r.computed == r.n:  # prefill done or decode step: sample the next token
                if len(r.output) >= r.max_new_tokens:
                    continue
                tok = (r.tokens[-1] * 1103515245 + 12345 + r.n) % 50_000
                r.output.append(tok)
                if len(r.output) >= r.max_new_tokens:
                    self.running.remove(r)
                    self._finish(r)
                else:
                    r.tokens.append(tok)

    def _finish(self, r: FakeRequest, aborted: bool = False) -> None:
        if self.kv is not None and r.table and self.check_kv:
            bad = self.kv.mismatches(r.table, r.tokens, r.computed)
            r.kv_mismatches = bad
            self.stats.kv_mismatched_tokens += len(bad)
        self.done[r.rid] = r
        self.finished_ids.append(r.rid)
        self.held[r.rid] = r.table  # freed once the next step's answer says whether to wait
        r.table = []

    def _drain_events(self) -> None:
        for w in self.workers:
            self._handle_events(w.poll())

    def _handle_events(self, events: list) -> None:  # list[WorkerEvent]
        for e in events:
            if isinstance(e, RequestReleased) and e.request_id in self.held and e.request_id not in self.finished_ids:
                self._release(e.request_id)
        # A release that cannot come any more (the daemon restarted, or died and every op deadline
        # passed) must not strand the blocks: the daemon stopped touching them by then.
        now = time.monotonic()
        for rid, (deadline, epoch) in list(self.held_until.items()):
            if rid in self.held and (now > deadline or epoch != self.client.epoch):
                self._release(rid)

    def _release(self, rid: str) -> None:
        self.held_until.pop(rid, None)
        for b in self.held.pop(rid):
            self._unref(b)

    # -- block pool ---------------------------------------------------------------------------------
    def _alloc(self, n: int) -> list[int] | None:
        if n <= 0:
            return []
        if len(self.free) < n:
            return None
        out = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)  # LRU free block; drop its cached content
            h = self.block_hash.pop(b, None)
            if h is not None:
                del self.cache[h]
            self.refs[b] = 1
            out.append(b)
        if self.kv is not None:
            self.kv.poison(out)  # fresh blocks hold garbage: a load that did not happen shows up
        return out

    def _ref(self, b: int) -> None:
        if self.refs[b] == 0:
            del self.free[b]
        self.refs[b] += 1

    def _unref(self, b: int) -> None:
        self.refs[b] -= 1
        assert self.refs[b] >= 0, f"block {b} freed twice"
        if self.refs[b] == 0:
            self.free[b] = None

    def check(self) -> None:
        """No block leaked: every block is free or referenced by a running/held request."""
        used = collections.Counter(b for r in self.running for b in r.table)
        used.update(b for bl in self.held.values() for b in bl)
        for b in range(self.num_blocks):
            assert self.refs[b] == used.get(b, 0), f"block {b}: refs {self.refs[b]} != users {used.get(b, 0)}"
