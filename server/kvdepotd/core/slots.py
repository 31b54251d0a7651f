"""Slots: the daemon's record of one request of one engine, and the rules that turn slot updates
into plans (docs/design.md "Slot semantics"; each rule is a test in tests/unit/test_scenarios.py).

Primitives:
    SlotUpdate                     one engine-neutral update (L, E, computed, scheduled, tokens, blocks)
    normalize(update, style, slot) the update in vLLM terms (TensorRT-LLM's computed_position differs)
    check_update(update, slot, block_size)   raises InvalidRequest/FailedPrecondition; changes nothing
    Slot.start_device_state(...)   (re)starts the request on the engine: L, E, block table  (rule 1, 2, 7)
    Slot.append(update)            tokens and block ids since the last update (rule 6)
    Slot.store_candidates(end)     block indices that are full, computed and undecided  (rule 4)

Per-block states make the bookkeeping explicit: a block is decided exactly once per device
residency, so no positional counter can drift (Dynamo's current_position / evaluated_blocks).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvdepot.hashing import BlockHash, block_hashes
from kvdepotd.core.errors import FailedPrecondition, InvalidRequest, NotFound
from kvdepotd.core.ops import OpId, RequestId


MAX_ID_LEN = 256  # request ids, engine names, models, namespaces
# How far computed + scheduled may run past the tokens a request carries: an engine schedules
# tokens it does not know yet (speculative drafts; asynchronous scheduling's next token), never
# more than this in one step. More is a mistake in the update, rejected.
MAX_SCHEDULED_AHEAD = 64


class UpdateStyle(enum.Enum):
    VLLM = "vllm"  # computed_tokens = num_computed_tokens (L+E on a new request)
    TRTLLM = "trtllm"  # computed_tokens = computed_position (excludes a sync load on a new request)


class BlockState(enum.Enum):
    PENDING = "PENDING"  # not yet full and computed, or not yet decided
    DEVICE_HIT = "DEVICE_HIT"  # the engine's own prefix cache: never loaded into, never stored (rule 1)
    LOADING = "LOADING"  # load target in flight from the daemon (rule 2)
    LOADED = "LOADED"
    LOAD_FAILED = "LOAD_FAILED"  # the engine recomputes it; it becomes PENDING again when rewound
    STORING = "STORING"
    STORED = "STORED"
    ALREADY_CACHED = "ALREADY_CACHED"  # resident or in flight when it became a candidate (rule 3)
    STORE_FAILED = "STORE_FAILED"
    NOT_STORED = "NOT_STORED"  # tier full of pinned/in-flight blocks when it became a candidate


class Phase(enum.Enum):
    ACTIVE = "ACTIVE"
    PREEMPTED = "PREEMPTED"
    FINISHING = "FINISHING"  # finished with ops in flight; released when the last one ends (rule 8)


@dataclass(frozen=True, slots=True)
class SlotUpdate:
    request_id: RequestId
    is_new: bool
    computed_tokens: int
    scheduled_tokens: int
    new_tokens: bytes = b""  # LE u32: tokens since the last update (a never-seen request: all of them)
    new_block_ids: tuple[int, ...] = ()  # new: the full block table; cached: appended blocks
    device_matched_tokens: int = 0  # L (new only)
    loaded_tokens: int = 0  # E (new only)
    cache_salt: str = ""
    lora_name: str = ""

    @property
    def num_new_tokens(self) -> int:
        return len(self.new_tokens) // 4


@dataclass(slots=True)
class StepColumns:
    """A step's slot updates as parallel columns (the wire's shape): row i of every list belongs to
    request_ids[i]; tokens (LE u32) and block ids are concatenated and cut by the counts."""

    request_ids: list[RequestId]
    is_new: list[bool]
    device_matched: list[int]
    loaded: list[int]
    computed: list[int]
    scheduled: list[int]
    num_new_tokens: list[int]
    tokens: bytes
    num_new_blocks: list[int]
    block_ids: list[int]
    cache_salt: list[str]
    lora_name: list[str]

    def __len__(self) -> int:
        return len(self.request_ids)

    def row(self, i: int, token_off: int, block_off: int) -> SlotUpdate:
        nt, nb = self.num_new_tokens[i], self.num_new_blocks[i]
        return SlotUpdate(
            self.request_ids[i],
            self.is_new[i],
            self.computed[i],
            self.scheduled[i],
            self.tokens[4 * token_off : 4 * (token_off + nt)],
            tuple(self.block_ids[block_off : block_off + nb]),
            self.device_matched[i],
            self.loaded[i],
            self.cache_salt[i] if self.cache_salt else "",
            self.lora_name[i] if self.lora_name else "",
        )

    @staticmethod
    def of(updates: list[SlotUpdate]) -> StepColumns:
        return StepColumns(
            [u.request_id for u in updates],
            [u.is_new for u in updates],
            [u.device_matched_tokens for u in updates],
            [u.loaded_tokens for u in updates],
            [u.computed_tokens for u in updates],
            [u.scheduled_tokens for u in updates],
            [u.num_new_tokens for u in updates],
            b"".join(u.new_tokens for u in updates),
            [len(u.new_block_ids) for u in updates],
            [b for u in updates for b in u.new_block_ids],
            [u.cache_salt for u in updates],
            [u.lora_name for u in updates],
        )


@dataclass(slots=True)
class Slot:
    request_id: RequestId
    seed: int  # hash seed: salt, namespace and model folded
    block_size: int
    phase: Phase = Phase.ACTIVE
    device_matched: int = 0  # L
    loaded: int = 0  # E
    computed: int = 0  # tokens the engine will have computed once the last applied step's forward ends
    block_table: list[int] = field(default_factory=list)
    states: list[BlockState] = field(default_factory=list)  # one per full block hashed so far
    scan_from: int = 0  # every block below is decided
    ops: set[OpId] = field(default_factory=set)  # in flight
    last_step: int = -1
    stored_blocks: int = 0
    tokens: bytearray = field(default_factory=bytearray)  # LE u32, every token the engine sent
    hashes: list[BlockHash] = field(default_factory=list)  # one per full block (the hash chain)
    next_full: int = 0  # token bytes at which the next block is full (0: set on first append)
    taint: int = -1  # first block whose load failed: from here the device KV is wrong until a rewind
    counted: int = 0  # tokens counted in its engine's slot_tokens (Depot.step brings it up to date)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) >> 2

    def append_tokens(self, data: bytes, known: Sequence[BlockHash] = (), known_over: bytes = b"") -> None:
        """Appends tokens; a block that becomes full gets its hash and a PENDING state. (The Step
        fast path inlines this: one bytearray append, then hash_full_blocks when one filled up.)

        `known` is a hash chain already computed over `known_over` with this slot's seed (a
        lookup's): to an empty slot whose tokens start with all of `known_over`, those hashes carry
        over instead of being computed again."""
        if known and not self.tokens and data.startswith(known_over):  # memcmp, no copy
            n = min(len(known), len(known_over) // (4 * self.block_size))
            self.hashes += known[:n]
            self.states += [BlockState.PENDING] * n
        self.tokens += data
        if len(self.tokens) >= self.next_full:
            self.hash_full_blocks()

    def hash_full_blocks(self) -> None:
        prev = self.hashes[-1] if self.hashes else None
        new = block_hashes(self.tokens, self.block_size, self.seed, start_block=len(self.hashes), prev=prev)
        self.hashes += new
        self.states += [BlockState.PENDING] * len(new)
        self.next_full = (len(self.hashes) + 1) * self.block_size * 4

    def truncate(self, num_tokens: int) -> None:
        """Undoes appends back to `num_tokens` (a rejected step)."""
        del self.tokens[num_tokens * 4 :]
        nhash = num_tokens // self.block_size
        del self.hashes[nhash:], self.states[nhash:]
        self.next_full = (nhash + 1) * self.block_size * 4

    def start_device_state(self, matched: int, loaded: int, block_table: list[int]) -> range:
        """A new (or resumed) request: sets L, E and the block table; returns the load targets.

        Tier facts (STORING, STORED) survive a restart: the blocks are still in the tier.
        """
        bs = self.block_size
        self.phase = Phase.ACTIVE
        self.device_matched, self.loaded = matched, loaded
        self.block_table = block_table
        self.computed = matched + loaded
        self.taint = -1
        first_load, end_load = matched // bs, (matched + loaded) // bs
        for i, st in enumerate(self.states):
            if st in (BlockState.STORING, BlockState.STORED):
                continue
            if i < first_load:
                self.states[i] = BlockState.DEVICE_HIT
            elif i < end_load:
                self.states[i] = BlockState.LOADING
            else:
                self.states[i] = BlockState.PENDING
        self.scan_from = first_load
        return range(first_load, end_load)

    def preempt(self) -> None:
        """Rule 7: the device state goes; what the tiers hold stays."""
        self.phase = Phase.PREEMPTED
        self.block_table = []
        self.computed = 0
        self.device_matched = self.loaded = 0

    def rewind(self, computed: int) -> None:
        """Rule 6: the engine's count went back (e.g. recompute after a failed load): blocks from
        there on are computed again, so what failed or was cancelled for them is undecided again."""
        first = computed // self.block_size
        for i in range(first, len(self.states)):
            if self.states[i] in (BlockState.LOAD_FAILED, BlockState.STORE_FAILED):
                self.states[i] = BlockState.PENDING
        self.scan_from = min(self.scan_from, first)
        if 0 <= self.taint and first <= self.taint:
            self.taint = -1

    def store_candidates(self, end_tokens: int) -> list[int]:
        """Rule 4: full blocks that the step's forward completes and that nobody decided yet."""
        end = min(end_tokens, self.num_tokens) // self.block_size
        end = min(end, len(self.block_table), len(self.states))
        if self.taint >= 0:  # computed over a failed load: never stored; the rewind rescans them
            end = min(end, self.taint)
        out = [i for i in range(self.scan_from, end) if self.states[i] is BlockState.PENDING]
        if end > self.scan_from:
            self.scan_from = end
        return out


def normalize(u: SlotUpdate, style: UpdateStyle) -> SlotUpdate:
    """The update in vLLM terms. TensorRT-LLM's computed_position of a new request whose load was
    synchronous excludes the loaded tokens (reference/engines.md A2.4); after an async load it
    includes them. Both come out as L+E."""
    if style is UpdateStyle.TRTLLM and u.is_new and u.loaded_tokens and u.computed_tokens == u.device_matched_tokens:
        return SlotUpdate(
            request_id=u.request_id,
            is_new=True,
            computed_tokens=u.device_matched_tokens + u.loaded_tokens,
            scheduled_tokens=u.scheduled_tokens,
            new_tokens=u.new_tokens,
            new_block_ids=u.new_block_ids,
            device_matched_tokens=u.device_matched_tokens,
            loaded_tokens=u.loaded_tokens,
            cache_salt=u.cache_salt,
            lora_name=u.lora_name,
        )
    return u


def repeated_block(table: Sequence[int], new: Sequence[int]) -> int | None:
    """A block id of `new` that `table` or `new` itself already holds, else None."""
    if len(new) == 1:
        return new[0] if new[0] in table else None
    seen = set(table)
    for b in new:
        if b in seen:
            return b
        seen.add(b)
    return None


def _check_whole_sequence(u: SlotUpdate, slot: Slot) -> None:
    """A new update of a request the daemon already holds tokens for (resumed after preemption,
    scheduled again after its async load) carries its whole token sequence, which must start with
    the tokens held: a request that changed its tokens is another request and needs its own id."""
    held, sent = slot.tokens, u.new_tokens
    if len(sent) < len(held):
        raise InvalidRequest(
            f"request {u.request_id}: a new update carries the request's whole token sequence; {len(sent) // 4} tokens "
            f"is fewer than the {len(held) // 4} already sent for it"
        )
    if sent[: len(held)] != held:
        at = next(i for i in range(0, len(held), 4) if sent[i : i + 4] != held[i : i + 4]) // 4
        raise InvalidRequest(
            f"request {u.request_id}: a new update carries the request's whole token sequence, and token {at} differs "
            f"from the one already sent for it (a request with other tokens needs an id of its own)"
        )


def check_update(u: SlotUpdate, slot: Slot | None, block_size: int, max_tokens: int) -> None:
    """Raises a DepotError naming what is wrong; never changes anything."""
    rid = u.request_id
    if not rid:
        raise InvalidRequest("request id must not be empty")
    if slot is not None and slot.phase is Phase.FINISHING:
        raise FailedPrecondition(f"request {rid} has finished and its ops are still running; ids are not reused")
    if len(u.new_tokens) % 4:
        raise InvalidRequest(f"request {rid}: token bytes must be a multiple of 4")
    if not u.is_new:
        if slot is None:
            raise NotFound(f"request {rid} is not known: send it with is_new first")
        if slot.phase is Phase.PREEMPTED:
            raise FailedPrecondition(f"request {rid} was preempted: resume it with is_new")
        if u.device_matched_tokens or u.loaded_tokens:
            raise InvalidRequest(f"request {rid}: device_matched_tokens and loaded_tokens are only for new updates")
    known = slot.num_tokens if slot is not None else 0
    total = known + u.num_new_tokens
    if u.is_new and known:
        _check_whole_sequence(u, slot)  # type: ignore[arg-type]
        total = u.num_new_tokens
    if total > max_tokens:
        raise InvalidRequest(f"request {rid}: {total} tokens is over the limit of {max_tokens}")
    if u.is_new and total == 0:
        raise InvalidRequest(f"request {rid}: a new request must carry its tokens")
    L, E, C, S = u.device_matched_tokens, u.loaded_tokens, u.computed_tokens, u.scheduled_tokens
    if E % block_size:
        raise InvalidRequest(f"request {rid}: loaded_tokens {E} is not a multiple of the block size {block_size}")
    if E and L % block_size:
        raise InvalidRequest(f"request {rid}: a load needs a block-aligned device_matched_tokens, got {L}")
    if L + E > total:
        raise InvalidRequest(f"request {rid}: device_matched_tokens {L} + loaded_tokens {E} exceed its {total} tokens")
    if C > total:
        raise InvalidRequest(f"request {rid}: computed_tokens {C} exceeds its {total} tokens")
    if C + S > total + MAX_SCHEDULED_AHEAD:
        raise InvalidRequest(
            f"request {rid}: computed_tokens {C} + scheduled_tokens {S} = {C + S} runs past its {total} tokens by more "
            f"than the {MAX_SCHEDULED_AHEAD} a step may schedule ahead of them (speculative drafts, async scheduling)"
        )
    if u.is_new and L > C:
        raise InvalidRequest(f"request {rid}: device_matched_tokens {L} exceeds computed_tokens {C}")
    ids = u.new_block_ids
    if ids:
        earlier = () if u.is_new or slot is None else slot.block_table
        if (dup := repeated_block(earlier, ids)) is not None:
            raise InvalidRequest(
                f"request {rid}: block id {dup} appears twice in its block table (each position needs a block of its own: "
                "two positions in one block would load or store one over the other)"
            )
    blocks = len(ids) + (0 if u.is_new or slot is None else len(slot.block_table))
    need = max(min(C + S, total), L + E)
    if blocks * block_size < need:
        raise InvalidRequest(
            f"request {rid}: block table of {blocks} blocks covers {blocks * block_size} tokens, "
            f"shorter than the {need} positions it computes"
        )
