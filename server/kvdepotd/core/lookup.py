"""Matching a prompt's blocks against the tiers of its layout class (Depot.lookup's walk).

    match(dom, tokens, block_size, seed, first, limit) -> (hashes, on_disk, chain)
        the blocks from `first` on that some tier holds, up to the first one none does, each pinned
        in the tier it is taken from (host first: block 2 on disk and block 3 in host memory is
        still a hit); on_disk says which tier per block; chain is every hash computed, from block 0
"""

from __future__ import annotations

from kvdepot.hashing import BlockHash, block_hashes
from kvdepotd.core.disk import Domain
from kvdepotd.core.registry import BlockStatus


def match(dom: Domain, tokens: bytes, bs: int, seed: int, first: int, limit: int) -> tuple[list[BlockHash], list[bool], list[BlockHash]]:
    """Resident blocks from `first` on, stopping at the first block no tier holds, pinned in
    the tier they are taken from (host first); hashes in growing chunks so a miss early in a
    long prompt costs little. Also returns every hash computed, from block 0 on (the chain)."""
    chain = block_hashes(tokens, bs, seed, limit=first) if first else []
    prev = chain[-1] if chain else None
    out: list[BlockHash] = []
    on_disk: list[bool] = []
    chunk = 32
    while len(out) < limit:
        hs = block_hashes(tokens, bs, seed, start_block=first + len(out), prev=prev, limit=min(chunk, limit - len(out)))
        if not hs:
            break
        chain += hs
        n = _match_tiers(dom, hs, on_disk)
        out += hs[:n]
        if n < len(hs):
            break
        prev = hs[-1]
        chunk *= 4
    return out, on_disk, chain


def _match_tiers(dom: Domain, hs: list[BlockHash], on_disk: list[bool]) -> int:
    """Pins the leading blocks of `hs` some tier holds; runs of host blocks go in one pass."""
    host, disk = dom.registry, dom.disk
    i = 0
    while i < len(hs):
        n = host.match_and_pin(hs[i:] if i else hs)
        on_disk += [False] * n
        i += n
        if disk is None:
            break
        start = i
        while i < len(hs):
            h = hs[i]
            e = disk.state_of(h)
            if e is None or e.status is not BlockStatus.RESIDENT or e.doomed or host.lookup([h]):
                break
            disk.pin(h)
            e.hits += 1
            on_disk.append(True)
            i += 1
        if i == start:
            break
    return i
