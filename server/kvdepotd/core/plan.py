"""Turning a slot's load targets and store candidates into ops: rules 2 and 3 of the slot engine.

    OpPlanner.load(engine, slot, targets, step, now_ms) -> [Op]
        rule 2: load targets are in flight from the daemon until their op ends. Each op pins its
        blocks; a block only on disk, or only in the remote store, is staged into the host tier
        first (a READ job, the op held until it lands); a target no tier holds fails at once (the
        engine recomputes it)
    OpPlanner.store(engine, slot, candidates, step, now_ms) -> Op | None
        rule 3: a block is stored at most once per residency; a hash any tier holds, or one in
        flight, is skipped and never copied again
    OpPlanner.settle(op, domain, slot, current, ...)
        the second phase of an ended op: its blocks' tier state, pins and counters, and its
        slot's block states
The Depot adds the ops it gets to the op table and the step's plan, and settles the ops that end.
"""

from __future__ import annotations

from collections import Counter

from kvdepot.hashing import BlockHash
from kvdepotd.core.disk import DiskItem, DiskJobKind, DiskPlanner, Domain
from kvdepotd.core.ops import EngineId, Op, OpKind, OpTable, RequestId
from kvdepotd.core.pool import CellId
from kvdepotd.core.records import DepotConfig, Engine
from kvdepotd.core.remote import RemoteItem, RemotePlanner
from kvdepotd.core.registry import BlockStatus
from kvdepotd.core.slots import BlockState, Slot


class OpPlanner:
    def __init__(
        self, config: DepotConfig, ops: OpTable, disk: DiskPlanner, remote: RemotePlanner, counters: Counter[str], epochs: dict[tuple[EngineId, RequestId], int]
    ) -> None:
        self.config = config
        self.ops = ops
        self.disk = disk
        self.remote = remote
        self.counters = counters
        self.epochs = epochs  # the slots' device-state generations (Depot._bump_epoch)

    def load(self, eng: Engine, slot: Slot, targets: range, step: int, now_ms: int) -> list[Op]:
        """Rule 2: load targets are in flight from the daemon. The op takes its own pins (blocks
        the lookup pinned are still resident); a target no tier holds fails at once (recompute)."""
        dom = eng.domain
        reg, disk = dom.registry, dom.disk
        idx = list(targets)
        hashes = [slot.hashes[i] for i in idx]
        tier_cells: list[CellId | None] = []
        failed: set[int] = set()
        staged: dict[int, DiskItem] = {}  # position -> the read this load starts
        fetched: dict[int, RemoteItem] = {}  # position -> the store read this load starts
        waits: dict[int, BlockHash] = {}  # position -> a block staging for this load (its own read or another's)
        from_remote: set[int] = set()  # positions waiting on a store read
        remote = self.remote
        for pos, (i, h) in enumerate(zip(idx, hashes)):
            self.disk.sighting(dom, h)
            e = reg.state_of(h)
            if e is not None and e.status is BlockStatus.RESIDENT and not e.doomed:
                reg.pin(h)
                tier_cells.append(e.cell)
                self.disk.consider(dom, h)
                continue
            if e is not None and self.disk.is_staging(dom, h):  # another load is staging it: wait for the same read
                tier_cells.append(e.cell)
                waits[pos] = h
                continue
            if e is not None and remote.is_staging(dom, h):
                tier_cells.append(e.cell)
                waits[pos] = h
                from_remote.add(pos)
                continue
            parent = slot.hashes[i - 1] if i else None
            if e is None and (item := self.disk.stage(dom, h, parent, eng.namespace)) is not None:
                tier_cells.append(item.host_cell)  # staged through the host tier
                staged[pos] = item
                waits[pos] = h
                continue
            if e is None and (ritem := remote.stage(dom, h, parent, eng.namespace)) is not None:
                tier_cells.append(ritem.host_cell)
                fetched[pos] = ritem
                waits[pos] = h
                from_remote.add(pos)
                continue
            tier_cells.append(None)
            failed.add(i)
        eng.release_pin(slot.request_id)
        reg.touch(hashes)
        if disk is not None:
            disk.touch([it.hash for it in staged.values()])
        # With blocks to stage, the load is cut into ops of a read job's size: each starts copying into
        # the engine as soon as its own blocks arrived, while the next ones are still being read.
        n = max(1, self.config.disk.job_blocks // 2) if waits else len(idx)
        ops: list[Op] = []
        for k in range(0, len(idx), n):
            part = range(k, min(k + n, len(idx)))
            op = self._new_op(eng, slot, OpKind.LOAD, idx[k : k + n], hashes[k : k + n], tier_cells[k : k + n], step, now_ms)
            op.failed = {idx[p] for p in part if idx[p] in failed}
            if op.failed:
                op.message = "blocks not resident in any tier"
            if mine := [p for p in part if p in waits]:
                op.staging = {idx[p] for p in mine}
                op.from_disk = {idx[p] for p in mine if p not in from_remote}
                op.held = True
                for p in mine:
                    (remote if p in from_remote else self.disk).wait(dom, waits[p], op, p - k)
            if items := [staged[p] for p in part if p in staged]:
                self.disk.job(DiskJobKind.READ, dom, items)
            if ritems := [fetched[p] for p in part if p in fetched]:
                remote.read(dom, ritems)
            ops.append(op)
        self.counters["load_blocks_planned"] += len(idx)
        return ops

    def store(self, eng: Engine, slot: Slot, candidates: list[int], step: int, now_ms: int) -> Op | None:
        """Rule 3: check the registry before allocating; resident or in-flight hashes are skipped."""
        if not candidates:
            return None
        dom = eng.domain
        reg, disk = dom.registry, dom.disk
        idx: list[int] = []
        tier_cells: list[CellId | None] = []
        for i in candidates:
            h = slot.hashes[i]
            self.disk.sighting(dom, h)
            if reg.state_of(h) is not None or (disk is not None and disk.state_of(h) is not None):
                slot.states[i] = BlockState.ALREADY_CACHED
                reg.touch([h])
                if disk is not None:
                    disk.touch([h])
                self.disk.consider(dom, h)
                self.counters["store_blocks_already_cached"] += 1
                continue
            tcell = reg.prepare_store(h, slot.hashes[i - 1] if i else None, eng.namespace)
            if tcell is None:
                slot.states[i] = BlockState.NOT_STORED
                self.counters["store_blocks_over_share" if reg.at_share(eng.namespace) else "store_blocks_tier_full"] += 1
                continue
            slot.states[i] = BlockState.STORING
            idx.append(i)
            tier_cells.append(tcell)
        if not idx:
            return None
        self.counters["store_blocks_planned"] += len(idx)
        return self._new_op(eng, slot, OpKind.STORE, idx, [slot.hashes[i] for i in idx], tier_cells, step, now_ms)

    def _new_op(
        self,
        eng: Engine,
        slot: Slot,
        kind: OpKind,
        idx: list[int],
        hashes: list[BlockHash],
        tier_cells: list[CellId | None],
        step: int,
        now_ms: int,
    ) -> Op:
        return Op(
            op_id=self.ops.new_id(),
            kind=kind,
            engine_id=eng.engine_id,
            request_id=slot.request_id,
            block_indices=idx,
            block_ids=[slot.block_table[i] for i in idx],
            hashes=hashes,
            tier_cells=tier_cells,
            step=step,
            deadline_ms=now_ms + self.config.op_timeout_ms,
            planned_ms=now_ms,
            world_size=eng.layout.world_size,
            layout_class=eng.domain.layout_class,
            epoch=self.epochs.get((eng.engine_id, slot.request_id), 0),
            check_late=kind is OpKind.LOAD and eng.late_load_checks,
        )

    def settle(self, op: Op, dom: Domain, slot: Slot | None, current: bool, stored_by_live_engine: bool) -> None:
        """The second phase of an ended op, block by block: a store's blocks become RESIDENT or go,
        a load's pins are released and its corrupt blocks dropped; the slot's block states follow
        when `slot` is the request's (`current`: of the same device-state generation, for loads)."""
        reg = dom.registry
        for i, h, s in zip(op.block_indices, op.hashes, op.tier_cells):
            ok = i not in op.failed
            if op.kind is OpKind.STORE:
                reg.complete_store(h, ok)
                if ok:
                    self.counters["stored_blocks"] += 1
                elif op.cancelled:  # the engine was about to reuse the blocks: not a failure of the tier
                    self.counters["store_blocks_cancelled"] += 1
                else:
                    self.counters["store_failed_blocks"] += 1
                if ok and stored_by_live_engine:
                    self.disk.consider(dom, h, stored=True)
                if slot is not None and slot.states[i] is BlockState.STORING:
                    slot.states[i] = BlockState.STORED if ok else BlockState.STORE_FAILED
                    slot.stored_blocks += ok
            else:
                if s is not None and i not in op.staging:  # a block still staging is pinned once it arrives
                    reg.unpin(h)
                if i in op.corrupt:
                    reg.discard(h)
                    if i in op.from_disk:  # read from disk for this load a moment ago: the disk's copy is bad
                        if dom.disk is not None:
                            dom.disk.discard(h)
                            self.counters["disk_checksum_failures"] += 1
                    else:
                        self.counters["checksum_failures"] += 1
                if ok:
                    self.counters["loaded_blocks"] += 1
                elif op.cancelled:  # its request finished: not a failure of the tier
                    self.counters["load_blocks_cancelled"] += 1
                else:
                    self.counters["load_failed_blocks"] += 1
                if current and slot is not None and slot.states[i] is BlockState.LOADING:
                    slot.states[i] = BlockState.LOADED if ok else BlockState.LOAD_FAILED
