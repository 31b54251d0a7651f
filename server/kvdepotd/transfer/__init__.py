"""The copy engine: runs op parts (one op on one rank) and reports each part's result."""

from kvdepotd.transfer.base import CopyEngine, PartDone
from kvdepotd.transfer.bookkeeping import BookkeepingCopyEngine

__all__ = ["BookkeepingCopyEngine", "CopyEngine", "PartDone"]
