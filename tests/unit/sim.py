"""A tiny driver for the pure core: one engine, explicit steps, a copy engine that succeeds.

Each scenario reads as the engine would act: look up, update slots per step, report forwards.
"""

from __future__ import annotations

from kvdepot.hashing import tokens_to_bytes
from kvdepot.layout import KvLayout
from kvdepotd.core.depot import Depot, DepotConfig, Event, OpCompleted, RequestReleased, StepPlan
from kvdepotd.core.ops import EngineId, Op, OpKind, Part, RequestId
from kvdepotd.core.slots import BlockState, SlotUpdate, UpdateStyle

BS = 16


def layout(world_size: int = 1, block_size: int = BS) -> KvLayout:
    return KvLayout(num_layers=2, num_kv_heads=1, head_size=4, dtype="float16", block_size=block_size, world_size=world_size)


def prompt(n: int, start: int = 1) -> list[int]:
    return list(range(start, start + n))


class Sim:
    def __init__(
        self,
        style: UpdateStyle = UpdateStyle.VLLM,
        host_blocks: int = 64,
        world_size: int = 1,
        depot: Depot | None = None,
        name: str = "e0",
        late_load_checks: bool = False,
    ) -> None:
        lay = layout(world_size)
        self.style = style
        self.depot = depot or Depot(DepotConfig(host_bytes=host_blocks * lay.block_bytes, slab_bytes=4 * lay.block_bytes))
        self.now = 1_000
        self.engine = EngineId(name)
        self.depot.register_engine(
            self.engine, name=name, model="m", layout=lay, namespace="", style=style, lease_ms=60_000, now_ms=self.now,
            late_load_checks=late_load_checks,
        )
        self.world_size = world_size
        self.step_no = 0
        self.events: list[Event] = []

    # -- engine actions ---------------------------------------------------------------------------
    def lookup(self, rid: str, tokens: list[int], L: int = 0) -> int:
        res = self.depot.lookup(
            self.engine, RequestId(rid), tokens_to_bytes(tokens), cache_salt="", lora_name="",
            device_matched_tokens=L, pin_ms=0, now_ms=self.now,
        )
        return res.matched_tokens

    def new(self, rid: str, tokens: list[int], *, L: int = 0, E: int = 0, S: int, table: list[int], C: int | None = None) -> SlotUpdate:
        """A new request as the engine reports it. C defaults to the engine's own count:
        vLLM: num_computed_tokens = L + E; TensorRT-LLM after a sync load: computed_position = L."""
        if C is None:
            C = L + E if self.style is UpdateStyle.VLLM else L
        return SlotUpdate(RequestId(rid), True, C, S, tokens_to_bytes(tokens), tuple(table), L, E)

    def cached(self, rid: str, C: int, S: int, tokens: list[int] = (), blocks: list[int] = ()) -> SlotUpdate:  # type: ignore[assignment]
        return SlotUpdate(RequestId(rid), False, C, S, tokens_to_bytes(list(tokens)), tuple(blocks))

    def step(self, *updates: SlotUpdate, finished: list[str] = (), preempted: list[str] = ()) -> StepPlan:  # type: ignore[assignment]
        self.step_no += 1
        return self.depot.step(
            self.engine, self.step_no, list(updates),
            [RequestId(r) for r in finished], [RequestId(r) for r in preempted], self.now,
        )

    def forward_done(self, step: int | None = None, ranks: list[int] | None = None) -> None:
        """Workers report the forward of `step` (default: the last one) done; the copy engine runs."""
        for r in ranks if ranks is not None else range(self.world_size):
            self.depot.forward_done(self.engine, r, self.step_no if step is None else step)
        self.run_copies()

    def run_copies(self, fail: set[int] | None = None, corrupt: set[int] | None = None) -> list[Part]:
        """Ends every ready part; the block indices in `fail` fail, those in `corrupt` fail their checksum."""
        parts = self.depot.take_ready()
        for p in parts:
            bad = [i for i in p.indices if (fail and i in fail) or (corrupt and i in corrupt)]
            sums = [i for i in bad if corrupt and i in corrupt]
            self.depot.complete_part(p.op_id, p.rank, bad or None, "injected" if bad else "", sums or None)
        self.events += self.depot.take_events()
        self.depot.check_invariants()
        return parts

    def prefill_and_store(self, rid: str, tokens: list[int], L: int = 0) -> None:
        """Runs a request through one full prefill with a successful store, then finishes it."""
        nb = (len(tokens) + BS - 1) // BS
        self.step(self.new(rid, tokens, L=L, S=len(tokens) - L, table=list(range(100, 100 + nb))))
        self.forward_done()
        self.step(finished=[rid])
        self.run_copies()

    # -- observations ----------------------------------------------------------------------------
    def states(self, rid: str) -> list[BlockState]:
        return list(self.depot.slot(self.engine, RequestId(rid)).states)

    def resident(self, tokens: list[int]) -> int:
        """Leading blocks of `tokens` the host tier holds (asks without pinning)."""
        from kvdepot.hashing import block_hashes
        from kvdepot.hashing import salt_hash, scope_seed

        seed = scope_seed(salt_hash(), "", "m")
        hs = block_hashes(tokens_to_bytes(tokens), BS, seed)
        return self.depot.engines[self.engine].domain.registry.lookup(hs)

    def completed(self, kind: OpKind | None = None) -> list[Op]:
        return [e.op for e in self.events if isinstance(e, OpCompleted) and (kind is None or e.op.kind is kind)]

    def released(self) -> list[str]:
        return [e.request_id for e in self.events if isinstance(e, RequestReleased)]


def blocks_of(plan: StepPlan, kind: OpKind) -> list[int]:
    return [i for op in plan.ops if op.kind is kind for i in op.block_indices]


def engine_blocks_of(plan: StepPlan, kind: OpKind) -> list[int]:
    return [b for op in plan.ops if op.kind is kind for b in op.block_ids]
