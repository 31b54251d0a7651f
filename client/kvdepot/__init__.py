"""kvdepot: the engine-side client of the kvdepotd KV-cache block manager."""

from kvdepot.hashing import BlockHash, ChainHasher, block_hashes, salt_hash
from kvdepot.layout import KvLayout

__all__ = ["BlockHash", "ChainHasher", "KvLayout", "block_hashes", "salt_hash"]
