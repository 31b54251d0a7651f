"""The core's plain records: its configuration, engines, lookups' pins and answers, step plans,
the events the workers must hear of, and the statistics the edges export. The Depot (depot.py) and
the planners (plan.py, disk.py) change them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvdepot.hashing import BlockHash, salt_hash, scope_seed
from kvdepot.layout import KvLayout
from kvdepotd.core.disk import DiskConfig, Domain
from kvdepotd.core.remote import RemoteConfig
from kvdepotd.core.ops import EngineId, Op, OpId, RequestId
from kvdepotd.core.slots import Slot, UpdateStyle

MAX_LEASE_MS = 3_600_000
# Every counter the core keeps (exported as kvdepot_<name>_total, at 0 until it first moves).
COUNTERS = (
    "engines_registered", "engines_unregistered", "leases_expired",
    "lookups", "lookup_asked_tokens", "lookup_hit_tokens", "pins_expired", "lookups_unmapped", "store_blocks_unmapped",
    "lookups_over_load_budget",
    "steps", "steps_repeated", "slots_created", "slots_released", "preemptions", "preempted_unknown",
    "store_blocks_planned", "store_blocks_already_cached", "store_blocks_tier_full", "store_blocks_over_share", "stored_blocks", "store_failed_blocks", "store_blocks_cancelled",
    "load_blocks_cancelled",
    "load_blocks_planned", "loaded_blocks", "load_failed_blocks", "checksum_failures",
    "ops_expired", "cleared_blocks", "evictions", "evicted_unhit_blocks",
    "lookup_disk_hit_tokens", "disk_admitted_blocks", "disk_rejected_blocks", "disk_written_blocks",
    "disk_write_failed_blocks", "disk_read_blocks", "disk_read_failed_blocks", "disk_checksum_failures",
    "disk_full", "disk_evictions", "disk_write_missed_blocks", "disk_blocks_over_share",
    "lookup_remote_hit_tokens", "remote_lookups", "remote_lookup_hits", "remote_queued_blocks", "remote_written_blocks", "remote_write_skipped_blocks",
    "remote_write_failed_blocks", "remote_read_blocks", "remote_read_failed_blocks", "remote_checksum_failures",
    "remote_dropped_store_down_blocks", "remote_dropped_queue_full_blocks", "remote_dropped_evicted_blocks", "remote_relearned_blocks", "remote_prefetched_blocks",
    "remote_forged_blocks",
)


@dataclass(frozen=True, slots=True)
class Caps:
    """The most request slots and lookup pins one engine, and all engines of one namespace, may
    hold at once, and the most prompt tokens a namespace's pins may keep (a pin keeps its prompt
    for the request's first Step: about 8 bytes a token with its hashes)."""

    slots_per_engine: int = 8192
    slots_per_namespace: int = 32768
    pins_per_engine: int = 8192
    pins_per_namespace: int = 32768
    pin_tokens_per_namespace: int = 64 << 20
    slot_tokens_per_namespace: int = 64 << 20  # the tokens a namespace's request slots keep (about 11 bytes each with hashes)


@dataclass(frozen=True, slots=True)
class DepotConfig:
    host_bytes: int
    slab_bytes: int = 64 << 20
    lease_ms: int = 30_000
    pin_ms: int = 30_000
    max_pin_ms: int = 600_000
    op_timeout_ms: int = 30_000
    max_tokens: int = 1 << 21
    step_cache: int = 16
    eviction_policy: str = "leaf-lru"
    disk_bytes: int = 0
    disk_slab_bytes: int = 256 << 20
    disk: DiskConfig = field(default_factory=DiskConfig)  # the disk planner's policy
    remote: RemoteConfig = field(default_factory=RemoteConfig)  # the remote tier's (off by default)
    # reclaim() keeps this many host cells of each layout class free: 1/64 of the pool, at most 256
    # (a few steps' worth of stores), so eviction leaves the Step path at the cost of that margin.
    free_reserve_fraction: float = 1 / 64
    free_reserve_max: int = 256
    namespace_host_share: float = 1.0  # < 1: most of a host pool one namespace may hold (BlockRegistry owner_share)
    namespace_disk_share: float = 1.0  # the same for each disk pool
    caps: Caps = field(default_factory=lambda: Caps())  # what one engine and one namespace may hold
    # Op ids must not repeat across daemon restarts: a worker that kept a completion of the old
    # daemon's op 7 would take the new daemon's op 7 as done. The daemon (server.py) starts them from the clock.
    first_op_id: int = 1


@dataclass(slots=True)
class LookupPin:
    hashes: list[BlockHash]
    deadline_ms: int
    on_disk: list[bool]  # per pinned hash: in the disk tier (else the host tier); hashes past its end are in the remote store (not pinned)
    # The hash chain the lookup computed from block 0 (over `tokens`, with `seed`): the request's
    # first Step reuses it when it carries the same tokens, instead of hashing the prompt again.
    tokens: bytes = b""
    seed: int = 0
    chain: list[BlockHash] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class LookupResult:
    matched_tokens: int
    host_tokens: int
    disk_tokens: int
    pin_deadline_ms: int
    total_blocks: int
    remote_tokens: int = 0
    # The hashes of the blocks after the local match that the remote store may hold, in order
    # (empty without a remote tier, or when the local tiers matched every block on offer): the
    # runtime asks the store and hands the answer to Depot.extend_lookup.
    remote_query: tuple[BlockHash, ...] = ()


@dataclass(slots=True)
class StepPlan:
    step: int
    ops: list[Op] = field(default_factory=list)
    delay_free: list[RequestId] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class OpCompleted:
    engine_id: EngineId
    op: Op


@dataclass(frozen=True, slots=True)
class RequestReleased:
    engine_id: EngineId
    request_id: RequestId


@dataclass(frozen=True, slots=True)
class LoadCopied:
    """A check_late load's bytes are in the engine's blocks on every rank (its OpCompleted follows)."""

    engine_id: EngineId
    op_id: OpId


Event = OpCompleted | RequestReleased | LoadCopied


@dataclass(frozen=True, slots=True)
class PoolStats:
    layout_class: str
    tier: str  # "host" or "disk"
    block_bytes: int  # of the layout class (a disk record adds its header and padding)
    capacity_blocks: int
    used_blocks: int
    pinned_blocks: int
    in_flight_blocks: int


@dataclass(frozen=True, slots=True)
class DepotStats:
    """What GetStats and the metrics export, read in one walk (Depot.stats)."""

    engines: int
    slots: int
    ops_in_flight: int
    pools: list[PoolStats]
    counters: dict[str, int]
    namespace_engines: dict[str, int]
    namespace_slots: dict[str, int]
    namespace_host_blocks: dict[str, int]  # host-tier blocks each namespace holds, all layout classes
    host_bytes: int
    disk_bytes: int
    disk_used_bytes: int
    remote_queue_blocks: int = 0  # admitted blocks waiting to be written to the remote store
    remote_jobs: int = 0  # store reads and writes running
    oldest_op_planned_ms: int = 0  # the clock of the Step that planned the oldest op in flight (0: none)

    def oldest_op_age_ms(self, now_ms: int) -> int:
        """How long the oldest op in flight has been, by the edge's clock (0: none)."""
        return max(0, now_ms - self.oldest_op_planned_ms) if self.oldest_op_planned_ms else 0


@dataclass(slots=True)
class Engine:
    engine_id: EngineId
    name: str
    model: str
    layout: KvLayout
    namespace: str
    style: UpdateStyle
    lease_ms: int
    lease_expires_ms: int
    domain: Domain
    key: str = ""
    late_load_checks: bool = False  # its loads report LoadCopied before their checksums are checked
    processes: int = 1  # registrations under its key (a scheduler and its workers) not yet unregistered
    slots: dict[RequestId, Slot] = field(default_factory=dict)
    pins: dict[RequestId, LookupPin] = field(default_factory=dict)
    pin_tokens: int = 0  # prompt tokens its pins keep
    slot_tokens: int = 0  # tokens its request slots keep (the sum of their `counted`)
    last_step: int = -1
    responses: OrderedDict[int, StepPlan] = field(default_factory=OrderedDict)
    # Ranks whose KV memory the daemon has mapped. Until every rank's is, the engine is offered no
    # hit and nothing of it is stored: a load would fail on the missing rank (with several ranks
    # TensorRT-LLM cannot be told, so its KV would be wrong) and a store would keep a partial block.
    mapped: set[int] = field(default_factory=set)
    registered_ms: int = 0
    engine_copies: bool = False  # its workers copy its blocks (to and from its private domain), not the daemon

    @property
    def moves_bytes(self) -> bool:
        return self.layout.kind != "none"

    @property
    def mapped_in_full(self) -> bool:
        """Every rank's memory is mapped (an engine that moves no bytes has none to map)."""
        return not self.moves_bytes or len(self.mapped) >= self.layout.world_size

    def seed(self, cache_salt: str, lora_name: str) -> int:
        return scope_seed(salt_hash(cache_salt, lora_name), self.namespace, self.model)

    def release_pin(self, rid: RequestId) -> None:
        """Unpins what the request's lookup pinned (no-op without a pin)."""
        pin = self.pins.pop(rid, None)
        if pin is not None:
            self.pin_tokens -= len(pin.tokens) >> 2
            dom = self.domain
            for h, d in zip(pin.hashes, pin.on_disk):
                (dom.disk if d else dom.registry).unpin(h)  # type: ignore[union-attr]
