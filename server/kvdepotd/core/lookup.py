"""A lookup: the tokens beyond the engine's own prefix hit that the tiers hold, pinned for the
request (Depot.lookup checks the engine and passes the clock in).

    lookup(engine, request_id, tokens, ...) -> LookupResult
        checks the request, replaces the request's earlier pin, matches and pins the blocks after
        the engine's own L tokens (never the last prompt token: the engine needs its logits)
    extend(engine, request_id, pin, found, result) -> LookupResult
        the remote store holds the first `found` blocks of the lookup's remote_query
    match(dom, tokens, block_size, seed, first, limit) -> (hashes, on_disk, chain)
        the blocks from `first` on that some tier holds, up to the first one none does, each pinned
        in the tier it is taken from (host first: block 2 on disk and block 3 in host memory is
        still a hit); on_disk says which tier per block; chain is every hash computed, from block 0
"""

from __future__ import annotations

from collections import Counter

from kvdepot.hashing import BlockHash, block_hashes
from kvdepotd.core.disk import Domain
from kvdepotd.core.errors import InvalidRequest
from kvdepotd.core.ops import RequestId
from kvdepotd.core.records import DepotConfig, Engine, LookupPin, LookupResult
from kvdepotd.core.registry import BlockStatus
from kvdepotd.core.slots import MAX_ID_LEN


def lookup(
    eng: Engine,
    request_id: RequestId,
    tokens: bytes,
    cache_salt: str,
    lora_name: str,
    device_matched_tokens: int,
    pin_ms: int,
    now_ms: int,
    config: DepotConfig,
    counters: Counter[str],
    remote: bool = False,
    offer: bool = True,
    load_cap: int = -1,
) -> LookupResult:
    """`remote`: the remote store may be asked for the blocks after the local match (the answer's
    remote_query; the pin is kept even without a local hit, for Depot.extend_lookup). Without
    `offer` (a rank's memory is not mapped yet) the request is checked and counted, and missed.
    `load_cap` >= 0: the most blocks the engine's load copies can deliver in time (the runtime's
    load budget): none past it is offered, from any tier."""
    bs = eng.layout.block_size
    n = len(tokens) // 4
    L = device_matched_tokens
    if not request_id or len(request_id) > MAX_ID_LEN:
        raise InvalidRequest(f"request id must have 1 to {MAX_ID_LEN} characters")
    if n == 0:
        raise InvalidRequest(f"request {request_id}: no tokens: a lookup needs the prompt's token ids")
    if n > config.max_tokens:
        raise InvalidRequest(f"{n} tokens is over the limit of {config.max_tokens}")
    if L > n:
        raise InvalidRequest(f"device_matched_tokens {L} exceeds the prompt's {n} tokens")
    if pin_ms < 0 or pin_ms > config.max_pin_ms:
        raise InvalidRequest(f"pin_ms must be in [0, {config.max_pin_ms}], got {pin_ms}")
    counters["lookups"] += 1
    eng.release_pin(request_id)  # a repeated lookup replaces the earlier answer
    first = L // bs
    # The last prompt token is always recomputed (the engine needs its logits), so never offer it.
    offerable = max(0, (n - 1) // bs - first) if n else 0
    asked = offerable  # the hit rate's denominator counts what could have been found
    capped = 0 <= load_cap < offerable
    if capped:
        offerable = load_cap
    hit: list[BlockHash] = []
    on_disk: list[bool] = []
    chain: list[BlockHash] = []
    seed = eng.seed(cache_salt, lora_name)
    if not offer:
        counters["lookups_unmapped"] += 1
        remote = False
    elif L % bs == 0 and offerable:
        hit, on_disk, chain = match(eng.domain, tokens, bs, seed, first, offerable)
    if capped and len(hit) == offerable:  # the match ran into the cap (or the cap offered nothing)
        counters["lookups_over_load_budget"] += 1
    query: list[BlockHash] = []
    if remote and L % bs == 0 and len(hit) < offerable:
        start = first + len(hit)
        want = min(offerable - len(hit), config.remote.lookup_blocks)
        if len(chain) < start + want:
            chain += block_hashes(tokens, bs, seed, start_block=len(chain), prev=chain[-1] if chain else None, limit=start + want - len(chain))
        query = chain[start : start + want]
    deadline = now_ms + (pin_ms or config.pin_ms)
    if hit or query:
        eng.pins[request_id] = LookupPin(hit, deadline, on_disk, tokens, seed, chain)
        eng.pin_tokens += n
    matched = len(hit) * bs
    disk = sum(on_disk) * bs
    counters["lookup_asked_tokens"] += asked * bs if L % bs == 0 else 0  # the tokens the daemon could have served: hit rates' denominator
    counters["lookup_hit_tokens"] += matched
    counters["lookup_disk_hit_tokens"] += disk
    return LookupResult(matched, matched - disk, disk, deadline if hit else 0, n // bs, remote_query=tuple(query))


def extend(eng: Engine, request_id: RequestId, pin: LookupPin, found: int, res: LookupResult, counters: Counter[str]) -> LookupResult:
    """The remote store holds the first `found` blocks of `res.remote_query`: they extend the match
    (not pinned: the store may still evict them, and a load then recomputes them). A pin that was
    replaced or released meanwhile (a repeated lookup, an expiry) is left alone."""
    if eng.pins.get(request_id) is not pin:
        return LookupResult(res.matched_tokens, res.host_tokens, res.disk_tokens, res.pin_deadline_ms, res.total_blocks)
    if found:
        pin.hashes = pin.hashes + list(res.remote_query[:found])
    elif not pin.hashes:
        eng.release_pin(request_id)  # kept for this answer only
    bs = eng.layout.block_size
    remote = found * bs
    counters["lookup_hit_tokens"] += remote
    counters["lookup_remote_hit_tokens"] += remote
    deadline = pin.deadline_ms if pin.hashes else 0
    return LookupResult(res.matched_tokens + remote, res.host_tokens, res.disk_tokens, deadline, res.total_blocks, remote)



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
