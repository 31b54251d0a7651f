"""Protobuf <-> core values. The service calls these and nothing else touches wire types."""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

from kvdepot.hashing import tokens_to_bytes
from kvdepot.layout import KvLayout
from kvdepot.messages import KINDS_PB, layout_pb
from kvdepot.v1 import kvdepot_pb2 as pb
from kvdepotd.core.records import Engine, StepPlan
from kvdepotd.core.errors import InvalidRequest
from kvdepotd.core.ops import Op, OpKind
from kvdepotd.core.slots import Slot, StepColumns, UpdateStyle
from kvdepotd.transfer.mapping import CudaStorage, RankSpec, ShmStorage, TensorSpec
from kvdepotd.transfer.cuda_import import CudaDriverStorage
from kvdepotd.transfer.engine_copy import CopyOrder

STYLE = {
    pb.UPDATE_STYLE_UNSPECIFIED: UpdateStyle.VLLM,
    pb.UPDATE_STYLE_VLLM: UpdateStyle.VLLM,
    pb.UPDATE_STYLE_TRTLLM: UpdateStyle.TRTLLM,
}
STYLE_PB = {UpdateStyle.VLLM: pb.UPDATE_STYLE_VLLM, UpdateStyle.TRTLLM: pb.UPDATE_STYLE_TRTLLM}
KIND_PB = {OpKind.LOAD: pb.OP_KIND_LOAD, OpKind.STORE: pb.OP_KIND_STORE}


LAYOUT_KIND = {v: k for k, v in KINDS_PB.items()}


def layout_from_pb(m: pb.KvLayout) -> KvLayout:
    kind = LAYOUT_KIND.get(m.kind)
    if kind is None:
        raise InvalidRequest(f"unknown layout kind {m.kind}")
    return KvLayout(m.num_layers, m.num_kv_heads, m.head_size, m.dtype, m.block_size, m.world_size, kind, m.kv_factor or 2)


def style_from_pb(value: int) -> UpdateStyle:
    try:
        return STYLE[value]  # type: ignore[index]
    except KeyError:
        raise InvalidRequest(f"unknown update_style {value}") from None


def _token_bytes(listed: Sequence[int], packed: bytes, name: str) -> bytes:
    """Tokens sent either as a repeated field or as little-endian u32 bytes (`name` + '_u32le')."""
    if listed and packed:
        raise InvalidRequest(f"set either {name} or {name}_u32le, not both")
    if packed:
        if len(packed) % 4:
            raise InvalidRequest(f"{name}_u32le has {len(packed)} bytes, not a multiple of 4")
        return packed
    return tokens_to_bytes(listed)


def lookup_tokens(req: pb.LookupRequest) -> bytes:
    return _token_bytes(req.tokens, req.tokens_u32le, "tokens")


def step_columns(req: pb.StepRequest) -> StepColumns:
    """The request's columns as the core takes them, after checking that they line up."""
    n = len(req.request_ids)
    for name in ("computed_tokens", "scheduled_tokens", "num_new_tokens", "num_new_block_ids"):
        got = len(getattr(req, name))
        if got != n:
            raise InvalidRequest(f"{name} has {got} entries for {n} request_ids (columns must line up)")
    for name in ("is_new", "device_matched_tokens", "loaded_tokens", "cache_salt", "lora_name"):
        got = len(getattr(req, name))
        if got not in (0, n):
            raise InvalidRequest(f"{name} has {got} entries for {n} request_ids (0 or one per request)")
    # A slice copies a upb container into a plain list in C, faster than list(); the core then
    # iterates plain lists, which beats indexing upb containers.
    ntok = req.num_new_tokens[:]
    nblk = req.num_new_block_ids[:]
    tokens = _token_bytes(req.new_tokens, req.new_tokens_u32le, "new_tokens")
    if sum(ntok) != len(tokens) // 4:
        raise InvalidRequest(f"num_new_tokens add up to {sum(ntok)} but new_tokens has {len(tokens) // 4}")
    if sum(nblk) != len(req.new_block_ids):
        raise InvalidRequest(f"num_new_block_ids add up to {sum(nblk)} but new_block_ids has {len(req.new_block_ids)}")
    return StepColumns(
        req.request_ids[:],
        req.is_new[:] or [False] * n,  # none sent: all false / all 0
        req.device_matched_tokens[:] or [0] * n,
        req.loaded_tokens[:] or [0] * n,
        req.computed_tokens[:],
        req.scheduled_tokens[:],
        ntok,
        tokens,
        nblk,
        req.new_block_ids[:],
        req.cache_salt[:],
        req.lora_name[:],
    )


def plan_to_pb(plan: StepPlan) -> pb.StepResponse:
    # Filled field by field, which is faster than building each pb.Op from keywords (this runs for
    # every op of every Step).
    resp = pb.StepResponse(step=plan.step, delay_free=plan.delay_free)
    add = resp.ops.add
    for op in plan.ops:
        o = add()
        o.op_id = op.op_id
        o.kind = KIND_PB[op.kind]
        o.request_id = op.request_id
        o.block_ids.extend(op.block_ids)
        o.block_indices.extend(op.block_indices)
        o.step = op.step
        o.deadline_unix_ms = op.deadline_ms
    return resp


def copy_order_pb(o: CopyOrder) -> pb.CopyOrder:
    return pb.CopyOrder(op_id=o.op_id, store=o.store, step=o.step, indices=o.indices, block_ids=o.block_ids, host_offsets=o.host_offsets)


def op_completed_pb(op: Op) -> pb.WorkerEvent.OpCompleted:
    return pb.WorkerEvent.OpCompleted(
        op_id=op.op_id,
        kind=KIND_PB[op.kind],
        request_id=op.request_id,
        success=op.success,
        failed_block_ids=op.failed_block_ids(),
        message=op.message,
    )


def slot_summary(slot: Slot) -> pb.SlotSummary:
    return pb.SlotSummary(
        request_id=slot.request_id,
        state=slot.phase.value,
        tokens=slot.num_tokens,
        computed_tokens=slot.computed,
        device_matched_tokens=slot.device_matched,
        loaded_tokens=slot.loaded,
        stored_blocks=slot.stored_blocks,
        ops_in_flight=len(slot.ops),
        last_step=max(slot.last_step, 0),
    )


def slot_blocks(slot: Slot) -> list[pb.BlockState]:
    table = slot.block_table
    return [
        pb.BlockState(
            index=i,
            hash=h,
            state=st.value,
            engine_block_id=table[i] if i < len(table) else 0,
            has_engine_block=i < len(table),
        )
        for i, (h, st) in enumerate(zip(slot.hashes, slot.states))
    ]


def oldest_ops(ops: Iterable[Op], now_ms: int, limit: int) -> list[pb.OpInFlight]:
    """The oldest ops in flight, for GetStats: what an operator looks at when ops pile up."""
    out = []
    for op in heapq.nsmallest(limit, ops, key=lambda o: (o.planned_ms, o.op_id)):
        state = "staging" if op.held else "waiting_forward" if not op.started else "copying"
        out.append(pb.OpInFlight(
            op_id=op.op_id, kind=KIND_PB[op.kind], engine_id=op.engine_id, request_id=op.request_id, blocks=len(op.block_ids),
            age_ms=max(0, now_ms - op.planned_ms), state=state,
        ))
    return out


def engine_info(eng: Engine, ranks: list[int]) -> pb.EngineInfo:
    return pb.EngineInfo(
        engine_id=eng.engine_id,
        engine_name=eng.name,
        model=eng.model,
        layout=layout_pb(eng.layout),
        namespace=eng.namespace,
        update_style=STYLE_PB[eng.style],
        slots=len(eng.slots),
        lease_expires_unix_ms=eng.lease_expires_ms,
        attached_ranks=ranks,
        last_step=max(eng.last_step, 0),
        mapped_ranks=sorted(eng.mapped),
    )


def rank_spec(req: pb.RegisterKvCachesRequest) -> RankSpec:
    """A worker's registration as the mapping takes it (its handles checked there)."""
    storages: list[ShmStorage | CudaStorage | CudaDriverStorage | None] = []
    for s in req.storages:
        which = s.WhichOneof("handle")
        if which == "cpu_shm":
            h = s.cpu_shm
            storages.append(ShmStorage(h.path, h.handoff_id, h.offset, h.size))
        elif which == "cuda_ipc":
            c = s.cuda_ipc
            storages.append(CudaStorage(c.device, c.handle, c.size, c.offset, c.ref_counter_handle, c.ref_counter_offset, c.event_handle, c.event_sync_required))
        elif which == "cuda_driver":
            d = s.cuda_driver
            chunks = tuple((k.offset, k.size, k.handoff_id) for k in d.chunks)
            storages.append(CudaDriverStorage(d.device, d.size, d.offset, d.ipc_handle, chunks, d.mapped_size))
        else:
            storages.append(None)
    tensors = [TensorSpec(t.name, t.storage, t.storage_offset, tuple(t.shape), tuple(t.stride), t.dtype) for t in req.tensors]
    return RankSpec(req.rank, req.num_blocks, storages, tensors)
