"""The row pass of a Step: the columns checked and, for the bulk of rows, applied in one pass.

Primitives:
    check_columns(cols, finished, preempted)   whole-message checks (lengths, sums, duplicates)
    RowPass(...).run(cols, step)               one pass over the rows: a running request's next
                                               decode token or prefill chunk is checked and applied
                                               inline with an undo record; any other row is checked
                                               (check_update) and collected in `slow` for the Depot
    RowPass.undo()                             rolls the applied rows back (a later row was bad)

A 256-request decode step must cost well under a millisecond, so the common row does no more than
a dict lookup, a few comparisons, a bytearray append and two attribute stores.
"""

from __future__ import annotations

from kvdepotd.core.errors import InvalidRequest
from kvdepotd.core.ops import RequestId
from kvdepotd.core.slots import MAX_ID_LEN, MAX_SCHEDULED_AHEAD, Phase, Slot, SlotUpdate, StepColumns, UpdateStyle, check_update, normalize, repeated_block


def check_columns(cols: StepColumns, finished: list[RequestId], preempted: list[RequestId]) -> None:
    n = len(cols)
    for name in ("is_new", "device_matched", "loaded", "computed", "scheduled", "num_new_tokens", "num_new_blocks"):
        if len(getattr(cols, name)) != n:
            raise InvalidRequest(f"{name} has {len(getattr(cols, name))} entries for {n} requests")
    if sum(cols.num_new_tokens) * 4 != len(cols.tokens) or sum(cols.num_new_blocks) != len(cols.block_ids):
        raise InvalidRequest("token or block counts do not add up to the tokens and block ids sent")
    ids = cols.request_ids
    unique = set(ids)
    if len(unique) != n:
        seen: set[str] = set()
        dup = next(r for r in ids if r in seen or seen.add(r))  # type: ignore[func-returns-value]
        raise InvalidRequest(f"request {dup} appears twice in one step")
    if (finished or preempted) and (both := unique & {*finished, *preempted}):
        raise InvalidRequest(f"request {sorted(both)[0]} is both updated and finished/preempted in one step")


class RowPass:
    def __init__(self, slots: dict[RequestId, Slot], block_size: int, style: UpdateStyle, max_tokens: int) -> None:
        self.slots = slots
        self.bs = block_size
        self.style = style
        self.max_tokens = max_tokens
        self.slow: list[SlotUpdate] = []  # rows for the general path, checked and normalized
        self.touched: list[Slot] = []  # fast rows whose forward may complete a block
        self._undo: list[tuple[Slot, int, int, int, int]] = []
        self.added = 0  # tokens the fast rows appended (counted in their slots' `counted` too)

    def run(self, cols: StepColumns, step: int) -> None:
        get, bs, max_tokens, active, style = self.slots.get, self.bs, self.max_tokens, Phase.ACTIVE, self.style
        tokens, block_ids = cols.tokens, cols.block_ids
        keep, mark, slow = self._undo.append, self.touched.append, self.slow.append
        t = b = 0  # offsets into the concatenated tokens (bytes) and block ids
        for i, (rid, new, L, E, C, S, nt, nb) in enumerate(
            zip(cols.request_ids, cols.is_new, cols.device_matched, cols.loaded, cols.computed, cols.scheduled, cols.num_new_tokens, cols.num_new_blocks)
        ):
            slot = get(rid)
            if new or slot is None or L or E or slot.phase is not active or C < slot.computed:
                if len(rid) > MAX_ID_LEN:
                    raise InvalidRequest(f"request id longer than {MAX_ID_LEN} characters")
                u = normalize(cols.row(i, t // 4, b), style)
                check_update(u, slot, bs, max_tokens)
                slow(u)
            else:
                toks, table = slot.tokens, slot.block_table
                ntok, ntable = len(toks), len(table)
                total = (ntok >> 2) + nt
                end = C + S
                if (
                    C > total
                    or end > total + MAX_SCHEDULED_AHEAD
                    or total > max_tokens
                    or (ntable + nb) * bs < (end if end < total else total)
                    or (nb and repeated_block(table, block_ids[b : b + nb]) is not None)
                ):
                    check_update(cols.row(i, t // 4, b), slot, bs, max_tokens)  # raises, saying what is wrong
                    raise AssertionError("fast-path check and check_update disagree")
                keep((slot, ntok, ntable, slot.computed, slot.last_step))
                if nt:
                    toks += tokens[t : t + 4 * nt]
                    slot.counted += nt
                    self.added += nt
                    if len(toks) >= slot.next_full:
                        slot.hash_full_blocks()
                if nb:
                    table += block_ids[b : b + nb]
                slot.computed = end
                slot.last_step = step
                if end >= (slot.scan_from + 1) * bs:  # a block may have completed
                    mark(slot)
            t += 4 * nt
            b += nb

    def undo(self) -> None:
        for slot, ntok, ntable, computed, last_step in reversed(self._undo):
            slot.truncate(ntok >> 2)
            slot.counted = ntok >> 2
            del slot.block_table[ntable:]
            slot.computed, slot.last_step = computed, last_step
        self._undo.clear()
