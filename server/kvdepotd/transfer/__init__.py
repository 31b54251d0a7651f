"""Copy engines: run op parts (one op on one rank) and report each part's result."""

from kvdepotd.transfer.base import CopyEngine, PartDone
from kvdepotd.transfer.host import Faults, HostCopyEngine

__all__ = ["CopyEngine", "Faults", "HostCopyEngine", "PartDone"]
