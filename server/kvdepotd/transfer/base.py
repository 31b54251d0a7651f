"""Copy engine contract.

    submit(parts)   hands over op parts (core.ops.Part, plain data) that may start now; returns at once
    cancel(op_id)   the op ended (its deadline, its engine gone): its parts touch no more blocks
    on_done         the callback a result comes back through, on the event loop:
                    PartDone(op_id, rank, failed block indices, message, corrupt, copied)
    close()         finishes or fails what is running, within the drain grace

A part that cannot run reports its blocks as failed, never as success.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

from kvdepotd.core.ops import OpId, Part


@dataclass(frozen=True, slots=True)
class Copied:
    """What a part's copy moved and how long it took (for metrics)."""

    kind: str  # "load" or "store"
    nbytes: int  # bytes of the blocks that did not fail
    queued_s: float  # from submit until a copy thread took its first blocks
    copy_s: float  # from then until its last blocks were done (both passes of a late-checked load)


@dataclass(frozen=True, slots=True)
class PartDone:
    op_id: OpId
    rank: int
    failed: list[int]
    message: str = ""
    corrupt: list[int] = field(default_factory=list)  # failed because the tier's bytes failed their checksum
    copied: Copied | None = None  # None when the part ended without copying anything


class CopyEngine(ABC):
    def __init__(self, on_done: Callable[[list[PartDone]], None]) -> None:
        self.on_done = on_done

    @abstractmethod
    def submit(self, parts: list[Part]) -> None: ...

    def cancel(self, op_id: OpId) -> None:
        return None

    async def close(self) -> None:
        return None
