"""Plain values the client hands to engines, and the builders of wire messages (shared by the
sync and asyncio clients, so both speak exactly the same protocol)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvdepot.hashing import tokens_to_bytes
from kvdepot.layout import KvLayout
from kvdepot.v1 import kvdepot_pb2 as pb

OpKindName = Literal["load", "store"]
_KIND = {pb.OP_KIND_LOAD: "load", pb.OP_KIND_STORE: "store"}
_TIER = {pb.TIER_HOST: "host", pb.TIER_DISK: "disk", pb.TIER_REMOTE: "remote"}
STYLES = {"vllm": pb.UPDATE_STYLE_VLLM, "trtllm": pb.UPDATE_STYLE_TRTLLM}
KINDS_PB = {
    "none": pb.KV_LAYOUT_KIND_UNSPECIFIED,
    "vllm_cpu": pb.KV_LAYOUT_KIND_VLLM_CPU,
    "vllm_flash": pb.KV_LAYOUT_KIND_VLLM_FLASH,
    "contiguous": pb.KV_LAYOUT_KIND_CONTIGUOUS,
    "trtllm": pb.KV_LAYOUT_KIND_TRTLLM,
}


@dataclass(frozen=True, slots=True)
class LookupResult:
    matched_tokens: int  # E: tokens beyond the engine's own hit the daemon can load
    by_tier: dict[str, int] = field(default_factory=dict)
    pin_deadline_ms: int = 0
    degraded: bool = False  # the daemon did not answer in time: this is a miss, not a verdict


MISS = LookupResult(0, degraded=True)


# OpInfo and OpCompleted come many to a step: plain slotted dataclasses, read-only by convention
# (a frozen dataclass costs a visible share of a large step's answer to build).
@dataclass(slots=True)
class OpInfo:
    op_id: int
    kind: OpKindName
    request_id: str
    block_ids: tuple[int, ...]
    block_indices: tuple[int, ...]
    step: int
    deadline_ms: int


@dataclass(frozen=True, slots=True)
class StepResult:
    step: int
    ops: tuple[OpInfo, ...] = ()
    delay_free: tuple[str, ...] = ()
    degraded: bool = False


@dataclass(slots=True)
class OpCompleted:
    op_id: int
    kind: OpKindName
    request_id: str
    success: bool
    failed_block_ids: tuple[int, ...]
    message: str


@dataclass(frozen=True, slots=True)
class RequestReleased:
    request_id: str


@dataclass(frozen=True, slots=True)
class LoadCopied:
    """A load's bytes are in this rank's blocks; its OpCompleted follows with the verdict. The
    stream reports it for engines registered with late_load_checks (the checksums are still being
    checked); the doorbell of a worker that handed its memory over reports it for every load (see
    WorkerLink), so one op may be reported twice. `intact`: (doorbell only) every block was copied
    and matched its checksum already, so even an engine that must not use unchecked bytes may go on."""

    op_id: int
    intact: bool = False


@dataclass(frozen=True, slots=True)
class LayersCopied:
    """(doorbell only) A load copied layer by layer has its first `layers` layers in every block
    of this rank, not yet checked: its LoadCopied and OpCompleted follow."""

    op_id: int
    layers: int


WorkerEvent = OpCompleted | RequestReleased | LoadCopied | LayersCopied


def cached_update_needed(block_size: int, blocks: int, sent_blocks: int, computed: int, scheduled: int, sent_end: int) -> bool:
    """Whether a running request's cached update matters to the daemon: blocks were appended, a
    block completes in this step's forward, or the engine's count went back (below what it last
    sent as computed + scheduled). Otherwise the step costs the engine no round trip (docs/design.md)
    and its tokens ride along with the next update."""
    end = computed + scheduled
    return blocks > sent_blocks or end // block_size > sent_end // block_size or computed < sent_end


class StepBatch:
    """One engine step's slot updates, built column by column (the wire format is columnar)."""

    def __init__(self) -> None:
        self.request_ids: list[str] = []
        self.is_new: list[bool] = []
        self.device_matched: list[int] = []
        self.loaded: list[int] = []
        self.computed: list[int] = []
        self.scheduled: list[int] = []
        self.num_new_tokens: list[int] = []
        self.new_tokens: list[int] = []
        self.num_new_blocks: list[int] = []
        self.new_block_ids: list[int] = []
        self.cache_salt: list[str] = []
        self.lora_name: list[str] = []
        self.finished: list[str] = []
        self.preempted: list[str] = []

    def new(
        self,
        request_id: str,
        tokens: Sequence[int],
        block_table: Sequence[int],
        *,
        computed: int,
        scheduled: int,
        device_matched: int = 0,
        loaded: int = 0,
        cache_salt: str = "",
        lora_name: str = "",
    ) -> None:
        """A request scheduled for the first time or resumed: `tokens` are those not sent before."""
        self._add(request_id, True, tokens, block_table, computed, scheduled, device_matched, loaded, cache_salt, lora_name)

    def cached(self, request_id: str, new_tokens: Sequence[int], new_block_ids: Sequence[int], *, computed: int, scheduled: int) -> None:
        self._add(request_id, False, new_tokens, new_block_ids, computed, scheduled, 0, 0, "", "")

    def _add(
        self, rid: str, new: bool, toks: Sequence[int], blocks: Sequence[int], C: int, S: int, L: int, E: int, salt: str, lora: str
    ) -> None:
        self.request_ids.append(rid)
        self.is_new.append(new)
        self.device_matched.append(L)
        self.loaded.append(E)
        self.computed.append(C)
        self.scheduled.append(S)
        self.num_new_tokens.append(len(toks))
        self.new_tokens += toks
        self.num_new_blocks.append(len(blocks))
        self.new_block_ids += blocks
        self.cache_salt.append(salt)
        self.lora_name.append(lora)

    def cached_columns(
        self,
        request_ids: Sequence[str],
        computed: Sequence[int],
        scheduled: Sequence[int],
        num_new_tokens: Sequence[int],
        new_tokens: Sequence[int],
        num_new_blocks: Sequence[int],
        new_block_ids: Sequence[int],
    ) -> None:
        """Many cached updates at once, column by column (as vLLM's CachedRequestData is laid out):
        no per-request Python work on the engine's path."""
        n = len(request_ids)
        if not (len(computed) == len(scheduled) == len(num_new_tokens) == len(num_new_blocks) == n):
            raise ValueError("cached_columns: every per-request column needs one entry per request id")
        self.request_ids += request_ids
        self.is_new += [False] * n
        self.device_matched += [0] * n
        self.loaded += [0] * n
        self.computed += computed
        self.scheduled += scheduled
        self.num_new_tokens += num_new_tokens
        self.new_tokens += new_tokens
        self.num_new_blocks += num_new_blocks
        self.new_block_ids += new_block_ids
        self.cache_salt += [""] * n
        self.lora_name += [""] * n

    def __len__(self) -> int:
        return len(self.request_ids)

    @property
    def empty(self) -> bool:
        return not self.request_ids and not self.finished and not self.preempted

    def to_pb(self, engine_id: str, step: int) -> pb.StepRequest:
        # All-false / all-zero columns and empty salts go as empty lists (the protocol's "none").
        salts = self.cache_salt if any(self.cache_salt) else []
        loras = self.lora_name if any(self.lora_name) else []
        new = any(self.is_new) or any(self.device_matched) or any(self.loaded)
        return pb.StepRequest(
            engine_id=engine_id,
            step=step,
            request_ids=self.request_ids,
            is_new=self.is_new if new else [],
            device_matched_tokens=self.device_matched if new else [],
            loaded_tokens=self.loaded if new else [],
            computed_tokens=self.computed,
            scheduled_tokens=self.scheduled,
            num_new_tokens=self.num_new_tokens,
            new_tokens_u32le=tokens_to_bytes(self.new_tokens),
            num_new_block_ids=self.num_new_blocks,
            new_block_ids=self.new_block_ids,
            cache_salt=salts,
            lora_name=loras,
            finished=self.finished,
            preempted=self.preempted,
        )


def layout_pb(layout: KvLayout) -> pb.KvLayout:
    return pb.KvLayout(
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_size=layout.head_size,
        dtype=layout.dtype,
        block_size=layout.block_size,
        world_size=layout.world_size,
        kind=KINDS_PB[layout.kind],
        kv_factor=layout.kv_factor if layout.kv_factor != 2 else 0,
    )


def register_pb(
    model: str, layout: KvLayout, name: str, namespace: str, style: str, lease_ms: int, key: str = "", late_load_checks: bool = False,
    join: bool = False,
    engine_copies: bool = False,
) -> pb.RegisterEngineRequest:
    if style not in STYLES:
        raise ValueError(f"update_style must be one of {sorted(STYLES)}, got {style!r}")
    return pb.RegisterEngineRequest(
        engine_name=name,
        model=model,
        layout=layout_pb(layout),
        namespace=namespace,
        update_style=STYLES[style],
        lease_ms=lease_ms,
        engine_key=key,
        late_load_checks=late_load_checks,
        join=join,
        engine_copies=engine_copies,
    )


def lookup_pb(engine_id: str, request_id: str, tokens: Sequence[int], L: int, salt: str, lora: str, pin_ms: int) -> pb.LookupRequest:
    return pb.LookupRequest(
        engine_id=engine_id,
        request_id=request_id,
        tokens_u32le=tokens_to_bytes(tokens),
        device_matched_tokens=L,
        cache_salt=salt,
        lora_name=lora,
        pin_ms=pin_ms,
    )


def lookup_result(r: pb.LookupResponse) -> LookupResult:
    return LookupResult(r.matched_tokens, {_TIER.get(t.tier, "unknown"): t.tokens for t in r.by_tier}, r.pin_deadline_unix_ms)


def step_result(r: pb.StepResponse) -> StepResult:
    ops = tuple(
        OpInfo(o.op_id, _KIND[o.kind], o.request_id, tuple(o.block_ids), tuple(o.block_indices), o.step, o.deadline_unix_ms)  # type: ignore[arg-type]
        for o in r.ops
    )
    return StepResult(r.step, ops, tuple(r.delay_free))


def worker_events(ev: pb.WorkerEvent) -> list[WorkerEvent]:
    """A batch from the stream: copies, then completions (an op that ended in the same batch was
    copied first), then releases (a release follows its request's last op)."""
    out: list[WorkerEvent] = [LoadCopied(op_id) for op_id in ev.copied]
    out += [
        OpCompleted(o.op_id, _KIND[o.kind], o.request_id, o.success, tuple(o.failed_block_ids), o.message)  # type: ignore[arg-type]
        for o in ev.completed
    ]
    out += [RequestReleased(r) for r in ev.released]
    return out


def clear_request(tier: str) -> pb.ClearRequest:
    """tier: "" (every tier), "host" or "disk"."""
    by_name = {"": pb.TIER_UNSPECIFIED, **{v: k for k, v in _TIER.items()}}
    if tier not in by_name:
        raise ValueError(f"tier must be host, disk or empty (all), not {tier!r}")
    return pb.ClearRequest(tier=by_name[tier])
