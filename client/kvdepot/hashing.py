"""Block identity: the xxh3-64 hash chain shared by the client and the daemon.

Primitives:
    salt_hash(cache_salt, lora_name) -> seed   per-request salt, Dynamo-compatible ("{}" when none)
    scope_seed(seed, *scopes) -> seed          fold daemon-side scopes (namespace, model) into a seed
    block_hashes(tokens_u32le, block_size, seed, start=0, prev=None) -> list[BlockHash]

Chain (docs/design.md): h0 = xxh3(tokens_0, seed); hi = xxh3(le_u64(h(i-1)) || le_u64(xxh3(tokens_i, seed)), seed),
tokens as little-endian u32. Only full blocks have a hash.
"""

from __future__ import annotations

import array
import json
import struct
import sys
from collections.abc import Sequence
from typing import NewType, cast

import xxhash

BlockHash = NewType("BlockHash", int)

_xxh3 = xxhash.xxh3_64_intdigest
_pack_pair = struct.Struct("<QQ").pack
_pack_u64 = struct.Struct("<Q").pack
TOKEN_BYTES = 4
MAX_TOKEN = 2**32 - 1
_U32 = next(code for code in "IL" if array.array(code).itemsize == 4)


def salt_hash(cache_salt: str = "", lora_name: str = "") -> int:
    """The per-request seed: xxh3 of a JSON object of the salt inputs that are set (Dynamo's rule)."""
    obj: dict[str, str] = {}
    if cache_salt:
        obj["salt"] = cache_salt
    if lora_name:
        obj["lora_name"] = lora_name
    return _xxh3(json.dumps(obj, separators=(",", ":"), sort_keys=True).encode(), 0)


def scope_seed(seed: int, *scopes: str) -> int:
    """Folds scopes (tenant namespace, model identity) into a seed; empty scopes change nothing,
    so the default namespace stays compatible with plain Dynamo hashes."""
    for scope in scopes:
        if scope:
            seed = _xxh3(_pack_u64(seed) + scope.encode(), 0)
    return seed


def tokens_to_bytes(tokens: Sequence[int]) -> bytes:
    """Little-endian u32 bytes of a token sequence (raises ValueError on a token outside u32)."""
    if isinstance(tokens, array.array) and tokens.typecode == _U32:
        arr = tokens
    else:
        try:
            arr = array.array(_U32, tokens)  # a conversion in C, faster than struct.pack(*tokens)
        except (OverflowError, TypeError) as e:
            raise ValueError(f"tokens must be integers in [0, {MAX_TOKEN}]: {e}") from None
    if sys.byteorder != "little":
        arr = array.array(_U32, arr)
        arr.byteswap()
    return arr.tobytes()


def block_hashes(
    data: bytes | bytearray | memoryview,
    block_size: int,
    seed: int,
    *,
    start_block: int = 0,
    prev: int | None = None,
    limit: int | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks of `data` (LE u32 tokens) from `start_block` on.

    `prev` is the hash of block start_block-1 (None when start_block is 0). `limit` caps how many
    hashes are produced (a lookup stops hashing at its first miss).
    """
    step = block_size * TOKEN_BYTES
    first = start_block * step
    end = len(data) - len(data) % step
    if limit is not None:
        end = min(end, first + limit * step)
    # Two tight passes (per-block hashes, then the chain) run faster than one mixed loop, and
    # slicing the bytes beats slicing a memoryview for block-sized pieces.
    local = [_xxh3(data[off : off + step], seed) for off in range(first, end, step)]
    if not local:
        return []
    out: list[int] = []
    append = out.append
    if prev is None:
        prev = local[0]
        append(prev)
        local = local[1:]
    pack = _pack_pair
    for bh in local:
        prev = _xxh3(pack(prev, bh), seed)
        append(prev)
    return cast(list[BlockHash], out)  # NewType calls cost a function call per block
